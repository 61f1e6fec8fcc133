//! The fifth hostile review's attacks (issue 41), each through real
//! processes: the attacker is `nobody` (uid 65534), the victims uids 5001
//! and 5002 or root, on the simulated driver.
//!
//! The review found each of these working against the code as it then
//! was; each test's comment says what it did there. Those that need
//! another uid run when the tests run as root and are skipped, loudly,
//! otherwise (`can_be_nobody`).

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use gpufrac_common::wire::{self, ClientMsg, Lease, LeaseReq, ServerMsg};
use support::*;

/// The victims: two users other than the attacker and root.
const VICTIM: u32 = 5001;
const VICTIM2: u32 = 5002;

/// A directory like /tmp: root's, mode 1777.
fn shared_tmp(dir: &Scratch) -> PathBuf {
    let d = dir.0.join("tmp");
    std::fs::create_dir(&d).unwrap();
    std::fs::set_permissions(&d, PermissionsExt::from_mode(0o1777)).unwrap();
    d
}

/// Where an attack between users plays: a scratch directory everyone may
/// enter, a `tmp` in it like /tmp, and a `jobs` directory everyone may
/// write (the victims' files, their simulated GPU state among them).
fn stage(name: &str) -> (Scratch, PathBuf, PathBuf) {
    let dir = Scratch::new(name);
    std::fs::set_permissions(&dir.0, PermissionsExt::from_mode(0o755)).unwrap();
    let tmp = shared_tmp(&dir);
    let jobs = dir.0.join("jobs");
    std::fs::create_dir(&jobs).unwrap();
    std::fs::set_permissions(&jobs, PermissionsExt::from_mode(0o777)).unwrap();
    (dir, tmp, jobs)
}

/// The first byte of a frame's body: how the squatter tells messages
/// apart.
fn client_tag(m: &ClientMsg) -> u8 {
    let mut out = Vec::new();
    wire::encode_client(m, &mut out);
    out[4]
}

fn server_frame(m: &ServerMsg) -> Vec<u8> {
    let mut out = Vec::new();
    wire::encode_server(m, &mut out);
    out
}

/// A listener that is not the broker: binds `PATH` (argv 1), lets
/// everyone connect, answers any hello with the frame `hello` and any
/// later frame whose tag it has an answer for (`replies`, lines of
/// `tag hex`) with that answer, and writes `conn` for each connection
/// and `frame TAG` for each frame it is sent to `LOG` (argv 3).
const SQUATTER: &str = r#"
import os, socket, struct, sys, threading
path, replies, log = sys.argv[1], sys.argv[2], sys.argv[3]
R = {}
for l in open(replies):
    k, v = l.split()
    R[k] = bytes.fromhex(v)
lock = threading.Lock()
def note(x):
    with lock, open(log, "a") as f:
        f.write(x + "\n")
def serve(c):
    note("conn")
    buf, first = b"", True
    while True:
        try:
            d = c.recv(1 << 16)
        except OSError:
            return
        if not d:
            return
        buf += d
        while len(buf) >= 4:
            n = struct.unpack("<I", buf[:4])[0]
            if len(buf) < 4 + n:
                break
            body, buf = buf[4:4 + n], buf[4 + n:]
            note("frame %d" % body[0])
            r = R["hello"] if first else R.get(str(body[0]))
            first = False
            if r:
                c.sendall(r)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(path)
os.chmod(path, 0o666)
s.listen(64)
print("listening", flush=True)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"#;

/// The squatter as `nobody` on `socket`, answering as a broker would:
/// hello, a status whose GPU is named `SQUATTED`, and a lease of GPU 0
/// with no memory cap and an MPS pipe directory of its choosing.
struct Squatter {
    _child: KillOnDrop,
    log: PathBuf,
}

