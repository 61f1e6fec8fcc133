//! The view drawn into ratatui's test backend from statuses of a node
//! with two users, their jobs and a queue, and driven by keys: what the
//! frames say (not their exact bytes, which any change of style would
//! break). `tests/top.rs` draws them from a real broker.

use gpufrac_common::status::{
    GpuHistory, GpuStatus, History, JobShare, LeaseEntry, ProcStatus, QueueEntry, ShareHistory,
    Status, UserShare,
};
use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};

use super::app::{App, Detail, Pane, Popup};
use super::model::{Filter, Model, Owed, Row, Sort, ViewOpts, short};
use super::render_text;
use super::view::{short_size, spark};

const GIB: u64 = 1 << 30;

fn proc(pid: u32, uid: u32, job: Option<u32>, used: u64, target: f64, achieved: f64) -> ProcStatus {
    ProcStatus {
        pid,
        uid,
        job,
        command: format!("/opt/bin/train --rank {pid}"),
        mem_used: used,
        mem_peak: used + GIB,
        mem_cap: job.map(|_| 4 * GIB),
        share_target: target,
        share_achieved: achieved,
        state: if achieved > 0.5 { "holding" } else { "waiting" }.into(),
        priority: "normal".into(),
        ..ProcStatus::default()
    }
}

fn series(values: &[f32]) -> Vec<Option<f32>> {
    values.iter().map(|&v| Some(v)).collect()
}

/// GPU 0: user nobody's job 41 (two processes, 70% asked) and root's
/// job 77 (30%), root's job far below its target for ten seconds; GPU 1
/// idle; a request of nobody's queued for 2 GPUs.
fn node() -> Status {
    let gpu0 = GpuStatus {
        index: Some(0),
        mode: "time-slicing".into(),
        uuid: "GPU-0".into(),
        name: "H100".into(),
        total_mem: 16 * GIB,
        slots_total: 1,
        committed_mem: 8 * GIB,
        free_mem: 8 * GIB,
        utilization: Some(97),
        holder: Some(101),
        processes: vec![
            proc(101, 65534, Some(41), GIB, 0.35, 0.6),
            ProcStatus {
                priority: "high".into(),
                ..proc(102, 65534, Some(41), 2 * GIB, 0.35, 0.3)
            },
            proc(201, 0, Some(77), 3 * GIB, 0.3, 0.1),
        ],
        users: vec![
            UserShare {
                uid: 0,
                weight: 1.0,
                share_target: 0.3,
                share_achieved: 0.1,
                jobs: vec![JobShare {
                    job: Some(77),
                    weight: 30.0,
                    share_target: 0.3,
                    share_achieved: 0.1,
                    processes: 1,
                    ..JobShare::default()
                }],
                ..UserShare::default()
            },
            UserShare {
                uid: 65534,
                weight: 1.0,
                share_target: 0.7,
                share_achieved: 0.9,
                jobs: vec![JobShare {
                    job: Some(41),
                    weight: 70.0,
                    share_target: 0.7,
                    share_achieved: 0.9,
                    processes: 2,
                    ..JobShare::default()
                }],
                ..UserShare::default()
            },
        ],
        ..GpuStatus::default()
    };
    let gpu1 = GpuStatus {
        index: Some(1),
        uuid: "GPU-1".into(),
        name: "H100".into(),
        total_mem: 16 * GIB,
        free_mem: 16 * GIB,
        utilization: Some(0),
        ..GpuStatus::default()
    };
    let off = series(&[0.1; 12]);
    Status {
        version: "0.1.0".into(),
        socket: "/run/gpufrac/broker.sock".into(),
        gpus: vec![gpu0, gpu1],
        queue: vec![QueueEntry {
            position: 1,
            pid: 300,
            uid: 65534,
            command: "torchrun big.py".into(),
            wants: "2 GPUs".into(),
            want_gpus: Some(2),
            waiting_s: 75.0,
            why: "needs 2 whole GPUs; 1 free (index 1); GPU 0: held whole by jobs 41, 77".into(),
            waits_for: vec![0],
            ..QueueEntry::default()
        }],
        leases: vec![
            LeaseEntry {
                pid: 41,
                uid: 65534,
                gpus: vec![0],
                mem_cap: Some(4 * GIB),
                ..LeaseEntry::default()
            },
            LeaseEntry {
                pid: 77,
                uid: 0,
                gpus: vec![0],
                mem_cap: Some(4 * GIB),
                ..LeaseEntry::default()
            },
        ],
        history: Some(History {
            every_s: 1.0,
            samples: 12,
            age_s: 0.2,
            queue: vec![1; 12],
            gpus: vec![GpuHistory {
                uuid: "GPU-0".into(),
                utilization: vec![Some(97); 12],
                allocated: vec![Some(6 * GIB); 12],
                committed: vec![Some(8 * GIB); 12],
            }],
            shares: vec![
                ShareHistory {
                    gpu: "GPU-0".into(),
                    uid: 0,
                    level: "job".into(),
                    job: Some(77),
                    target: series(&[0.3; 12]),
                    achieved: off.clone(),
                    ..ShareHistory::default()
                },
                ShareHistory {
                    gpu: "GPU-0".into(),
                    uid: 65534,
                    level: "job".into(),
                    job: Some(41),
                    target: series(&[0.7; 12]),
                    achieved: series(&[0.7; 12]),
                    ..ShareHistory::default()
                },
            ],
            dropped: 0,
        }),
        ..Status::default()
    }
}

