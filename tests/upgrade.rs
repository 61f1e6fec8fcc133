//! Upgrades (SPEC §2): the wire protocol negotiates a version range at
//! hello, so a broker restarted on a newer release keeps serving the shims
//! and runs of processes started under the previous one, a client of this
//! release still talks to a broker of the previous one, and a pair with no
//! version in common says so in one line. A clean stop (SIGTERM: what
//! `systemctl restart` and a DaemonSet rollout send) keeps the leases of
//! running jobs for the next broker, as a crash does.

mod support;

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::process::{Command, Stdio};

use gpufrac_common::wire::{
    self, ClientMsg, ERR_VERSION, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, ServerMsg,
};
use support::*;

/// `Hello` exactly as a client of protocol version 4 wrote it (one
/// version, no range), built by hand, not by this build's encoder.
fn hello_v4(role: u8) -> Vec<u8> {
    let mut payload = vec![0x01];
    payload.extend_from_slice(b"GPFR");
    payload.extend_from_slice(&4u16.to_le_bytes());
    payload.extend_from_slice(&std::process::id().to_le_bytes());
    payload.push(role);
    let mut f = (payload.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(&payload);
    f
}

/// A shim of the previous release (version 4 speaks the same frames as
/// this one past the hello) registers with, and is served by, this broker,
/// as the shims of running processes do after an upgrade restarts it.
#[test]
fn a_client_of_the_previous_version_is_served() {
    let b = Broker::start("16G", &[]);
    let uuid = b.first_gpu_uuid();
    let mut old = RawClient::connect(&b.socket);
    old.send_raw(&hello_v4(1)).unwrap();
    assert_eq!(old.recv(), Some(ServerMsg::HelloOk { version: 4 }));
    old.send(&register_msg(
        uuid,
        "old shim",
        gpufrac_common::config::Priority::Normal,
    ));
    old.send(&ClientMsg::Ping);
    loop {
        match old.recv() {
            Some(ServerMsg::Pong) => break,
            Some(ServerMsg::Error { message, .. }) => panic!("{message}"),
            Some(_) => {}
            None => panic!("the broker closed a version 4 client"),
        }
    }
    wait_until(10.0, "the old shim registered", || {
        b.registered().contains(&u64::from(std::process::id()))
    });
    // And a version 4 CLI reads status.
    let mut cli = RawClient::connect(&b.socket);
    cli.send_raw(&hello_v4(2)).unwrap();
    assert_eq!(cli.recv(), Some(ServerMsg::HelloOk { version: 4 }));
    cli.send(&ClientMsg::Status { from: 0 });
    assert!(matches!(cli.recv(), Some(ServerMsg::StatusReply { .. })));
}

/// A client of this release gets the newest version both speak.
#[test]
fn a_client_of_this_release_gets_the_newest_version() {
    let b = Broker::start("16G", &[]);
    let mut c = RawClient::connect(&b.socket);
    c.send(&ClientMsg::hello(std::process::id(), wire::Role::Cli));
    assert_eq!(
        c.recv(),
        Some(ServerMsg::HelloOk {
            version: PROTOCOL_VERSION
        })
    );
}

/// A client of a release this broker cannot speak to is told so in one
/// line naming both ranges and what to do, and is closed alone.
#[test]
fn an_incompatible_client_is_told_in_one_line() {
    let b = Broker::start("16G", &[]);
    let future = PROTOCOL_VERSION + 1;
    let mut c = RawClient::connect(&b.socket);
    c.send(&ClientMsg::Hello {
        magic: wire::MAGIC,
        version: future,
        pid: std::process::id(),
        role: wire::Role::Shim,
        max_version: future + 2,
    });
    match c.recv() {
        Some(ServerMsg::Error { code, message }) => {
            assert_eq!(code, ERR_VERSION);
            assert!(!message.contains('\n'), "{message}");
            for want in [
                format!("versions {future} to {}", future + 2),
                format!("speaks versions {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}"),
                "upgrade gpufrac on this node and restart the broker".to_owned(),
            ] {
                assert!(message.contains(&want), "{want} missing from {message}");
            }
        }
        other => panic!("expected a version error, got {other:?}"),
    }
    assert_eq!(c.recv(), None, "closed");
    // Everyone else is served.
    assert!(b.status()["gpus"].is_array());
}

/// This release's CLI against a broker of the previous one: the hello's
/// `version` is 4, which such a broker checks as the one it speaks, and
/// the rest works. (The stand-in answers as version 4 brokers did: one
/// version, refused unless equal.)
#[test]
fn this_release_talks_to_a_broker_of_the_previous_one() {
    let dir = Scratch::new("v4-broker");
    let socket = dir.0.join("b.sock");
    let l = UnixListener::bind(&socket).unwrap();
    let served = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut buf = Vec::new();
        let hello = loop {
            let mut tmp = [0u8; 4096];
            let n = s.read(&mut tmp).unwrap();
            assert!(n > 0, "the client hung up before its hello");
            buf.extend_from_slice(&tmp[..n]);
            if let Ok((m, used)) = wire::decode_client(&buf) {
                buf.drain(..used);
                break m;
            }
        };
        let ClientMsg::Hello { version, .. } = hello else {
            panic!("{hello:?}")
        };
        let mut out = Vec::new();
        if version != 4 {
            wire::encode_server(
                &ServerMsg::Error {
                    code: ERR_VERSION,
                    message: format!(
                        "protocol version {version} not supported; this broker speaks 4"
                    ),
                },
                &mut out,
            );
            s.write_all(&out).unwrap();
            return version;
        }
        wire::encode_server(&ServerMsg::HelloOk { version: 4 }, &mut out);
        let status = gpufrac_common::status::Status {
            version: "0.0.4".into(),
            socket: "/old".into(),
            ..Default::default()
        };
        wire::encode_server(
            &ServerMsg::StatusReply {
                json: serde_json::to_string(&status).unwrap(),
            },
            &mut out,
        );
        s.write_all(&out).unwrap();
        // Until the client has read it all.
        let _ = s.read(&mut [0u8; 64]);
        version
    });
    let o = Command::new(&artifacts().gpufrac)
        .args(["status", "--json", "--socket"])
        .arg(&socket)
        .output()
        .unwrap();
    assert_eq!(served.join().unwrap(), 4);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("0.0.4"), "{}", stdout(&o));
}

