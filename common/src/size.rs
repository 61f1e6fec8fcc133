//! Parsing and printing of sizes, percentages and durations as users type
//! them on the command line and in the environment.
//!
//! Numbers are decimal only ("1.5", never "1e3", "0x10", "inf" or "nan") and
//! are scaled with integer arithmetic, so "1.5G" is exactly 1610612736 bytes
//! and no value is ever rounded up past what the user wrote.
//!
//! Every parser comes in two layers: a crate-private one that returns only the
//! problem ("unknown unit 'X'"), which the configuration module combines with
//! the variable name and its own example, and the public one, which appends an
//! example of a good value so that a CLI can print the message as is.

use std::fmt;

/// Good values for [`parse_size`], worded to follow "expected".
pub const SIZE_EXAMPLE: &str = "a size such as 4G, 512M, 1.5G or 4294967296";
/// Good values for [`parse_mem_limit`], worded to follow "expected".
pub const MEM_LIMIT_EXAMPLE: &str =
    "a size such as 4G, 512M, 1.5G, 4294967296 or a percentage such as 25%";
/// Good values for [`parse_percent`], worded to follow "expected".
pub const PERCENT_EXAMPLE: &str = "a percentage such as 30%, 12.5% or 100%";
/// Good values for [`parse_duration`], worded to follow "expected".
pub const DURATION_EXAMPLE: &str = "a duration such as 50ms, 2s, 1.5s, 10m, 1h or 1h30m";

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const TIB: u64 = 1 << 40;

/// All binary, as `docker --memory` reads them: users copy values between the
/// two and a "4GB" that meant 4_000_000_000 here would surprise them.
const SIZE_UNITS: &[(&str, u64)] = &[
    ("", 1),
    ("b", 1),
    ("k", KIB),
    ("ki", KIB),
    ("kib", KIB),
    ("kb", KIB),
    ("m", MIB),
    ("mi", MIB),
    ("mib", MIB),
    ("mb", MIB),
    ("g", GIB),
    ("gi", GIB),
    ("gib", GIB),
    ("gb", GIB),
    ("t", TIB),
    ("ti", TIB),
    ("tib", TIB),
    ("tb", TIB),
];

const NS_PER_US: u64 = 1_000;
const NS_PER_MS: u64 = 1_000_000;
const NS_PER_S: u64 = 1_000_000_000;
const NS_PER_MIN: u64 = 60 * NS_PER_S;
const NS_PER_H: u64 = 60 * NS_PER_MIN;
const NS_PER_D: u64 = 24 * NS_PER_H;

const DURATION_UNITS: &[(&str, u64)] = &[
    ("ns", 1),
    ("us", NS_PER_US),
    ("\u{b5}s", NS_PER_US),  // MICRO SIGN, what most keyboards produce
    ("\u{3bc}s", NS_PER_US), // GREEK SMALL LETTER MU, what some fonts suggest
    ("ms", NS_PER_MS),
    ("s", NS_PER_S),
    ("m", NS_PER_MIN),
    ("min", NS_PER_MIN),
    ("h", NS_PER_H),
    ("d", NS_PER_D),
];

/// The largest memory cap accepted: about a hundred times the memory of
/// the largest GPUs, so no real cap is refused and a slip of the unit is.
pub const MAX_MEM_LIMIT: u64 = 16 * TIB;

/// A memory cap as written in `GPU_MEM_LIMIT`; a percentage can only be
/// turned into bytes once the device's physical total is known.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MemLimit {
    None,
    Bytes(u64),
    Percent(f64),
}

impl MemLimit {
    /// The cap in bytes on a device with `physical_total` bytes, or `None`
    /// when uncapped.
    ///
    /// A percentage rounds down, so the cap never exceeds what was asked for.
    /// Values built by hand outside (0, 100] are clamped rather than trusted:
    /// NaN and anything at or below zero give a cap of 0 (fail closed), above
    /// 100 gives the whole device.
    pub fn resolve(&self, physical_total: u64) -> Option<u64> {
        match *self {
            MemLimit::None => None,
            MemLimit::Bytes(b) => Some(b),
            MemLimit::Percent(p) => {
                if p.is_nan() || p <= 0.0 {
                    return Some(0);
                }
                if p >= 100.0 {
                    return Some(physical_total);
                }
                // Multiplying before dividing keeps whole results exact (25% of
                // 80 GiB is exactly 20 GiB) where `total * (p / 100)` would not.
                let bytes = (physical_total as f64 * p / 100.0).floor();
                // `as` saturates; min() guards the f64 rounding of huge totals.
                Some((bytes as u64).min(physical_total))
            }
        }
    }
}

