//! What metrics ask the host: user names, and the broker process's own
//! figures (the `process_*` families every Prometheus client library
//! exports, read from /proc/self).

use std::ffi::CStr;

use super::text::{Family, Kind};

/// The login name of `uid`, from the password database (NSS).
pub fn user_name(uid: u32) -> Option<String> {
    let mut buf = vec![0u8; 4096];
    // SAFETY: a zeroed passwd is a valid out-parameter.
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the sizes given; getpwuid_r
    // writes the strings into `buf`, which outlives their use below.
    let rc =
        unsafe { libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr().cast(), buf.len(), &mut found) };
    if rc != 0 || found.is_null() || pw.pw_name.is_null() {
        return None;
    }
    // SAFETY: pw_name points into `buf`, NUL-terminated by getpwuid_r.
    let name = unsafe { CStr::from_ptr(pw.pw_name) };
    name.to_str().ok().map(str::to_owned)
}

/// The broker process's CPU time, memory, descriptors and start time.
pub fn process_families() -> Vec<Family> {
    let mut out = Vec::new();
    // SAFETY: sysconf has no preconditions.
    let (tick, page) = unsafe {
        (
            libc::sysconf(libc::_SC_CLK_TCK) as f64,
            libc::sysconf(libc::_SC_PAGESIZE) as f64,
        )
    };
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command, which may itself hold spaces: state is
    // field 3, utime 14, stime 15, starttime 22, vsize 23, rss 24.
    let rest: Vec<&str> = stat
        .rsplit_once(") ")
        .map_or(Vec::new(), |(_, r)| r.split(' ').collect());
    let field = |n: usize| rest.get(n - 3).and_then(|v| v.parse::<f64>().ok());
    let one = |name: &str, kind, help: &str, v: f64| {
        let mut f = Family::new(name, kind, help);
        f.add(vec![], v);
        f
    };
    if let (Some(u), Some(s)) = (field(14), field(15)) {
        out.push(one(
            "process_cpu_seconds_total",
            Kind::Counter,
            "CPU time the broker used, user and system, seconds.",
            (u + s) / tick,
        ));
    }
    if let Some(start) = field(22)
        && let Some(boot) = boot_time()
    {
        out.push(one(
            "process_start_time_seconds",
            Kind::Gauge,
            "When the broker started, seconds since the Unix epoch.",
            boot + start / tick,
        ));
    }
    if let Some(v) = field(23) {
        out.push(one(
            "process_virtual_memory_bytes",
            Kind::Gauge,
            "The broker's virtual memory size.",
            v,
        ));
    }
    if let Some(r) = field(24) {
        out.push(one(
            "process_resident_memory_bytes",
            Kind::Gauge,
            "The broker's resident memory.",
            r * page,
        ));
    }
    if let Ok(d) = std::fs::read_dir("/proc/self/fd") {
        out.push(one(
            "process_open_fds",
            Kind::Gauge,
            "File descriptors the broker has open.",
            d.count() as f64,
        ));
    }
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        out.push(one(
            "process_max_fds",
            Kind::Gauge,
            "The broker's limit on open file descriptors.",
            lim.rlim_cur as f64,
        ));
    }
    out
}

fn boot_time() -> Option<f64> {
    std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_is_named_and_a_uid_nobody_has_is_not() {
        assert_eq!(user_name(0).as_deref(), Some("root"));
        assert_eq!(user_name(4_000_000_000), None);
    }

    #[test]
    fn the_process_families_describe_this_process() {
        let fams = process_families();
        let mut text = String::new();
        for f in &fams {
            f.write(&mut text);
        }
        for name in [
            "process_cpu_seconds_total",
            "process_start_time_seconds",
            "process_resident_memory_bytes",
            "process_open_fds",
            "process_max_fds",
        ] {
            let v: f64 = text
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{name} ")))
                .unwrap_or_else(|| panic!("no {name} in\n{text}"))
                .parse()
                .unwrap();
            // CPU time may still be under one tick.
            assert!(v > 0.0 || name.starts_with("process_cpu"), "{name} {v}");
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let start: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("process_start_time_seconds "))
            .unwrap()
            .parse()
            .unwrap();
        // This test process started today, not in 1970 or the future.
        assert!(
            start <= now + 2.0 && start > now - 86_400.0,
            "{start} {now}"
        );
    }
}
