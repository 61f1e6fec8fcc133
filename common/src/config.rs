//! The shim's configuration, read from the environment of the process it is
//! loaded into (the README's Configuration table).
//!
//! Anything malformed is an error, never a default: a user who asked for a
//! cap must not run uncapped because of a typo. Where the environment holds a
//! variable twice, the first one counts, as it does for `getenv`, so the shim
//! sees the same value as the application and its libraries.
//!
//! Nothing here reads the environment itself; the caller hands the variables
//! in, which keeps this testable and lets the shim read `environ` however is
//! safe at the time.

use std::fmt;

use crate::size::{self, MEM_LIMIT_EXAMPLE, MemLimit, PERCENT_EXAMPLE};

pub const DEFAULT_SOCKET: &str = "/run/gpufrac/broker.sock";
pub const MAX_DEVICES: usize = 64;

pub const VAR_MEM_LIMIT: &str = "GPU_MEM_LIMIT";
/// Followed by the device ordinal, as in `GPU_MEM_LIMIT_0`.
pub const VAR_MEM_LIMIT_PREFIX: &str = "GPU_MEM_LIMIT_";
pub const VAR_COMPUTE_SHARE: &str = "GPU_COMPUTE_SHARE";
pub const VAR_COMPUTE_LIMIT: &str = "GPU_COMPUTE_LIMIT";
pub const VAR_COMPUTE_PRIORITY: &str = "GPU_COMPUTE_PRIORITY";
pub const VAR_SOCKET: &str = "GPUFRAC_SOCKET";
pub const VAR_BROKER: &str = "GPUFRAC_BROKER";
pub const VAR_LOG: &str = "GPUFRAC_LOG";
/// Set by `gpufrac run --gpu-memory`: the file holding the job's shared
/// memory books (see `jobledger`).
pub const VAR_JOB_LEDGER: &str = "GPUFRAC_JOB_LEDGER";
/// Set by `gpufrac run` when a broker runs the job: the job's token (16 hex
/// digits), by which processes that do not descend from `run` (a
/// container's) join the job.
pub const VAR_JOB: &str = "GPUFRAC_JOB";

/// `sun_path` is 108 bytes on Linux and needs a terminating NUL.
const MAX_SOCKET_PATH: usize = 107;

const ORDINAL_EXAMPLE: &str = "a variable name such as GPU_MEM_LIMIT_0 through GPU_MEM_LIMIT_63 \
     (the CUDA device ordinal as this process sees it)";
const SOCKET_EXAMPLE: &str = "a Unix socket path such as /run/gpufrac/broker.sock";
const BROKER_EXAMPLE: &str = "one of optional, required, off";
const LOG_EXAMPLE: &str = "one of error, warn, info, debug";
const PRIORITY_EXAMPLE: &str = "one of high, normal, low";
const UTF8_PROBLEM: &str = "the value is not valid UTF-8";

/// What to do about the broker (`GPUFRAC_BROKER`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BrokerMode {
    /// Use it when it is there; without it memory caps still hold and compute
    /// runs unarbitrated.
    #[default]
    Optional,
    /// Without a broker, CUDA initialisation fails.
    Required,
    /// Never connect.
    Off,
}

impl BrokerMode {
    /// The spelling `GPUFRAC_BROKER` accepts, for passing it on to children.
    pub fn as_str(self) -> &'static str {
        match self {
            BrokerMode::Optional => "optional",
            BrokerMode::Required => "required",
            BrokerMode::Off => "off",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        [BrokerMode::Optional, BrokerMode::Required, BrokerMode::Off]
            .into_iter()
            .find(|m| m.as_str().eq_ignore_ascii_case(s))
    }
}

/// `GPU_COMPUTE_PRIORITY`: the class a process competes in. A higher class
/// takes the GPU from a lower one at once; shares apply within a class.
/// Ordered so that `High > Normal > Low`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Priority {
    Low,
    #[default]
    Normal,
    High,
}

impl Priority {
    pub const ALL: [Priority; 3] = [Priority::Low, Priority::Normal, Priority::High];

