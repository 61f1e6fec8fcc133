//! The fourth hostile review's attacks (issue 32), each through real
//! processes against a real broker on a socket: the attacker is `nobody`
//! (uid 65534), the victim root or a third user, on the simulated driver.
//!
//! The review found each of these working against the broker as it then
//! was; the figures in each test's comment are what they did there. They
//! need another uid, so they run when the tests run as root and are
//! skipped, loudly, otherwise (`can_be_nobody`). Tests that measure GPU
//! time or flood the broker take `serial()`; the others run beside them.
//!
//! The attackers are small Python clients speaking the wire protocol
//! (frames encoded here, by the wire module, and handed over in hex), or
//! the test programs under the shim where the point is real work.

mod support;

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpufrac_common::config::Priority;
use gpufrac_common::wire::{self, ClientMsg, DeviceReg, LeaseReq, Role, ServerMsg};
use support::*;

const MS: u64 = 1_000_000;

/// A broker other users can reach (its socket's group nogroup, its
/// directory traversable, the simulated GPU's state shared), logging at
/// `info` into a file.
struct Open {
    _child: KillOnDrop,
    socket: PathBuf,
    log: PathBuf,
    state: PathBuf,
    devices: String,
    dir: Scratch,
}

impl Open {
    fn start(devices: &str, args: &[&str]) -> Open {
        Self::start_with(devices, args, |_| {})
    }

    /// `start`, `tweak` applied to the broker's command last.
    fn start_with(devices: &str, args: &[&str], tweak: impl FnOnce(&mut Command)) -> Open {
        let dir = Scratch::new("r4");
        std::fs::set_permissions(&dir.0, PermissionsExt::from_mode(0o755)).unwrap();
        let socket = dir.0.join("b.sock");
        let log = dir.0.join("broker.log");
        let state = dir.0.join("sim-state");
        let mut cmd = sim_command(&artifacts().gpufrac, devices, false);
        cmd.args(["broker", "--group", "nogroup", "--socket"])
            .arg(&socket)
            .args(args)
            .env("GPUFRAC_SIM_STATE", &state)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        if !args.contains(&"--state-dir") {
            cmd.arg("--state-dir").arg(dir.0.join("state"));
        }
        tweak(&mut cmd);
        let mut child = KillOnDrop(cmd.spawn().expect("starting gpufrac broker"));
        wait_until(20.0, "the broker socket", || {
            if let Ok(Some(st)) = child.0.try_wait() {
                panic!(
                    "broker exited early ({st}): {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            std::os::unix::net::UnixStream::connect(&socket).is_ok()
        });
        // The simulated GPU's shared state exists once the broker has
        // looked at its GPUs; every user's processes map it.
        if state.exists() {
            std::fs::set_permissions(&state, PermissionsExt::from_mode(0o666)).unwrap();
        }
        Open {
            _child: child,
            socket,
            log,
            state,
            devices: devices.into(),
            dir,
        }
    }

    fn log(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.log).unwrap()).into_owned()
    }

    fn uuid(&self) -> [u8; 16] {
        first_gpu_uuid_in(&status_cli(&self.socket))
    }

    /// `gpufrac run --socket S ARGS`.
    fn run(&self, args: &[&str]) -> Command {
        let mut cmd = sim_command(&artifacts().gpufrac, &self.devices, false);
        cmd.env_remove("GPUFRAC_BROKER")
            .env("GPUFRAC_SIM_STATE", &self.state)
            .args(["run", "--socket"])
            .arg(&self.socket)
            .args(args);
        cmd
    }

    /// `program` under the shim, talking to this broker in `mode`
    /// (`optional`, `required`).
    fn shim(&self, program: impl AsRef<Path>, mode: &str) -> Command {
        let mut cmd = sim_command(program, &self.devices, true);
        cmd.env("GPUFRAC_SOCKET", &self.socket)
            .env("GPUFRAC_BROKER", mode)
            .env("GPUFRAC_SIM_STATE", &self.state);
        cmd
    }

    /// A directory every user may write, for jobs' files.
    fn shared_dir(&self, name: &str) -> PathBuf {
        let d = self.dir.0.join(name);
        std::fs::create_dir(&d).unwrap();
        std::fs::set_permissions(&d, PermissionsExt::from_mode(0o777)).unwrap();
        d
    }
}

fn frames(msgs: &[ClientMsg]) -> Vec<u8> {
    let mut out = Vec::new();
    for m in msgs {
        wire::encode_client(m, &mut out);
    }
    out
}

/// The first byte of `m`'s frame body: how the Python clients tell the
/// broker's messages apart.
fn tag(m: &ServerMsg) -> u8 {
    let mut out = Vec::new();
    wire::encode_server(m, &mut out);
    out[4]
}

/// What every attacker script starts with: the socket (`PATH`), the
/// frames it may send (`M[name]`, from a file of `name hex` lines: a
/// frame can be larger than the kernel lets one variable or argument be),
/// the tags of the
/// broker's messages (`T[name]`), and a frame reader.
const PRELUDE: &str = r#"
import os, socket, struct, sys, threading, time
PATH = os.environ["ATTACK_SOCKET"]
M = {}
for l in open(os.environ["ATTACK_MSGS"]):
    k, v = l.split()
    M[k] = bytes.fromhex(v)
T = {k[4:].lower(): int(v) for k, v in os.environ.items() if k.startswith("TAG_")}
def connect():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(PATH)
    return s
class Frames:
    def __init__(self, s):
        self.s, self.buf = s, b""
    def next(self):
        # (tag, body) of the next frame; None once the broker closed.
        while True:
            if len(self.buf) >= 4:
                n = struct.unpack("<I", self.buf[:4])[0]
                if len(self.buf) >= 4 + n:
                    body, self.buf = self.buf[4:4 + n], self.buf[4 + n:]
                    return body[0], body
            try:
                d = self.s.recv(1 << 16)
            except OSError:
                return None
            if not d:
                return None
            self.buf += d
    def until(self, *tags):
        while True:
            f = self.next()
            if f is None or f[0] in tags:
                return f
def drain(s):
    try:
        while s.recv(1 << 16):
            pass
    except OSError:
        pass
def say(x):
    print(x, flush=True)
def registered():
    # A new connection that sent M["register"], and its frames, once the
    # broker said registered; the script exits otherwise.
    s = connect()
    s.sendall(M["register"])
    f = Frames(s)
    fr = f.until(T["registered"])
    if fr is None or fr[0] != T["registered"]:
        sys.exit("not registered")
    return s, f
"#;

