//! The sliding-window meter (`meter`): usage, its timers, its history.

use crate::sched::meter::{MAX_HISTORY, Meter};

#[test]
fn usage_slides_with_the_window_and_the_timer_matches_it() {
    let mut m = Meter::default();
    m.set(true, 100);
    m.set(false, 400);
    m.set(true, 500);
    m.set(false, 600);
    assert_eq!(m.usage(1000, 600), 400);
    assert_eq!(m.usage(200, 600), 100);
    assert_eq!(m.total(600), 400);
    // Down to 150 once 250 of the 400 have slid out: at 350 + 1000.
    let t = m.down_to_at(1000, 600, 150).unwrap();
    assert_eq!(t, 1350);
    assert_eq!(m.usage(1000, t), 150);
    assert!(m.usage(1000, t - 1) > 150);
    assert_eq!(m.down_to_at(1000, 600, 400), None);
    m.set(true, 700);
    assert_eq!(m.usage(1000, 800), 500);
    // Running: as if it stopped now, the earliest it could be.
    let t = m.down_to_at(1000, 800, 300).unwrap();
    assert_eq!(t, 1300);
    m.set(false, 800);
    assert_eq!(m.usage(1000, t), 300);
}

#[test]
fn history_stays_bounded_and_exact_in_the_window() {
    let mut m = Meter::default();
    for i in 0..10_000u64 {
        m.set(true, i * 10);
        m.set(false, i * 10 + 5);
    }
    assert_eq!(m.total(100_000), 50_000);
    assert_eq!(m.usage(1000, 100_000), 500);
    let mut kept = m.clone();
    assert!(kept.take_history().len() <= MAX_HISTORY);
    m.prune(1000, 1_000_000);
    assert!(m.is_empty());
}
