use super::models::*;
use super::*;

const GIB: u64 = 1 << 30;
const SEC: Nanos = 1_000_000_000;

fn name(pl: &Planner, c: &Choice) -> String {
    pl.gpus[c.gpu]
        .info
        .profiles
        .iter()
        .find(|p| p.id == c.profile)
        .unwrap()
        .name
        .clone()
}

/// Plans, assigns and completes (as the I/O layer would, with made-up
/// GPU instance ids from 100 up).
fn take(pl: &mut Planner, now: Nanos, id: RequestId, mem: u64, compute: Option<f64>) -> Assignment {
    let c = pl.plan(now, mem, compute).expect("a placement");
    let a = pl.assign(id, &c);
    let index = a.gpu;
    for s in &a.steps {
        if let Step::Destroy { gi } = s {
            pl.destroyed(index, *gi);
        }
    }
    if a.uuid.is_none() {
        let gi = 100 + id as u32;
        pl.created(id, index, gi, format!("MIG-{id}"));
        return Assignment {
            gi: Some(gi),
            uuid: Some(format!("MIG-{id}")),
            ..a
        };
    }
    a
}

#[test]
fn the_smallest_profile_that_fits_memory_and_compute() {
    let pl = Planner::new(vec![a100_40gb(0)]);
    let cases: [(u64, Option<f64>, &str); 9] = [
        (4 * GIB, None, "1g.5gb"),
        (4 * GIB, Some(14.0), "1g.5gb"),
        (4 * GIB, Some(100.0 / 7.0), "1g.5gb"),
        // One slice is 14.3%: 20% takes two.
        (4 * GIB, Some(20.0), "2g.10gb"),
        (6 * GIB, None, "1g.10gb"),
        (6 * GIB, Some(25.0), "2g.10gb"),
        (12 * GIB, None, "3g.20gb"),
        (12 * GIB, Some(50.0), "4g.20gb"),
        (25 * GIB, None, "7g.40gb"),
    ];
    for (mem, compute, want) in cases {
        let c = pl.plan(0, mem, compute).unwrap();
        assert_eq!(name(&pl, &c), want, "{mem} {compute:?}");
    }
    assert!(pl.plan(0, 40 * GIB, None).is_none());
    assert!(!pl.could_fit(40 * GIB, None));
    assert!(pl.could_fit(39 * GIB, Some(100.0)));
    let (gpu, p) = pl.largest().unwrap();
    assert_eq!((gpu, p.name.as_str()), (0, "7g.40gb"));
}

#[test]
fn reuse_then_free_placements_then_lazy_destruction() {
    let mut pl = Planner::new(vec![a100_40gb(0)]);
    // The first 1g goes where it blocks least: the end of the GPU.
    let a = take(&mut pl, 0, 1, 4 * GIB, None);
    assert_eq!(
        (a.placement, a.steps.len()),
        (Range { start: 6, size: 1 }, 1)
    );
    // Released, it is reused rather than a second one made.
    pl.release(SEC, 1);
    let b = take(&mut pl, 2 * SEC, 2, 3 * GIB, None);
    assert_eq!((b.gi, b.steps.clone()), (a.gi, vec![]));
    // A 3g.20gb fits beside it, at 0 (4:4 overlaps the 1g at 6).
    let c = take(&mut pl, 3 * SEC, 3, 12 * GIB, None);
    assert_eq!(c.placement, Range { start: 0, size: 4 });
    assert_eq!(c.steps.len(), 1);
    // Two more 1g instances, at 5 and 4 (each blocks three free
    // placements; the later start wins the tie), then everything is
    // released at different times.
    let d = take(&mut pl, 4 * SEC, 4, 4 * GIB, None);
    let e = take(&mut pl, 4 * SEC, 5, 4 * GIB, None);
    assert_eq!((d.placement.start, e.placement.start), (5, 4));
    pl.release(10 * SEC, 3);
    pl.release(11 * SEC, 4);
    pl.release(12 * SEC, 2);
    pl.release(13 * SEC, 5);
    let gi = |a: &Assignment| a.gi.unwrap();
    // A 7g.40gb needs the whole GPU: all four idle instances go.
    let f = pl.plan(20 * SEC, 30 * GIB, None).unwrap();
    let mut all = vec![gi(&b), gi(&c), gi(&d), gi(&e)];
    all.sort();
    assert_eq!(
        f.how,
        How::Create {
            placement: Range { start: 0, size: 8 },
            destroy: all
        }
    );
    // A 3g.20gb: the idle one is reused.
    let g = pl.plan(20 * SEC, 12 * GIB, None).unwrap();
    assert_eq!(g.how, How::Reuse { gi: gi(&c) });
    // A 2g.10gb (28% needs two slices): 0:2 and 2:2 need only the 3g
    // gone, 4:2 both 1g at 4 and 5; the fewest, then the lowest start.
    let h = pl.plan(20 * SEC, 8 * GIB, Some(28.0)).unwrap();
    assert_eq!(
        h.how,
        How::Create {
            placement: Range { start: 0, size: 2 },
            destroy: vec![gi(&c)]
        }
    );
}

