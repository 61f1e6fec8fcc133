//! The Prometheus text format (version 0.0.4): each family once, with its
//! HELP and TYPE, its samples after, label values escaped. Samples with
//! the same labels are summed, which is how series past a label's bound
//! fold into one (`user="other"`).

use std::collections::BTreeMap;
use std::fmt::Write;

use crate::stats::Histogram;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Gauge,
    Counter,
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Gauge => "gauge",
            Kind::Counter => "counter",
            Kind::Histogram => "histogram",
        }
    }
}

/// Label names and values, in the order written.
pub type Labels = Vec<(&'static str, String)>;

pub struct Family {
    pub name: String,
    kind: Kind,
    help: String,
    samples: BTreeMap<Labels, f64>,
    histograms: Vec<(Labels, Histogram)>,
}

impl Family {
    pub fn new(name: impl Into<String>, kind: Kind, help: impl Into<String>) -> Family {
        Family {
            name: name.into(),
            kind,
            help: help.into(),
            samples: BTreeMap::new(),
            histograms: Vec::new(),
        }
    }

    /// Adds `v` to the sample with these labels.
    pub fn add(&mut self, labels: Labels, v: f64) {
        *self.samples.entry(labels).or_insert(0.0) += v;
    }

    pub fn histogram(&mut self, labels: Labels, h: &Histogram) {
        self.histograms.push((labels, h.clone()));
    }

    pub fn write(&self, o: &mut String) {
        let (name, kind) = (self.name.as_str(), self.kind.as_str());
        let _ = writeln!(o, "# HELP {name} {}", self.help);
        let _ = writeln!(o, "# TYPE {name} {kind}");
        for (labels, v) in &self.samples {
            sample(o, name, labels, None, *v);
        }
        for (labels, h) in &self.histograms {
            let bucket = format!("{name}_bucket");
            for (le, n) in h.buckets() {
                sample(o, &bucket, labels, Some(&seconds(le)), n as f64);
            }
            sample(o, &bucket, labels, Some("+Inf"), h.count() as f64);
            sample(o, &format!("{name}_sum"), labels, None, h.sum_seconds());
            sample(o, &format!("{name}_count"), labels, None, h.count() as f64);
        }
    }
}

/// Nanoseconds as seconds, as short as they are exact (`0.00025`, `5`).
fn seconds(ns: u64) -> String {
    let s = format!("{}.{:09}", ns / 1_000_000_000, ns % 1_000_000_000);
    s.trim_end_matches('0').trim_end_matches('.').to_owned()
}

fn sample(o: &mut String, name: &str, labels: &Labels, le: Option<&str>, v: f64) {
    o.push_str(name);
    if !labels.is_empty() || le.is_some() {
        o.push('{');
        let le = le.map(|l| ("le", l));
        for (i, (k, v)) in labels
            .iter()
            .map(|(k, v)| (*k, v.as_str()))
            .chain(le)
            .enumerate()
        {
            if i > 0 {
                o.push(',');
            }
            o.push_str(k);
            o.push_str("=\"");
            escape(o, v);
            o.push('"');
        }
        o.push('}');
    }
    let _ = writeln!(o, " {}", number(v));
}

/// A label value as the format wants it: backslash, double quote and
/// newline escaped; any other character no label may show raw (controls,
/// format characters: `gpufrac_common::text::is_hidden`) as the text
/// `\u{NNNN}`, so that a dashboard shows a command or a user as it is.
fn escape(o: &mut String, v: &str) {
    use gpufrac_common::text::{is_hidden, push_code};
    for c in v.chars() {
        match c {
            '\\' => o.push_str("\\\\"),
            '"' => o.push_str("\\\""),
            '\n' => o.push_str("\\n"),
            c if is_hidden(c) => {
                // The code's backslash is itself escaped for the format.
                o.push('\\');
                push_code(o, c);
            }
            c => o.push(c),
        }
    }
}

fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else {
        format!("{v}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_family_is_written_once_with_its_help_type_and_escaped_labels() {
        let mut f = Family::new("gpufrac_x_bytes", Kind::Gauge, "What x holds.");
        f.add(vec![("user", "a\"b\\c\nd\u{202e}e".into())], 1.0);
        f.add(vec![("user", "other".into())], 2.0);
        f.add(vec![("user", "other".into())], 3.5);
        let mut o = String::new();
        f.write(&mut o);
        assert_eq!(
            o,
            "# HELP gpufrac_x_bytes What x holds.\n\
             # TYPE gpufrac_x_bytes gauge\n\
             gpufrac_x_bytes{user=\"a\\\"b\\\\c\\nd\\\\u{202e}e\"} 1\n\
             gpufrac_x_bytes{user=\"other\"} 5.5\n"
        );
    }

    #[test]
    fn a_histogram_has_cumulative_buckets_in_seconds_a_sum_and_a_count() {
        let mut h = Histogram::new(&[250_000, 1_000_000_000, 5_000_000_000]);
        h.observe(2_000_000_000);
        h.observe(10_000_000_000);
        let mut f = Family::new("gpufrac_w_seconds", Kind::Histogram, "W.");
        f.histogram(vec![("class", "low".into())], &h);
        let mut o = String::new();
        f.write(&mut o);
        let lines: Vec<&str> = o.lines().collect();
        assert_eq!(
            lines[2..],
            [
                "gpufrac_w_seconds_bucket{class=\"low\",le=\"0.00025\"} 0",
                "gpufrac_w_seconds_bucket{class=\"low\",le=\"1\"} 0",
                "gpufrac_w_seconds_bucket{class=\"low\",le=\"5\"} 1",
                "gpufrac_w_seconds_bucket{class=\"low\",le=\"+Inf\"} 2",
                "gpufrac_w_seconds_sum{class=\"low\"} 12",
                "gpufrac_w_seconds_count{class=\"low\"} 2",
            ]
        );
    }

    #[test]
    fn numbers_are_written_as_the_format_reads_them() {
        assert_eq!(number(0.000_000_1), "0.0000001");
        assert_eq!(number(17179869184.0), "17179869184");
        assert_eq!(number(f64::INFINITY), "+Inf");
        assert_eq!(number(f64::NAN), "NaN");
        assert_eq!(seconds(100_000), "0.0001");
        assert_eq!(seconds(30_000_000_000), "30");
    }
}
