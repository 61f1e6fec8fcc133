//! `gpufrac docker-args`: the `docker run` flags that put an image someone
//! else built under the shim.

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use gpufrac_common::config::{VAR_COMPUTE_LIMIT, VAR_COMPUTE_SHARE, VAR_MEM_LIMIT, VAR_SOCKET};
use gpufrac_common::size::{parse_mem_limit, parse_percent};

use crate::inject::{CONTAINER_LIB, CONTAINER_MPS_PIPE, CONTAINER_SOCKET_DIR, find_shim, sh_quote};

const DOCKER_EXAMPLES: &str = "\
Examples:
  docker run $(gpufrac docker-args --gpu-memory 8G --gpu-compute 30% --gpus 0) IMAGE
  docker run $(gpufrac docker-args --gpu-memory 25% --gpus all) IMAGE
  eval \"docker run $(gpufrac docker-args --format sh --gpus 0,1) IMAGE\"

The library is mounted read-only at /usr/lib/gpufrac/libgpufrac.so and the
broker socket's directory at /run/gpufrac (the directory rather than the socket
itself, so the mount still works after the broker restarts and recreates it).

Images whose entrypoint clears or overwrites LD_PRELOAD: use
--preload-file PATH instead. It writes PATH with the library's path in it and
prints `-v PATH:/etc/ld.so.preload:ro` in place of `-e LD_PRELOAD=...`; the
dynamic loader reads /etc/ld.so.preload for every program, whatever its
environment.";

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// One argument per line, as is: for `docker run $(...)`, or `mapfile -t`.
    #[default]
    Lines,
    /// All arguments on one line, quoted for a POSIX shell: for `eval`.
    Sh,
}

#[derive(Args, Debug)]
#[command(after_help = DOCKER_EXAMPLES)]
pub struct DockerArgs {
    /// Memory cap inside the container (GPU_MEM_LIMIT), e.g. 8G or 25%.
    #[arg(long, value_name = "SIZE", value_parser = mem_limit)]
    pub gpu_memory: Option<String>,
    /// Compute share when contended (GPU_COMPUTE_SHARE), e.g. 30%.
    #[arg(long, value_name = "PCT", value_parser = percent)]
    pub gpu_compute: Option<String>,
    /// Hard compute ceiling (GPU_COMPUTE_LIMIT), e.g. 50%.
    #[arg(long, value_name = "PCT", value_parser = percent)]
    pub gpu_limit: Option<String>,
    /// GPUs to pass through: `all`, or indices or UUIDs such as 0 or 0,1.
    #[arg(long, value_name = "LIST", value_parser = gpu_list)]
    pub gpus: Option<String>,
    #[command(flatten)]
    pub inject: InjectArgs,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Lines)]
    pub format: Format,
}

/// What `docker-args` and `cdi generate` both inject into a container.
#[derive(Args, Debug)]
pub struct InjectArgs {
    /// Broker socket on the host [default: $GPUFRAC_SOCKET, else /run/gpufrac/broker.sock]
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// libgpufrac.so on the host [default: the one installed with this gpufrac]
    #[arg(long, value_name = "PATH")]
    pub lib: Option<PathBuf>,
    /// Write an ld.so.preload file to PATH and mount it as /etc/ld.so.preload
    /// instead of setting LD_PRELOAD (for images whose entrypoint resets it).
    #[arg(long, value_name = "PATH")]
    pub preload_file: Option<PathBuf>,
}

impl InjectArgs {
    /// The shim and the socket as absolute host paths.
    pub fn lib_and_socket(&self) -> Result<(PathBuf, PathBuf), String> {
        let lib = match &self.lib {
            Some(p) => absolute(p)?,
            None => find_shim()?,
        };
        if !lib.is_file() {
            return Err(format!(
                "--lib {}: no such file; name libgpufrac.so, e.g. /usr/local/lib/libgpufrac.so",
                lib.display()
            ));
        }
        Ok((lib, absolute(&crate::socket_path(self.socket.clone()))?))
    }

    /// Writes the preload file, if asked for one; its absolute path.
    pub fn write_preload_file(&self) -> Result<Option<PathBuf>, String> {
        let Some(p) = &self.preload_file else {
            return Ok(None);
        };
        let p = absolute(p)?;
        std::fs::write(&p, format!("{CONTAINER_LIB}\n"))
            .map_err(|e| format!("--preload-file {}: cannot write it: {e}", p.display()))?;
        Ok(Some(p))
    }
}

fn mem_limit(s: &str) -> Result<String, String> {
    parse_mem_limit(s)?;
    Ok(s.trim().to_owned())
}

fn percent(s: &str) -> Result<String, String> {
    Ok(format!("{}%", parse_percent(s)?))
}

fn gpu_list(s: &str) -> Result<String, String> {
    let s = s.trim();
    const EXAMPLE: &str = "expected all, or GPU indices or UUIDs such as 0, 0,1 or GPU-<uuid>";
    if s.eq_ignore_ascii_case("all") {
        return Ok("all".to_owned());
    }
    let ok = !s.is_empty()
        && s.split(',').all(|d| {
            !d.is_empty()
                && d.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        });
    if ok {
        Ok(s.to_owned())
    } else {
        Err(EXAMPLE.to_owned())
    }
}

