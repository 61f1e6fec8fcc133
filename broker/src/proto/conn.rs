//! One client connection as the core sees it: its peer, its protocol
//! state, and the bytes in and out, charged to its user's budgets.

use super::Nanos;
use crate::authority::Peer;
use crate::sched::Priority;
use gpufrac_common::wire::Role;

mod conns;
pub(super) use conns::{Conns, Over};

// The one escaper of what users send (commands, labels, pod names), in
// common so that every client shows text by the same rules.
pub use gpufrac_common::text::{Quoted, clip_counted};

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

/// Every connection's part: who is on the other end, its bytes, its
/// deadlines and its place in its user's budgets. What it may send and
/// hold is its role's (`role`).
#[derive(Debug)]
pub(super) struct Conn {
    pub peer: Peer,
    pub opened: Nanos,
    /// An unfinished frame has been waiting since then.
    pub partial_since: Option<Nanos>,
    pub inbuf: Vec<u8>,
    /// Output not written yet: queued by `Conns::send` only, which charges
    /// it and lists the connection.
    outbuf: Vec<u8>,
    /// Fixed by the first `Hello`: a connection never changes role, so
    /// a CLI connection never holds a process's state and a shim's never
    /// holds a lease.
    pub role: RoleState,
    /// The command line its process sent (a shim's `Register`), or its
    /// job's label (a CLI's lease), escaped and cut to the label budget.
    pub command: String,
    /// Input handling stopped at its user's part of the turn with whole
    /// frames possibly left in `inbuf`: served again next turn.
    pub more: bool,
    /// The socket may hold bytes not read yet (the poll said so, and no
    /// read has found it empty since).
    pub readable: bool,
    /// Past a deadline (no hello, half a frame): closed at its next serve
    /// if, with what its socket holds read, it still is.
    pub overdue: bool,
    /// The broker granted or revoked a grant of its process and awaits
    /// its next message (a revoked GPU is kept for it only for a moment;
    /// a granted one is freed by its Release): when its socket is
    /// readable, it is served ahead of the round, once.
    pub awaited: bool,
    /// The broker is done with it: set by `Conns::kill` only, which lists
    /// it for the shell to close.
    dead: bool,
}

#[derive(Debug)]
pub(super) enum RoleState {
    /// No `Hello` yet: only a `Hello` is taken.
    Greeting,
    Shim(ShimConn),
    Cli(CliConn),
}

/// A process's connection (`libgpufrac.so`): its devices and settings,
/// the job it belongs to, its place in the GPUs' schedulers.
#[derive(Debug)]
pub(super) struct ShimConn {
    pub devices: Vec<ClientDev>,
    pub share: Option<f64>,
    pub limit: Option<f64>,
    pub priority: Priority,
    /// The job this process belongs to (it descends from the job's run, or
    /// holds its token).
    pub member_of: Option<u64>,
    /// The job token a process sent in `Join` (a container's process, which
    /// does not descend from its job's run).
    pub claimed_job: Option<u64>,
    /// It has sent `Register` (and been answered).
    pub registered: bool,
}

/// A `gpufrac run`, `gpufrac status` or device plugin connection: at most
/// one lease, its place in the queue, a status page it waits for.
#[derive(Debug, Default)]
pub(super) struct CliConn {
    /// The job (token) this connection is the `gpufrac run` of.
    pub job: Option<u64>,
    /// A `Status` request waiting for its user's status budget (the page
    /// asked for). Nothing after it on this connection is handled until
    /// it is answered: replies keep their order. Set and cleared by
    /// `Conns` only, which lists the connection meanwhile.
    status_wait: Option<u32>,
}

impl RoleState {
    pub fn new(role: Role) -> RoleState {
        match role {
            Role::Shim => RoleState::Shim(ShimConn {
                devices: Vec::new(),
                share: None,
                limit: None,
                priority: Priority::Normal,
                member_of: None,
                claimed_job: None,
                registered: false,
            }),
            Role::Cli => RoleState::Cli(CliConn::default()),
        }
    }
}

