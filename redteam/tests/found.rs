//! Strategies that broke an invariant, kept as regression tests: the
//! review's own (issue 32), and those a search found, each as `redteam
//! search` (or `cargo xtask redteam`) printed it. Each plays once within
//! the test suite's bounds (`Bounds::QUICK`). `GPUFRAC_REDTEAM_REPORT_ONLY=1`
//! reports instead of failing.

use gpufrac_redteam::*;

/// One of the review's strategies, by name.
fn review(name: &str) -> Strategy {
    seeds()
        .into_iter()
        .find(|(n, _)| *n == name)
        .map(|(_, s)| s)
        .unwrap_or_else(|| panic!("no seed strategy named {name}"))
}

#[test]
fn connections_taking_turns_get_one_users_part() {
    holds(Invariant::Fairness, &review("rotation"));
}

#[test]
fn high_and_normal_processes_get_one_users_part() {
    holds(Invariant::Fairness, &review("high-and-normal"));
}

#[test]
fn a_busy_high_process_does_not_hold_another_users_high_burst() {
    holds(Invariant::Service, &review("high-and-normal"));
}

#[test]
fn registrations_with_a_large_command_line_cost_bounded_work() {
    holds(Invariant::Service, &review("big-argv-registers"));
}

#[test]
fn a_holder_answering_recalls_by_asking_again_leaves_no_idle_gpu() {
    holds(Invariant::Idle, &review("recall-pretending"));
}

#[test]
fn one_users_refusals_hide_no_other_line() {
    holds(Invariant::Logs, &review("refusal-a-second"));
}

#[test]
fn a_command_line_forges_no_field() {
    holds(Invariant::Logs, &review("forged-fields"));
}

#[test]
fn made_up_gpus_are_forgotten_with_their_process() {
    holds(Invariant::State, &review("uuid-flood"));
}

#[test]
fn a_whole_gpus_memory_waits_behind_an_earlier_whole_gpu() {
    holds(Invariant::Queue, &review("whole-memory-jumps-the-queue"));
}

/// What `cargo xtask redteam --invariant fairness --without rotation
/// --shims-only --classes normal --budget 300` found on the code before
/// the round-4 fixes (a release build; its best played 0.92, simplified
/// to 0.77): 35 connections of one process with work, each on half of
/// an 833 ms period, staggered by a tenth (taking turns), beside holders
/// that never answer a recall and holders without work, all coming back
/// on new connections. The victim kept 23% of its fair part.
#[test]
fn connections_taking_turns_found_without_the_rotation_seed() {
    let s = Strategy {
        cohorts: vec![
            Cohort {
                play: Play::Shim {
                    class: Priority::Normal,
                    work: false,
                    recall: Recall::Ignore,
                    uuids: 0,
                },
                members: 16,
                procs: 1,
                start_ms: 0,
                period_ms: 708,
                duty: 50,
                stagger: 0,
                reconnect: true,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: false,
            },
            Cohort {
                play: Play::Shim {
                    class: Priority::Normal,
                    work: false,
                    recall: Recall::Honest,
                    uuids: 0,
                },
                members: 32,
                procs: 1,
                start_ms: 0,
                period_ms: 1416,
                duty: 50,
                stagger: 0,
                reconnect: true,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: false,
            },
            Cohort {
                play: Play::Shim {
                    class: Priority::Normal,
                    work: true,
                    recall: Recall::Honest,
                    uuids: 0,
                },
                members: 35,
                procs: 1,
                start_ms: 0,
                period_ms: 833,
                duty: 50,
                stagger: 10,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: false,
            },
        ],
    };
    holds(Invariant::Fairness, &s);
}

/// Found by `cargo xtask redteam --budget 300` (seed 20261126) on the
/// code before the round-4 fixes: 82 connections whose processes have 2.3
/// to 4.6 MiB command lines of control bytes, asking for leases or
/// registering, each read and escaped whole at its first message; the
/// victim's status waited 3.6 s (141 ms within the test suite's bounds).
#[test]
fn large_command_lines_on_leases_and_registrations_stall_no_answer() {
    let s = Strategy {
        cohorts: vec![
            Cohort {
                play: Play::Lease {
                    want: Want::Memory,
                    queued: false,
                },
                members: 6,
                procs: 1,
                start_ms: 300,
                period_ms: 20,
                duty: 100,
                stagger: 0,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 4608,
                    text: Text::Controls,
                },
                slow: false,
            },
            Cohort {
                play: Play::Lease {
                    want: Want::WholeMemory { less: 0 },
                    queued: false,
                },
                members: 12,
                procs: 1,
                start_ms: 300,
                period_ms: 20,
                duty: 100,
                stagger: 0,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 4608,
                    text: Text::Controls,
                },
                slow: false,
            },
            Cohort {
                play: Play::Shim {
                    class: Priority::Normal,
                    work: false,
                    recall: Recall::Reask,
                    uuids: 0,
                },
                members: 64,
                procs: 1,
                start_ms: 300,
                period_ms: 10,
                duty: 100,
                stagger: 0,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 2304,
                    text: Text::Controls,
                },
                slow: false,
            },
        ],
    };
    holds(Invariant::Service, &s);
}

