//! Kubernetes quantities (`4Gi`, `30`, `1.5G`, `500m`, `2e3`) as the
//! plugin reads them from a claim's `consumedCapacity` and writes them into
//! a ResourceSlice. A leaf: no I/O, no other room.
//!
//! `G` is 10⁹ here and `Gi` 2³⁰, as Kubernetes has it: not the shim's
//! `GPU_MEM_LIMIT`, where both are binary, so a quantity is never handed
//! to the shim as text, only as the bytes it comes to.

/// A quantity's value: `digits × 10^exp10 × 2^exp2`, exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Exact {
    digits: u128,
    exp10: i32,
    exp2: u32,
}

const EXAMPLE: &str = "a Kubernetes quantity such as 4Gi, 4096Mi, 30 or 1.5G";

fn parse_exact(s: &str) -> Result<Exact, String> {
    let bad = |why: &str| format!("{s:?} is not a quantity ({why}); expected {EXAMPLE}");
    let t = s.trim();
    let t = t.strip_prefix('+').unwrap_or(t);
    if t.starts_with('-') {
        return Err(bad("negative"));
    }
    let end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, suffix) = t.split_at(end);
    let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && frac.is_empty() {
        return Err(bad("no digits"));
    }
    if frac.contains('.') {
        return Err(bad("two decimal points"));
    }
    let mut digits: u128 = 0;
    for c in whole.bytes().chain(frac.bytes()) {
        digits = digits
            .checked_mul(10)
            .and_then(|d| d.checked_add(u128::from(c - b'0')))
            .ok_or_else(|| bad("too many digits"))?;
    }
    let mut exp10 = -i32::try_from(frac.len()).map_err(|_| bad("too many digits"))?;
    let mut exp2 = 0;
    match suffix {
        "" => {}
        "Ki" => exp2 = 10,
        "Mi" => exp2 = 20,
        "Gi" => exp2 = 30,
        "Ti" => exp2 = 40,
        "Pi" => exp2 = 50,
        "Ei" => exp2 = 60,
        "n" => exp10 -= 9,
        "u" => exp10 -= 6,
        "m" => exp10 -= 3,
        "k" => exp10 += 3,
        "M" => exp10 += 6,
        "G" => exp10 += 9,
        "T" => exp10 += 12,
        "P" => exp10 += 15,
        "E" => exp10 += 18,
        e if e.starts_with(['e', 'E']) => {
            let n: i32 = e[1..]
                .strip_prefix('+')
                .unwrap_or(&e[1..])
                .parse()
                .map_err(|_| bad("an exponent that is not a number"))?;
            if n.abs() > 40 {
                return Err(bad("an exponent out of range"));
            }
            exp10 += n;
        }
        _ => return Err(bad(&format!("unknown suffix {suffix:?}"))),
    }
    Ok(Exact {
        digits,
        exp10,
        exp2,
    })
}

/// The quantity as a whole number, rounded up as Kubernetes' `Value()`
/// rounds it; None past u64.
pub fn parse_ceil(s: &str) -> Result<u64, String> {
    let q = parse_exact(s)?;
    let too_large = || format!("{s:?} is too large a quantity; expected {EXAMPLE}");
    let mut n = q.digits;
    if q.exp2 > 0 {
        n = n
            .checked_shl(q.exp2)
            .filter(|v| v >> q.exp2 == n)
            .ok_or_else(too_large)?;
    }
    if q.exp10 >= 0 {
        for _ in 0..q.exp10 {
            n = n.checked_mul(10).ok_or_else(too_large)?;
        }
    } else {
        let mut div: u128 = 1;
        for _ in 0..(-q.exp10) {
            match div.checked_mul(10) {
                Some(d) => div = d,
                // Past 10^38 any value we can hold rounds up to 1.
                None => return Ok(u64::from(n > 0)),
            }
        }
        n = n.div_ceil(div);
    }
    u64::try_from(n).map_err(|_| too_large())
}

/// The quantity as a number, for percentages (`30`, `12.5`).
pub fn parse_f64(s: &str) -> Result<f64, String> {
    let q = parse_exact(s)?;
    Ok(q.digits as f64 * 10f64.powi(q.exp10) * 2f64.powi(q.exp2 as i32))
}

/// Bytes as Kubernetes writes them: `16Gi`, `512Mi`, or plain bytes.
pub fn format_bytes(bytes: u64) -> String {
    for (suffix, shift) in [
        ("Ei", 60),
        ("Pi", 50),
        ("Ti", 40),
        ("Gi", 30),
        ("Mi", 20),
        ("Ki", 10),
    ] {
        if bytes != 0 && bytes.trailing_zeros() >= shift {
            return format!("{}{suffix}", bytes >> shift);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_as_kubernetes_reads_them() {
        assert_eq!(parse_ceil("4Gi"), Ok(4 << 30));
        assert_eq!(parse_ceil("4096Mi"), Ok(4 << 30));
        assert_eq!(parse_ceil("4G"), Ok(4_000_000_000), "G is decimal");
        assert_eq!(parse_ceil("1.5Gi"), Ok(3 << 29));
        assert_eq!(parse_ceil("4294967296"), Ok(4 << 30));
        assert_eq!(parse_ceil("30"), Ok(30));
        assert_eq!(parse_ceil("+30"), Ok(30));
        assert_eq!(parse_ceil("2e3"), Ok(2000));
        assert_eq!(parse_ceil("2E+3"), Ok(2000));
        assert_eq!(parse_ceil("1500m"), Ok(2), "rounded up, as Value() does");
        assert_eq!(parse_ceil("0.1"), Ok(1));
        assert_eq!(parse_ceil("0"), Ok(0));
        assert_eq!(parse_ceil(".5"), Ok(1));
        assert_eq!(parse_ceil("1e-30"), Ok(1));
        assert_eq!(parse_ceil("0.000000000000000000001e-30"), Ok(1));
        assert!((parse_f64("12.5").unwrap() - 12.5).abs() < 1e-9);
        assert!((parse_f64("300m").unwrap() - 0.3).abs() < 1e-9);
        for bad in [
            "", "Gi", "-4Gi", "4GB", "4 Gi", "1.2.3", "4x", "1e", "1e999",
        ] {
            let e = parse_ceil(bad).unwrap_err();
            assert!(e.contains("4Gi, 4096Mi, 30 or 1.5G"), "{bad}: {e}");
        }
        assert!(parse_ceil("16Ei").unwrap_err().contains("too large"));
    }

    #[test]
    fn bytes_as_kubernetes_writes_them() {
        assert_eq!(format_bytes(16 << 30), "16Gi");
        assert_eq!(format_bytes(256 << 20), "256Mi");
        assert_eq!(format_bytes((16 << 30) + (1 << 20)), "16385Mi");
        assert_eq!(format_bytes(1000), "1000");
        assert_eq!(format_bytes(0), "0");
        for b in [0, 1000, 256 << 20, 85_031_714_816, 16 << 30] {
            assert_eq!(parse_ceil(&format_bytes(b)), Ok(b));
        }
    }
}