    /// The spelling `GPU_COMPUTE_PRIORITY` and `gpufrac run --priority` accept.
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Low => "low",
            Priority::Normal => "normal",
            Priority::High => "high",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|p| p.as_str().eq_ignore_ascii_case(s.trim()))
    }

    /// Its byte on the wire and its index in per-class tables.
    pub fn index(self) -> usize {
        self as usize
    }

    pub fn from_index(i: u8) -> Option<Self> {
        Self::ALL.get(i as usize).copied()
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `GPUFRAC_LOG`; ordered so that `level >= LogLevel::Info` reads naturally.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LogLevel {
    #[default]
    Error,
    Warn,
    Info,
    Debug,
}

impl LogLevel {
    /// The spelling `GPUFRAC_LOG` accepts.
    pub fn as_str(self) -> &'static str {
        match self {
            LogLevel::Error => "error",
            LogLevel::Warn => "warn",
            LogLevel::Info => "info",
            LogLevel::Debug => "debug",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        [
            LogLevel::Error,
            LogLevel::Warn,
            LogLevel::Info,
            LogLevel::Debug,
        ]
        .into_iter()
        .find(|l| l.as_str().eq_ignore_ascii_case(s))
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct ShimConfig {
    /// `GPU_MEM_LIMIT`
    pub mem_limit: MemLimit,
    /// `GPU_MEM_LIMIT_<N>`, indexed by the CUDA ordinal as the process sees it
    /// (after `CUDA_VISIBLE_DEVICES`). `Some(MemLimit::None)` is an explicit
    /// "uncapped on this device"; `None` defers to `mem_limit`.
    pub per_device: [Option<MemLimit>; MAX_DEVICES],
    /// `GPU_COMPUTE_SHARE`, percent.
    pub compute_share: Option<f64>,
    /// `GPU_COMPUTE_LIMIT`, percent.
    pub compute_limit: Option<f64>,
    /// `GPU_COMPUTE_PRIORITY`
    pub compute_priority: Priority,
    /// `GPUFRAC_SOCKET`
    pub socket: String,
    /// `GPUFRAC_BROKER`
    pub broker: BrokerMode,
    /// `GPUFRAC_LOG`
    pub log: LogLevel,
    /// `GPUFRAC_JOB_LEDGER`
    pub job_ledger: Option<String>,
    /// `GPUFRAC_JOB`; 0 = none.
    pub job: u64,
}

impl Default for ShimConfig {
    /// What an empty environment gives.
    fn default() -> Self {
        ShimConfig {
            mem_limit: MemLimit::None,
            per_device: [None; MAX_DEVICES],
            compute_share: None,
            compute_limit: None,
            compute_priority: Priority::Normal,
            socket: DEFAULT_SOCKET.to_owned(),
            broker: BrokerMode::Optional,
            log: LogLevel::Error,
            job_ledger: None,
            job: 0,
        }
    }
}

impl ShimConfig {
    /// The cap that applies to device `ordinal`: its own override if it has
    /// one, else the global one. Ordinals past [`MAX_DEVICES`] cannot have an
    /// override and get the global cap.
    pub fn limit_for(&self, ordinal: usize) -> MemLimit {
        self.per_device
            .get(ordinal)
            .copied()
            .flatten()
            .unwrap_or(self.mem_limit)
    }
}

/// A variable the shim refuses; printed as one line naming the variable, the
/// value, what is wrong and what would be right.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    pub var: String,
    pub value: String,
    pub problem: String,
    /// Worded to follow "expected".
    pub example: &'static str,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Both the name and the value come from the environment, so they are
        // escaped and shortened to keep the message on one readable line.
        write!(
            f,
            "{}=\"{}\": {}; expected {}",
            size::excerpt(&self.var, 64),
            size::excerpt(&self.value, 64),
            self.problem,
            self.example
        )
    }
}

impl std::error::Error for ConfigError {}

/// Builds the configuration from `(name, value)` pairs, such as the process
/// environment. Variables that are not the shim's are ignored.
pub fn from_vars<'a, I: IntoIterator<Item = (&'a str, &'a str)>>(
    vars: I,
) -> Result<ShimConfig, ConfigError> {
    from_raw_vars(
        vars.into_iter()
            .map(|(name, value)| (name.as_bytes(), value.as_bytes())),
    )
}