/// A Python client as `uid` running `body` after `PRELUDE`, with the
/// frames `msgs` and `args` as its argv after the script.
fn python_as(uid: u32, b: &Open, body: &str, msgs: &[(&str, Vec<u8>)], args: &[&str]) -> Command {
    // A script file, not `-c`: the command line the broker reads starts
    // with `args`.
    let n = mono_ns();
    let script = b.dir.0.join(format!("attack-{n}.py"));
    std::fs::write(&script, format!("{PRELUDE}\n{body}")).unwrap();
    std::fs::set_permissions(&script, PermissionsExt::from_mode(0o644)).unwrap();
    let mut c = Command::new("python3");
    c.arg(&script)
        .args(args)
        .env("ATTACK_SOCKET", &b.socket)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let tags = [
        ("HELLO_OK", ServerMsg::HelloOk { version: 0 }),
        (
            "GRANT",
            ServerMsg::Grant {
                uuid: [0; 16],
                grant: 0,
                slice_ns: 0,
                bound_ns: 0,
                waiters: false,
            },
        ),
        (
            "REVOKE",
            ServerMsg::Revoke {
                uuid: [0; 16],
                grant: 0,
            },
        ),
        ("LEASED", ServerMsg::Leased(wire::Lease::default())),
        (
            "REFUSED",
            ServerMsg::Refused {
                reason: String::new(),
            },
        ),
        (
            "ERROR",
            ServerMsg::Error {
                code: 0,
                message: String::new(),
            },
        ),
        ("REGISTERED", ServerMsg::Registered { mem_cap: 0 }),
    ];
    for (name, m) in tags {
        c.env(format!("TAG_{name}"), tag(&m).to_string());
    }
    let file = b.dir.0.join(format!("msgs-{n}"));
    let text: String = msgs
        .iter()
        .map(|(name, bytes)| format!("{name} {}\n", hex(bytes)))
        .collect();
    std::fs::write(&file, text).unwrap();
    std::fs::set_permissions(&file, PermissionsExt::from_mode(0o644)).unwrap();
    c.env("ATTACK_MSGS", &file);
    as_user(&mut c, uid);
    c
}

/// The child's next line of output, or None when it has printed none
/// within `secs` (or closed its output).
fn line_within(c: &mut Child, secs: u64) -> Option<String> {
    use std::os::fd::AsRawFd;
    let out = c.stdout.as_mut().unwrap();
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut line = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut pfd = libc::pollfd {
            fd: out.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, valid for the call.
        let n = unsafe { libc::poll(&mut pfd, 1, left.as_millis() as libc::c_int) };
        if n <= 0 {
            return None;
        }
        let mut b = [0u8; 1];
        match out.read(&mut b) {
            Ok(1) if b[0] == b'\n' => return Some(String::from_utf8_lossy(&line).into_owned()),
            Ok(1) => line.push(b[0]),
            _ => return None,
        }
    }
}

/// Waits for the attacker to say `word` (its attack is under way).
fn started_saying(a: &mut KillOnDrop, word: &str) {
    let said = line_within(&mut a.0, 60);
    assert_eq!(
        said.as_deref(),
        Some(word),
        "the attacker did not start within 60 s"
    );
}

fn attacker(b: &Open, body: &str, msgs: &[(&str, Vec<u8>)], args: &[&str]) -> KillOnDrop {
    KillOnDrop(
        python_as(NOBODY, b, body, msgs, args)
            .spawn()
            .expect("python3"),
    )
}

/// A registration of this process on `uuid` (a shim's first frames).
fn shim_hello_register(uuid: [u8; 16], command: &str, priority: Priority) -> Vec<u8> {
    frames(&[
        ClientMsg::hello(1, Role::Shim),
        register_msg(uuid, command, priority),
    ])
}

/// A `normal` shim's frames on `uuid`, by the names the scripts send them
/// by: `register` (as `command`), `acquire`, `release` (having held
/// `held_ns`) and `again` (let go and ask again at once).
fn shim_frames(uuid: [u8; 16], command: &str, held_ns: u64) -> Vec<(&'static str, Vec<u8>)> {
    let release = [
        ClientMsg::Release { uuid, held_ns },
        ClientMsg::Drained { uuid },
    ];
    let again = [
        ClientMsg::Release { uuid, held_ns: 0 },
        ClientMsg::Drained { uuid },
        ClientMsg::Acquire { uuid },
    ];
    vec![
        (
            "register",
            shim_hello_register(uuid, command, Priority::Normal),
        ),
        ("acquire", frames(&[ClientMsg::Acquire { uuid }])),
        ("release", frames(&release)),
        ("again", frames(&again)),
    ]
}