impl fmt::Display for MemLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            MemLimit::None => f.write_str("none"),
            MemLimit::Bytes(b) => f.write_str(&format_size(b)),
            MemLimit::Percent(p) => write!(f, "{p}%"),
        }
    }
}

/// Parses a byte size: "4G", "4GiB", "4GB", "512m", "1.5G", "4294967296",
/// "100K", "2T". Fractions round down to whole bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    size_problem(s)
        .map(|(bytes, _)| bytes)
        .map_err(|p| format!("{p}; expected {SIZE_EXAMPLE}"))
}

/// Parses the `GPU_MEM_LIMIT` syntax: empty or zero means no cap, "25%" is a
/// share of the device, anything else is a [`parse_size`] size.
pub fn parse_mem_limit(s: &str) -> Result<MemLimit, String> {
    mem_limit_problem(s).map_err(|p| format!("{p}; expected {MEM_LIMIT_EXAMPLE}"))
}

/// Parses a percentage in (0, 100], with or without the '%': "30%", "30",
/// "12.5%".
pub fn parse_percent(s: &str) -> Result<f64, String> {
    percent_problem(s).map_err(|p| format!("{p}; expected {PERCENT_EXAMPLE}"))
}

/// Parses a duration into nanoseconds: "50ms", "2s", "1.5s", "500us", "10m",
/// "1h", "100ns", "1d", and sums such as "1h30m" or "2m 30s". Units are
/// case-insensitive. A bare number is rejected because "30" could as well
/// mean seconds as milliseconds or minutes.
pub fn parse_duration(s: &str) -> Result<u64, String> {
    duration_problem(s).map_err(|p| format!("{p}; expected {DURATION_EXAMPLE}"))
}

/// Formats bytes for people: "1023 B", "512.00 MiB", "4.00 GiB". The
/// fraction is truncated, never rounded up, so a figure just under a limit
/// never prints as the limit itself.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < KIB {
        return format!("{bytes} B");
    }
    let mut shift = 10u32;
    let mut unit = UNITS[0];
    for (i, name) in UNITS.iter().enumerate().skip(1) {
        let s = 10 * (i as u32 + 1);
        if bytes >> s == 0 {
            break;
        }
        shift = s;
        unit = name;
    }
    let hundredths = (u128::from(bytes) * 100) >> shift;
    format!("{}.{:02} {unit}", hundredths / 100, hundredths % 100)
}

/// Bytes for a one-line message, formatted without allocating (the shim
/// prints it on its refusal path): like [`format_size`], with the fraction
/// left out when it is zero ("256 MiB", "4 GiB", "3.75 GiB", "1023 B").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Short(pub u64);

impl fmt::Display for Short {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
        let bytes = self.0;
        if bytes < KIB {
            return write!(f, "{bytes} B");
        }
        let mut shift = 10u32;
        let mut unit = UNITS[0];
        for (i, name) in UNITS.iter().enumerate().skip(1) {
            let s = 10 * (i as u32 + 1);
            if bytes >> s == 0 {
                break;
            }
            shift = s;
            unit = name;
        }
        let hundredths = (u128::from(bytes) * 100) >> shift;
        match hundredths % 100 {
            0 => write!(f, "{} {unit}", hundredths / 100),
            h => write!(f, "{}.{h:02} {unit}", hundredths / 100),
        }
    }
}

/// Bytes as a value to paste into a command line, which [`parse_size`]
/// reads back: the largest of T, G, M and K that fits, with at most two
/// decimals, truncated so that it never says more than `bytes` ("16G",
/// "39.25G", "512M", "1000"). Hints that suggest a `--gpu-memory` use it:
/// "16.00 GiB", pasted, would be two words.
pub fn format_size_arg(bytes: u64) -> String {
    const UNITS: [(u64, &str); 4] = [(TIB, "T"), (GIB, "G"), (MIB, "M"), (KIB, "K")];
    let Some(&(mult, unit)) = UNITS.iter().find(|(m, _)| bytes >= *m) else {
        return bytes.to_string();
    };
    let hundredths = u128::from(bytes) * 100 / u128::from(mult);
    let (whole, frac) = (hundredths / 100, hundredths % 100);
    match frac {
        0 => format!("{whole}{unit}"),
        f if f % 10 == 0 => format!("{whole}.{}{unit}", f / 10),
        f => format!("{whole}.{f:02}{unit}"),
    }
}