/// [`from_vars`] for an environment read as bytes (`environ` holds no
/// promise of UTF-8): a value of one of the shim's variables that is not
/// UTF-8 is an error, since it cannot be what the user meant.
pub fn from_raw_vars<'a, I: IntoIterator<Item = (&'a [u8], &'a [u8])>>(
    vars: I,
) -> Result<ShimConfig, ConfigError> {
    let mut cfg = ShimConfig::default();
    let mut seen = Seen::default();
    for (name, raw) in vars {
        // No name of ours is anything but ASCII; other names are not ours.
        let Ok(name) = std::str::from_utf8(name) else {
            continue;
        };
        let value = |example: &'static str| {
            std::str::from_utf8(raw).map_err(|_| ConfigError {
                var: name.to_owned(),
                value: String::from_utf8_lossy(raw).into_owned(),
                problem: UTF8_PROBLEM.to_owned(),
                example,
            })
        };
        let fail = |value: &str, problem: String, example: &'static str| ConfigError {
            var: name.to_owned(),
            value: value.to_owned(),
            problem,
            example,
        };
        match name {
            VAR_MEM_LIMIT => {
                if seen.first(Var::MemLimit) {
                    let v = value(MEM_LIMIT_EXAMPLE)?;
                    cfg.mem_limit =
                        size::mem_limit_problem(v).map_err(|p| fail(v, p, MEM_LIMIT_EXAMPLE))?;
                }
            }
            VAR_COMPUTE_SHARE => {
                if seen.first(Var::ComputeShare) {
                    let v = value(PERCENT_EXAMPLE)?;
                    cfg.compute_share =
                        optional_percent(v).map_err(|p| fail(v, p, PERCENT_EXAMPLE))?;
                }
            }
            VAR_COMPUTE_LIMIT => {
                if seen.first(Var::ComputeLimit) {
                    let v = value(PERCENT_EXAMPLE)?;
                    cfg.compute_limit =
                        optional_percent(v).map_err(|p| fail(v, p, PERCENT_EXAMPLE))?;
                }
            }
            VAR_COMPUTE_PRIORITY => {
                if seen.first(Var::ComputePriority) {
                    let v = value(PRIORITY_EXAMPLE)?;
                    if !v.trim().is_empty() {
                        cfg.compute_priority = Priority::parse(v).ok_or_else(|| {
                            fail(v, "unknown priority".to_owned(), PRIORITY_EXAMPLE)
                        })?;
                    }
                }
            }
            VAR_SOCKET => {
                if seen.first(Var::Socket) {
                    let v = value(SOCKET_EXAMPLE)?;
                    if !v.is_empty() {
                        check_socket(v).map_err(|p| fail(v, p, SOCKET_EXAMPLE))?;
                        v.clone_into(&mut cfg.socket);
                    }
                }
            }
            VAR_BROKER => {
                if seen.first(Var::Broker) {
                    let v = value(BROKER_EXAMPLE)?;
                    let t = v.trim();
                    if !t.is_empty() {
                        cfg.broker = BrokerMode::parse(t).ok_or_else(|| {
                            fail(v, "unknown broker mode".to_owned(), BROKER_EXAMPLE)
                        })?;
                    }
                }
            }
            VAR_JOB_LEDGER => {
                if seen.first(Var::JobLedger) {
                    let v = value("a path such as /dev/shm/gpufrac-job-1234")?;
                    if !v.trim().is_empty() {
                        cfg.job_ledger = Some(v.to_owned());
                    }
                }
            }
            VAR_JOB => {
                if seen.first(Var::Job) {
                    const JOB_EXAMPLE: &str =
                        "the 16 hex digits gpufrac run sets, such as 0123456789abcdef";
                    let v = value(JOB_EXAMPLE)?;
                    let t = v.trim();
                    if !t.is_empty() {
                        cfg.job = u64::from_str_radix(t, 16)
                            .ok()
                            .filter(|&j| j != 0 && t.len() == 16)
                            .ok_or_else(|| fail(v, "not a job token".to_owned(), JOB_EXAMPLE))?;
                    }
                }
            }
            VAR_LOG => {
                if seen.first(Var::Log) {
                    let v = value(LOG_EXAMPLE)?;
                    let t = v.trim();
                    if !t.is_empty() {
                        cfg.log = LogLevel::parse(t)
                            .ok_or_else(|| fail(v, "unknown log level".to_owned(), LOG_EXAMPLE))?;
                    }
                }
            }
            _ => {
                let Some(suffix) = name.strip_prefix(VAR_MEM_LIMIT_PREFIX) else {
                    continue;
                };
                let lossy = || String::from_utf8_lossy(raw).into_owned();
                let ordinal =
                    parse_ordinal(suffix).map_err(|p| fail(&lossy(), p, ORDINAL_EXAMPLE))?;
                if seen.first_device(ordinal) {
                    let v = value(MEM_LIMIT_EXAMPLE)?;
                    // Empty means "no override", unlike GPU_MEM_LIMIT_<N>=0,
                    // which uncaps this one device under a global cap.
                    if !v.trim().is_empty() {
                        let limit = size::mem_limit_problem(v)
                            .map_err(|p| fail(v, p, MEM_LIMIT_EXAMPLE))?;
                        if let Some(slot) = cfg.per_device.get_mut(ordinal) {
                            *slot = Some(limit);
                        }
                    }
                }
            }
        }
    }
    Ok(cfg)
}

