//! The child itself: spawned with the forwarded signals blocked until its
//! pid is known, signals passed on to it, and its exit status turned into
//! `run`'s.

use std::ffi::OsString;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::Command;
use std::sync::atomic::{AtomicI32, Ordering};

use super::env::ChildEnv;
use super::fail::Fail;

static CHILD: AtomicI32 = AtomicI32::new(0);

const FORWARDED: [libc::c_int; 6] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
];

extern "C" fn forward_signal(sig: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // A terminal sends ^C, ^\ and hangups to its whole foreground process
    // group, the child included; passing them on would deliver them twice.
    if matches!(sig, libc::SIGINT | libc::SIGQUIT | libc::SIGHUP)
        && !info.is_null()
        // SAFETY: the kernel hands a valid siginfo to an SA_SIGINFO handler.
        && unsafe { (*info).si_code } == libc::SI_KERNEL
    {
        return;
    }
    let pid = CHILD.load(Ordering::Relaxed);
    if pid > 0 {
        // SAFETY: errno is thread-local and kill is async-signal-safe; errno
        // is restored so the interrupted code never sees ours.
        unsafe {
            let errno = *libc::__errno_location();
            libc::kill(pid, sig);
            *libc::__errno_location() = errno;
        }
    }
}

fn forwarded_set() -> libc::sigset_t {
    // SAFETY: sigemptyset initialises the set before sigaddset reads it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in FORWARDED {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

/// Runs `f` with the forwarded signals blocked in this thread (it is
/// given the mask from before), so that a thread or child it starts never
/// takes one: the kernel hands a signal sent to `run` to any thread that
/// does not block it, and in a thread of its own a SIGTERM that came
/// before the handler was in place ended `run` alone (its default
/// action), leaving the child running without it.
pub(super) fn without_forwarded_signals<T>(f: impl FnOnce(libc::sigset_t) -> T) -> T {
    let set = forwarded_set();
    // SAFETY: plain libc calls on initialised sigsets.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old) };
    let out = f(old);
    // SAFETY: restores the mask saved above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
    out
}

/// Spawns the command with the forwarded signals blocked until its pid is
/// known, so none that arrives in between is lost or kills `run` alone.
pub(super) fn spawn_and_wait(
    command: &[OsString],
    env: &ChildEnv,
) -> Result<std::process::ExitStatus, Fail> {
    let (program, rest) = command
        .split_first()
        .ok_or_else(|| Fail::new(2, "no command given"))?;
    let mut cmd = Command::new(program);
    cmd.args(rest);
    for k in &env.remove {
        cmd.env_remove(k);
    }
    for (k, v) in &env.set {
        cmd.env(k, v);
    }

    let spawned = without_forwarded_signals(|old| {
        // std passes the signal mask on to the child, which would then
        // never see the very signals we forward to it.
        // SAFETY: pthread_sigmask is async-signal-safe, as pre_exec requires.
        unsafe {
            cmd.pre_exec(move || {
                libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
                Ok(())
            });
        }
        let spawned = cmd.spawn();
        if let Ok(child) = &spawned {
            CHILD.store(child.id() as i32, Ordering::Relaxed);
            for s in FORWARDED {
                // SAFETY: the handler only touches an atomic, errno and kill().
                unsafe {
                    let mut sa: libc::sigaction = std::mem::zeroed();
                    sa.sa_sigaction = forward_signal as *const () as usize;
                    sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
                    libc::sigemptyset(&mut sa.sa_mask);
                    libc::sigaction(s, &sa, std::ptr::null_mut());
                }
            }
        }
        spawned
    });

    let mut child = spawned.map_err(|e| {
        let name = program.to_string_lossy();
        match e.kind() {
            std::io::ErrorKind::NotFound => Fail::new(127, format!("{name}: command not found")),
            _ => Fail::new(126, format!("cannot run {name}: {e}")),
        }
    })?;
    child
        .wait()
        .map_err(|e| Fail::new(1, format!("waiting for the command failed: {e}")))
}

pub(super) fn exit_code(status: std::process::ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        // Exit statuses are 0..=255 already; the mask only satisfies the type.
        (Some(c), _) => (c & 0xff) as u8,
        (None, Some(sig)) => (128 + sig).clamp(0, 255) as u8,
        (None, None) => 1,
    }
}
