//! A flooded or stalled broker never hangs a user process past a bounded
//! time: connecting has a deadline (a Unix `connect` blocks while the
//! listener's accept queue is full), and a broker that stops answering
//! while a process waits for a grant is treated as gone in optional mode.

mod support;
use std::io::{BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::*;

const MS: u64 = 1_000_000;

/// A socket that is listened on and never accepted from, with its accept
/// queue full (backlog 0 holds one connection): what a flood of idle
/// connections, or a stopped broker with a full queue, looks like.
struct Jam {
    _listener: UnixListener,
    _fillers: Vec<UnixStream>,
}

impl Jam {
    fn new(path: &Path) -> Jam {
        let l = UnixListener::bind(path).unwrap();
        // SAFETY: shrinking the backlog of our own listening socket.
        assert_eq!(unsafe { libc::listen(l.as_raw_fd(), 0) }, 0);
        let mut fillers = Vec::new();
        loop {
            // A deadline of now: one non-blocking try.
            match gpufrac_common::net::connect_unix(path, Instant::now()) {
                Ok(s) => fillers.push(s),
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => break,
                Err(e) => panic!("filling the accept queue: {e}"),
            }
            assert!(fillers.len() < 64, "the accept queue never filled");
        }
        assert!(!fillers.is_empty());
        Jam {
            _listener: l,
            _fillers: fillers,
        }
    }
}

/// Runs `cmd` to completion, failing the test (and killing it) if it takes
/// longer than `limit`. Returns its output and how long it took.
fn run_bounded(mut cmd: Command, limit: Duration) -> (Output, Duration) {
    let t = Instant::now();
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let o = child.wait_with_output().unwrap();
            panic!(
                "still running after {limit:?}: {:?}\n{}{}",
                cmd,
                stdout(&o),
                stderr(&o)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let took = t.elapsed();
    (child.wait_with_output().unwrap(), took)
}

#[test]
fn status_fails_with_a_message_when_the_broker_does_not_answer() {
    let dir = Scratch::new("jam-status");
    let path = dir.0.join("broker.sock");
    let _jam = Jam::new(&path);
    let mut cmd = sim_command(&artifacts().gpufrac, "16G", false);
    cmd.arg("status").arg("--socket").arg(&path);
    let (o, took) = run_bounded(cmd, Duration::from_secs(30));
    let err = stderr(&o);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "the broker at {} did not answer within 5 s (it may be overloaded or stopped)",
            path.display()
        )),
        "{err}"
    );
    assert!(took < Duration::from_secs(10), "took {took:?}");
}

#[test]
fn required_broker_that_does_not_answer_fails_cuinit_in_bounded_time() {
    // Two ways a broker can fail to answer: its accept queue is full (the
    // connect itself would block), or it accepted the connection and says
    // nothing (the handshake would block).
    let dir = Scratch::new("jam-required");
    let jammed = dir.0.join("jammed.sock");
    let _jam = Jam::new(&jammed);
    let mute = dir.0.join("mute.sock");
    let _mute = UnixListener::bind(&mute).unwrap();
    let spawn = |sock: &Path| {
        let mut cmd = sim_command(&artifacts().probe, "16G", true);
        cmd.env("GPUFRAC_BROKER", "required")
            .env("GPUFRAC_SOCKET", sock)
            .arg("ctx");
        cmd
    };
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| run_bounded(spawn(&jammed), Duration::from_secs(30)));
        let b = s.spawn(|| run_bounded(spawn(&mute), Duration::from_secs(30)));
        (a.join().unwrap(), b.join().unwrap())
    });
    for ((o, took), sock) in [(a, &jammed), (b, &mute)] {
        let err = stderr(&o);
        assert_eq!(
            num(&line(&o, "init", 0), "rc"),
            802,
            "CUDA_ERROR_SYSTEM_NOT_READY: {err}"
        );
        assert!(
            err.contains(&format!(
                "GPUFRAC_BROKER=required but the broker at {} did not answer within 5 s",
                sock.display()
            )),
            "{err}"
        );
        assert!(took < Duration::from_secs(10), "took {took:?}");
    }
}

