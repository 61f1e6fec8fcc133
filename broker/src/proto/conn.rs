//! One client connection as the core sees it: its peer, its protocol
//! state, and the bytes in and out, charged to its user's budgets.

use super::Nanos;
use crate::authority::Peer;
use crate::sched::Priority;
use gpufrac_common::wire::Role;

/// How much of the broker one user may hold at once. Each budget is the
/// user's own: one user exhausting it closes or refuses only that user's
/// connections and requests (SECURITY.md lists them with their defaults).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budgets {
    /// Connections open at once (`--max-connections-per-user`).
    pub connections: usize,
    /// Unread input (partial frames) across the user's connections.
    pub input: usize,
    /// Output the user's connections have not read yet.
    pub output: usize,
    /// Requests waiting in the queue.
    pub queued: usize,
    /// Leases held, with or without placement.
    pub leases: usize,
    /// Bytes of a command or label kept for status and the state file.
    pub label: usize,
}

pub const DEFAULT_MAX_CONNS_PER_USER: usize = 256;

impl Default for Budgets {
    fn default() -> Self {
        Budgets {
            connections: DEFAULT_MAX_CONNS_PER_USER,
            input: 16 << 20,
            output: 16 << 20,
            queued: 32,
            leases: 64,
            label: 256,
        }
    }
}

/// A connection whose unsent output grows past this is not reading: it
/// is closed (a status page is at most 1 MiB).
pub const MAX_OUTBUF: usize = 4 << 20;

/// What one user holds now, in bytes and connections.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Held {
    pub conns: usize,
    pub input: usize,
    pub output: usize,
}

#[derive(Debug)]
pub(super) struct ClientDev {
    pub gpu: usize,
    pub ordinal: u32,
    pub cap: u64,
    pub used: u64,
    pub peak: u64,
    pub ooms: u64,
}

#[derive(Debug)]
pub(super) struct Conn {
    pub peer: Peer,
    pub opened: Nanos,
    /// An unfinished frame has been waiting since then.
    pub partial_since: Option<Nanos>,
    pub inbuf: Vec<u8>,
    pub outbuf: Vec<u8>,
    pub role: Option<Role>,
    pub command: String,
    pub devices: Vec<ClientDev>,
    pub share: Option<f64>,
    pub limit: Option<f64>,
    pub priority: Priority,
    /// The job (token) this connection is the `gpufrac run` of.
    pub job: Option<u64>,
    /// The job this process belongs to (it descends from the job's run, or
    /// holds its token).
    pub member_of: Option<u64>,
    /// The job token a process sent in `Join` (a container's process, which
    /// does not descend from its job's run).
    pub claimed_job: Option<u64>,
    /// It has sent `Register` (and been answered).
    pub registered: bool,
    /// Queue position last told to a waiting `gpufrac run`.
    pub queued: Option<u32>,
    pub dead: bool,
}

impl Conn {
    pub fn new(peer: Peer, now: Nanos, command: String) -> Conn {
        Conn {
            peer,
            opened: now,
            partial_since: None,
            inbuf: Vec::new(),
            outbuf: Vec::new(),
            role: None,
            command,
            devices: Vec::new(),
            share: None,
            limit: None,
            priority: Priority::Normal,
            job: None,
            member_of: None,
            claimed_job: None,
            registered: false,
            queued: None,
            dead: false,
        }
    }
}

/// `s` cut to at most `max` bytes at a character boundary, with an
/// ellipsis when cut.
pub fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max.saturating_sub('…'.len_utf8());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clipped_labels_stay_within_their_budget() {
        assert_eq!(clip("short", 256), "short");
        let long = "é".repeat(1000);
        let c = clip(&long, 256);
        assert!(c.len() <= 256 && c.ends_with('…'), "{}", c.len());
    }
}
