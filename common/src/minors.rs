//! Which /dev/nvidiaN node is which GPU: the kernel module's minor numbers,
//! read from `/proc/driver/nvidia/gpus/*/information`. CUDA's ordinals and
//! nvidia-smi's indices need not be the minor numbers (a GPU excluded or
//! unbound leaves a gap), so whoever hands a container a GPU's node (the
//! CDI generator, the device plugin) reads them here.

use std::collections::BTreeMap;
use std::path::Path;

/// Where the kernel module lists its GPUs.
pub const PROC_GPUS: &str = "/proc/driver/nvidia/gpus";

/// `GPU UUID:` (lower case) and `Device Minor:` of one GPU's `information`
/// file; None when either is missing or the minor is not a number.
pub fn parse_information(text: &str) -> Option<(String, u32)> {
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
    };
    let uuid = field("GPU UUID")?.to_ascii_lowercase();
    let minor = field("Device Minor")?.parse().ok()?;
    Some((uuid, minor))
}

/// GPU UUID (lower case) → minor number, for every GPU directory under
/// `proc_gpus` (normally `PROC_GPUS`) whose information file says both.
/// Err when the directory cannot be read (no NVIDIA kernel module): the
/// caller then takes GPU N to be /dev/nvidiaN.
pub fn read_minors(proc_gpus: &Path) -> std::io::Result<BTreeMap<String, u32>> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(proc_gpus)?.flatten() {
        if let Ok(text) = std::fs::read_to_string(entry.path().join("information"))
            && let Some((uuid, minor)) = parse_information(&text)
        {
            out.insert(uuid, minor);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minor_numbers_from_the_information_file() {
        let info = "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 42\n\
                    GPU UUID: \t GPU-5E1F0C4A-1B2C-3D4E-5F60-718293A4B5C6\n\
                    Bus Location: \t 0000:1b:00.0\nDevice Minor: \t 3\nGPU Excluded:\t No\n";
        assert_eq!(
            parse_information(info),
            Some(("gpu-5e1f0c4a-1b2c-3d4e-5f60-718293a4b5c6".into(), 3))
        );
        assert_eq!(parse_information("Model: x\n"), None);
        assert_eq!(
            parse_information("GPU UUID: GPU-1\nDevice Minor: ?\n"),
            None
        );
    }

    #[test]
    fn read_from_a_directory_of_gpus() {
        let root = std::env::temp_dir().join(format!("gpufrac-minors-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for (bus, uuid, minor) in [
            ("0000:1b:00.0", "GPU-AA", "2"),
            ("0000:2c:00.0", "GPU-BB", "0"),
        ] {
            std::fs::create_dir_all(root.join(bus)).unwrap();
            std::fs::write(
                root.join(bus).join("information"),
                format!("GPU UUID: {uuid}\nDevice Minor: {minor}\n"),
            )
            .unwrap();
        }
        // A GPU whose file says no minor is left out, not guessed.
        std::fs::create_dir_all(root.join("0000:3d:00.0")).unwrap();
        std::fs::write(root.join("0000:3d:00.0/information"), "GPU UUID: GPU-CC\n").unwrap();
        let m = read_minors(&root).unwrap();
        assert_eq!(
            m.into_iter().collect::<Vec<_>>(),
            [("gpu-aa".to_string(), 2), ("gpu-bb".to_string(), 0)]
        );
        assert!(read_minors(&root.join("absent")).is_err());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