#[test]
fn the_longest_idle_go_first_and_leases_are_never_destroyed() {
    let mut pl = Planner::new(vec![a100_40gb(0)]);
    // Seven 1g instances fill the GPU.
    let all: Vec<Assignment> = (1..=7)
        .map(|id| take(&mut pl, 0, id, 4 * GIB, None))
        .collect();
    assert!(pl.plan(0, 4 * GIB, None).is_none(), "full");
    // Idle at 0:1 since 5 s, 1:1 since 3 s; the rest in use.
    let at = |s: u32| all.iter().find(|a| a.placement.start == s).unwrap().clone();
    let (z, o) = (at(0), at(1));
    let id_of = |a: &Assignment| (a.uuid.as_ref().unwrap()[4..]).parse::<u64>().unwrap();
    pl.release(5 * SEC, id_of(&z));
    pl.release(3 * SEC, id_of(&o));
    // A 1g.10gb (two memory slices at 0, 2, 4 or 6): only 0:2 is
    // freeable, by destroying both idle ones.
    let c = pl.plan(9 * SEC, 6 * GIB, None).unwrap();
    assert_eq!(
        c.how,
        How::Create {
            placement: Range { start: 0, size: 2 },
            destroy: {
                let mut v = vec![z.gi.unwrap(), o.gi.unwrap()];
                v.sort();
                v
            }
        }
    );
    // A 1g.5gb reuses the most recently idle (3 s < 5 s: the one at 0).
    let r = pl.plan(9 * SEC, 4 * GIB, None).unwrap();
    assert_eq!(r.how, How::Reuse { gi: z.gi.unwrap() });
    // Nothing bigger can be had without touching leases.
    assert!(pl.plan(9 * SEC, 12 * GIB, None).is_none());
}

#[test]
fn foreign_instances_and_failed_placements_are_avoided() {
    let mut pl = Planner::new(vec![a100_40gb(0)]);
    // Found at start: a 3g.20gb at 4 with two compute instances
    // (foreign) and an idle 1g.5gb at 0.
    pl.sync(
        0,
        0,
        &[
            (
                1,
                9,
                Range { start: 4, size: 4 },
                vec!["MIG-a".into(), "MIG-b".into()],
            ),
            (2, 19, Range { start: 0, size: 1 }, vec!["MIG-c".into()]),
        ],
    );
    // Only 0:4 could hold a 3g; the idle 1g goes, the foreign stays.
    let c = pl.plan(SEC, 12 * GIB, None).unwrap();
    assert_eq!(
        c.how,
        How::Create {
            placement: Range { start: 0, size: 4 },
            destroy: vec![2]
        }
    );
    assert!(
        pl.plan(SEC, 25 * GIB, None).is_none(),
        "7g needs the foreign one's room"
    );
    // Creation at 0:4 fails: those slices are avoided for a while, by
    // every profile.
    let a = pl.assign(7, &c);
    pl.destroyed(0, 2);
    pl.failed(2 * SEC, 7, 0, a.placement);
    pl.sync(
        2 * SEC,
        0,
        &[(
            1,
            9,
            Range { start: 4, size: 4 },
            vec!["MIG-a".into(), "MIG-b".into()],
        )],
    );
    assert!(pl.avoiding(3 * SEC));
    assert!(pl.plan(3 * SEC, 12 * GIB, None).is_none());
    assert!(pl.plan(3 * SEC, 4 * GIB, None).is_none());
    assert!(!pl.avoiding(2 * SEC + BLOCK_FOR));
    let c = pl.plan(2 * SEC + BLOCK_FOR, 12 * GIB, None).unwrap();
    assert_eq!(name(&pl, &c), "3g.20gb");
    let st = pl.status();
    assert_eq!(st[0].failures, 1);
    assert_eq!(st[0].destroyed, 1);
}