/// How long each of `n` pings on a connection opened now took, one every
/// 50 ms; stops at the first left unanswered for 5 s (None), or once they
/// have taken 10 s.
fn ping_times(socket: &Path, n: usize) -> Vec<Option<Duration>> {
    let all = Instant::now();
    let mut c = RawClient::connect(socket);
    c.s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let t = Instant::now();
    c.send(&ClientMsg::hello(std::process::id(), Role::Cli));
    let mut times = Vec::new();
    if !matches!(c.recv(), Some(ServerMsg::HelloOk { .. })) {
        times.push(None);
        return times;
    }
    times.push(Some(t.elapsed()));
    for _ in 0..n {
        if all.elapsed() > Duration::from_secs(10) {
            break;
        }
        let t = Instant::now();
        c.send(&ClientMsg::Ping);
        match c.recv() {
            Some(ServerMsg::Pong) => times.push(Some(t.elapsed())),
            _ => {
                times.push(None);
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    times
}

/// Two of root's processes spinning on the GPU from now on, taking turns
/// through the broker: while they run, each asks it for the GPU every
/// slice, so a broker that stops answering shows in their logs.
struct Spinners(Vec<Child>);

impl Spinners {
    fn start(b: &Open, secs: u64) -> Spinners {
        let start = mono_ns() + 500 * MS;
        let end = start + secs * 1000 * MS;
        let kids = (0..2)
            .map(|_| {
                b.shim(&artifacts().probe, "optional")
                    .env("GPUFRAC_LOG", "warn")
                    .args(spin_args(start, end))
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        Spinners(kids)
    }

    /// What went wrong for them: a failure, or a stretch without the broker.
    fn trouble(self) -> Vec<String> {
        let mut out = Vec::new();
        for c in self.0 {
            let o = c.wait_with_output().unwrap();
            let err = stderr(&o);
            if !o.status.success() {
                out.push(format!("a spinner failed: {err}"));
            }
            out.extend(
                err.lines()
                    .filter(|l| l.contains("has not answered") || l.contains("lost the broker"))
                    .map(|l| format!("a running process: {l}")),
            );
        }
        out
    }
}

/// Root's side of every flood: pings on a new connection answered within
/// a bound, `gpufrac run --no-wait` and a process that needs the broker to
/// start served, and two running processes kept arbitrated. Returns the
/// failures, each in words, and says the figures.
fn victim_checks(b: &Open, spinners: Spinners, what: &str) -> Vec<String> {
    let mut bad = Vec::new();
    let times = ping_times(&b.socket, 40);
    let answered: Vec<Duration> = times.iter().flatten().copied().collect();
    let worst = answered.iter().max().copied().unwrap_or_default();
    let mut sorted = answered.clone();
    sorted.sort();
    let median = sorted.get(sorted.len() / 2).copied().unwrap_or_default();
    eprintln!(
        "figure: {what}: the victim's hello and pings: {} of {} answered, median {median:?}, worst {worst:?}",
        answered.len(),
        times.len()
    );
    if answered.len() < times.len() {
        bad.push(format!(
            "a ping went unanswered for 5 s (after {} answered)",
            answered.len()
        ));
    }
    // Well under a second: an answer waits for at most one user's part
    // of a turn, a bounded amount of work.
    if worst > Duration::from_millis(500) {
        bad.push(format!("a ping took {worst:?}"));
    }
    let t = Instant::now();
    match output_within(
        &mut b.run(&["--no-wait", "--gpu-memory", "1G", "--", "true"]),
        10,
    ) {
        Some(o) if o.status.success() => {
            eprintln!(
                "figure: {what}: gpufrac run --no-wait took {:?}",
                t.elapsed()
            )
        }
        Some(o) => bad.push(format!("gpufrac run --no-wait failed: {}", stderr(&o))),
        None => bad.push("gpufrac run --no-wait took over 10 s".into()),
    }
    match output_within(
        b.shim(&artifacts().probe, "required")
            .args(["ctx", "launch", "3", "1000"]),
        15,
    ) {
        Some(o) if o.status.success() && stdout(&o).contains("launch rc=0") => {}
        Some(o) => bad.push(format!(
            "a GPUFRAC_BROKER=required process failed: {}{}",
            stdout(&o),
            stderr(&o)
        )),
        None => bad.push("a GPUFRAC_BROKER=required process hung for 15 s".into()),
    }
    bad.extend(spinners.trouble());
    bad
}

/// The attack: one process of `nobody`'s with a 4.5 MiB command line (36
/// arguments of 128 KiB of control bytes) registers on 32 connections,
/// again and again. The broker read the whole `/proc/PID/cmdline` and
/// escaped every byte before cutting it to 256 for each connection's
/// first Register (about 75 ms a Register for 2 MiB in a release build):
/// another user's pings went from 0.04 ms to 2.5 s, and none came back in
/// 5 s with 4.5 MiB; `gpufrac run --no-wait` took 12.8 s or failed, a
/// `GPUFRAC_BROKER=required` process failed cuInit, and running
/// processes lost their arbitration. Nothing the broker does for one
/// frame may grow with a size a user controls.
#[test]
fn a_huge_command_line_registered_on_many_connections_leaves_others_served() {
    if !can_be_nobody() {
        return;
    }
    let _s = serial();
    let b = Open::start("16G", &[]);
    let uuid = b.uuid();
    // The frame's own command is as big as a frame allows, for a broker
    // that takes the label from the client instead of /proc.
    let label = "\u{1}".repeat(200 << 10);
    let arg = "\u{1}".repeat((128 << 10) - 1);
    let args: Vec<&str> = (0..36).map(|_| arg.as_str()).collect();
    let mut cmd = python_as(
        NOBODY,
        &b,
        r#"
first = True
while True:
    conns = []
    for _ in range(32):
        s = connect()
        s.sendall(M["register"])
        conns.append((s, Frames(s)))
    if first:
        say("attacking")
        first = False
    # Each connection is closed once registered (or after 10 s), and a
    # new one registers in its place: its first Register is the costly one.
    for s, f in conns:
        s.settimeout(10.0)
        f.until(T["registered"], T["error"])
        s.close()
"#,
        &[(
            "register",
            shim_hello_register(uuid, &label, Priority::Normal),
        )],
        &args,
    );
    // Arguments this long need a larger stack limit (a quarter of it
    // holds them).
    // SAFETY: setrlimit in the child before exec.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
            let rl = libc::rlimit {
                rlim_cur: 256 << 20,
                rlim_max: 256 << 20,
            };
            libc::setrlimit(libc::RLIMIT_STACK, &rl);
            Ok(())
        });
    }
    let mut a = KillOnDrop(cmd.spawn().expect("python3"));
    started_saying(&mut a, "attacking");
    let spinners = Spinners::start(&b, 10);
    let bad = victim_checks(&b, spinners, "32 connections registering a 4.5 MiB argv");
    assert!(
        a.0.try_wait().unwrap().is_none(),
        "the attacker stopped early"
    );
    assert!(
        bad.is_empty(),
        "beside 32 connections registering a 4.5 MiB command line: {bad:#?}"
    );
}

/// The attack: `nobody` takes a lease (no GPU, only a job to name) and
/// sends `Name` frames with a pod and a label of 64 KiB of control bytes
/// each, as fast as it can. Each was escaped whole (four bytes out for
/// each in) before it was cut: another user's pings took 119 ms in a
/// release build, without any big command line.
#[test]
fn name_frames_of_control_bytes_leave_others_served() {
    if !can_be_nobody() {
        return;
    }
    let _s = serial();
    let b = Open::start("16G", &[]);
    let junk = "\u{1}".repeat(64 << 10);
    let name = frames(&[ClientMsg::Name {
        pod: junk.clone(),
        label: junk,
    }]);
    let _a = {
        let mut a = attacker(
            &b,
            r#"
# A connection reads at most 64 KiB a turn, so a frame this big takes
# two: many connections, each naming its own lease, fill the user's
# part of every turn.
ready = threading.Semaphore(0)
def namer():
    s = connect()
    s.sendall(M["lease"])
    f = Frames(s)
    if f.until(T["leased"])[0] != T["leased"]:
        sys.exit("no lease")
    threading.Thread(target=drain, args=(s,), daemon=True).start()
    ready.release()
    burst = M["name"] * 8
    while True:
        s.sendall(burst)
n = int(sys.argv[1])
for _ in range(n):
    threading.Thread(target=namer, daemon=True).start()
for _ in range(n):
    ready.acquire()
say("attacking")
time.sleep(3600)
"#,
            &[
                (
                    "lease",
                    frames(&[
                        ClientMsg::hello(1, Role::Cli),
                        ClientMsg::Lease(LeaseReq {
                            command: "namer".into(),
                            ..LeaseReq::default()
                        }),
                    ]),
                ),
                ("name", name),
            ],
            &["60"],
        );
        started_saying(&mut a, "attacking");
        a
    };
    let spinners = Spinners::start(&b, 10);
    let bad = victim_checks(&b, spinners, "Name frames of 2 x 64 KiB control bytes");
    assert!(
        bad.is_empty(),
        "beside Name frames of 2 x 64 KiB control bytes: {bad:#?}"
    );
}

/// GPU seconds a `probe spin` run reported, over all its windows.
fn spun_s(o: &std::process::Output) -> f64 {
    assert!(o.status.success(), "{}{}", stdout(o), stderr(o));
    let out = stdout(o);
    let ns: u64 = out
        .lines()
        .filter(|l| l.starts_with("spin "))
        .map(|l| {
            l.split_whitespace()
                .find_map(|kv| kv.strip_prefix("gpu_ns="))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no gpu_ns in {l:?}"))
        })
        .sum();
    ns as f64 / 1e9
}

/// Root's busy process at `priority` on the GPU from `start` to `end`.
fn busy_victim(b: &Open, priority: &str, start: u64, end: u64) -> Child {
    b.shim(&artifacts().probe, "optional")
        .env("GPU_COMPUTE_PRIORITY", priority)
        .args(spin_args(start, end))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Root's busy process at `priority` runs for 6 s beside the raw
/// attacker `a` (whose grants are idle GPU time), which must still run
/// after, and keeps at least 0.3 of the GPU: `beside` says what it ran
/// beside, for the figure and the failure.
fn victim_keeps_its_gpu(b: &Open, a: &mut KillOnDrop, priority: &str, beside: &str) {
    let window = 6.0;
    let start = mono_ns() + 500 * MS;
    let v = busy_victim(b, priority, start, start + (window * 1e9) as u64);
    let got = spun_s(&v.wait_with_output().unwrap());
    assert!(a.0.try_wait().unwrap().is_none(), "the attacker stopped");
    eprintln!("figure: a busy {priority} process beside {beside}: {got:.2} s of GPU in {window} s");
    assert!(
        got >= 0.3 * window,
        "a busy {priority} process beside {beside} got {got:.2} s of GPU in {window} s"
    );
}

/// Root's busy process runs from `start` to `end` beside the `attackers`
/// (busy `probe spin` runs of another user) and gets at least 0.4 of the
/// GPU time they all got (its fair part: half): `beside` says what they
/// are, for the figure and the failure.
fn victim_gets_half(b: &Open, attackers: Vec<Child>, start: u64, end: u64, beside: &str) {
    let v = busy_victim(b, "normal", start, end);
    let theirs: Vec<f64> = attackers
        .into_iter()
        .map(|c| spun_s(&c.wait_with_output().unwrap()))
        .collect();
    let mine = spun_s(&v.wait_with_output().unwrap());
    let share = mine / (mine + theirs.iter().sum::<f64>());
    eprintln!(
        "figure: a busy process beside {beside}: {mine:.2} s of GPU against their {:.2} s ({share:.2} of the GPU)",
        theirs.iter().sum::<f64>()
    );
    assert!(
        share >= 0.4,
        "a busy process beside {beside} got {mine:.2} s of GPU against their {theirs:.2?} ({share:.2}; its fair part: half)"
    );
}

/// The attack: sixteen connections of one user, registered on the GPU,
/// take turns: one asks for the GPU, holds it until recalled, lets go,
/// and the next one asks. Virtual time was kept per connection, and one
/// that came back from idle started a timeslice behind the holder and
/// took the GPU at once: each connection carried a sixteenth of its
/// user's debt. Another user's busy process kept 0.57 s of 8 s of GPU
/// (4.08 s beside one connection doing the same), the GPU idle
/// meanwhile. A user's debt is the user's, however many connections.
#[test]
fn connections_taking_turns_do_not_multiply_a_users_share() {
    if !can_be_nobody() {
        return;
    }
    let _s = serial();
    let b = Open::start("16G", &[]);
    let uuid = b.uuid();
    let mut a = attacker(
        &b,
        r#"
conns = []
for _ in range(int(sys.argv[1])):
    conns.append(registered())
say("attacking")
i = 0
while True:
    s, f = conns[i]
    s.sendall(M["acquire"])
    f.until(T["grant"])
    f.until(T["revoke"])
    s.sendall(M["release"])
    i = (i + 1) % len(conns)
"#,
        &shim_frames(uuid, "turns", 0),
        &["16"],
    );
    started_saying(&mut a, "attacking");
    // Its fair part is half: on a loaded machine one connection doing the
    // same left it 0.39 to 0.46 of the window.
    victim_keeps_its_gpu(
        &b,
        &mut a,
        "normal",
        "16 connections of another user taking turns",
    );
}

/// The same with real work: sixteen processes of one user, each running
/// 1 ms kernels for 50 ms in turn (a token passed round), beside another
/// user's busy process. They took 4.94 s of GPU against the victim's
/// 2.53 s (3.70 s and 3.70 s with one process each).
#[test]
fn processes_taking_turns_do_not_multiply_a_users_share() {
    if !can_be_nobody() {
        return;
    }
    let _s = serial();
    let b = Open::start("16G", &[]);
    let n = 16u64;
    let turn = 50 * MS;
    let start = mono_ns() + 3000 * MS;
    let rounds = 8u64;
    let end = start + rounds * n * turn;
    let attackers: Vec<Child> = (0..n)
        .map(|i| {
            let mut c = b.shim(&artifacts().probe, "optional");
            c.arg("ctx");
            for k in 0..rounds {
                let from = start + (k * n + i) * turn;
                c.args(["spin", &from.to_string(), &(from + turn).to_string()])
                    .args(["1000000", "2"]);
            }
            c.stdout(Stdio::piped()).stderr(Stdio::piped());
            as_user(&mut c, NOBODY).spawn().unwrap()
        })
        .collect();
    // One process doing the same work left it 0.53 to 0.56.
    victim_gets_half(
        &b,
        attackers,
        start,
        end,
        "16 processes of another user taking turns",
    );
}

/// The attack: a `normal` holder of `nobody`'s answers every recall with
/// Release and Acquire at once, doing no work, beside another user's
/// busy `low` process. Recalled at the end of each slice, it was granted
/// back at once: the victim kept 0.3 s of 8 s of GPU on a GPU that was
/// 4% busy. The simulated driver reports per-process work as NVML does:
/// a recalled holder it never saw at work goes behind the waiting class
/// (its user's benefit of the doubt spent), longer at each recall.
#[test]
fn a_holder_answering_recalls_by_asking_again_does_not_starve_a_low_victim() {
    if !can_be_nobody() {
        return;
    }
    let _s = serial();
    let b = Open::start("16G", &[]);
    let uuid = b.uuid();
    let mut a = attacker(
        &b,
        r#"
s, f = registered()
s.sendall(M["acquire"])
f.until(T["grant"])
say("attacking")
while True:
    fr = f.until(T["revoke"])
    if fr is None:
        sys.exit("closed")
    s.sendall(M["again"])
"#,
        &shim_frames(uuid, "pretender", 0),
        &[],
    );
    started_saying(&mut a, "attacking");
    // The GPU is otherwise idle: the victim would have nearly all of it
    // (5.13 s beside a holder that only lets go), and half of it even if
    // the holder took every other slice.
    victim_keeps_its_gpu(
        &b,
        &mut a,
        "low",
        "another user's holder that answers each recall by asking again",
    );
}

/// The attack (found by the red-team search, `idle_seed_20261126` in
/// `redteam/tests/found.rs`): `nobody` starts a new process every 10 ms
/// that registers at `normal`, asks for the GPU, never launches nor
/// answers a revoke, and exits once the next has asked. The GPU passed
/// from each holder to the next as it left, no holder was ever revoked
/// or let go, and none was judged for evidence of work: another user's
/// busy `low` process waited on an idle GPU. A holder that leaves is
/// judged as one that lets go.
#[test]
fn holders_handing_the_gpu_on_by_exiting_do_not_starve_a_low_victim() {
    if !can_be_nobody() {
        return;
    }
    let _s = serial();
    let b = Open::start("16G", &[]);
    let uuid = b.uuid();
    let mut a = attacker(
        &b,
        r#"
# Each child exits when this process does (its pipe's end closes).
alive_r, alive_w = os.pipe()
def child(w):
    os.close(alive_w)
    s, _ = registered()
    s.sendall(M["acquire"])
    os.write(w, b"x")
    os.read(alive_r, 1)
prev = None
said = False
while True:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            child(w)
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    if not got:
        sys.exit("a child could not register")
    if prev is not None:
        os.kill(prev, 9)
        os.waitpid(prev, 0)
    prev = pid
    if not said:
        say("attacking")
        said = True
    time.sleep(0.01)
"#,
        &shim_frames(uuid, "leaver", 0),
        &[],
    );
    started_saying(&mut a, "attacking");
    victim_keeps_its_gpu(
        &b,
        &mut a,
        "low",
        "another user's holders, each a new process exiting as the next asks",
    );
}

/// The attack (found by the red-team search,
/// `a_pretender_beside_a_working_connection_of_its_process` in
/// `redteam/tests/found.rs`): one process of `nobody`'s holds two
/// connections on the GPU. One runs 20 ms of real kernels each second
/// (the driver sees the process at work); the other, a `normal` holder
/// that launches nothing, answers every recall by asking again. The
/// driver counts work by process, and the pretender was granted back at
/// each recall on its process's evidence: a `low` victim waited on an
/// idle GPU. Evidence is a connection's only where it is its process's
/// one on that GPU, as a shim's is.
#[test]
fn a_pretender_beside_a_working_connection_of_its_process_does_not_starve_a_low_victim() {
    if !can_be_nobody() {
        return;
    }
    let _s = serial();
    let b = Open::start("16G", &[]);
    let uuid = b.uuid();
    let mut a = on_sim_cuda(
        &b,
        r#"
def pretend():
    s, f = registered()
    s.sendall(M["acquire"])
    while True:
        if f.until(T["revoke"]) is None:
            os._exit(3)
        s.sendall(M["again"])
threading.Thread(target=pretend, daemon=True).start()
s, f = registered()
said = False
while True:
    t = time.monotonic()
    s.sendall(M["acquire"])
    if f.until(T["grant"]) is None:
        sys.exit("closed")
    work(20_000_000)
    s.sendall(M["release"])
    if not said:
        say("attacking")
        said = True
    time.sleep(max(0.0, 1.0 - (time.monotonic() - t)))
"#,
        &shim_frames(uuid, "pretender", 20 * MS),
    );
    started_saying(&mut a, "attacking");
    victim_keeps_its_gpu(
        &b,
        &mut a,
        "low",
        "a holder asking again at each recall beside a connection of its process working 20 ms a second",
    );
}

/// A Python prelude for an attacker whose process runs real kernels: its
/// CUDA context on the simulated driver, without the shim (its kernels run
/// whenever it launches them, and NVML counts them as this process's
/// work), and `work(ns)`, one kernel of `ns` waited for.
const SIM_CUDA: &str = r#"
import ctypes
cu = ctypes.CDLL("libcuda.so.1")
dev, ctx, mod, fn = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
for rc in (cu.cuInit(0), cu.cuDeviceGet(ctypes.byref(dev), 0),
           cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev),
           cu.cuModuleLoadData(ctypes.byref(mod), b"sim"),
           cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"spin")):
    if rc != 0:
        sys.exit(f"CUDA: {rc}")
def work(ns):
    d = ctypes.c_uint64(ns)
    params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(d), ctypes.c_void_p))
    rc = cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, params, None)
    if rc != 0 or cu.cuCtxSynchronize() != 0:
        sys.exit(f"launch: {rc}")
