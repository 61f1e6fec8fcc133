//! The broker's private files (SPEC §2, invariant 5), tried as `nobody`
//! would against a root broker whose socket sat in a sticky directory
//! like /tmp (which a broker now refuses; what was planted while it was
//! one stays when it is closed): MPS directories and links planted beside
//! the socket, state
//! directories of the wrong owner or mode, and a restart on a state file
//! the broker cannot trust, during which the attacker claims GPUs under a
//! made-up token.
//!
//! Each of these once worked. The tests that need another uid run when the
//! tests run as root and are skipped, loudly, otherwise.

mod support;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use gpufrac_common::wire::{self, ClientMsg, LeaseReq, Pin, Role, ServerMsg};
use support::*;

const GIB: u64 = 1 << 30;

/// A stand-in `nvidia-cuda-mps-control` (as tests/mps.rs has it): `-d`
/// starts a daemon that writes its pid into the pipe directory.
const STANDIN: &str = r#"#!/bin/sh
if [ "$1" = "-d" ]; then
  sleep 1000000 </dev/null >/dev/null 2>&1 &
  echo $! > "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
  exit 0
fi
while read cmd; do
  if [ "$cmd" = quit ]; then
    kill "$(cat "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid")"
  fi
done
"#;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Runs `script` as `nobody` with `sh -c`, arguments after it.
fn as_nobody(script: &str, args: &[&Path]) {
    let mut c = Command::new("sh");
    c.arg("-c").arg(script).arg("sh").args(args);
    let st = as_user(&mut c, NOBODY).status().unwrap();
    assert!(st.success(), "as nobody: {script}");
}

fn owner_mode(p: &Path) -> (u32, u32) {
    let m = std::fs::symlink_metadata(p).unwrap();
    (m.uid(), m.mode() & 0o7777)
}

/// Once, `--mps` made `mps-pipe/` and `mps-log/` beside the socket and
/// took existing ones: the root daemon wrote its pid through nobody's
/// link, every job got a pipe directory nobody owned, mode 0777, and a
/// forged pid file drove MPS to `failed`. Now they are in the broker's own
/// directory, and what is planted beside the socket is never used.
#[test]
fn mps_directories_planted_beside_the_socket_are_never_used() {
    if !is_root() {
        eprintln!("skipped: needs root to plant files as nobody");
        return;
    }
    let _s = serial();
    let dir = Scratch::new("mps-sticky");
    let bin = dir.0.join("bin");
    std::fs::create_dir(&bin).unwrap();
    std::fs::write(bin.join("nvidia-cuda-mps-control"), STANDIN).unwrap();
    std::fs::set_permissions(
        bin.join("nvidia-cuda-mps-control"),
        PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    // The socket's directory: sticky and world-writable, like /tmp.
    let shared = dir.0.join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&dir.0, PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&shared, PermissionsExt::from_mode(0o1777)).unwrap();
    // A root-only directory the planted link points into.
    let secret = dir.0.join("secret");
    std::fs::create_dir(&secret).unwrap();
    std::fs::set_permissions(&secret, PermissionsExt::from_mode(0o700)).unwrap();
    as_nobody(
        "mkdir -m 777 \"$1/mps-pipe\" && echo 999999 > \"$1/mps-pipe/nvidia-cuda-mps-control.pid\" \
         && ln -s \"$2\" \"$1/mps-log\"",
        &[&shared, &secret],
    );
    // Closed, as a broker's refusal of it says to, with the plants left.
    std::fs::set_permissions(&shared, PermissionsExt::from_mode(0o755)).unwrap();
    let socket = shared.join("b.sock");
    let mut cmd = sim_command(&artifacts().gpufrac, "16G", false);
    cmd.args(["broker", "--mps", "--socket"])
        .arg(&socket)
        .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .env("GPUFRAC_SIM_STATE", dir.0.join("sim"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null());
    log_to(&mut cmd, &dir.0.join("broker.log"));
    let mut b = KillOnDrop(cmd.spawn().unwrap());
    wait_until(20.0, "the broker", || {
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    });
    wait_until(20.0, "the daemon's pid", || {
        status_cli(&socket)["mps"]["daemon_pid"].is_u64()
    });
    let st = status_cli(&socket);
    let pipe = PathBuf::from(st["mps"]["pipe_dir"].as_str().unwrap());
    // The default state directory: root's, away from the socket.
    let state_dir = pipe.parent().unwrap().to_path_buf();
    let cleanup = Scratch(state_dir.clone());
    assert!(!pipe.starts_with(&shared), "{}", pipe.display());
    assert_eq!(owner_mode(&pipe), (0, 0o755));
    let (uid, mode) = owner_mode(&state_dir);
    assert!(uid == 0 && mode & 0o022 == 0, "{uid} {mode:o}");
    assert_eq!(st["mps"]["state"], "running", "{st}");
    assert_ne!(st["mps"]["daemon_pid"], 999999, "{st}");
    // The daemon's pid went into the broker's pipe directory, not through
    // what nobody planted.
    assert!(pipe.join("nvidia-cuda-mps-control.pid").exists());
    assert!(std::fs::read_dir(&secret).unwrap().next().is_none());
    assert_eq!(
        std::fs::read_to_string(shared.join("mps-pipe/nvidia-cuda-mps-control.pid")).unwrap(),
        "999999\n"
    );
    // Jobs are given the broker's pipe.
    let o = sim_command(&artifacts().gpufrac, "16G", false)
        .env("GPUFRAC_SIM_STATE", dir.0.join("sim"))
        .args(["run", "--socket"])
        .arg(&socket)
        .args(["--gpu-memory", "1G", "--", "sh", "-c"])
        .arg("echo pipe=$CUDA_MPS_PIPE_DIRECTORY")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains(&format!("pipe={}", pipe.display())),
        "{}",
        stdout(&o)
    );
    // SAFETY: signalling the broker this test started.
    unsafe { libc::kill(b.0.id() as i32, libc::SIGTERM) };
    assert!(b.0.wait().unwrap().success());
    drop(cleanup);
}