/// The node as top saw it over ten seconds: each unit owed its target
/// and given what it achieved, a second at a time.
fn model() -> Model {
    let mut m = Model::default();
    for k in 0..11 {
        m.update(node_after(k as f64));
    }
    m
}

/// `node()` after `secs` seconds of owing each unit its target and giving
/// it what it achieved.
fn node_after(secs: f64) -> Status {
    let mut st = node();
    for g in &mut st.gpus {
        for p in &mut g.processes {
            p.entitled_s = secs * p.share_target;
            p.gpu_time_s = secs * p.share_achieved;
        }
        for u in &mut g.users {
            u.entitled_s = secs * u.share_target;
            u.gpu_time_s = secs * u.share_achieved;
            for j in &mut u.jobs {
                j.entitled_s = secs * j.share_target;
                j.gpu_time_s = secs * j.share_achieved;
            }
        }
    }
    st
}

fn app() -> App {
    App::new(ViewOpts {
        me: 0,
        ..ViewOpts::default()
    })
}

fn press(app: &mut App, m: &Model, keys: &str) {
    for c in keys.chars() {
        let code = match c {
            '\n' => KeyCode::Enter,
            '\t' => KeyCode::Tab,
            '\x1b' => KeyCode::Esc,
            '↓' => KeyCode::Down,
            '↑' => KeyCode::Up,
            '\x08' => KeyCode::Backspace,
            '\x15' => {
                app.key(KeyEvent::new(KeyCode::Char('u'), KeyModifiers::CONTROL), m);
                continue;
            }
            c => KeyCode::Char(c),
        };
        app.key(KeyEvent::new(code, KeyModifiers::NONE), m);
    }
}

fn line_with<'a>(frame: &'a str, what: &str) -> &'a str {
    frame
        .lines()
        .find(|l| l.contains(what))
        .unwrap_or_else(|| panic!("no line with {what:?} in\n{frame}"))
}

#[test]
fn an_80x24_frame_shows_caps_shares_users_jobs_and_the_queue() {
    let m = model();
    let t = render_text(&m, &mut app(), 80, 24);
    assert_eq!(t.lines().count(), 24, "{t}");
    assert!(t.lines().all(|l| l.chars().count() <= 80), "{t}");
    let header = t.lines().next().unwrap();
    for what in [
        "broker 0.1.0",
        "mode plain",
        "2 GPUs",
        "3 processes",
        "queue 1",
        "2 leases",
    ] {
        assert!(header.contains(what), "{what}: {header}");
    }
    // A strip per GPU: the bar with both leases' caps marked, the figures,
    // utilisation with its history.
    let gpu0 = line_with(&t, "GPU 0 H100");
    assert_eq!(gpu0.matches('┃').count(), 2, "{gpu0}");
    assert!(gpu0.contains("alloc 6G commit 8G free 8G of 16G"), "{gpu0}");
    assert!(line_with(&t, "util  97%").contains("███"), "{t}");
    // Users, then their jobs, then processes, with target/achieved; root's
    // job is marked off its target.
    let rows: Vec<&str> = t
        .lines()
        .skip_while(|l| !l.contains("USER / JOB / PROCESS"))
        .skip(1)
        .take(6)
        .collect();
    assert!(
        rows[0].contains("▾ root") && rows[0].contains("30/10%"),
        "{t}"
    );
    assert!(
        rows[1].contains("▾ job 77") && rows[1].contains("30/10%!"),
        "{t}"
    );
    assert!(
        rows[2].contains("201 train --rank 201") && rows[2].contains("3G/4G"),
        "{t}"
    );
    assert!(
        rows[3].contains("▾ nobody") && rows[3].contains("70/90%"),
        "{t}"
    );
    assert!(
        rows[4].contains("▾ job 41") && rows[4].contains("3G/4G") && !rows[4].contains('!'),
        "{t}"
    );
    assert!(
        rows[5].contains("101 train") && rows[5].contains("holding"),
        "{t}"
    );
    // The queue: who, what, how long and why.
    let q = line_with(&t, "1m15s");
    assert!(
        q.contains("nobody") && q.contains("1m15s") && q.contains("needs 2 whole GPUs"),
        "{t}"
    );
    assert!(
        line_with(&t, "held whole by jobs 41, 77")
            .trim_start()
            .starts_with("held"),
        "the why wraps to a second line:\n{t}"
    );
    assert!(
        t.lines().last().unwrap().starts_with("q quit ? help"),
        "{t}"
    );
}

