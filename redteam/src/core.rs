//! The one place that touches the broker: its core built with stand-ins
//! (the host's processes, job tokens, GPUs), and the shell's event loop
//! around it as `broker/src/server.rs` runs it (accepts, the core's turn,
//! which serves each ready user its part in work and asks the shell for
//! reads and the time, helper threads' reports, timers, output, closes,
//! state writes), over sockets the harness simulates. Everything above
//! this file speaks to `Shell` only; when the core's API moves, this file
//! is what follows it.
//!
//! Every call into the core is charged to the virtual clock by the work
//! it did (`Clock::run`; a turn is metered as it goes, so that the time
//! the core asks for at each serve is its start plus the work so far): a
//! broker that works longer for one client answers the others later, in
//! virtual time, exactly as a real one does in real time.

use std::cell::RefCell;
use std::collections::HashSet;
use std::rc::Rc;

use gpufrac_broker::harness::{
    ACCEPTS_PER_TURN, Allow, Broker, Config, GpuInfo, GpuSample, MigDone, Peer, Planner, Policy,
    Procs, SAVE_EVERY, Sockets as CoreSockets, Telemetry, Tokens, Work,
};
pub use gpufrac_broker::harness::{ConnId, Nanos, Read};
use gpufrac_common::status::Status;

use crate::host::Host;
use crate::work::{self, Tally};

pub const US: Nanos = 1_000;
pub const MS: Nanos = 1_000_000;
pub const SEC: Nanos = 1_000_000_000;
pub const GIB: u64 = 1 << 30;

/// The cost model: what the broker's work takes in virtual time. A call
/// into the core is a system call's worth (the read, write or timer that
/// comes with it in the real loop); then each allocation, and each KiB
/// allocated. Fitted with `redteam calibrate` (a release build, each
/// call's CPU time against its allocations and their bytes, over every
/// seed strategy in every scene: 31.6 ns an allocation, 831 ns a KiB,
/// before the turn went into the core; a Register with a 2 MiB command
/// line, which the broker then read from /proc, was 10 ms in the model, 17
/// ms of CPU in the harness, and about 75 ms on a real /proc).
pub const NS_PER_CALL: Nanos = 1_000;
pub const NS_PER_ALLOC: Nanos = 30;
pub const NS_PER_KIB: Nanos = 800;
/// A log line written: formatting and a write to the journal.
pub const NS_PER_LINE: Nanos = 3_000;

/// Work, in the model's units: nanoseconds of a broker's time.
pub fn cost(t: Tally) -> Nanos {
    t.allocs * NS_PER_ALLOC + t.bytes * NS_PER_KIB / 1024
}

/// One call into the core, timed (the thread's CPU time, `profile`):
/// what the cost model is fitted on.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    pub real: Nanos,
    pub work: Tally,
}

thread_local! {
    static PROFILE: RefCell<Option<Vec<Sample>>> = const { RefCell::new(None) };
}

/// This thread's CPU time: unlike the wall clock, not inflated by other
/// processes on a busy machine.
fn thread_cpu() -> Nanos {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, which `ts` is.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as Nanos * SEC + ts.tv_nsec as Nanos
}

/// Runs `f` with every call into the core timed on the real clock.
pub fn profile<R>(f: impl FnOnce() -> R) -> (R, Vec<Sample>) {
    PROFILE.with(|p| *p.borrow_mut() = Some(Vec::new()));
    let r = f();
    let samples = PROFILE.with(|p| p.borrow_mut().take()).unwrap_or_default();
    (r, samples)
}

/// Virtual time, and the work the broker has done so far.
#[derive(Debug, Default, Clone, Copy)]
pub struct Clock {
    pub now: Nanos,
    /// The broker's work so far (ns of its time, by the cost model).
    pub work: Nanos,
}

/// The work of one stretch of the broker's time (a call into the core,
/// or a whole turn with the reads it asks for), metered as it goes: a
/// turn asks for the time at each serve, and is told the time its work so
/// far has taken.
struct Meter {
    from: Nanos,
    before: Tally,
    lines: u64,
    /// System calls made (the call itself, each read): `NS_PER_CALL` each.
    calls: u64,
    cpu: Option<Nanos>,
}