"#;

/// Starts a Python client of `nobody`'s on `b`'s simulated GPU, running
/// `body` after `SIM_CUDA`, with the frames `msgs`.
fn on_sim_cuda(b: &Open, body: &str, msgs: &[(&str, Vec<u8>)]) -> KillOnDrop {
    let mut cmd = python_as(NOBODY, b, &format!("{SIM_CUDA}{body}"), msgs, &[]);
    cmd.env("LD_LIBRARY_PATH", &artifacts().simdir)
        .env("GPUFRAC_SIM_DEVICES", &b.devices)
        .env("GPUFRAC_SIM_STATE", &b.state);
    KillOnDrop(cmd.spawn().expect("python3"))
}

/// The attack (issue 40): a `normal` holder whose process runs one 100 us
/// kernel every 500 ms, 0.02% of the GPU, on its own and only connection,
/// and answers every recall by letting go and asking again. The driver
/// saw its process at work in every sample, and a sample above zero was
/// all the evidence asked for: a busy `low` victim of root's got 0.01 s of
/// GPU in 6 s (4.79 s beside a holder running nothing). Evidence is work
/// in proportion to the time held.
#[test]
fn a_holder_doing_a_little_work_does_not_starve_a_low_victim() {
    if !can_be_nobody() {
        return;
    }
    let _s = serial();
    let b = Open::start("16G", &[]);
    let uuid = b.uuid();
    let mut a = on_sim_cuda(
        &b,
        r#"
def hold(s, f):
    while True:
        if f.until(T["revoke"]) is None:
            os._exit(3)
        s.sendall(M["again"])
s, f = registered()
s.sendall(M["acquire"])
if f.until(T["grant"]) is None:
    sys.exit("closed")
threading.Thread(target=hold, args=(s, f), daemon=True).start()
say("attacking")
# The context is this thread's: the kernels are launched from here.
while True:
    work(100_000)
    time.sleep(0.5)
"#,
        &shim_frames(uuid, "little", 100_000),
    );
    started_saying(&mut a, "attacking");
    victim_keeps_its_gpu(
        &b,
        &mut a,
        "low",
        "another user's holder running 100 us of kernels every 500 ms and asking again at each recall",
    );
}

