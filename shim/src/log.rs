//! Logging that never allocates and never takes a lock: lines are formatted
//! into a stack buffer and written with one `write(2)` so they stay whole
//! when several threads log at once.

use gpufrac_common::config::LogLevel;
use std::fmt::{self, Write};
use std::sync::atomic::{AtomicU8, Ordering};

/// Until the configuration is parsed only errors are printed, so nothing is
/// written by a process that never touches CUDA.
static LEVEL: AtomicU8 = AtomicU8::new(LogLevel::Error as u8);

pub fn set_level(l: LogLevel) {
    LEVEL.store(l as u8, Ordering::Relaxed);
}

#[inline]
pub fn enabled(l: LogLevel) -> bool {
    (l as u8) <= LEVEL.load(Ordering::Relaxed)
}

struct StackBuf {
    buf: [u8; 512],
    len: usize,
}

impl Write for StackBuf {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let room = self.buf.len() - 1 - self.len;
        let n = s.len().min(room);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

pub fn write_line(args: fmt::Arguments<'_>) {
    let mut b = StackBuf {
        buf: [0; 512],
        len: 0,
    };
    let _ = b.write_str("gpufrac: ");
    let _ = b.write_fmt(args);
    b.buf[b.len] = b'\n';
    b.len += 1;
    // Unit tests: through std, which the test harness captures.
    #[cfg(test)]
    eprint!("{}", String::from_utf8_lossy(&b.buf[..b.len]));
    // SAFETY: writing a buffer we own to fd 2.
    #[cfg(not(test))]
    unsafe {
        libc::write(2, b.buf.as_ptr().cast(), b.len);
    }
}

macro_rules! log_at {
    ($lvl:expr, $($arg:tt)*) => {
        if $crate::log::enabled($lvl) {
            $crate::log::write_line(format_args!($($arg)*));
        }
    };
}
#[allow(unused_macros)]
macro_rules! error { ($($arg:tt)*) => { log_at!(gpufrac_common::config::LogLevel::Error, $($arg)*) }; }
macro_rules! warn { ($($arg:tt)*) => { log_at!(gpufrac_common::config::LogLevel::Warn, $($arg)*) }; }
macro_rules! info { ($($arg:tt)*) => { log_at!(gpufrac_common::config::LogLevel::Info, $($arg)*) }; }
macro_rules! debug { ($($arg:tt)*) => { log_at!(gpufrac_common::config::LogLevel::Debug, $($arg)*) }; }
