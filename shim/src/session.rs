//! The broker session's decisions, as a pure state machine: what this
//! process does on each broker message, on each tick of its client thread,
//! on connecting and on losing the broker. Events go in with the time they
//! happen at; actions come out, for the client thread (`client.rs`) to
//! apply to the gate's atomics and the socket. Nothing here reads a clock,
//! a global or the driver, so every rule is tested in virtual time
//! (`tests` below), as the broker's core is.
//!
//! What the session owns is what only the client thread ever touched: the
//! grant held per device (its id, slice, bound, when it began), the id last
//! released, the request outstanding, the usage last reported and the
//! `Watch` on the broker's silence. It is the only one that sends: what
//! application threads want (a device their launch found closed) and what
//! the drain thread saw finish come in, with the rest they share with it
//! (launches in flight, the last launch, the optimistic windows, threads
//! in a synchronize call), as a snapshot, `Gauges`, with each tick; asking,
//! asking again, arming the optimistic window and the order of an
//! `Acquire` before a `Release` are decided here.

use crate::watch::{self, STALL_NS, Verdict, Watch};
use gpufrac_common::config::{BrokerMode, MAX_DEVICES, Priority, ShimConfig};
use gpufrac_common::wire::{ClientMsg, DeviceReg, ServerMsg};

/// Without launches for this long while others wait (or could), the GPU is
/// handed back: a returning holder asks again, which costs a round trip.
pub const IDLE_HANDBACK_NS: u64 = 500_000;
/// Usage figures go out at most this often (and only when they changed).
pub const REPORT_EVERY_NS: u64 = 100_000_000;
/// The client thread's tick while nothing needs a finer one: usage reports,
/// asking again and the watch on the broker live with this.
const COARSE_TICK_NS: u64 = 100_000_000;
/// A request still unanswered after this long is made again: the broker
/// takes a repeated `Acquire` as the same request, and a request lost in
/// some race (a CI run once left a process waiting on a broker that had it
/// as idle) costs half a second, not forever.
pub const ASK_AGAIN_NS: u64 = 500_000_000;

/// A device's memory figures as reported: (used, peak, refusals).
pub type Usage = (u64, u64, u64);

/// What the application threads share with the client thread, read by it
/// just before a tick.
#[derive(Clone, Debug)]
pub struct Gauges {
    /// Devices a launch waits for (or went out on ahead of its grant):
    /// what application threads want asked for.
    pub wants: u64,
    /// Devices whose queued work the drain thread saw finish since the
    /// last tick.
    pub drained: u64,
    /// The drain thread is gone (a contained panic).
    pub drain_lost: bool,
    /// The process is exiting: its figures go out once more.
    pub exiting: bool,
    /// A thread waits for this process's own kernels (a synchronize call,
    /// or room under the in-flight bound): not idleness.
    pub syncing: bool,
    /// Devices with a launch past the gate that has not returned.
    pub in_flight: u64,
    /// Per device: the last launch (or the end of a wait for this process's
    /// own work), in the clock's nanoseconds.
    pub last_launch: [u64; MAX_DEVICES],
    /// Per device: the end of the optimistic window (0: none open).
    pub optimistic_until: [u64; MAX_DEVICES],
    /// Per device: the memory figures now.
    pub usage: [Usage; MAX_DEVICES],
}

impl Default for Gauges {
    fn default() -> Gauges {
        Gauges {
            wants: 0,
            drained: 0,
            drain_lost: false,
            exiting: false,
            syncing: false,
            in_flight: 0,
            last_launch: [0; MAX_DEVICES],
            optimistic_until: [0; MAX_DEVICES],
            usage: [(0, 0, 0); MAX_DEVICES],
        }
    }
}

/// Something that happened to the session.
#[derive(Debug)]
pub enum Event<'a> {
    /// The handshake with a broker completed; `devices` are this process's
    /// (caps and sizes as they are now), `command` its command line.
    Connected {
        devices: Vec<DeviceReg>,
        command: String,
    },
    /// Bytes arrived from the broker (a whole frame or not).
    Heard,
    Message(ServerMsg),
    /// The client thread's timer, with the gate's state read just before.
    Tick(&'a Gauges),
    /// The connection failed (closed, a read error, a bad frame, a write
    /// that did not go out): why, in words.
    Lost(String),
    /// No session could be opened: why, in words ("no broker at PATH
    /// (...)").
    ConnectFailed(String),
}