/// Found by the same search: 24 connections sending `Name` frames of
/// 250 KiB of control bytes from processes with 4.6 MiB command lines,
/// a tenth of every 2 s: the loop is busy escaping and the `low`
/// victim's grants wait on an idle GPU (all of 2 s; 6.7% within the
/// test suite's bounds).
#[test]
fn name_floods_leave_no_idle_gpu_while_a_low_victim_waits() {
    let s = Strategy {
        cohorts: vec![Cohort {
            play: Play::Name {
                kib: 250,
                frames: 16,
            },
            members: 24,
            procs: 1,
            start_ms: 0,
            period_ms: 2000,
            duty: 10,
            stagger: 0,
            reconnect: false,
            respawn: false,
            argv: Argv {
                kib: 4608,
                text: Text::Controls,
            },
            slow: false,
        }],
    };
    holds(Invariant::Idle, &s);
}

/// Found by the same search: six connections of `high` processes whose
/// command line is ` uid=0 pid=1 job=root`, coming back on new
/// connections and taking turns: each registration is a line whose
/// fields say uid 0 (78 lines in 2 s).
#[test]
fn command_lines_shaped_like_fields_forge_no_line() {
    let s = Strategy {
        cohorts: vec![Cohort {
            play: Play::Shim {
                class: Priority::High,
                work: true,
                recall: Recall::Honest,
                uuids: 0,
            },
            members: 6,
            procs: 1,
            start_ms: 0,
            period_ms: 320,
            duty: 48,
            stagger: 2,
            reconnect: true,
            respawn: false,
            argv: Argv {
                kib: 0,
                text: Text::Fields,
            },
            slow: false,
        }],
    };
    holds(Invariant::Logs, &s);
}

/// Found by the same search: two `--gpu-memory` requests for a whole
/// GPU's memory, asked after the victim's `--gpus 1`, both placed before
/// it.
#[test]
fn whole_memory_requests_do_not_jump_an_earlier_whole_gpu() {
    let s = Strategy {
        cohorts: vec![
            Cohort {
                play: Play::Lease {
                    want: Want::Memory,
                    queued: false,
                },
                members: 1,
                procs: 1,
                start_ms: 0,
                period_ms: 414,
                duty: 90,
                stagger: 0,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: false,
            },
            Cohort {
                play: Play::Lease {
                    want: Want::WholeMemory { less: 0 },
                    queued: true,
                },
                members: 1,
                procs: 1,
                start_ms: 300,
                period_ms: 2000,
                duty: 82,
                stagger: 0,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: false,
            },
            Cohort {
                play: Play::Lease {
                    want: Want::WholeMemory { less: 0 },
                    queued: true,
                },
                members: 1,
                procs: 1,
                start_ms: 300,
                period_ms: 2000,
                duty: 90,
                stagger: 0,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: false,
            },
        ],
    };
    holds(Invariant::Queue, &s);
}

/// What the test suite's search found for logs once the core was
/// re-pointed (seed 20261126, 74 strategies, a debug build): three
/// connections of one process registering a made-up GPU beside GPU 0, on
/// a broker that found its GPUs, taking turns. Each refusal is the
/// broker's own words, "... or with GPUFRAC_BROKER=off", which a logfmt
/// reader takes as a field: no user wrote it, and the measure counted it
/// as forged (75 lines). A line is forged by the fields a user's text is
/// shaped to forge (`logs::FORGING`), not by the broker's own `key=value`.
#[test]
fn the_brokers_own_words_in_a_refusal_forge_no_field() {
    let s = Strategy {
        cohorts: vec![Cohort {
            play: Play::Shim {
                class: Priority::High,
                work: true,
                recall: Recall::Honest,
                uuids: 1,
            },
            members: 3,
            procs: 1,
            start_ms: 0,
            period_ms: 80,
            duty: 75,
            stagger: 50,
            reconnect: false,
            respawn: false,
            argv: Argv {
                kib: 0,
                text: Text::Plain,
            },
            slow: false,
        }],
    };
    holds(Invariant::Logs, &s);
}

/// What `cargo xtask redteam --invariant service --classes normal,low
/// --without high-and-normal` found once the core was re-pointed (seed
/// 20261126, 417 strategies, a release build; simplified here to one
/// process): a single `low` process of another user that asks for the GPU
/// at 777 ms. The victim's `high` interactive process had held the GPU
/// alone since 20 ms, launching 0.5 ms every 20 ms (the shim keeps an
/// uncontended grant between bursts); the `high` class's meter ran all
/// that time, though nothing of a lower class could use the GPU, so when
/// the `low` process asked, the class was at once 757 ms into a 500 ms
/// share of its 1 s window, and every `high` burst was passed over until
/// the window slid: the burst at 780 ms was granted at 1297 ms.
/// (then the scheduler's limits, `sync_meters`: `self.high.set(high_on,
/// now)` whether or not `high_bounded`.) Arriving at 1000 ms instead, it
/// recalls a burst midway, which then waits to the end of the scene
/// (500 ms): a burst still waiting at the end counts as waiting until it.
#[test]
fn a_low_process_arriving_holds_no_high_burst_for_the_class_share() {
    for start_ms in [777, 1000] {
        let s = Strategy {
            cohorts: vec![Cohort {
                play: Play::Shim {
                    class: Priority::Low,
                    work: true,
                    recall: Recall::Honest,
                    uuids: 0,
                },
                members: 1,
                procs: 1,
                start_ms,
                period_ms: 1000,
                duty: 100,
                stagger: 0,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: false,
            }],
        };
        holds(Invariant::Service, &s);
    }
}