#[test]
fn smaller_frames_degrade_without_overflowing() {
    let m = model();
    for (w, h) in [
        (132, 50),
        (100, 30),
        (60, 20),
        (40, 12),
        (30, 8),
        (20, 5),
        (10, 3),
        (1, 1),
    ] {
        let mut a = app();
        let t = render_text(&m, &mut a, w, h);
        assert_eq!(t.lines().count(), usize::from(h), "{w}x{h}:\n{t}");
        assert!(
            t.lines().all(|l| l.chars().count() <= usize::from(w)),
            "{w}x{h}:\n{t}"
        );
        if h >= 8 && w >= 30 {
            assert!(t.starts_with("gpufrac top"), "{w}x{h}:\n{t}");
            assert!(
                t.contains("▾ root"),
                "{w}x{h}: users are what the view is for\n{t}"
            );
        }
        // Wider frames show more of each process, never less.
        if w >= 100 {
            let flat = {
                let mut a = app();
                press(&mut a, &m, "t");
                render_text(&m, &mut a, w, h)
            };
            for col in [
                "PID", "USER", "JOB", "CLASS", "ASKED", "USED/CAP", "SHARE", "STATE", "COMMAND",
            ] {
                assert!(flat.contains(col), "{w}x{h} flat: {col}\n{flat}");
            }
            // No process here runs in a container: no empty column.
            assert!(!flat.contains("CONTAINER"), "{w}x{h} flat:\n{flat}");
        }
        // At 80 columns the flat view keeps CLASS (how a process is
        // scheduled) before a container (where it runs).
        if w == 80 || (w, h) == (100, 30) {
            let mut a = app();
            press(&mut a, &m, "t");
            let flat = render_text(&m, &mut a, w, h);
            assert!(flat.contains("CLASS"), "{w}x{h} flat:\n{flat}");
        }
    }
}