/// The attack: one user runs a busy `high` process and a busy `normal`
/// one beside another user's busy `normal` process. `high` held the GPU
/// for its ceiling (half of each second) and the `normal` process shared
/// the rest: the attacker got 5.71 s against the victim's 1.87 s.
/// Priority buys latency, never throughput: time in `high` is charged to
/// its user's part.
#[test]
fn high_beside_normal_does_not_buy_a_user_more_than_its_part() {
    if !can_be_nobody() {
        return;
    }
    let _s = serial();
    let b = Open::start("16G", &[]);
    let start = mono_ns() + 2000 * MS;
    let end = start + 6000 * MS;
    let attackers: Vec<Child> = ["high", "normal"]
        .into_iter()
        .map(|priority| {
            let mut c = b.shim(&artifacts().probe, "optional");
            c.env("GPU_COMPUTE_PRIORITY", priority)
                .args(spin_args(start, end))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            as_user(&mut c, NOBODY).spawn().unwrap()
        })
        .collect();
    // Two normal processes of one user left it 0.50.
    victim_gets_half(
        &b,
        attackers,
        start,
        end,
        "another user's busy high and normal processes",
    );
}

/// Whether the log line `line` names the number `n` on its own (not
/// inside a longer number), after its timestamp.
fn names_number(line: &str, n: u64) -> bool {
    let line = line.split_once(' ').map_or(line, |(_, rest)| rest);
    let n = n.to_string();
    line.match_indices(&n).any(|(i, _)| {
        let before = line[..i].chars().next_back();
        let after = line[i + n.len()..].chars().next();
        !before.is_some_and(|c| c.is_ascii_digit()) && !after.is_some_and(|c| c.is_ascii_digit())
    })
}

/// A third user, the victim of the log attacks: `daemon`, in the socket's
/// group so that it may reach the broker.
const DAEMON: u32 = 1;