/// Found by `cargo xtask redteam --invariant idle` (400 strategies, full
/// inputs): processes that never read what the broker says (so never
/// hear their grants, never launch, never answer a recall) and ask for
/// the GPU in turns on four connections of two processes of one user.
/// Each holder stayed behind a sibling waiter that was charged as fast
/// as it (both on the GPU, the sibling still draining), and was extended
/// slice after slice: the `low` victim waited on an idle GPU for 70.6%
/// of 6 s. A grant now runs at most a slice of credit and the warp while
/// a lower band waits (7.9%).
#[test]
fn holders_that_never_read_extended_behind_their_own_siblings_leave_no_idle_gpu() {
    let shim = |period_ms, duty| Cohort {
        play: Play::Shim {
            class: Priority::Normal,
            work: true,
            recall: Recall::Honest,
            uuids: 0,
        },
        members: 2,
        procs: 1,
        start_ms: 0,
        period_ms,
        duty,
        stagger: 0,
        reconnect: false,
        respawn: false,
        argv: Argv {
            kib: 0,
            text: Text::Plain,
        },
        slow: true,
    };
    let s = Strategy {
        cohorts: vec![shim(964, 80), shim(1731, 83)],
    };
    holds(Invariant::Idle, &s);
}

/// Found by the longer search: never-reading holders without work, each
/// behind a sibling of its own user, were extended 4 ms at a time up to
/// three slices while `low` waited, never judged for evidence: the low
/// victim waited on an idle GPU 15.2% of 6 s. A holder whose user's
/// benefit of the doubt is spent is no longer extended (10.8%).
#[test]
fn holders_that_never_read_extended_4_ms_at_a_time_leave_no_idle_gpu() {
    let s = Strategy {
        cohorts: vec![
            Cohort {
                play: Play::Shim {
                    class: Priority::Normal,
                    work: false,
                    recall: Recall::Honest,
                    uuids: 0,
                },
                members: 8,
                procs: 1,
                start_ms: 0,
                period_ms: 2000,
                duty: 75,
                stagger: 0,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: true,
            },
            Cohort {
                play: Play::Shim {
                    class: Priority::Normal,
                    work: true,
                    recall: Recall::Honest,
                    uuids: 0,
                },
                members: 4,
                procs: 1,
                start_ms: 0,
                period_ms: 1000,
                duty: 100,
                stagger: 10,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: true,
            },
            Cohort {
                play: Play::Shim {
                    class: Priority::Normal,
                    work: false,
                    recall: Recall::Honest,
                    uuids: 0,
                },
                members: 1,
                procs: 1,
                start_ms: 0,
                period_ms: 2000,
                duty: 75,
                stagger: 0,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: true,
            },
        ],
    };
    holds(Invariant::Idle, &s);
}

/// Found by the longer search (after the wake-up credit was bounded):
/// 23 `high` connections of one process working 55% of each 160 ms took
/// 1.27 s of 3 s beside a busy victim (harm 0.203): the band's clock
/// jumped at each handover over the revoked holder's place, and a user
/// coming back kept its lag from a clock that had run ahead.
#[test]
fn a_duty_cycle_of_many_connections_gets_no_more_than_its_part() {
    let s = Strategy {
        cohorts: vec![Cohort {
            play: Play::Shim {
                class: Priority::High,
                work: true,
                recall: Recall::Reask,
                uuids: 0,
            },
            members: 23,
            procs: 1,
            start_ms: 0,
            period_ms: 160,
            duty: 55,
            stagger: 0,
            reconnect: false,
            respawn: false,
            argv: Argv {
                kib: 0,
                text: Text::Plain,
            },
            slow: false,
        }],
    };
    holds(Invariant::Fairness, &s);
}

/// Found by the longer search: two `high` connections working half of
/// each 380 ms, beside twelve `low` ones churning every 5 ms, kept the
/// victim's `high` burst waiting 193 ms. A waker of another user is owed
/// the GPU within a wake period.
#[test]
fn a_high_burst_beside_high_and_low_churn_is_granted_within_its_bound() {
    let s = Strategy {
        cohorts: vec![
            Cohort {
                play: Play::Shim {
                    class: Priority::High,
                    work: true,
                    recall: Recall::Honest,
                    uuids: 0,
                },
                members: 2,
                procs: 1,
                start_ms: 0,
                period_ms: 380,
                duty: 51,
                stagger: 0,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: false,
            },
            Cohort {
                play: Play::Shim {
                    class: Priority::Low,
                    work: true,
                    recall: Recall::Honest,
                    uuids: 0,
                },
                members: 12,
                procs: 1,
                start_ms: 300,
                period_ms: 5,
                duty: 25,
                stagger: 25,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: false,
            },
        ],
    };
    holds(Invariant::Service, &s);
}

