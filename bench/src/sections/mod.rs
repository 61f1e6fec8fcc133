//! The six benchmark sections. Each returns a [`Section`] of tables,
//! targets and notes; every process it starts is killed on drop.
//!
//! [`Section`]: gpufrac_bench::report::Section

pub mod accuracy;
pub mod arbitration;
pub mod contend;
pub mod free;
pub mod hook;
pub mod latency;
mod loadgen;
pub mod queue;
pub mod scale;
mod shims;

/// `12.3` style formatting with a fixed number of decimals.
pub fn f(v: f64, decimals: usize) -> String {
    if v.is_finite() {
        format!("{v:.decimals$}")
    } else {
        "n/a".into()
    }
}

/// Signed, e.g. `+12.3`.
pub fn signed(v: f64, decimals: usize) -> String {
    if v.is_finite() {
        format!("{v:+.decimals$}")
    } else {
        "n/a".into()
    }
}
