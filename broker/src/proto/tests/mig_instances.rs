//! MIG instances are made off the loop: the lease is told once its
//! instance exists, and a `--no-wait` request whose instance fails is
//! refused.

use super::*;

/// Making a MIG instance takes seconds on a real GPU: the core asks the
/// shell for it and goes on; the lease is told when it is made.
#[test]
fn mig_instances_are_made_off_the_loop() {
    let planner = crate::mig::Planner::new(vec![crate::mig::models::a100_40gb(0)]);
    let mut t = T::with_mig(cfg(), &[], planner);
    let p = t.spawn(1);
    let c = t.connect_as(p, ALICE);
    t.lease(c, 0, 4 * GIB, false);
    t.turn();
    let Some(Work::Mig { lease, gpu, steps }) = t.b.poll_work() else {
        panic!("no MIG work");
    };
    assert_eq!((gpu, steps.len()), (0, 1));
    // Meanwhile the broker serves others.
    let p2 = t.spawn(1);
    let o = t.connect_as(p2, BOB);
    t.send(o, &ClientMsg::Ping);
    assert!(matches!(t.recv(o)[..], [ServerMsg::Pong]));
    assert!(leased(&t.recv(c)).is_none());
    assert_eq!(
        t.status().gpus[0].mig.as_ref().unwrap().instances[0].state,
        "creating"
    );
    let uuid = "MIG-11111111-2222-3333-4444-555555555555".to_string();
    t.b.mig_done(
        t.now,
        MigDone {
            lease,
            gpu,
            destroyed: Vec::new(),
            result: Ok((3, uuid.clone())),
        },
    );
    // Told once the state that books it is written (at most every
    // SAVE_EVERY).
    t.advance(SAVE_EVERY);
    let got = t.recv(c);
    assert!(
        got.iter()
            .any(|m| matches!(m, ServerMsg::Leased(l) if l.mig == uuid)),
        "{got:?}"
    );
}

/// A `--no-wait` MIG request whose instance cannot be made is refused, and
/// its job was never booked.
#[test]
fn a_failed_instance_refuses_a_no_wait_request() {
    let planner = crate::mig::Planner::new(vec![crate::mig::models::a100_40gb(0)]);
    let mut t = T::with_mig(cfg(), &[], planner);
    let p = t.spawn(1);
    let c = t.connect_as(p, ALICE);
    t.lease(c, 0, 4 * GIB, true);
    let Some(Work::Mig { lease, gpu, .. }) = t.b.poll_work() else {
        panic!("no MIG work");
    };
    t.b.mig_done(
        t.now,
        MigDone {
            lease,
            gpu,
            destroyed: Vec::new(),
            result: Err(("insufficient resources".into(), Some(Vec::new()))),
        },
    );
    let why = refused(&t.recv(c)).expect("refused");
    assert!(why.contains("could not be made"), "{why}");
    assert!(t.status().leases.is_empty());
}
