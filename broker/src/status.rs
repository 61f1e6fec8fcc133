//! The status document the broker serves: its schema lives beside the wire
//! protocol that carries it (`gpufrac_common::status`), where the CLI reads
//! it too.

pub use gpufrac_common::status::*;
