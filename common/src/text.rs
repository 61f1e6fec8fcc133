//! Text a user chose, made safe to show: in a terminal, a log line, a
//! metric label or a dashboard. One rule for every place ([`is_hidden`]):
//! control characters, and the format characters that change what a
//! terminal shows without being seen (bidirectional overrides and
//! isolates that reorder a line, zero-width characters that hide in a
//! name, the rest of Unicode's general category Cf), and the line and
//! paragraph separators, are never shown raw.
//!
//! Two spellings of it: [`clip`] for what the broker keeps of what a user
//! sends (escaped so that it reads back unambiguously: a backslash is
//! doubled, and bounded in work), and [`shown`] for what a client puts on
//! a terminal (text the broker already keeps escaped shows as it is kept;
//! what is still hidden is escaped the same way).

/// Characters that must never reach a terminal, a log, a label or a
/// dashboard as they are: controls (Cc), format characters (Cf, as of
/// Unicode 16: among them the bidirectional controls U+202A–U+202E,
/// U+2066–U+2069, U+200E/U+200F and U+061C, the zero-width U+200B–U+200D,
/// U+2060 and U+FEFF, the soft hyphen, and the tag characters), and the
/// line and paragraph separators U+2028 and U+2029 (Zl, Zp), which some
/// viewers take for line breaks.
pub fn is_hidden(c: char) -> bool {
    c.is_control() || matches!(c, '\u{2028}' | '\u{2029}') || is_format(c)
}

/// Unicode's general category Cf (format characters), as of Unicode 16.
fn is_format(c: char) -> bool {
    matches!(
        c as u32,
        0x00AD
            | 0x0600..=0x0605
            | 0x061C
            | 0x06DD
            | 0x070F
            | 0x0890..=0x0891
            | 0x08E2
            | 0x180E
            | 0x200B..=0x200F
            | 0x202A..=0x202E
            | 0x2060..=0x2064
            | 0x2066..=0x206F
            | 0xFEFF
            | 0xFFF9..=0xFFFB
            | 0x110BD
            | 0x110CD
            | 0x13430..=0x1343F
            | 0x1BCA0..=0x1BCA3
            | 0x1D173..=0x1D17A
            | 0xE0001
            | 0xE0020..=0xE007F
    )
}

/// `c` as every escaping here spells a hidden character: `\u{NNNN}`.
pub fn push_code(out: &mut String, c: char) {
    use std::fmt::Write;
    let _ = write!(out, "\\u{{{:04x}}}", c as u32);
}

/// `s` as a client shows it on a terminal: controls become spaces (a
/// command line may hold newlines; a table stays a table), every other
/// hidden character `\u{NNNN}`, the rest as it is. Borrowed when there
/// is nothing to change.
pub fn shown(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(is_hidden) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if c.is_control() {
            out.push(' ');
        } else if is_hidden(c) {
            push_code(&mut out, c);
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// `s` escaped, and cut to at most `max` bytes, with an ellipsis when cut:
/// what a user sends is kept, shown and logged only in this form. The
/// escaping stops at the limit: it reads at most `max + 1` characters of
/// `s`, whatever its length (64 KiB of control characters once cost a
/// `Name` frame 256 KiB of escapes, each a small allocation, before the
/// cut), and it never cuts an escape in two. Returns the text and the
/// bytes of `s` it read (the work it did).
pub fn clip_counted(s: &str, max: usize) -> (String, usize) {
    let keep = max.saturating_sub('…'.len_utf8());
    let mut out = String::with_capacity(s.len().min(max));
    // `out`'s length after the last escape that left room for the
    // ellipsis: where a cut goes.
    let mut cut = 0;
    for (at, c) in s.char_indices() {
        push_escaped(&mut out, c);
        if out.len() > max {
            out.truncate(cut);
            out.push('…');
            return (out, at + c.len_utf8());
        }
        if out.len() <= keep {
            cut = out.len();
        }
    }
    (out, s.len())
}

/// `clip_counted`'s text.
pub fn clip(s: &str, max: usize) -> String {
    clip_counted(s, max).0
}

/// `c` as kept in what a user sends: newline, carriage return and tab
/// become the two characters `\n`, `\r`, `\t`; other ASCII controls and
/// DEL `\xNN`; every other character [`is_hidden`] names (C1 controls,
/// bidirectional controls, zero-width and other format characters, line
/// and paragraph separators) `\u{NNNN}`; a backslash is doubled, so that
/// an escape cannot be typed in. Nothing in the result can forge or
/// disguise a line of a log or of status (SECURITY.md, invariant 6).
fn push_escaped(out: &mut String, c: char) {
    use std::fmt::Write;
    match c {
        '\\' => out.push_str("\\\\"),
        '\n' => out.push_str("\\n"),
        '\r' => out.push_str("\\r"),
        '\t' => out.push_str("\\t"),
        c if c.is_ascii_control() => {
            let _ = write!(out, "\\x{:02x}", c as u32);
        }
        c if needs_escape(c) => push_code(out, c),
        c => out.push(c),
    }
}

fn needs_escape(c: char) -> bool {
    c == '\\' || is_hidden(c)
}

/// A field a user chose (a command, a label, a pod's name), already
/// clipped, as a log line shows it: in double quotes, a quote inside as
/// `\"`. A structured log line then reads as its fields: `uid=0 pid=1` in
/// an argv stays inside the command's quotes (clipped text holds no
/// control character, and its backslashes are doubled, so the quoting
/// cannot be undone from inside).
pub struct Quoted<'a>(pub &'a str);

impl std::fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use std::fmt::Write;
        f.write_char('"')?;
        for (i, part) in self.0.split('"').enumerate() {
            if i > 0 {
                f.write_str("\\\"")?;
            }
            f.write_str(part)?;
        }
        f.write_char('"')
    }
}