impl Meter {
    fn start(clock: &Clock) -> Meter {
        Meter {
            from: clock.now,
            before: work::allocated(),
            lines: crate::logs::lines_written(),
            calls: 1,
            cpu: PROFILE.with(|p| p.borrow().is_some()).then(thread_cpu),
        }
    }

    /// The broker's time so far in this stretch, by the cost model.
    fn spent(&self) -> Nanos {
        self.calls * NS_PER_CALL
            + cost(work::allocated() - self.before)
            + (crate::logs::lines_written() - self.lines) * NS_PER_LINE
    }

    fn now(&self) -> Nanos {
        self.from + self.spent()
    }

    /// Moves the clock on by the stretch's work: the broker was busy
    /// meanwhile.
    fn finish(self, clock: &mut Clock) {
        let spent = self.spent();
        if let Some(t) = self.cpu {
            let real = thread_cpu().saturating_sub(t);
            let did = work::allocated() - self.before;
            work::paused(|| {
                PROFILE.with(|p| {
                    if let Some(v) = p.borrow_mut().as_mut() {
                        v.push(Sample { real, work: did });
                    }
                })
            });
        }
        clock.work += spent;
        clock.now += spent;
    }
}

impl Clock {
    /// Calls the core at `now`, then moves the clock on by the work the
    /// call did: the broker is busy meanwhile.
    pub fn run<R>(&mut self, f: impl FnOnce(Nanos) -> R) -> R {
        let m = Meter::start(self);
        let r = f(self.now);
        m.finish(self);
        r
    }
}

/// What the node is made of.
#[derive(Debug, Clone)]
pub struct Setup {
    /// The GPUs the broker found (their memory), GPU i with UUID `uuid(i)`.
    pub gpus: Vec<u64>,
    /// Whether the broker found them (false: it found no driver, and
    /// arbitrates the GPUs its clients name).
    pub discovered: bool,
    /// `--high-allow`: who may ask for `high` (None: everyone).
    pub high_allow: Option<Vec<u32>>,
    /// State writes fail in this window (a full disk): the broker must
    /// say so in its own voice, whoever else is being noisy.
    pub state_fails: Option<(Nanos, Nanos)>,
}

impl Default for Setup {
    fn default() -> Setup {
        Setup {
            gpus: vec![16 * GIB],
            discovered: true,
            high_allow: None,
            state_fails: None,
        }
    }
}

/// State writes are coalesced to one every this long, and a lease is
/// told to its run only once the state that books it is written: an
/// answer to a lease may wait this long for others' churn.
pub const STATE_COALESCED: Nanos = SAVE_EVERY;

/// GPU `i`'s UUID (the same bytes as the core's own tests use).
pub fn uuid(i: usize) -> [u8; 16] {
    [i as u8 + 1; 16]
}

/// /proc, as the core sees it: a process's stat (its parent and start
/// time), and nothing of its memory. The broker reads no command line
/// (what it shows is what the client's `Register` or `Lease` says): were a
/// read of a process's memory to come back into `Procs`, it belongs here,
/// through `Host`, which builds the attacker's command lines of up to
/// 4.5 MiB and counts the bytes handed out (`Node::cmdline_bytes`), so the
/// strategies with large command lines would find it.
struct FakeProcs(Rc<RefCell<Host>>);

impl Procs for FakeProcs {
    fn ident(&self, pid: u32) -> Option<u64> {
        self.0.borrow().start_time(pid)
    }

    fn parent(&self, pid: u32) -> Option<u32> {
        self.0.borrow().parent(pid)
    }
}

/// Job tokens as a fixed sequence (splitmix64), as the core's tests make
/// them: spread over u64 as random ones are.
fn tokens() -> Tokens {
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    Box::new(move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    })
}

/// The sockets as the shell sees them: the harness's clients on the other
/// end.
pub trait Sockets {
    /// Reads into `buf` what the client of `id` wrote (as `read(2)` on a
    /// non-blocking socket: `Closed` once the client closed its end and
    /// everything it wrote was read).
    fn read(&mut self, id: ConnId, buf: &mut [u8]) -> Read;
    /// Writes to the client of `id`: the bytes its socket took (0: full),
    /// or None when the client has closed its end (EPIPE).
    fn write(&mut self, id: ConnId, bytes: &[u8]) -> Option<usize>;
    /// The next connection in the listener's backlog: its id, and the
    /// pid of the process that connected.
    fn accept(&mut self) -> Option<(ConnId, u32)>;
    /// The broker closed `id`.
    fn close(&mut self, id: ConnId);
}

