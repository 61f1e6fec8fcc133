//! What the process sees of memory: a GPU the size of its cap.
//! total = min(cap, physical); free = min(physical free, cap − used).
//! Shared by the CUDA and NVML views, tested on its own.

/// "No cap" in the books.
pub const NO_LIMIT: u64 = u64::MAX;

/// The virtual (total, free) for a device with `cap` and `used` bytes
/// charged, given the physical figures.
pub fn virtual_view(phys_total: u64, phys_free: u64, cap: u64, used: u64) -> (u64, u64) {
    if cap == NO_LIMIT {
        return (phys_total, phys_free);
    }
    let total = cap.min(phys_total);
    let free = phys_free.min(cap.saturating_sub(used)).min(total);
    (total, free)
}

/// Whether a UUID as CUDA's devices are formatted (`GPU-…`) and one as NVML
/// names a device (`GPU-…` for a GPU, `MIG-…` for a MIG instance, whose
/// hex is CUDA's UUID for that instance) name the same device: the hex
/// after the prefix decides, so that a MIG instance's NVML handle finds its
/// CUDA device (and its cap) instead of falling back to the global cap.
pub fn same_uuid(cuda: &[u8], nvml: &[u8]) -> bool {
    fn hex(u: &[u8]) -> &[u8] {
        match u {
            [b'G', b'P', b'U', b'-', rest @ ..] | [b'M', b'I', b'G', b'-', rest @ ..] => rest,
            _ => u,
        }
    }
    let (a, b) = (hex(cuda), hex(nvml));
    !a.is_empty() && a.eq_ignore_ascii_case(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 1 << 30;

    #[test]
    fn the_cap_is_the_device() {
        assert_eq!(virtual_view(80 * G, 70 * G, 4 * G, G), (4 * G, 3 * G));
    }

    #[test]
    fn never_more_than_the_device_has() {
        // Others hold most of the GPU: free is what is physically free.
        assert_eq!(virtual_view(80 * G, G, 4 * G, 0), (4 * G, G));
        // A cap above the device: the device is the limit.
        assert_eq!(virtual_view(16 * G, 10 * G, 64 * G, 0), (16 * G, 10 * G));
    }

    #[test]
    fn past_the_cap_nothing_is_free() {
        // Graph memory is charged past the cap while the driver holds it.
        assert_eq!(virtual_view(80 * G, 70 * G, 4 * G, 5 * G), (4 * G, 0));
    }

    #[test]
    fn uncapped_is_physical() {
        assert_eq!(virtual_view(80 * G, 7, NO_LIMIT, 123), (80 * G, 7));
    }

    #[test]
    fn a_mig_instance_is_found_by_its_hex() {
        let cuda = b"GPU-5a1e6f7a-c0de-4000-8000-000000000001";
        assert!(same_uuid(cuda, b"GPU-5a1e6f7a-c0de-4000-8000-000000000001"));
        assert!(same_uuid(cuda, b"MIG-5a1e6f7a-c0de-4000-8000-000000000001"));
        assert!(!same_uuid(
            cuda,
            b"MIG-5a1e6f7a-c0de-4000-8000-000000000002"
        ));
        assert!(!same_uuid(b"", b""));
    }
}
