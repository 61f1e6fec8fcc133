//! CLOCK_MONOTONIC, the one clock every process of a node shares: the
//! simulated engine's timelines, the shim's grant and idle timing, and the
//! windows tests and benchmarks measure in. vDSO reads: no syscall, no
//! allocation.

#[inline(always)]
fn read(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer; both clocks always exist.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CLOCK_MONOTONIC in nanoseconds.
#[inline(always)]
pub fn mono_ns() -> u64 {
    read(libc::CLOCK_MONOTONIC)
}

/// CLOCK_MONOTONIC_COARSE in nanoseconds: a plain memory read, a few ms
/// resolution — enough for idle detection on a launch path.
#[inline(always)]
pub fn coarse_ns() -> u64 {
    read(libc::CLOCK_MONOTONIC_COARSE)
}

/// Sleeps (no spinning) until CLOCK_MONOTONIC reaches `t` ns.
pub fn sleep_until(t: u64) {
    while mono_ns() < t {
        let ts = libc::timespec {
            tv_sec: (t / 1_000_000_000) as libc::time_t,
            tv_nsec: (t % 1_000_000_000) as libc::c_long,
        };
        // SAFETY: valid timespec; EINTR just loops.
        unsafe {
            libc::clock_nanosleep(
                libc::CLOCK_MONOTONIC,
                libc::TIMER_ABSTIME,
                &ts,
                std::ptr::null_mut(),
            )
        };
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn sleeps_until_the_deadline() {
        let t = super::mono_ns() + 2_000_000;
        super::sleep_until(t);
        assert!(super::mono_ns() >= t);
    }
}