#[test]
fn sync_keeps_leases_and_restore_finds_them() {
    let mut pl = Planner::new(vec![a100_80gb(3)]);
    let a = take(&mut pl, 0, 1, 12 * GIB, None);
    assert_eq!(a.profile_name, "1g.20gb");
    assert_eq!(a.gpu, 3);
    let found = [(
        a.gi.unwrap(),
        a.profile,
        a.placement,
        vec![a.uuid.clone().unwrap()],
    )];
    pl.sync(5 * SEC, 3, &found);
    assert_eq!(pl.status()[0].instances[0].use_, Use::Lease(1));
    assert_eq!(pl.committed(3), 19968 << 20);
    // A new broker knows nothing of leases until they are restored.
    let mut fresh = Planner::new(vec![a100_80gb(3)]);
    fresh.sync(0, 3, &found);
    assert_eq!(fresh.status()[0].instances[0].use_, Use::Idle { since: 0 });
    let r = fresh.restore(9, 3, a.uuid.as_deref().unwrap()).unwrap();
    assert_eq!((r.gi, r.mem), (a.gi, 19968 << 20));
    assert!(fresh.restore(9, 3, "MIG-nope").is_none());
    fresh.release(7 * SEC, 9);
    assert_eq!(
        fresh.status()[0].instances[0].use_,
        Use::Idle { since: 7 * SEC }
    );
}

#[test]
fn another_gpu_or_a_larger_profile_only_when_the_smallest_cannot_be_had() {
    let mut pl = Planner::new(vec![a100_40gb(0), h100_80gb(1)]);
    // 4 GiB: the A100's 1g.5gb is smaller than any H100 profile.
    let a = take(&mut pl, 0, 1, 4 * GIB, None);
    assert_eq!((a.gpu, a.profile_name.as_str()), (0, "1g.5gb"));
    // 30 GiB: only the A100's 7g.40gb is smaller than the H100's
    // 3g.40gb... but it is blocked by a lease, so the H100 it is.
    let b = take(&mut pl, 0, 2, 30 * GIB, None);
    assert_eq!((b.gpu, b.profile_name.as_str()), (1, "3g.40gb"));
    // 45 GiB: only the H100's 7g.80gb, blocked by the 3g.40gb lease.
    assert!(pl.plan(0, 45 * GIB, None).is_none());
    assert!(pl.could_fit(45 * GIB, None));
}