impl Squatter {
    fn start(dir: &Scratch, socket: &Path, status: &serde_json::Value) -> Squatter {
        let mut status = status.clone();
        status["gpus"][0]["name"] = "SQUATTED".into();
        let uuid = first_gpu_uuid_in(&status);
        let replies = [
            (
                "hello".to_owned(),
                server_frame(&ServerMsg::HelloOk {
                    version: wire::PROTOCOL_VERSION,
                }),
            ),
            (
                client_tag(&ClientMsg::Status { from: 0 }).to_string(),
                server_frame(&ServerMsg::StatusReply {
                    json: status.to_string(),
                }),
            ),
            (
                client_tag(&ClientMsg::Lease(LeaseReq::default())).to_string(),
                server_frame(&ServerMsg::Leased(Lease {
                    gpus: vec![0],
                    uuids: vec![uuid],
                    mem_cap: 0,
                    token: 7,
                    mps_pipe: "/tmp/squatters-pipe".into(),
                    mig: String::new(),
                })),
            ),
            (
                client_tag(&register_msg(uuid, "x", Default::default())).to_string(),
                server_frame(&ServerMsg::Registered { mem_cap: 0 }),
            ),
        ];
        let file = |name: &str, text: &str| {
            let p = dir.0.join(name);
            std::fs::write(&p, text).unwrap();
            std::fs::set_permissions(&p, PermissionsExt::from_mode(0o666)).unwrap();
            p
        };
        let script = file("squatter.py", SQUATTER);
        let replies = file(
            "squatter.replies",
            &replies
                .iter()
                .map(|(k, v)| format!("{k} {}\n", hex(v)))
                .collect::<String>(),
        );
        let log = file("squatter.log", "");
        let mut cmd = Command::new("python3");
        cmd.arg(&script)
            .arg(socket)
            .arg(&replies)
            .arg(&log)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        as_user(&mut cmd, NOBODY);
        let mut child = KillOnDrop(cmd.spawn().expect("python3"));
        assert_eq!(
            read_line(&mut child.0),
            "listening",
            "the squatter did not bind"
        );
        Squatter { _child: child, log }
    }

    /// (connections, frames) it was sent.
    fn heard(&self) -> (usize, usize) {
        let log = std::fs::read_to_string(&self.log).unwrap();
        (
            log.lines().filter(|l| *l == "conn").count(),
            log.lines().filter(|l| l.starts_with("frame")).count(),
        )
    }
}

/// A status document as a real broker on `devices` writes it, for the
/// squatter to serve.
fn real_status(devices: &str) -> serde_json::Value {
    Broker::start(devices, &[]).status()
}

/// `gpufrac ARGS` as `uid` on the simulated 16 GiB GPU, its state in a
/// file of its own in `sim` (a directory anyone may write).
fn gpufrac_as(uid: u32, sim: &Path, args: &[&str]) -> Command {
    let mut cmd = sim_command(&artifacts().gpufrac, "16G", false);
    cmd.env_remove("GPUFRAC_BROKER")
        .env("GPUFRAC_SIM_STATE", sim.join(format!("sim-{uid}")))
        .args(args);
    as_user(&mut cmd, uid);
    cmd
}

/// The probe under the shim as `uid`, in `mode`, against `socket`.
fn probe_as(uid: u32, sim: &Path, socket: &Path, mode: &str) -> Command {
    let mut cmd = sim_command(&artifacts().probe, "16G", true);
    cmd.env("GPUFRAC_SOCKET", socket)
        .env("GPUFRAC_BROKER", mode)
        .env("GPUFRAC_SIM_STATE", sim.join(format!("sim-{uid}-{mode}")));
    as_user(&mut cmd, uid);
    cmd
}

