//! Fractions backfill only where they delay no earlier whole-GPU request,
//! whatever their size: properties in virtual time.

use super::*;
use proptest::prelude::*;

const MIB: u64 = 1 << 20;
/// The longest a fraction of the stream runs.
const D: Nanos = 10 * SEC;

/// A little less than a GPU's memory: nothing, a byte, a page, a MiB,
/// or anything under 64 MiB.
fn less() -> impl Strategy<Value = u64> {
    prop_oneof![Just(0), Just(1), Just(4096), Just(MIB), 0..64 * MIB]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Every GPU is held whole by a blocker; a victim asks for `n` whole
    /// GPUs; then, from another user, requests for each GPU's memory less
    /// a little. The blockers end one by one, in any order: as soon as
    /// `n` GPUs are free of blockers the victim has them, and until then
    /// its place is first. (Before, a request for a GPU's memory less
    /// 1 MiB was ordered as a fraction ahead of every whole-GPU request
    /// and took the GPU when it freed.)
    #[test]
    fn a_gpus_memory_less_a_little_never_takes_what_an_earlier_whole_request_waits_for(
        totals in prop::collection::vec(prop_oneof![Just(16 * GIB), Just(24 * GIB + 3), Just(80 * GIB)], 1..5),
        f in 1..3u32,
        n in 1..5u32,
        attackers in prop::collection::vec((any::<prop::sample::Index>(), less(), 1..SEC), 1..8),
        ends in any::<u64>(),
    ) {
        let g = totals.len();
        let n = n.min(g as u32);
        let cfg = QueueConfig { overprovision: f, ..QueueConfig::default() };
        let mut q = Queue::new(gpus(&totals), cfg);
        let mut now = 0;
        let mut blockers = Vec::new();
        for id in 1..=(g as u64 * u64::from(f)) {
            q.submit(now, id, by(1000, whole(1))).unwrap();
            blockers.push(id);
        }
        prop_assert_eq!(q.poll(now).len(), blockers.len());
        now += SEC;
        let victim = 100;
        q.submit(now, victim, by(5001, whole(n))).unwrap();
        prop_assert!(q.poll(now).is_empty());
        for (k, (gpu, less, dt)) in attackers.iter().enumerate() {
            now += dt;
            let total = totals[gpu.index(g)];
            q.submit(now, 200 + k as u64, by(65534, req(Want::Memory(total - less)))).unwrap();
            prop_assert!(q.poll(now).is_empty(), "every GPU is held");
            prop_assert_eq!(q.position(now, victim), Some(1));
        }
        // The blockers end in an order drawn from `ends`.
        let mut order = blockers.clone();
        let mut x = ends;
        for i in (1..order.len()).rev() {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            order.swap(i, (x >> 33) as usize % (i + 1));
        }
        let mut placed_victim = false;
        for b in order {
            now += SEC;
            q.release(now, b);
            for l in q.poll(now) {
                if l.id == victim {
                    placed_victim = true;
                } else {
                    prop_assert!(placed_victim, "attacker {} placed before the victim", l.id);
                }
            }
            let free = q.gpus.iter().filter(|g| g.leases.is_empty()).count();
            prop_assert!(
                placed_victim || free < n as usize,
                "{free} GPUs free and the victim's --gpus {n} still waits"
            );
            if !placed_victim {
                prop_assert_eq!(q.position(now, victim), Some(1));
            }
        }
        prop_assert!(placed_victim);
    }

    /// A fair stream of fractions (each ends within `D`, a new one every
    /// half second to second and a half, each 256 MiB to 1 GiB: enough to
    /// keep a GPU busy all the time, never so much that one waits) cannot starve a request
    /// for every GPU: once it waits, no fraction arriving after it starts
    /// on a GPU it waits for, so it has them within `D`, far before the
    /// hour after which it would escalate; meanwhile it is first in line.
    /// (Before, the fractions went first and it waited the hour.)
    #[test]
    fn a_fair_stream_of_fractions_cannot_starve_a_whole_gpu_request(
        g in 2..5usize,
        stream in prop::collection::vec((SEC / 2..3 * SEC / 2, 4 * SEC..D, 256..1024u64), 60..120),
        asks_at in 10..20usize,
    ) {
        let mut q = Queue::new(gpus(&vec![16 * GIB; g]), QueueConfig::default());
        let mut now = 0;
        // (ends at, id) of the fractions running.
        let mut running: Vec<(Nanos, RequestId)> = Vec::new();
        let mut lasts: BTreeMap<RequestId, Nanos> = BTreeMap::new();
        let victim = 1_000_000;
        let mut asked: Option<Nanos> = None;
        let mut got: Option<Nanos> = None;
        for (k, &(gap, last, mib)) in stream.iter().enumerate() {
            // Time passes in steps of a tenth of a second, leases ending.
            let until = now + gap;
            while now < until {
                now = (now + SEC / 10).min(until);
                if step(&mut q, now, &mut running, &lasts, victim) {
                    got = Some(now);
                }
            }
            if k == asks_at {
                q.submit(now, victim, by(5001, whole(g as u32))).unwrap();
                asked = Some(now);
                if step(&mut q, now, &mut running, &lasts, victim) {
                    got = Some(now);
                }
            }
            let id = k as u64 + 1;
            lasts.insert(id, last);
            q.submit(now, id, by(65534, req(Want::Memory(mib * MIB)))).unwrap();
            if step(&mut q, now, &mut running, &lasts, victim) {
                got = Some(now);
            }
            if asked.is_some() && got.is_none() {
                prop_assert_eq!(q.position(now, victim), Some(1));
            }
        }
        // The stream ends; time runs on until the victim has its GPUs.
        let asked = asked.unwrap();
        while got.is_none() && now < asked + 2 * 3600 * SEC {
            now += SEC / 10;
            if step(&mut q, now, &mut running, &lasts, victim) {
                got = Some(now);
            }
        }
        let waited = got.unwrap() - asked;
        prop_assert!(waited <= D, "the --gpus {g} waited {} s", waited / SEC);
    }
}

/// Ends the fractions due by `now`, then polls: whether the victim was
/// placed. Fractions placed start running for their `lasts`.
fn step(
    q: &mut Queue,
    now: Nanos,
    running: &mut Vec<(Nanos, RequestId)>,
    lasts: &BTreeMap<RequestId, Nanos>,
    victim: RequestId,
) -> bool {
    running.retain(|&(end, id)| {
        if end <= now {
            q.release(now, id);
        }
        end > now
    });
    let mut victim_placed = false;
    for l in q.poll(now) {
        if l.id == victim {
            victim_placed = true;
        } else {
            running.push((now + lasts[&l.id], l.id));
        }
    }
    victim_placed
}
