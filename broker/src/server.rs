//! The broker daemon: a thin socket layer around the scheduler and queue
//! state machines. One thread, one mio event loop; every client socket is
//! non-blocking with its own bounded output buffer, so a slow or stuck
//! client can only lose its own connection, never stall the others.

use crate::inventory::{self, Nvml, uuid_string};
use crate::queue::{self, Placement, Queue, QueueConfig, Request, Want};
use crate::sched::{Action, ClientState, Priority, SchedConfig, Scheduler};
use crate::status::{GpuStatus, LeaseEntry, ProcStatus, QueueEntry, Status};
use gpufrac_common::size::format_size;
use gpufrac_common::wire::{self, ClientMsg, DecodeError, Role, ServerMsg};
use mio::net::{UnixListener, UnixStream};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token};
use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::{debug, info, warn};

#[derive(Clone, Debug)]
pub struct BrokerOptions {
    pub socket: PathBuf,
    /// Contended timeslice between busy processes of one class, ns
    /// (default 20 ms).
    pub timeslice: u64,
    /// Most unfinished work a holder may keep queued while others share its
    /// GPU, ns (default 250 µs; 0: unbounded).
    pub inflight: u64,
    /// Group that may use the socket (mode 0660).
    pub group: Option<String>,
    /// Address for Prometheus metrics over HTTP, e.g. 127.0.0.1:9400.
    pub metrics: Option<String>,
    /// Queue escalation age, ns (default 1 h).
    pub escalate_after: u64,
    /// Logical GPUs per physical GPU (default 1).
    pub overprovision: u32,
    /// Allow committed memory beyond physical.
    pub overcommit: bool,
    /// Place fractions on the emptiest GPU instead of best fit.
    pub spread: bool,
}

impl Default for BrokerOptions {
    fn default() -> Self {
        BrokerOptions {
            socket: gpufrac_common::config::DEFAULT_SOCKET.into(),
            timeslice: SchedConfig::default().timeslice,
            inflight: SchedConfig::default().bound,
            group: None,
            metrics: None,
            escalate_after: 3600 * 1_000_000_000,
            overprovision: 1,
            overcommit: false,
            spread: false,
        }
    }
}

/// A client whose unsent output grows past this is not reading: drop it.
const MAX_OUTBUF: usize = 4 << 20;
/// Weight of a process that set no GPU_COMPUTE_SHARE: as if it asked 50%,
/// so two such processes split evenly and every share is a plain weight.
pub const DEFAULT_WEIGHT: f64 = 50.0;

const LISTENER: Token = Token(0);
const SIGNALS: Token = Token(1);
const FIRST_CLIENT: usize = 2;

static SIGNAL_PIPE: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_signal(_: libc::c_int) {
    let fd = SIGNAL_PIPE.load(Ordering::Relaxed);
    if fd >= 0 {
        // SAFETY: write(2) is async-signal-safe.
        unsafe { libc::write(fd, b"x".as_ptr().cast(), 1) };
    }
}

struct ClientDev {
    gpu: usize,
    ordinal: u32,
    cap: u64,
    used: u64,
    peak: u64,
    ooms: u64,
}

struct Conn {
    stream: UnixStream,
    id: u64,
    pid: u32,
    inbuf: Vec<u8>,
    outbuf: Vec<u8>,
    role: Option<Role>,
    command: String,
    devices: Vec<ClientDev>,
    share: Option<f64>,
    limit: Option<f64>,
    /// Queue request of a `gpufrac run`: last position told, lease start.
    queued: Option<u32>,
    leased_at: Option<Instant>,
    dead: bool,
    /// Registered for writability (output pending).
    want_write: bool,
}

struct Gpu {
    index: Option<u32>,
    uuid: [u8; 16],
    uuid_str: String,
    name: String,
    total_mem: u64,
    sched: Scheduler,
}

struct Server {
    opts: BrokerOptions,
    poll: Poll,
    listener: UnixListener,
    conns: HashMap<Token, Conn>,
    by_id: HashMap<u64, Token>,
    gpus: Vec<Gpu>,
    queue: Queue,
    nvml: Nvml,
    start: Instant,
    next_token: usize,
    metrics: Option<Arc<Mutex<String>>>,
    last_metrics: Instant,
    readbuf: Vec<u8>,
}