/// Found by the search: an attacker's `high` connection back with a
/// slice of credit took the GPU from the victim's `high` process idle in
/// its grant, and its siblings' wake-ups took the turn the victim's next
/// burst was owed: 22 to 26 ms (with status floods beside).
#[test]
fn a_high_burst_asked_as_its_grant_is_taken_is_granted_within_its_bound() {
    let s = Strategy {
        cohorts: vec![
            Cohort {
                play: Play::Shim {
                    class: Priority::High,
                    work: true,
                    recall: Recall::Honest,
                    uuids: 0,
                },
                members: 16,
                procs: 1,
                start_ms: 0,
                period_ms: 320,
                duty: 50,
                stagger: 0,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: false,
            },
            Cohort {
                play: Play::Shim {
                    class: Priority::High,
                    work: true,
                    recall: Recall::Honest,
                    uuids: 0,
                },
                members: 2,
                procs: 1,
                start_ms: 0,
                period_ms: 320,
                duty: 25,
                stagger: 0,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: false,
            },
            Cohort {
                play: Play::Status { frames: 2048 },
                members: 32,
                procs: 31,
                start_ms: 300,
                period_ms: 1000,
                duty: 75,
                stagger: 50,
                reconnect: true,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Controls,
                },
                slow: false,
            },
        ],
    };
    holds(Invariant::Service, &s);
}

/// Found by the longer search: a `high` pretender beside sixteen `low`
/// connections that never answer a revoke. The victim's `high` burst took
/// the GPU from a `low` holder, and the grant went to the pretender, ahead
/// in the order (charged a seventeenth of its time beside the hung ones):
/// 52 ms. A waker passed over for another user's client is owed the GPU.
#[test]
fn a_high_burst_beside_a_pretender_and_hung_low_holders_is_granted_within_its_bound() {
    let s = Strategy {
        cohorts: vec![
            Cohort {
                play: Play::Shim {
                    class: Priority::Low,
                    work: true,
                    recall: Recall::Ignore,
                    uuids: 0,
                },
                members: 16,
                procs: 1,
                start_ms: 500,
                period_ms: 20,
                duty: 100,
                stagger: 0,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: false,
            },
            Cohort {
                play: Play::Shim {
                    class: Priority::High,
                    work: false,
                    recall: Recall::Honest,
                    uuids: 0,
                },
                members: 1,
                procs: 1,
                start_ms: 0,
                period_ms: 320,
                duty: 100,
                stagger: 0,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: false,
            },
        ],
    };
    holds(Invariant::Service, &s);
}

/// Two `high` connections of one user taking turns, 42% of each 90 ms:
/// the victim's `high` burst waited 27.8 ms. A holder alone since the
/// last event had its lag recorded from a clock as old as that event,
/// so the victim came back far behind its real place; and a burst asked
/// as its idle grant was taken for a newcomer was not served as a waker.
#[test]
fn service_seed_20261126_turns() {
    let s = Strategy {
        cohorts: vec![Cohort {
            play: Play::Shim {
                class: Priority::High,
                work: true,
                recall: Recall::Honest,
                uuids: 0,
            },
            members: 2,
            procs: 1,
            start_ms: 0,
            period_ms: 90,
            duty: 42,
            stagger: 100,
            reconnect: false,
            respawn: false,
            argv: Argv {
                kib: 0,
                text: Text::Plain,
            },
            slow: false,
        }],
    };
    holds(Invariant::Service, &s);
}

/// Found by the longer search with another seed (`redteam search
/// --invariant service --shims-only --seed 1127`): the victim's idle
/// grant, alone for most of a slice, ended for the attacker's waker 12 µs
/// later instead of at once, and the burst asked as it ended waited the
/// attacker's whole slice (20 ms).
#[test]
fn service_seed_1127() {
    let s = Strategy {
        cohorts: vec![
            Cohort {
                play: Play::Shim {
                    class: Priority::High,
                    work: true,
                    recall: Recall::Reask,
                    uuids: 0,
                },
                members: 2,
                procs: 1,
                start_ms: 300,
                period_ms: 80,
                duty: 9,
                stagger: 50,
                reconnect: true,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: false,
            },
            Cohort {
                play: Play::Shim {
                    class: Priority::High,
                    work: false,
                    recall: Recall::Honest,
                    uuids: 0,
                },
                members: 2,
                procs: 1,
                start_ms: 300,
                period_ms: 640,
                duty: 11,
                stagger: 50,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: false,
            },
        ],
    };
    holds(Invariant::Service, &s);
}

/// Also seed 1127: one attacker's busy `high` connections spend its
/// `--high-share` beside its own `low` connections that ignore recalls,
/// and wait; the victim's interactive `high` process runs alone in the
/// band meanwhile. The waiting attacker held the band's clock back, the
/// victim ran ahead of it, and when the share came back the victim's
/// burst, over a slice ahead of the attacker, was not owed the GPU: it
/// waited 82 ms.
#[test]
fn service_seed_1127_high_share_spent() {
    let cohort = |play, members, start_ms, period_ms, duty, stagger| Cohort {
        members,
        start_ms,
        period_ms,
        duty,
        stagger,
        ..cohort(play)
    };
    let s = Strategy {
        cohorts: vec![
            cohort(
                shim(Priority::High, true, Recall::Honest),
                2,
                100,
                640,
                100,
                12,
            ),
            cohort(
                shim(Priority::Low, false, Recall::Honest),
                2,
                0,
                338,
                100,
                50,
            ),
            cohort(
                shim(Priority::Low, true, Recall::Ignore),
                3,
                100,
                1000,
                10,
                0,
            ),
        ],
    };
    holds(Invariant::Service, &s);
}

