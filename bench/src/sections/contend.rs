//! Section 4's rows that contend. Every client always asks: Acquire again
//! as soon as it let go, so the broker always has a full line of waiters,
//! which the periodic rows (20% offered load) rarely give it. Beside them
//! a client of another user asks every 20 ms: how long one user's grants
//! take beside another's population. And a churning queue: 1,000 requests
//! waiting in the admission queue, 100 a second arriving and leaving,
//! beside 64 clients that always ask, in 1 s windows with and without
//! the churn taken in turn; then the same queue alone, 1,000 a second, in
//! windows without churn, with bare connections coming and going, with
//! the churn and after it: the parts of an arrival-and-departure.

use super::f;
use super::queue::{Churn, Kind, Pattern, churn_counts, spawn_queue};
use super::shims::{Clients, Cycle, HOLD_NS, MS, collect, gpu_uuids, spawn_clients, start_broker};
use gpufrac_bench::clock::{mono_ns, sleep_until};
use gpufrac_bench::harness::{Artifacts, cpu_seconds_precise, sleeps};
use gpufrac_bench::report::{Check, Section, Table};
use gpufrac_bench::stats::{median, percentile_u64};
use std::time::Duration;

/// How often the other user's client asks.
const OTHER_PERIOD_NS: u64 = 20 * MS;
const OTHER_P99_TARGET_NS: u64 = 5 * MS;
/// CPU per grant with 1,000 clients that always ask, against 64: at most.
const FLAT_RATIO: f64 = 2.0;
/// Requests waiting in the churning queue, and arrivals (each with a
/// departure) a second.
const QUEUED: usize = 1000;
const CHURN_PER_S: u64 = 100;
/// Broker CPU a churn's arrival-and-departure may add: at most.
const CHURN_TARGET_S: f64 = 0.2e-3;
/// Clients that always ask beside the churning queue.
const BESIDE: usize = 64;
/// The churn's windows beside them: quiet and churn in turn, this long
/// each, and this many churn windows (each between two quiet ones). With
/// 40 the standard error was 0.02 ms on this machine, a tenth of the
/// target: the whole interval could not be under it unless the mean was
/// under 0.16 ms; 80 halve the variance.
const ALTERNATE_NS: u64 = 1000 * MS;
const CHURN_WINDOWS: u64 = 80;
/// The parts' run: the same queue with no clients beside it, this many
/// arrivals (each with a departure) a second, where a connection's life
/// and a request's part stand well clear of the host's noise.
const PARTS_PER_S: u64 = 1000;
const NOBODY: u32 = 65534;

/// The tables, targets, notes and raw figures these rows add to section 4.
pub(super) struct Contended {
    pub tables: Vec<Table>,
    pub checks: Vec<Check>,
    pub notes: Vec<String>,
    pub data: serde_json::Value,
}

/// The other user and the broker options that let it in: `nobody`, in
/// the socket's group, when the bench runs as root; else the bench's own
/// user (the notes say so).
fn other_user() -> (Option<u32>, &'static [&'static str]) {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        (Some(NOBODY), &["--group", "nogroup"])
    } else {
        (None, &[])
    }
}

/// Which of these rows a run takes.
#[derive(Clone, Copy)]
pub(super) struct Parts {
    /// 64 and 1,000 clients that always ask, on 1 and 8 GPUs.
    pub always_asking: bool,
    /// The churning queue.
    pub churn: bool,
}

impl Parts {
    pub const ALL: Parts = Parts {
        always_asking: true,
        churn: true,
    };
}