/// The driver as the shell's sampler asks it, every `SAMPLE_EVERY`.
pub trait Driver {
    /// Each GPU's utilisation (percent) since the last sample.
    fn utilization(&mut self, now: Nanos) -> u32;
    /// The pids whose kernels ran since the last sample, each with the
    /// percent of that time it kept the GPU busy (NVML's per-process
    /// utilisation).
    fn working(&mut self, now: Nanos) -> Vec<(u32, u32)>;
}

/// As `broker/src/server.rs` samples the driver.
const SAMPLE_EVERY: Nanos = 500 * MS;
/// A state write (on the writer's thread): a write and an fsync.
const STATE_WRITE: Nanos = MS;

/// The sockets and the clock as the core's turn asks for them (the
/// shell's `Live`): each read is a system call, and the time is the
/// turn's start plus the work done in it so far.
struct Live<'a> {
    io: &'a mut dyn Sockets,
    meter: Meter,
}

impl CoreSockets for Live<'_> {
    fn now(&mut self) -> Nanos {
        self.meter.now()
    }

    fn read(&mut self, id: ConnId, buf: &mut [u8]) -> Read {
        self.meter.calls += 1;
        work::paused(|| self.io.read(id, buf))
    }
}

/// The broker: its core and the shell's loop around it.
pub struct Shell {
    b: Broker,
    host: Rc<RefCell<Host>>,
    /// Connections accepted and not yet closed.
    open: HashSet<ConnId>,
    /// The listener may have connections waiting in its backlog.
    backlog: bool,
    /// A state snapshot handed to the writer, and when its write is done.
    saving: Option<(u64, Nanos)>,
    state_fails: Option<(Nanos, Nanos)>,
    last_sample: Nanos,
}

impl Shell {
    pub fn new(setup: &Setup, host: Rc<RefCell<Host>>, now: Nanos) -> Shell {
        let cfg = Config {
            policy: Policy {
                plugin: Allow {
                    uids: Vec::new(),
                    gids: Vec::new(),
                },
                high: setup.high_allow.clone().map(|uids| Allow {
                    uids,
                    gids: Vec::new(),
                }),
            },
            ..Config::default()
        };
        let gpus = setup
            .gpus
            .iter()
            .enumerate()
            .map(|(i, &total_mem)| GpuInfo {
                index: i as u32,
                uuid: uuid(i),
                name: format!("gpu{i}"),
                total_mem,
            })
            .collect();
        let b = Broker::new(
            cfg,
            gpus,
            Planner::default(),
            setup.discovered,
            Box::new(FakeProcs(host.clone())),
            tokens(),
            now,
        );
        Shell {
            b,
            host,
            open: HashSet::new(),
            backlog: false,
            saving: None,
            state_fails: setup.state_fails,
            // As the shell: the first sample at once.
            last_sample: now.saturating_sub(SAMPLE_EVERY),
        }
    }

    /// The listener has connections waiting.
    pub fn listener_ready(&mut self) {
        self.backlog = true;
    }

    /// The poll said `id` is readable (bytes, or its client closed).
    pub fn ready(&mut self, id: ConnId) {
        self.b.readable(id);
    }

    /// The process of `id` exited (its pidfd said so).
    pub fn exited(&mut self, clock: &mut Clock, id: ConnId) {
        if self.open.contains(&id) {
            clock.run(|_| self.b.exited(id));
        }
    }

    /// Whether the loop has work without waiting in poll.
    pub fn busy(&self) -> bool {
        self.backlog || self.b.busy()
    }

    /// When the loop's next timer is due: the core's, or the sampler's.
    pub fn next_timeout(&self) -> Option<Nanos> {
        let sample = self.last_sample + SAMPLE_EVERY;
        let saved = self.saving.map_or(sample, |(_, at)| at.min(sample));
        Some(self.b.next_timeout().map_or(saved, |t| t.min(saved)))
    }