/// The figures in docs/mig.md: which profile requests get on an empty
/// GPU of each model, and what a decision costs on a busy node.
/// `cargo test --release -p gpufrac-broker mig::tests::figures -- --ignored --nocapture`
#[test]
#[ignore = "prints the figures for docs/mig.md; run it on purpose"]
fn figures() {
    let requests: [(u64, Option<f64>); 16] = [
        (1, None),
        (4, None),
        (4, Some(14.0)),
        (4, Some(20.0)),
        (6, None),
        (8, Some(30.0)),
        (10, None),
        (12, None),
        (12, Some(50.0)),
        (20, None),
        (25, None),
        (39, None),
        (40, None),
        (45, None),
        (79, None),
        (80, None),
    ];
    let models = [a100_40gb(0), a100_80gb(0), h100_80gb(0)];
    let mut table =
        String::from("| request | A100-40GB | A100-80GB | H100-80GB |\n|---|---|---|---|\n");
    for (g, c) in requests {
        let req = match c {
            Some(c) => format!("`--gpu-memory {g}G --gpu-compute {c}%`"),
            None => format!("`--gpu-memory {g}G`"),
        };
        let cells: Vec<String> = models
            .iter()
            .map(|m| {
                let pl = Planner::new(vec![m.clone()]);
                pl.plan(0, g * GIB, c)
                    .map_or("none (refused or a fraction elsewhere)".into(), |c| {
                        name(&pl, &c)
                    })
            })
            .collect();
        table.push_str(&format!("| {req} | {} |\n", cells.join(" | ")));
    }
    println!("{table}");
    let want = "\
| `--gpu-memory 1G` | 1g.5gb | 1g.10gb | 1g.10gb |
| `--gpu-memory 4G` | 1g.5gb | 1g.10gb | 1g.10gb |
| `--gpu-memory 4G --gpu-compute 14%` | 1g.5gb | 1g.10gb | 1g.10gb |
| `--gpu-memory 4G --gpu-compute 20%` | 2g.10gb | 2g.20gb | 2g.20gb |
| `--gpu-memory 6G` | 1g.10gb | 1g.10gb | 1g.10gb |
| `--gpu-memory 8G --gpu-compute 30%` | 3g.20gb | 3g.40gb | 3g.40gb |
| `--gpu-memory 10G` | 3g.20gb | 1g.20gb | 1g.20gb |
| `--gpu-memory 12G` | 3g.20gb | 1g.20gb | 1g.20gb |
| `--gpu-memory 12G --gpu-compute 50%` | 4g.20gb | 4g.40gb | 4g.40gb |
| `--gpu-memory 20G` | 7g.40gb | 3g.40gb | 3g.40gb |
| `--gpu-memory 25G` | 7g.40gb | 3g.40gb | 3g.40gb |
| `--gpu-memory 39G` | 7g.40gb | 3g.40gb | 3g.40gb |
| `--gpu-memory 40G` | none (refused or a fraction elsewhere) | 7g.80gb | 7g.80gb |
| `--gpu-memory 45G` | none (refused or a fraction elsewhere) | 7g.80gb | 7g.80gb |
| `--gpu-memory 79G` | none (refused or a fraction elsewhere) | 7g.80gb | 7g.80gb |
| `--gpu-memory 80G` | none (refused or a fraction elsewhere) | none (refused or a fraction elsewhere) | none (refused or a fraction elsewhere) |
";
    assert!(table.ends_with(want), "{table}");

    // A busy node: eight GPUs of the three models, each full of 1g
    // instances, four held by jobs and three idle (idle since
    // different times): every plan for more than a 1g searches for
    // instances to destroy on every GPU.
    let gpus: Vec<MigGpu> = (0..8)
        .map(|i| match i % 3 {
            0 => a100_40gb(i),
            1 => a100_80gb(i),
            _ => h100_80gb(i),
        })
        .collect();
    let mut pl = Planner::new(gpus);
    let mut id = 0;
    for g in 0..8u32 {
        for k in 0..7u32 {
            id += 1;
            let since = u64::from(k) * SEC;
            let use_ = if k < 4 {
                Use::Lease(id)
            } else {
                Use::Idle { since }
            };
            pl.gpus[g as usize].instances.push(Instance {
                gi: Some(k + 1),
                profile: 19,
                placement: Range { start: k, size: 1 },
                uuid: Some(format!("MIG-{g}-{k}")),
                use_,
            });
        }
    }
    let time = |mem: u64, compute: Option<f64>| {
        let n = 20_000u32;
        let t = std::time::Instant::now();
        let mut found = 0;
        for _ in 0..n {
            found += u32::from(std::hint::black_box(pl.plan(10 * SEC, mem, compute)).is_some());
        }
        (t.elapsed().as_nanos() as f64 / f64::from(n), found == n)
    };
    for (what, mem, c, want) in [
        ("reuse an idle 1g", 4 * GIB, None, true),
        (
            "destroy idle 1g instances for a 2g",
            8 * GIB,
            Some(25.0),
            true,
        ),
        (
            "none can be had: 50 GiB needs a whole 80 GB GPU",
            50 * GIB,
            None,
            false,
        ),
    ] {
        let (ns, placed) = time(mem, c);
        assert_eq!(placed, want, "{what}");
        println!(
            "| {what} | {:.1} µs | {} |",
            ns / 1000.0,
            if placed { "placed" } else { "waits" }
        );
    }
}