/// Found with seed 31 (`--shims-only`): the attacker's `high` pretender
/// (no work; it answers every recall by asking again), deferred for want
/// of evidence, waited while the victim held the band alone; the band's
/// clock had last moved at the previous event, so when the deferral
/// ended the victim was over a slice ahead of a clock held back to then,
/// and its burst waited 60 ms. The clock now follows a holder alone
/// until the event that ends it.
#[test]
fn service_seed_31() {
    let cohort = |play, period_ms, duty, stagger| Cohort {
        period_ms,
        duty,
        stagger,
        ..cohort(play)
    };
    let s = Strategy {
        cohorts: vec![
            cohort(shim(Priority::Low, false, Recall::Honest), 500, 68, 0),
            cohort(shim(Priority::High, false, Recall::Reask), 1000, 100, 50),
        ],
    };
    holds(Invariant::Service, &s);
}

/// Seed 31 again, after the fix above: 64 `high` pretenders of one
/// attacker process, deferred for want of evidence, beside its `low`
/// and never-reading `high` connections. When the deferral ended (a
/// timer), the victim's idle grant, alone for a slice, was revoked at
/// once for the pretender now allowed to run, which was no waker, so the
/// victim's burst asked as that happened was not served as one; the
/// pretenders, far behind after their deferral, then took turns for
/// 56 ms.
#[test]
fn service_seed_31_deferral_ends() {
    let cohort = |play, members, start_ms, period_ms, duty, respawn, slow| Cohort {
        members,
        start_ms,
        period_ms,
        duty,
        respawn,
        slow,
        ..cohort(play)
    };
    let pretender = shim(Priority::High, false, Recall::Reask);
    let s = Strategy {
        cohorts: vec![
            cohort(pretender, 64, 0, 500, 75, false, false),
            cohort(
                shim(Priority::Low, true, Recall::Honest),
                2,
                1,
                500,
                75,
                false,
                false,
            ),
            cohort(
                shim(Priority::High, true, Recall::Honest),
                2,
                0,
                594,
                50,
                true,
                true,
            ),
            cohort(pretender, 64, 0, 1000, 75, false, false),
        ],
    };
    holds(Invariant::Service, &s);
}

/// Found with seed 7 (`--invariant idle`): beside the attacker's `normal`
/// pretender (no work; it answers every recall by asking again), two
/// `high` connections of another of its processes, working while they
/// hold and ignoring recalls, on for 1.5 s of every 2 s. New, with no
/// sample yet, each was judged in the pretender's place when its slice
/// ended; the sample that then showed it at work ended the user's
/// deferral and started the pretender's doubling over at a slice, again
/// each second: the `low` victim waited on an idle GPU 15.1% of 6 s. A
/// deferral that evidence ends keeps its count now (10.5%).
#[test]
fn idle_seed_7() {
    let cohort = |play, members, start_ms, period_ms, duty, stagger| Cohort {
        members,
        start_ms,
        period_ms,
        duty,
        stagger,
        ..cohort(play)
    };
    let s = Strategy {
        cohorts: vec![
            cohort(
                shim(Priority::Normal, false, Recall::Reask),
                1,
                0,
                640,
                100,
                0,
            ),
            cohort(
                shim(Priority::High, true, Recall::Ignore),
                2,
                100,
                2000,
                75,
                50,
            ),
        ],
    };
    holds(Invariant::Idle, &s);
}

/// Found by this project once a cohort could share the processes of the
/// one before it (the driver counts work by process): a `normal`
/// pretender (no work; it answers every recall by asking again) beside a
/// connection of its own process that works 20 ms each second. The
/// process's work was the pretender's evidence, it was granted back at
/// each recall, and the `low` victim waited on an idle GPU 97.9% of
/// 6 s. Work is a connection's only where it is its process's one on the
/// GPU now (11.5%).
#[test]
fn a_pretender_beside_a_working_connection_of_its_process() {
    let cohort = |play, procs, duty| Cohort {
        procs,
        duty,
        ..cohort(play)
    };
    let s = Strategy {
        cohorts: vec![
            cohort(shim(Priority::Normal, true, Recall::Honest), 1, 2),
            cohort(shim(Priority::Normal, false, Recall::Reask), 0, 100),
        ],
    };
    holds(Invariant::Idle, &s);
}

/// Found with the pinned seed once the search's trajectory changed: two
/// members taking turns, each a new process every 2 ms (the old one
/// exits), `normal`, no work, recalls ignored. The holder left as the
/// next asked, so the GPU was handed on within the attacker's user and no
/// holder was ever revoked or let go, so none was judged: the `low`
/// victim waited on an idle GPU 55% of 6 s (100% with the largest
/// bounds). A holder that leaves is judged as one that lets go (8.4%).
#[test]
fn idle_seed_20261126() {
    let s = Strategy {
        cohorts: vec![Cohort {
            members: 2,
            period_ms: 2,
            duty: 75,
            stagger: 50,
            respawn: true,
            ..cohort(shim(Priority::Normal, false, Recall::Ignore))
        }],
    };
    holds(Invariant::Idle, &s);
}