/// A child whose output lines are collected as they come, killed on drop.
struct Watched {
    child: Child,
    out: Arc<Mutex<String>>,
    err: Arc<Mutex<String>>,
}

impl Watched {
    fn spawn(mut cmd: Command) -> Watched {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let collect = |r: Box<dyn std::io::Read + Send>| {
            let buf = Arc::new(Mutex::new(String::new()));
            let b = buf.clone();
            std::thread::spawn(move || {
                for l in BufReader::new(r).lines() {
                    let Ok(l) = l else { break };
                    let mut b = b.lock().unwrap();
                    b.push_str(&l);
                    b.push('\n');
                }
            });
            buf
        };
        let out = collect(Box::new(child.stdout.take().unwrap()));
        let err = collect(Box::new(child.stderr.take().unwrap()));
        Watched { child, out, err }
    }

    fn pid(&self) -> u64 {
        self.child.id() as u64
    }

    fn out(&self) -> String {
        self.out.lock().unwrap().clone()
    }

    fn err(&self) -> String {
        self.err.lock().unwrap().clone()
    }

    fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn signal(b: &Broker, sig: libc::c_int) {
    // SAFETY: signalling the broker child this test started.
    assert_eq!(unsafe { libc::kill(b.child.id() as i32, sig) }, 0);
}

/// Continues a stopped broker when the test ends, pass or fail, so that
/// nothing is left stopped (the broker itself is killed on drop).
struct Continue<'a>(&'a Broker);

impl Drop for Continue<'_> {
    fn drop(&mut self) {
        signal(self.0, libc::SIGCONT);
    }
}

/// The probe spinning 1 ms kernels, two in flight, from `start` to `end`
/// under the shim, wired to `b`.
fn spin(b: &Broker, start: u64, end: u64) -> Command {
    let mut cmd = b.client(&artifacts().probe);
    cmd.args([
        "ctx",
        "spin",
        &start.to_string(),
        &end.to_string(),
        &MS.to_string(),
        "2",
    ]);
    cmd
}

/// The spinners' window, from 1.5 s to 8 s from now: time to start and
/// register before it, and a stop inside it still leaves the stall bound
/// (3 s) to run out before its end.
fn window() -> (u64, u64) {
    let t0 = mono_ns();
    (t0 + 1500 * MS, t0 + 8000 * MS)
}

/// Whether any process `b`'s status lists on GPU 0 is as `f` says.
fn any_process(b: &Broker, f: impl Fn(&serde_json::Value) -> bool) -> bool {
    b.status()["gpus"][0]["processes"]
        .as_array()
        .unwrap()
        .iter()
        .any(f)
}

/// Whether `p` said it launches unarbitrated because `b` stopped
/// answering.
fn said_unarbitrated(b: &Broker, p: &Watched) -> bool {
    p.err().contains(&format!(
        "broker at {} has not answered for 3 s; launching unarbitrated",
        b.socket.display()
    ))
}

/// `p` spun its whole window without an error and is still alive.
fn spun_its_window(p: &mut Watched) {
    let out = p.out();
    let spin = out.lines().find(|l| l.starts_with("spin ")).unwrap();
    assert!(spin.contains(" rc=0 "), "{out}{}", p.err());
    assert!(p.alive(), "{out}{}", p.err());
}

