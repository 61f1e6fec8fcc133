//! Error messages that say what to do next, from the real binary: a busy
//! GPU named by the job that holds it as `gpufrac status` shows it.

mod support;
use std::path::Path;
use std::process::{Command, Stdio};
use support::*;

/// The text status, as a user reads it.
fn status_text(socket: &Path) -> String {
    let o = Command::new(&artifacts().gpufrac)
        .args(["status", "--socket"])
        .arg(socket)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    stdout(&o)
}

#[test]
fn a_busy_gpu_is_named_by_the_job_that_holds_it_as_status_shows_it() {
    let b = Broker::start("16G", &[]);
    // Holds the only GPU until its stdin closes.
    let holder = KillOnDrop(
        b.run(&["--gpus", "1", "--", "sh", "-c", "read _"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let job = holder.0.id();
    wait_until(20.0, "the holder's lease", || {
        b.status()["leases"]
            .as_array()
            .is_some_and(|l| l.len() == 1)
    });
    assert_eq!(b.status()["leases"][0]["pid"].as_u64(), Some(job as u64));

    let o = b
        .run(&["--gpus", "1", "--no-wait", "--", "true"])
        .output()
        .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("held whole by job {job}")), "{err}");

    let text = status_text(&b.socket);
    let leases = text.split("leases:\n").nth(1).expect("a leases table");
    assert!(leases.starts_with("  JOB "), "{text}");
    assert!(
        leases
            .lines()
            .any(|l| l.split_whitespace().next() == Some(&job.to_string())),
        "{text}"
    );

    // The job's token is its secret (only the job's processes may hold
    // it): neither the refusal nor status shows it.
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(b.socket.with_extension("sock.state")).unwrap())
            .unwrap();
    let token = state["jobs"][0]["token"]
        .as_u64()
        .expect("the job's token in the state file")
        .to_string();
    assert!(
        !err.contains(&token) && !text.contains(&token),
        "{err}\n{text}"
    );
}