/// Found by a longer search (`redteam search --invariant fairness --seed 9
/// --budget 800`): the attacker's busy `high` process on half of each
/// 265 ms, beside sixteen of its `low` connections taking turns, each on
/// 40 µs in 2 ms and never answering a revoke. Left on the GPU, the `low`
/// connections thinned the charge of whoever held it, so the band's
/// clock crawled and the `high` user's warp (a fixed two slices of
/// virtual time) bought it its whole on-time: the `normal` victim kept
/// 73% of its fair part. A higher band's charge is no longer thinned by a
/// lower band's clients on the GPU (96%). Played within the largest
/// bounds: within the suite's, the attacker's churn is cut short before
/// it shows.
#[test]
fn fairness_seed_9() {
    let s = Strategy {
        cohorts: vec![
            Cohort {
                period_ms: 265,
                duty: 50,
                ..cohort(shim(Priority::High, true, Recall::Honest))
            },
            Cohort {
                members: 16,
                period_ms: 2,
                duty: 2,
                stagger: 6,
                ..cohort(shim(Priority::Low, true, Recall::Ignore))
            },
        ],
    };
    gpufrac_redteam::check::verdict(
        &evaluate(Invariant::Fairness, &s, &Bounds::FULL),
        " within the largest bounds",
    );
}

/// Found by a longer search (budget 160) from the pinned seed: eight
/// connections of one busy `high` process that answer each recall by
/// asking again, never reading their socket, beside the victim's
/// interactive `high` bursts.
#[test]
fn service_busy_high_connections_reasking() {
    let s = Strategy {
        cohorts: vec![Cohort {
            members: 8,
            start_ms: 100,
            period_ms: 20,
            duty: 100,
            slow: true,
            ..cohort(shim(Priority::High, true, Recall::Reask))
        }],
    };
    holds(Invariant::Service, &s);
}

/// Found by a longer search (budget 160) from seed 9: a `normal`
/// connection that holds without work for 57% of each 200 ms, beside four
/// connections of one `high` process that take turns.
#[test]
fn service_high_rotation_beside_an_idle_normal_holder() {
    let s = Strategy {
        cohorts: vec![
            Cohort {
                period_ms: 200,
                duty: 57,
                ..cohort(shim(Priority::Normal, false, Recall::Honest))
            },
            Cohort {
                members: 4,
                start_ms: 1,
                period_ms: 656,
                duty: 6,
                stagger: 6,
                ..cohort(shim(Priority::High, true, Recall::Reask))
            },
        ],
    };
    holds(Invariant::Service, &s);
}

/// Found by a longer search (budget 160) from seed 2027: 48 connections of
/// one `high` process with no work that answer each recall by asking
/// again, beside connections that send oversized name frames. Played
/// within the largest bounds.
#[test]
fn service_idle_high_connections_reasking_beside_name_frames() {
    let s = Strategy {
        cohorts: vec![
            Cohort {
                members: 48,
                period_ms: 20,
                ..cohort(shim(Priority::High, false, Recall::Reask))
            },
            Cohort {
                members: 8,
                start_ms: 300,
                period_ms: 24,
                duty: 75,
                stagger: 25,
                ..cohort(Play::Name {
                    kib: 128,
                    frames: 2,
                })
            },
        ],
    };
    gpufrac_redteam::check::verdict(
        &evaluate(Invariant::Service, &s, &Bounds::FULL),
        " within the largest bounds",
    );
}

/// Seed 2027 (`--budget 160`): a user's `low` connections that never
/// read, and 48 busy `high` connections of one process of the same user,
/// beside the victim's interactive `high` process. The 48 asked at once
/// and each came as a burst (and kept it while it waited); when the
/// victim's grant revoked the last waiting `low` connection, the `high`
/// share let go, they came back with a burst's warped deadline level
/// with the victim's, and rounding gave them the GPU for a whole slice
/// (a burst waited 19.8 ms). A parked request now comes back as no
/// burst, and a tie leaves the holder the GPU.
#[test]
fn service_seed_2027() {
    let s = Strategy {
        cohorts: vec![
            Cohort {
                play: Play::Shim {
                    class: Priority::Low,
                    work: false,
                    recall: Recall::Reask,
                    uuids: 0,
                },
                members: 3,
                procs: 1,
                start_ms: 0,
                period_ms: 16,
                duty: 100,
                stagger: 0,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: true,
            },
            Cohort {
                play: Play::Shim {
                    class: Priority::High,
                    work: true,
                    recall: Recall::Reask,
                    uuids: 0,
                },
                members: 48,
                procs: 1,
                start_ms: 0,
                period_ms: 20,
                duty: 100,
                stagger: 0,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: false,
            },
        ],
    };
    holds(Invariant::Service, &s);
}