/// [`parse_size`] without the example. The flag is whether the number as
/// written is non-zero, so that callers can tell "0" (a deliberate "no cap")
/// from "0.1" (a tiny cap that rounds down to zero bytes).
pub(crate) fn size_problem(s: &str) -> Result<(u64, bool), String> {
    let s = s.trim();
    if s.is_empty() {
        return Err("empty value".into());
    }
    let (num, rest) = split_decimal(s)?;
    let unit = rest.trim_start();
    let mult =
        lookup(SIZE_UNITS, unit).ok_or_else(|| format!("unknown unit '{}'", excerpt(unit, 16)))?;
    let bytes = num.scale(mult).ok_or_else(|| {
        format!(
            "{} is too large: sizes are limited to just under 16 EiB ({} bytes)",
            excerpt(s, 32),
            u64::MAX
        )
    })?;
    Ok((bytes, num.nonzero))
}

pub(crate) fn mem_limit_problem(s: &str) -> Result<MemLimit, String> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(MemLimit::None);
    }
    if s.ends_with('%') {
        return percent_problem(s).map(MemLimit::Percent);
    }
    match size_problem(s)? {
        (_, false) => Ok(MemLimit::None),
        // A user who asked for a cap must never run uncapped, and a zero-byte
        // cap is surely not what they meant either.
        (0, true) => Err(format!(
            "{} rounds down to 0 bytes; use 0 or leave the variable unset for no cap",
            excerpt(s, 32)
        )),
        // A cap above the device's memory is the whole device, so a bigger
        // figure changes nothing there: a value beyond any GPU is a slip
        // (99999T for 99999M) that would silently cap nothing.
        (bytes, true) if bytes > MAX_MEM_LIMIT => Err(format!(
            "{} is more memory than any GPU has: a cap is at most {} (16T); \
             use 0 or leave the variable unset for no cap",
            excerpt(s, 32),
            format_size(MAX_MEM_LIMIT)
        )),
        (bytes, true) => Ok(MemLimit::Bytes(bytes)),
    }
}

pub(crate) fn percent_problem(s: &str) -> Result<f64, String> {
    let s = s.trim();
    let digits = s.strip_suffix('%').unwrap_or(s).trim_end();
    if digits.is_empty() {
        return Err("empty value".into());
    }
    let (num, rest) = split_decimal(digits)?;
    if !rest.is_empty() {
        return Err(format!(
            "unexpected '{}' after the number",
            excerpt(rest.trim_start(), 16)
        ));
    }
    // The grammar already checked gives only digits and one dot, which f64
    // parses; a failure can only mean something absurd, so report it.
    let value: f64 = digits
        .parse()
        .map_err(|_| format!("{} is not a number", excerpt(digits, 32)))?;
    if !num.nonzero {
        return Err("a percentage must be greater than 0".into());
    }
    if value > 100.0 {
        return Err(format!("{}% is above 100%", excerpt(digits, 32)));
    }
    // Hundreds of zeros after the point underflow f64 to 0.
    if value.is_nan() || value <= 0.0 {
        return Err(format!("{}% is too small", excerpt(digits, 32)));
    }
    Ok(value)
}

pub(crate) fn duration_problem(s: &str) -> Result<u64, String> {
    let s = s.trim();
    if s.is_empty() {
        return Err("empty value".into());
    }
    let mut rest = s;
    let mut total: u64 = 0;
    while !rest.is_empty() {
        let (num, after) = split_decimal(rest)?;
        let number = rest.get(..rest.len() - after.len()).unwrap_or(rest);
        let after = after.trim_start();
        let unit_len = after
            .find(|c: char| !c.is_alphabetic())
            .unwrap_or(after.len());
        let Some((unit, next)) = after.split_at_checked(unit_len) else {
            return Err("malformed duration".into());
        };
        if unit.is_empty() {
            let n = excerpt(number, 24);
            return Err(if rest.len() == s.len() && after.is_empty() {
                format!(
                    "a bare number has no unit; write {n}s for seconds, {n}ms for milliseconds or {n}m for minutes"
                )
            } else {
                format!("missing unit after {n}")
            });
        }
        let mult = lookup(DURATION_UNITS, unit)
            .ok_or_else(|| format!("unknown unit '{}'", excerpt(unit, 16)))?;
        total = num
            .scale(mult)
            .and_then(|ns| total.checked_add(ns))
            .ok_or_else(|| {
                format!(
                    "{} is too long: durations are limited to about 584 years",
                    excerpt(s, 32)
                )
            })?;
        rest = next.trim_start();
    }
    Ok(total)
}