/// These rows alone, as a section of their own (`--only contend` or
/// `--only churn`: quicker to measure again than the whole of section 4).
fn section(
    a: &Artifacts,
    quick: bool,
    parts: Parts,
    (key, title): (&'static str, &str),
) -> Result<Section, String> {
    let c = run(a, quick, parts)?;
    Ok(Section {
        key,
        title: title.into(),
        method: vec!["As in section 4 of the full run.".into()],
        tables: c.tables,
        checks: c.checks,
        notes: c.notes,
        error: None,
        steal_pct: None,
        data: Some(c.data),
        plots: Vec::new(),
    })
}

pub const CONTEND_TITLE: &str = "4. Broker scale: every client always asks";
pub const CHURN_TITLE: &str = "4. Broker scale: the churning queue";

/// Section 4's rows where every client always asks, alone.
pub fn contend_section(a: &Artifacts, quick: bool) -> Result<Section, String> {
    let parts = Parts {
        always_asking: true,
        churn: false,
    };
    section(a, quick, parts, ("contend", CONTEND_TITLE))
}

/// Section 4's churning queue, alone.
pub fn churn_section(a: &Artifacts, quick: bool) -> Result<Section, String> {
    let parts = Parts {
        always_asking: false,
        churn: true,
    };
    section(a, quick, parts, ("churn", CHURN_TITLE))
}

pub(super) fn run(a: &Artifacts, quick: bool, parts: Parts) -> Result<Contended, String> {
    let window_ns = if quick { 1500 * MS } else { 4000 * MS };
    // 64 and 1,000 alternately, twice unless quick: the ratio is between
    // runs taken side by side.
    let rounds = if quick { 1 } else { 2 };
    let mut t = Table::new(
        &format!(
            "{:.1} s window per row; every client always asks (Acquire again as soon as it \
             released, holding {} us); another user's client asks every {} ms beside them",
            window_ns as f64 / 1e9,
            HOLD_NS / 1000,
            OTHER_PERIOD_NS / MS
        ),
        &[
            "GPUs",
            "clients",
            "as",
            "grants/s",
            "grant p50",
            "grant p99",
            "other user's p50",
            "other user's p99",
            "other user's max",
            "broker CPU",
            "CPU/grant",
        ],
    );
    let mut checks = Vec::new();
    let mut notes = Vec::new();
    let mut points = Vec::new();
    let gpu_counts: &[usize] = if parts.always_asking { &[1, 8] } else { &[] };
    for &gpus in gpu_counts {
        // (CPU seconds, grants) summed over the rounds, per population,
        // and the other user's latencies at 1,000.
        let mut sums = [(0.0f64, 0.0f64); 2];
        let mut others_1000 = Vec::new();
        for _ in 0..rounds {
            for (k, n) in [64usize, 1000].into_iter().enumerate() {
                let r = contend(a, gpus, n, window_ns)?;
                let mut lat: Vec<u64> = r.cycles.iter().map(|c| c.grant - c.acquire).collect();
                let mut other: Vec<u64> = r.other.iter().map(|c| c.grant - c.acquire).collect();
                let grants = (lat.len() + other.len()) as f64;
                let grants_s = grants / r.secs;
                sums[k].0 += r.cpu_per_s * r.secs;
                sums[k].1 += grants;
                let p = |v: &mut Vec<u64>, q: f64| percentile_u64(v, q).unwrap_or(0);
                let (p50, p99) = (p(&mut lat, 50.0), p(&mut lat, 99.0));
                let (o50, o99) = (p(&mut other, 50.0), p(&mut other, 99.0));
                let omax = other.last().copied().unwrap_or(0);
                t.row(vec![
                    gpus.to_string(),
                    n.to_string(),
                    r.layout.clone(),
                    f(grants_s, 0),
                    ms(p50),
                    ms(p99),
                    ms(o50),
                    ms(o99),
                    ms(omax),
                    format!("{} ms/s", f(r.cpu_per_s * 1e3, 1)),
                    format!("{} us", f(r.cpu_per_s * 1e6 / grants_s.max(1e-9), 1)),
                ]);
                points.push(serde_json::json!({
                    "gpus": gpus,
                    "clients": n,
                    "grants_per_s": grants_s,
                    "grant_p50_us": p50 as f64 / 1e3,
                    "grant_p99_us": p99 as f64 / 1e3,
                    "other_p50_us": o50 as f64 / 1e3,
                    "other_p99_us": o99 as f64 / 1e3,
                    "other_grants": other.len(),
                    "cpu_per_grant_us": r.cpu_per_s * 1e6 / grants_s.max(1e-9),
                }));
                if n == 1000 {
                    others_1000.extend(other);
                }
                if r.errors > 0 {
                    notes.push(format!(
                        "{gpus} GPU(s), {n} clients that always ask: {} client error(s)",
                        r.errors
                    ));
                }
            }
        }
        let per_grant = |(cpu, grants): (f64, f64)| cpu / grants.max(1.0);
        let ratio = per_grant(sums[1]) / per_grant(sums[0]).max(1e-12);
        checks.push(Check::new(
            &format!(
                "broker CPU per grant, 1,000 against 64 clients that always ask, {gpus} GPU(s)"
            ),
            format!(
                "{}× ({} against {} us)",
                f(ratio, 2),
                f(per_grant(sums[1]) * 1e6, 1),
                f(per_grant(sums[0]) * 1e6, 1)
            ),
            &format!("≤ {}×", f(FLAT_RATIO, 1)),
            ratio <= FLAT_RATIO,
        ));
        let o99 = percentile_u64(&mut others_1000, 99.0).unwrap_or(u64::MAX);
        checks.push(Check::new(
            &format!(
                "another user's grant p99 beside 1,000 clients that always ask, {gpus} GPU(s)"
            ),
            ms(o99),
            &format!("≤ {} ms", OTHER_P99_TARGET_NS / MS),
            o99 <= OTHER_P99_TARGET_NS,
        ));
    }
    let mut tables = Vec::new();
    let mut data = serde_json::Map::new();
    let (uid, _) = other_user();
    if parts.always_asking {
        tables.push(t);
        data.insert("always_asking".into(), points.into());
        notes.push(always_asking_note(uid.is_some(), rounds));
    }
    if parts.churn {
        // The contending clients' own CPU drifts by tens of ms/s over
        // seconds on a shared machine: short windows in turn, each churn
        // window against its neighbours, which drift alike.
        let n = if quick { 10 } else { CHURN_WINDOWS };
        let beside = Churning {
            window_ns: ALTERNATE_NS,
            windows: 2 * n + 1,
            per_s: CHURN_PER_S,
            beside: BESIDE,
            pattern: Pattern::Alternate,
        };
        let (churn_tables, churn_checks, mut churn_data) = churn_report(&churn(a, &beside)?);
        checks.extend(churn_checks);
        tables.extend(churn_tables);
        let alone = Churning {
            window_ns: if quick { 1000 * MS } else { 2000 * MS },
            windows: 8,
            per_s: PARTS_PER_S,
            beside: 0,
            pattern: Pattern::Parts,
        };
        let (parts_table, parts_data) = parts_report(&churn(a, &alone)?);
        tables.push(parts_table);
        churn_data["parts"] = parts_data;
        data.insert("churn".into(), churn_data);
        notes.push(churn_note(n));
    }
    Ok(Contended {
        tables,
        checks,
        notes,
        data: data.into(),
    })
}

/// What the rows that always ask are, for the notes.
fn always_asking_note(nobody: bool, rounds: usize) -> String {
    format!(
        "Rows that contend: a client that always asks sends Acquire again as soon as it sent \
         Release (and Drained), so every client of a GPU is always waiting or holding; the \
         broker's line of waiters is the whole population. The other user's client is {} \
         registered on GPU 0, asking every {} ms and holding {} us. CPU per grant at 1,000 \
         against 64 is the sum of broker CPU over the sum of grants of the {} run(s) of \
         each, taken alternately.",
        if nobody {
            "uid 65534 (`nobody`)"
        } else {
            "the bench's own user (not root: no other uid to run as)"
        },
        OTHER_PERIOD_NS / MS,
        HOLD_NS / 1000,
        rounds
    )
}

/// What the churning queue is, for the notes.
fn churn_note(n: u64) -> String {
    format!(
        "The churning queue: a lease holding 1 GiB of the GPU and {QUEUED} `--gpu-memory 16G` \
         requests waiting behind it, {BESIDE} clients that always ask and the other user's \
         client, on one broker. In a churn window, {CHURN_PER_S} times a second a new request \
         connects, asks and is queued, and a random waiting one disconnects (its request \
         leaves the queue). Quiet and churn windows of {quiet} s come in turn, {n} churn \
         windows each between two quiet ones; *added per arrival-and-departure*: each churn \
         window's broker CPU less the mean of the quiet windows either side of it, over its \
         rate, and the mean of those (the target's figure, met only when its whole 95% \
         interval is under the target). *less the grants served*: the churn windows serve \
         more of the clients' grants than their neighbours (the broker, woken more often, \
         is awake when more of them ask); the same figure less that work, at what a grant \
         costs across the quiet windows (the slope of their CPU on their grants), to say \
         what the churn itself costs; the target is the first figure's. The machine's slow \
         drifts (the clients' grants a second move by a third over tens of seconds here, \
         and the broker's CPU with them) move a window and its neighbours alike; the earlier design, a quiet, a churn and \
         an after window of 4 s each compared by their medians four times over, read 0.197 \
         to 0.343 ms on this machine with a standard error near 0.13 ms. The requests the \
         churn moved are told their places (each at most once every 5 s, or 50 ms per place where that is longer) in the quiet \
         windows too; the parts' run measures what that costs. *The parts*: the same queue \
         with nobody beside it, {PARTS_PER_S} arrivals and departures a second, in quiet, \
         bare, churn and after windows in turn, compared by their medians: in the bare \
         windows a connection says Hello, is answered and stays, and the one before it \
         closes (a connection's life with no request in it); nothing arrives in an after \
         window, but the places the churn moved are told then. *a bare connection's life*: \
         the bare windows' CPU less the quiet ones', over their rate: the kernel's work for \
         a connection (the accept, the credentials, the pidfd and its inode (or, \
         without pidfs, the `/proc` read) that marks the process, the closes, the wakes) and the broker's for its Hello; \
         *its request*: the churn and after windows' CPU less twice the quiet ones', over \
         the churn's rate, less the bare connection's part. *broker wakes*: its threads' \
         voluntary context switches (each sleep ends in a wake, which the kernel charges \
         to the broker). *position updates*: Queued messages the waiting requests read \
         (every 50 ms). The lease and the requests are a process of their own \
         (`gpufrac-bench queue-client`), never the clients' parent: the broker counts a \
         run's descendants into its job, and with the bench itself as the holder every \
         client, the other user's too, was one of that job's processes (its p99 then \
         measured 64 processes of one job taking turns, 20 ms).",
        quiet = f(ALTERNATE_NS as f64 / 1e9, 0),
    )
}

fn ms(ns: u64) -> String {
    format!("{} ms", f(ns as f64 / 1e6, 2))
}

/// One row that contends.
struct Contend {
    /// The cycles of the clients that always ask, and of the other user's.
    cycles: Vec<Cycle>,
    other: Vec<Cycle>,
    cpu_per_s: f64,
    secs: f64,
    layout: String,
    errors: u64,
}

/// `n` clients that always ask on `gpus` GPUs, and the other user's
/// client, for `window_ns`.
fn contend(a: &Artifacts, gpus: usize, n: usize, window_ns: u64) -> Result<Contend, String> {
    let (uid, more) = other_user();
    let broker = start_broker(a, gpus, more)?;
    let uuids = gpu_uuids(&broker, gpus)?;
    let lead = 1000 * MS + n as u64 * 10 * MS;
    let start = mono_ns() + lead;
    let end = start + window_ns;
    let clients = |n, period, uuids, uid| Clients {
        n,
        start,
        end,
        period,
        uuids,
        uid,
    };
    let (kids, layout) = spawn_clients(a, &broker, clients(n, 0, &uuids, None))?;
    let (theirs, _) = spawn_clients(a, &broker, clients(1, OTHER_PERIOD_NS, &uuids[..1], uid))?;
    let pid = broker.pid();
    let cpu = || cpu_seconds_precise(pid).ok_or("broker /proc/stat");
    sleep_until(start + 100 * MS);
    let (c0, t0) = (cpu()?, mono_ns());
    sleep_until(end);
    let (c1, t1) = (cpu()?, mono_ns());
    let span = Duration::from_nanos(lead + window_ns);
    let (cycles, mut errors) = collect(kids, span)?;
    let (other, e) = collect(theirs, span)?;
    errors += e;
    let secs = (t1 - t0) as f64 / 1e9;
    // Grants within the window CPU was read over.
    let within = |c: &Cycle| c.grant >= t0 && c.grant < t1;
    Ok(Contend {
        cycles: cycles.into_iter().filter(within).collect(),
        other: other.into_iter().filter(within).collect(),
        cpu_per_s: (c1 - c0) / secs,
        secs,
        layout,
        errors,
    })
}

/// One window of the churning queue's run.
struct Window {
    kind: Kind,
    cpu_per_s: f64,
    /// Arrivals (each with a departure) and Queued messages read, a
    /// second: counted over the whole window, whose first 100 ms the CPU
    /// is not read over (over that part they would say 11% more a second
    /// in a 1 s window than came).
    pairs_per_s: f64,
    told_per_s: f64,
    /// Grants of the clients that always ask, a second, over the part of
    /// the window the CPU is read over.
    grants_per_s: f64,
    other: Vec<u64>,
    /// The broker's sleeps (voluntary context switches) a second: a wake
    /// each.
    wakes_per_s: f64,
}

impl Window {
    /// Its raw figures, for the JSON.
    fn json(&self) -> serde_json::Value {
        let mut other = self.other.clone();
        serde_json::json!({
            "kind": self.kind.word(),
            "pairs_per_s": self.pairs_per_s,
            "position_updates_per_s": self.told_per_s,
            "grants_per_s": self.grants_per_s,
            "cpu_ms_per_s": self.cpu_per_s * 1e3,
            "wakes_per_s": self.wakes_per_s,
            "other_p99_us": percentile_u64(&mut other, 99.0).unwrap_or(0) as f64 / 1e3,
        })
    }
}

/// A run of the churning queue: its windows, and how many arrivals a
/// second beside how many clients that always ask.
struct Churning {
    window_ns: u64,
    windows: u64,
    per_s: u64,
    beside: usize,
    pattern: Pattern,
}

/// The churning queue: `windows` windows of the kinds `pattern` takes in
/// turn, `per_s` arrivals a second beside `beside` clients that always
/// ask and (with any) the other user's client.
/// The queue and its churn are a process of their own (`queue`), beside
/// the clients, never their ancestor: a job's run's children are the
/// job's.
fn churn(a: &Artifacts, run: &Churning) -> Result<Vec<Window>, String> {
    let &Churning {
        window_ns,
        windows,
        per_s,
        beside,
        pattern,
    } = run;
    let (uid, more) = other_user();
    let broker = start_broker(a, 1, more)?;
    let uuids = gpu_uuids(&broker, 1)?;
    let lead = 1000 * MS + beside as u64 * 10 * MS;
    let start = mono_ns() + lead;
    let end = start + windows * window_ns;
    let churn = Churn {
        start,
        window_ns,
        windows,
        per_s,
        pattern,
    };
    let queue = spawn_queue(a, &broker, QUEUED, Some(&churn))?.ok_or("no queue")?;
    let clients = |n, period, uid| Clients {
        n,
        start,
        end,
        period,
        uuids: &uuids,
        uid,
    };
    let (kids, theirs) = if beside > 0 {
        let (kids, _) = spawn_clients(a, &broker, clients(beside, 0, None))?;
        let (theirs, _) = spawn_clients(a, &broker, clients(1, OTHER_PERIOD_NS, uid))?;
        (kids, theirs)
    } else {
        (Vec::new(), Vec::new())
    };
    let pid = broker.pid();
    let cpu = || cpu_seconds_precise(pid).ok_or("broker /proc/stat");
    let sleeps = || sleeps(pid).ok_or("broker /proc/PID/task/*/status");
    let mut spans = Vec::new();
    for w in 0..windows {
        let from = start + w * window_ns;
        sleep_until(from + 100 * MS);
        let (c0, s0, t0) = (cpu()?, sleeps()?, mono_ns());
        sleep_until(from + window_ns);
        let (c1, s1, t1) = (cpu()?, sleeps()?, mono_ns());
        spans.push((c1 - c0, s1.saturating_sub(s0), t0, t1));
    }
    let span = Duration::from_nanos(lead + windows * window_ns);
    let counts = churn_counts(queue, span)?;
    if counts.len() != spans.len() {
        return Err(format!(
            "the queue process counted {} windows, not {}",
            counts.len(),
            spans.len()
        ));
    }
    let (cycles, _) = collect(kids, span)?;
    let (other, _) = collect(theirs, span)?;
    Ok(spans
        .into_iter()
        .zip(counts)
        .enumerate()
        .map(|(w, ((cpu, slept, t0, t1), (pairs, told)))| {
            let within = |c: &&Cycle| c.grant >= t0 && c.grant < t1;
            let secs = (t1 - t0) as f64 / 1e9;
            Window {
                kind: pattern.kind(w as u64),
                cpu_per_s: cpu / secs,
                pairs_per_s: pairs as f64 * 1e9 / window_ns as f64,
                told_per_s: told as f64 * 1e9 / window_ns as f64,
                grants_per_s: cycles.iter().filter(within).count() as f64 / secs,
                other: other
                    .iter()
                    .filter(within)
                    .map(|c| c.grant - c.acquire)
                    .collect(),
                wakes_per_s: slept as f64 / secs,
            }
        })
        .collect())
}

/// The churning queue beside the clients that always ask (quiet and churn
/// windows in turn): a summary of each kind, and what each churn window
/// adds against the mean of the quiet windows either side of it, per
/// arrival-and-departure; the targets and the raw figures.
fn churn_report(ws: &[Window]) -> (Vec<Table>, Vec<Check>, serde_json::Value) {
    let mut t = Table::new(
        &format!(
            "{QUEUED} requests waiting, {BESIDE} clients that always ask and another user's \
             client on 1 GPU; {} s windows without churn and with {CHURN_PER_S} requests \
             arriving and leaving a second, in turn: each kind's median",
            f(ALTERNATE_NS as f64 / 1e9, 0)
        ),
        &[
            "windows",
            "count",
            "arrivals+departures/s",
            "position updates/s",
            "grants/s",
            "broker CPU",
            "broker wakes/s",
            "other user's p99",
        ],
    );
    for kind in [Kind::Quiet, Kind::Churn] {
        let of: Vec<&Window> = ws.iter().filter(|w| w.kind == kind).collect();
        let med = |v: &dyn Fn(&Window) -> f64| median(&of.iter().map(|w| v(w)).collect::<Vec<_>>());
        let mut other: Vec<u64> = of.iter().flat_map(|w| w.other.iter().copied()).collect();
        t.row(vec![
            kind.word().into(),
            of.len().to_string(),
            f(med(&|w| w.pairs_per_s), 0),
            f(med(&|w| w.told_per_s), 0),
            f(med(&|w| w.grants_per_s), 0),
            format!("{} ms/s", f(med(&|w| w.cpu_per_s) * 1e3, 1)),
            f(med(&|w| w.wakes_per_s), 0),
            ms(percentile_u64(&mut other, 99.0).unwrap_or(0)),
        ]);
    }
    let added = Sandwich::of(ws, 0.0);
    let per_grant = cpu_per_grant(ws.iter().filter(|w| w.kind == Kind::Quiet));
    let for_churn = Sandwich::of(ws, per_grant);
    let mut split = Table::new(
        "broker CPU a churn window adds against the mean of the quiet windows either side, \
         per arrival-and-departure",
        &[
            "figure",
            "churn windows",
            "mean",
            "standard error",
            "95% interval",
        ],
    );
    for (figure, s) in [
        ("all of it (the target's)".to_string(), &added),
        (
            format!(
                "less the grants served beyond the neighbours', at {} us each",
                f(per_grant * 1e6, 1)
            ),
            &for_churn,
        ),
    ] {
        split.row(vec![
            figure,
            s.n.to_string(),
            format!("{} ms", f(s.mean * 1e3, 3)),
            format!("{} ms", f(s.se * 1e3, 3)),
            format!("{} to {} ms", f(s.low() * 1e3, 3), f(s.high() * 1e3, 3)),
        ]);
    }
    let mut other: Vec<u64> = ws.iter().flat_map(|w| w.other.iter().copied()).collect();
    let o99 = percentile_u64(&mut other, 99.0).unwrap_or(u64::MAX);
    let checks = vec![
        Check::new(
            &format!(
                "broker CPU a churn adds per arrival-and-departure, {QUEUED} waiting, \
                 {CHURN_PER_S}/s, beside {BESIDE} clients that always ask (95% interval)"
            ),
            format!(
                "{} ms ({} to {})",
                f(added.mean * 1e3, 3),
                f(added.low() * 1e3, 3),
                f(added.high() * 1e3, 3)
            ),
            &format!("≤ {} ms", f(CHURN_TARGET_S * 1e3, 1)),
            // Met only when the whole interval is: a mean under the
            // target by less than the host's noise is no figure. A mean
            // below nothing (the quiet windows ran slower than those with
            // the churn) is the host's noise too, and counts as missed.
            added.mean >= 0.0 && added.high() <= CHURN_TARGET_S,
        ),
        Check::new(
            "another user's grant p99 beside the churning queue",
            ms(o99),
            &format!("≤ {} ms", OTHER_P99_TARGET_NS / MS),
            o99 <= OTHER_P99_TARGET_NS,
        ),
    ];
    let data = serde_json::json!({
        "windows": ws.iter().map(Window::json).collect::<Vec<_>>(),
        "added_cpu_per_pair_us": added.mean * 1e6,
        "added_cpu_per_pair_se_us": added.se * 1e6,
        "cpu_per_grant_us": per_grant * 1e6,
        "added_cpu_less_grants_per_pair_us": for_churn.mean * 1e6,
        "added_cpu_less_grants_per_pair_se_us": for_churn.se * 1e6,
        "churn_windows": added.n,
    });
    (vec![t, split], checks, data)
}

/// The slope of broker CPU on grants across `ws`: what a grant costs it,
/// as windows that serve more of them say (none when they cannot).
fn cpu_per_grant<'a>(ws: impl Iterator<Item = &'a Window>) -> f64 {
    let xy: Vec<(f64, f64)> = ws.map(|w| (w.grants_per_s, w.cpu_per_s)).collect();
    let n = xy.len().max(1) as f64;
    let (mx, my) = xy
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x / n, b + y / n));
    let sxx: f64 = xy.iter().map(|(x, _)| (x - mx).powi(2)).sum();
    let sxy: f64 = xy.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
    if sxx > 0.0 { sxy / sxx } else { 0.0 }
}

