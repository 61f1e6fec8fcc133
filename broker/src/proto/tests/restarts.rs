//! State on disk and restarts: a lease is told only once it is durable,
//! a suspect state file books nothing twice, restored jobs are resumed
//! only by their own run, and a recovery accepts only claims it can
//! verify (SPEC §2, invariant 5).

use proptest::prelude::*;

const NOBODY: u32 = 65534;

use super::*;

/// A lease is told to its run only once the state that books it is on
/// disk: a crash never forgets a lease a job already holds.
#[test]
fn a_lease_is_told_only_once_durable() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let p = t.spawn(1);
    let c = t.connect_as(p, ALICE);
    t.lease(c, 1, 0, false);
    assert!(leased(&t.recv(c)).is_none());
    let (seq, bytes) = t.b.take_state(t.now).expect("a write");
    let jobs = crate::jobs::decode(&bytes).unwrap().0;
    assert!(matches!(jobs[0].phase, Phase::Running { .. }));
    assert!(leased(&t.recv(c)).is_none(), "not before it is written");
    t.b.state_saved(t.now, seq, Ok(()));
    assert!(leased(&t.recv(c)).is_some());
}

/// The attack: a truncated state file was set aside and the broker went on
/// as if nothing ran, booking 10 GiB onto a GPU holding 16. Now placements
/// are held while running jobs claim their leases back.
#[test]
fn after_a_suspect_state_file_nothing_is_booked_twice() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let run = t.spawn(1);
    // The job the state file lost: it holds GPU 0 whole.
    t.b.restore(
        t.now,
        Loaded {
            jobs: Vec::new(),
            problem: Some("truncated".into()),
            suspect: true,
        },
    );
    assert!(t.status().recovery.is_some());
    // A newcomer cannot be placed now...
    let p = t.spawn(1);
    let n = t.connect_as(p, BOB);
    t.lease(n, 0, 10 * GIB, true);
    let why = refused(&t.recv(n)).expect("refused");
    assert!(why.contains("recovering"), "{why}");
    let p = t.spawn(1);
    let q = t.connect_as(p, BOB);
    t.lease(q, 0, 10 * GIB, false);
    t.advance(SEC);
    assert!(leased(&t.recv(q)).is_none(), "held while recovering");
    // A claim nothing can verify, from a user, books nothing...
    let r = t.connect_as(run, ALICE);
    t.send(r, &claim(0xabc, &[1]).into());
    t.turn();
    let why = refused(&t.recv(r)).expect("an unverifiable claim is refused");
    assert!(why.contains("trusted state has no such lease"), "{why}");
    // ...while root's running job (or the device plugin's) claims its GPU
    // back.
    let r = t.connect_as(run, 0);
    t.send(r, &claim(0xabc, &[1]).into());
    t.turn();
    assert_eq!(leased(&t.recv(r)), Some(0xabc));
    // After the grace the queue moves again, around what was claimed.
    t.advance(Config::default().recovery_grace);
    assert!(t.status().recovery.is_none());
    assert!(leased(&t.recv(q)).is_none(), "GPU 0 is the claimed job's");
    assert_eq!(t.status().gpus[0].committed_mem, 16 * GIB);
    // Outside a recovery, a claim for a lease the broker never had is
    // refused.
    let p = t.spawn(1);
    let x = t.connect_as(p, BOB);
    t.send(
        x,
        &LeaseReq {
            resume: 0xdef,
            pin: vec![Pin {
                uuid: uuid(1),
                mem: 16 * GIB,
            }],
            ..lease(1, 0, false)
        }
        .into(),
    );
    assert!(refused(&t.recv(x)).is_some());
}

/// A clean stop (a restart, an upgrade) keeps for the next broker the
/// jobs whose run is alive, their leases and places in the queue, so that
/// it books them as after a crash; a job whose run died is left out, and
/// with no run alive nothing is kept (the file and its directory go).
#[test]
fn a_clean_stop_keeps_the_jobs_whose_run_is_alive() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    assert!(t.b.stop_state().is_none(), "nothing ran");
    let a = t.spawn(1);
    let ca = t.connect_as(a, ALICE);
    t.lease(ca, 1, 0, false);
    t.turn();
    assert!(leased(&t.recv(ca)).is_some());
    let q = t.spawn(1);
    let cq = t.connect_as(q, BOB);
    t.lease(cq, 1, 0, false);
    t.turn();
    assert!(leased(&t.recv(cq)).is_none(), "queued behind the first");
    let k = t.b.stop_state().expect("jobs run");
    assert_eq!((k.leases, k.queued, k.unplaced), (1, 1, 0));
    // The queued run dies before the broker has seen its connection close.
    t.procs.borrow_mut().remove(&q);
    let k = t.b.stop_state().expect("a job runs");
    assert_eq!((k.leases, k.queued), (1, 0));
    let jobs = crate::jobs::decode(&k.bytes).unwrap().0;
    assert_eq!(jobs.iter().map(|j| j.pid).collect::<Vec<_>>(), vec![a]);
    assert!(matches!(jobs[0].phase, Phase::Running { .. }));
    t.procs.borrow_mut().remove(&a);
    assert!(t.b.stop_state().is_none(), "no run is alive");
}