/// Renders untrusted text for a one-line message: control characters and
/// quotes escaped, and cut short so a megabyte of garbage in a variable does
/// not become a megabyte of log.
pub(crate) fn excerpt(s: &str, max_chars: usize) -> String {
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i == max_chars {
            out.push('\u{2026}');
            break;
        }
        out.extend(c.escape_debug());
    }
    out
}

fn lookup(table: &[(&str, u64)], unit: &str) -> Option<u64> {
    table
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case(unit))
        .map(|&(_, mult)| mult)
}

/// An unsigned decimal as written, kept as digit strings so it can be scaled
/// exactly.
struct Decimal<'a> {
    int: &'a str,
    frac: &'a str,
    nonzero: bool,
}

impl Decimal<'_> {
    /// `self × mult`, rounded down, or `None` on overflow. `mult` must be at
    /// most `u64::MAX / 10` (all unit tables are far below that).
    fn scale(&self, mult: u64) -> Option<u64> {
        let mut int: u64 = 0;
        for b in self.int.bytes() {
            int = int
                .checked_mul(10)?
                .checked_add(u64::from(b.wrapping_sub(b'0')))?;
        }
        // Horner's scheme from the last digit: floor((a + floor(b)) / 10) ==
        // floor((a + b) / 10) for whole a, so flooring at each step still gives
        // the exact floor of the whole fraction however many digits it has,
        // with `acc` staying below `mult`.
        let mut acc: u64 = 0;
        for b in self.frac.bytes().rev() {
            let digit = u64::from(b.wrapping_sub(b'0'));
            acc = acc.checked_add(digit.checked_mul(mult)?)? / 10;
        }
        int.checked_mul(mult)?.checked_add(acc)
    }
}

