//! The log (SECURITY.md, invariant 6): every line a client can cause
//! draws on its user's log budget, the broker's own warnings never share
//! a limiter with users, and what a user chose is quoted, so that it can
//! forge neither a line nor a field. The core's lines are captured as the
//! broker writes them (tracing's fmt layer).

use std::sync::{Arc, Mutex};

use super::*;

/// Where the captured lines go.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;

    fn make_writer(&'a self) -> Captured {
        self.clone()
    }
}

/// What `f` logged at `info` and above, formatted as the broker's log is.
fn logged(f: impl FnOnce()) -> String {
    let out = Captured::default();
    let sub = tracing_subscriber::fmt()
        .with_writer(out.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    tracing::subscriber::with_default(sub, f);
    String::from_utf8(out.0.lock().unwrap().clone()).unwrap()
}

/// The `key=value` fields of a log line as a reader of structured logs
/// takes them: split at spaces outside double quotes, `\"` inside them a
/// quote.
fn fields(line: &str) -> Vec<(String, String)> {
    let mut tokens = Vec::new();
    let (mut tok, mut quoted, mut escaped) = (String::new(), false, false);
    for c in line.chars() {
        if quoted {
            tok.push(c);
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => quoted = false,
                _ => {}
            }
            continue;
        }
        match c {
            ' ' => tokens.push(std::mem::take(&mut tok)),
            '"' => {
                quoted = true;
                tok.push(c);
            }
            c => tok.push(c),
        }
    }
    tokens.push(tok);
    tokens
        .into_iter()
        .filter_map(|t| {
            let (k, v) = t.split_once('=')?;
            Some((k.to_owned(), v.to_owned()))
        })
        .collect()
}

fn field<'a>(fs: &'a [(String, String)], key: &str) -> Vec<&'a str> {
    fs.iter()
        .filter(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
        .collect()
}

/// The attack: a command line holding `uid=0 pid=1` and newlines made
/// fields of the root broker's own record (the command was logged
/// unquoted), and, before escaping, whole lines.
#[test]
fn a_command_with_fields_and_newlines_forges_neither_fields_nor_lines() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let p = t.spawn(1);
    let c = t.connect_shim(p, BOB);
    let command = "python x\" uid=0 pid=1 \\\" job=9\nINFO gpufrac_broker: registered uid=0 pid=1";
    let log = logged(|| {
        t.send(
            c,
            &ClientMsg::Register {
                command: command.into(),
                devices: vec![DeviceReg {
                    uuid: uuid(1),
                    ordinal: 0,
                    mem_cap: 0,
                    mem_total: 16 * GIB,
                }],
                share: None,
                limit: None,
                priority: Priority::Normal,
            },
        );
    });
    assert!(
        t.recv(c)
            .iter()
            .any(|m| matches!(m, ServerMsg::Registered { .. }))
    );
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(lines.len(), 1, "one line:\n{log}");
    let fs = fields(lines[0]);
    assert_eq!(field(&fs, "uid"), [BOB.to_string()], "{}", lines[0]);
    assert_eq!(field(&fs, "pid"), [p.to_string()], "{}", lines[0]);
    assert!(
        field(&fs, "job").iter().all(|j| *j == "None"),
        "{}",
        lines[0]
    );
    let shown = field(&fs, "command");
    assert_eq!(shown.len(), 1);
    assert!(shown[0].starts_with("\"python x\\\" uid=0") && shown[0].ends_with("uid=0 pid=1\""));
}

/// The attack: one refused lease a second from one user silenced, through
/// one limiter for the whole broker, every other user's refusals.
#[test]
fn one_users_refusals_never_silence_anothers() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let pinned = LeaseReq {
        pin: vec![Pin {
            uuid: uuid(1),
            mem: GIB,
        }],
        ..LeaseReq::default()
    };
    let log = logged(|| {
        for _ in 0..5 {
            let p = t.spawn(1);
            let c = t.connect_as(p, BOB);
            t.send(c, &pinned.clone().into());
            assert!(refused(&t.recv(c)).is_some());
            t.now += SEC;
        }
        let p = t.spawn(1);
        let c = t.connect_as(p, ALICE);
        t.send(c, &pinned.clone().into());
        assert!(refused(&t.recv(c)).is_some());
    });
    let refusals = |uid: u32| {
        log.lines()
            .filter(|l| {
                l.contains("refused a lease") && field(&fields(l), "uid") == [uid.to_string()]
            })
            .count()
    };
    assert_eq!(refusals(BOB), 5, "{log}");
    assert_eq!(refusals(ALICE), 1, "{log}");
}

/// Every refusal of a lease says so in one line, with whose it was and
/// why in a bounded word and in the words the client got, quoted; a
/// user's flood of refusals stays within its log budget.
#[test]
fn each_refusal_is_one_line_within_its_users_budget() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let mut refused_n = 0;
    let log = logged(|| {
        let p = t.spawn(1);
        let holder = t.connect_as(p, ALICE);
        t.lease(holder, 1, 0, false);
        t.advance(SEC);
        for _ in 0..300 {
            let p = t.spawn(1);
            let c = t.connect_as(p, BOB);
            t.lease(c, 1, 0, true);
            t.turn();
            refused_n += usize::from(refused(&t.recv(c)).is_some());
            t.b.hangup(c);
            t.turn();
            t.now += SEC / 300;
        }
    });
    assert_eq!(refused_n, 300);
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("refused a lease"))
        .collect();
    let first = fields(lines[0]);
    assert_eq!(field(&first, "uid"), [BOB.to_string()], "{}", lines[0]);
    assert_eq!(field(&first, "reason"), ["\"no_room\""], "{}", lines[0]);
    assert!(
        field(&first, "why")[0].starts_with("\"no room now for --gpus 1"),
        "{}",
        lines[0]
    );
    // Its burst and ten a second after it.
    assert!(
        lines.len() > 10 && lines.len() <= LOG_BURST as usize + 10 + 1,
        "{} refusal lines:\n{log}",
        lines.len()
    );
}