pub fn main(args: DockerArgs) -> u8 {
    match docker_args(&args) {
        Ok(list) => {
            if args.format == Format::Lines
                && let Some(bad) = list.iter().find(|a| a.chars().any(splits_in_substitution))
            {
                eprintln!(
                    "gpufrac docker-args: warning: {bad:?} would be split by `$(...)`; use --format sh with eval, or mapfile -t"
                );
            }
            let text = match args.format {
                Format::Lines => list.iter().map(|a| format!("{a}\n")).collect(),
                // One line: eval would run each further line as a command.
                Format::Sh => {
                    let quoted: Vec<String> = list.iter().map(|a| sh_quote(a)).collect();
                    quoted.join(" ") + "\n"
                }
            };
            match crate::print_stdout(&text) {
                Ok(()) => 0,
                Err(m) => {
                    eprintln!("gpufrac docker-args: {m}");
                    1
                }
            }
        }
        Err(m) => {
            eprintln!("gpufrac docker-args: {m}");
            1
        }
    }
}

/// Characters an unquoted `$(...)` splits or globs on.
fn splits_in_substitution(c: char) -> bool {
    c.is_whitespace() || matches!(c, '*' | '?' | '[')
}

/// The arguments, one per element.
pub fn docker_args(args: &DockerArgs) -> Result<Vec<String>, String> {
    let (lib, socket) = args.inject.lib_and_socket()?;
    let preload_file = args.inject.write_preload_file()?;
    let mut out = build(
        &lib,
        &socket,
        preload_file.as_deref(),
        args.gpu_memory.as_deref(),
        args.gpu_compute.as_deref(),
        args.gpu_limit.as_deref(),
        args.gpus.as_deref(),
    );
    if let Some(pipe) = broker_mps_pipe(&socket) {
        out.extend(mps_args(&pipe, args.gpu_compute.as_deref()));
    }
    Ok(out)
}

/// The MPS pipe directory of a broker started with `--mps`, asked of the
/// broker itself (it is in the broker's private directory, not beside the
/// socket), so a stale directory does not count.
fn broker_mps_pipe(socket: &Path) -> Option<String> {
    crate::client::Client::ask_status(socket)
        .ok()
        .and_then(|s| s.mps)
        .map(|m| m.pipe_dir)
}

/// The container's processes as MPS clients: the pipe directory mounted
/// where the container sees it, the host's IPC namespace (MPS clients and
/// server share memory through it), and the compute share as an SM
/// percentage.
fn mps_args(pipe: &str, compute: Option<&str>) -> Vec<String> {
    let mut v = vec![
        "-v".to_owned(),
        format!("{pipe}:{CONTAINER_MPS_PIPE}"),
        "-e".to_owned(),
        format!("CUDA_MPS_PIPE_DIRECTORY={CONTAINER_MPS_PIPE}"),
        "--ipc=host".to_owned(),
    ];
    if let Some(c) = compute {
        v.push("-e".to_owned());
        v.push(format!(
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={}",
            c.trim_end_matches('%')
        ));
    }
    v
}

fn build(
    lib: &Path,
    socket: &Path,
    preload_file: Option<&Path>,
    mem: Option<&str>,
    compute: Option<&str>,
    limit: Option<&str>,
    gpus: Option<&str>,
) -> Vec<String> {
    let mut out = Vec::new();
    let mut push = |a: &str, b: String| {
        out.push(a.to_owned());
        out.push(b);
    };
    push("-v", format!("{}:{CONTAINER_LIB}:ro", lib.display()));
    let socket_dir = socket.parent().unwrap_or(Path::new("/"));
    let socket_name = socket
        .file_name()
        .map_or_else(|| "broker.sock".into(), |n| n.to_string_lossy());
    push(
        "-v",
        format!("{}:{CONTAINER_SOCKET_DIR}", socket_dir.display()),
    );
    push(
        "-e",
        format!("{VAR_SOCKET}={CONTAINER_SOCKET_DIR}/{socket_name}"),
    );
    match preload_file {
        Some(f) => push("-v", format!("{}:/etc/ld.so.preload:ro", f.display())),
        None => push("-e", format!("LD_PRELOAD={CONTAINER_LIB}")),
    }
    if let Some(m) = mem {
        push("-e", format!("{VAR_MEM_LIMIT}={m}"));
    }
    if let Some(c) = compute {
        push("-e", format!("{VAR_COMPUTE_SHARE}={c}"));
    }
    if let Some(l) = limit {
        push("-e", format!("{VAR_COMPUTE_LIMIT}={l}"));
    }
    match gpus {
        Some("all") => push("--gpus", "all".to_owned()),
        // docker reads --gpus as CSV, so a list must arrive wrapped in double
        // quotes or its commas would separate options.
        Some(list) if list.contains(',') => push("--gpus", format!("\"device={list}\"")),
        Some(one) => push("--gpus", format!("device={one}")),
        None => {}
    }
    out
}

