use gpufrac_redteam::*;
#[test]
fn dbg() {
    let cohort = |play, members, start_ms, period_ms, duty, respawn, slow| Cohort {
        members, start_ms, period_ms, duty, respawn, slow, ..cohort(play)
    };
    let pretender = shim(Priority::High, false, Recall::Reask);
    let s = Strategy {
        cohorts: vec![
            cohort(pretender, 64, 0, 500, 75, false, false),
            cohort(shim(Priority::Low, true, Recall::Honest), 2, 1, 500, 75, false, false),
            cohort(shim(Priority::High, true, Recall::Honest), 2, 0, 594, 50, true, true),
            cohort(pretender, 64, 0, 1000, 75, false, false),
        ],
    };
    for a in gpufrac_redteam::check::answers_of(Invariant::Service, &s, &Bounds::QUICK) {
        if a.0.contains("burst") || a.2.map_or(true, |t| t - a.1 > 5.0) {
            eprintln!("ANS {:?}", a);
        }
    }
}
