//! The connection's sending side, shared by the client thread and
//! application threads (an `Acquire` from a launch, `Drained` from the
//! drain thread): the descriptor they send on and the lock that orders
//! their frames.

use gpufrac_common::wire::{self, ClientMsg};
use std::io::ErrorKind;
use std::sync::atomic::{AtomicI32, Ordering::*};
use std::sync::{Mutex, MutexGuard};

/// Raw fd of the live connection (-1 none), for app threads sending
/// Acquire and for a fork child to close.
static CONN_FD: AtomicI32 = AtomicI32::new(-1);
static SEND: Mutex<()> = Mutex::new(());

/// Sends one frame on the live connection (any thread).
pub fn send(msg: &ClientMsg) -> bool {
    send_locked(&lock(), msg)
}

/// The send lock, held by a release until its frame is on the wire.
pub fn lock() -> MutexGuard<'static, ()> {
    SEND.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sends with the send lock already held (the lock orders an application
/// thread's Acquire after a release in progress).
pub fn send_locked(_held: &MutexGuard<'_, ()>, msg: &ClientMsg) -> bool {
    let mut buf = Vec::with_capacity(64);
    wire::encode_client(msg, &mut buf);
    let fd = CONN_FD.load(Acquire);
    if fd < 0 {
        return false;
    }
    let mut off = 0;
    while off < buf.len() {
        // SAFETY: writing our buffer to our socket; MSG_NOSIGNAL so a dead
        // broker does not kill the application with SIGPIPE.
        let n = unsafe {
            libc::send(
                fd,
                buf[off..].as_ptr().cast(),
                buf.len() - off,
                libc::MSG_NOSIGNAL,
            )
        };
        if n <= 0 {
            if n < 0 && std::io::Error::last_os_error().kind() == ErrorKind::Interrupted {
                continue;
            }
            return false;
        }
        off += n as usize;
    }
    true
}

/// Sends one frame at exit, if the connection is up, without waiting on a
/// broker that stopped reading (a frame cut short there is the
/// connection's last) and waiting at most `EXIT_WAIT` for a thread that
/// is sending (one blocked on such a broker holds the lock).
pub fn send_at_exit(msg: &ClientMsg) {
    let deadline = std::time::Instant::now() + EXIT_WAIT;
    let _held = loop {
        match SEND.try_lock() {
            Ok(g) => break g,
            Err(std::sync::TryLockError::Poisoned(e)) => break e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
            Err(std::sync::TryLockError::WouldBlock) => return,
        }
    };
    let fd = CONN_FD.load(Acquire);
    if fd < 0 {
        return;
    }
    let mut buf = Vec::with_capacity(64);
    wire::encode_client(msg, &mut buf);
    // SAFETY: writing our buffer to our socket, without blocking and
    // without SIGPIPE.
    unsafe {
        libc::send(
            fd,
            buf.as_ptr().cast(),
            buf.len(),
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    };
}

/// The longest an exit waits for another thread's send to finish.
const EXIT_WAIT: std::time::Duration = std::time::Duration::from_millis(20);

/// A registered connection: any thread may send on `fd` from now on.
pub fn publish(fd: i32) {
    CONN_FD.store(fd, Release);
}

/// The connection is going: no thread sends on it from now on.
pub fn unpublish() {
    CONN_FD.store(-1, Release);
}

/// Returns once a send in progress has finished.
pub fn wait_for_senders() {
    drop(lock());
}

/// The connection's descriptor, for a fork child to close (-1: none).
pub fn take_fd() -> i32 {
    CONN_FD.swap(-1, SeqCst)
}
