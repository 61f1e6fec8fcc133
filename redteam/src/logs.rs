//! The broker's log as an administrator reads it: every event at `info`
//! and above, captured on this thread, rendered as the broker's own
//! subscriber (tracing-subscriber's default format) writes it, and read
//! back as a log collector parsing `key=value` fields would. From it the
//! harness counts the lines a user caused, the lines said on a user's
//! behalf that went missing, the broker's own warnings, and lines whose
//! fields a user's text forged.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::Layer;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::{Context, SubscriberExt};

use crate::work;

thread_local! {
    static WRITTEN: Cell<u64> = const { Cell::new(0) };
}

/// Lines this thread's broker has written so far (each costs work).
pub fn lines_written() -> u64 {
    WRITTEN.with(Cell::get)
}

/// What a user's text says to forge the fields of a line that shows it:
/// the fields that name who did what.
pub const FORGING: &str = "uid=0 pid=1 job=root";

/// The keys `FORGING` would put in a line that shows it unquoted.
fn forgeable(key: &str) -> bool {
    FORGING
        .split(' ')
        .filter_map(|kv| kv.split_once('='))
        .any(|(k, _)| k == key)
}

/// One line of the log.
#[derive(Clone, Debug)]
pub struct Line {
    pub level: Level,
    pub message: String,
    /// The event's fields but the message, as the subscriber renders
    /// each value.
    pub fields: Vec<(String, String)>,
    /// The whole line as written.
    pub text: String,
}

#[derive(Default)]
struct Fields {
    message: String,
    fields: Vec<(String, String)>,
}

impl Visit for Fields {
    // As tracing-subscriber's default format: a string field quoted (its
    // Debug form), anything else (a `%value` among them) as it formats.
    fn record_str(&mut self, field: &Field, value: &str) {
        self.record_debug(field, &value);
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            self.fields
                .push((field.name().to_owned(), format!("{value:?}")));
        }
    }
}

struct Capture(Arc<Mutex<Vec<Line>>>);

impl<S: Subscriber> Layer<S> for Capture {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        work::paused(|| {
            let mut f = Fields::default();
            event.record(&mut f);
            let meta = event.metadata();
            let mut text = format!("{} {}: {}", meta.level(), meta.target(), f.message);
            for (k, v) in &f.fields {
                let _ = write!(text, " {k}={v}");
            }
            let line = Line {
                level: *meta.level(),
                message: f.message,
                fields: f.fields,
                text,
            };
            if let Ok(mut lines) = self.0.lock() {
                lines.push(line);
            }
        });
        WRITTEN.with(|w| w.set(w.get() + 1));
    }
}

/// Runs `f` with this thread's log captured; the lines it wrote.
pub fn capture<R>(f: impl FnOnce() -> R) -> (R, Vec<Line>) {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let sub =
        tracing_subscriber::registry().with(Capture(lines.clone()).with_filter(LevelFilter::INFO));
    let r = tracing::subscriber::with_default(sub, f);
    let lines = std::mem::take(&mut *lines.lock().unwrap_or_else(|e| e.into_inner()));
    (r, lines)
}

impl Line {
    /// The uids and pids the line names: its `uid` and `pid` fields, and
    /// "uid N", "user N" and "pid N" in its message.
    pub fn names(&self) -> (Vec<u32>, Vec<u32>) {
        let (mut uids, mut pids) = (Vec::new(), Vec::new());
        for (k, v) in &self.fields {
            if let Ok(n) = v.parse::<u32>() {
                match k.as_str() {
                    "uid" => uids.push(n),
                    "pid" => pids.push(n),
                    _ => {}
                }
            }
        }
        let words: Vec<&str> = self
            .message
            .split(|c: char| !c.is_ascii_alphanumeric())
            .filter(|w| !w.is_empty())
            .collect();
        for w in words.windows(2) {
            if let Ok(n) = w[1].parse::<u32>() {
                match w[0] {
                    "uid" | "user" => uids.push(n),
                    "pid" => pids.push(n),
                    _ => {}
                }
            }
        }
        (uids, pids)
    }

    /// Whether the line, read back as `key=value` fields (quotes kept
    /// together, as logfmt readers do), says something else than the
    /// event did: a field a user's text is shaped to forge (`FORGING`)
    /// that the event did not have, or had fewer times, or a line broken
    /// in two. (The broker's own words may hold a `key=value`, as
    /// "run it with GPUFRAC_BROKER=off" does: no user wrote that.)
    pub fn forged(&self) -> bool {
        if self.text.contains(['\n', '\r']) {
            return true;
        }
        let mut said: BTreeMap<&str, usize> = BTreeMap::new();
        for (k, _) in &self.fields {
            *said.entry(k.as_str()).or_default() += 1;
        }
        let mut read: BTreeMap<String, usize> = BTreeMap::new();
        for token in logfmt_tokens(&self.text) {
            if let Some((k, _)) = token.split_once('=')
                && forgeable(k)
            {
                *read.entry(k.to_owned()).or_default() += 1;
            }
        }
        read.iter()
            .any(|(k, &n)| n > said.get(k.as_str()).copied().unwrap_or(0))
    }
}

/// Whitespace-separated tokens, a double-quoted run (with `\"` escapes)
/// kept in one.
fn logfmt_tokens(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let (mut quoted, mut escaped) = (false, false);
    for c in s.chars() {
        if quoted {
            cur.push(c);
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                quoted = false;
            }
        } else if c.is_whitespace() {
            if !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
        } else {
            if c == '"' {
                quoted = true;
            }
            cur.push(c);
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_field_of_text_shaped_like_fields_is_a_forged_line_unless_quoted() {
        let ((), lines) = capture(|| {
            let command = "python3 x uid=0 pid=1";
            tracing::info!(pid = 7, uid = 1000, command = %command, "registered");
            tracing::info!(pid = 7, uid = 1000, command, "registered");
            tracing::warn!("refusing a connection from uid 65534 (pid 12)");
            tracing::warn!("refused; run it with GPUFRAC_BROKER=off");
            tracing::info!(pid = 7, "label \"a\nb\"");
            tracing::debug!("not captured");
        });
        assert_eq!(lines.len(), 5);
        assert!(!lines[3].forged(), "{}", lines[3].text);
        assert!(lines[4].forged(), "{}", lines[4].text);
        assert!(lines[0].forged(), "{}", lines[0].text);
        assert!(!lines[1].forged(), "{}", lines[1].text);
        assert!(!lines[2].forged());
        assert_eq!(lines[0].names(), (vec![1000], vec![7]));
        assert_eq!(lines[2].names(), (vec![65534], vec![12]));
        assert_eq!(lines_written(), 5);
    }
}
