//! Configuration from the environment, read once.

use std::ffi::{CString, OsString};
use std::sync::OnceLock;

pub use crate::mig::Model;

pub const VAR_DEVICES: &str = "GPUFRAC_SIM_DEVICES";
pub const VAR_STATE: &str = "GPUFRAC_SIM_STATE";
pub const VAR_DRIVER_VERSION: &str = "GPUFRAC_SIM_DRIVER_VERSION";
pub const VAR_QUANTUM_US: &str = "GPUFRAC_SIM_QUANTUM_US";
pub const VAR_SWITCH_US: &str = "GPUFRAC_SIM_SWITCH_US";
/// Read for one thing only: a first entry `MIG-<uuid>` makes the process
/// see that MIG device alone, as the real driver does. Other lists are not
/// honoured (see the crate's known gap).
pub const VAR_VISIBLE: &str = "CUDA_VISIBLE_DEVICES";

pub const DEFAULT_DRIVER_VERSION: i32 = 13000;
pub const DEFAULT_DEVICE_BYTES: u64 = 16 << 30;
/// Time slice and context switch cost measured on an H100 (driver 580).
pub const DEFAULT_QUANTUM_US: u64 = 2000;
pub const DEFAULT_SWITCH_US: u64 = 100;
/// Past this a model step in ns could overflow when added to a timestamp.
const MAX_US: u64 = 3_600_000_000;

/// One physical device of `GPUFRAC_SIM_DEVICES`: a size (`16G`), or a
/// MIG-capable model (`A100-40GB`) whose MIG mode is on with `:mig`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DevSpec {
    pub total: u64,
    pub model: Option<Model>,
    /// MIG mode is enabled (read-only: nothing in the simulator changes it,
    /// as nothing in gpufrac may change it on a real GPU).
    pub mig: bool,
}

impl DevSpec {
    pub const fn plain(total: u64) -> DevSpec {
        DevSpec {
            total,
            model: None,
            mig: false,
        }
    }
}

pub struct Config {
    pub devices: Vec<DevSpec>,
    /// `CUDA_VISIBLE_DEVICES`' first entry when it names a MIG device.
    pub visible_mig: Option<String>,
    pub state_path: Option<CString>,
    pub quantum_ns: u64,
    pub switch_ns: u64,
}

/// Parses `16G`, `512M`, `1024`, `8GiB`, `8GB` (all binary units).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits = t.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return Err(format!("bad size {s:?}"));
    }
    let n: u64 = t[..digits].parse().map_err(|_| format!("bad size {s:?}"))?;
    let unit = t[digits..].trim().to_ascii_uppercase();
    let unit = unit.strip_suffix('B').unwrap_or(&unit);
    let unit = unit.strip_suffix('I').unwrap_or(unit);
    let shift = match unit {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return Err(format!("bad size unit in {s:?}")),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("size {s:?} overflows"))
}

/// One entry: a size, or `MODEL` / `MODEL:mig` for a MIG-capable model.
pub fn parse_device(s: &str) -> Result<DevSpec, String> {
    let t = s.trim();
    let (name, mig) = match t.rsplit_once(':') {
        Some((n, m)) if m.trim().eq_ignore_ascii_case("mig") => (n.trim(), true),
        Some((_, m)) => {
            return Err(format!(
                "bad device {s:?}: unknown suffix {m:?}; the only suffix is :mig, e.g. A100-40GB:mig"
            ));
        }
        None => (t, false),
    };
    if let Some(model) = Model::parse(name) {
        return Ok(DevSpec {
            total: model.info().total_mib << 20,
            model: Some(model),
            mig,
        });
    }
    let total = parse_size(name).map_err(|e| {
        format!(
            "{e}; a device is a size such as 16G or a MIG-capable model ({}), optionally with :mig",
            Model::NAMES.join(", ")
        )
    })?;
    if mig {
        return Err(format!(
            "bad device {s:?}: MIG needs a model with MIG profiles, e.g. A100-40GB:mig ({} are known)",
            Model::NAMES.join(", ")
        ));
    }
    Ok(DevSpec::plain(total))
}

pub fn parse_devices(s: &str) -> Result<Vec<DevSpec>, String> {
    let v = s
        .split(',')
        .map(parse_device)
        .collect::<Result<Vec<_>, _>>()?;
    if v.len() > crate::state::MAX_DEV {
        return Err(format!(
            "{VAR_DEVICES}: at most {} devices",
            crate::state::MAX_DEV
        ));
    }
    Ok(v)
}

/// Microseconds as a plain integer; `min` is the least accepted value.
pub fn parse_us(var: &str, s: &str, min: u64) -> Result<u64, String> {
    let v: u64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{var}: {s:?} is not a whole number of microseconds"))?;
    if v < min || v > MAX_US {
        return Err(format!("{var}: {v} is out of range ({min}..={MAX_US})"));
    }
    Ok(v)
}

fn env_us(var: &str, default: u64, min: u64) -> Result<u64, String> {
    match std::env::var(var) {
        Ok(s) => parse_us(var, &s, min),
        Err(std::env::VarError::NotPresent) => Ok(default),
        Err(e) => Err(format!("{var}: {e}")),
    }
}