    /// One pass of the loop after a poll, in the order of
    /// `broker/src/server.rs`: a turn, what the helper threads reported,
    /// the sampler, due timers, then output, closes and work handed out.
    pub fn iteration(&mut self, clock: &mut Clock, io: &mut dyn Sockets, driver: &mut dyn Driver) {
        self.turn(clock, io);
        if let Some((seq, _)) = self.saving.take_if(|(_, at)| *at <= clock.now) {
            let fails = self
                .state_fails
                .is_some_and(|(a, b)| (a..b).contains(&clock.now));
            let r = if fails {
                Err("/run/gpufrac/state/state.json: No space left on device".to_owned())
            } else {
                Ok(())
            };
            clock.run(|now| self.b.state_saved(now, seq, r));
        }
        if clock.now >= self.last_sample + SAMPLE_EVERY {
            self.last_sample = clock.now;
            let utilization = Some(driver.utilization(clock.now));
            let working = Some(driver.working(clock.now));
            let gpus = self
                .b
                .telemetry_uuids()
                .into_iter()
                .map(|u| {
                    let s = GpuSample {
                        utilization,
                        processes: Some(Vec::new()),
                        working: working.clone(),
                        memory: None,
                        health: None,
                    };
                    (u, s)
                })
                .collect();
            clock.run(|now| self.b.telemetry(now, Telemetry { gpus }));
        }
        if self.b.next_timeout().is_some_and(|t| t <= clock.now) {
            clock.run(|now| self.b.handle_timeout(now));
        }
        self.settle(clock, io);
    }

    /// A bounded number of accepts, then the core's turn, its reads done
    /// through `io` when it asks.
    fn turn(&mut self, clock: &mut Clock, io: &mut dyn Sockets) {
        if self.backlog {
            self.backlog = self.accept(clock, io);
        }
        let mut live = Live {
            io,
            meter: Meter::start(clock),
        };
        self.b.turn(&mut live);
        live.meter.finish(clock);
    }

    fn accept(&mut self, clock: &mut Clock, io: &mut dyn Sockets) -> bool {
        for _ in 0..ACCEPTS_PER_TURN {
            let Some((id, pid)) = io.accept() else {
                return false;
            };
            let (uid, ident) = {
                let h = self.host.borrow();
                (h.uid(pid), h.start_time(pid))
            };
            // A process already gone: the kernel cannot say who it was.
            let (Some(uid), Some(_)) = (uid, ident) else {
                io.close(id);
                continue;
            };
            let peer = Peer {
                pid,
                uid,
                gid: uid,
                groups: Vec::new(),
                ident,
            };
            match clock.run(|now| self.b.connect(now, id, peer)) {
                Err(frame) => {
                    io.write(id, &frame);
                    io.close(id);
                }
                Ok(()) => {
                    self.open.insert(id);
                }
            }
        }
        true
    }

    fn flush(&mut self, clock: &mut Clock, io: &mut dyn Sockets, id: ConnId) {
        loop {
            let out = self.b.output(id);
            if out.is_empty() {
                return;
            }
            match io.write(id, out) {
                Some(0) => return,
                Some(n) => clock.run(|_| self.b.consumed(id, n)),
                None => {
                    clock.run(|_| self.b.hangup(id));
                    return;
                }
            }
        }
    }

    fn settle(&mut self, clock: &mut Clock, io: &mut dyn Sockets) {
        loop {
            for id in self.b.pending_output() {
                self.flush(clock, io, id);
            }
            let dead = self.b.dead();
            if dead.is_empty() {
                break;
            }
            for id in dead {
                // Say what can still be said (an error frame) first.
                self.flush(clock, io, id);
                io.close(id);
                self.open.remove(&id);
                clock.run(|now| self.b.remove(now, id));
            }
            // Descriptors closed make room for the backlog.
            self.backlog = true;
        }
        while let Some(w) = self.b.poll_work() {
            let Work::Mig { lease, gpu, .. } = w;
            clock.run(|now| {
                self.b.mig_done(
                    now,
                    MigDone {
                        lease,
                        gpu,
                        destroyed: Vec::new(),
                        result: Err(("the broker has no MIG driver".into(), None)),
                    },
                )
            });
        }
        if let Some((seq, _bytes)) = clock.run(|now| self.b.take_state(now)) {
            self.saving = Some((seq, clock.now + STATE_WRITE));
        }
    }

    /// Status as `gpufrac status --json` would show it now.
    pub fn status(&self, now: Nanos) -> Status {
        self.b.status(now)
    }

    /// The GPUs the broker keeps state for (and asks the driver about).
    pub fn gpus_known(&self) -> Vec<String> {
        self.b.telemetry_uuids()
    }
}
