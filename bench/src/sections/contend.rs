//! Section 4's rows that contend. Every client always asks: Acquire again
//! as soon as it let go, so the broker always has a full line of waiters,
//! which the periodic rows (20% offered load) rarely give it. Beside them
//! a client of another user asks every 20 ms: how long one user's grants
//! take beside another's population. And a churning queue: 1,000 requests
//! waiting in the admission queue, 100 a second arriving and leaving,
//! beside 64 clients that always ask, in windows taken in turn without
//! churn, with bare connections coming and going, and with the churn, on
//! one broker.

use super::f;
use super::queue::{Churn, Kind, churn_counts, spawn_queue};
use super::shims::{Clients, Cycle, HOLD_NS, MS, collect, gpu_uuids, spawn_clients, start_broker};
use gpufrac_bench::clock::{mono_ns, sleep_until};
use gpufrac_bench::harness::{Artifacts, cpu_seconds_precise};
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
        // The contending clients' own CPU varies by tens of ms/s from one
        // window to the next on a shared machine: more windows, unless
        // quick; each kind's windows as many.
        let churn = churn(a, window_ns, if quick { 8 } else { 16 })?;
        let (churn_tables, churn_checks, churn_data) = churn_report(&churn);
        checks.extend(churn_checks);
        tables.extend(churn_tables);
        data.insert("churn".into(), churn_data);
        notes.push(churn_note());
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
fn churn_note() -> String {
    format!(
        "The churning queue: a lease holding 1 GiB of the GPU and {QUEUED} `--gpu-memory 16G` \
         requests waiting behind it, {BESIDE} clients that always ask and the other user's \
         client, on one broker; in the churn windows, {CHURN_PER_S} times a second a new \
         request connects, asks and is queued, and a random waiting one disconnects (its \
         request leaves the queue); in the bare windows, as often, a connection says Hello, \
         is answered and stays, and the one before it closes: a connection's life with no \
         request in it. Quiet, bare, churn and after windows come in turn; nothing arrives \
         in an after window, but the requests the churn moved are still told their places \
         (each at most once every 5 s). *added per arrival-and-departure*: the churn and \
         after windows' median broker CPU less twice the quiet ones', over the churn's rate \
         (the target's figure; a figure below zero, where the quiet windows ran slower than \
         those with the churn, is the host's noise and counts as missed); *a bare \
         connection's life*: the bare windows' less the quiet ones', over their rate; *its \
         request*: the difference. The bare connection's part \
         is the kernel's work for a connection (the accept, the credentials, the pidfd, the \
         `/proc` read that fixes the process's identity, the closes) and the broker's for its \
         Hello. *position updates*: Queued messages the waiting requests read (every 50 ms). \
         The lease and the requests are a process of their own (`gpufrac-bench \
         queue-client`), never the clients' parent: the broker counts a run's descendants \
         into its job, and with the bench itself as the holder every client, the other \
         user's too, was one of that job's processes (its p99 then measured 64 processes of \
         one job taking turns, 20 ms)."
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
    secs: f64,
    /// Arrivals (each with a departure) and Queued messages read.
    pairs: u64,
    told: u64,
    grants: usize,
    other: Vec<u64>,
}

/// The churning queue: `windows` windows, quiet, bare, churn and after in
/// turn (`Kind`).
/// The queue and its churn are a process of their own (`queue`), beside
/// the clients, never their ancestor: a job's run's children are the
/// job's.
fn churn(a: &Artifacts, window_ns: u64, windows: u64) -> Result<Vec<Window>, String> {
    let (uid, more) = other_user();
    let broker = start_broker(a, 1, more)?;
    let uuids = gpu_uuids(&broker, 1)?;
    let lead = 1000 * MS + BESIDE as u64 * 10 * MS;
    let start = mono_ns() + lead;
    let end = start + windows * window_ns;
    let churn = Churn {
        start,
        window_ns,
        windows,
        per_s: CHURN_PER_S,
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
    let (kids, _) = spawn_clients(a, &broker, clients(BESIDE, 0, None))?;
    let (theirs, _) = spawn_clients(a, &broker, clients(1, OTHER_PERIOD_NS, uid))?;
    let pid = broker.pid();
    let cpu = || cpu_seconds_precise(pid).ok_or("broker /proc/stat");
    let mut spans = Vec::new();
    for w in 0..windows {
        let from = start + w * window_ns;
        sleep_until(from + 100 * MS);
        let (c0, t0) = (cpu()?, mono_ns());
        sleep_until(from + window_ns);
        let (c1, t1) = (cpu()?, mono_ns());
        spans.push((c1 - c0, t0, t1));
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
        .map(|(w, ((cpu, t0, t1), (pairs, told)))| {
            let within = |c: &&Cycle| c.grant >= t0 && c.grant < t1;
            let secs = (t1 - t0) as f64 / 1e9;
            Window {
                kind: Kind::of(w as u64),
                cpu_per_s: cpu / secs,
                secs,
                pairs,
                told,
                grants: cycles.iter().filter(within).count(),
                other: other
                    .iter()
                    .filter(within)
                    .map(|c| c.grant - c.acquire)
                    .collect(),
            }
        })
        .collect())
}

/// The churning queue's table, targets and raw figures.
fn churn_report(ws: &[Window]) -> (Vec<Table>, Vec<Check>, serde_json::Value) {
    let mut t = Table::new(
        &format!(
            "{QUEUED} requests waiting, {BESIDE} clients that always ask and another user's \
             client on 1 GPU; windows without churn, with {CHURN_PER_S} bare connections and \
             with {CHURN_PER_S} requests arriving and leaving a second, in turn"
        ),
        &[
            "window",
            "arrivals+departures/s",
            "position updates/s",
            "grants/s",
            "broker CPU",
            "other user's p99",
        ],
    );
    let mut rows = Vec::new();
    for (i, w) in ws.iter().enumerate() {
        let mut other = w.other.clone();
        let o99 = percentile_u64(&mut other, 99.0).unwrap_or(0);
        t.row(vec![
            format!("{} {}", w.kind.word(), i / 4 + 1),
            f(w.pairs as f64 / w.secs, 0),
            f(w.told as f64 / w.secs, 0),
            f(w.grants as f64 / w.secs, 0),
            format!("{} ms/s", f(w.cpu_per_s * 1e3, 1)),
            ms(o99),
        ]);
        rows.push(serde_json::json!({
            "kind": w.kind.word(),
            "churn": w.kind == Kind::Churn,
            "pairs_per_s": w.pairs as f64 / w.secs,
            "position_updates_per_s": w.told as f64 / w.secs,
            "grants_per_s": w.grants as f64 / w.secs,
            "cpu_ms_per_s": w.cpu_per_s * 1e3,
            "other_p99_us": o99 as f64 / 1e3,
        }));
    }
    // Medians: now and then a window of this shared machine runs 10 ms/s
    // off its neighbours, as much as the figure sought.
    let of = |kind: Kind, v: &dyn Fn(&Window) -> f64| {
        let of: Vec<f64> = ws.iter().filter(|w| w.kind == kind).map(v).collect();
        median(&of)
    };
    let cpu = |kind| of(kind, &|w| w.cpu_per_s);
    let rate = |kind| of(kind, &|w| w.pairs as f64 / w.secs).max(1e-9);
    // The window after the churn is charged to it too: the places it moved
    // are told then.
    let per_pair =
        (cpu(Kind::Churn) + cpu(Kind::After) - 2.0 * cpu(Kind::Quiet)) / rate(Kind::Churn);
    // What a connection's life costs alone, and what a request in it adds.
    let bare = (cpu(Kind::Bare) - cpu(Kind::Quiet)) / rate(Kind::Bare);
    let request = per_pair - bare;
    let mut split = Table::new(
        "broker CPU per arrival-and-departure, from each kind of window's median",
        &["part", "windows compared", "broker CPU added"],
    );
    for (part, compared, v) in [
        ("all of it", "churn and after against quiet", per_pair),
        ("a bare connection's life", "bare against quiet", bare),
        ("its request in the queue", "the difference", request),
    ] {
        split.row(vec![
            part.into(),
            compared.into(),
            format!("{} ms", f(v * 1e3, 3)),
        ]);
    }
    let mut other: Vec<u64> = ws.iter().flat_map(|w| w.other.iter().copied()).collect();
    let o99 = percentile_u64(&mut other, 99.0).unwrap_or(u64::MAX);
    let checks = vec![
        Check::new(
            &format!(
                "broker CPU a churn adds per arrival-and-departure, {QUEUED} waiting, \
                 {CHURN_PER_S}/s, beside {BESIDE} clients that always ask"
            ),
            format!("{} ms", f(per_pair * 1e3, 3)),
            &format!("≤ {} ms", f(CHURN_TARGET_S * 1e3, 1)),
            // Below nothing is no figure: the quiet windows ran slower
            // than those with the churn, so the host's noise outweighed
            // what was sought (once with 18% of the CPU stolen, -0.909 ms),
            // and it counts as missed, not met.
            (0.0..=CHURN_TARGET_S).contains(&per_pair),
        ),
        Check::new(
            "another user's grant p99 beside the churning queue",
            ms(o99),
            &format!("≤ {} ms", OTHER_P99_TARGET_NS / MS),
            o99 <= OTHER_P99_TARGET_NS,
        ),
    ];
    let data = serde_json::json!({
        "windows": rows,
        "added_cpu_per_pair_us": per_pair * 1e6,
        "bare_connection_cpu_per_pair_us": bare * 1e6,
        "request_cpu_per_pair_us": request * 1e6,
    });
    (vec![t, split], checks, data)
}