/// The MIG device a `CUDA_VISIBLE_DEVICES` value selects: its first entry,
/// when that is `MIG-...` (CUDA enumerates one MIG device per process).
pub fn visible_mig(s: &str) -> Option<String> {
    let first = s.split(',').next()?.trim();
    first.starts_with("MIG-").then(|| first.to_owned())
}

pub fn load() -> Result<Config, String> {
    let devices = match std::env::var(VAR_DEVICES) {
        Ok(s) if !s.trim().is_empty() => {
            parse_devices(&s).map_err(|e| format!("{VAR_DEVICES}: {e}"))?
        }
        Ok(_) => Vec::new(),
        Err(std::env::VarError::NotPresent) => vec![DevSpec::plain(DEFAULT_DEVICE_BYTES)],
        Err(e) => return Err(format!("{VAR_DEVICES}: {e}")),
    };
    let visible_mig = std::env::var(VAR_VISIBLE)
        .ok()
        .and_then(|v| visible_mig(&v));
    let state_path = match std::env::var_os(VAR_STATE) {
        Some(p) if !p.is_empty() => Some(to_cstring(p)?),
        _ => None,
    };
    // A zero quantum would let two contexts preempt each other forever
    // without either making progress.
    let quantum_ns = env_us(VAR_QUANTUM_US, DEFAULT_QUANTUM_US, 1)? * 1000;
    let switch_ns = env_us(VAR_SWITCH_US, DEFAULT_SWITCH_US, 0)? * 1000;
    Ok(Config {
        devices,
        visible_mig,
        state_path,
        quantum_ns,
        switch_ns,
    })
}

fn to_cstring(p: OsString) -> Result<CString, String> {
    use std::os::unix::ffi::OsStringExt;
    CString::new(p.into_vec()).map_err(|_| format!("{VAR_STATE} contains NUL"))
}

/// The simulated driver version; read on first use (`cuGetProcAddress` and
/// `cuDriverGetVersion` work before `cuInit`).
pub fn driver_version() -> i32 {
    static V: OnceLock<i32> = OnceLock::new();
    *V.get_or_init(|| {
        std::env::var(VAR_DRIVER_VERSION)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(DEFAULT_DRIVER_VERSION)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1024"), Ok(1024));
        assert_eq!(parse_size("16G"), Ok(16 << 30));
        assert_eq!(parse_size(" 8GiB "), Ok(8 << 30));
        assert_eq!(parse_size("512m"), Ok(512 << 20));
        assert_eq!(parse_size("2KB"), Ok(2048));
        assert_eq!(parse_size("1T"), Ok(1 << 40));
        assert!(parse_size("").is_err());
        assert!(parse_size("G").is_err());
        assert!(parse_size("12X").is_err());
        assert!(parse_size("99999999999T").is_err());
        assert_eq!(
            parse_devices("16G,8G"),
            Ok(vec![DevSpec::plain(16 << 30), DevSpec::plain(8 << 30)])
        );
        assert!(parse_devices("16G,,8G").is_err());
    }

    #[test]
    fn mig_models() {
        let v = parse_devices("A100-40GB:mig, a100-80gb ,H100-80GB:MIG,8G").unwrap();
        let models: Vec<_> = v.iter().map(|d| (d.model, d.mig)).collect();
        assert_eq!(
            models,
            vec![
                (Some(Model::A100_40GB), true),
                (Some(Model::A100_80GB), false),
                (Some(Model::H100_80GB), true),
                (None, false)
            ]
        );
        assert_eq!(v[0].total, 40960 << 20);
        assert_eq!(v[2].total, 81559 << 20);
        let e = parse_device("16G:mig").unwrap_err();
        assert!(
            e.contains("MIG needs a model") && e.contains("A100-40GB"),
            "{e}"
        );
        let e = parse_device("A100-40GB:nope").unwrap_err();
        assert!(e.contains(":mig"), "{e}");
        let e = parse_device("V100").unwrap_err();
        assert!(e.contains("H100-80GB"), "{e}");
        assert_eq!(visible_mig("MIG-abc,GPU-x"), Some("MIG-abc".into()));
        assert_eq!(visible_mig(" MIG-abc"), Some("MIG-abc".into()));
        assert_eq!(visible_mig("0,MIG-abc"), None);
        assert_eq!(visible_mig(""), None);
    }

    #[test]
    fn microseconds() {
        assert_eq!(parse_us("Q", " 2000 ", 1), Ok(2000));
        assert_eq!(parse_us("S", "0", 0), Ok(0));
        assert!(parse_us("Q", "0", 1).unwrap_err().contains("out of range"));
        assert!(parse_us("Q", "2ms", 1).unwrap_err().starts_with("Q: "));
        assert!(parse_us("Q", "-5", 1).is_err());
        assert!(parse_us("Q", "", 1).is_err());
        assert!(parse_us("Q", "99999999999999", 1).is_err());
    }
}
