//! Configuration from the environment, read once.

use std::ffi::{CString, OsString};
use std::sync::OnceLock;

use gpufrac_common::cuda::{CUuuid, format_uuid};
use gpufrac_common::size::parse_size;

pub use crate::mig::Model;

pub const VAR_DEVICES: &str = "GPUFRAC_SIM_DEVICES";
pub const VAR_STATE: &str = "GPUFRAC_SIM_STATE";
pub const VAR_DRIVER_VERSION: &str = "GPUFRAC_SIM_DRIVER_VERSION";
pub const VAR_NVML_LATE: &str = "GPUFRAC_SIM_NVML_LATE";
pub const VAR_QUANTUM_US: &str = "GPUFRAC_SIM_QUANTUM_US";
pub const VAR_SWITCH_US: &str = "GPUFRAC_SIM_SWITCH_US";
/// Which devices CUDA shows, in which order, as the real driver reads it
/// (see `Visible`).
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

/// One entry of `CUDA_VISIBLE_DEVICES`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Visible {
    /// A device index as nvidia-smi numbers the GPUs (what `gpufrac run`
    /// hands out, with `CUDA_DEVICE_ORDER=PCI_BUS_ID`).
    Index(usize),
    /// `GPU-<uuid>` or any prefix of it, as the driver accepts.
    Uuid(String),
    /// `MIG-<uuid>`: counts only as the first entry (CUDA then shows that
    /// MIG device alone).
    Mig(String),
    /// Anything else (`-1`, `foo`): the driver shows the devices named
    /// before it and none after.
    Invalid,
}