#[test]
fn restored_jobs_are_resumed_only_by_their_own_run() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let run = t.spawn(1);
    let start = t.procs.borrow()[&run].1;
    let job = Job {
        pid: run,
        ident: start,
        uid: ALICE,
        ..crate::jobs::sample(77)
    };

    t.b.restore(
        t.now,
        Loaded {
            jobs: vec![job],
            problem: None,
            suspect: false,
        },
    );
    let resume = LeaseReq {
        resume: 77,
        ..lease(1, 0, false)
    }
    .into();
    let other = t.spawn(1);
    let o = t.connect_as(other, ALICE);
    t.send(o, &resume);
    assert!(refused(&t.recv(o)).is_some());
    let r = t.connect_as(run, ALICE);
    t.send(r, &resume);
    assert_eq!(leased(&t.recv(r)), Some(77));
}

/// A resume naming `token` and claiming these GPUs (by number from 1, as
/// `uuid` makes them) whole.
fn claim(token: u64, gpus: &[u8]) -> LeaseReq {
    LeaseReq {
        resume: token,
        pin: gpus
            .iter()
            .map(|&g| Pin {
                uuid: uuid(g),
                mem: 16 * GIB,
            })
            .collect(),
        ..lease(gpus.len() as u32, 0, false)
    }
}

/// A broker of two 16 GiB GPUs restarted on a suspect state file whose
/// last good copy has alice's job 77 on GPU 0; returns its run's pid.
fn recovering() -> (T, u32) {
    let mut t = T::new(cfg(), &[16 * GIB, 16 * GIB]);
    let run = t.spawn(1);
    let start = t.procs.borrow()[&run].1;
    let job = Job {
        pid: run,
        ident: start,
        uid: ALICE,
        ..crate::jobs::sample(77)
    };
    t.b.restore(
        t.now,
        Loaded {
            jobs: vec![job],
            problem: Some("planted".into()),
            suspect: true,
        },
    );
    assert!(t.status().recovery.is_some());
    (t, run)
}

/// The attack: a planted state file and a restart put the broker in
/// recovery, and during the grace uid 65534 claimed GPUs 0 and 1 whole
/// with resume + pin under a made-up token, and kept them; the victim's
/// 1 GiB request then timed out.
#[test]
fn a_made_up_claim_during_recovery_books_nothing() {
    let (mut t, _) = recovering();
    let p = t.spawn(1);
    let x = t.connect_as(p, NOBODY);
    t.send(x, &claim(0x5eed, &[1, 2]).into());
    t.turn();
    let why = refused(&t.recv(x)).expect("refused");
    assert!(
        why.contains("uid 65534") && why.contains("root or the broker's --plugin-user"),
        "{why}"
    );
    assert_eq!(t.status().gpus[1].committed_mem, 0);
    t.advance(Config::default().recovery_grace);
    let p = t.spawn(1);
    let v = t.connect_as(p, BOB);
    t.lease(v, 0, GIB, false);
    t.advance(SEC);
    assert!(leased(&t.recv(v)).is_some(), "the victim is placed");
}

/// A lease of the trusted state is taken back only by its own run, as its
/// own user: not by a process of another uid under the same pid and start
/// time (a setuid since), and not twice.
#[test]
fn a_restored_lease_is_resumed_only_by_its_run_as_its_user() {
    let (mut t, run) = recovering();
    let o = t.connect_as(run, NOBODY);
    t.send(o, &claim(77, &[1]).into());
    t.turn();
    assert!(refused(&t.recv(o)).is_some(), "another uid");
    let r = t.connect_as(run, ALICE);
    t.send(r, &claim(77, &[1]).into());
    t.turn();
    assert_eq!(leased(&t.recv(r)), Some(77));
    let again = t.connect_as(run, ALICE);
    t.send(again, &claim(77, &[1]).into());
    t.turn();
    assert!(
        refused(&t.recv(again)).is_some(),
        "held by a live connection"
    );
}