#[test]
fn keys_change_the_view() {
    let m = model();
    let mut a = app();
    // t: the flat table, by pid.
    press(&mut a, &m, "t");
    let t = render_text(&m, &mut a, 120, 30);
    assert!(t.contains("Processes (3)") && !t.contains("▾"), "{t}");
    let pids: Vec<&str> = t
        .lines()
        .skip_while(|l| !l.contains("PID"))
        .skip(1)
        .take(3)
        .map(|l| l.split_whitespace().next().unwrap())
        .collect();
    assert_eq!(pids, ["101", "102", "201"], "{t}");
    // s: the next key (user), twice more (mem); S reverses.
    press(&mut a, &m, "ss");
    assert_eq!(a.opts.sort, Sort::Memory);
    let order = |a: &App| -> Vec<u32> {
        m.rows(&a.opts)
            .iter()
            .map(|r| match *r {
                Row::Proc { gpu, proc, .. } => m.status.gpus[gpu].processes[proc].pid,
                _ => 0,
            })
            .collect()
    };
    assert_eq!(order(&a), [201, 102, 101]);
    press(&mut a, &m, "S");
    assert_eq!(order(&a), [101, 102, 201]);
    // /: a filter typed, Enter applies it; the header says so.
    press(&mut a, &m, "/user:nobody\n");
    assert_eq!(a.opts.filter, Filter::parse("user:nobody").unwrap());
    let t = render_text(&m, &mut a, 120, 30);
    assert!(
        t.contains("Processes (2)") && t.contains("filter: user:nobody"),
        "{t}"
    );
    // The filter opens with what it is; Backspace and Ctrl-U edit it.
    press(&mut a, &m, "/\x08");
    assert_eq!(a.popup, Some(Popup::Filter("user:nobod".into())));
    // A filter that does not parse is said, and kept for correcting.
    press(&mut a, &m, "\x15class:urgent\n");
    assert!(
        a.message
            .as_deref()
            .is_some_and(|e| e.contains("class:high")),
        "{:?}",
        a.message
    );
    assert!(matches!(a.popup, Some(Popup::Filter(_))));
    press(&mut a, &m, "\x1b");
    assert_eq!(a.popup, None);
    // u: only mine (root here): root's process and no queued request.
    press(&mut a, &m, "/\n");
    a.popup = None;
    a.opts.filter = Filter::default();
    press(&mut a, &m, "u");
    assert_eq!(order(&a), [201]);
    let t = render_text(&m, &mut a, 120, 30);
    assert!(
        t.contains("queue: 1 waiting, none matching") && t.contains("only root"),
        "{t}"
    );
    press(&mut a, &m, "u");
    // f: frozen, said in the header.
    press(&mut a, &m, "f");
    assert!(a.frozen);
    assert!(
        render_text(&m, &mut a, 120, 30)
            .lines()
            .next()
            .unwrap()
            .contains("FROZEN")
    );
    // Tab: the queue, then the GPUs, then back.
    press(&mut a, &m, "\t");
    assert_eq!(a.pane, Pane::Queue);
    press(&mut a, &m, "\n");
    assert_eq!(a.popup, Some(Popup::Detail(Detail::Queued { pid: 300 })));
    let t = render_text(&m, &mut a, 120, 30);
    assert!(
        t.contains("queued request of 300") && t.contains("GPU 0: held whole by jobs 41, 77"),
        "{t}"
    );
    press(&mut a, &m, "\x1b\t");
    assert_eq!(a.pane, Pane::Gpus);
    press(&mut a, &m, "\t");
    assert_eq!(a.pane, Pane::Procs);
    // ?: help, and any key closes it; q quits, and so does Esc.
    press(&mut a, &m, "?");
    assert!(render_text(&m, &mut a, 120, 30).contains("tree (users → jobs → processes)"));
    press(&mut a, &m, "?");
    assert_eq!(a.popup, None);
    assert!(!a.quit);
    press(&mut a, &m, "q");
    assert!(a.quit);
    let mut b = app();
    press(&mut b, &m, "\x1b");
    assert!(b.quit);
}

#[test]
fn enter_shows_a_process_with_its_history() {
    let mut m = model();
    // Three more samples since top opened.
    for achieved in [0.2, 0.4, 0.6] {
        let mut st = node();
        st.gpus[0].processes[0].share_achieved = achieved;
        m.update(st);
    }
    let mut a = app();
    // The tree: root, job 77, 201, nobody, job 41, 101: the sixth row.
    press(&mut a, &m, "jjjjj\n");
    assert_eq!(
        a.popup,
        Some(Popup::Detail(Detail::Proc {
            gpu: "GPU-0".into(),
            pid: 101
        }))
    );
    let t = render_text(&m, &mut a, 100, 30);
    assert!(t.contains("process 101"), "{t}");
    assert!(
        line_with(&t, "command").contains("/opt/bin/train --rank 101"),
        "{t}"
    );
    assert!(
        line_with(&t, "memory").contains("1G used, cap 4G, peak 2G"),
        "{t}"
    );
    // Its own four samples, its job's and user's from the broker.
    let achieved = line_with(&t, "achieved     ");
    assert!(
        achieved.contains(&spark(&series(&[0.6, 0.2, 0.4, 0.6]), 4, 1.0)),
        "{t}"
    );
    assert!(line_with(&t, "its job").contains("▆▆▆"), "{t}");
    // Up on the first row stays there; Enter on a job is its share.
    press(&mut a, &m, "\x1bkkkkkkkkj\n");
    assert!(matches!(
        a.popup,
        Some(Popup::Detail(Detail::Share {
            uid: 0,
            job: Some(Some(77)),
            ..
        }))
    ));
    let t = render_text(&m, &mut a, 100, 30);
    assert!(
        t.contains("job 77 of root")
            && line_with(&t, "now").contains("target 30%")
            && line_with(&t, "now").contains("achieved 10%"),
        "{t}"
    );
}