fn optional_percent(v: &str) -> Result<Option<f64>, String> {
    if v.trim().is_empty() {
        Ok(None)
    } else {
        size::percent_problem(v).map(Some)
    }
}

fn check_socket(v: &str) -> Result<(), String> {
    if v.contains('\0') {
        return Err("the path contains a NUL byte".to_owned());
    }
    if v.len() > MAX_SOCKET_PATH {
        return Err(format!(
            "the path is {} bytes long; Unix socket paths are limited to {MAX_SOCKET_PATH}",
            v.len()
        ));
    }
    Ok(())
}

fn parse_ordinal(suffix: &str) -> Result<usize, String> {
    if suffix.is_empty() {
        return Err("no device ordinal after GPU_MEM_LIMIT_".to_owned());
    }
    if !suffix.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "'{}' is not a device ordinal",
            size::excerpt(suffix, 16)
        ));
    }
    // GPU_MEM_LIMIT_01 and GPU_MEM_LIMIT_1 would otherwise both name device
    // 1, and which of two conflicting values wins would be a surprise.
    if suffix.len() > 1 && suffix.starts_with('0') {
        return Err(format!(
            "device ordinal '{}' has a leading zero",
            size::excerpt(suffix, 16)
        ));
    }
    match suffix.parse::<usize>() {
        Ok(n) if n < MAX_DEVICES => Ok(n),
        _ => Err(format!(
            "device ordinal {} is out of range 0..{}",
            size::excerpt(suffix, 16),
            MAX_DEVICES - 1
        )),
    }
}

#[derive(Clone, Copy)]
enum Var {
    MemLimit,
    ComputeShare,
    ComputeLimit,
    ComputePriority,
    Socket,
    Broker,
    Log,
    JobLedger,
    Job,
}

/// Which variables have been met, so later duplicates are skipped.
#[derive(Default)]
struct Seen {
    vars: u16,
    devices: u64,
}

impl Seen {
    fn first(&mut self, var: Var) -> bool {
        let bit = 1u16 << var as u16;
        let first = self.vars & bit == 0;
        self.vars |= bit;
        first
    }