impl Server {
    fn now(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    fn sched_cfg(&self) -> SchedConfig {
        SchedConfig {
            timeslice: self.opts.timeslice,
            bound: self.opts.inflight,
            ..SchedConfig::default()
        }
    }

    fn gpu_by_uuid(&mut self, uuid: &[u8; 16], total: u64) -> usize {
        if let Some(i) = self.gpus.iter().position(|g| &g.uuid == uuid) {
            return i;
        }
        // A device the broker itself cannot see (hidden from it, or it runs
        // without a driver): arbitrate it all the same, by UUID.
        let cfg = self.sched_cfg();
        self.gpus.push(Gpu {
            index: None,
            uuid: *uuid,
            uuid_str: uuid_string(uuid),
            name: "unknown".into(),
            total_mem: total,
            sched: Scheduler::new(cfg),
        });
        self.gpus.len() - 1
    }

    fn send(&mut self, tok: Token, msg: &ServerMsg) {
        if let Some(c) = self.conns.get_mut(&tok) {
            wire::encode_server(msg, &mut c.outbuf);
            if c.outbuf.len() > MAX_OUTBUF {
                warn!(pid = c.pid, "client is not reading; disconnecting it");
                c.dead = true;
            }
        }
    }

    fn send_id(&mut self, id: u64, msg: &ServerMsg) {
        if let Some(&tok) = self.by_id.get(&id) {
            self.send(tok, msg);
        }
    }

    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((mut stream, _)) => {
                    let tok = Token(self.next_token);
                    self.next_token += 1;
                    let (pid, uid) = peer_cred(stream.as_raw_fd());
                    if let Err(e) =
                        self.poll
                            .registry()
                            .register(&mut stream, tok, Interest::READABLE)
                    {
                        warn!("register client: {e}");
                        continue;
                    }
                    let id = tok.0 as u64;
                    debug!(pid, uid, id, "client connected");
                    self.by_id.insert(id, tok);
                    self.conns.insert(
                        tok,
                        Conn {
                            stream,
                            id,
                            pid,
                            inbuf: Vec::new(),
                            outbuf: Vec::new(),
                            role: None,
                            command: cmdline(pid),
                            devices: Vec::new(),
                            share: None,
                            limit: None,
                            queued: None,
                            leased_at: None,
                            dead: false,
                            want_write: false,
                        },
                    );
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) => {
                    warn!("accept: {e}");
                    return;
                }
            }
        }
    }

    fn read(&mut self, tok: Token) {
        // One buffer for the whole loop, not a zeroed 16 KiB per read.
        let mut buf = std::mem::take(&mut self.readbuf);
        buf.resize(16 * 1024, 0);
        while let Some(c) = self.conns.get_mut(&tok) {
            match c.stream.read(&mut buf) {
                Ok(0) => {
                    c.dead = true;
                    break;
                }
                Ok(n) => {
                    c.inbuf.extend_from_slice(&buf[..n]);
                    // Never buffer more than one maximal frame of input.
                    if c.inbuf.len() > wire::MAX_FRAME as usize + 8 {
                        break;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => {
                    c.dead = true;
                    break;
                }
            }
        }
        self.readbuf = buf;
        self.process_input(tok);
    }

    fn process_input(&mut self, tok: Token) {
        loop {
            let Some(c) = self.conns.get_mut(&tok) else {
                return;
            };
            if c.dead || c.inbuf.is_empty() {
                return;
            }
            match wire::decode_client(&c.inbuf) {
                Ok((msg, used)) => {
                    c.inbuf.drain(..used);
                    self.handle(tok, msg);
                }
                Err(DecodeError::Incomplete) => return,
                Err(e) => {
                    let pid = c.pid;
                    warn!(pid, "bad frame ({e}); closing that client");
                    self.send(
                        tok,
                        &ServerMsg::Error {
                            code: wire::ERR_BAD_FRAME,
                            message: format!("bad frame: {e}"),
                        },
                    );
                    if let Some(c) = self.conns.get_mut(&tok) {
                        c.dead = true;
                    }
                    return;
                }
            }
        }
    }

    fn handle(&mut self, tok: Token, msg: ClientMsg) {
        let now = self.now();
        let Some(c) = self.conns.get_mut(&tok) else {
            return;
        };
        let id = c.id;
        if c.role.is_none() {
            match msg {
                ClientMsg::Hello {
                    magic,
                    version,
                    role,
                    ..
                } => {
                    let reply = wire::hello_reply(magic, version);
                    let ok = matches!(reply, ServerMsg::HelloOk { .. });
                    if ok {
                        c.role = Some(role);
                    } else {
                        warn!(
                            pid = c.pid,
                            version, "refusing client with another protocol version"
                        );
                        c.dead = true;
                    }
                    self.send(tok, &reply);
                }
                _ => {
                    c.dead = true;
                    self.send(
                        tok,
                        &ServerMsg::Error {
                            code: wire::ERR_BAD_FRAME,
                            message: "expected Hello first".into(),
                        },
                    );
                }
            }
            return;
        }
        match msg {
            ClientMsg::Hello { .. } => {}
            ClientMsg::Register {
                command,
                devices,
                share,
                limit,
                priority,
            } => {
                // A weight is a percentage: (0, 100]. Anything larger would
                // let one client declare itself the whole GPU (1e300 once
                // left a neighbour 52 kernels in 2924).
                let share = share
                    .filter(|s| s.is_finite() && *s > 0.0)
                    .map(|s| s.min(100.0));
                let limit = limit
                    .filter(|l| l.is_finite() && *l > 0.0)
                    .map(|l| (l / 100.0).min(1.0));
                if !command.is_empty() {
                    c.command = command;
                }
                c.share = share;
                c.limit = limit;
                let old: Vec<usize> = c.devices.drain(..).map(|d| d.gpu).collect();
                for g in old {
                    self.gpus[g].sched.remove_client(now, id);
                }
                let mut devs = Vec::new();
                for d in devices.iter().take(64) {
                    let g = self.gpu_by_uuid(&d.uuid, d.mem_total);
                    self.gpus[g].sched.add_client(
                        now,
                        id,
                        share.unwrap_or(DEFAULT_WEIGHT),
                        limit,
                        priority,
                    );
                    devs.push(ClientDev {
                        gpu: g,
                        ordinal: d.ordinal,
                        cap: d.mem_cap,
                        used: 0,
                        peak: 0,
                        ooms: 0,
                    });
                }
                if let Some(c) = self.conns.get_mut(&tok) {
                    info!(pid = c.pid, command = %c.command, devices = devs.len(), ?share, ?limit, %priority, "registered");
                    c.devices = devs;
                }
            }
            ClientMsg::Usage {
                uuid,
                used,
                peak,
                ooms,
            } => {
                if let Some(d) = c.devices.iter_mut().find(|d| self.gpus[d.gpu].uuid == uuid) {
                    // Reports are the client's word: never more than the
                    // GPU holds (a claim of 4 EiB used would skew status
                    // and every sum made from it).
                    let total = self.gpus[d.gpu].total_mem;
                    let cap = if total > 0 { total } else { u64::MAX };
                    d.used = used.min(cap);
                    d.peak = peak.min(cap).max(d.used);
                    d.ooms = ooms;
                }
            }
            ClientMsg::Acquire { uuid } => {
                debug!(pid = c.pid, "acquire");
                if let Some(d) = c.devices.iter().find(|d| self.gpus[d.gpu].uuid == uuid) {
                    let g = d.gpu;
                    self.gpus[g].sched.acquire(now, id);
                }
            }
            ClientMsg::Release { uuid, held_ns } => {
                debug!(pid = c.pid, held_us = held_ns / 1000, "release");
                if let Some(d) = c.devices.iter().find(|d| self.gpus[d.gpu].uuid == uuid) {
                    let g = d.gpu;
                    self.gpus[g].sched.release(now, id);
                }
            }
            ClientMsg::Drained { uuid } => {
                debug!(pid = c.pid, "drained");
                if let Some(d) = c.devices.iter().find(|d| self.gpus[d.gpu].uuid == uuid) {
                    let g = d.gpu;
                    self.gpus[g].sched.drained(now, id);
                }
            }
            ClientMsg::Status => {
                let json = serde_json::to_string(&self.status()).unwrap_or_default();
                self.send(tok, &ServerMsg::StatusReply { json });
            }
            ClientMsg::Lease {
                want_gpus,
                want_mem,
                compute,
                limit,
                no_wait,
                command,
                ..
            } => {
                if c.queued.is_some() || c.leased_at.is_some() {
                    self.send(
                        tok,
                        &ServerMsg::Refused {
                            reason: "one lease per connection".into(),
                        },
                    );
                    return;
                }
                let want = if want_gpus > 0 {
                    Want::Gpus(want_gpus)
                } else {
                    Want::Memory(want_mem)
                };
                if want_gpus == 0 && want_mem == 0 {
                    self.send(
                        tok,
                        &ServerMsg::Refused {
                            reason: "ask for --gpus N or --gpu-memory SIZE".into(),
                        },
                    );
                    return;
                }
                let label = if command.is_empty() {
                    c.command.clone()
                } else {
                    command
                };
                c.command = label.clone();
                // Percent on the wire, fractions in the queue.
                let req = Request {
                    want,
                    compute,
                    limit: limit.map(|l| l / 100.0),
                    label,
                };
                if no_wait {
                    match self.queue.try_now(now, id, req) {
                        Ok(lease) => self.deliver_lease(&lease),
                        Err(r) => self.send(tok, &ServerMsg::Refused { reason: r.reason }),
                    }
                } else {
                    match self.queue.submit(now, id, req) {
                        Ok(()) => {
                            if let Some(c) = self.conns.get_mut(&tok) {
                                c.queued = Some(0);
                            }
                        }
                        Err(r) => self.send(tok, &ServerMsg::Refused { reason: r.reason }),
                    }
                }
            }
        }
    }

    fn deliver_lease(&mut self, lease: &queue::Lease) {
        let uuids: Vec<[u8; 16]> = lease
            .uuids
            .iter()
            .map(|u| {
                self.gpus
                    .iter()
                    .find(|g| &g.uuid_str == u)
                    .map_or([0; 16], |g| g.uuid)
            })
            .collect();
        if let Some(&tok) = self.by_id.get(&lease.id) {
            if let Some(c) = self.conns.get_mut(&tok) {
                info!(pid = c.pid, gpus = ?lease.gpus, mem_cap = ?lease.mem_cap, "lease granted");
                c.queued = None;
                c.leased_at = Some(Instant::now());
            }
            self.send(
                tok,
                &ServerMsg::Leased {
                    gpus: lease.gpus.clone(),
                    uuids,
                    mem_cap: lease.mem_cap.unwrap_or(0),
                },
            );
        }
    }

    /// Everything the state machines decided since the last turn.
    fn pump(&mut self) {
        let now = self.now();
        for g in 0..self.gpus.len() {
            if self.gpus[g].sched.next_timeout().is_some_and(|t| t <= now) {
                self.gpus[g].sched.handle_timeout(now);
            }
            while let Some(a) = self.gpus[g].sched.poll_action() {
                let uuid = self.gpus[g].uuid;
                debug!(?a, "scheduler");
                match a {
                    Action::Grant {
                        client,
                        grant,
                        slice,
                        bound,
                        waiters,
                    } => self.send_id(
                        client,
                        &ServerMsg::Grant {
                            uuid,
                            grant,
                            slice_ns: slice.unwrap_or(0),
                            bound_ns: bound,
                            waiters,
                        },
                    ),
                    Action::Revoke { client, grant } => {
                        self.send_id(client, &ServerMsg::Revoke { uuid, grant })
                    }
                }
            }
        }
        for lease in self.queue.poll(now) {
            self.deliver_lease(&lease);
        }
        for w in self.queue.waiting(now) {
            let pos = w.position as u32;
            let Some(&tok) = self.by_id.get(&w.id) else {
                continue;
            };
            let changed = self.conns.get(&tok).is_some_and(|c| c.queued != Some(pos));
            if changed {
                let waiting_for = describe(&w.want);
                if let Some(c) = self.conns.get_mut(&tok) {
                    c.queued = Some(pos);
                }
                self.send(
                    tok,
                    &ServerMsg::Queued {
                        position: pos,
                        waiting_for,
                    },
                );
            }
        }
    }

    fn flush(&mut self, tok: Token) {
        let Some(c) = self.conns.get_mut(&tok) else {
            return;
        };
        while !c.outbuf.is_empty() {
            match c.stream.write(&c.outbuf) {
                Ok(0) => {
                    c.dead = true;
                    break;
                }
                Ok(n) => {
                    c.outbuf.drain(..n);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => {
                    c.dead = true;
                    break;
                }
            }
        }
        // Ask for writability only while output is pending, and tell epoll
        // only when that changes: a syscall per flush is most of the cost of
        // a grant otherwise.
        let pending = !c.outbuf.is_empty();
        if pending != c.want_write {
            c.want_write = pending;
            let want = if pending {
                Interest::READABLE | Interest::WRITABLE
            } else {
                Interest::READABLE
            };
            let _ = self.poll.registry().reregister(&mut c.stream, tok, want);
        }
    }

    fn reap(&mut self) {
        let now = self.now();
        let dead: Vec<Token> = self
            .conns
            .iter()
            .filter(|(_, c)| c.dead)
            .map(|(t, _)| *t)
            .collect();
        for tok in dead {
            // Say what we still can (an error frame) before closing.
            self.flush(tok);
            let Some(mut c) = self.conns.remove(&tok) else {
                continue;
            };
            let _ = self.poll.registry().deregister(&mut c.stream);
            self.by_id.remove(&c.id);
            for d in &c.devices {
                self.gpus[d.gpu].sched.remove_client(now, c.id);
            }
            self.queue.cancel(now, c.id);
            self.queue.release(now, c.id);
            if !c.devices.is_empty() || c.leased_at.is_some() {
                info!(pid = c.pid, command = %c.command, "client gone");
            }
        }
    }

    /// Runs the state machines and the sockets to a fixed point: removing
    /// a dead client can produce a grant for another, sending can reveal a
    /// dead client, and every such consequence must go out this turn (there
    /// may be no timer to bring the loop back).
    fn settle(&mut self, touched: Vec<Token>) {
        let mut touched = touched;
        loop {
            self.reap();
            self.pump();
            let toks: Vec<Token> = self
                .conns
                .iter()
                .filter(|(_, c)| !c.outbuf.is_empty())
                .map(|(t, _)| *t)
                .collect();
            for t in toks.into_iter().chain(touched.drain(..)) {
                self.flush(t);
            }
            if !self.conns.values().any(|c| c.dead) {
                return;
            }
        }
    }

    fn next_wakeup(&self) -> Option<Duration> {
        let now = self.now();
        let mut t = self
            .gpus
            .iter()
            .filter_map(|g| g.sched.next_timeout())
            .min();
        // Queue escalation has no timer of its own: re-check while anyone
        // waits, and refresh metrics.
        if !self.queue.waiting(now).is_empty() || self.metrics.is_some() {
            let tick = now + 500_000_000;
            t = Some(t.map_or(tick, |x| x.min(tick)));
        }
        t.map(|t| Duration::from_nanos(t.saturating_sub(now)))
    }

    fn status(&self) -> Status {
        let now = self.now();
        let leases = self.queue.leases();
        let mut gpus = Vec::new();
        for g in &self.gpus {
            let st = g.sched.status(now);
            let driver_mem = self.nvml.process_memory(&g.uuid_str);
            let mut processes = Vec::new();
            for c in self.conns.values() {
                let Some(d) = c.devices.iter().find(|d| self.gpus[d.gpu].uuid == g.uuid) else {
                    continue;
                };
                let s = st.iter().find(|s| s.client == c.id);
                processes.push(ProcStatus {
                    pid: c.pid,
                    command: c.command.clone(),
                    ordinal: d.ordinal,
                    mem_used: d.used,
                    mem_peak: d.peak,
                    mem_cap: (d.cap > 0).then_some(d.cap),
                    driver_mem: driver_mem
                        .iter()
                        .find(|(p, _)| *p == c.pid)
                        .map(|&(_, b)| b),
                    ooms: d.ooms,
                    share_target: s.map_or(0.0, |s| s.target),
                    share_achieved: s.map_or(0.0, |s| s.achieved),
                    limit: c.limit,
                    state: s.map_or("idle".into(), |s| match s.state {
                        ClientState::Idle => "idle".into(),
                        ClientState::Waiting => "waiting".into(),
                        ClientState::Holding => "holding".into(),
                        ClientState::Revoking if s.hung => "hung".into(),
                        ClientState::Revoking => "revoking".into(),
                    }),
                    priority: s.map_or(Priority::Normal, |s| s.priority).as_str().into(),
                    gpu_time_s: s.map_or(0.0, |s| s.gpu_time as f64 / 1e9),
                    draining: s.is_some_and(|s| s.draining),
                });
            }
            processes.sort_by_key(|p| p.pid);
            let ls = g.index.and_then(|i| leases.iter().find(|l| l.index == i));
            gpus.push(GpuStatus {
                index: g.index,
                uuid: g.uuid_str.clone(),
                name: g.name.clone(),
                total_mem: g.total_mem,
                slots_total: ls.map_or(self.opts.overprovision, |l| l.slots_total),
                slots_used: ls.map_or(0, |l| l.slots_used),
                committed_mem: ls.map_or(0, |l| l.committed_mem),
                utilization: self.nvml.utilization(&g.uuid_str),
                holder: g
                    .sched
                    .holder()
                    .and_then(|h| self.by_id.get(&h))
                    .and_then(|t| self.conns.get(t))
                    .map(|c| c.pid),
                processes,
            });
        }
        let queue = self
            .queue
            .waiting(now)
            .into_iter()
            .map(|w| {
                let pid = self
                    .by_id
                    .get(&w.id)
                    .and_then(|t| self.conns.get(t))
                    .map_or(0, |c| c.pid);
                QueueEntry {
                    position: w.position as u32,
                    pid,
                    command: w.label.clone(),
                    wants: describe(&w.want),
                    waiting_s: w.waited as f64 / 1e9,
                    escalated: w.escalated,
                }
            })
            .collect();
        let leases = self
            .conns
            .values()
            .filter_map(|c| {
                let l = self.queue.lease(c.id)?;
                Some(LeaseEntry {
                    pid: c.pid,
                    command: c.command.clone(),
                    gpus: l.gpus.clone(),
                    mem_cap: l.mem_cap,
                    held_s: c.leased_at.map_or(0.0, |t| t.elapsed().as_secs_f64()),
                })
            })
            .collect();
        Status {
            version: env!("CARGO_PKG_VERSION").into(),
            socket: self.opts.socket.display().to_string(),
            timeslice_ms: self.opts.timeslice as f64 / 1e6,
            inflight_us: self.opts.inflight as f64 / 1e3,
            overprovision: self.opts.overprovision,
            gpus,
            queue,
            leases,
        }
    }

    fn refresh_metrics(&mut self) {
        let Some(m) = self.metrics.clone() else {
            return;
        };
        if self.last_metrics.elapsed() < Duration::from_millis(500) {
            return;
        }
        self.last_metrics = Instant::now();
        let text = render_metrics(&self.status());
        *m.lock().unwrap_or_else(|e| e.into_inner()) = text;
    }
}

fn describe(w: &Want) -> String {
    match w {
        Want::Gpus(1) => "1 GPU".into(),
        Want::Gpus(n) => format!("{n} GPUs"),
        Want::Memory(b) => format!("{} of GPU memory", format_size(*b)),
    }
}

fn peer_cred(fd: i32) -> (u32, u32) {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt into a correctly sized ucred.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc == 0 {
        (cred.pid as u32, cred.uid)
    } else {
        (0, 0)
    }
}

fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            b.split(|&c| c == 0)
                .filter(|s| !s.is_empty())
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

fn render_metrics(s: &Status) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "# HELP gpufrac_gpu_memory_total_bytes Physical memory of the GPU."
    );
    let _ = writeln!(o, "# TYPE gpufrac_gpu_memory_total_bytes gauge");
    for g in &s.gpus {
        let _ = writeln!(
            o,
            "gpufrac_gpu_memory_total_bytes{{uuid=\"{}\"}} {}",
            g.uuid, g.total_mem
        );
    }
    let _ = writeln!(o, "# TYPE gpufrac_gpu_memory_committed_bytes gauge");
    for g in &s.gpus {
        let _ = writeln!(
            o,
            "gpufrac_gpu_memory_committed_bytes{{uuid=\"{}\"}} {}",
            g.uuid, g.committed_mem
        );
    }
    let _ = writeln!(o, "# TYPE gpufrac_gpu_processes gauge");
    for g in &s.gpus {
        let _ = writeln!(
            o,
            "gpufrac_gpu_processes{{uuid=\"{}\"}} {}",
            g.uuid,
            g.processes.len()
        );
    }
    for (name, help) in [
        (
            "gpufrac_process_memory_used_bytes",
            "Memory charged to the process by the shim.",
        ),
        (
            "gpufrac_process_share_target",
            "Compute share promised when contended (0..1).",
        ),
        (
            "gpufrac_process_share_achieved",
            "Compute share held over the last window (0..1).",
        ),
        (
            "gpufrac_process_ooms_total",
            "Allocations refused by the memory cap.",
        ),
        (
            "gpufrac_process_gpu_seconds_total",
            "GPU time charged to the process (split evenly while shared).",
        ),
    ] {
        let _ = writeln!(o, "# HELP {name} {help}");
        let _ = writeln!(
            o,
            "# TYPE {name} {}",
            if name.ends_with("_total") {
                "counter"
            } else {
                "gauge"
            }
        );
        for g in &s.gpus {
            for p in &g.processes {
                let v = match name {
                    "gpufrac_process_memory_used_bytes" => p.mem_used as f64,
                    "gpufrac_process_share_target" => p.share_target,
                    "gpufrac_process_share_achieved" => p.share_achieved,
                    "gpufrac_process_gpu_seconds_total" => p.gpu_time_s,
                    _ => p.ooms as f64,
                };
                let _ = writeln!(
                    o,
                    "{name}{{uuid=\"{}\",pid=\"{}\",priority=\"{}\"}} {v}",
                    g.uuid, p.pid, p.priority
                );
            }
        }
    }
    let _ = writeln!(o, "# TYPE gpufrac_queue_waiting gauge");
    let _ = writeln!(o, "gpufrac_queue_waiting {}", s.queue.len());
    o
}