impl std::fmt::Debug for Quoted<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn escape(s: &str) -> String {
        clip(s, usize::MAX)
    }

    #[test]
    fn escaped_text_holds_no_control_character() {
        assert_eq!(escape("python train.py"), "python train.py");
        assert_eq!(
            escape("a\nINFO forged\r\t\\x\u{1b}[31m\u{7f}"),
            "a\\nINFO forged\\r\\t\\\\x\\x1b[31m\\x7f"
        );
        assert_eq!(escape("\u{202e}gpj.exe\u{85}"), "\\u{202e}gpj.exe\\u{0085}");
        assert_eq!(escape("é ü 日本"), "é ü 日本");
        // Clipping never cuts an escape into a control character, nor in
        // two.
        let c = clip(&"\n".repeat(300), 256);
        assert!(c.len() <= 256 && !c.contains('\n'), "{c}");
        assert_eq!(c, format!("{}…", "\\n".repeat(126)));
        let c = clip(&"\u{1}".repeat(300), 16);
        assert_eq!(c, "\\x01\\x01\\x01…");
    }

    /// The attack: a `Name` of 64 KiB of control characters was escaped
    /// whole (256 KiB of escapes, a small allocation each) and then cut to
    /// 256 bytes. The escaping now stops at its output limit.
    #[test]
    fn escaping_reads_no_further_than_its_output_limit() {
        for big in [
            "\u{1}".repeat(64 << 10),
            "x".repeat(2 << 20),
            "é".repeat(1 << 20),
        ] {
            let (text, read) = clip_counted(&big, 256);
            assert!(text.len() <= 256, "{}", text.len());
            assert!(read <= 257 * 2, "read {read} bytes of {}", big.len());
        }
        assert_eq!(clip_counted("short", 256), ("short".into(), 5));
    }

    #[test]
    fn quoted_fields_keep_to_their_quotes() {
        assert_eq!(Quoted("python x").to_string(), "\"python x\"");
        let q = Quoted(&clip("a\" uid=0 pid=1 \\\"", 256)).to_string();
        assert_eq!(q, "\"a\\\" uid=0 pid=1 \\\\\\\"\"");
    }

    #[test]
    fn clipped_labels_stay_within_their_budget() {
        assert_eq!(clip("short", 256), "short");
        let long = "é".repeat(1000);
        let c = clip(&long, 256);
        assert!(c.len() <= 256 && c.ends_with('…'), "{}", c.len());
    }

    /// The review's planted name: a right-to-left override in a cgroup
    /// name reversed the rest of root's `top` line. Every kind of hidden
    /// character the review named is escaped by both spellings.
    #[test]
    fn format_characters_are_escaped_too() {
        for c in [
            '\u{202a}',
            '\u{202e}',
            '\u{2066}',
            '\u{2069}',
            '\u{200e}',
            '\u{200f}',
            '\u{200b}',
            '\u{200d}',
            '\u{2060}',
            '\u{feff}',
            '\u{ad}',
            '\u{61c}',
            '\u{2028}',
            '\u{e0041}',
        ] {
            let s = format!("job_4242{c}LIVE");
            let want = format!("job_4242\\u{{{:04x}}}LIVE", c as u32);
            assert_eq!(escape(&s), want, "{:x}", c as u32);
            assert_eq!(shown(&s), want, "{:x}", c as u32);
        }
        assert_eq!(shown("a\nb\\n é"), "a b\\n é");
        assert!(matches!(
            shown("plain é 日本"),
            std::borrow::Cow::Borrowed(_)
        ));
    }

    /// The table against Unicode's own (Python's unicodedata, when there
    /// is a python3): every Cf character it knows is hidden here.
    #[test]
    fn every_format_character_python_knows_is_hidden() {
        let o = std::process::Command::new("python3")
            .args([
                "-c",
                "import sys, unicodedata as u\n\
                 print(u.unidata_version)\n\
                 print(' '.join('%x' % c for c in range(sys.maxunicode + 1) \
                 if u.category(chr(c)) == 'Cf'))",
            ])
            .output();
        let Some(o) = o.ok().filter(|o| o.status.success()) else {
            eprintln!("skipped: no python3 to read Unicode's categories from");
            return;
        };
        let text = String::from_utf8(o.stdout).unwrap();
        let mut lines = text.lines();
        let version = lines.next().unwrap_or_default();
        let missing: Vec<&str> = lines
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .filter(|h| !is_hidden(char::from_u32(u32::from_str_radix(h, 16).unwrap()).unwrap()))
            .collect();
        assert!(
            missing.is_empty(),
            "format characters of Unicode {version} not hidden: {missing:?}"
        );
    }
}