/// Mounts need absolute host paths.
pub(crate) fn absolute(p: &Path) -> Result<PathBuf, String> {
    if let Ok(c) = p.canonicalize() {
        return Ok(c);
    }
    // A socket that does not exist yet: make the path absolute without
    // resolving it.
    std::env::current_dir()
        .map(|d| d.join(p))
        .map_err(|e| format!("cannot make {} absolute: {e}", p.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct T {
        #[command(flatten)]
        d: DockerArgs,
    }

    fn parse(args: &[&str]) -> Result<DockerArgs, String> {
        T::try_parse_from(std::iter::once("docker-args").chain(args.iter().copied()))
            .map(|t| t.d)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn full_set() {
        let a = build(
            Path::new("/opt/gpufrac/lib/libgpufrac.so"),
            Path::new("/run/gpufrac/broker.sock"),
            None,
            Some("8G"),
            Some("30%"),
            Some("50%"),
            Some("0"),
        );
        assert_eq!(
            a,
            [
                "-v",
                "/opt/gpufrac/lib/libgpufrac.so:/usr/lib/gpufrac/libgpufrac.so:ro",
                "-v",
                "/run/gpufrac:/run/gpufrac",
                "-e",
                "GPUFRAC_SOCKET=/run/gpufrac/broker.sock",
                "-e",
                "LD_PRELOAD=/usr/lib/gpufrac/libgpufrac.so",
                "-e",
                "GPU_MEM_LIMIT=8G",
                "-e",
                "GPU_COMPUTE_SHARE=30%",
                "-e",
                "GPU_COMPUTE_LIMIT=50%",
                "--gpus",
                "device=0",
            ]
        );
    }

    #[test]
    fn preload_file_and_gpu_lists() {
        let a = build(
            Path::new("/l/libgpufrac.so"),
            Path::new("/tmp/x/my.sock"),
            Some(Path::new("/tmp/preload")),
            None,
            None,
            None,
            Some("0,1"),
        );
        assert!(a.contains(&"/tmp/preload:/etc/ld.so.preload:ro".to_owned()));
        assert!(!a.iter().any(|s| s.starts_with("LD_PRELOAD")));
        assert!(a.contains(&"/tmp/x:/run/gpufrac".to_owned()));
        assert!(a.contains(&"GPUFRAC_SOCKET=/run/gpufrac/my.sock".to_owned()));
        assert!(a.ends_with(&["--gpus".to_owned(), "\"device=0,1\"".to_owned()]));

        let a = build(
            Path::new("/l/libgpufrac.so"),
            Path::new("/s.sock"),
            None,
            None,
            None,
            None,
            Some("all"),
        );
        assert!(a.ends_with(&["--gpus".to_owned(), "all".to_owned()]));
    }

    #[test]
    fn preload_file_is_written() {
        let p = std::env::temp_dir().join(format!("gpufrac-preload-{}", std::process::id()));
        let args = InjectArgs {
            socket: None,
            lib: None,
            preload_file: Some(p.clone()),
        };
        assert_eq!(args.write_preload_file().unwrap(), Some(p.clone()));
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            "/usr/lib/gpufrac/libgpufrac.so\n"
        );
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn arguments() {
        let a = parse(&[
            "--gpu-memory",
            "25%",
            "--gpu-compute",
            "30",
            "--gpus",
            "ALL",
        ])
        .unwrap();
        assert_eq!(a.gpu_memory.as_deref(), Some("25%"));
        assert_eq!(a.gpu_compute.as_deref(), Some("30%"));
        assert_eq!(a.gpus.as_deref(), Some("all"));
        assert_eq!(a.format, Format::Lines);
        let e = parse(&["--gpu-memory", "lots"]).unwrap_err();
        assert!(e.contains("--gpu-memory") && e.contains("4G"), "{e}");
        let e = parse(&["--gpu-compute", "0%"]).unwrap_err();
        assert!(e.contains("greater than 0"), "{e}");
        let e = parse(&["--gpus", "0,,1"]).unwrap_err();
        assert!(e.contains("such as 0, 0,1"), "{e}");
        let e = parse(&["--gpus", "0 1"]).unwrap_err();
        assert!(e.contains("such as 0, 0,1"), "{e}");
        assert!(parse(&["--format", "sh"]).is_ok());
    }

    #[test]
    fn quoting() {
        assert_eq!(sh_quote("-v"), "-v");
        assert_eq!(sh_quote("GPU_MEM_LIMIT=8G"), "GPU_MEM_LIMIT=8G");
        assert_eq!(sh_quote("\"device=0,1\""), "'\"device=0,1\"'");
        assert_eq!(sh_quote("it's"), r"'it'\''s'");
        assert_eq!(sh_quote(""), "''");
        assert_eq!(sh_quote("/a b/lib.so"), "'/a b/lib.so'");
    }
}