/// What the client thread must do, in this order.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Sends this frame to the broker.
    Send(ClientMsg),
    /// A new connection is registered: close every gate, publish the
    /// connection to the application threads and arbitrate launches.
    Arbitrate,
    /// Opens `dev` under the grant that just came. `bound_ns` 0: no
    /// in-flight bound. `stamp`: give the holder a fresh idle window from
    /// now (contention or a bound starts). `all_open`: every registered
    /// device is now held open-ended and unbounded, so launches may skip
    /// the per-device lane.
    Open {
        dev: usize,
        contended: bool,
        bound_ns: u64,
        stamp: Option<u64>,
        all_open: bool,
    },
    /// Stops launching on `dev` and waits for launches past the gate: the
    /// `Release` that follows may go out.
    Close { dev: usize },
    /// The devices whose next launch may go out before its grant (nothing
    /// asked for them, nothing held): it opens the optimistic window, and
    /// its want is asked for at once.
    Arm(u64),
    /// Waits for what this process queued on `dev` to finish, then sends
    /// `Drained`.
    Drain { dev: usize },
    /// `dev`'s optimistic window (the one that ends at `until`) ran out
    /// without a grant: close it, and if the client thread is the one that
    /// closed it, drain (what went out is
    /// charged until it has run).
    EndOptimism { dev: usize, until: u64 },
    /// Lowers every device's memory cap to the job's.
    ApplyCap(u64),
    /// The first registration was answered (or could not be made): the
    /// first context creation may go on.
    FirstRegistrationDone,
    /// Tells the user.
    Say(Note),
    /// Ends the session: the connection is closed.
    End,
    /// The report asked for at exit is out, or cannot be made: the exit
    /// may go on.
    ExitReported,
    /// No broker to arbitrate: close every gate; with `gated`
    /// (`GPUFRAC_BROKER=required`) launches wait for one, otherwise they
    /// run unarbitrated.
    Unarbitrated { gated: bool },
}

/// What the user is told; the client thread words it (it knows the socket).
#[derive(Clone, Debug, PartialEq)]
pub enum Note {
    Registered,
    /// The broker refused this process.
    Refused(String),
    /// A stopped broker, in required mode: launches keep waiting. Said once
    /// per silence.
    StalledWaiting,
    /// A stopped broker, in optional mode: the session ends. `loud`: the
    /// user asked for arbitration, so this is said at any log level.
    StalledUnarbitrated {
        loud: bool,
    },
    Lost(String),
    /// No broker (said once until a session has been served).
    NoBroker {
        what: String,
        loud: bool,
    },
    Granted {
        dev: usize,
        open_ended: bool,
    },
    Released {
        dev: usize,
        held_ns: u64,
    },
    /// The drain thread is gone: what was held is handed back and compute
    /// is not arbitrated from now on.
    Retired,
}

/// The grant state of one device.
#[derive(Clone, Copy, Debug, Default)]
struct Device {
    uuid: [u8; 16],
    open: bool,
    contended: bool,
    bound_ns: u64,
    grant: u64,
    released: u64,
    slice_ns: u64,
    granted_at: u64,
    /// When the `Acquire` still unanswered went out (None: nothing asked).
    asked: Option<u64>,
    reported: Option<Usage>,
}

/// This process's session with the broker, across reconnections: one per
/// client thread.
pub struct Session {
    job: u64,
    share: Option<f64>,
    limit: Option<f64>,
    priority: Priority,
    required: bool,
    /// The user asked for compute shares, limits or the broker itself: they
    /// are told when these do not hold.
    loud: bool,
    connected: bool,
    devices: Vec<Device>,
    watch: Watch,
    last_report: u64,
    /// The user has been told there is no broker (or that it stalled);
    /// the retries that follow do not repeat it.
    warned: bool,
    /// The devices last armed (`Action::Arm`).
    armed: u64,
    /// Arbitration ended for good (the drain thread is gone).
    retired: bool,
    /// The process is exiting and its last figures are said.
    exit_reported: bool,
}

impl Session {
    /// Whether it says what goes wrong with the broker on stderr whatever
    /// the log level (a process that asked for compute shares or limits,
    /// or requires its broker).
    pub fn loud(&self) -> bool {
        self.loud
    }

    pub fn new(cfg: &ShimConfig) -> Session {
        Session {
            job: cfg.job,
            share: cfg.compute_share,
            limit: cfg.compute_limit,
            priority: cfg.compute_priority,
            required: cfg.broker == BrokerMode::Required,
            loud: cfg.compute_share.is_some()
                || cfg.compute_limit.is_some()
                || cfg.broker == BrokerMode::Required,
            connected: false,
            devices: Vec::new(),
            watch: Watch::new(0),
            last_report: 0,
            warned: false,
            armed: 0,
            retired: false,
            exit_reported: false,
        }
    }