#[test]
fn a_stopped_broker_does_not_block_launches_and_arbitration_resumes() {
    let b = Broker::start("16G", &["--timeslice", "20ms"]);
    let (start, end) = window();
    let spinner = || {
        let mut cmd = spin(&b, start, end);
        // Still alive when the broker comes back: it must re-register.
        // Its grants and releases are logged: should nobody say why it
        // launched unarbitrated, the failure shows where each one was at
        // the stop.
        cmd.env("GPUFRAC_LOG", "debug").args(["sleep-ms", "60000"]);
        Watched::spawn(cmd)
    };
    let mut procs = [spinner(), spinner()];
    let pids: Vec<u64> = procs.iter().map(|p| p.pid()).collect();
    wait_until(15.0, "both spinners registered", || {
        let r = b.registered();
        pids.iter().all(|p| r.contains(p))
    });
    // Stop the broker while one spinner holds the GPU and the other waits
    // for it: without a bound, the waiter would wait as long as the stop.
    wait_until(15.0, "one spinner waiting for the GPU", || {
        any_process(&b, |p| p["state"] == "waiting")
    });
    signal(&b, libc::SIGSTOP);
    let stopped_at = mono_ns();
    let cont = Continue(&b);
    assert!(
        stopped_at < end,
        "the machine is too slow for this test's window"
    );

    // Both finish their window while the broker is still stopped: the
    // waiter goes ahead unarbitrated ~3 s into the stop.
    let limit = (end.max(stopped_at + 3000 * MS) - mono_ns()) as f64 / 1e9 + 8.0;
    wait_until(
        limit,
        "both spinners to finish while the broker is stopped",
        || procs.iter().all(|p| p.out().contains("spin kernels=")),
    );
    for p in procs.iter_mut() {
        spun_its_window(p);
    }
    // The waiter at the stop says it. The holder says it too when the
    // broker had told it of the waiter (its grant then has a slice to end),
    // but a hand-over can race the stop: the waiter hands back after an
    // idle moment, the other is granted with nobody waiting, and the stop
    // comes before the first one asks again. That holder's grant is
    // open-ended, nothing is owed to anyone it knows of, and it runs on.
    // What a holder of a slice owes is the session's unit tests' to show;
    // a process that waits on the broker whatever the moment of the stop
    // (one under a compute limit) is tested below.
    assert!(
        procs.iter().any(|p| said_unarbitrated(&b, p)),
        "nobody said why it launched unarbitrated (stopped {} ms into the window); the \
         end of each one's log:\n{}",
        stopped_at.saturating_sub(start) / MS,
        procs
            .iter()
            .map(|p| {
                let err = p.err();
                let lines: Vec<&str> = err.lines().collect();
                lines[lines.len().saturating_sub(25)..].join("\n")
            })
            .collect::<Vec<_>>()
            .join("\n----\n")
    );

    // Back: the survivors register again (arbitration resumes) and a new
    // process registers as usual, as `gpufrac status` shows.
    drop(cont);
    wait_until(15.0, "the spinners to register again", || {
        let r = b.registered();
        pids.iter().all(|p| r.contains(p))
    });
    let mut cmd = b.client(&artifacts().probe);
    cmd.args(["ctx", "sleep-ms", "60000"]);
    let newcomer = Watched::spawn(cmd);
    let pid = newcomer.pid();
    wait_until(15.0, "a new process in gpufrac status", || {
        let o = sim_command(&artifacts().gpufrac, "16G", false)
            .args(["status", "--json", "--socket"])
            .arg(&b.socket)
            .output()
            .unwrap();
        o.status.success() && stdout(&o).contains(&format!("\"pid\": {pid}"))
    });
}

/// A process under a compute limit always holds a slice (its grant ends
/// where the limit does), is parked by the limit, or asks: whatever the
/// moment of the stop, it waits on the broker, so it says so within the
/// stall bound (plus a slice) and then runs to the end of its window
/// instead of staying parked.
#[test]
fn a_stopped_broker_does_not_hold_back_a_process_under_a_compute_limit() {
    let b = Broker::start("16G", &["--timeslice", "20ms"]);
    let (start, end) = window();
    let mut cmd = spin(&b, start, end);
    cmd.env("GPU_COMPUTE_LIMIT", "50")
        .env("GPUFRAC_LOG", "warn")
        .args(["sleep-ms", "60000"]);
    let mut p = Watched::spawn(cmd);
    let pid = p.pid();
    wait_until(15.0, "the spinner to hold a grant", || {
        any_process(&b, |c| c["pid"] == pid && c["state"] == "holding")
    });
    signal(&b, libc::SIGSTOP);
    let stopped_at = mono_ns();
    let cont = Continue(&b);
    assert!(
        stopped_at + 4000 * MS < end,
        "the machine is too slow for this test's window"
    );
    let limit = (end - mono_ns()) as f64 / 1e9 + 8.0;
    wait_until(
        limit,
        "the spinner to finish while the broker is stopped",
        || p.out().contains("spin kernels="),
    );
    spun_its_window(&mut p);
    assert!(
        said_unarbitrated(&b, &p),
        "stopped {} ms before the end: {}{}",
        (end - stopped_at) / MS,
        p.out(),
        p.err()
    );
    drop(cont);
    wait_until(15.0, "the spinner to register again", || {
        b.registered().contains(&pid)
    });
}

