//! What the core says: frames to a connection (charged to the turn, within
//! its user's output budget), status pages (within its user's status
//! budget), and log lines a user's connections cause (within that user's
//! log budget); a user's text escaped and cut before it is said.

use gpufrac_common::wire::ServerMsg;
use tracing::warn;

use super::conn::{Over, clip_counted};
use super::{Broker, ConnId, Nanos};

impl Broker {
    pub(super) fn send(&mut self, id: ConnId, msg: &ServerMsg) {
        let Some((pid, uid)) = self.conns.get(&id).map(|c| (c.peer.pid, c.peer.uid)) else {
            return;
        };
        let sent = self.conns.send(id, msg);
        self.serving.charge().sent += sent.bytes as u64;
        match sent.over {
            None | Some(Over::Input) => {}
            Some(Over::Outbuf) => self.warn_uid(
                uid,
                format_args!(
                    "pid {pid} (uid {uid}) is not reading what it asked for; disconnecting it"
                ),
            ),
            Some(Over::Output) => self.warn_uid(
                uid,
                format_args!(
                    "user {uid}'s output budget is exhausted (its connections are not reading); \
                     closing the connection of pid {pid} that went over"
                ),
            ),
        }
    }

    pub(super) fn kill(&mut self, id: ConnId) {
        self.conns.kill(id);
    }

    /// A warning user `uid`'s connections provoked, within that user's log
    /// budget (`may_log`): one user's flood neither floods the log nor
    /// silences the warnings about anyone else.
    pub(super) fn warn_uid(&mut self, uid: u32, msg: std::fmt::Arguments<'_>) {
        if self.may_log(uid) {
            warn!("{msg}");
        }
    }

    /// Whether a log line user `uid`'s connections caused may be written
    /// now: every line a client can cause (registrations, refusals,
    /// warnings, its leases' lines) takes one from its user's budget;
    /// lines held back are counted and said with the next line let
    /// through.
    pub(super) fn may_log(&mut self, uid: u32) -> bool {
        self.voices.may_log(uid, self.now)
    }

    /// `s`, text a user sent, escaped and cut to `max` bytes
    /// (`clip_counted`), the escaping charged to the turn.
    pub(super) fn clip(&mut self, s: &str, max: usize) -> String {
        let (text, read) = clip_counted(s, max);
        self.serving.charge().escaped += read as u64;
        text
    }

    /// A `Status` request: answered now if its user's status budget
    /// allows, else held (with everything after it on the connection)
    /// until the budget refills.
    pub(super) fn ask_status(&mut self, now: Nanos, id: ConnId, from: u32) {
        if !self.answer_status(now, id, from) {
            self.conns.hold_status(id, from);
        }
    }

    /// Answers `id`'s status request if its user's budget allows; true if
    /// it did (a held request is then no longer held).
    pub(super) fn answer_status(&mut self, now: Nanos, id: ConnId, from: u32) -> bool {
        let Some(uid) = self.conns.get(&id).map(|c| c.peer.uid) else {
            return false;
        };
        if !self.voices.page(uid, now) {
            return false;
        }
        self.conns.status_answered(id);
        let json = self.status_page(now, from);
        self.send(id, &ServerMsg::StatusReply { json });
        true
    }

    /// A status page, the connections it looks at charged to the turn.
    fn status_page(&mut self, now: Nanos, from: u32) -> String {
        self.serving.charge().walked += (self.conns.len() * self.gpus.len().max(1)) as u64;
        self.status_json(now, from as usize)
    }
}