/// Stops the broker as systemd and the kubelet do (SIGTERM), and waits
/// for its clean exit.
fn clean_stop(b: &mut Broker) {
    // SAFETY: signalling the broker this test started.
    unsafe { libc::kill(b.child.id() as i32, libc::SIGTERM) };
    assert!(b.child.wait().unwrap().success(), "a clean stop");
}

/// The pids of the leases `gpufrac status --json` shows, and whether each
/// one's run is connected.
fn leases(b: &Broker) -> Vec<(u64, bool)> {
    let st = status_cli(&b.socket);
    let mut v: Vec<(u64, bool)> = st["leases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| (l["pid"].as_u64().unwrap(), l["connected"] == true))
        .collect();
    v.sort();
    v
}

/// A restart or an upgrade ended every lease: the clean stop removed the
/// state file, each running job's `gpufrac run` was refused its lease
/// ("the command carries on unbooked") and the next broker could place
/// new jobs into its memory. Now the stop keeps the file when jobs run,
/// the next broker books their leases before it accepts anyone, and the
/// run claims its own back.
#[test]
fn a_running_job_keeps_its_lease_across_a_clean_restart() {
    let mut b = Broker::start("16G", &[]);
    let a = b.holding("12G");
    let pid = u64::from(a.id());
    assert_eq!(leases(&b), vec![(pid, true)]);
    clean_stop(&mut b);
    let log = b.log();
    assert!(
        log.contains("kept 1 lease for the next broker"),
        "the stop's line:\n{log}"
    );
    assert!(b.state_file().exists(), "the state file is kept");
    b.restart();
    wait_until(20.0, "the run to claim its lease back", || {
        leases(&b) == vec![(pid, true)]
    });
    // 8 GiB would fit only if the 12 GiB of the running job were not
    // booked: the request waits.
    let mut c = b
        .run(&["--gpu-memory", "8G", "--", "true"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_until(20.0, "the second job in the queue", || {
        status_cli(&b.socket)["queue"]
            .as_array()
            .is_some_and(|q| q.len() == 1)
    });
    assert!(c.try_wait().unwrap().is_none(), "placed into booked memory");
    let err = release_holding(a);
    assert!(
        err.contains("lease claimed back from the restarted broker") && !err.contains("unbooked"),
        "{err}"
    );
    let o = c.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
}

/// The broker before marked processes by start time and wrote state file
/// version 1; this one marks them by pidfs inode where the kernel has
/// pidfs, and carries such a file over: a job whose run still has the
/// start time the file says is the run's (it claims its lease back), one
/// whose pid has another start time is a run that never came back.
#[test]
fn a_state_file_of_start_times_from_the_broker_before_is_carried_over() {
    let mut b = Broker::start("16G", &[]);
    let kept = b.holding("8G");
    let other = b.holding("4G");
    let (kept_pid, other_pid) = (kept.id(), other.id());
    clean_stop(&mut b);
    let text = std::fs::read_to_string(b.state_file()).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["version"], 2, "{text}");
    assert!(v["idents"].is_string(), "{text}");
    v.as_object_mut().unwrap().remove("idents");
    v["version"] = 1.into();
    for j in v["jobs"].as_array_mut().unwrap() {
        let pid = j["pid"].as_u64().unwrap() as u32;
        let start = gpufrac_common::procfs::start_time(pid).unwrap();
        // The other's file says it started a tick later: another process.
        let start = if pid == other_pid { start + 1 } else { start };
        let o = j.as_object_mut().unwrap();
        o.remove("ident");
        o.insert("start_time".into(), start.into());
    }
    std::fs::write(b.state_file(), v.to_string()).unwrap();
    b.restart();
    wait_until(20.0, "the restarted broker to say what it restored", || {
        b.log().contains("restored jobs from the state file")
    });
    wait_until(20.0, "the kept run to claim its lease back", || {
        leases(&b) == vec![(u64::from(kept_pid), true)]
    });
    let err = release_holding(kept);
    assert!(
        err.contains("lease claimed back from the restarted broker"),
        "{err}"
    );
    let err = release_holding(other);
    assert!(
        err.contains("would not give the lease back")
            && !err.contains("lease claimed back from the restarted broker"),
        "{err}"
    );
}

/// A job whose run ended while no broker ran is dropped by the next one
/// at its start, and one whose run dies before claiming its lease back
/// is dropped by the sweep that follows: neither holds memory another
/// job is refused for. The job still running keeps its lease.
#[test]
fn jobs_whose_run_died_across_a_clean_restart_are_dropped() {
    let mut b = Broker::start("16G", &[]);
    let kept = b.holding("4G");
    let ended = b.holding("4G");
    // Killed if the test ends first: stopped, it would not end at the end
    // of its input as the others do.
    let mut stalled = Reap(Some(b.holding("4G")));
    let stalled_id = stalled.0.as_ref().unwrap().id();
    let (kept_pid, stalled_pid) = (u64::from(kept.id()), u64::from(stalled_id));
    // Stopped, it cannot claim its lease back.
    // SAFETY: signalling a child this test started.
    unsafe { libc::kill(stalled_id as i32, libc::SIGSTOP) };
    clean_stop(&mut b);
    assert!(
        b.log().contains("kept 3 leases for the next broker"),
        "{}",
        b.log()
    );
    release_holding(ended);
    b.restart();
    // The socket answers once it listens, which may be before the line
    // about what was restored is written.
    wait_until(20.0, "the restarted broker to say what it restored", || {
        b.log().contains("restored jobs from the state file")
    });
    let restored = b
        .log()
        .lines()
        .find(|l| l.contains("restored jobs from the state file"))
        .map(str::to_owned);
    assert!(
        restored
            .as_deref()
            .is_some_and(|l| l.contains("kept=2") && l.contains("dropped=1")),
        "{restored:?}\n{}",
        b.log()
    );
    let mut both = vec![(kept_pid, true), (stalled_pid, false)];
    both.sort();
    wait_until(20.0, "the running job to claim its lease back", || {
        leases(&b) == both
    });
    // The stalled run dies unclaimed (reaped: a zombie's pid still reads
    // as the run); its command ends at the end of its input.
    let mut stalled = stalled.0.take().unwrap();
    stalled.kill().unwrap();
    stalled.wait().unwrap();
    drop(stalled.stdin.take());
    wait_until(20.0, "the dead run's lease to be dropped", || {
        leases(&b) == vec![(kept_pid, true)]
    });
    assert!(
        b.log()
            .contains("a restored job's gpufrac run is gone; ending its lease"),
        "{}",
        b.log()
    );
    // 12 GiB fits beside the running job's 4 only if neither dead job's
    // memory is booked.
    let o = b
        .run(&["--gpu-memory", "12G", "--no-wait", "--", "true"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    release_holding(kept);
}