#[test]
fn a_stopped_broker_keeps_blocking_launches_with_broker_required() {
    // GPUFRAC_BROKER=required asks to wait for the broker: a stop blocks a
    // waiting launch for as long as it lasts, and the user is told why.
    let b = Broker::start("16G", &["--timeslice", "20ms"]);
    let t0 = mono_ns();
    let start = t0 + 1500 * MS;
    let end = t0 + 4000 * MS;
    let spinner = || {
        let mut cmd = spin(&b, start, end);
        cmd.env("GPUFRAC_BROKER", "required");
        Watched::spawn(cmd)
    };
    let procs = [spinner(), spinner()];
    let pids: Vec<u64> = procs.iter().map(|p| p.pid()).collect();
    wait_until(15.0, "both spinners registered", || {
        let r = b.registered();
        pids.iter().all(|p| r.contains(p))
    });
    wait_until(15.0, "one spinner waiting for the GPU", || {
        any_process(&b, |p| p["state"] == "waiting")
    });
    signal(&b, libc::SIGSTOP);
    let cont = Continue(&b);
    let told = format!(
        "broker at {} has not answered for 3 s; launches wait for it (GPUFRAC_BROKER=required)",
        b.socket.display()
    );
    wait_until(10.0, "a spinner to say it waits for the broker", || {
        procs.iter().any(|p| p.err().contains(&told))
    });
    // Well past the window, the waiter is still waiting: a non-event, so
    // only time can show it.
    gpufrac_common::clock::sleep_until(end.max(mono_ns()) + 1000 * MS);
    assert!(
        !procs.iter().all(|p| p.out().contains("spin kernels=")),
        "both finished although the broker was stopped: {:?}",
        procs.iter().map(|p| p.err()).collect::<Vec<_>>()
    );
    assert!(procs.iter().all(|p| !p.err().contains("unarbitrated")));
    drop(cont);
    wait_until(
        15.0,
        "both spinners to finish once the broker is back",
        || procs.iter().all(|p| p.out().contains("spin kernels=")),
    );
}

#[test]
fn a_live_broker_that_keeps_a_waiter_waiting_is_not_a_stall() {
    // A `low` process next to a busy `normal` one can wait far longer than
    // the stall bound, and the broker tells it nothing meanwhile; the
    // probe's answer shows the broker is alive, so it keeps waiting. (With
    // silence alone as the test, it was let loose after 3 s.)
    let b = Broker::start("16G", &["--timeslice", "20ms"]);
    let t0 = mono_ns();
    let start = t0 + 1500 * MS;
    let end = t0 + 7500 * MS;
    let spinner = |prio: &str| {
        let mut cmd = spin(&b, start, end);
        cmd.env("GPUFRAC_LOG", "warn")
            .env("GPU_COMPUTE_PRIORITY", prio);
        Watched::spawn(cmd)
    };
    let procs = [spinner("normal"), spinner("low")];
    wait_until(30.0, "both spinners to finish", || {
        procs.iter().all(|p| p.out().contains("spin kernels="))
    });
    for p in &procs {
        assert!(!p.err().contains("has not answered"), "{}", p.err());
    }
    // And it was kept waiting, not let loose: a scavenger's share of a
    // busy GPU is what the busy process leaves, next to nothing here.
    let kernels = |p: &Watched| {
        let out = p.out();
        let l = out
            .lines()
            .find(|l| l.starts_with("spin "))
            .unwrap()
            .to_owned();
        l.split_whitespace()
            .find_map(|kv| kv.strip_prefix("kernels="))
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    let (normal, low) = (kernels(&procs[0]), kernels(&procs[1]));
    assert!(low * 4 < normal, "normal {normal} kernels, low {low}");
}
