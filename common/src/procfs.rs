//! Fields of `/proc/PID/stat`, read without allocating (the shim reads
//! them on its charge path when a job's books reclaim dead processes).

/// The `n`-th field after the command name (0: the state; 1: the parent;
/// 19: the start time in clock ticks after boot), None if the process is
/// gone or the field is not a number.
pub fn stat_field(pid: u32, n: usize) -> Option<u64> {
    stat_fields(pid, [n])[0]
}

/// Several fields, as `stat_field` numbers them, from one read of the file.
pub fn stat_fields<const N: usize>(pid: u32, ns: [usize; N]) -> [Option<u64>; N] {
    let mut out = [None; N];
    let mut path = [0u8; 32];
    let mut len = 0;
    let mut put = |b: &[u8]| {
        path[len..len + b.len()].copy_from_slice(b);
        len += b.len();
    };
    put(b"/proc/");
    let mut digits = [0u8; 10];
    let mut d = digits.len();
    let mut p = pid;
    loop {
        d -= 1;
        digits[d] = b'0' + (p % 10) as u8;
        p /= 10;
        if p == 0 {
            break;
        }
    }
    put(&digits[d..]);
    put(b"/stat\0");
    let mut buf = [0u8; 1024];
    // SAFETY: a NUL-terminated path in a local buffer; read into a local
    // buffer of its size.
    let got = unsafe {
        let fd = libc::open(path.as_ptr().cast(), libc::O_RDONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return out;
        }
        let r = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
        libc::close(fd);
        r
    };
    let Some(text) = usize::try_from(got).ok().and_then(|n| buf.get(..n)) else {
        return out;
    };
    // The command name may hold spaces and parentheses: fields start after
    // the last ')'.
    let Some(close) = text.iter().rposition(|&c| c == b')') else {
        return out;
    };
    let fields = text[close + 1..]
        .split(|&c| c == b' ' || c == b'\n')
        .filter(|f| !f.is_empty());
    let last = ns.iter().copied().max().unwrap_or(0);
    for (i, f) in fields.enumerate().take(last + 1) {
        for (o, &n) in out.iter_mut().zip(&ns) {
            if n == i {
                *o = std::str::from_utf8(f).ok().and_then(|f| f.parse().ok());
            }
        }
    }
    out
}

/// When the process started (clock ticks after boot): with the pid, it
/// names one process even after pids are reused.
pub fn start_time(pid: u32) -> Option<u64> {
    stat_field(pid, 19)
}

pub fn parent(pid: u32) -> Option<u32> {
    stat_field(pid, 1).and_then(|p| u32::try_from(p).ok())
}

/// `parent` and `start_time` from one read.
pub fn parent_and_start(pid: u32) -> (Option<u32>, Option<u64>) {
    let [parent, start] = stat_fields(pid, [1, 19]);
    (parent.and_then(|p| u32::try_from(p).ok()), start)
}

/// Most bytes of a command line `cmdline` reads: what the broker keeps of
/// one (256 bytes, escaped) is well within it.
pub const CMDLINE_MAX: usize = 4096;

/// The command line of `pid` (`None`: this process), arguments joined by
/// spaces, from its first `CMDLINE_MAX` bytes at most (an argv can be
/// megabytes); empty when it cannot be read. Allocates: not for hot
/// paths. Reading another process's command line reads its memory, which
/// that process can make block (CVE-2018-1120): the shim reads its own,
/// and the broker none.
pub fn cmdline(pid: impl Into<Option<u32>>) -> String {
    use std::io::Read;
    let path = match pid.into() {
        Some(p) => format!("/proc/{p}/cmdline"),
        None => "/proc/self/cmdline".to_owned(),
    };
    let mut b = Vec::new();
    let read =
        std::fs::File::open(path).and_then(|f| f.take(CMDLINE_MAX as u64).read_to_end(&mut b));
    if read.is_err() {
        return String::new();
    }
    b.split(|&c| c == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_of_this_process() {
        let me = std::process::id();
        assert!(start_time(me).is_some_and(|t| t > 0));
        // SAFETY: getppid has no preconditions.
        assert_eq!(parent(me), Some(unsafe { libc::getppid() } as u32));
        assert_eq!(start_time(u32::MAX), None);
        assert_eq!(parent_and_start(me), (parent(me), start_time(me)));
        assert_eq!(parent_and_start(u32::MAX), (None, None));
        // Asked in any order, and twice.
        assert_eq!(
            stat_fields(me, [19, 1, 19]),
            [start_time(me), parent(me).map(u64::from), start_time(me)]
        );
        assert_eq!(cmdline(me), cmdline(None));
        assert!(cmdline(None).contains("gpufrac_common"));
        assert_eq!(cmdline(u32::MAX), "");
    }

    /// A 1 MiB argv is read no further than `CMDLINE_MAX`.
    #[test]
    fn a_long_command_line_is_read_only_so_far() {
        let big = "x".repeat(64 << 10);
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .args(std::iter::repeat_n(&big, 16))
            .spawn()
            .expect("sleep runs");
        // The kernel may show the argv only once the new image is set up:
        // wait for it rather than race it.
        let mut line = cmdline(child.id());
        for _ in 0..1000 {
            if line.starts_with("sleep") {
                break;
            }
            std::thread::yield_now();
            line = cmdline(child.id());
        }
        let _ = child.kill();
        let _ = child.wait();
        assert!(
            line.starts_with("sleep 30 xxx"),
            "{}",
            &line[..40.min(line.len())]
        );
        assert!(line.len() <= CMDLINE_MAX, "{}", line.len());
    }
}