/// The attack: `nobody` asks for a `high` lease it may not have once a
/// second. One limiter served every warning a client could provoke, at
/// most one every 10 s: the first refusal took it, and another user's
/// refusal, and the broker's own "cannot write the state file", went
/// unsaid. A warning about one user is never silenced by another's, and
/// the broker's own warnings share no limiter with users.
#[test]
fn one_users_refusals_do_not_silence_anothers_or_the_brokers_own_warnings() {
    if !can_be_nobody() {
        return;
    }
    let b = Open::start("16G", &["--high-allow", "root"]);
    let mut a = attacker(
        &b,
        r#"
while True:
    s = connect()
    s.sendall(M["lease"])
    f = Frames(s)
    fr = f.until(T["refused"], T["leased"])
    say("refused" if fr is not None and fr[0] == T["refused"] else "not refused")
    s.close()
    time.sleep(1)
"#,
        &[(
            "lease",
            frames(&[
                ClientMsg::hello(1, Role::Cli),
                ClientMsg::Lease(LeaseReq {
                    priority: Some(Priority::High),
                    command: "asks for high".into(),
                    ..LeaseReq::default()
                }),
            ]),
        )],
        &[],
    );
    started_saying(&mut a, "refused");
    let attacker_pid = u64::from(a.0.id());
    wait_until(10.0, "the attacker's refusal in the log", || {
        b.log()
            .lines()
            .any(|l| l.contains("refus") && names_number(l, attacker_pid))
    });
    // Another user is refused the same, once.
    let mut v = b.run(&["--priority", "high", "--", "true"]);
    as_user_in_group(&mut v, DAEMON, NOBODY)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let v = v.spawn().unwrap();
    let victim_pid = u64::from(v.id());
    let vo = v.wait_with_output().unwrap();
    assert!(
        !vo.status.success(),
        "uid 1 was given high: {}",
        stderr(&vo)
    );
    // And the broker cannot write its state file: its directory is gone
    // (as on a full or read-only file system).
    let state_dir = b.dir.0.join("state");
    let from = b.log().len();
    std::fs::remove_dir_all(&state_dir).unwrap();
    let o = b
        .run(&["--gpu-memory", "1G", "--", "true"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let victims_line = |log: &str| {
        log.lines()
            .any(|l| l.to_lowercase().contains("refus") && names_number(l, victim_pid))
    };
    let state_line = |log: &str| log[from..].to_lowercase().contains("state file");
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(3) && !(victims_line(&b.log()) && state_line(&b.log()))
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = b.log();
    assert!(a.0.try_wait().unwrap().is_none(), "the attacker stopped");
    let (victims, state) = (victims_line(&log), state_line(&log));
    eprintln!(
        "figure: beside nobody's refused lease once a second: uid 1's refusal logged: {victims}, the state file warning logged: {state}"
    );
    assert!(
        victims && state,
        "beside nobody's refused lease once a second, uid 1's refusal (pid {victim_pid}) logged: \
         {victims}, the broker's own warning that it cannot write its state file logged: {state}:\n{log}"
    );
}

/// Lines of `log` that name the attacker: its pid or its uid.
fn lines_naming(log: &str, pid: u64, uid: u32) -> usize {
    log.lines()
        .filter(|l| names_number(l, pid) || names_number(l, u64::from(uid)))
        .count()
}

/// The per-user log budget (broker/src/proto/mod.rs, LOG_BURST, and a
/// line every LOG_EVERY): 64 lines at once, then 10 a second.
const LOG_BURST: f64 = 64.0;
const LOG_PER_S: f64 = 10.0;

/// The attack: `nobody` takes and drops leases on 32 connections as fast
/// as it can. "lease granted" lines were written outside the per-user log
/// budget: 600 lines a second (the budget is 10). Every line a client can
/// cause goes through its user's budget.
#[test]
fn lease_churn_stays_within_its_users_log_budget() {
    if !can_be_nobody() {
        return;
    }
    let _s = serial();
    let b = Open::start("16G", &[]);
    let started = Instant::now();
    let mut a = attacker(
        &b,
        r#"
first = threading.Event()
def churn():
    while True:
        s = connect()
        s.sendall(M["lease"])
        fr = Frames(s).until(T["leased"], T["refused"])
        if fr is not None and fr[0] == T["leased"]:
            first.set()
        s.close()
for _ in range(32):
    threading.Thread(target=churn, daemon=True).start()
first.wait()
say("churning")
time.sleep(3600)
"#,
        &[(
            "lease",
            frames(&[
                ClientMsg::hello(1, Role::Cli),
                ClientMsg::Lease(LeaseReq {
                    want_mem: 64 << 20,
                    no_wait: true,
                    command: "churn".into(),
                    ..LeaseReq::default()
                }),
            ]),
        )],
        &[],
    );
    started_saying(&mut a, "churning");
    let pid = u64::from(a.0.id());
    std::thread::sleep(Duration::from_secs(5));
    let log = b.log();
    let secs = started.elapsed().as_secs_f64();
    assert!(a.0.try_wait().unwrap().is_none(), "the attacker stopped");
    let lines = lines_naming(&log, pid, NOBODY);
    let granted = log
        .lines()
        .filter(|l| l.contains("lease granted") && names_number(l, pid))
        .count();
    eprintln!(
        "figure: lease churn on 32 connections: {lines} log lines about the attacker in {secs:.1} s ({granted} of them lease granted)"
    );
    // Twice the budget: a line let through after some were held back may
    // come with one saying how many.
    let bound = 2.0 * (LOG_BURST + LOG_PER_S * secs) + 4.0;
    assert!(
        (lines as f64) <= bound,
        "{lines} log lines about nobody's lease churn in {secs:.1} s (its budget allows {bound:.0})"
    );
}

/// The fields of a log line as `key=value` pairs, a value in double
/// quotes read whole (with its backslash escapes), as a log shipper reads
/// them.
fn fields(line: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut chars = line.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.peek().is_none() {
            return out;
        }
        let mut token = String::new();
        let mut quoted = false;
        while let Some(&c) = chars.peek() {
            if c.is_whitespace() && !quoted {
                break;
            }
            chars.next();
            match c {
                '"' => quoted = !quoted,
                '\\' if quoted => {
                    if let Some(e) = chars.next() {
                        token.push(e);
                    }
                }
                c => token.push(c),
            }
        }
        if let Some((k, v)) = token.split_once('=') {
            out.push((k.to_string(), v.to_string()));
        }
    }
}

/// `fields` reads a record as a log shipper does: a quoted value whole,
/// whatever it holds, so the check above tells a quoted command from an
/// unquoted one.
#[test]
fn the_field_reader_takes_a_quoted_value_whole() {
    let quoted = r#"2026-11-27T03:01:11Z INFO x: registered pid=5 uid=65534 command="a uid=0 \"pid=1\"\nFORGED" devices=1"#;
    assert_eq!(
        fields(quoted),
        [
            ("pid", "5"),
            ("uid", "65534"),
            ("command", "a uid=0 \"pid=1\"nFORGED"),
            ("devices", "1"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()))
    );
    let bare = "registered pid=5 uid=65534 command=a uid=0 pid=1";
    let uids = fields(bare).into_iter().filter(|(k, _)| k == "uid").count();
    assert_eq!(uids, 2);
}

/// The attack: `nobody` registers a process whose command line holds
/// ` uid=0 pid=1` and a newline. The command was logged unquoted, so
/// `uid=0 pid=1` became fields of the root broker's own record of the
/// registration. Every user-controlled field is quoted.
#[test]
fn a_command_line_cannot_forge_fields_or_lines_of_the_log() {
    if !can_be_nobody() {
        return;
    }
    let b = Open::start("16G", &[]);
    let uuid = b.uuid();
    let forged = "x uid=0 pid=1 job=1\nFORGED uid=0 pid=1 registered";
    let mut a = attacker(
        &b,
        r#"
s, _ = registered()
say("registered")
sys.stdin.readline()
"#,
        // The frame's command says the same, for a broker that takes the
        // label from the client.
        &[(
            "register",
            shim_hello_register(uuid, forged, Priority::Normal),
        )],
        &[forged],
    );
    started_saying(&mut a, "registered");
    let pid = u64::from(a.0.id());
    wait_until(10.0, "the registration in the log", || {
        b.log().lines().any(|l| {
            l.contains("registered")
                && fields(l)
                    .iter()
                    .any(|(k, v)| k == "pid" && v == &pid.to_string())
        })
    });
    let log = b.log();
    assert!(
        !log.lines().any(|l| l.starts_with("FORGED")),
        "a forged line in the log:\n{log}"
    );
    for l in log.lines().filter(|l| names_number(l, pid)) {
        let f = fields(l);
        let uids: Vec<&str> = f
            .iter()
            .filter(|(k, _)| k == "uid")
            .map(|(_, v)| v.as_str())
            .collect();
        let pids: Vec<&str> = f
            .iter()
            .filter(|(k, _)| k == "pid")
            .map(|(_, v)| v.as_str())
            .collect();
        assert!(
            uids.iter().all(|u| *u == "65534") && pids.iter().all(|p| *p == pid.to_string()),
            "nobody's command line forged fields of the broker's record (uid {uids:?}, pid {pids:?}):\n{l}"
        );
        assert!(
            uids.len() <= 1 && pids.len() <= 1,
            "a field twice in one record (uid {uids:?}, pid {pids:?}):\n{l}"
        );
    }
}

/// One scrape of `/metrics` at `to` from `from`, within `secs`: whether
/// it came back whole with metrics in it.
fn scrape(from: [u8; 4], to: std::net::SocketAddrV4, secs: u64) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut s = connect_from(from, to).map_err(|e| format!("connect: {e}"))?;
    s.set_write_timeout(Some(Duration::from_secs(secs)))
        .unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: gpufrac\r\nConnection: close\r\n\r\n")
        .map_err(|e| format!("write: {e}"))?;
    let mut body = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("no whole answer in {secs} s"));
        }
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => body.extend_from_slice(&buf[..n]),
            Err(e) => return Err(format!("read: {e}")),
        }
    }
    let text = String::from_utf8_lossy(&body);
    if text.starts_with("HTTP/1.1 200") && text.contains("gpufrac_") {
        Ok(())
    } else {
        Err(format!(
            "answered {:?}",
            text.lines().next().unwrap_or_default()
        ))
    }
}

