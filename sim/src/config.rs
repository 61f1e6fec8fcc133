//! Configuration from the environment, read once.

use std::ffi::{CString, OsString};
use std::sync::OnceLock;

pub const VAR_DEVICES: &str = "GPUFRAC_SIM_DEVICES";
pub const VAR_STATE: &str = "GPUFRAC_SIM_STATE";
pub const VAR_DRIVER_VERSION: &str = "GPUFRAC_SIM_DRIVER_VERSION";

pub const DEFAULT_DRIVER_VERSION: i32 = 13000;
pub const DEFAULT_DEVICE_BYTES: u64 = 16 << 30;

pub struct Config {
    pub totals: Vec<u64>,
    pub state_path: Option<CString>,
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

pub fn parse_devices(s: &str) -> Result<Vec<u64>, String> {
    let v = s
        .split(',')
        .map(parse_size)
        .collect::<Result<Vec<_>, _>>()?;
    if v.len() > crate::state::MAX_DEV {
        return Err(format!(
            "{VAR_DEVICES}: at most {} devices",
            crate::state::MAX_DEV
        ));
    }
    Ok(v)
}

pub fn load() -> Result<Config, String> {
    let totals = match std::env::var(VAR_DEVICES) {
        Ok(s) if !s.trim().is_empty() => parse_devices(&s)?,
        Ok(_) => Vec::new(),
        Err(std::env::VarError::NotPresent) => vec![DEFAULT_DEVICE_BYTES],
        Err(e) => return Err(format!("{VAR_DEVICES}: {e}")),
    };
    let state_path = match std::env::var_os(VAR_STATE) {
        Some(p) if !p.is_empty() => Some(to_cstring(p)?),
        _ => None,
    };
    Ok(Config { totals, state_path })
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
        assert_eq!(parse_devices("16G,8G"), Ok(vec![16 << 30, 8 << 30]));
        assert!(parse_devices("16G,,8G").is_err());
    }
}