/// Seed 9 (`--budget 160`): a user's 16 connections without work that
/// answer every recall by asking again, and another's `high` processes
/// that ignore recalls. It broke `idle` (15.8%) against a scheduler that
/// gave a burst only to a user's only work of its class: the 16 then
/// asked for whole slices and held the GPU idle for each. A connection's
/// own idleness makes its burst, and its short request.
#[test]
fn idle_seed_9() {
    let s = Strategy {
        cohorts: vec![
            Cohort {
                play: Play::Shim {
                    class: Priority::High,
                    work: true,
                    recall: Recall::Ignore,
                    uuids: 0,
                },
                members: 4,
                procs: 4,
                start_ms: 1400,
                period_ms: 160,
                duty: 25,
                stagger: 25,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: false,
            },
            Cohort {
                play: Play::Shim {
                    class: Priority::Normal,
                    work: false,
                    recall: Recall::Reask,
                    uuids: 0,
                },
                members: 16,
                procs: 1,
                start_ms: 0,
                period_ms: 80,
                duty: 100,
                stagger: 25,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: false,
            },
        ],
    };
    holds(Invariant::Idle, &s);
}

/// Found by the pinned seed's search at budget 480 (2026-11-29), and
/// already broken before that day's changes (the same harm, 2.009, at
/// 577b968): beside 24 `high` connections of one user that each hold
/// for a second in two, another 24 that come on for 1.7 ms in every
/// 17 ms, each on a new connection registering a 76 KiB command line of
/// control characters, keep another user's `high` burst waiting a whole
/// slice (20 ms) for its grant, not a quantum. It holds within the suite's
/// bounds (`Bounds::QUICK`: harm 0.36); only the search's bounds on the
/// attacker's broker work (`Bounds::FULL`) show it. A new connection's
/// warped deadline, earlier by a hair, took the burst from its holder
/// 0.35 ms into it; busy, the burst asked again as no burst. A burst now
/// runs its first quantum before a waiter of its class
/// (`sched::tests::high`).
#[test]
fn high_reconnects_with_long_command_lines_beside_held_high_connections() {
    let on = |members, period_ms, duty, stagger, reconnect, kib, text| Cohort {
        play: Play::Shim {
            class: Priority::High,
            work: true,
            recall: Recall::Honest,
            uuids: 0,
        },
        members,
        procs: 1,
        start_ms: 0,
        period_ms,
        duty,
        stagger,
        reconnect,
        respawn: false,
        argv: Argv { kib, text },
        slow: false,
    };
    let s = Strategy {
        cohorts: vec![
            on(24, 17, 10, 25, true, 76, Text::Controls),
            on(24, 2000, 50, 0, false, 0, Text::Plain),
        ],
    };
    let o = evaluate(Invariant::Service, &s, &Bounds::FULL);
    assert!(o.harm <= 1.0, "service: harm {:.3}: {}", o.harm, o.figures);
}

/// Found by seed 77's search at budget 480 (2026-11-29), and broken
/// before that day's changes too: a `normal` connection that holds
/// without launching, of the same process as a `low` connection that
/// launches 0.4 ms in every 10 ms on a new connection each time. At a
/// sample the `low` one had gone, so the process's work was credited to
/// the `normal` one as its only connection there, which then held a
/// third of a second at a time, proven, while the `low` victim waited on
/// an idle GPU (harm 0.40). A process's work is now evidence for its
/// connection only where that connection was its one on the GPU since the
/// previous sample, and never more than the time it held.
#[test]
fn a_pretender_borrows_no_work_from_its_process_s_connections_that_came_and_went() {
    let s = Strategy {
        cohorts: vec![
            Cohort {
                play: shim(Priority::Low, true, Recall::Ignore),
                members: 1,
                procs: 1,
                start_ms: 697,
                period_ms: 10,
                duty: 4,
                stagger: 0,
                reconnect: true,
                respawn: false,
                argv: Argv::SHORT,
                slow: false,
            },
            Cohort {
                play: shim(Priority::Normal, false, Recall::Honest),
                members: 1,
                procs: 0,
                start_ms: 100,
                period_ms: 640,
                duty: 85,
                stagger: 0,
                reconnect: true,
                respawn: false,
                argv: Argv::SHORT,
                slow: false,
            },
        ],
    };
    holds(Invariant::Idle, &s);
}

/// Seed 9's search at budget 480 (2026-11-29) reported fairness broken
/// (harm 0.26) against 8 connections of one process taking turns at a
/// lease for `high` and 2 `low` shims of the same process holding
/// without work on a new connection each time. The broker was right and
/// the oracle wrong: a job's priority is its processes' (the shims held
/// as `high` while a lease was open, and so were owed half the GPU), but
/// the oracle took their class from their registration and owed the
/// victim all of it. The oracle now gives a process's shims its open
/// `high` lease's class; the victim keeps its part.
#[test]
fn shims_of_a_process_with_a_high_lease_are_owed_a_high_users_part() {
    let s = Strategy {
        cohorts: vec![
            Cohort {
                play: Play::Lease {
                    want: Want::High,
                    queued: true,
                },
                members: 8,
                procs: 1,
                start_ms: 0,
                period_ms: 160,
                duty: 50,
                stagger: 1,
                reconnect: false,
                respawn: false,
                argv: Argv::SHORT,
                slow: false,
            },
            Cohort {
                play: shim(Priority::Low, false, Recall::Reask),
                members: 2,
                procs: 0,
                start_ms: 0,
                period_ms: 21,
                duty: 50,
                stagger: 50,
                reconnect: true,
                respawn: false,
                argv: Argv::SHORT,
                slow: false,
            },
        ],
    };
    holds(Invariant::Fairness, &s);
}