/// The broker with `--state-dir DIR`, on a socket of its own; its output.
fn broker_with_state_dir(dir: &Scratch, state_dir: &Path) -> std::process::Output {
    sim_command(&artifacts().gpufrac, "16G", false)
        .args(["broker", "--socket"])
        .arg(dir.0.join("b.sock"))
        .arg("--state-dir")
        .arg(state_dir)
        .env("GPUFRAC_SIM_STATE", dir.0.join("sim"))
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

/// A state directory someone else owns, or that others can write, or a
/// link, is refused with a message naming it, its owner and mode and what
/// is expected; nothing is reused, and no socket is left behind.
#[test]
fn a_state_directory_of_another_owner_or_mode_is_refused() {
    let dir = Scratch::new("state-dirs");
    let open = dir.0.join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, PermissionsExt::from_mode(0o777)).unwrap();
    let o = broker_with_state_dir(&dir, &open);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains(&open.display().to_string())
            && e.contains("mode 777")
            && e.contains("writable by everyone")
            && e.contains("expected a directory of uid")
            && e.contains("--state-dir"),
        "{e}"
    );
    assert_eq!(e.trim().lines().count(), 1, "one line: {e}");
    assert!(
        !dir.0.join("b.sock").exists(),
        "a refused start left its socket"
    );

    let link = dir.0.join("link");
    let target = dir.0.join("target");
    std::fs::create_dir(&target).unwrap();
    std::fs::set_permissions(&target, PermissionsExt::from_mode(0o700)).unwrap();
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let e = stderr(&broker_with_state_dir(&dir, &link));
    assert!(e.contains("symbolic link"), "{e}");

    if !is_root() {
        eprintln!("skipped: a directory of nobody's needs root to make");
        return;
    }
    let theirs = dir.0.join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    std::fs::set_permissions(&theirs, PermissionsExt::from_mode(0o700)).unwrap();
    std::os::unix::fs::chown(&theirs, Some(NOBODY), Some(NOBODY)).unwrap();
    let o = broker_with_state_dir(&dir, &theirs);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains(&theirs.display().to_string())
            && e.contains("belongs to uid 65534")
            && e.contains("mode 700"),
        "{e}"
    );
}

