//! State on disk and restarts: a lease is told only once it is durable,
//! a suspect state file books nothing twice, and restored jobs are resumed
//! only by their own run.

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
    let jobs = crate::jobs::decode(&bytes).unwrap();
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
    // ...while the running job claims its GPU back.
    let r = t.connect_as(run, ALICE);
    t.send(
        r,
        &LeaseReq {
            resume: 0xabc,
            pin: vec![Pin {
                uuid: uuid(1),
                mem: 16 * GIB,
            }],
            ..lease(1, 0, false)
        }
        .into(),
    );
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

#[test]
fn restored_jobs_are_resumed_only_by_their_own_run() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let run = t.spawn(1);
    let start = t.procs.borrow()[&run].1;
    let job = Job {
        pid: run,
        start_time: start,
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
