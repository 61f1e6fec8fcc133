//! `gpufrac run … -- docker run …` (or `podman run`): the container becomes
//! the job's. The engine's client is run's child, but the container's
//! processes are the runtime's children, so run puts into the container
//! what its own children would have inherited: the shim, the socket, the
//! caps, the job's memory books and the job's token, by which the broker
//! counts them in the job. The lease lasts as long as the attached client,
//! which lasts as long as the container (`docker kill` included).

use std::ffi::OsString;
use std::path::Path;

use gpufrac_common::config::{VAR_JOB, VAR_JOB_LEDGER, VAR_SOCKET};

use crate::inject::{CONTAINER_LIB, CONTAINER_MPS_PIPE, CONTAINER_SOCKET_DIR};
use crate::run::env::ChildEnv;

/// Where the job's memory books appear inside the container (a path of
/// our own: the image's /dev/shm is its own tmpfs).
const CONTAINER_BOOKS: &str = "/run/gpufrac-job/books";

/// Engines whose `run` takes Docker's flags.
const ENGINES: &[&str] = &["docker", "podman", "nerdctl"];

/// Docker's boolean short flags, which may come clustered (`-dit`).
const BOOL_SHORT: &[u8] = b"ditPq";

/// Where `run`'s arguments start in a `docker run` / `docker container
/// run` command line, or None when the command is not one.
pub fn run_index(command: &[OsString]) -> Option<usize> {
    let engine = Path::new(command.first()?).file_name()?.to_str()?;
    if !ENGINES.contains(&engine) {
        return None;
    }
    let mut prev_was_option = false;
    let mut i = 1;
    while i < command.len() {
        let a = command[i].to_str()?;
        match a {
            "run" => return Some(i + 1),
            "container" if command.get(i + 1).is_some_and(|n| n == "run") => return Some(i + 2),
            _ if a.starts_with('-') => prev_was_option = !a.contains('='),
            // The value of a global option (`docker -H unix:///x run`).
            _ if prev_was_option => prev_was_option = false,
            // Another subcommand (`docker ps`, `docker exec`): not ours.
            _ => return None,
        }
        i += 1;
    }
    None
}

/// Why the container `command` runs cannot be a job's, if it cannot: asked
/// before the run asks for a lease, so that a refused command is never
/// queued nor booked.
pub fn refusal(command: &[OsString]) -> Option<String> {
    let flag = detached(&command[run_index(command)?..])?;
    Some(format!(
        "`{flag}` detaches the container, and the lease would end at once with the client; \
         drop {flag} to keep the container attached (it still runs in the background if you \
         background gpufrac run), or use `gpufrac docker-args` for a container outside the queue"
    ))
}

/// The command with the container's part of the job inserted after `run`
/// (one `refusal` passed).
pub fn wrap(
    command: &[OsString],
    at: usize,
    env: &ChildEnv,
    shim: &Path,
    socket: &Path,
) -> Vec<OsString> {
    let user = &command[at..];
    let mut add: Vec<String> = Vec::new();
    let mut ipc_host = false;
    let mut push = |a: &str, b: String| {
        add.push(a.to_owned());
        add.push(b);
    };
    // A gpufrac CDI device or docker-args' own flags already put the shim
    // and the socket in; mounting them twice is an error to the engine.
    let mounted = user.iter().any(|a| {
        let a = a.to_string_lossy();
        a.contains("gpufrac.dev/gpu") || a.contains(CONTAINER_LIB)
    });
    let socket_name = socket
        .file_name()
        .map_or_else(|| "broker.sock".into(), |n| n.to_string_lossy());
    if !mounted {
        push("-v", format!("{}:{CONTAINER_LIB}:ro", shim.display()));
        let dir = socket.parent().unwrap_or(Path::new("/"));
        push("-v", format!("{}:{CONTAINER_SOCKET_DIR}", dir.display()));
    }
    for (k, v) in &env.set {
        match k.as_str() {
            // Host paths: the container sees its own.
            "LD_PRELOAD" => {
                if !mounted {
                    push("-e", format!("LD_PRELOAD={CONTAINER_LIB}"));
                }
            }
            VAR_SOCKET => push(
                "-e",
                format!("{VAR_SOCKET}={CONTAINER_SOCKET_DIR}/{socket_name}"),
            ),
            VAR_JOB_LEDGER => {
                push("-v", format!("{v}:{CONTAINER_BOOKS}"));
                push("-e", format!("{VAR_JOB_LEDGER}={CONTAINER_BOOKS}"));
            }
            "CUDA_MPS_PIPE_DIRECTORY" => {
                push("-v", format!("{v}:{CONTAINER_MPS_PIPE}"));
                push(
                    "-e",
                    format!("CUDA_MPS_PIPE_DIRECTORY={CONTAINER_MPS_PIPE}"),
                );
                ipc_host = true;
            }
            // A secret: named only, so the engine's client takes the value
            // from its own environment (run sets it there) and no command
            // line, which every user can read in ps, ever carries it.
            VAR_JOB => push("-e", VAR_JOB.to_owned()),
            _ => push("-e", format!("{k}={v}")),
        }
    }
    if ipc_host {
        // MPS clients and the server share memory through it.
        add.push("--ipc=host".to_owned());
    }
    let mut out: Vec<OsString> = command[..at].to_vec();
    out.extend(add.into_iter().map(OsString::from));
    out.extend(user.iter().cloned());
    out
}