fn serve_metrics(addr: &str, text: Arc<Mutex<String>>) -> Result<(), String> {
    let l =
        std::net::TcpListener::bind(addr).map_err(|e| format!("metrics address {addr}: {e}"))?;
    info!(%addr, "serving Prometheus metrics at /metrics");
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { continue };
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let mut req = [0u8; 1024];
                let n = s.read(&mut req).unwrap_or(0);
                let path_ok = req[..n].starts_with(b"GET /metrics");
                let body = if path_ok { text.lock().unwrap_or_else(|e| e.into_inner()).clone() } else { String::new() };
                let head = if path_ok { "200 OK" } else { "404 Not Found" };
                let _ = write!(
                    s,
                    "HTTP/1.1 {head}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        })
        .map_err(|e| e.to_string())?;
    Ok(())
}

fn bind(opts: &BrokerOptions) -> Result<UnixListener, String> {
    let path = &opts.socket;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        // Only ever remove a stale socket: a typo in --socket must not
        // delete someone's file.
        if !meta.file_type().is_socket() {
            return Err(format!(
                "{} exists and is not a socket; remove it yourself or choose another --socket path",
                path.display()
            ));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(format!(
                "another broker is already listening on {}",
                path.display()
            ));
        }
        // A stale socket from a broker that died.
        let _ = std::fs::remove_file(path);
    }
    let l = UnixListener::bind(path)
        .map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .map_err(|e| format!("chmod {}: {e}", path.display()))?;
    if let Some(group) = &opts.group {
        let cname =
            std::ffi::CString::new(group.as_str()).map_err(|_| "bad group name".to_string())?;
        // SAFETY: getgrnam with a valid C string; we copy gr_gid at once.
        let gr = unsafe { libc::getgrnam(cname.as_ptr()) };
        if gr.is_null() {
            return Err(format!("--group {group}: no such group"));
        }
        let gid = unsafe { (*gr).gr_gid };
        let cpath = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| "bad socket path")?;
        // SAFETY: chown of our own socket file; -1 keeps the owner.
        if unsafe { libc::chown(cpath.as_ptr(), u32::MAX, gid) } != 0 {
            return Err(format!(
                "chown {} to group {group}: {}",
                path.display(),
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(l)
}

/// Runs the broker until SIGTERM/SIGINT. Returns an error message meant for
/// the user (e.g. the socket is already in use).
pub fn run(opts: BrokerOptions) -> Result<(), String> {
    if opts.overprovision == 0 {
        return Err("--overprovision must be at least 1".into());
    }
    let found = match inventory::discover() {
        Ok(g) => g,
        Err(e) => {
            warn!(
                "{e}; no GPUs to queue for (compute arbitration still works for clients that register)"
            );
            Vec::new()
        }
    };
    for g in &found {
        info!(index = g.index, name = %g.name, uuid = %uuid_string(&g.uuid), total = %format_size(g.total_mem), "GPU");
    }
    let listener = bind(&opts)?;
    let poll = Poll::new().map_err(|e| e.to_string())?;
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 into a 2-int array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
        return Err("pipe2 failed".into());
    }
    SIGNAL_PIPE.store(fds[1], Ordering::Relaxed);
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: installing a handler that only writes to a pipe.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as usize;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
    // SAFETY: a peer that disappears mid-write must not kill the broker.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    let mut listener = listener;
    poll.registry()
        .register(&mut listener, LISTENER, Interest::READABLE)
        .map_err(|e| e.to_string())?;
    poll.registry()
        .register(&mut SourceFd(&fds[0]), SIGNALS, Interest::READABLE)
        .map_err(|e| e.to_string())?;
    let metrics = match &opts.metrics {
        Some(addr) => {
            let m = Arc::new(Mutex::new(String::new()));
            serve_metrics(addr, m.clone())?;
            Some(m)
        }
        None => None,
    };
    let qgpus = found
        .iter()
        .map(|g| queue::GpuInfo {
            index: g.index,
            uuid: uuid_string(&g.uuid),
            total_mem: g.total_mem,
        })
        .collect();
    let qcfg = QueueConfig {
        escalate_after: opts.escalate_after,
        overprovision: opts.overprovision,
        overcommit: opts.overcommit,
        placement: if opts.spread {
            Placement::Spread
        } else {
            Placement::BestFit
        },
    };
    let sched = SchedConfig {
        timeslice: opts.timeslice,
        bound: opts.inflight,
        ..SchedConfig::default()
    };
    let mut s = Server {
        poll,
        listener,
        conns: HashMap::new(),
        by_id: HashMap::new(),
        gpus: found
            .iter()
            .map(|g| Gpu {
                index: Some(g.index),
                uuid: g.uuid,
                uuid_str: uuid_string(&g.uuid),
                name: g.name.clone(),
                total_mem: g.total_mem,
                sched: Scheduler::new(sched),
            })
            .collect(),
        queue: Queue::new(qgpus, qcfg),
        nvml: Nvml::open(),
        start: Instant::now(),
        next_token: FIRST_CLIENT,
        metrics,
        last_metrics: Instant::now() - Duration::from_secs(1),
        readbuf: Vec::new(),
        opts,
    };
    info!(socket = %s.opts.socket.display(), timeslice_ms = s.opts.timeslice as f64 / 1e6, "broker ready");
    let mut events = Events::with_capacity(256);
    let result = loop {
        let timeout = s.next_wakeup();
        if let Err(e) = s.poll.poll(&mut events, timeout) {
            if e.kind() == ErrorKind::Interrupted {
                continue;
            }
            break Err(format!("poll: {e}"));
        }
        let mut stop = false;
        let mut touched = Vec::new();
        for ev in events.iter() {
            match ev.token() {
                LISTENER => s.accept(),
                SIGNALS => stop = true,
                tok => {
                    if ev.is_readable() || ev.is_read_closed() {
                        s.read(tok);
                    }
                    touched.push(tok);
                }
            }
        }
        if stop {
            info!("shutting down");
            break Ok(());
        }
        s.settle(touched);
        s.refresh_metrics();
    };
    let _ = std::fs::remove_file(&s.opts.socket);
    result
}
