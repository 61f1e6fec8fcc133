//! The node's processes as the broker's stand-in for /proc sees them:
//! pids, parents, start times and command lines. An attacker's process
//! may carry a command line of any size and content; the stand-in builds
//! it anew at each read, as the kernel copies it out of the process at
//! each read of `/proc/PID/cmdline`, so reading it costs what it costs.
//! The broker reads none of it (only a stat page: parent and start time);
//! a process says its command itself, in its `Register` or its `Lease`
//! (`Argv::command`), and a hostile one says as much as the protocol
//! carries.

use std::collections::HashMap;

/// What a command line holds, past its program name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Text {
    /// Printable bytes.
    Plain,
    /// Control bytes (newlines, escape sequences): each escaped on the
    /// way to a log line or status, at several bytes of output each.
    Controls,
    /// Text shaped like a structured log's fields (` uid=0 pid=1`), to
    /// forge the fields of the line that names the command.
    Fields,
}

/// A command line: its size (KiB past the program name) and content.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Argv {
    pub kib: u32,
    pub text: Text,
}

impl Argv {
    pub const SHORT: Argv = Argv {
        kib: 0,
        text: Text::Plain,
    };

    /// The command line as the kernel hands it out: arguments ended by
    /// NUL bytes.
    pub fn raw(&self) -> Vec<u8> {
        self.raw_within(usize::MAX)
    }

    /// The first `max` bytes of `raw` (give or take an argument).
    fn raw_within(&self, max: usize) -> Vec<u8> {
        let head: &[u8] = b"python3\0work.py\0";
        let fields = [crate::logs::FORGING.as_bytes(), b"\0"].concat();
        let arg: &[u8] = match self.text {
            Text::Plain => b"--data=/scratch/datasets/imagenet/train/shard-000001.tar\0",
            Text::Controls => b"\n\x1b[2K\r\t\x07\n\x1b[2K\r\t\x07\n\x1b[2K\r\t\x07\0",
            Text::Fields => &fields,
        };
        let want = (head.len() + self.kib as usize * 1024).min(max);
        let mut s = Vec::with_capacity(want + arg.len());
        s.extend_from_slice(head);
        if self.text == Text::Fields {
            // A short line forges its fields too.
            s.extend_from_slice(arg);
        }
        while s.len() < want {
            s.extend_from_slice(arg);
        }
        s
    }

    /// The command line as `gpufrac_common::procfs::cmdline` makes it of
    /// the raw bytes: arguments joined by spaces, allocation for
    /// allocation, so that a read of it costs as much work.
    pub fn render(&self) -> String {
        joined(&self.raw())
    }

    /// What the process says its command is, in a `Register` or a
    /// `Lease`: the shim says the first 4 KiB of its command line; a
    /// hostile process says as much of it as the protocol carries (a
    /// string of up to 64 KiB).
    pub fn command(&self) -> String {
        let mut s = joined(&self.raw_within(COMMAND_MAX + 1024));
        let mut end = s.len().min(COMMAND_MAX);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s
    }
}

/// The longest command a `Register` or a `Lease` carries (a string with a
/// 16-bit length).
pub const COMMAND_MAX: usize = u16::MAX as usize;

/// `gpufrac_common::procfs::cmdline` on bytes already read.
fn joined(raw: &[u8]) -> String {
    raw.split(|&c| c == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

#[derive(Clone, Debug)]
struct Proc {
    parent: u32,
    start: u64,
    argv: Argv,
    /// The user it runs as.
    uid: u32,
}

/// The processes alive now.
#[derive(Debug)]
pub struct Host {
    procs: HashMap<u32, Proc>,
    next_pid: u32,
    next_start: u64,
    /// Bytes of command lines handed to the broker so far.
    pub cmdline_bytes: u64,
}

impl Default for Host {
    fn default() -> Host {
        Host {
            procs: HashMap::new(),
            next_pid: 1000,
            next_start: 10_000,
            cmdline_bytes: 0,
        }
    }
}

impl Host {
    /// A new process of `uid`, child of `parent` (1: none of ours).
    pub fn spawn(&mut self, uid: u32, parent: u32, argv: Argv) -> u32 {
        self.next_pid += 1;
        self.next_start += 1;
        let pid = self.next_pid;
        self.procs.insert(
            pid,
            Proc {
                parent,
                start: self.next_start,
                argv,
                uid,
            },
        );
        pid
    }

    pub fn exit(&mut self, pid: u32) {
        self.procs.remove(&pid);
    }

    pub fn start_time(&self, pid: u32) -> Option<u64> {
        self.procs.get(&pid).map(|p| p.start)
    }

    pub fn parent(&self, pid: u32) -> Option<u32> {
        self.procs.get(&pid).map(|p| p.parent)
    }

    pub fn uid(&self, pid: u32) -> Option<u32> {
        self.procs.get(&pid).map(|p| p.uid)
    }

    /// What a read of the process's command line gives; empty for a
    /// process that is gone.
    pub fn cmdline(&mut self, pid: u32) -> String {
        let s = self
            .procs
            .get(&pid)
            .map_or_else(String::new, |p| p.argv.render());
        self.cmdline_bytes += s.len() as u64;
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_lines_have_the_size_and_content_asked_for() {
        let a = Argv {
            kib: 64,
            text: Text::Controls,
        };
        let s = a.render();
        assert!(s.len() >= 64 * 1024 && s.len() < 65 * 1024, "{}", s.len());
        assert!(s.contains('\n'));
        let f = Argv {
            kib: 0,
            text: Text::Fields,
        }
        .render();
        assert!(f.contains(" uid=0 pid=1"), "{f}");
        assert_eq!(a.command().len(), COMMAND_MAX);
        assert!(s.starts_with(&a.command()));
        assert_eq!(Argv::SHORT.command(), "python3 work.py");
        let mut h = Host::default();
        let p = h.spawn(7, 1, Argv::SHORT);
        assert_eq!(h.cmdline(p), "python3 work.py");
        assert_eq!(h.uid(p), Some(7));
        h.exit(p);
        assert_eq!(h.cmdline(p), "");
        assert_eq!(h.start_time(p), None);
    }
}