    /// Applies `event`, which happened at `now`; the actions go to `out`.
    pub fn on(&mut self, now: u64, event: Event<'_>, out: &mut Vec<Action>) {
        if let Event::Tick(g) = &event
            && g.exiting
            && !self.exit_reported
        {
            // Once, whatever else the tick would do: the process is on its
            // way out.
            self.exit_reported = true;
            if self.connected {
                self.report_usage(g, true, out);
            }
            return out.push(Action::ExitReported);
        }
        if self.retired {
            return;
        }
        match event {
            Event::Connected { devices, command } => self.connected(now, devices, command, out),
            Event::Heard => self.watch.heard(now),
            Event::Message(m) if self.connected => self.message(now, m, out),
            Event::Message(_) => {}
            Event::Tick(g) if g.drain_lost => self.retire(now, out),
            Event::Tick(g) if self.connected => self.tick(now, g, out),
            Event::Tick(_) => {}
            Event::Lost(why) => {
                if self.connected {
                    out.push(Action::Say(Note::Lost(why)));
                    self.disconnect(self.required, out);
                }
            }
            Event::ConnectFailed(what) => {
                if self.connected {
                    // A new attempt means the session before is over.
                    self.disconnect(self.required, out);
                }
                out.push(Action::FirstRegistrationDone);
                if !self.warned {
                    self.warned = true;
                    out.push(Action::Say(Note::NoBroker {
                        what,
                        loud: self.loud,
                    }));
                }
                out.push(Action::Unarbitrated {
                    gated: self.required,
                });
            }
        }
    }

    /// How long the client thread may wait for the broker before the next
    /// tick: idle hand-back and the end of an optimistic window need a fine
    /// one, the rest (usage reports, the watch) a coarse one.
    pub fn tick_ns(&self, any_optimistic: bool) -> u64 {
        if any_optimistic || self.devices.iter().any(|d| d.open && d.shared()) {
            IDLE_HANDBACK_NS / 2
        } else {
            COARSE_TICK_NS
        }
    }

    #[cfg(test)]
    pub fn is_connected(&self) -> bool {
        self.connected
    }

    /// Arbitration ended for good: the client thread stops.
    pub fn retired(&self) -> bool {
        self.retired
    }

    /// Devices open now, as a bit set.
    #[cfg(test)]
    pub fn open(&self) -> u64 {
        self.bits(|d| d.open)
    }

    fn bits(&self, f: impl Fn(&Device) -> bool) -> u64 {
        self.devices
            .iter()
            .enumerate()
            .filter(|(_, d)| f(d))
            .fold(0, |acc, (i, _)| acc | 1 << i)
    }

    fn connected(
        &mut self,
        now: u64,
        devices: Vec<DeviceReg>,
        command: String,
        out: &mut Vec<Action>,
    ) {
        // A new broker (or the same one restarted) knows nothing of this
        // process: nothing it granted before holds, and everything is
        // reported afresh.
        self.devices = devices
            .iter()
            .take(MAX_DEVICES)
            .map(|r| Device {
                uuid: r.uuid,
                ..Device::default()
            })
            .collect();
        self.watch = Watch::new(now);
        self.last_report = 0;
        self.connected = true;
        // Should this session be lost, the user hears of the next failure
        // to connect.
        self.warned = false;
        if self.job != 0 {
            // Before Register, which is where the broker settles the job.
            out.push(Action::Send(ClientMsg::Join { job: self.job }));
        }
        out.push(Action::Send(ClientMsg::Register {
            command,
            devices: devices.into_iter().take(MAX_DEVICES).collect(),
            share: self.share,
            limit: self.limit,
            priority: self.priority,
        }));
        out.push(Action::Arbitrate);
        self.armed = 0;
        self.arm(out);
        out.push(Action::Say(Note::Registered));
    }

    /// Arms the devices neither held nor asked for, if that changed.
    fn arm(&mut self, out: &mut Vec<Action>) {
        let armed = self.bits(|d| !d.open && d.asked.is_none());
        if armed != self.armed {
            self.armed = armed;
            out.push(Action::Arm(armed));
        }
    }