mod props {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Take(u64, Option<f64>),
        Release(usize),
        Fail(u64),
        Advance(Nanos),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => ((1..90u64), prop::option::of(1.0..100.0f64))
                .prop_map(|(g, c)| Op::Take(g * GIB / 2, c)),
            3 => any::<usize>().prop_map(Op::Release),
            1 => (1..90u64).prop_map(|g| Op::Fail(g * GIB / 2)),
            1 => (0..20 * SEC).prop_map(Op::Advance),
        ]
    }

    fn gpus() -> impl Strategy<Value = Vec<MigGpu>> {
        prop::collection::vec(0..3u8, 1..4).prop_map(|kinds| {
            kinds
                .iter()
                .enumerate()
                .map(|(i, k)| match k {
                    0 => a100_40gb(i as u32),
                    1 => a100_80gb(i as u32),
                    _ => h100_80gb(i as u32),
                })
                .collect()
        })
    }

    /// Instances never overlap, sit only where their profile may, and
    /// never add up to more than the GPU (slices, memory, counts).
    fn check(pl: &Planner, leases: &[RequestId]) {
        for g in &pl.gpus {
            let mut slices = 0;
            let mut mem = 0;
            for (k, i) in g.instances.iter().enumerate() {
                let p = g.info.profiles.iter().find(|p| p.id == i.profile).unwrap();
                assert!(
                    p.placements.contains(&i.placement),
                    "{i:?} not a placement of {}",
                    p.name
                );
                assert!(i.placement.end() <= 8);
                for j in &g.instances[k + 1..] {
                    assert!(!i.placement.overlaps(&j.placement), "{i:?} overlaps {j:?}");
                }
                slices += p.slices;
                mem += p.mem;
                let n = g
                    .instances
                    .iter()
                    .filter(|j| j.profile == i.profile)
                    .count() as u32;
                assert!(n <= p.max, "{n} instances of {}", p.name);
            }
            assert!(slices <= g.info.slices, "{slices} compute slices");
            assert!(mem <= g.info.total_mem, "{mem} bytes");
        }
        // Each lease holds exactly one instance; nothing else does.
        let held: Vec<RequestId> = pl
            .gpus
            .iter()
            .flat_map(|g| g.instances.iter())
            .filter_map(|i| match i.use_ {
                Use::Lease(id) => Some(id),
                _ => None,
            })
            .collect();
        let mut a = held.clone();
        a.sort_unstable();
        let mut b = leases.to_vec();
        b.sort_unstable();
        assert_eq!(a, b);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn instances_never_overlap_nor_exceed_the_gpu(gpus in gpus(), ops in prop::collection::vec(op(), 1..150)) {
            let mut pl = Planner::new(gpus);
            let mut now = 0;
            let mut next = 0;
            let mut leases: Vec<RequestId> = Vec::new();
            for op in ops {
                match op {
                    Op::Take(mem, compute) => {
                        next += 1;
                        if let Some(c) = pl.plan(now, mem, compute) {
                            let g = &pl.gpus[c.gpu];
                            let p = g.info.profiles.iter().find(|p| p.id == c.profile).unwrap();
                            prop_assert!(p.mem >= mem);
                            // Only idle instances are destroyed.
                            if let How::Create { destroy, .. } = &c.how {
                                for gi in destroy {
                                    let i = g.instances.iter().find(|i| i.gi == Some(*gi)).unwrap();
                                    let idle = matches!(i.use_, Use::Idle { .. });
                                    prop_assert!(idle, "destroying {:?}", i);
                                }
                            }
                            take(&mut pl, now, next, mem, compute);
                            leases.push(next);
                        } else {
                            let empty = pl.gpus.iter().all(|g| g.instances.is_empty());
                            prop_assert!(
                                !pl.could_fit(mem, compute) || !empty || pl.avoiding(now),
                                "an empty node refused what fits"
                            );
                        }
                    }
                    Op::Fail(mem) => {
                        next += 1;
                        if let Some(c) = pl.plan(now, mem, None) {
                            let a = pl.assign(next, &c);
                            for s in &a.steps {
                                if let Step::Destroy { gi } = s {
                                    pl.destroyed(a.gpu, *gi);
                                }
                            }
                            if a.uuid.is_none() {
                                pl.failed(now, next, a.gpu, a.placement);
                            } else {
                                leases.push(next);
                            }
                        }
                    }
                    Op::Release(k) if !leases.is_empty() => {
                        let id = leases.remove(k % leases.len());
                        pl.release(now, id);
                    }
                    Op::Advance(dt) => now += dt,
                    _ => {}
                }
                check(&pl, &leases);
            }
        }
    }
}