/// Each churn window's broker CPU less the mean of the quiet windows
/// either side, over its arrivals: their mean and its standard error.
struct Sandwich {
    n: usize,
    mean: f64,
    se: f64,
}

impl Sandwich {
    /// Of the broker's CPU a second less `per_grant` for each grant a
    /// second the window served.
    fn of(ws: &[Window], per_grant: f64) -> Sandwich {
        let cpu = |w: &Window| w.cpu_per_s - per_grant * w.grants_per_s;
        let per_pair: Vec<f64> = ws
            .windows(3)
            .filter(|w| w[1].kind == Kind::Churn && w[0].kind == Kind::Quiet)
            .filter(|w| w[2].kind == Kind::Quiet && w[1].pairs_per_s > 0.0)
            .map(|w| {
                let around = (cpu(&w[0]) + cpu(&w[2])) / 2.0;
                (cpu(&w[1]) - around) / w[1].pairs_per_s
            })
            .collect();
        let n = per_pair.len();
        let mean = per_pair.iter().sum::<f64>() / n.max(1) as f64;
        let var = per_pair.iter().map(|v| (v - mean).powi(2)).sum::<f64>()
            / (n.saturating_sub(1)).max(1) as f64;
        Sandwich {
            n,
            mean,
            se: if n > 1 {
                (var / n as f64).sqrt()
            } else {
                f64::INFINITY
            },
        }
    }