/// The review's most serious find: the broker accepted a socket in a
/// sticky shared directory (SECURITY.md said it might sit in /tmp) and
/// removed its socket when it stopped, and no client asked who was
/// listening. `nobody` bound the path 0.1–0.2 ms after a stop and became
/// the broker for everyone: the root broker could not start again
/// ("another broker is already listening"), the victim's `gpufrac status`
/// showed the squatter's text, `gpufrac run --gpus 1` ran the job on a GPU
/// with no memory cap and an MPS pipe directory the squatter chose, and
/// `GPUFRAC_BROKER=required` processes waited on it. Every client now
/// checks the listener's uid (`SO_PEERCRED`) before it sends a byte:
/// status and run refuse it, naming the uid found and the one expected;
/// the shim takes it for no broker (closed under `required`; caps held
/// under `optional`); the squatter is sent nothing.
#[test]
fn a_squatter_on_the_socket_path_is_believed_by_no_client() {
    if !can_be_nobody() {
        return;
    }
    let (dir, tmp, jobs) = stage("r5-squat");
    let socket = tmp.join("broker.sock");
    let status = real_status("16G");
    // A root broker in the shared directory, where a broker that takes it
    // stops for a restart; one that refuses it leaves the path to whoever
    // binds first all the same.
    let mut root = sim_command(&artifacts().gpufrac, "16G", false);
    root.args(["broker", "--socket"])
        .arg(&socket)
        .arg("--state-dir")
        .arg(dir.0.join("state"))
        .env("GPUFRAC_SIM_STATE", dir.0.join("sim-state"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut root = KillOnDrop(root.spawn().unwrap());
    wait_until(20.0, "the root broker to listen or refuse", || {
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
            || matches!(root.0.try_wait(), Ok(Some(_)))
    });
    stop(&mut root.0);
    let squatter = Squatter::start(&dir, &socket, &status);
    let sim = jobs.as_path();
    let sock = socket.to_str().unwrap();
    let mut bad = Vec::new();

    let ran = jobs.join("ran");
    let job = format!(
        "echo ran cap=${{GPU_MEM_LIMIT-none}} pipe=${{CUDA_MPS_PIPE_DIRECTORY-none}} > {}",
        ran.display()
    );
    let o = output_within(
        &mut gpufrac_as(
            VICTIM,
            sim,
            &[
                "run", "--socket", sock, "--gpus", "1", "--", "sh", "-c", &job,
            ],
        ),
        30,
    )
    .expect("gpufrac run against the squatter hung");
    let err = stderr(&o);
    if let Ok(r) = std::fs::read_to_string(&ran) {
        bad.push(format!(
            "the victim's job ran with the squatter's lease: {r}"
        ));
    }
    if o.status.success()
        || !err.contains(&format!("the listener on {sock} is not the gpufrac broker"))
        || !err.contains("it runs as uid 65534")
        || !err.contains("must run as root (uid 0)")
    {
        bad.push(format!(
            "gpufrac run did not refuse the squatter clearly ({}): {err}",
            o.status
        ));
    }

    let o = output_within(
        &mut gpufrac_as(VICTIM2, sim, &["status", "--socket", sock]),
        30,
    )
    .expect("gpufrac status against the squatter hung");
    if stdout(&o).contains("SQUATTED") {
        bad.push(format!(
            "gpufrac status showed the squatter's text: {}",
            stdout(&o)
        ));
    }
    if o.status.success() || !stderr(&o).contains("it runs as uid 65534") {
        bad.push(format!("gpufrac status did not refuse: {}", stderr(&o)));
    }

    let o = output_within(
        probe_as(VICTIM, sim, &socket, "required").args(["ctx", "alloc", "alloc", "1G"]),
        30,
    )
    .expect("a GPUFRAC_BROKER=required process hung on the squatter");
    let init = line(&o, "init", 0);
    if init.get("rc").map(String::as_str) != Some("802")
        || !stderr(&o).contains("GPUFRAC_BROKER=required but the listener on")
    {
        bad.push(format!(
            "GPUFRAC_BROKER=required did not fail closed: {}{}",
            stdout(&o),
            stderr(&o)
        ));
    }

    let o = output_within(
        probe_as(VICTIM, sim, &socket, "optional")
            .env("GPU_MEM_LIMIT", "1G")
            .args([
                "ctx", "sleep-ms", "1500", "alloc", "alloc", "2G", "alloc", "alloc", "512M",
            ]),
        30,
    )
    .expect("a GPUFRAC_BROKER=optional process hung on the squatter");
    let over = line(&o, "alloc", 0);
    let under = line(&o, "alloc", 1);
    if num(&over, "rc") == 0 || num(&under, "rc") != 0 {
        bad.push(format!(
            "under optional the cap did not hold as with no broker: {}",
            stdout(&o)
        ));
    }
    if !stderr(&o).contains("is not the gpufrac broker")
        || !stderr(&o).contains("running as with no broker")
    {
        bad.push(format!(
            "under optional the process did not say it ignored the squatter: {}",
            stderr(&o)
        ));
    }

    let (conns, frames) = squatter.heard();
    assert!(
        conns >= 3,
        "the victims never reached the squatter ({conns})"
    );
    if frames > 0 {
        bad.push(format!("the victims sent the squatter {frames} frames"));
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The same squatter one step earlier: a directory in /tmp named as a
/// user's own broker's (`/tmp/gpufrac-UID`, the Quickstart's), made by
/// `nobody` before the user's broker ever ran. Its owner is the
/// squatter's, so "the owner of the socket's directory" would have
/// vouched for it; a directory in one anyone can write proves nothing,
/// and only root (or the user itself) is believed there.
#[test]
fn a_directory_planted_in_tmp_under_a_victims_socket_path_vouches_for_nobody() {
    if !can_be_nobody() {
        return;
    }
    let (dir, tmp, sim) = stage("r5-plant");
    let planted = tmp.join(format!("gpufrac-{VICTIM}"));
    std::fs::create_dir(&planted).unwrap();
    std::os::unix::fs::chown(&planted, Some(NOBODY), Some(NOBODY)).unwrap();
    let socket = planted.join("broker.sock");
    let _squatter = Squatter::start(&dir, &socket, &real_status("16G"));
    let o = output_within(
        &mut gpufrac_as(
            VICTIM,
            &sim,
            &["status", "--socket", socket.to_str().unwrap()],
        ),
        30,
    )
    .expect("gpufrac status hung");
    let err = stderr(&o);
    assert!(!stdout(&o).contains("SQUATTED"), "{}", stdout(&o));
    assert!(
        !o.status.success()
            && err.contains("it runs as uid 65534")
            && err.contains(&format!(
                "{} belongs to uid 65534, but {} (owner uid 0, mode 1777) lets others make entries",
                planted.display(),
                tmp.display()
            )),
        "{err}"
    );
}

/// The broker accepted a sticky directory anyone can write (like /tmp)
/// for its socket: the squatter above needs nothing more. It is refused
/// at start, naming the directory, its owner and mode and what would be
/// right, and nothing is left there.
#[test]
fn the_broker_refuses_a_socket_directory_anyone_can_write_sticky_or_not() {
    let dir = Scratch::new("r5-sticky");
    let tmp = shared_tmp(&dir);
    let socket = tmp.join("broker.sock");
    let mut cmd = sim_command(&artifacts().gpufrac, "16G", false);
    cmd.args(["broker", "--socket"])
        .arg(&socket)
        .arg("--state-dir")
        .arg(dir.0.join("state"))
        .env("GPUFRAC_SIM_STATE", dir.0.join("sim-state"))
        .env("RUST_LOG", "warn");
    let Some(o) = output_within(&mut cmd, 20) else {
        panic!("the broker started on a socket in a sticky directory anyone can write");
    };
    let err = stderr(&o);
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "the socket's directory {} (owner uid {me}, mode 1777) is writable by everyone \
             (sticky or not)",
            tmp.display()
        )) && err.contains(&format!(
            "expected a directory that only uid {me} can write"
        )),
        "{err}"
    );
    if me == 0 {
        assert!(err.contains("/run/gpufrac/broker.sock"), "{err}");
    }
    assert!(!socket.exists(), "a refused start left a socket");
}

/// A clean stop removed the socket, and a start removed a stale one
/// before binding its own: twice a restart left the path free for
/// whoever binds first. Now the path is a socket all along: the stop
/// leaves it (stale: clients see no broker) and the start renames its
/// own over it. Watched from before the stop until the new broker
/// answers.
#[test]
fn the_socket_path_is_never_free_across_a_restart() {
    let mut b = Broker::start("16G", &[]);
    let socket = b.socket.clone();
    let looks = Arc::new(AtomicU64::new(0));
    let missing = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (looks, missing, done, socket) =
            (looks.clone(), missing.clone(), done.clone(), socket.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Acquire) {
                use std::os::unix::fs::FileTypeExt;
                let ok =
                    std::fs::symlink_metadata(&socket).is_ok_and(|m| m.file_type().is_socket());
                if !ok {
                    missing.fetch_add(1, Ordering::Relaxed);
                }
                looks.fetch_add(1, Ordering::Release);
            }
        })
    };
    wait_until(10.0, "the watcher to start", || {
        looks.load(Ordering::Acquire) > 0
    });
    // SAFETY: signalling the broker this test started.
    unsafe { libc::kill(b.child.id() as i32, libc::SIGTERM) };
    assert!(b.child.wait().unwrap().success(), "a clean stop");
    let at_stop = looks.load(Ordering::Acquire);
    assert!(
        std::os::unix::net::UnixStream::connect(&socket).is_err(),
        "nothing listens after the stop"
    );
    b.restart();
    done.store(true, Ordering::Release);
    watcher.join().unwrap();
    let seen = looks.load(Ordering::Acquire);
    assert!(
        seen > at_stop,
        "the watcher did not look during the restart ({at_stop} looks by the stop, {seen} in all)"
    );
    assert_eq!(
        missing.load(Ordering::Relaxed),
        0,
        "the path was free in {} of {seen} looks",
        missing.load(Ordering::Relaxed)
    );
    // The restarted broker serves.
    assert!(b.status()["gpus"].as_array().is_some_and(|g| g.len() == 1));
}