/// (owed, got) a second apart, from rates of each a second.
fn owed(rates: &[(f64, f64)]) -> Owed {
    let mut acc = (0.0, 0.0);
    let mut out = Owed::from([acc]);
    for &(o, g) in rates {
        acc = (acc.0 + o, acc.1 + g);
        out.push_back(acc);
    }
    out
}

/// The `!` mark: less than owed by more than 5 points and a fifth of
/// what was owed, over at least five samples; never for more than owed,
/// for an idle unit, or a small miss (docs/cli.md says the same).
#[test]
fn short_needs_a_real_debt_and_enough_history() {
    assert!(short(&owed(&[(0.3, 0.1); 10])));
    assert!(!short(&owed(&[(0.3, 0.28); 10])), "2 points");
    assert!(!short(&owed(&[(0.05, 0.0); 10])), "under 5 points");
    assert!(!short(&owed(&[(0.8, 0.7); 10])), "under a fifth");
    assert!(short(&owed(&[(0.8, 0.6); 10])));
    assert!(!short(&owed(&[(0.3, 0.1); 3])), "too few samples");
    assert!(!short(&owed(&[(0.0, 0.0); 10])), "idle");
    assert!(!short(&owed(&[(0.3, 0.9); 10])), "more than owed");
}

#[test]
fn filters_say_what_is_wrong() {
    assert!(Filter::parse("gpu:x").unwrap_err().contains("gpu:0"));
    assert!(
        Filter::parse("class:urgent")
            .unwrap_err()
            .contains("class:normal")
    );
    let m = model();
    let count = |f: &str| {
        let opts = ViewOpts {
            tree: false,
            filter: Filter::parse(f).unwrap(),
            ..ViewOpts::default()
        };
        (m.rows(&opts).len(), m.queue_rows(&opts).len())
    };
    assert_eq!(count(""), (3, 1));
    assert_eq!(count("user:root"), (1, 0));
    assert_eq!(count("user:65534"), (2, 1));
    assert_eq!(count("job:41"), (2, 0));
    assert_eq!(count("gpu:1"), (0, 0));
    assert_eq!(count("gpu:0"), (3, 1));
    assert_eq!(count("class:high"), (1, 0));
    assert_eq!(count("rank 10"), (2, 0));
    assert_eq!(count("torchrun"), (0, 1));
}

#[test]
fn sizes_and_sparklines() {
    assert_eq!(short_size(0), "0B");
    assert_eq!(short_size(512 << 20), "512M");
    assert_eq!(short_size(3 * GIB / 2), "1.5G");
    assert_eq!(short_size(80 * GIB), "80G");
    assert_eq!(
        spark(&[None, Some(0.0), Some(0.5), Some(1.0), Some(2.0)], 10, 1.0),
        " ▁▅██"
    );
    assert_eq!(spark(&series(&[0.0, 1.0]), 1, 1.0), "█");
}