    fn low(&self) -> f64 {
        self.mean - 1.96 * self.se
    }

    fn high(&self) -> f64 {
        self.mean + 1.96 * self.se
    }
}

/// The same queue alone, `PARTS_PER_S` a second: its parts, and its
/// windows' raw figures.
fn parts_report(ws: &[Window]) -> (Table, serde_json::Value) {
    let added = Added::of(ws);
    let t = added.table(&format!(
        "the same queue alone: {QUEUED} requests waiting, no clients beside it, \
         {PARTS_PER_S} arrivals and departures a second; broker CPU and wakes per \
         arrival-and-departure, from each kind of window's median"
    ));
    let data = serde_json::json!({
        "windows": ws.iter().map(Window::json).collect::<Vec<_>>(),
        "added_cpu_per_pair_us": added.per_pair * 1e6,
        "bare_connection_cpu_per_pair_us": added.bare * 1e6,
        "request_cpu_per_pair_us": added.request() * 1e6,
        "added_wakes_per_pair": added.wakes_pair,
        "bare_connection_wakes_per_pair": added.wakes_bare,
    });
    (t, data)
}

/// What an arrival-and-departure adds, from each kind of window's median
/// (a window of this shared machine now and then runs 10 ms/s off its
/// neighbours, as much as the figure sought): all of it, the churn and
/// after windows against twice the quiet ones (the window after the churn
/// is charged to it too: the places it moved are told then), and a bare
/// connection's life, the bare windows against the quiet ones; in broker
/// CPU and in the broker's wakes.
struct Added {
    per_pair: f64,
    bare: f64,
    wakes_pair: f64,
    wakes_bare: f64,
}