impl Conn {
    /// A connection just accepted: whatever its peer sent before the
    /// accept is still to be read.
    pub fn new(peer: Peer, now: Nanos) -> Conn {
        Conn {
            peer,
            opened: now,
            partial_since: None,
            inbuf: Vec::new(),
            outbuf: Vec::new(),
            role: RoleState::Greeting,
            command: String::new(),
            more: false,
            readable: true,
            overdue: false,
            awaited: false,
            dead: false,
        }
    }

    /// The role its `Hello` said; None before it.
    pub fn role(&self) -> Option<Role> {
        match self.role {
            RoleState::Greeting => None,
            RoleState::Shim(_) => Some(Role::Shim),
            RoleState::Cli(_) => Some(Role::Cli),
        }
    }

    pub fn shim(&self) -> Option<&ShimConn> {
        match &self.role {
            RoleState::Shim(s) => Some(s),
            _ => None,
        }
    }

    pub fn shim_mut(&mut self) -> Option<&mut ShimConn> {
        match &mut self.role {
            RoleState::Shim(s) => Some(s),
            _ => None,
        }
    }

    pub fn cli(&self) -> Option<&CliConn> {
        match &self.role {
            RoleState::Cli(c) => Some(c),
            _ => None,
        }
    }

    pub fn cli_mut(&mut self) -> Option<&mut CliConn> {
        match &mut self.role {
            RoleState::Cli(c) => Some(c),
            _ => None,
        }
    }

    /// A shim's devices; none for any other connection.
    pub fn devices(&self) -> &[ClientDev] {
        self.shim().map_or(&[], |s| &s.devices)
    }

    /// The job a shim's process belongs to.
    pub fn member_of(&self) -> Option<u64> {
        self.shim().and_then(|s| s.member_of)
    }

    /// The job a CLI connection holds the lease of.
    pub fn job(&self) -> Option<u64> {
        self.cli().and_then(|c| c.job)
    }

    /// The broker is done with it (`Conns::kill`).
    pub fn dead(&self) -> bool {
        self.dead
    }

    /// Output not written yet.
    #[cfg(test)]
    pub fn outbuf(&self) -> &[u8] {
        &self.outbuf
    }

    /// The status page a CLI connection waits for.
    pub fn status_wait(&self) -> Option<u32> {
        self.cli().and_then(|c| c.status_wait)
    }
}

/// A token bucket in virtual time: `cap` at once, then one per `every`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Bucket {
    tokens: u32,
    at: Nanos,
}

impl Bucket {
    pub fn full(cap: u32, now: Nanos) -> Bucket {
        Bucket {
            tokens: cap,
            at: now,
        }
    }

    fn refill(&mut self, now: Nanos, cap: u32, every: Nanos) {
        let n = now.saturating_sub(self.at) / every.max(1);
        let n = u32::try_from(n).unwrap_or(u32::MAX);
        self.tokens = self.tokens.saturating_add(n).min(cap);
        if self.tokens == cap {
            self.at = now;
        } else {
            self.at += u64::from(n) * every;
        }
    }

    /// Takes one if there is one.
    pub fn take(&mut self, now: Nanos, cap: u32, every: Nanos) -> bool {
        self.refill(now, cap, every);
        if self.tokens == 0 {
            return false;
        }
        self.tokens -= 1;
        true
    }

    /// Whether it has one to give at `now`.
    pub fn has(&self, now: Nanos, cap: u32, every: Nanos) -> bool {
        let mut b = *self;
        b.refill(now, cap, every);
        b.tokens > 0
    }

    /// Whether it is full at `now` (then it can be forgotten).
    pub fn is_full(&self, now: Nanos, cap: u32, every: Nanos) -> bool {
        let mut b = *self;
        b.refill(now, cap, every);
        b.tokens == cap
    }

    /// When the next token comes.
    pub fn next(&self, every: Nanos) -> Nanos {
        self.at + every
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_gives_its_burst_then_one_per_period() {
        let mut b = Bucket::full(3, 0);
        assert!((0..3).all(|_| b.take(0, 3, 10)));
        assert!(!b.take(5, 3, 10));
        assert_eq!(b.next(10), 10);
        assert!(b.take(10, 3, 10));
        assert!(!b.take(19, 3, 10));
        assert!(b.is_full(1000, 3, 10));
    }
}