pub struct Config {
    pub devices: Vec<DevSpec>,
    /// `CUDA_VISIBLE_DEVICES`, parsed; None when unset (every device).
    pub visible: Option<Vec<Visible>>,
    pub state_path: Option<CString>,
    pub quantum_ns: u64,
    pub switch_ns: u64,
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
    if v.len() > MAX_DEV {
        return Err(format!("{VAR_DEVICES}: at most {} devices", MAX_DEV));
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

/// Parses a `CUDA_VISIBLE_DEVICES` value. An empty value is an empty list
/// (no device), as with the driver.
pub fn parse_visible(s: &str) -> Vec<Visible> {
    if s.trim().is_empty() {
        return Vec::new();
    }
    s.split(',')
        .map(|e| {
            let e = e.trim();
            if e.len() > 4 && e[..4].eq_ignore_ascii_case("GPU-") {
                Visible::Uuid(e.to_ascii_lowercase())
            } else if e.starts_with("MIG-") {
                Visible::Mig(e.to_owned())
            } else if !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit()) {
                e.parse().map_or(Visible::Invalid, Visible::Index)
            } else {
                Visible::Invalid
            }
        })
        .collect()
}

/// The physical devices CUDA shows, in CUDA order, given the UUID string
/// (`GPU-…`, lower case) of each. As the real driver does: the list ends
/// at the first entry that names no device, names one ambiguously (a UUID
/// prefix two devices share), names one already listed, or names a GPU in
/// MIG mode (not a CUDA device of its own); a MIG entry past the first
/// ends it too. Unset: every device not in MIG mode.
pub fn select_visible(
    devices: &[DevSpec],
    uuids: &[String],
    visible: Option<&[Visible]>,
) -> Vec<usize> {
    let Some(visible) = visible else {
        return (0..devices.len()).filter(|&i| !devices[i].mig).collect();
    };
    let mut out: Vec<usize> = Vec::new();
    for v in visible {
        let found = match v {
            Visible::Index(i) => Some(*i).filter(|&i| i < devices.len()),
            Visible::Uuid(prefix) => {
                let mut m = (0..uuids.len()).filter(|&i| uuids[i].starts_with(prefix.as_str()));
                match (m.next(), m.next()) {
                    (Some(i), None) => Some(i),
                    _ => None,
                }
            }
            Visible::Mig(_) | Visible::Invalid => None,
        };
        match found {
            Some(i) if !devices[i].mig && !out.contains(&i) => out.push(i),
            _ => break,
        }
    }
    out
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
    let visible = match std::env::var(VAR_VISIBLE) {
        Ok(v) => Some(parse_visible(&v)),
        Err(std::env::VarError::NotPresent) => None,
        // The driver would find no device it can name in bytes that are not
        // UTF-8 either.
        Err(std::env::VarError::NotUnicode(_)) => Some(vec![Visible::Invalid]),
    };
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
        visible,
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

/// `GPUFRAC_SIM_NVML_LATE`: processes that start between a caller's two
/// calls of an NVML process list. The first call, which asks for the
/// count (no buffer or no room), is told that many fewer than the list
/// holds; the next finds the list longer than the buffer sized by that
/// count, as a real driver does while a job's workers start at once.
/// Read on first use; 0 (unset, or not a number): the count is exact.
pub fn nvml_late() -> usize {
    static V: OnceLock<usize> = OnceLock::new();
    *V.get_or_init(|| {
        std::env::var(VAR_NVML_LATE)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    })
}

/// Physical devices the simulated machine can have.
pub const MAX_DEV: usize = 64;

/// Deterministic UUID of device `i`, the same for CUDA and NVML.
pub fn uuid(i: usize) -> CUuuid {
    let mut bytes = [
        0x5a, 0x1e, 0x6f, 0x7a, 0xc0, 0xde, 0x40, 0x00, 0x80, 0x00, 0, 0, 0, 0, 0, 0,
    ];
    bytes[14] = (i >> 8) as u8;
    bytes[15] = i as u8;
    CUuuid { bytes }
}

pub fn uuid_string(i: usize) -> ([u8; 40], usize) {
    let mut buf = [0u8; 40];
    let n = format_uuid(&uuid(i), &mut buf);
    (buf, n)
}

/// Name of physical device `i` (NVML's, and CUDA's when CUDA shows it).
pub fn phys_name(i: usize, d: &DevSpec) -> String {
    match d.model {
        Some(m) => format!("gpufrac-sim {} (GPU {i})", m.info().name),
        None => format!("gpufrac-sim GPU {i}"),
    }
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
        assert_eq!(
            parse_visible("MIG-abc,GPU-x"),
            vec![
                Visible::Mig("MIG-abc".into()),
                Visible::Uuid("gpu-x".into())
            ]
        );
        assert_eq!(parse_visible(" MIG-abc")[0], Visible::Mig("MIG-abc".into()));
        assert_eq!(parse_visible(""), vec![]);
    }

    #[test]
    fn visible_devices_as_the_driver_reads_them() {
        use Visible::*;
        assert_eq!(
            parse_visible(" 1, 0 ,GPU-5A1E,-1,x,,gpu-"),
            vec![
                Index(1),
                Index(0),
                Uuid("gpu-5a1e".into()),
                Invalid,
                Invalid,
                Invalid,
                Invalid
            ]
        );
        let devs = [
            DevSpec::plain(16 << 30),
            DevSpec::plain(8 << 30),
            DevSpec::plain(4 << 30),
        ];
        let uuids: Vec<String> = ["gpu-aa01", "gpu-aa02", "gpu-bb03"]
            .map(String::from)
            .to_vec();
        let sel = |v: &str| select_visible(&devs, &uuids, Some(&parse_visible(v)));
        assert_eq!(select_visible(&devs, &uuids, None), vec![0, 1, 2]);
        assert_eq!(sel("1"), vec![1]);
        assert_eq!(sel("2,0"), vec![2, 0]);
        assert_eq!(
            sel("0,2,-1,1"),
            vec![0, 2],
            "an invalid entry ends the list"
        );
        assert_eq!(
            sel("0,7,1"),
            vec![0],
            "so does an index past the last device"
        );
        assert_eq!(sel("GPU-bb"), vec![2], "a unique prefix names a device");
        assert_eq!(
            sel("GPU-AA02,GPU-aa"),
            vec![1],
            "an ambiguous one ends the list"
        );
        assert_eq!(sel("1,GPU-aa02,0"), vec![1], "a device is listed once");
        assert_eq!(sel("1,MIG-x"), vec![1]);
        assert_eq!(sel(""), Vec::<usize>::new());
        let mig = [
            DevSpec::plain(16 << 30),
            parse_device("A100-40GB:mig").unwrap(),
        ];
        let uuids = &uuids[..2];
        assert_eq!(select_visible(&mig, uuids, None), vec![0]);
        assert_eq!(
            select_visible(&mig, uuids, Some(&parse_visible("1,0"))),
            Vec::<usize>::new(),
            "a GPU in MIG mode is no CUDA device"
        );
    }

    /// Every list of up to four entries over a small alphabet: the devices
    /// shown are the list's valid prefix, in its order, each once, and the
    /// first invalid entry hides everything after it.
    #[test]
    fn visible_lists_exhaustively() {
        let devs = [
            DevSpec::plain(16 << 30),
            DevSpec::plain(8 << 30),
            parse_device("A100-40GB:mig").unwrap(),
        ];
        let uuids: Vec<String> = ["gpu-aa01", "gpu-aa02", "gpu-bb03"]
            .map(String::from)
            .to_vec();
        let alphabet = [
            "0", "1", "2", "3", "-1", "GPU-aa01", "GPU-aa", "GPU-b", "MIG-x", "",
        ];
        let named = |e: &str| -> Option<usize> {
            match e {
                "0" | "GPU-aa01" => Some(0),
                "1" => Some(1),
                "2" | "GPU-b" => Some(2),
                _ => None,
            }
        };
        let mut lists: Vec<Vec<&str>> = vec![vec![]];
        for _ in 0..4 {
            let longer: Vec<Vec<&str>> = lists
                .iter()
                .filter(|l| l.len() == lists.last().unwrap().len())
                .flat_map(|l| {
                    alphabet.iter().map(move |a| {
                        let mut l = l.clone();
                        l.push(a);
                        l
                    })
                })
                .collect();
            lists.extend(longer);
        }
        assert!(lists.len() > 10_000);
        for l in lists {
            let v = l.join(",");
            let got = select_visible(&devs, &uuids, Some(&parse_visible(&v)));
            let mut want = Vec::new();
            for e in &l {
                match named(e) {
                    Some(i) if !devs[i].mig && !want.contains(&i) => want.push(i),
                    _ => break,
                }
            }
            assert_eq!(got, want, "CUDA_VISIBLE_DEVICES={v:?}");
        }
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