impl Added {
    fn of(ws: &[Window]) -> Added {
        let of = |kind: Kind, v: &dyn Fn(&Window) -> f64| {
            let of: Vec<f64> = ws.iter().filter(|w| w.kind == kind).map(v).collect();
            median(&of)
        };
        let rate = |kind| of(kind, &|w| w.pairs_per_s).max(1e-9);
        let per = |v: &dyn Fn(&Window) -> f64| {
            let quiet = of(Kind::Quiet, v);
            (
                (of(Kind::Churn, v) + of(Kind::After, v) - 2.0 * quiet) / rate(Kind::Churn),
                (of(Kind::Bare, v) - quiet) / rate(Kind::Bare),
            )
        };
        let (per_pair, bare) = per(&|w| w.cpu_per_s);
        let (wakes_pair, wakes_bare) = per(&|w| w.wakes_per_s);
        Added {
            per_pair,
            bare,
            wakes_pair,
            wakes_bare,
        }
    }

    /// What the request in the queue adds to a connection's life.
    fn request(&self) -> f64 {
        self.per_pair - self.bare
    }

    fn table(&self, title: &str) -> Table {
        let mut t = Table::new(
            title,
            &[
                "part",
                "windows compared",
                "broker CPU added",
                "broker wakes added",
            ],
        );
        for (part, compared, cpu, wakes) in [
            (
                "all of it",
                "churn and after against quiet",
                self.per_pair,
                self.wakes_pair,
            ),
            (
                "a bare connection's life",
                "bare against quiet",
                self.bare,
                self.wakes_bare,
            ),
            (
                "its request in the queue",
                "the difference",
                self.request(),
                self.wakes_pair - self.wakes_bare,
            ),
        ] {
            t.row(vec![
                part.into(),
                compared.into(),
                format!("{} ms", f(cpu * 1e3, 3)),
                f(wakes, 2),
            ]);
        }
        t
    }
}