/// A user at their lease limit still takes their own lease back: the
/// restored job is already counted, not counted twice.
#[test]
fn a_user_at_the_budget_resumes_their_own_lease() {
    let (mut t, run) = recovering();
    t.b.cfg.budgets.leases = 1;
    let r = t.connect_as(run, ALICE);
    t.send(r, &claim(77, &[1]).into());
    t.turn();
    assert_eq!(leased(&t.recv(r)), Some(77));
    let p = t.spawn(1);
    let n = t.connect_as(p, ALICE);
    t.lease(n, 1, 0, false);
    let why = refused(&t.recv(n)).expect("a second lease is over the budget");
    assert!(why.contains("per-user limit"), "{why}");
}

#[derive(Debug, Clone)]
enum Attack {
    /// A resume under a token (a small set, which includes the victim's
    /// real one) claiming GPUs (a bit mask over two).
    Claim { token: u64, gpus: u8 },
    /// Time passes, in tenths of the grace.
    Wait(u8),
}

fn attack() -> impl Strategy<Value = Attack> {
    prop_oneof![
        (
            prop::sample::select(vec![1u64, 2, 77, 0x5eed, u64::MAX]),
            0u8..4
        )
            .prop_map(|(token, gpus)| Attack::Claim { token, gpus }),
        (1u8..4).prop_map(Attack::Wait),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    /// Invariant 5, recovery: whatever a user of another uid sends while a
    /// restarted broker recovers, it is booked nothing, the run of the
    /// trusted state's lease gets it back, and once the grace is over the
    /// victim's request is placed.
    #[test]
    fn recovery_grants_an_attacker_nothing(
        attacks in prop::collection::vec(attack(), 1..24),
        victim_at in 0usize..24,
    ) {
        let (mut t, run) = recovering();
        let grace = Config::default().recovery_grace;
        let mut attackers = Vec::new();
        for (i, a) in attacks.iter().enumerate() {
            if i == victim_at {
                let r = t.connect_as(run, ALICE);
                t.send(r, &claim(77, &[1]).into());
                t.turn();
                prop_assert_eq!(leased(&t.recv(r)), Some(77));
            }
            match *a {
                Attack::Claim { token, gpus } => {
                    let on: Vec<u8> = (1..=2).filter(|g| gpus & (1 << (g - 1)) != 0).collect();
                    let p = t.spawn(1);
                    let x = t.connect_as(p, NOBODY);
                    t.send(x, &claim(token, &on).into());
                    t.turn();
                    attackers.push(x);
                }
                Attack::Wait(tenths) => t.advance(grace / 10 * u64::from(tenths)),
            }
            for &x in &attackers {
                prop_assert!(leased(&t.recv(x)).is_none(), "an attacker was booked");
            }
            prop_assert!(t.b.ledger.jobs().values().all(|j| j.uid != NOBODY));
        }
        t.advance(grace);
        let p = t.spawn(1);
        let v = t.connect_as(p, BOB);
        t.lease(v, 0, GIB, false);
        t.advance(SEC);
        prop_assert!(leased(&t.recv(v)).is_some(), "the victim is placed");
    }
}

/// A queue whose requests only come and go is written once a second, not
/// at every `SAVE_EVERY`; a lease placed from it is written at once.
#[test]
fn a_churning_queue_is_written_once_a_second_and_a_placed_lease_at_once() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let p = t.spawn(1);
    let holder = t.connect_as(p, ALICE);
    t.lease(holder, 1, 0, false);
    t.save().expect("the lease's write");
    assert!(leased(&t.recv(holder)).is_some());
    let mut waiting = Vec::new();
    let mut writes = 0;
    // Two seconds: a request arrives every 10 ms, and the oldest leaves.
    for _ in 0..200 {
        t.now += 10 * MS;
        let p = t.spawn(1);
        let c = t.connect_as(p, BOB);
        t.lease(c, 1, 0, false);
        waiting.push(c);
        if waiting.len() > 3 {
            t.b.remove(t.now, waiting.remove(0));
        }
        writes += usize::from(t.save().is_some());
    }
    assert!((1..=3).contains(&writes), "{writes} writes in 2 s");
    t.now += 10 * MS;
    t.b.remove(t.now, holder);
    let bytes = t.save().expect("the placed lease's write, at once");
    let jobs = crate::jobs::decode(&bytes).unwrap().0;
    assert!(
        jobs.iter()
            .any(|j| matches!(j.phase, Phase::Running { .. })),
        "{jobs:?}"
    );
}
