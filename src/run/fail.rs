//! A failure of `gpufrac run` itself, with the exit status it ends in.

/// A failure of `run` itself: the message (printed after "gpufrac run: ")
/// and the exit status.
#[derive(Debug)]
pub(super) struct Fail {
    pub(super) msg: String,
    pub(super) code: u8,
}

impl Fail {
    pub(super) fn new(code: u8, msg: impl Into<String>) -> Fail {
        Fail {
            msg: msg.into(),
            code,
        }
    }
}