/// Where the cgroup v2 hierarchy is mounted, if this process may make
/// cgroups in it.
fn cgroup2_root() -> Option<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let root = info.lines().find_map(|l| {
        let (before, after) = l.split_once(" - ")?;
        let at = before.split_whitespace().nth(4)?;
        (after.split_whitespace().next() == Some("cgroup2")).then(|| PathBuf::from(at))
    })?;
    let probe = root.join(format!("gpufrac-r5-probe-{}", std::process::id()));
    std::fs::create_dir(&probe).ok()?;
    std::fs::remove_dir(&probe).ok()?;
    Some(root)
}

/// A cgroup tree removed, deepest first, when the test ends (its
/// processes gone by then).
struct Cgroups(PathBuf);

impl Drop for Cgroups {
    fn drop(&mut self) {
        fn remove(d: &Path) {
            if let Ok(entries) = std::fs::read_dir(d) {
                for e in entries.flatten() {
                    if e.file_type().is_ok_and(|t| t.is_dir()) {
                        remove(&e.path());
                    }
                }
            }
            let _ = std::fs::remove_dir(d);
        }
        remove(&self.0);
    }
}

/// The review's planted name: systemd delegates a cgroup subtree to
/// every logged-in user (`user@UID.service`), who may name cgroups in it
/// anything. `nobody` made `slurm/job_4242<U+202E>LIVE` there and moved
/// its process in: root's `gpufrac top --once` showed that process as
/// Slurm job 4242, with the right-to-left override raw in the frame (a
/// zero-width space in its command went through raw too). Attribution
/// now comes only from slurmstepd's and the kubelet's own trees, with
/// well-formed ids, and every name a user chose is escaped, format
/// characters included.
#[test]
fn a_planted_cgroup_name_is_neither_shown_raw_nor_taken_for_a_slurm_job() {
    if !can_be_nobody() {
        return;
    }
    let Some(cg) = cgroup2_root() else {
        eprintln!("skipped: no cgroup v2 hierarchy this test may make cgroups in");
        return;
    };
    let b = Broker::start_open("16G", &[]);
    let (_dir, _tmp, jobs) = stage("r5-cgroup");
    // What systemd makes at login: the user's manager's subtree, handed
    // to the user, with the manager's processes in a leaf of it.
    let tree = Cgroups(cg.join(format!("gpufrac-r5-{}.slice", std::process::id())));
    let service = tree.0.join(format!("user@{NOBODY}.service"));
    let init = service.join("init.scope");
    std::fs::create_dir_all(&init).unwrap();
    for p in [&service, &init] {
        std::os::unix::fs::chown(p, Some(NOBODY), Some(NOBODY)).unwrap();
        for f in ["cgroup.procs", "cgroup.subtree_control", "cgroup.threads"] {
            let _ = std::os::unix::fs::chown(p.join(f), Some(NOBODY), Some(NOBODY));
        }
    }
    // The attacker's program under a name with a zero-width space.
    let named = jobs.join("train\u{200b}x");
    std::os::unix::fs::symlink(&artifacts().probe, &named).unwrap();
    let planted = service.join("slurm").join("job_4242\u{202e}LIVE");
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(
            "read go && mkdir -p \"$1\" && echo $$ > \"$1/cgroup.procs\" && echo moved && \
             exec \"$2\" ctx sleep-ms 60000",
        )
        .arg("sh")
        .arg(&planted)
        .arg(&named)
        .env("LD_LIBRARY_PATH", &artifacts().simdir)
        .env("GPUFRAC_SIM_DEVICES", "16G")
        .env("GPUFRAC_SIM_STATE", &b.state)
        .env("LD_PRELOAD", &artifacts().shim)
        .env("GPUFRAC_SOCKET", &b.socket)
        .env("GPUFRAC_BROKER", "optional")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    as_user(&mut cmd, NOBODY);
    let mut attacker = KillOnDrop(cmd.spawn().unwrap());
    let pid = attacker.0.id();
    std::fs::write(init.join("cgroup.procs"), pid.to_string()).unwrap();
    {
        use std::io::Write;
        let mut go = attacker.0.stdin.take().unwrap();
        go.write_all(b"go\n").unwrap();
    }
    assert_eq!(
        read_line(&mut attacker.0),
        "moved",
        "the attacker could not move"
    );
    let line = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    assert!(line.contains("job_4242\u{202e}LIVE"), "{line}");
    wait_until(30.0, "the attacker's process to register", || {
        b.process(pid).is_some()
    });
    let mut bad = Vec::new();
    for layout in [&[][..], &["--flat"][..]] {
        let o = Command::new(&artifacts().gpufrac)
            .args(["top", "--once", "--size", "220x40", "--socket"])
            .arg(&b.socket)
            .args(layout)
            .output()
            .unwrap();
        let frame = stdout(&o);
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(
            frame.contains(&pid.to_string()),
            "{layout:?}: no row of the attacker's: {frame}"
        );
        // The test's own list, not the escaper's: what the review planted
        // and its kin.
        let hidden = |c: char| {
            (c.is_control() && c != '\n')
                || matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{2069}' | '\u{feff}')
        };
        if let Some(c) = frame.chars().find(|&c| hidden(c)) {
            bad.push(format!(
                "{layout:?}: U+{:04X} shown raw:\n{frame}",
                c as u32
            ));
        }
        if frame.contains("job 4242") || frame.contains("job_4242") {
            bad.push(format!(
                "{layout:?}: the planted cgroup taken for a Slurm job:\n{frame}"
            ));
        }
        if !frame.contains("train\\u{200b}x") {
            bad.push(format!(
                "{layout:?}: the command's zero-width space not escaped:\n{frame}"
            ));
        }
    }
    stop(&mut attacker.0);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
