//! Fairness among users over the wire: a user's jobs are one user's part,
//! users' weights come from the configuration, and status shows each
//! level.

use super::*;

/// Bob runs four jobs of `--gpu-compute 100%` with a busy process each,
/// Alice one busy process: each user gets half, unless weighted.
fn four_jobs_beside_one(weights: Weights) -> (T, u32, Vec<u32>) {
    let mut t = T::new(Config { weights, ..cfg() }, &[16 * GIB]);
    let mut bobs = Vec::new();
    for _ in 0..4 {
        let run = t.spawn(1);
        let r = t.connect_as(run, BOB);
        t.send(
            r,
            &LeaseReq {
                compute: Some(100.0),
                ..lease(0, 0, false)
            }
            .into(),
        );
        assert!(leased(&t.recv(r)).is_some());
        let p = t.spawn(run);
        let c = t.connect_shim(p, BOB);
        t.register(c, Priority::Normal);
        t.send(c, &ClientMsg::Acquire { uuid: uuid(1) });
        bobs.push(p);
    }
    let a = t.spawn(1);
    let c = t.connect_shim(a, ALICE);
    t.register(c, Priority::Normal);
    t.send(c, &ClientMsg::Acquire { uuid: uuid(1) });
    t.advance(SEC);
    (t, a, bobs)
}

#[test]
fn a_users_jobs_share_one_users_part_and_status_shows_each_level() {
    let (t, alice, bobs) = four_jobs_beside_one(Weights::default());
    let st = t.status();
    let g = &st.gpus[0];
    let target = |pid| {
        g.processes
            .iter()
            .find(|p| p.pid == pid)
            .unwrap()
            .share_target
    };
    assert!((target(alice) - 0.5).abs() < 1e-9, "{}", target(alice));
    for &b in &bobs {
        assert!((target(b) - 0.125).abs() < 1e-9, "{}", target(b));
    }
    let users: Vec<(u32, f64, usize)> = g
        .users
        .iter()
        .map(|u| {
            (
                u.uid,
                (u.share_target * 1000.0).round() / 1000.0,
                u.jobs.len(),
            )
        })
        .collect();
    assert_eq!(users, vec![(ALICE, 0.5, 1), (BOB, 0.5, 4)]);
    let bob = &g.users[1];
    assert!(
        bob.jobs
            .iter()
            .all(|j| j.job.is_some() && j.weight == 100.0 && j.processes == 1)
    );
    assert_eq!(g.users[0].jobs[0].job, None, "alice's process is in no job");
}

#[test]
fn user_weights_scale_a_users_part() {
    let mut w = Weights::default();
    w.users.insert(ALICE, 3.0);
    let (t, alice, bobs) = four_jobs_beside_one(w);
    // Weights by user alone need no process's groups.
    assert!(!t.b.reads_groups());
    let st = t.status();
    let g = &st.gpus[0];
    let target = |pid| {
        g.processes
            .iter()
            .find(|p| p.pid == pid)
            .unwrap()
            .share_target
    };
    assert!((target(alice) - 0.75).abs() < 1e-9, "{}", target(alice));
    assert!((target(bobs[0]) - 0.0625).abs() < 1e-9);
    assert_eq!(g.users[0].weight, 3.0);
    // A group's weight counts for its members without one of their own.
    let mut w = Weights::default();
    w.groups.insert(BOB, 3.0);
    let (t, alice, _) = four_jobs_beside_one(w);
    assert!(t.b.reads_groups());
    let g = &t.status().gpus[0];
    let a = g.processes.iter().find(|p| p.pid == alice).unwrap();
    assert!((a.share_target - 0.25).abs() < 1e-9, "{}", a.share_target);
}
