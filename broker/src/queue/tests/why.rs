//! Why a waiting request waits: what it needs, what is free, who holds
//! the rest, and which GPUs it waits for; as the next pass would decide.

use super::*;
use proptest::prelude::*;

fn why_of(q: &Queue, now: Nanos, id: RequestId) -> Why {
    q.why(now)
        .into_iter()
        .find(|(i, _)| *i == id)
        .map(|(_, w)| w)
        .unwrap_or_else(|| panic!("request {id} is not waiting"))
}

#[test]
fn whole_gpus_name_the_free_ones_and_the_jobs_holding_the_rest() {
    let mut q = two_80g();
    q.submit(
        0,
        1,
        Request {
            job: 41,
            ..whole(1)
        },
    )
    .unwrap();
    assert_eq!(placed(&q.poll(0)), vec![(1, vec![0])]);
    q.submit(
        0,
        2,
        Request {
            job: 42,
            ..whole(2)
        },
    )
    .unwrap();
    assert!(q.poll(0).is_empty());
    let w = why_of(&q, SEC, 2);
    assert_eq!(
        w.text,
        "needs 2 whole GPUs; 1 free (index 1); GPU 0: held whole by job 41"
    );
    assert_eq!(w.gpus, vec![0]);
}

#[test]
fn memory_names_what_each_gpu_has_free() {
    let mut q = two_80g();
    q.submit(0, 1, Request { job: 41, ..mem(60) }).unwrap();
    q.submit(0, 2, Request { job: 43, ..mem(70) }).unwrap();
    assert_eq!(placed(&q.poll(0)).len(), 2);
    q.submit(0, 3, Request { job: 44, ..mem(30) }).unwrap();
    assert!(q.poll(0).is_empty());
    let w = why_of(&q, SEC, 3);
    assert_eq!(
        w.text,
        "needs 30.00 GiB on one GPU; GPU 0: 20.00 GiB free of 80.00 GiB (the rest held by job 41); \
         GPU 1: 10.00 GiB free of 80.00 GiB (the rest held by job 43)"
    );
    assert_eq!(w.gpus, vec![0, 1]);
    // A GPU too small to ever hold it is not among those it waits for.
    let mut q = Queue::new(gpus(&[80 * GIB, 16 * GIB]), QueueConfig::default());
    q.submit(0, 1, Request { job: 41, ..mem(60) }).unwrap();
    q.poll(0);
    q.submit(0, 2, mem(30)).unwrap();
    assert!(q.poll(0).is_empty());
    assert_eq!(why_of(&q, 0, 2).gpus, vec![0]);
}

#[test]
fn a_request_that_fits_on_gpus_held_for_an_escalated_one_says_so() {
    let cfg = QueueConfig {
        escalate_after: 10 * SEC,
        ..QueueConfig::default()
    };
    let mut q = Queue::new(gpus(&[80 * GIB, 80 * GIB]), cfg);
    q.submit(
        0,
        1,
        by(
            1,
            Request {
                job: 41,
                ..whole(1)
            },
        ),
    )
    .unwrap();
    assert_eq!(placed(&q.poll(0)), vec![(1, vec![0])]);
    q.submit(
        0,
        2,
        by(
            2,
            Request {
                job: 42,
                ..whole(2)
            },
        ),
    )
    .unwrap();
    assert!(q.poll(0).is_empty());
    // Request 2 escalates: GPU 1, free, is held for it.
    q.submit(
        20 * SEC,
        3,
        by(
            3,
            Request {
                job: 43,
                ..whole(1)
            },
        ),
    )
    .unwrap();
    assert!(q.poll(20 * SEC).is_empty());
    let w = why_of(&q, 20 * SEC, 3);
    assert_eq!(
        w.text,
        "needs 1 whole GPU; it would fit, but GPU 1 is held for the request at position 1 \
         of the queue (escalated, pinned or for whole GPUs: placed first)"
    );
    assert_eq!(w.gpus, vec![1]);
    let first = why_of(&q, 20 * SEC, 2);
    assert!(
        first
            .text
            .starts_with("needs 2 whole GPUs; 1 free (index 1); GPU 0: held whole by job 41"),
        "{}",
        first.text
    );
}

#[test]
fn slots_and_pins_are_named() {
    let cfg = QueueConfig {
        overprovision: 2,
        ..QueueConfig::default()
    };
    let mut q = Queue::new(gpus(&[80 * GIB]), cfg);
    for (id, job) in [(1, 41), (2, 42)] {
        q.submit(0, id, Request { job, ..whole(1) }).unwrap();
    }
    assert_eq!(q.poll(0).len(), 2);
    q.submit(0, 3, whole(1)).unwrap();
    q.submit(0, 4, pinned(&[(0, 8)])).unwrap();
    assert!(q.poll(0).is_empty());
    assert_eq!(
        why_of(&q, 0, 3).text,
        "needs a free slot on 1 GPU; 0 free; GPU 0: no free slot (2/2 taken by jobs 41, 42)"
    );
    let pin = why_of(&q, 0, 4);
    assert_eq!(
        pin.text,
        "needs 8.00 GiB on GPU 0 (pinned); GPU 0: no free slot (2/2 taken by jobs 41, 42)"
    );
    assert_eq!(pin.gpus, vec![0]);
}

proptest! {
    /// The walk decides as a pass would: after a poll nothing waiting is
    /// said to fit, every waiting request says why, and a request held
    /// back names only requests ahead of it.
    #[test]
    fn why_agrees_with_the_queue(
        ops in proptest::collection::vec((0u8..4, 0u32..3, 1u64..90, 0u64..4), 1..40)
    ) {
        let cfg = QueueConfig {
            escalate_after: 10 * SEC,
            ..QueueConfig::default()
        };
        let mut q = Queue::new(gpus(&[80 * GIB, 80 * GIB, 40 * GIB]), cfg);
        let mut now = 0;
        let mut held: Vec<RequestId> = Vec::new();
        for (id, &(op, uid, size, dt)) in ops.iter().enumerate() {
            let id = id as RequestId + 1;
            now += dt * 4 * SEC;
            match op {
                0 => q.submit(now, id, by(uid, whole(1 + (size % 2) as u32))).unwrap(),
                1 | 2 => q.submit(now, id, by(uid, Request { job: id as u32, ..mem(size) })).unwrap_or(()),
                _ if !held.is_empty() => {
                    let l = held.remove(size as usize % held.len());
                    q.release(now, l);
                }
                _ => {}
            }
            held.extend(q.poll(now).iter().map(|l| l.id));
            let waiting = q.waiting(now);
            let why = q.why(now);
            prop_assert_eq!(why.len(), waiting.len());
            for ((id, w), s) in why.iter().zip(&waiting) {
                prop_assert_eq!(*id, s.id);
                prop_assert!(!w.text.starts_with("fits now"), "{} fits: {:?}", id, w);
                prop_assert!(w.text.starts_with("needs "), "{:?}", w);
                if let Some(at) = w.text.find("at position ") {
                    let p: usize = w.text[at + 12..]
                        .split(|c: char| !c.is_ascii_digit())
                        .next()
                        .unwrap()
                        .parse()
                        .unwrap();
                    prop_assert!(p < s.position, "{:?} at {}", w, s.position);
                    prop_assert!(!w.gpus.is_empty());
                }
            }
        }
    }
}