    /// Ends the connection; `gated`: launches wait for the next one.
    fn disconnect(&mut self, gated: bool, out: &mut Vec<Action>) {
        self.connected = false;
        for d in &mut self.devices {
            d.open = false;
            d.contended = false;
            d.bound_ns = 0;
            d.asked = None;
        }
        // Closing every gate disarms them.
        self.armed = 0;
        out.push(Action::End);
        out.push(Action::Unarbitrated { gated });
    }

    fn ordinal_of(&self, uuid: &[u8; 16]) -> Option<usize> {
        self.devices.iter().position(|d| &d.uuid == uuid)
    }

    fn message(&mut self, now: u64, m: ServerMsg, out: &mut Vec<Action>) {
        match m {
            ServerMsg::Grant {
                uuid,
                grant,
                slice_ns,
                bound_ns,
                waiters,
            } => {
                let Some(i) = self.ordinal_of(&uuid) else {
                    return;
                };
                let d = &mut self.devices[i];
                if grant == d.released {
                    // An update that crossed our release on the wire.
                    return;
                }
                let contended = slice_ns != 0 || waiters;
                // Contention or a bound starts now: give the holder a fresh
                // idle window, and send launches back through the lane that
                // stamps it.
                let stamp = (contended || bound_ns != 0).then_some(now);
                if !d.open {
                    d.granted_at = now;
                }
                d.open = true;
                d.asked = None;
                d.grant = grant;
                d.slice_ns = slice_ns;
                d.bound_ns = bound_ns;
                d.contended = contended;
                let all_open = self.devices.iter().all(|d| d.open && !d.shared());
                out.push(Action::Open {
                    dev: i,
                    contended,
                    bound_ns,
                    stamp,
                    all_open,
                });
                out.push(Action::Say(Note::Granted {
                    dev: i,
                    open_ended: slice_ns == 0,
                }));
                self.arm(out);
            }
            ServerMsg::Revoke { uuid, grant } => {
                // Revoked while busy: this process still has work, so it
                // asks again (see `release`).
                if let Some(i) = self.ordinal_of(&uuid)
                    && grant == self.devices[i].grant
                {
                    self.release(now, i, true, true, out);
                }
            }
            ServerMsg::Registered { mem_cap } => {
                if mem_cap != 0 {
                    out.push(Action::ApplyCap(mem_cap));
                }
                out.push(Action::FirstRegistrationDone);
            }
            ServerMsg::Error { message, .. } => {
                out.push(Action::Say(Note::Refused(message)));
                out.push(Action::FirstRegistrationDone);
            }
            // A Pong (the answer to a probe) counts as heard, which is all
            // it is for; the rest is not for a shim.
            _ => {}
        }
    }

    /// Stops holding `i` (if it is held) and says so to the broker, asking
    /// again first with `ask_again` (so that a busy process keeps its place
    /// in the fair queue: asked after the `Release`, the broker would take
    /// its `Acquire` for the holder's and then idle it), and drains with
    /// `drain`.
    fn release(&mut self, now: u64, i: usize, ask_again: bool, drain: bool, out: &mut Vec<Action>) {
        let d = &mut self.devices[i];
        if !d.open {
            return;
        }
        d.open = false;
        d.contended = false;
        d.bound_ns = 0;
        d.released = d.grant;
        let held_ns = now.saturating_sub(d.granted_at);
        if ask_again {
            d.asked = Some(now);
            out.push(Action::Send(ClientMsg::Acquire { uuid: d.uuid }));
        }
        out.push(Action::Close { dev: i });
        out.push(Action::Send(ClientMsg::Release {
            uuid: d.uuid,
            held_ns,
        }));
        // No drain before the Release: the next holder starts now, and
        // the GPU's time-slicer interleaves what this process still has
        // queued (kept short by the in-flight bound).
        if drain {
            out.push(Action::Drain { dev: i });
        }
        out.push(Action::Say(Note::Released { dev: i, held_ns }));
        self.arm(out);
    }

    fn tick(&mut self, now: u64, g: &Gauges, out: &mut Vec<Action>) {
        self.report_drained(g, out);
        self.idle_handback(now, g, out);
        self.ask(now, g, out);
        self.end_optimism(now, g, out);
        if now.saturating_sub(self.last_report) >= REPORT_EVERY_NS {
            self.last_report = now;
            self.report_usage(g, false, out);
        }
        self.check_watch(now, out);
    }