    fn first_device(&mut self, ordinal: usize) -> bool {
        let bit = 1u64.checked_shl(ordinal as u32).unwrap_or(0);
        let first = self.devices & bit == 0;
        self.devices |= bit;
        first
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn ok(vars: &[(&str, &str)]) -> ShimConfig {
        from_vars(vars.iter().copied()).unwrap_or_else(|e| panic!("{vars:?}: {e}"))
    }

    fn err(vars: &[(&str, &str)]) -> ConfigError {
        match from_vars(vars.iter().copied()) {
            Ok(c) => panic!("{vars:?} accepted: {c:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn empty_environment_gives_defaults() {
        let c = ok(&[]);
        assert_eq!(c, ShimConfig::default());
        assert_eq!(c.mem_limit, MemLimit::None);
        assert!(c.per_device.iter().all(Option::is_none));
        assert_eq!(c.compute_share, None);
        assert_eq!(c.compute_limit, None);
        assert_eq!(c.socket, DEFAULT_SOCKET);
        assert_eq!(c.broker, BrokerMode::Optional);
        assert_eq!(c.log, LogLevel::Error);
    }

    #[test]
    fn job_token() {
        assert_eq!(ok(&[("GPUFRAC_JOB", "00000000000000ff")]).job, 0xff);
        assert_eq!(ok(&[("GPUFRAC_JOB", "")]).job, 0);
        for bad in [
            "ff",
            "xyz0000000000000",
            "0000000000000000",
            "00000000000000ff0",
        ] {
            let e = err(&[("GPUFRAC_JOB", bad)]).to_string();
            assert!(
                e.contains("GPUFRAC_JOB") && e.contains("16 hex digits"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn unrelated_variables_are_ignored() {
        let c = ok(&[
            ("PATH", "/usr/bin"),
            ("GPU_MEM_LIMITS", "garbage"),
            ("gpu_mem_limit", "garbage"),
            ("GPU_MEM_LIMIT2", "garbage"),
            ("GPUFRAC_SIM_DEVICES", "garbage"),
            ("GPU_COMPUTE_SHARE_0", "garbage"),
            ("", ""),
        ]);
        assert_eq!(c, ShimConfig::default());
    }

    #[test]
    fn mem_limit_spellings() {
        for (v, want) in [
            ("", MemLimit::None),
            ("0", MemLimit::None),
            ("0G", MemLimit::None),
            ("4G", MemLimit::Bytes(4 * GIB)),
            ("4GiB", MemLimit::Bytes(4 * GIB)),
            ("4GB", MemLimit::Bytes(4 * GIB)),
            ("4g", MemLimit::Bytes(4 * GIB)),
            ("512M", MemLimit::Bytes(512 << 20)),
            ("1.5G", MemLimit::Bytes(1_610_612_736)),
            ("4294967296", MemLimit::Bytes(4 * GIB)),
            (" 4G ", MemLimit::Bytes(4 * GIB)),
            ("25%", MemLimit::Percent(25.0)),
            ("100%", MemLimit::Percent(100.0)),
        ] {
            assert_eq!(ok(&[("GPU_MEM_LIMIT", v)]).mem_limit, want, "{v:?}");
        }
    }

    #[test]
    fn mem_limit_rejections() {
        for v in [
            "4X", "G", "-1G", "1.2.3", "4 G G", "0%", "101%", "0.5", "nan", "25%%", "4GG", "x",
        ] {
            let e = err(&[("GPU_MEM_LIMIT", v)]);
            assert_eq!(e.var, "GPU_MEM_LIMIT");
            assert_eq!(e.value, v);
            assert_eq!(e.example, MEM_LIMIT_EXAMPLE);
        }
    }

    #[test]
    fn error_line_matches_the_documented_form() {
        let e = err(&[("GPU_MEM_LIMIT", "4X")]);
        assert_eq!(
            e.to_string(),
            "GPU_MEM_LIMIT=\"4X\": unknown unit 'X'; expected a size such as 4G, 512M, 1.5G, \
             4294967296 or a percentage such as 25%"
        );
    }

    #[test]
    fn error_line_is_one_line_and_bounded() {
        let nasty = format!("4\"X\n{}", "y".repeat(100_000));
        let e = err(&[("GPU_MEM_LIMIT", &nasty)]);
        let line = e.to_string();
        assert!(!line.contains('\n'), "{line}");
        assert!(line.len() < 400, "{line}");
        assert!(line.starts_with("GPU_MEM_LIMIT=\"4\\\"X\\n"), "{line}");
        assert_eq!(e.value, nasty, "the struct keeps the whole value");
    }

    #[test]
    fn per_device_overrides() {
        let c = ok(&[
            ("GPU_MEM_LIMIT", "4G"),
            ("GPU_MEM_LIMIT_0", "2G"),
            ("GPU_MEM_LIMIT_1", "0"),
            ("GPU_MEM_LIMIT_2", ""),
            ("GPU_MEM_LIMIT_3", "50%"),
            ("GPU_MEM_LIMIT_63", "1G"),
        ]);
        assert_eq!(c.per_device[0], Some(MemLimit::Bytes(2 * GIB)));
        assert_eq!(c.per_device[1], Some(MemLimit::None));
        assert_eq!(c.per_device[2], None);
        assert_eq!(c.per_device[3], Some(MemLimit::Percent(50.0)));
        assert_eq!(c.per_device[63], Some(MemLimit::Bytes(GIB)));
        assert_eq!(c.limit_for(0), MemLimit::Bytes(2 * GIB));
        assert_eq!(c.limit_for(1), MemLimit::None);
        assert_eq!(c.limit_for(2), MemLimit::Bytes(4 * GIB));
        assert_eq!(c.limit_for(3), MemLimit::Percent(50.0));
        assert_eq!(c.limit_for(4), MemLimit::Bytes(4 * GIB));
        assert_eq!(c.limit_for(63), MemLimit::Bytes(GIB));
        assert_eq!(c.limit_for(64), MemLimit::Bytes(4 * GIB));
        assert_eq!(c.limit_for(usize::MAX), MemLimit::Bytes(4 * GIB));
    }

    #[test]
    fn per_device_override_without_global_cap() {
        let c = ok(&[("GPU_MEM_LIMIT_5", "1G")]);
        assert_eq!(c.mem_limit, MemLimit::None);
        assert_eq!(c.limit_for(5), MemLimit::Bytes(GIB));
        assert_eq!(c.limit_for(4), MemLimit::None);
    }

    #[test]
    fn bad_device_variable_names() {
        for (name, needle) in [
            ("GPU_MEM_LIMIT_", "no device ordinal"),
            ("GPU_MEM_LIMIT_X", "'X' is not a device ordinal"),
            ("GPU_MEM_LIMIT_-1", "'-1' is not a device ordinal"),
            ("GPU_MEM_LIMIT_1X", "not a device ordinal"),
            ("GPU_MEM_LIMIT_ 1", "not a device ordinal"),
            ("GPU_MEM_LIMIT_64", "out of range 0..63"),
            ("GPU_MEM_LIMIT_99", "out of range 0..63"),
            ("GPU_MEM_LIMIT_99999999999999999999999", "out of range"),
            ("GPU_MEM_LIMIT_01", "leading zero"),
            ("GPU_MEM_LIMIT_00", "leading zero"),
        ] {
            // Even an empty value: a misspelt name is a mistake either way.
            for value in ["1G", ""] {
                let e = err(&[(name, value)]);
                assert_eq!(e.var, name);
                assert!(e.problem.contains(needle), "{name}: {}", e.problem);
                assert_eq!(e.example, ORDINAL_EXAMPLE);
                assert!(e.to_string().starts_with(name), "{e}");
            }
        }
    }

    #[test]
    fn bad_device_values() {
        for v in ["4X", "-1", "0%", "200%", "1.2.3G"] {
            let e = err(&[("GPU_MEM_LIMIT_7", v)]);
            assert_eq!(e.var, "GPU_MEM_LIMIT_7");
            assert_eq!(e.value, v);
            assert_eq!(e.example, MEM_LIMIT_EXAMPLE);
        }
    }

    #[test]
    fn compute_percentages() {
        for (v, want) in [
            ("30%", Some(30.0)),
            ("30", Some(30.0)),
            ("12.5%", Some(12.5)),
            ("100", Some(100.0)),
            ("", None),
            ("  ", None),
        ] {
            assert_eq!(ok(&[("GPU_COMPUTE_SHARE", v)]).compute_share, want, "{v:?}");
            assert_eq!(ok(&[("GPU_COMPUTE_LIMIT", v)]).compute_limit, want, "{v:?}");
        }
        for v in ["0", "0%", "101", "-5%", "30%%", "abc", "30G", "nan", "1e2"] {
            for var in ["GPU_COMPUTE_SHARE", "GPU_COMPUTE_LIMIT"] {
                let e = err(&[(var, v)]);
                assert_eq!(e.var, var);
                assert_eq!(e.example, PERCENT_EXAMPLE);
            }
        }
    }

    #[test]
    fn socket_paths() {
        assert_eq!(
            ok(&[("GPUFRAC_SOCKET", "/tmp/x.sock")]).socket,
            "/tmp/x.sock"
        );
        assert_eq!(ok(&[("GPUFRAC_SOCKET", "rel.sock")]).socket, "rel.sock");
        assert_eq!(ok(&[("GPUFRAC_SOCKET", "")]).socket, DEFAULT_SOCKET);
        let longest = format!("/{}", "a".repeat(MAX_SOCKET_PATH - 1));
        assert_eq!(ok(&[("GPUFRAC_SOCKET", &longest)]).socket, longest);
        let e = err(&[("GPUFRAC_SOCKET", &format!("{longest}a"))]);
        assert!(e.problem.contains("108 bytes long"), "{}", e.problem);
        let e = err(&[("GPUFRAC_SOCKET", "/tmp/a\0b")]);
        assert!(e.problem.contains("NUL"));
        assert_eq!(e.example, SOCKET_EXAMPLE);
    }

    #[test]
    fn broker_modes() {
        for (v, want) in [
            ("optional", BrokerMode::Optional),
            ("required", BrokerMode::Required),
            ("off", BrokerMode::Off),
            ("OFF", BrokerMode::Off),
            ("Required", BrokerMode::Required),
            (" off ", BrokerMode::Off),
            ("", BrokerMode::Optional),
        ] {
            assert_eq!(ok(&[("GPUFRAC_BROKER", v)]).broker, want, "{v:?}");
        }
        for v in [
            "on",
            "no",
            "0",
            "1",
            "true",
            "false",
            "require",
            "optional,off",
        ] {
            let e = err(&[("GPUFRAC_BROKER", v)]);
            assert_eq!(e.var, "GPUFRAC_BROKER");
            assert!(
                e.to_string()
                    .ends_with("expected one of optional, required, off"),
                "{e}"
            );
        }
        for m in [BrokerMode::Optional, BrokerMode::Required, BrokerMode::Off] {
            assert_eq!(BrokerMode::parse(m.as_str()), Some(m));
        }
    }

    #[test]
    fn log_levels() {
        for (v, want) in [
            ("error", LogLevel::Error),
            ("warn", LogLevel::Warn),
            ("info", LogLevel::Info),
            ("debug", LogLevel::Debug),
            ("DEBUG", LogLevel::Debug),
            (" Info", LogLevel::Info),
            ("", LogLevel::Error),
        ] {
            assert_eq!(ok(&[("GPUFRAC_LOG", v)]).log, want, "{v:?}");
        }
        for v in ["warning", "trace", "verbose", "3", "err", "info debug"] {
            let e = err(&[("GPUFRAC_LOG", v)]);
            assert_eq!(e.var, "GPUFRAC_LOG");
            assert!(
                e.to_string()
                    .ends_with("expected one of error, warn, info, debug"),
                "{e}"
            );
        }
        assert!(LogLevel::Error < LogLevel::Warn);
        assert!(LogLevel::Warn < LogLevel::Info);
        assert!(LogLevel::Info < LogLevel::Debug);
    }

    #[test]
    fn priorities() {
        for (v, want) in [
            ("high", Priority::High),
            ("normal", Priority::Normal),
            ("low", Priority::Low),
            ("HIGH", Priority::High),
            (" Low ", Priority::Low),
            ("", Priority::Normal),
        ] {
            assert_eq!(
                ok(&[("GPU_COMPUTE_PRIORITY", v)]).compute_priority,
                want,
                "{v:?}"
            );
        }
        for v in ["urgent", "1", "hi", "high,low", "realtime", "-1"] {
            let e = err(&[("GPU_COMPUTE_PRIORITY", v)]);
            assert_eq!(e.var, "GPU_COMPUTE_PRIORITY");
            assert!(
                e.to_string().ends_with("expected one of high, normal, low"),
                "{e}"
            );
        }
        assert_eq!(ShimConfig::default().compute_priority, Priority::Normal);
        assert!(Priority::High > Priority::Normal && Priority::Normal > Priority::Low);
        for p in Priority::ALL {
            assert_eq!(Priority::parse(p.as_str()), Some(p));
            assert_eq!(Priority::from_index(p.index() as u8), Some(p));
        }
        assert_eq!(Priority::from_index(3), None);
    }

    #[test]
    fn everything_at_once() {
        let c = ok(&[
            ("GPU_MEM_LIMIT", "25%"),
            ("GPU_MEM_LIMIT_1", "8G"),
            ("GPU_COMPUTE_SHARE", "30%"),
            ("GPU_COMPUTE_LIMIT", "50"),
            ("GPU_COMPUTE_PRIORITY", "high"),
            ("GPUFRAC_SOCKET", "/tmp/b.sock"),
            ("GPUFRAC_BROKER", "required"),
            ("GPUFRAC_LOG", "debug"),
        ]);
        assert_eq!(c.mem_limit, MemLimit::Percent(25.0));
        assert_eq!(c.limit_for(1), MemLimit::Bytes(8 * GIB));
        assert_eq!(c.compute_share, Some(30.0));
        assert_eq!(c.compute_limit, Some(50.0));
        assert_eq!(c.compute_priority, Priority::High);
        assert_eq!(c.socket, "/tmp/b.sock");
        assert_eq!(c.broker, BrokerMode::Required);
        assert_eq!(c.log, LogLevel::Debug);
    }

    #[test]
    fn first_occurrence_wins_like_getenv() {
        let c = ok(&[
            ("GPU_MEM_LIMIT", "4G"),
            ("GPU_MEM_LIMIT", "garbage"),
            ("GPU_MEM_LIMIT_2", "1G"),
            ("GPU_MEM_LIMIT_2", "garbage"),
            ("GPUFRAC_LOG", "info"),
            ("GPUFRAC_LOG", "debug"),
        ]);
        assert_eq!(c.mem_limit, MemLimit::Bytes(4 * GIB));
        assert_eq!(c.limit_for(2), MemLimit::Bytes(GIB));
        assert_eq!(c.log, LogLevel::Info);
        // An empty first value still counts as the one getenv returns.
        let c = ok(&[("GPU_MEM_LIMIT", ""), ("GPU_MEM_LIMIT", "4G")]);
        assert_eq!(c.mem_limit, MemLimit::None);
    }

    #[test]
    fn first_error_is_reported() {
        let e = err(&[("GPUFRAC_LOG", "loud"), ("GPU_MEM_LIMIT", "4X")]);
        assert_eq!(e.var, "GPUFRAC_LOG");
    }

    #[test]
    fn raw_environment() {
        let vars: [(&[u8], &[u8]); 3] = [
            (b"\xff\xfe", b"\xff"),
            (b"PATH", b"\xff"),
            (b"GPU_MEM_LIMIT", b"4G"),
        ];
        let c = from_raw_vars(vars).unwrap();
        assert_eq!(c.mem_limit, MemLimit::Bytes(4 * GIB));

        for name in [
            "GPU_MEM_LIMIT",
            "GPU_MEM_LIMIT_0",
            "GPU_COMPUTE_SHARE",
            "GPU_COMPUTE_LIMIT",
            "GPUFRAC_SOCKET",
            "GPUFRAC_BROKER",
            "GPUFRAC_LOG",
        ] {
            let e = from_raw_vars([(name.as_bytes(), &b"4\xffG"[..])]).unwrap_err();
            assert_eq!(e.var, name);
            assert_eq!(e.problem, UTF8_PROBLEM);
            assert_eq!(e.value, "4\u{fffd}G");
        }
        let e = from_raw_vars([(&b"GPU_MEM_LIMIT_Q"[..], &b"\xff"[..])]).unwrap_err();
        assert_eq!(e.example, ORDINAL_EXAMPLE);
    }

    proptest::proptest! {
        #[test]
        fn never_panics(
            vars in proptest::collection::vec(
                (
                    proptest::sample::select(vec![
                        "GPU_MEM_LIMIT", "GPU_MEM_LIMIT_0", "GPU_MEM_LIMIT_63", "GPU_MEM_LIMIT_64",
                        "GPU_MEM_LIMIT_x", "GPU_COMPUTE_SHARE", "GPU_COMPUTE_LIMIT",
                        "GPUFRAC_SOCKET", "GPUFRAC_BROKER", "GPUFRAC_LOG", "OTHER",
                    ]),
                    proptest::prelude::any::<String>(),
                ),
                0..8,
            )
        ) {
            match from_vars(vars.iter().map(|(k, v)| (*k, v.as_str()))) {
                Ok(c) => {
                    for i in 0..=MAX_DEVICES {
                        let _ = c.limit_for(i).resolve(80 << 30);
                    }
                }
                Err(e) => proptest::prop_assert!(!e.to_string().contains('\n')),
            }
        }

        #[test]
        fn never_panics_on_any_name(name in "GPU_MEM_LIMIT_.{0,6}", value in ".{0,8}") {
            let _ = from_vars([(name.as_str(), value.as_str())]);
        }
    }
}