/// The flag that detaches the container, if the user gave one before the
/// image (flags after it belong to the container's command).
fn detached(user: &[OsString]) -> Option<String> {
    for a in user {
        let a = a.to_string_lossy();
        if a == "--" {
            return None;
        }
        if a == "--detach" || a.starts_with("--detach=") && !a.ends_with("=false") {
            return Some(a.into_owned());
        }
        if let Some(short) = a.strip_prefix('-')
            && !short.starts_with('-')
            && !short.is_empty()
            && short.bytes().all(|b| BOOL_SHORT.contains(&b))
            && short.contains('d')
        {
            return Some(a.into_owned());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(args: &[&str]) -> Vec<OsString> {
        args.iter().map(OsString::from).collect()
    }

    /// `command` (an engine's `run` at index 2) wrapped for a job.
    fn wrapped(command: &[OsString], env: &ChildEnv) -> Vec<String> {
        wrap(
            command,
            2,
            env,
            Path::new("/opt/lib/libgpufrac.so"),
            Path::new("/run/g/broker.sock"),
        )
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect()
    }

    #[test]
    fn finds_run() {
        assert_eq!(run_index(&v(&["docker", "run", "img"])), Some(2));
        assert_eq!(run_index(&v(&["/usr/bin/podman", "run", "img"])), Some(2));
        assert_eq!(
            run_index(&v(&["docker", "container", "run", "img"])),
            Some(3)
        );
        assert_eq!(
            run_index(&v(&["docker", "-H", "unix:///x.sock", "run", "img"])),
            Some(4)
        );
        assert_eq!(run_index(&v(&["docker", "--debug", "run", "img"])), Some(3));
        assert_eq!(run_index(&v(&["docker", "exec", "c", "run"])), None);
        assert_eq!(run_index(&v(&["python", "run", "x"])), None);
        assert_eq!(run_index(&v(&["docker"])), None);
    }

    #[test]
    fn detach_is_refused() {
        for d in [
            &["-d", "img"][..],
            &["-dit", "img"],
            &["--detach", "img"],
            &["-itd", "img"],
        ] {
            let cmd = [&["docker", "run"][..], d].concat();
            let e = refusal(&v(&cmd)).unwrap();
            assert!(e.contains("detaches") && e.contains("docker-args"), "{e}");
        }
        for ok in [
            &["-it", "img"][..],
            &["--detach=false", "img"],
            &["-e", "D=1", "img"],
            &["--", "img", "-d"],
        ] {
            let cmd = [&["docker", "run"][..], ok].concat();
            assert_eq!(refusal(&v(&cmd)), None, "{ok:?}");
        }
        // Not a container: its -d is its own.
        assert_eq!(refusal(&v(&["python", "-d", "x.py"])), None);
    }

    #[test]
    fn container_gets_the_job() {
        let env = ChildEnv {
            set: vec![
                ("LD_PRELOAD".into(), "/opt/lib/libgpufrac.so:/x.so".into()),
                (VAR_SOCKET.into(), "/run/g/broker.sock".into()),
                ("GPU_MEM_LIMIT".into(), "1073741824".into()),
                ("CUDA_VISIBLE_DEVICES".into(), "1".into()),
                (VAR_JOB_LEDGER.into(), "/dev/shm/gpufrac-job-1".into()),
                ("GPUFRAC_JOB".into(), "00000000000000ff".into()),
            ],
            remove: vec![],
        };
        let s = wrapped(&v(&["docker", "run", "--rm", "img", "cmd"]), &env);
        assert_eq!(&s[..2], ["docker", "run"]);
        assert_eq!(&s[s.len() - 3..], ["--rm", "img", "cmd"]);
        let has = |a: &str, b: &str| s.windows(2).any(|w| w[0] == a && w[1] == b);
        assert!(
            has(
                "-v",
                "/opt/lib/libgpufrac.so:/usr/lib/gpufrac/libgpufrac.so:ro"
            ),
            "{s:?}"
        );
        assert!(has("-v", "/run/g:/run/gpufrac"), "{s:?}");
        assert!(
            has("-e", "LD_PRELOAD=/usr/lib/gpufrac/libgpufrac.so"),
            "{s:?}"
        );
        assert!(
            has("-e", "GPUFRAC_SOCKET=/run/gpufrac/broker.sock"),
            "{s:?}"
        );
        assert!(has("-e", "GPU_MEM_LIMIT=1073741824"), "{s:?}");
        assert!(has("-e", "CUDA_VISIBLE_DEVICES=1"), "{s:?}");
        assert!(
            has("-v", "/dev/shm/gpufrac-job-1:/run/gpufrac-job/books"),
            "{s:?}"
        );
        assert!(
            has("-e", "GPUFRAC_JOB_LEDGER=/run/gpufrac-job/books"),
            "{s:?}"
        );
        // The token is named, never written out: the engine's client has
        // it in its environment.
        assert!(has("-e", "GPUFRAC_JOB"), "{s:?}");
        assert!(!s.iter().any(|a| a.contains("00000000000000ff")), "{s:?}");

        // With a CDI device, the spec mounts the shim and the socket.
        let s = wrapped(
            &v(&["podman", "run", "--device", "gpufrac.dev/gpu=0", "img"]),
            &env,
        );
        assert!(
            !s.iter()
                .any(|a| a.contains(":/usr/lib/gpufrac/libgpufrac.so")),
            "{s:?}"
        );
        assert!(!s.iter().any(|a| a.starts_with("LD_PRELOAD")), "{s:?}");
        assert!(s.iter().any(|a| a == "GPUFRAC_JOB"), "{s:?}");
    }
}