/// Splits the leading unsigned decimal ("12", "1.5") off `s`, or says why
/// there is none.
fn split_decimal(s: &str) -> Result<(Decimal<'_>, &str), String> {
    let int_len = s.bytes().take_while(u8::is_ascii_digit).count();
    if int_len == 0 {
        return Err(match s.chars().next() {
            Some('-') => "negative values are not allowed".into(),
            Some('.') => "write a leading zero, as in 0.5".into(),
            _ => format!("{} does not start with a number", excerpt(s, 32)),
        });
    }
    let (int, mut rest) = s.split_at(int_len);
    let mut frac = "";
    if let Some(after_dot) = rest.strip_prefix('.') {
        let frac_len = after_dot.bytes().take_while(u8::is_ascii_digit).count();
        if frac_len == 0 {
            return Err(format!(
                "malformed number {}: no digits after the decimal point",
                excerpt(s, 32)
            ));
        }
        (frac, rest) = after_dot.split_at(frac_len);
    }
    if rest.starts_with('.') {
        return Err(format!("malformed number {}", excerpt(s, 32)));
    }
    let nonzero = int.bytes().chain(frac.bytes()).any(|b| b != b'0');
    Ok((Decimal { int, frac, nonzero }, rest))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn size(s: &str) -> u64 {
        parse_size(s).unwrap_or_else(|e| panic!("{s:?} rejected: {e}"))
    }

    fn size_err(s: &str) -> String {
        match parse_size(s) {
            Ok(v) => panic!("{s:?} accepted as {v}"),
            Err(e) => e,
        }
    }

    #[test]
    fn sizes_plain_bytes() {
        assert_eq!(size("0"), 0);
        assert_eq!(size("1"), 1);
        assert_eq!(size("4294967296"), 4 << 30);
        assert_eq!(size("  4294967296 \t\n"), 4 << 30);
        assert_eq!(size("18446744073709551615"), u64::MAX);
        assert_eq!(size("000000000000000000000000000001"), 1);
        assert_eq!(size("512B"), 512);
        assert_eq!(size("512b"), 512);
        assert_eq!(size("512 B"), 512);
    }

    #[test]
    fn sizes_every_unit_spelling_is_binary() {
        for (letter, mult) in [("k", KIB), ("m", MIB), ("g", GIB), ("t", TIB)] {
            for suffix in ["", "i", "ib", "b"] {
                let unit = format!("{letter}{suffix}");
                for spelled in [
                    unit.clone(),
                    unit.to_ascii_uppercase(),
                    format!("{}{}", letter.to_ascii_uppercase(), suffix),
                ] {
                    assert_eq!(size(&format!("3{spelled}")), 3 * mult, "3{spelled}");
                    assert_eq!(size(&format!("3 {spelled}")), 3 * mult, "3 {spelled}");
                }
            }
        }
    }

    #[test]
    fn sizes_from_the_spec() {
        assert_eq!(size("4G"), 4 * GIB);
        assert_eq!(size("4GiB"), 4 * GIB);
        assert_eq!(size("4GB"), 4 * GIB);
        assert_eq!(size("4g"), 4 * GIB);
        assert_eq!(size("512M"), 512 * MIB);
        assert_eq!(size("512MiB"), 512 * MIB);
        assert_eq!(size("1.5G"), 1_610_612_736);
        assert_eq!(size("100K"), 102_400);
        assert_eq!(size("2T"), 2 * TIB);
    }

    #[test]
    fn sizes_fractions_round_down_exactly() {
        assert_eq!(size("0.5K"), 512);
        assert_eq!(size("0.1K"), 102); // 102.4
        assert_eq!(size("0.9999B"), 0);
        assert_eq!(size("1.5"), 1);
        assert_eq!(
            size("1.999999999999999999999999999999999999999999G"),
            2 * GIB - 1
        );
        assert_eq!(size("0.000000000000000000000000000001T"), 0);
        // 1/1024 has an exact ten-digit expansion; many trailing digits must
        // not disturb it.
        assert_eq!(size("0.0009765625K"), 1);
        assert_eq!(size("0.00097656249999999999999999K"), 0);
        assert_eq!(size("0.000976562500000000000000001K"), 1);
        assert_eq!(size("16777215.999999999T"), u64::MAX - 1099); // 2^64 - 1100
    }

    #[test]
    fn sizes_overflow_is_rejected() {
        assert!(size_err("18446744073709551616").contains("too large"));
        assert!(size_err("16777216T").contains("too large"));
        assert!(size_err("99999999999999999999999999G").contains("too large"));
        assert!(size_err("17179869184G").contains("too large"));
    }

    #[test]
    fn sizes_garbage_is_rejected_with_examples() {
        for bad in [
            "", "   ", "G", "GiB", "4X", "4 G G", "1.2.3", "-1G", "-0", "+4G", "NaN", "nan", "inf",
            "1e9", "0x10", "4GG", "4GiBB", "4Gi B", ".5G", "5.G", "5.", "4\u{0}", "4P", "4E",
            "4KB/s", "1,5G", "1_000", "４G", "4g4", "%", "25%",
        ] {
            let e = size_err(bad);
            assert!(e.ends_with(SIZE_EXAMPLE), "{bad:?}: {e}");
        }
        assert!(size_err("4X").starts_with("unknown unit 'X'"));
        assert!(size_err("4 G G").starts_with("unknown unit 'G G'"));
        assert!(size_err("-1G").contains("negative"));
        assert!(size_err("").contains("empty"));
        assert!(size_err(".5G").contains("0.5"));
        assert!(size_err("1.2.3").contains("malformed"));
        assert!(size_err("5.G").contains("decimal point"));
        assert!(size_err("G").contains("does not start with a number"));
    }

    #[test]
    fn size_errors_are_one_line_and_short() {
        let e = size_err(&format!("4X{}Y", "\n".repeat(10_000)));
        assert!(!e.contains('\n'), "{e}");
        assert!(e.len() < 200, "{e}");
        let e = size_err("4\u{7}\"x");
        assert!(e.contains("\\u{7}\\\"x"), "{e}");
    }

    #[test]
    fn mem_limits() {
        let ok = |s: &str| parse_mem_limit(s).unwrap_or_else(|e| panic!("{s:?}: {e}"));
        assert_eq!(ok(""), MemLimit::None);
        assert_eq!(ok("  "), MemLimit::None);
        assert_eq!(ok("0"), MemLimit::None);
        assert_eq!(ok("0G"), MemLimit::None);
        assert_eq!(ok("0.0M"), MemLimit::None);
        assert_eq!(ok("000"), MemLimit::None);
        assert_eq!(ok("4G"), MemLimit::Bytes(4 * GIB));
        assert_eq!(ok(" 1.5g "), MemLimit::Bytes(1_610_612_736));
        assert_eq!(ok("1"), MemLimit::Bytes(1));
        assert_eq!(ok("25%"), MemLimit::Percent(25.0));
        assert_eq!(ok("25 %"), MemLimit::Percent(25.0));
        assert_eq!(ok("12.5%"), MemLimit::Percent(12.5));
        assert_eq!(ok("100%"), MemLimit::Percent(100.0));
        assert_eq!(ok("0.001%"), MemLimit::Percent(0.001));
    }

    #[test]
    fn mem_limits_rejected() {
        let err = |s: &str| match parse_mem_limit(s) {
            Ok(v) => panic!("{s:?} accepted as {v:?}"),
            Err(e) => {
                assert!(e.ends_with(MEM_LIMIT_EXAMPLE), "{e}");
                e
            }
        };
        assert!(err("4X").starts_with("unknown unit 'X'"));
        assert!(err("0%").contains("greater than 0"));
        assert!(err("0.0%").contains("greater than 0"));
        assert!(err("101%").contains("above 100"));
        assert!(err("100.0001%").contains("above 100"));
        assert!(err("-5%").contains("negative"));
        assert!(err("%").contains("empty"));
        assert!(err("25%%").contains("unexpected '%'"));
        assert!(err("0.5").contains("rounds down to 0 bytes"));
        assert!(err("0.0001K").contains("rounds down to 0 bytes"));
        for huge in ["99999T", "16.01T", "17592186044417", "16777215T"] {
            let e = err(huge);
            assert!(
                e.contains("more memory than any GPU") && e.contains("16.00 TiB"),
                "{e}"
            );
        }
        assert!(err("99999999999T").contains("too large"));
        assert_eq!(parse_mem_limit("16T"), Ok(MemLimit::Bytes(MAX_MEM_LIMIT)));
        for bad in [
            "G", "-1G", "1.2.3", "4 G G", "nan%", "inf", "25%G", "G25%", "1e2%",
        ] {
            err(bad);
        }
    }

    #[test]
    fn resolve_limits() {
        let total = 80 * GIB;
        assert_eq!(MemLimit::None.resolve(total), None);
        assert_eq!(MemLimit::Bytes(4 * GIB).resolve(total), Some(4 * GIB));
        // A byte cap above the device is kept: the view is min(cap, physical).
        assert_eq!(MemLimit::Bytes(200 * GIB).resolve(total), Some(200 * GIB));
        assert_eq!(MemLimit::Percent(25.0).resolve(total), Some(20 * GIB));
        assert_eq!(MemLimit::Percent(100.0).resolve(total), Some(total));
        assert_eq!(MemLimit::Percent(10.0).resolve(1000), Some(100));
        assert_eq!(MemLimit::Percent(33.3).resolve(1000), Some(333));
        assert_eq!(MemLimit::Percent(12.5).resolve(1001), Some(125)); // 125.125
        assert_eq!(MemLimit::Percent(50.0).resolve(u64::MAX), Some(1 << 63));
        assert!(MemLimit::Percent(99.9999).resolve(u64::MAX).is_some());
        assert_eq!(MemLimit::Percent(50.0).resolve(0), Some(0));
        // Hand-built nonsense fails closed or clamps; it never panics.
        assert_eq!(MemLimit::Percent(f64::NAN).resolve(total), Some(0));
        assert_eq!(MemLimit::Percent(-3.0).resolve(total), Some(0));
        assert_eq!(MemLimit::Percent(0.0).resolve(total), Some(0));
        assert_eq!(MemLimit::Percent(250.0).resolve(total), Some(total));
        assert_eq!(MemLimit::Percent(f64::INFINITY).resolve(total), Some(total));
    }

    #[test]
    fn mem_limit_display() {
        assert_eq!(MemLimit::None.to_string(), "none");
        assert_eq!(MemLimit::Bytes(4 * GIB).to_string(), "4.00 GiB");
        assert_eq!(MemLimit::Percent(12.5).to_string(), "12.5%");
    }

    #[test]
    fn percents() {
        let ok = |s: &str| parse_percent(s).unwrap_or_else(|e| panic!("{s:?}: {e}"));
        assert_eq!(ok("30%"), 30.0);
        assert_eq!(ok("30"), 30.0);
        assert_eq!(ok(" 30 % "), 30.0);
        assert_eq!(ok("12.5%"), 12.5);
        assert_eq!(ok("100"), 100.0);
        assert_eq!(ok("100.000%"), 100.0);
        assert_eq!(ok("0.01"), 0.01);
        assert_eq!(ok("007"), 7.0);
    }

    #[test]
    fn percents_rejected() {
        let err = |s: &str| match parse_percent(s) {
            Ok(v) => panic!("{s:?} accepted as {v}"),
            Err(e) => {
                assert!(e.ends_with(PERCENT_EXAMPLE), "{e}");
                e
            }
        };
        assert!(err("").contains("empty"));
        assert!(err("%").contains("empty"));
        assert!(err("0").contains("greater than 0"));
        assert!(err("0%").contains("greater than 0"));
        assert!(err("100.5%").contains("above 100"));
        assert!(err("1000000000000000000000000000000000000").contains("above 100"));
        assert!(err("-5").contains("negative"));
        assert!(err("30%%").contains("unexpected"));
        assert!(err("30 percent").contains("unexpected 'percent'"));
        let tiny = format!("0.{}1%", "0".repeat(400));
        assert!(err(&tiny).contains("too small"));
        for bad in [
            "nan", "NaN%", "inf", "1e1", "0x10", "30%x", "%30", "3 0", ".5", "5.", "1.2.3", "30G",
        ] {
            err(bad);
        }
    }

    #[test]
    fn durations() {
        let ok = |s: &str| parse_duration(s).unwrap_or_else(|e| panic!("{s:?}: {e}"));
        assert_eq!(ok("50ms"), 50 * NS_PER_MS);
        assert_eq!(ok("2s"), 2 * NS_PER_S);
        assert_eq!(ok("1.5s"), 1_500_000_000);
        assert_eq!(ok("500us"), 500_000);
        assert_eq!(ok("500\u{b5}s"), 500_000);
        assert_eq!(ok("500\u{3bc}s"), 500_000);
        assert_eq!(ok("10m"), 600 * NS_PER_S);
        assert_eq!(ok("10min"), 600 * NS_PER_S);
        assert_eq!(ok("1h"), 3600 * NS_PER_S);
        assert_eq!(ok("1d"), 86_400 * NS_PER_S);
        assert_eq!(ok("100ns"), 100);
        assert_eq!(ok("0s"), 0);
        assert_eq!(ok(" 2S "), 2 * NS_PER_S);
        assert_eq!(ok("50MS"), 50 * NS_PER_MS);
        assert_eq!(ok("2 s"), 2 * NS_PER_S);
        assert_eq!(ok("1h30m"), 5400 * NS_PER_S);
        assert_eq!(ok("2m 30s"), 150 * NS_PER_S);
        assert_eq!(ok("1.5ns"), 1);
        assert_eq!(ok("0.1h"), 360 * NS_PER_S);
        assert_eq!(ok("18446744073709551615ns"), u64::MAX);
    }

    #[test]
    fn durations_rejected() {
        let err = |s: &str| match parse_duration(s) {
            Ok(v) => panic!("{s:?} accepted as {v}"),
            Err(e) => {
                assert!(e.ends_with(DURATION_EXAMPLE), "{e}");
                e
            }
        };
        let bare = err("30");
        assert!(
            bare.contains("bare number") && bare.contains("30s"),
            "{bare}"
        );
        assert!(err("1.5").contains("1.5s"));
        assert!(err("1h30").contains("missing unit after 30"));
        assert!(err("5x").contains("unknown unit 'x'"));
        assert!(err("5 parsecs").contains("unknown unit 'parsecs'"));
        assert!(err("-1s").contains("negative"));
        assert!(err("").contains("empty"));
        assert!(err("18446744073709551616ns").contains("too long"));
        assert!(err("584555d").contains("too long"));
        assert!(err("18446744073709551615ns1ns").contains("too long"));
        for bad in [
            "s", "ms", "1.2.3s", "1e3ms", "nan", "inf", ".5s", "5.s", "1h-30m", "1h,30m", "1s!",
        ] {
            err(bad);
        }
    }

    #[test]
    fn format_sizes() {
        assert_eq!(format_size(0), "0 B");
        assert_eq!(format_size(1023), "1023 B");
        assert_eq!(format_size(1024), "1.00 KiB");
        assert_eq!(format_size(1536), "1.50 KiB");
        assert_eq!(format_size(512 * MIB), "512.00 MiB");
        assert_eq!(format_size(4 * GIB), "4.00 GiB");
        assert_eq!(format_size(GIB - 1), "1023.99 MiB");
        assert_eq!(format_size(1_610_612_736), "1.50 GiB");
        assert_eq!(format_size(2 * TIB), "2.00 TiB");
        assert_eq!(format_size(1 << 50), "1.00 PiB");
        assert_eq!(format_size(u64::MAX), "15.99 EiB");
    }

    #[test]
    fn short_sizes() {
        let short = |b| Short(b).to_string();
        assert_eq!(short(0), "0 B");
        assert_eq!(short(1023), "1023 B");
        assert_eq!(short(256 * MIB), "256 MiB");
        assert_eq!(short(4 * GIB), "4 GiB");
        assert_eq!(short(3 * GIB + 768 * MIB), "3.75 GiB");
        assert_eq!(short(GIB - 1), "1023.99 MiB");
        assert_eq!(short(512 * 1024), "512 KiB");
    }

    #[test]
    fn size_args_paste_back() {
        assert_eq!(format_size_arg(0), "0");
        assert_eq!(format_size_arg(1023), "1023");
        assert_eq!(format_size_arg(1024), "1K");
        assert_eq!(format_size_arg(512 * MIB), "512M");
        assert_eq!(format_size_arg(16 * GIB), "16G");
        assert_eq!(format_size_arg(40192 * MIB), "39.25G");
        assert_eq!(format_size_arg(1_610_612_736), "1.5G");
        assert_eq!(format_size_arg(GIB - 1), "1023.99M");
        assert_eq!(format_size_arg(3 * TIB), "3T");
        assert_eq!(format_size_arg(u64::MAX), "16777215.99T");
    }

    proptest! {
        #[test]
        fn parsers_never_panic(s in any::<String>()) {
            let _ = parse_size(&s);
            let _ = parse_mem_limit(&s);
            let _ = parse_percent(&s);
            let _ = parse_duration(&s);
        }

        #[test]
        fn parsers_never_panic_on_near_misses(s in "[ 0-9.%kKmMgGtTiIbBnsuhd\u{b5}-]{0,24}") {
            let _ = parse_size(&s);
            let _ = parse_mem_limit(&s);
            let _ = parse_percent(&s);
            let _ = parse_duration(&s);
        }

        #[test]
        fn short_sizes_are_format_size_without_a_zero_fraction(n in any::<u64>()) {
            let long = format_size(n);
            prop_assert_eq!(Short(n).to_string(), long.replacen(".00 ", " ", 1));
        }

        #[test]
        fn whole_sizes_round_trip(n in any::<u64>()) {
            prop_assert_eq!(parse_size(&n.to_string()), Ok(n));
        }

        #[test]
        fn scaled_sizes_match_integer_maths(n in 0u64..(1 << 24), frac in 0u64..1000) {
            // n.frac G rounds down to (n*1000 + frac) * 2^30 / 1000.
            let got = size(&format!("{n}.{frac:03}G"));
            let want = (u128::from(n * 1000 + frac) << 30) / 1000;
            prop_assert_eq!(u128::from(got), want);
        }

        #[test]
        fn format_is_never_above_the_value(n in any::<u64>()) {
            let text = format_size(n);
            let (num, unit) = text.split_once(' ').unwrap();
            let mult = match unit {
                "B" => 1u128, "KiB" => 1 << 10, "MiB" => 1 << 20, "GiB" => 1 << 30,
                "TiB" => 1 << 40, "PiB" => 1 << 50, "EiB" => 1 << 60,
                other => panic!("unit {other}"),
            };
            let (whole, hundredths) = num.split_once('.').unwrap_or((num, "0"));
            let shown = whole.parse::<u128>().unwrap() * 100 + hundredths.parse::<u128>().unwrap();
            prop_assert!(shown * mult <= u128::from(n) * 100);
            prop_assert!((shown + 1) * mult > u128::from(n) * 100);
            prop_assert!(whole.parse::<u128>().unwrap() < 1024);
        }

        #[test]
        fn size_args_parse_back_to_at_most_the_value(n in any::<u64>()) {
            let text = format_size_arg(n);
            prop_assert!(!text.contains(' '), "{}", text);
            let back = parse_size(&text).unwrap();
            prop_assert!(back <= n, "{} reads back as {} > {}", text, back, n);
            // Two decimals of the largest unit that fits: within 1%.
            prop_assert!(u128::from(back) * 100 >= u128::from(n) * 99, "{} for {}", text, n);
        }
    }
}
