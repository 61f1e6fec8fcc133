//! The scheduler's public types: its configuration, the actions it asks
//! the socket layer to carry out, and what status reports of each client.

use super::{MS, Priority, US};

/// Monotonic nanoseconds, chosen by the caller.
pub type Nanos = u64;
/// One connected process.
pub type ClientId = u64;
/// Identifies one grant, so late updates and revokes can be told apart from a
/// new grant by the client.
pub type GrantId = u64;
/// A unit of fairness (a job or a user); chosen by the caller.
pub type GroupId = u64;
/// A user, the top level of fairness; chosen by the caller.
pub type UserId = u64;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SchedConfig {
    /// Contended slice between busy clients of one class (`--timeslice`).
    pub timeslice: Nanos,
    /// Sliding window for `GPU_COMPUTE_LIMIT` and for achieved share.
    pub window: Nanos,
    /// A revoked holder that has not released after this is reported hung.
    /// The GPU has already moved on at the revoke; it is charged either way.
    pub grace: Nanos,
    /// Most unfinished work a holder may keep queued while others share the
    /// GPU (`--inflight`); 0: no bound. It is what a newcomer may have to
    /// wait for beyond the time-slicer's own quantum, and what a handover
    /// leaves running.
    pub bound: Nanos,
    /// Longest a released client is charged for its queued work without
    /// saying it has drained.
    pub drain_timeout: Nanos,
    /// Longest a client that wakes up waits for a holder of its class,
    /// when it is not behind enough to take the GPU at once: about the
    /// GPU's own time-slice quantum.
    pub wake: Nanos,
    /// While clients of lower classes are active, the most of each window
    /// the `high` class may hold the GPU (Linux's real-time throttling):
    /// an interactive process still gets the GPU at once, but a busy or
    /// stuck `high` client cannot starve everyone else. 1.0: unbounded.
    pub high_share: f64,
    /// How far back the driver's samples are weighed against a client's
    /// time on the GPU (`Scheduler::work_seen`): two of the shell's sample
    /// periods. A user's benefit of the doubt is half of it, coming back
    /// at a twentieth of real time (`evidence`).
    pub evidence: Nanos,
}

impl Default for SchedConfig {
    /// 20 ms slices (a handover costs about a round trip and a hardware
    /// context switch, so 20 ms keeps switching under 1%), a 1 s window, a
    /// 200 ms grace, 250 µs of queued work, 5 s to drain, at most half
    /// of each window for `high` while others wait, and evidence of work
    /// good for 1 s (the shell samples the driver every 500 ms).
    fn default() -> Self {
        SchedConfig {
            timeslice: 20 * MS,
            window: 1000 * MS,
            grace: 200 * MS,
            bound: 250 * US,
            drain_timeout: 5000 * MS,
            wake: 2 * MS,
            high_share: 0.5,
            evidence: 1000 * MS,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// `slice: None` is open-ended (uncontended, unlimited). A grant id the
    /// client already holds makes this an update of that grant. `bound` is
    /// the most unfinished work it may keep queued (0: none).
    Grant {
        client: ClientId,
        grant: GrantId,
        slice: Option<Nanos>,
        bound: Nanos,
        /// Someone else (of any class) wants the GPU: an idle holder hands
        /// it back early.
        waiters: bool,
    },
    /// Stop launching, then `release` (without waiting for queued work).
    Revoke { client: ClientId, grant: GrantId },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientState {
    Idle,
    Waiting,
    Holding,
    /// Revoked and not yet released (then `hung` past the grace). It is
    /// no longer the holder, but still charged.
    Revoking,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ClientStatus {
    pub client: ClientId,
    pub weight: f64,
    pub limit: Option<f64>,
    pub priority: Priority,
    pub state: ClientState,
    /// Fraction of the last window (or of its lifetime, if younger) during
    /// which the client was on the GPU (holding, or its work draining).
    pub achieved: f64,
    /// weight / sum of weights of the active clients of the highest
    /// active band but `high` ones (a share among the shares); 0 for an
    /// idle client, one of a lower band, or a `high` one (above shares).
    pub target: f64,
    /// Its times so far.
    pub times: ClientTimes,
    /// Released, with queued work still running.
    pub draining: bool,
    /// Revoked, past its grace, still not released.
    pub hung: bool,
}

/// A client's times since it registered, ns: what it held, what it was
/// charged and what it was owed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ClientTimes {
    /// Time on the GPU (holding or draining), wall clock.
    pub total_held: Nanos,
    /// GPU time charged: wall time on the GPU, split evenly while several
    /// clients' work shared it.
    pub gpu_time: Nanos,
    /// Its target share integrated over the time it asked in the top
    /// band, its ceilings letting it run (`entitled`): what it was owed.
    pub entitled: Nanos,
    /// Time it asked but was held back by its ceilings (its limit, its
    /// job's, the `high` class's share, its want of evidence of work).
    pub held_back: Nanos,
}