/// The attack: 32 connections from one peer each send a request a byte a
/// second, and connect again whenever closed. Every serving thread was
/// held (2 s per read, not per request): scrapes went from 4 of 4 to none
/// in 5 s. One deadline per request and a limit per peer: another peer's
/// scrapes are answered, whatever serves them.
#[test]
fn trickling_metrics_connections_do_not_stop_scrapes() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let addr = std::net::SocketAddrV4::new([127, 0, 0, 1].into(), port);
    let b = Open::start("16G", &["--metrics", &addr.to_string()]);
    // Answered before the attack.
    wait_until(10.0, "a first scrape", || {
        scrape([127, 0, 0, 2], addr, 5).is_ok()
    });
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let trickle = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            // A request line that never ends: each connection sends the
            // next byte of it every second.
            let line: Vec<u8> = b"GET /metrics?"
                .iter()
                .copied()
                .chain(std::iter::repeat(b'a'))
                .take(4096)
                .collect();
            let mut conns: Vec<(Option<std::net::TcpStream>, usize)> =
                (0..32).map(|_| (None, 0)).collect();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for (c, sent) in conns.iter_mut() {
                    if c.is_none() {
                        *c = connect_from([127, 0, 0, 1], addr).ok();
                        *sent = 0;
                    }
                    let Some(s) = c else { continue };
                    s.set_nonblocking(true).unwrap();
                    let mut b = [0u8; 512];
                    let closed = matches!(s.read(&mut b), Ok(0))
                        || s.write(&line[*sent..*sent + 1]).is_err();
                    if closed {
                        *c = None;
                    } else {
                        *sent = (*sent + 1).min(line.len() - 1);
                    }
                }
                std::thread::sleep(Duration::from_secs(1));
            }
        })
    };
    // The trickle holds whatever it can by now.
    std::thread::sleep(Duration::from_millis(2500));
    let results: Vec<Result<(), String>> =
        (0..4).map(|_| scrape([127, 0, 0, 2], addr, 3)).collect();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    trickle.join().unwrap();
    let ok = results.iter().filter(|r| r.is_ok()).count();
    eprintln!("figure: scrapes answered beside 32 trickling connections: {ok} of 4");
    assert_eq!(
        ok, 4,
        "scrapes from another peer beside 32 connections trickling a byte a second: {results:?}"
    );
    drop(b);
}