/// A process the driver lists outside the shim: "other" in the GPU's
/// figures and bar, a row of its own with its pid and memory (tree and
/// flat, kept by `gpu:` and `other`, left out by `u` and `user:`), and
/// what the driver says in the GPU's detail.
#[test]
fn processes_outside_the_shim_show_as_other() {
    let mut st = node();
    let g = &mut st.gpus[1];
    g.unmanaged = vec![gpufrac_common::status::UnmanagedProc {
        pid: 4242,
        mem: 3 * GIB,
    }];
    g.unmanaged_processes = 1;
    g.unmanaged_mem = 3 * GIB;
    g.free_mem = 13 * GIB;
    g.driver = Some(gpufrac_common::status::DriverMem {
        total: 16 * GIB,
        used: 3 * GIB,
        free: 13 * GIB,
    });
    let mut m = Model::default();
    m.update(st);
    let t = render_text(&m, &mut app(), 100, 30);
    let gpu1 = line_with(&t, "GPU 1 H100");
    assert!(gpu1.contains("other 3G free 13G of 16G"), "{gpu1}");
    assert!(gpu1.contains('▓'), "{gpu1}");
    let row = line_with(&t, "4242 other");
    assert!(row.contains("3G/-"), "{t}");
    let mut flat = app();
    flat.opts.tree = false;
    let f = render_text(&m, &mut flat, 132, 30);
    assert!(line_with(&f, "4242").contains("other"), "{f}");
    for (filter, shown) in [
        ("gpu:1", true),
        ("other", true),
        ("gpu:0", false),
        ("user:root", false),
    ] {
        let mut a = app();
        a.opts.filter = Filter::parse(filter).unwrap();
        let rows = m.rows(&a.opts);
        assert_eq!(
            rows.iter().any(|r| matches!(r, Row::Other { .. })),
            shown,
            "{filter}"
        );
    }
    let mut mine = app();
    mine.opts.mine = true;
    assert!(
        !m.rows(&mine.opts)
            .iter()
            .any(|r| matches!(r, Row::Other { .. }))
    );
    // Enter on it opens its GPU, which says what the driver says.
    let mut a = app();
    let at = m
        .rows(&a.opts)
        .iter()
        .position(|r| matches!(r, Row::Other { .. }))
        .unwrap();
    press(&mut a, &m, &"j".repeat(at));
    press(&mut a, &m, "\n");
    let d = render_text(&m, &mut a, 100, 30);
    assert!(
        d.contains("1 process not under the shim hold 3G: 4242 (3G)"),
        "{d}"
    );
    assert!(d.contains("3G used, 13G free (NVML"), "{d}");
}

/// What each unit asked beside what it gets: a user's weight, a job's
/// `--gpu-compute` (or its processes' weight) and `--gpu-limit`, a
/// process's limit; `high` as above the shares, not a 0% target;
/// refusals summed up to jobs and users.
#[test]
fn rows_say_what_was_asked_and_what_high_is() {
    let mut st = node();
    st.leases[0].compute = Some(70.0);
    st.leases[0].limit = Some(0.8);
    st.gpus[0].processes[2].ooms = 3;
    st.gpus[0].processes[2].limit = Some(0.5);
    let mut m = Model::default();
    m.update(st);
    let t = render_text(&m, &mut app(), 120, 30);
    let job41 = line_with(&t, "▾ job 41");
    assert!(job41.contains("70% ≤80%"), "{t}");
    assert!(line_with(&t, "▾ job 77").contains("w30"), "{t}");
    assert!(line_with(&t, "▾ nobody").contains("w1"), "{t}");
    // The high process: above the shares, asked high.
    let high = line_with(&t, "102 train");
    assert!(high.contains("high/30%") && high.contains(" high "), "{t}");
    // Root's process was refused three times: its job and user say so.
    for row in ["▾ root", "▾ job 77", "201 train"] {
        assert!(
            line_with(&t, row).split_whitespace().any(|w| w == "3"),
            "{row}: {t}"
        );
    }
    assert!(line_with(&t, "201 train").contains("≤50%"), "{t}");
}

/// A tree longer than its pane says how much more there is below, and
/// above once scrolled: a cut view never reads as whole.
#[test]
fn a_cut_tree_says_how_much_more() {
    let mut st = node();
    let more: Vec<ProcStatus> = (0..20)
        .map(|i| proc(300 + i, 65534, Some(41), GIB, 0.01, 0.01))
        .collect();
    st.gpus[0].processes.extend(more);
    let mut m = Model::default();
    m.update(st);
    let mut a = app();
    let t = render_text(&m, &mut a, 100, 20);
    assert!(line_with(&t, "more below").starts_with("…"), "{t}");
    assert!(!t.contains(" above"), "{t}");
    // Down to the end: all that is left is above.
    press(&mut a, &m, "G");
    let t = render_text(&m, &mut a, 100, 20);
    assert!(t.contains("above") && !t.contains("more below"), "{t}");
}

/// A frame left after the broker stopped answering says how old it is
/// (and is dimmed), so that nobody reads it as now.
#[test]
fn a_stale_frame_says_its_age() {
    let m = model();
    let mut a = app();
    let t = render_text(&m, &mut a, 100, 30);
    assert!(!t.contains("STALE"), "{t}");
    a.message = Some("broker: no broker at /run/gpufrac/broker.sock".into());
    let t = render_text(&m, &mut a, 100, 30);
    assert!(t.lines().next().unwrap().contains("STALE 0s old"), "{t}");
}
