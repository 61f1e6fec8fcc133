//! Strategies a search found, kept as regression tests: each as
//! `redteam search` (or `cargo xtask redteam`) printed it, with the
//! invariant it broke. Each plays once within the test suite's bounds
//! (`Bounds::QUICK`). `GPUFRAC_REDTEAM_REPORT_ONLY=1` reports instead of
//! failing.

use gpufrac_redteam::*;