/// Found by seed 77's search at budget 480 (2026-11-29, after the
/// pretender above was mended), and the same harm before that day's
/// changes (9e8074a): 48 `low` connections of one process that come on
/// together for 0.4 ms in every 10 ms, each a new connection registering
/// a 2 KiB command line, and a `normal` process that holds without
/// launching. The `normal` one holds exactly its user's benefit of the
/// doubt (776 ms in 6 s); the rest is the broker's work: the holder's
/// release waits behind the other 47 registrations, so the busy `low`
/// victim is granted back 0.13 ms after the GPU went idle, every 10 ms.
/// Idle harm 0.152 against 0.150, where the scene's floor is 0.129; only
/// the search's bounds on the attacker's broker work (`Bounds::FULL`)
/// show it. A new holder's next message is now served ahead of the round,
/// as a revoked one's answer is.
#[test]
fn a_registration_storm_does_not_delay_the_release_that_frees_the_gpu_for_low() {
    let s = Strategy {
        cohorts: vec![
            Cohort {
                play: shim(Priority::Low, true, Recall::Ignore),
                members: 48,
                procs: 1,
                start_ms: 697,
                period_ms: 10,
                duty: 4,
                stagger: 0,
                reconnect: true,
                respawn: false,
                argv: Argv {
                    kib: 2,
                    text: Text::Fields,
                },
                slow: false,
            },
            Cohort {
                play: shim(Priority::Normal, false, Recall::Honest),
                members: 1,
                procs: 1,
                start_ms: 0,
                period_ms: 1614,
                duty: 58,
                stagger: 0,
                reconnect: false,
                respawn: false,
                argv: Argv::SHORT,
                slow: false,
            },
        ],
    };
    let o = evaluate(Invariant::Idle, &s, &Bounds::FULL);
    assert!(
        o.harm <= Invariant::Idle.threshold(),
        "idle: harm {:.3}: {}",
        o.harm,
        o.figures
    );
}

/// Found by the search at budget 480 (seed 20261126) on 2026-11-30: a
/// high burst waited 20 ms, a whole slice. The broker's turn over the
/// attacker's trickles and unread status took 2.3 ms; the victim's burst
/// ended inside it, but the node ran the victim's timer only after
/// delivering that turn's revoke, so the victim took itself for
/// mid-burst and asked again as no waker. The node now runs the timers
/// that fell due during a turn before the clients read its output, as
/// processes on their own CPUs would (`node.rs`); the broker was not
/// changed.
#[test]
fn service_seed_20261126() {
    let s = Strategy {
        cohorts: vec![
            Cohort {
                play: Play::Status { frames: 74 },
                members: 1,
                procs: 1,
                start_ms: 0,
                period_ms: 10,
                duty: 25,
                stagger: 0,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: true,
            },
            Cohort {
                play: Play::Shim {
                    class: Priority::High,
                    work: false,
                    recall: Recall::Honest,
                    uuids: 0,
                },
                members: 64,
                procs: 1,
                start_ms: 0,
                period_ms: 320,
                duty: 100,
                stagger: 57,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: false,
            },
            Cohort {
                play: Play::Trickle { kib: 232, bytes: 1 },
                members: 32,
                procs: 1,
                start_ms: 0,
                period_ms: 5,
                duty: 10,
                stagger: 10,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: false,
            },
        ],
    };
    holds(Invariant::Service, &s);
}

/// Seed 9 (`--budget 480`): a user's 64 connections of 54 processes at
/// `high`, taking turns in bursts, each recalled beside the low victim
/// and never answering. It broke `idle` (45.5%) against a scheduler that
/// kept the GPU for every recalled holder's answer: each kept 4 ms that
/// ran nothing, then the next burst took the GPU from the victim. The
/// GPU kept for an answer is now its user's benefit of the doubt.
#[test]
fn idle_seed_9_recalls_never_answered() {
    let s = Strategy {
        cohorts: vec![
            Cohort {
                play: Play::Shim {
                    class: Priority::Normal,
                    work: false,
                    recall: Recall::Reask,
                    uuids: 0,
                },
                members: 1,
                procs: 1,
                start_ms: 0,
                period_ms: 1281,
                duty: 100,
                stagger: 0,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: false,
            },
            Cohort {
                play: Play::Shim {
                    class: Priority::High,
                    work: true,
                    recall: Recall::Ignore,
                    uuids: 0,
                },
                members: 64,
                procs: 54,
                start_ms: 0,
                period_ms: 160,
                duty: 5,
                stagger: 8,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: false,
            },
            Cohort {
                play: Play::Shim {
                    class: Priority::Normal,
                    work: false,
                    recall: Recall::Reask,
                    uuids: 0,
                },
                members: 1,
                procs: 1,
                start_ms: 0,
                period_ms: 1281,
                duty: 100,
                stagger: 0,
                reconnect: false,
                respawn: false,
                argv: Argv {
                    kib: 0,
                    text: Text::Plain,
                },
                slow: false,
            },
        ],
    };
    holds(Invariant::Idle, &s);
}