    fn idle_handback(&mut self, now: u64, g: &Gauges, out: &mut Vec<Action>) {
        if g.syncing {
            return;
        }
        for i in 0..self.devices.len() {
            let d = &self.devices[i];
            if d.open
                && d.shared()
                && g.in_flight & (1 << i) == 0
                && now.saturating_sub(g.last_launch[i]) >= IDLE_HANDBACK_NS
            {
                self.release(now, i, false, true, out);
            }
        }
    }

    /// Asks for the devices that application threads want and this
    /// process neither holds nor has asked for, and again for those asked
    /// for `ASK_AGAIN_NS` ago and still not granted.
    fn ask(&mut self, now: u64, g: &Gauges, out: &mut Vec<Action>) {
        for (i, d) in self.devices.iter_mut().enumerate() {
            let due = d
                .asked
                .is_none_or(|at| now.saturating_sub(at) >= ASK_AGAIN_NS);
            if g.wants & (1 << i) != 0 && !d.open && due {
                d.asked = Some(now);
                out.push(Action::Send(ClientMsg::Acquire { uuid: d.uuid }));
            }
        }
        self.arm(out);
    }

    /// `Drained` for each device whose queued work the drain thread saw
    /// finish.
    fn report_drained(&self, g: &Gauges, out: &mut Vec<Action>) {
        for (i, d) in self.devices.iter().enumerate() {
            if g.drained & (1 << i) != 0 {
                out.push(Action::Send(ClientMsg::Drained { uuid: d.uuid }));
            }
        }
    }

    /// The drain thread is gone: everything held is handed back, each with
    /// its `Release` (a hung holder otherwise, to the broker), the session
    /// ends and compute is not arbitrated from now on.
    fn retire(&mut self, now: u64, out: &mut Vec<Action>) {
        for i in 0..self.devices.len() {
            self.release(now, i, false, false, out);
        }
        out.push(Action::Say(Note::Retired));
        self.disconnect(false, out);
        self.retired = true;
    }

    /// A process whose launches went out ahead of a grant that has not come
    /// within the window reports that work once it has run, whether or not
    /// it launches again: the broker charges it until then.
    fn end_optimism(&self, now: u64, g: &Gauges, out: &mut Vec<Action>) {
        for (i, &until) in g.optimistic_until.iter().enumerate() {
            let open = self.devices.get(i).is_some_and(|d| d.open);
            if !open && until != 0 && now >= until {
                out.push(Action::EndOptimism { dev: i, until });
            }
        }
    }

    /// The figures of every device whose (used, peak, refusals) changed
    /// since they were last sent: comparing values costs the allocation
    /// path nothing. With `all`, every device's (the last report, at
    /// exit).
    fn report_usage(&mut self, g: &Gauges, all: bool, out: &mut Vec<Action>) {
        for (d, &now) in self.devices.iter_mut().zip(g.usage.iter()) {
            if d.reported == Some(now) && !all {
                continue;
            }
            d.reported = Some(now);
            out.push(Action::Send(ClientMsg::Usage {
                uuid: d.uuid,
                used: now.0,
                peak: now.1,
                ooms: now.2,
            }));
        }
    }

    /// How long the broker may stay silent now (see `watch.rs`).
    fn allowance(&self) -> Option<u64> {
        let waiting = self.devices.iter().any(|d| !d.open && d.asked.is_some());
        let slice = self
            .devices
            .iter()
            .filter(|d| d.open && d.contended)
            .map(|d| d.slice_ns)
            .max();
        watch::allowance(waiting, slice)
    }

    fn check_watch(&mut self, now: u64, out: &mut Vec<Action>) {
        match self.watch.check(now, self.allowance()) {
            Verdict::Fine => {}
            // Answered by a Pong: what counts is that something arrives.
            Verdict::Probe => out.push(Action::Send(ClientMsg::Ping)),
            Verdict::Stalled if self.required => {
                if !self.watch.told {
                    self.watch.told = true;
                    out.push(Action::Say(Note::StalledWaiting));
                }
            }
            Verdict::Stalled => {
                // The retries that follow while the broker is still stopped
                // do not say it again.
                self.warned = true;
                out.push(Action::Say(Note::StalledUnarbitrated { loud: self.loud }));
                self.disconnect(self.required, out);
            }
        }
    }
}

impl Device {
    /// Others share the GPU (a slice, a bound, or someone waiting): launches
    /// stamp their time, and idle hand-back applies.
    fn shared(&self) -> bool {
        self.contended || self.bound_ns != 0
    }
}

/// The broker's silence allowed while waiting, for the messages.
pub const STALL_S: u64 = STALL_NS / 1_000_000_000;

#[cfg(test)]
mod tests;