/// The attack: on a broker that found no GPU (no driver where it runs),
/// `nobody` registers one process on 15 made-up GPU UUIDs. The broker
/// arbitrated up to 16 GPUs its clients named and never forgot them:
/// every other user's process on another GPU was refused (here, one that
/// sees two), and ran unarbitrated. GPUs learnt from clients are bounded per user and
/// forgotten when no process names them.
#[test]
fn made_up_gpus_on_a_driverless_broker_do_not_crowd_out_anothers() {
    if !can_be_nobody() {
        return;
    }
    // No simulated driver where the broker runs: it finds no GPU.
    let b = Open::start_with("16G", &[], |c| {
        c.env_remove("LD_LIBRARY_PATH");
    });
    let s = status_cli(&b.socket);
    assert!(s["gpus"].as_array().unwrap().is_empty(), "{s}");
    let made_up: Vec<DeviceReg> = (0..15u8)
        .map(|i| DeviceReg {
            uuid: [0xa0 + i; 16],
            ordinal: u32::from(i),
            mem_cap: 0,
            mem_total: 16 << 30,
        })
        .collect();
    let mut a = attacker(
        &b,
        r#"
s = connect()
s.sendall(M["register"])
fr = Frames(s).until(T["registered"], T["error"])
say("registered" if fr is not None and fr[0] == T["registered"] else "refused")
sys.stdin.readline()
"#,
        &[(
            "register",
            frames(&[
                ClientMsg::hello(1, Role::Shim),
                ClientMsg::Register {
                    command: "made up".into(),
                    devices: made_up,
                    share: None,
                    limit: None,
                    priority: Priority::Normal,
                },
            ]),
        )],
        &[],
    );
    let said = line_within(&mut a.0, 60).unwrap_or_default();
    eprintln!("figure: nobody's registration on 15 made-up GPUs: {said}");
    // Root's process on its own two (simulated) GPUs, under the shim: a
    // node's GPUs the broker does not see.
    let dir = b.shared_dir("victim");
    let stop = dir.join("stop");
    let mut v = KillOnDrop(
        sim_command(&artifacts().probe, "16G,16G", true)
            .env("GPUFRAC_SOCKET", &b.socket)
            .env("GPUFRAC_BROKER", "optional")
            .env("GPUFRAC_SIM_STATE", dir.join("sim-state"))
            .env("GPUFRAC_LOG", "warn")
            .args(["ctx", "launch", "3", "1000", "wait-file"])
            .arg(&stop)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let pid = u64::from(v.0.id());
    let t = Instant::now();
    let mut registered = false;
    while t.elapsed() < Duration::from_secs(5) && v.0.try_wait().unwrap().is_none() {
        registered = b_registered(&b, pid);
        if registered {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    std::fs::write(&stop, "").unwrap();
    let mut err = String::new();
    v.0.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let _ = v.0.wait();
    assert!(
        registered,
        "root's process on its own GPUs was not arbitrated beside nobody's 15 made-up GPUs: {err}"
    );
    assert!(!err.contains("refused"), "{err}");
    drop(a);
}

/// Whether `pid` is registered on some GPU of `b`.
fn b_registered(b: &Open, pid: u64) -> bool {
    try_status_cli(&b.socket).is_ok_and(|s| {
        s["gpus"].as_array().unwrap().iter().any(|g| {
            g["processes"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["pid"].as_u64() == Some(pid))
        })
    })
}

/// A victim of its own: uid 5001, in the socket's group.
const VICTIM: u32 = 5001;

/// The attack: with a job holding the only (16 GiB) GPU and a victim's
/// `--gpus 1` waiting for it, `nobody` asks for `--gpu-memory` of the
/// GPU's memory less a little. `16G` itself was ordered as a fraction,
/// ahead of every whole-GPU request, and took the GPU when it freed (the
/// victim waited 5.6 s, and would wait for as long as such requests keep
/// coming); the fix that made `16G` a whole-GPU request left `16383M`
/// (16 GiB less 1 MiB) a fraction, placed at 1.5 s and the victim, first
/// in line, at 5.5 s. A fraction now goes after every earlier whole-GPU
/// request and takes no GPU one waits for, whatever its size: for each
/// size the victim is first in the queue and first on the GPU.
#[test]
fn a_whole_gpus_memory_less_a_little_does_not_jump_an_earlier_whole_gpu_request() {
    if !can_be_nobody() {
        return;
    }
    let b = Open::start("16G", &[]);
    let dir = b.shared_dir("jobs");
    let spawn = |name: &str, args: &[&str], uid: Option<u32>| {
        let script = job_script(&dir, name);
        let mut c = b.run(args);
        c.args(["--", "sh", "-c", &script])
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(u) = uid {
            // nogroup: the socket's group, as `--group` made it.
            as_user_in_group(&mut c, u, NOBODY);
        }
        c.spawn().unwrap()
    };
    let queue = || {
        status_cli(&b.socket)["queue"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    };
    let queued =
        |n: usize| wait_until(20.0, &format!("{n} requests queued"), || queue().len() == n);
    // 16 GiB; less a MiB, a byte, a page, a KiB.
    let sizes = ["16G", "16383M", "17179869183", "16777212K", "16777215K"];
    for (k, size) in sizes.iter().enumerate() {
        let (holder, victim, attacker) = (
            format!("holder{k}"),
            format!("victim{k}"),
            format!("attacker{k}"),
        );
        let held = spawn(&holder, &["--gpus", "1"], None);
        wait_started(&dir, &holder);
        let v = spawn(&victim, &["--gpus", "1"], Some(VICTIM));
        queued(1);
        let a = spawn(&attacker, &["--gpu-memory", size], Some(NOBODY));
        queued(2);
        let first = queue()[0]["pid"].as_u64();
        let t = Instant::now();
        release(&dir, &holder, held);
        wait_until(20.0, "a queued job to start", || {
            started(&dir, &victim).is_some() || started(&dir, &attacker).is_some()
        });
        let ran = if started(&dir, &victim).is_some() {
            "victim"
        } else {
            "attacker"
        };
        eprintln!(
            "figure: --gpu-memory {size}: after the GPU freed, the {ran} ran first ({:?})",
            t.elapsed()
        );
        // Whichever ran, both end.
        if ran == "attacker" {
            release(&dir, &attacker, a);
            wait_started(&dir, &victim);
            release(&dir, &victim, v);
            panic!(
                "nobody's --gpu-memory {size} on a 16 GiB GPU ran before uid {VICTIM}'s earlier --gpus 1"
            );
        }
        assert!(started(&dir, &attacker).is_none(), "both hold the GPU");
        assert_eq!(
            first,
            Some(u64::from(v.id())),
            "--gpu-memory {size}: the victim is first in line"
        );
        release(&dir, &victim, v);
        wait_started(&dir, &attacker);
        release(&dir, &attacker, a);
    }
}

/// The attack (on the node, by the test suite itself): a cleanly stopped
/// broker left the state directory it made for its socket under
/// /run/gpufrac/state/ (about 15 a run of the tests). A broker that stops
/// cleanly removes the directory it made once nothing is left in it.
#[test]
fn a_cleanly_stopped_broker_leaves_no_state_directory_behind() {
    let dir = Scratch::new("r4-state");
    let socket = dir.0.join("b.sock");
    let state = gpufrac_broker::default_state_dir(&socket);
    assert!(!state.exists(), "{} before the broker", state.display());
    let mut cmd = sim_command(&artifacts().gpufrac, "16G", false);
    cmd.args(["broker", "--socket"])
        .arg(&socket)
        .env("GPUFRAC_SIM_STATE", dir.0.join("sim-state"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null());
    log_to(&mut cmd, &dir.0.join("broker.log"));
    let mut broker = KillOnDrop(cmd.spawn().unwrap());
    wait_until(20.0, "the broker socket", || {
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    });
    let o = sim_command(&artifacts().gpufrac, "16G", false)
        .env_remove("GPUFRAC_BROKER")
        .env("GPUFRAC_SIM_STATE", dir.0.join("sim-state"))
        .args(["run", "--socket"])
        .arg(&socket)
        .args(["--gpu-memory", "1G", "--", "true"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let made = state.exists();
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(broker.0.id() as libc::pid_t, libc::SIGTERM) };
    let st = broker.0.wait().unwrap();
    let left: Vec<String> = std::fs::read_dir(&state)
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    let kept = state.exists();
    // Never left behind by this test, whatever the broker did.
    let _ = std::fs::remove_dir_all(&state);
    assert!(st.success(), "the broker stopped with {st}");
    assert!(made, "the broker made no {}", state.display());
    assert!(
        !kept,
        "a cleanly stopped broker left {} behind, holding {left:?}",
        state.display()
    );
}
