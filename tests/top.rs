//! `gpufrac top` against a real broker on the simulated driver: two jobs
//! busy at 70% and 30% with memory under their caps and a third queued
//! behind them. `--once` draws a frame with ratatui's test backend (as
//! root, as `nobody`, small); the live view runs under a real terminal,
//! tmux's, takes keys and gives the terminal back on `q`. Real jobs also
//! cut the tree at 80×24 (its last line says how much is below) and have
//! their caps refuse allocations (summed up to jobs and users).

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use support::*;

/// A `gpufrac run` job ended with SIGTERM (which run forwards to its
/// child) however the test ends, so that no probe outlives it.
struct Job(Child);

impl Drop for Job {
    fn drop(&mut self) {
        // SAFETY: kill with a pid of a child of ours.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let t = std::time::Instant::now();
        while t.elapsed().as_secs() < 10 {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The node of the demo: a 16 GiB GPU, job A (`--gpu-memory 4G
/// --gpu-compute 70%`, 1 GiB allocated) and job B (`8G`, `30%`, 512 MiB)
/// busy on it, job C (`8G`) queued: 4 GiB are left uncommitted.
struct Node {
    // Fields drop in order: the jobs end before their broker.
    a: Job,
    b: Job,
    _c: Job,
    broker: Broker,
}

fn busy_job(b: &Broker, mem: &str, compute: &str, alloc: &str) -> Job {
    let start = mono_ns() + 300_000_000;
    let end = start + 120_000_000_000;
    let mut cmd = b.run(&["--gpu-memory", mem, "--gpu-compute", compute, "--"]);
    cmd.arg(&artifacts().probe)
        .args(["ctx", "alloc", "alloc", alloc])
        .args(spin_args(start, end))
        .stdout(Stdio::null());
    Job(cmd.spawn().unwrap())
}

fn node() -> Node {
    // The socket's group and directory let `nobody` ask for status.
    let broker = Broker::start("16G", &["--group", "nogroup"]);
    std::fs::set_permissions(
        broker.socket.parent().unwrap(),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    let a = busy_job(&broker, "4G", "70%", "1G");
    let b = busy_job(&broker, "8G", "30%", "512M");
    wait_until(30.0, "both jobs busy with their memory", || {
        let st = broker.status();
        let procs = st["gpus"][0]["processes"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        procs.len() == 2
            && procs
                .iter()
                .all(|p| p["mem_used"].as_u64() >= Some(512 << 20))
    });
    let mut c = broker.run(&["--gpu-memory", "8G", "--"]);
    c.arg(&artifacts().probe)
        .arg("ctx")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let c = Job(c.spawn().unwrap());
    wait_until(30.0, "the third job queued", || {
        broker.status()["queue"]
            .as_array()
            .is_some_and(|q| q.len() == 1)
    });
    Node {
        a,
        b,
        _c: c,
        broker,
    }
}

/// `gpufrac top ARGS` against `socket`, as `uid` (None: this user).
fn top(socket: &Path, args: &[&str], uid: Option<u32>) -> (String, String, bool) {
    let mut cmd = Command::new(&artifacts().gpufrac);
    scrub_env(&mut cmd);
    cmd.arg("top")
        .args(args)
        .arg("--socket")
        .arg(socket)
        .stdin(Stdio::null());
    if let Some(uid) = uid {
        as_user(&mut cmd, uid);
    }
    let o = cmd.output().unwrap();
    (stdout(&o), stderr(&o), o.status.success())
}

fn line_with<'a>(frame: &'a str, what: &str) -> &'a str {
    frame
        .lines()
        .find(|l| l.contains(what))
        .unwrap_or_else(|| panic!("no line with {what:?} in\n{frame}"))
}

#[test]
fn once_shows_caps_shares_users_jobs_and_the_queue() {
    let _serial = serial();
    let n = node();
    let (a, b) = (n.a.0.id(), n.b.0.id());
    // A few samples of the broker's ring, so that history shows.
    wait_until(30.0, "three samples of history", || {
        let (t, _, _) = top(&n.broker.socket, &["--once", "--size", "100x30"], None);
        line_with(&t, &format!("▾ job {a}"))
            .matches(['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'])
            .count()
            >= 3
    });
    let (t, err, ok) = top(&n.broker.socket, &["--once", "--size", "100x30"], None);
    assert!(ok, "{err}");
    assert_eq!(t.lines().count(), 30, "{t}");
    let header = t.lines().next().unwrap();
    for what in ["mode plain", "1 GPU", "2 processes", "queue 1", "2 leases"] {
        assert!(header.contains(what), "{what}: {header}");
    }
    // The GPU: 1.5 GiB allocated, 12 GiB committed with both caps marked.
    let gpu = line_with(&t, "GPU 0");
    assert!(gpu.contains("alloc 1.5G commit 12G free 4G of 16G"), "{t}");
    assert_eq!(gpu.matches('┃').count(), 2, "{t}");
    assert!(t.contains("  util "), "{t}");
    // The tree: the user, each job with its cap and target share, each
    // process under its job with what it allocated.
    assert!(line_with(&t, "▾ root").contains("1.5G"), "{t}");
    let job_a = line_with(&t, &format!("▾ job {a}"));
    assert!(job_a.contains("1G/4G") && job_a.contains("70/"), "{t}");
    let job_b = line_with(&t, &format!("▾ job {b}"));
    assert!(job_b.contains("512M/8G") && job_b.contains("30/"), "{t}");
    let rows: Vec<&str> = t.lines().collect();
    let at = |what: &str| rows.iter().position(|l| l.contains(what)).unwrap();
    let pa = at(&format!("▾ job {a}")) + 1;
    assert!(
        rows[pa].contains("probe ctx alloc") && rows[pa].contains("1G/4G"),
        "{t}"
    );
    // The queue: the third job, what it wants and why it waits.
    let q = line_with(&t, "needs 8.00 GiB");
    assert!(q.contains("root") && q.contains("8G"), "{t}");
    assert!(t.contains("GPU 0: 4.00 GiB free of 16.00 GiB"), "{t}");

    // Flat, by memory: A's process (1 GiB) before B's (512 MiB).
    let (flat, _, _) = top(
        &n.broker.socket,
        &["--once", "--size", "132x30", "--flat", "--sort", "mem"],
        None,
    );
    let first = flat.lines().position(|l| l.contains("1G/4G")).expect(&flat);
    let second = flat
        .lines()
        .position(|l| l.contains("512M/8G"))
        .expect(&flat);
    assert!(first < second, "{flat}");
    // How each process is scheduled, whatever else the width drops (a
    // column of containers shows only where a process has one).
    assert!(line_with(&flat, "PID").contains("CLASS"), "{flat}");
    let (narrow, _, _) = top(
        &n.broker.socket,
        &["--once", "--size", "80x24", "--flat"],
        None,
    );
    assert!(line_with(&narrow, "PID").contains("CLASS"), "{narrow}");

    // Small: nothing past 40 columns, the user still there.
    let (small, _, _) = top(&n.broker.socket, &["--once", "--size", "40x12"], None);
    assert!(small.lines().all(|l| l.chars().count() <= 40), "{small}");
    assert!(small.contains("▾ root"), "{small}");

    // `nobody` sees what status lets it see: the same processes, jobs and
    // request.
    if can_be_nobody() {
        let (theirs, err, ok) = top(
            &n.broker.socket,
            &["--once", "--size", "100x30"],
            Some(NOBODY),
        );
        assert!(ok, "{err}");
        for what in [
            format!("▾ job {a}"),
            format!("▾ job {b}"),
            "needs 8.00 GiB".into(),
        ] {
            assert!(theirs.contains(&what), "{what}:\n{theirs}");
        }
        let (none, _, _) = top(&n.broker.socket, &["--once", "--mine"], Some(NOBODY));
        assert!(
            none.contains("no process matches") && none.contains("queue: 1 waiting, none matching"),
            "{none}"
        );
    }
}

#[test]
fn without_a_terminal_it_says_to_use_once() {
    let b = Broker::start("16G", &[]);
    let (out, err, ok) = top(&b.socket, &[], None);
    assert!(!ok && out.is_empty(), "{out}");
    assert!(
        err.contains("needs a terminal") && err.contains("gpufrac top --once"),
        "{err}"
    );
    let (_, err, ok) = top(&b.socket.with_extension("nowhere"), &["--once"], None);
    assert!(!ok && err.contains("no broker at"), "{err}");
}

/// A tmux server of the test's own, killed however the test ends.
struct Tmux(String);

impl Tmux {
    fn cmd(&self) -> Command {
        let mut c = Command::new("tmux");
        c.args(["-L", &self.0, "-f", "/dev/null"]);
        c
    }

    fn capture(&self) -> String {
        let o = self
            .cmd()
            .args(["capture-pane", "-p", "-t", "top"])
            .output()
            .unwrap();
        stdout(&o)
    }

    fn keys(&self, keys: &[&str]) {
        let ok = self
            .cmd()
            .args(["send-keys", "-t", "top"])
            .args(keys)
            .status()
            .unwrap();
        assert!(ok.success());
    }

    /// Waits for the screen to hold `what`.
    fn wait_for(&self, what: &str) -> String {
        self.wait_until(&format!("show {what:?}"), |s| s.contains(what))
    }

    /// Waits for `what` to leave the screen.
    fn wait_gone(&self, what: &str) -> String {
        self.wait_until(&format!("lose {what:?}"), |s| !s.contains(what))
    }

    fn wait_until(&self, what: &str, cond: impl Fn(&str) -> bool) -> String {
        let mut screen = String::new();
        let t = std::time::Instant::now();
        while t.elapsed().as_secs() < 30 {
            screen = self.capture();
            if cond(&screen) {
                return screen;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        panic!("the screen did not {what}:\n{screen}");
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd().arg("kill-server").stderr(Stdio::null()).status();
    }
}

#[test]
fn live_view_under_tmux_takes_keys_and_gives_the_terminal_back() {
    const WHAT: &str = "the live view of gpufrac top under tmux";
    if !engines_wanted(WHAT) {
        return;
    }
    if let Err(why) = apt_install(WHAT, &["tmux"], || Path::new("/usr/bin/tmux").exists()) {
        cannot(WHAT, &why);
        return;
    }
    let _serial = serial();
    let n = node();
    let a = n.a.0.id();
    let tmux = Tmux(format!("gpufrac-test-{}", std::process::id()));
    // The shell says what the terminal is like once top has given it
    // back: canonical mode and echo on.
    // It runs top twice: the first is left with `q`, the second killed.
    let modes = "stty -a | tr ' ;' '\\n\\n' | grep -x -e icanon -e echo -e -icanon -e -echo \
                 | tr '\\n' ' '; echo";
    let top_cmd = format!(
        "{} top --socket {}",
        artifacts().gpufrac.display(),
        n.broker.socket.display()
    );
    // The second starts once the test has read the screen the first left.
    let dir = Scratch::new("top-tmux");
    let go = dir.0.join("go");
    let script = format!(
        "printf 'BEFORE\\n'; {top_cmd}; echo \"top exited $?\"; {modes}; \
         while [ ! -e {go} ]; do sleep 0.05; done; \
         {top_cmd}; echo \"top ended with $?\"; {modes}; sleep 120",
        go = go.display()
    );
    let ok = tmux
        .cmd()
        .args([
            "new-session",
            "-d",
            "-s",
            "top",
            "-x",
            "120",
            "-y",
            "32",
            "sh",
            "-c",
            &script,
        ])
        .status()
        .unwrap();
    assert!(ok.success());
    let screen = tmux.wait_for(&format!("▾ job {a}"));
    assert!(screen.starts_with("gpufrac top"), "{screen}");
    assert!(
        !screen.contains("BEFORE"),
        "the alternate screen:\n{screen}"
    );
    // The history grows while it is open.
    tmux.wait_for("needs 8.00 GiB");
    // t: the flat table; ?: help; Esc closes it.
    tmux.keys(&["t"]);
    tmux.wait_for("Processes (2)");
    tmux.keys(&["?"]);
    tmux.wait_for("only your processes and requests");
    tmux.keys(&["Escape"]);
    let screen = tmux.wait_gone("only your processes and requests");
    assert!(screen.contains("Processes (2)"), "{screen}");
    // /: a filter typed and applied.
    tmux.keys(&["/", "job:", &a.to_string(), "Enter"]);
    let screen = tmux.wait_for(&format!("filter: job:{a}"));
    tmux.wait_for("Processes (1)");
    assert!(screen.contains("PID"), "{screen}");
    // Enter: the process's detail, with its history.
    tmux.keys(&["Enter"]);
    let screen = tmux.wait_for("its job");
    assert!(screen.contains("1G used, cap 4G"), "{screen}");
    tmux.keys(&["Escape"]);
    tmux.wait_gone("its job");
    // q: gone, and the terminal as it was.
    tmux.keys(&["q"]);
    tmux.wait_for("top exited 0");
    let screen = tmux.wait_for("icanon");
    assert!(
        screen.contains("BEFORE"),
        "the normal screen is back:\n{screen}"
    );
    assert!(!screen.contains("gpufrac top"), "{screen}");
    let modes = line_with(&screen, "icanon");
    assert_eq!(
        modes.split_whitespace().collect::<Vec<_>>(),
        ["icanon", "echo"],
        "{screen}"
    );
    // The second: SIGTERM gives the terminal back as well.
    std::fs::write(&go, "").unwrap();
    tmux.wait_for(&format!("▾ job {a}"));
    let top_pid = pane_child(&tmux);
    // SAFETY: kill with the pid of the pane's top.
    assert_eq!(unsafe { libc::kill(top_pid, libc::SIGTERM) }, 0);
    tmux.wait_for("top ended with 0");
    let screen = tmux.wait_until("say its modes twice", |s| s.matches("icanon").count() == 2);
    let modes: Vec<&str> = screen.lines().filter(|l| l.contains("icanon")).collect();
    assert_eq!(
        modes[1].split_whitespace().collect::<Vec<_>>(),
        ["icanon", "echo"],
        "{screen}"
    );
}

/// A job asking `--gpu-compute 70% --gpu-limit 90%` busy beside another
/// user's interactive `high` process: in every frame the job's target is
/// its whole share among the shares (the `high` process, above them, no
/// longer halves it while busy), it says what it asked, and the `high`
/// process shows `high` where a 0% target read as a violation.
#[test]
fn high_is_above_the_shares_and_what_was_asked_is_shown() {
    let _serial = serial();
    let b = Broker::start("16G", &[]);
    let start = mono_ns() + 300_000_000;
    let end = start + 120_000_000_000;
    let mut job = b.run(&["--gpu-compute", "70%", "--gpu-limit", "90%", "--"]);
    job.arg(&artifacts().probe)
        .args(["ctx"])
        .args(spin_args(start, end))
        .stdout(Stdio::null());
    let job = Job(job.spawn().unwrap());
    let mut high = b.client(&artifacts().loadgen);
    high.env("GPU_COMPUTE_PRIORITY", "high")
        .args(["interactive", "4", "200", "20000", "+0", "+120"])
        .stdout(Stdio::null());
    let _high = KillOnDrop(high.spawn().unwrap());
    let pid = job.0.id();
    wait_until(30.0, "the job busy and the high process there", || {
        let st = b.status();
        let procs = st["gpus"][0]["processes"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        procs.len() == 2
            && procs.iter().any(|p| p["priority"] == "high")
            && procs
                .iter()
                .any(|p| p["job"] == pid && p["share_target"].as_f64() == Some(1.0))
    });
    for _ in 0..5 {
        let (t, err, ok) = top(&b.socket, &["--once", "--size", "120x30"], None);
        assert!(ok, "{err}");
        let row = line_with(&t, &format!("▾ job {pid}"));
        assert!(row.contains("100/"), "{t}");
        assert!(row.contains("70% ≤90%"), "{t}");
        let hp = line_with(&t, "loadgen interactive");
        assert!(hp.contains("high/") && !hp.contains(" 0/"), "{t}");
        std::thread::sleep(std::time::Duration::from_millis(300));
    }
}

/// The broker stops while top is open under tmux: the frame it left stays,
/// marked stale with its age, until it answers again.
#[test]
fn a_frame_left_by_a_stopped_broker_is_marked_stale() {
    const WHAT: &str = "the live view of gpufrac top under tmux";
    if !engines_wanted(WHAT) {
        return;
    }
    if let Err(why) = apt_install(WHAT, &["tmux"], || Path::new("/usr/bin/tmux").exists()) {
        cannot(WHAT, &why);
        return;
    }
    let _serial = serial();
    let mut b = Broker::start("16G", &[]);
    let job = busy_job(&b, "4G", "70%", "1G");
    let pid = job.0.id();
    let tmux = Tmux(format!("gpufrac-stale-{}", std::process::id()));
    let top_cmd = format!(
        "{} top --socket {}; sleep 120",
        artifacts().gpufrac.display(),
        b.socket.display()
    );
    let ok = tmux
        .cmd()
        .args([
            "new-session",
            "-d",
            "-s",
            "top",
            "-x",
            "120",
            "-y",
            "30",
            "sh",
            "-c",
            &top_cmd,
        ])
        .status()
        .unwrap();
    assert!(ok.success());
    let screen = tmux.wait_for(&format!("▾ job {pid}"));
    assert!(!screen.contains("STALE"), "{screen}");
    drop(job);
    b.kill();
    let screen = tmux.wait_until("say the frame is stale and how old", |s| {
        s.lines()
            .next()
            .is_some_and(|l| l.contains("STALE") && l.contains("s old"))
    });
    assert!(
        screen.contains(&format!("▾ job {pid}")),
        "the last frame stays:\n{screen}"
    );
    // Its age grows while nothing answers.
    tmux.wait_until("age past a second", |s| {
        s.lines().next().is_some_and(|l| {
            l.split("STALE ")
                .nth(1)
                .and_then(|r| r.split('s').next())
                .and_then(|n| n.parse::<u32>().ok())
                .is_some_and(|n| n >= 2)
        })
    });
    // The window closes under it: the pane's shell, the session's leader,
    // has the SIGHUP; top, its child, only a terminal hung up. It ends
    // rather than spin on reads that return at once.
    let top_pid = pane_child(&tmux);
    drop(tmux);
    wait_until(30.0, "top to end once its terminal was gone", || {
        std::fs::read_to_string(format!("/proc/{top_pid}/stat")).map_or(true, |s| {
            s.rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('Z'))
        })
    });
}

/// The pid of the process the pane's shell started (its top).
fn pane_child(tmux: &Tmux) -> i32 {
    let shell = stdout(
        &tmux
            .cmd()
            .args(["display-message", "-p", "-t", "top", "#{pane_pid}"])
            .output()
            .unwrap(),
    );
    let children =
        std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", shell.trim())).unwrap();
    children.split_whitespace().next().unwrap().parse().unwrap()
}

/// `gpufrac run --gpu-memory MEM -- sh -c SCRIPT`, ended however the test
/// ends.
fn job_sh(b: &Broker, mem: &str, script: &str) -> Job {
    let mut cmd = b.run(&["--gpu-memory", mem, "--", "sh", "-c", script]);
    cmd.stdout(Stdio::null()).stderr(Stdio::null());
    Job(cmd.spawn().unwrap())
}

/// The text of column `name` in `row`, by where `header` puts it (the
/// table's columns line up, one character a cell).
fn cell(header: &str, row: &str, name: &str) -> String {
    let at = |l: &str, s: &str| l.find(s).map(|b| l[..b].chars().count());
    let start = at(header, name).unwrap_or_else(|| panic!("no {name} in {header}"));
    let end = header
        .chars()
        .skip(start + name.chars().count())
        .position(|c| c != ' ')
        .map_or(usize::MAX, |n| start + name.chars().count() + n);
    row.chars()
        .skip(start)
        .take(end - start)
        .collect::<String>()
        .trim()
        .to_owned()
}

/// At 80×24 a tree of more rows than the pane holds is cut, and its last
/// line says how many rows are below (the unit test draws a made-up
/// status; here the jobs are real).
#[test]
fn at_80x24_a_cut_tree_says_how_many_rows_are_below() {
    let _serial = serial();
    let b = Broker::start("16G", &[]);
    let dir = Scratch::new("top-cut");
    let stop = dir.0.join("stop");
    let p = artifacts().probe.display().to_string();
    let jobs: Vec<Job> = (0..12)
        .map(|_| job_sh(&b, "256M", &format!("{p} ctx wait-file {}", stop.display())))
        .collect();
    wait_until(30.0, "twelve processes registered", || {
        b.status()["gpus"][0]["processes"]
            .as_array()
            .is_some_and(|p| p.len() == 12)
    });
    let (t, err, ok) = top(&b.socket, &["--once", "--size", "80x24"], None);
    assert!(ok, "{err}");
    let lines: Vec<&str> = t.lines().collect();
    assert_eq!(lines.len(), 24, "{t}");
    // The rows drawn: from under the tree's heading to the mark, which
    // follows the last of them.
    let head = lines
        .iter()
        .position(|l| l.starts_with("USER / JOB / PROCESS"))
        .expect(&t);
    let mark = lines
        .iter()
        .position(|l| l.contains("more below"))
        .expect(&t);
    assert!(lines[mark].starts_with("… "), "{t}");
    assert!(!lines[mark].contains("above"), "{t}");
    let shown = &lines[head + 1..mark];
    assert!(shown[0].starts_with("▾ root"), "{t}");
    assert!(
        shown
            .iter()
            .all(|l| l.starts_with("▾ ") || l.starts_with("  ▾ job ") || l.starts_with("    ")),
        "{t}"
    );
    // The user, 12 jobs and their 12 processes: what is not drawn is
    // what the mark counts.
    let below: usize = lines[mark]
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .expect(&t);
    assert!(below > 0, "{t}");
    assert_eq!(shown.len() + below, 1 + 12 + 12, "{t}");
    // The queue and the keys stay on screen under it.
    assert!(
        lines[mark + 1..].iter().any(|l| l.starts_with("queue")),
        "{t}"
    );
    assert!(lines[23].starts_with("q quit"), "{t}");
    std::fs::write(&stop, "").unwrap();
    drop(jobs);
}

/// Refusals are summed up the tree: each process's own, its job's those
/// of its processes together, its user's those of its jobs (the unit test
/// draws a made-up status; here the caps refuse real allocations).
#[test]
fn refusals_are_summed_up_to_jobs_and_users() {
    let _serial = serial();
    let b = Broker::start("16G", &[]);
    let dir = Scratch::new("top-refusals");
    let stop = dir.0.join("stop");
    let (p, s) = (artifacts().probe.display(), stop.display());
    // Job one's two processes are refused 2 and 1 times by its 1 GiB cap,
    // job two's one 4 times.
    let one = job_sh(
        &b,
        "1G",
        &format!(
            "{p} ctx alloc alloc 2G alloc alloc 5G wait-file {s} & \
             {p} ctx alloc alloc 3G wait-file {s} & wait"
        ),
    );
    let two = job_sh(
        &b,
        "1G",
        &format!(
            "{p} ctx alloc alloc 2G alloc alloc 2G alloc alloc 2G alloc alloc 2G wait-file {s}"
        ),
    );
    wait_until(30.0, "seven refusals reported", || {
        let st = b.status();
        let procs = st["gpus"][0]["processes"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        procs.len() == 3 && procs.iter().filter_map(|p| p["ooms"].as_u64()).sum::<u64>() == 7
    });
    // Job one's processes, told apart by their commands (top cuts them).
    let st = b.status();
    let pid_of = |words: &str| {
        st["gpus"][0]["processes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["command"].as_str().is_some_and(|c| c.contains(words)))
            .and_then(|p| p["pid"].as_u64())
            .unwrap_or_else(|| panic!("no process runs {words:?}: {st}"))
    };
    let twice = pid_of("alloc 5G");
    let once = pid_of("alloc alloc 3G");
    let (t, err, ok) = top(&b.socket, &["--once", "--size", "120x30"], None);
    assert!(ok, "{err}");
    let header = line_with(&t, "USER / JOB / PROCESS");
    let refs = |row: &str| cell(header, line_with(&t, row), "REF");
    assert_eq!(refs("▾ root"), "7", "{t}");
    assert_eq!(refs(&format!("▾ job {}", one.0.id())), "3", "{t}");
    assert_eq!(refs(&format!("▾ job {}", two.0.id())), "4", "{t}");
    assert_eq!(refs(&format!("{twice} probe")), "2", "{t}");
    assert_eq!(refs(&format!("{once} probe")), "1", "{t}");
    std::fs::write(&stop, "").unwrap();
    drop((one, two));
}