/// The state file warning is the broker's own: a user's refusals never
/// use up its limiter.
#[test]
fn the_state_file_warning_is_never_silenced_by_a_user() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let log = logged(|| {
        let p = t.spawn(1);
        let c = t.connect_as(p, BOB);
        t.send(
            c,
            &LeaseReq {
                token: 5,
                ..lease(0, GIB, true)
            }
            .into(),
        );
        assert!(refused(&t.recv(c)).is_some());
        t.b.saves.changed();
        let (seq, _) = t.b.take_state(t.now).expect("a state to write");
        t.b.state_saved(t.now, seq, Err("disk full".into()));
    });
    assert!(log.contains("refused a lease"), "{log}");
    assert!(
        log.contains("cannot write the state file: disk full"),
        "{log}"
    );
}

/// The attack: lease churn wrote 600 "lease granted" lines a second,
/// outside the per-user budget (10 a second). Every lease line is in it.
#[test]
fn lease_churn_lines_stay_within_the_users_budget() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let mut leases = 0;
    let log = logged(|| {
        for _ in 0..600 {
            let p = t.spawn(1);
            let c = t.connect_as(p, BOB);
            t.lease(c, 0, 1, true);
            t.turn();
            leases += usize::from(refused(&t.recv(c)).is_none());
            t.b.hangup(c);
            t.turn();
            t.now += SEC / 600;
        }
    });
    assert_eq!(leases, 600);
    let about_bob: Vec<&str> = log
        .lines()
        .filter(|l| field(&fields(l), "uid") == [BOB.to_string()])
        .collect();
    let (counts, lines): (Vec<&str>, Vec<&str>) =
        about_bob.iter().partition(|l| l.contains("left out"));
    // Its burst, and ten a second after it; what was held back is said
    // with the next line let through.
    let budget = LOG_BURST as usize + 10 + 1;
    assert!(
        lines.len() <= budget,
        "{} lines about bob in a second:\n{log}",
        lines.len()
    );
    assert!(!counts.is_empty() && counts.len() <= lines.len(), "{log}");
}

/// The fields of Bob's first line saying `what`.
fn bobs_line(log: &str, what: &str) -> Vec<(String, String)> {
    log.lines()
        .find(|l| l.contains(what) && l.contains(&format!("uid={BOB}")))
        .map(fields)
        .unwrap_or_else(|| panic!("no {what} line:\n{log}"))
}

/// Issue 33's lines: a lease says when it is queued, when it is placed
/// (and how long it waited), and when it ends (how long it was held, the
/// GPU time its processes used, their peak memory together).
#[test]
fn a_lease_says_when_it_is_queued_placed_and_ended() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let log = logged(|| {
        let (holder, run, p2) = t.bob_waits_behind_alice("python train.py");
        t.advance(2 * SEC);
        t.b.hangup(holder);
        t.advance(SEC / 10);
        assert!(leased(&t.recv(run)).is_some());
        // Its process, on the GPU for a second, 3 GiB in use.
        let child = t.spawn(p2);
        let shim = t.connect_shim(child, BOB);
        t.register(shim, Priority::Normal);
        t.send(
            shim,
            &ClientMsg::Usage {
                uuid: uuid(1),
                used: 3 * GIB,
                peak: 3 * GIB,
                ooms: 0,
            },
        );
        t.send(shim, &ClientMsg::Acquire { uuid: uuid(1) });
        assert!(granted(&t.recv(shim)));
        t.advance(SEC);
        t.b.hangup(run);
        t.advance(SEC / 10);
    });
    let line = |what: &str| bobs_line(&log, what);
    let queued = line("lease queued");
    assert_eq!(field(&queued, "command"), ["\"python train.py\""]);
    assert_eq!(field(&queued, "wants"), ["\"1 GPU\""]);
    let placed = line("lease placed");
    let waited: f64 = field(&placed, "waited_s")[0].parse().unwrap();
    assert!((2.0..2.2).contains(&waited), "{waited}");
    let ended = line("lease ended");
    let held: f64 = field(&ended, "held_s")[0].parse().unwrap();
    let gpu: f64 = field(&ended, "gpu_s")[0].parse().unwrap();
    assert!((1.0..1.3).contains(&held), "{held}");
    assert!((0.9..=held).contains(&gpu), "{gpu}");
    assert_eq!(field(&ended, "peak"), ["\"3.00 GiB\""]);
}

/// A request that leaves the queue before it is placed held no lease: its
/// last line says it left and how long it waited, not "lease ended" with
/// a held time of "-".
#[test]
fn a_request_that_leaves_the_queue_says_so_and_how_long_it_waited() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let log = logged(|| {
        let (_, run, _) = t.bob_waits_behind_alice("python eval.py");
        t.advance(3 * SEC);
        t.b.hangup(run);
        t.advance(SEC / 10);
    });
    assert!(
        !log.lines()
            .any(|l| l.contains("lease ended") && l.contains(&format!("uid={BOB}"))),
        "{log}"
    );
    let left = bobs_line(&log, "queued request left before it was placed");
    assert_eq!(field(&left, "command"), ["\"python eval.py\""]);
    let waited: f64 = field(&left, "waited_s")[0].parse().unwrap();
    assert!((3.0..3.2).contains(&waited), "{waited}");
}