/// `frames` sent as `nobody` on one connection; what came back within a
/// few seconds (or until the broker closed it).
fn send_as_nobody(socket: &Path, frames: &[u8]) -> Vec<ServerMsg> {
    let script = r#"
import binascii, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
s.sendall(binascii.unhexlify(sys.argv[2]))
s.settimeout(5)
got = b""
try:
    while True:
        d = s.recv(1 << 16)
        if not d:
            break
        got += d
        if b"\x88" in got or b"\x87" in got:
            break
except OSError:
    pass
print(binascii.hexlify(got).decode())
"#;
    let hex: String = frames.iter().map(|b| format!("{b:02x}")).collect();
    let mut c = Command::new("python3");
    c.args(["-c", script]).arg(socket).arg(hex);
    let o = as_user(&mut c, NOBODY).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    let text = text.trim();
    let mut bytes: Vec<u8> = (0..text.len() / 2)
        .map(|i| u8::from_str_radix(&text[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let mut out = Vec::new();
    while let Ok((m, n)) = wire::decode_server(&bytes) {
        out.push(m);
        bytes.drain(..n);
    }
    out
}

/// Once, a planted state file and a restart gave the attacker the node:
/// the suspect file put the broker in recovery, and during the grace uid
/// 65534 claimed GPUs 0 and 1 whole with resume + pin under a made-up
/// token and kept them; the victim's 1 GiB request timed out. Now a claim
/// the trusted state cannot verify is refused.
#[test]
fn a_made_up_claim_during_a_recovery_is_refused_and_the_victim_placed() {
    if !is_root() || !can_be_nobody() {
        eprintln!("skipped: needs root to run the attacker as nobody");
        return;
    }
    let _s = serial();
    let mut b = Broker::start("16G,16G", &["--recovery-grace", "3s", "--group", "nogroup"]);
    std::fs::set_permissions(b.socket.parent().unwrap(), PermissionsExt::from_mode(0o755)).unwrap();
    let uuids: Vec<[u8; 16]> = (0..2)
        .map(|i| {
            let s = b.status();
            let hex: String = s["gpus"][i]["uuid"]
                .as_str()
                .unwrap()
                .trim_start_matches("GPU-")
                .replace('-', "");
            std::array::from_fn(|j| u8::from_str_radix(&hex[2 * j..2 * j + 2], 16).unwrap())
        })
        .collect();
    b.kill();
    // A state file the broker did not write (another owner): suspect, so
    // the restarted broker recovers, and never loads it.
    let state = b.state_file();
    std::fs::write(&state, br#"{"version":1,"jobs":[]}"#).unwrap();
    std::fs::set_permissions(&state, PermissionsExt::from_mode(0o600)).unwrap();
    std::os::unix::fs::chown(&state, Some(NOBODY), Some(NOBODY)).unwrap();
    let _ = std::fs::remove_file(state.with_file_name("state.prev"));
    b.restart();
    let st = b.status();
    assert!(st["recovery"].is_string(), "{st}");

    let mut frames = Vec::new();
    wire::encode_client(&ClientMsg::hello(1, Role::Cli), &mut frames);
    wire::encode_client(
        &ClientMsg::Lease(LeaseReq {
            want_gpus: 2,
            resume: 0x5eed_5eed,
            pin: uuids
                .iter()
                .map(|&uuid| Pin {
                    uuid,
                    mem: 16 * GIB,
                })
                .collect(),
            ..LeaseReq::default()
        }),
        &mut frames,
    );
    let got = send_as_nobody(&b.socket, &frames);
    let refused = got.iter().find_map(|m| match m {
        ServerMsg::Refused { reason } => Some(reason.clone()),
        _ => None,
    });
    let reason = refused.unwrap_or_else(|| panic!("the claim was not refused: {got:?}"));
    assert!(
        reason.contains("uid 65534") && reason.contains("trusted state has no such lease"),
        "{reason}"
    );
    assert!(b.status()["leases"].as_array().unwrap().is_empty());
    assert!(
        b.status()["recovery"].is_string(),
        "refused during the recovery"
    );
    wait_until(20.0, "the recovery grace to pass", || {
        b.status()["recovery"].is_null()
    });
    let o = b
        .run(&["--gpu-memory", "1G", "--no-wait", "--", "true"])
        .output()
        .unwrap();
    assert!(o.status.success(), "the victim is placed: {}", stderr(&o));
}

/// A broker that stops cleanly removes the state directory it made, or
/// its socket's default one (left by a broker killed before it), when
/// nothing is left in it: each broker of the test suite once left one
/// under /run/gpufrac/state. One it did not make (an administrator's
/// `--state-dir`) stays, and so does one with something left in it.
#[test]
fn a_clean_stop_removes_the_state_directory_it_made() {
    let dir = Scratch::new("made-dirs");
    let start = |state_dir: Option<&Path>| {
        let mut cmd = sim_command(&artifacts().gpufrac, "16G", false);
        cmd.args(["broker", "--socket"])
            .arg(dir.0.join("b.sock"))
            .env("GPUFRAC_SIM_STATE", dir.0.join("sim"))
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null());
        log_to(&mut cmd, &dir.0.join("broker.log"));
        if let Some(d) = state_dir {
            cmd.arg("--state-dir").arg(d);
        }
        let mut b = KillOnDrop(cmd.spawn().unwrap());
        wait_until(20.0, "the broker socket", || {
            if let Ok(Some(st)) = b.0.try_wait() {
                panic!("broker exited early: {st}");
            }
            std::os::unix::net::UnixStream::connect(dir.0.join("b.sock")).is_ok()
        });
        // Answered: its loop runs, its signal handlers are in place.
        let mut c = RawClient::connect(&dir.0.join("b.sock"));
        c.hello();
        c.send(&ClientMsg::Ping);
        assert_eq!(c.recv(), Some(ServerMsg::Pong));
        b
    };
    let stop = |mut b: KillOnDrop| {
        // SAFETY: signalling the broker this test started.
        unsafe { libc::kill(b.0.id() as i32, libc::SIGTERM) };
        assert!(b.0.wait().unwrap().success());
    };
    // The default directory (keyed by the socket), made at start.
    let default = gpufrac_broker::default_state_dir(&dir.0.join("b.sock"));
    assert!(!default.exists(), "{}", default.display());
    let b = start(None);
    assert!(default.is_dir());
    stop(b);
    assert!(!default.exists(), "{} left behind", default.display());
    // Left by a broker that was killed: the next one on the socket did
    // not make it, and removes it all the same.
    let mut killed = start(None);
    killed.0.kill().unwrap();
    killed.0.wait().unwrap();
    assert!(default.is_dir(), "a kill leaves it");
    stop(start(None));
    assert!(!default.exists(), "{} left behind", default.display());
    // One it made under --state-dir, and one that was there before.
    let made = dir.0.join("made");
    stop(start(Some(&made)));
    assert!(!made.exists());
    let kept = dir.0.join("kept");
    std::fs::create_dir(&kept).unwrap();
    std::fs::set_permissions(&kept, PermissionsExt::from_mode(0o700)).unwrap();
    stop(start(Some(&kept)));
    assert!(kept.is_dir(), "an administrator's directory is kept");
    // Something left in it: kept, with what is in it.
    let full = dir.0.join("full");
    let b = start(Some(&full));
    std::fs::write(full.join("note"), b"kept").unwrap();
    stop(b);
    assert_eq!(std::fs::read(full.join("note")).unwrap(), b"kept");
}

/// The suite's helpers leave nothing behind: a machine-wide lock's file
/// goes with its last holder (one that waited on it takes a new one), a
/// scratch directory with its owner, and a test broker's private files
/// with its scratch directory.
#[test]
fn the_test_helpers_leave_nothing_behind() {
    let name = format!("selftest-{}", std::process::id());
    let path = std::env::temp_dir().join(format!("gpufrac-test-{name}.lock"));
    let held = MachineLock::take(&name);
    assert!(path.exists());
    // A second taker waits on the file its holder then removes.
    let waiter = {
        let name = name.clone();
        std::thread::spawn(move || drop(MachineLock::take(&name)))
    };
    let ino = format!(":{} ", std::fs::metadata(&path).unwrap().ino());
    wait_until(10.0, "the second taker waiting on the file", || {
        std::fs::read_to_string("/proc/locks")
            .is_ok_and(|l| l.lines().any(|l| l.contains("->") && l.contains(&ino)))
    });
    drop(held);
    waiter.join().unwrap();
    assert!(!path.exists(), "{} left behind", path.display());

    let b = Broker::start("16G", &[]);
    let scratch = b.socket.parent().unwrap().to_path_buf();
    let default = gpufrac_broker::default_state_dir(&b.socket);
    assert!(scratch.join("state").is_dir());
    drop(b);
    assert!(!scratch.exists(), "{} left behind", scratch.display());
    assert!(!default.exists(), "{} made", default.display());
}
