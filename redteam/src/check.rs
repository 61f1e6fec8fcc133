//! The broker's invariants (SECURITY.md, "The broker's invariants"; the
//! product contract, §2 "Invariants, not patches"), each as a scene (the
//! node, the victim user's scripted processes, how long it runs) and a
//! measure of the victim's harm at user level, whatever the attacker
//! does with however many connections and processes, with the threshold
//! past which the invariant is broken. `evaluate` plays one strategy in
//! one scene.

use std::sync::OnceLock;

use gpufrac_common::config::Priority;
use tracing::Level;

use crate::attack::{Attacker, Bounds, Strategy, Want};
use crate::core::{GIB, MS, Nanos, SEC, STATE_COALESCED, Setup, uuid};
use crate::host::COMMAND_MAX;
use crate::logs::{self, Line};
use crate::node::{ATTACKER, Actor, Node, VICTIM};
use crate::victim::{Part, Victim};

/// An invariant the search attacks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Invariant {
    /// Fairness by users: a victim user with a busy process keeps at
    /// least `FAIR_KEPT` of its fair part of the GPU.
    Fairness,
    /// Service measured in work: every answer the victim asks for
    /// (ping, status, registration, `run --no-wait`) comes within
    /// `ANSWER_WITHIN` of virtual time and `ANSWER_WORK` of the broker's
    /// work, and an interactive `high` burst is granted within
    /// `GRANT_WITHIN`; the victim is never disconnected; and the broker
    /// reads no process's command line.
    Service,
    /// No idle GPU while the victim waits: a busy `low` victim waits on
    /// a GPU that runs nobody's work at most `IDLE_WAITING` of the time.
    Idle,
    /// Logs: no line said on the victim's behalf, and none of the
    /// broker's own warnings, goes missing for anything the attacker
    /// does; the attacker's lines stay within its budget; no line's
    /// fields are forged.
    Logs,
    /// No state a client can name without bound: after the attacker has
    /// gone, a broker without a driver keeps no GPU that no registered
    /// process names, and the victim's processes are never refused.
    State,
    /// Queue order: no request of the attacker's for room on a GPU (a
    /// whole one, its memory less a little, or any fraction) asked after
    /// the victim's `--gpus 1` is placed before it: fractions backfill
    /// only where they delay no earlier whole-GPU request.
    Queue,
}

/// Fairness: the least part of its fair share the victim keeps.
pub const FAIR_KEPT: f64 = 0.8;
/// Service: the longest answer, in virtual time and in broker work (an
/// answer to a lease may wait besides for the state that books it to be
/// written, `STATE_COALESCED`).
pub const ANSWER_WITHIN: Nanos = 20 * MS;
pub const ANSWER_WORK: Nanos = 10 * MS;
/// Service: the longest an interactive `high` burst waits for its grant
/// (the GPU at once, but for the broker's turn and a time-slicer's
/// quantum).
pub const GRANT_WITHIN: Nanos = 10 * MS;
/// Idle: the most of the horizon the victim may wait on an idle GPU. A
/// holder that answers recalls without working is told from a busy one
/// only by the driver's samples: it keeps the GPU for its user's benefit
/// of the doubt (half a second in ten) and then a slice at each recall,
/// about one a second (broker/src/sched/evidence.rs), so over the scene's
/// 6 s it may hold about 0.6 s.
pub const IDLE_WAITING: f64 = 0.15;

/// Where an invariant is attacked.
struct Scene {
    setup: Setup,
    victim: Vec<Part>,
    horizon: Nanos,
    /// The attacker closes everything and its processes exit then.
    leave: Option<Nanos>,
}

impl Invariant {
    pub const ALL: [Invariant; 6] = [
        Invariant::Fairness,
        Invariant::Service,
        Invariant::Idle,
        Invariant::Logs,
        Invariant::State,
        Invariant::Queue,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Invariant::Fairness => "fairness",
            Invariant::Service => "service",
            Invariant::Idle => "idle",
            Invariant::Logs => "logs",
            Invariant::State => "state",
            Invariant::Queue => "queue",
        }
    }

    pub fn parse(s: &str) -> Option<Invariant> {
        Invariant::ALL.into_iter().find(|i| i.name() == s)
    }

    /// The harm past which the invariant is broken.
    pub fn threshold(self) -> f64 {
        match self {
            Invariant::Fairness => 1.0 - FAIR_KEPT,
            Invariant::Service => 1.0,
            Invariant::Idle => IDLE_WAITING,
            Invariant::Logs | Invariant::State | Invariant::Queue => 0.0,
        }
    }

    fn scene(self) -> Scene {
        let plain = |victim, horizon| Scene {
            setup: Setup::default(),
            victim,
            horizon,
            leave: None,
        };
        match self {
            Invariant::Fairness => plain(
                vec![Part::Busy {
                    class: Priority::Normal,
                }],
                3 * SEC,
            ),
            Invariant::Service => plain(
                vec![
                    Part::Cli {
                        ping: 10 * MS,
                        status: 100 * MS,
                    },
                    Part::Runs {
                        every: 200 * MS,
                        hold: 50 * MS,
                        mem: GIB,
                    },
                    Part::Registers {
                        at: (1..10).map(|k| k * 150 * MS).collect(),
                        stay: 50 * MS,
                    },
                    Part::Interactive {
                        class: Priority::High,
                        every: 20 * MS,
                        burst: 500_000,
                    },
                ],
                1500 * MS,
            ),
            Invariant::Idle => plain(
                vec![Part::Busy {
                    class: Priority::Low,
                }],
                6 * SEC,
            ),
            Invariant::Logs => logs_scene(true, true),
            Invariant::State => Scene {
                setup: Setup {
                    gpus: Vec::new(),
                    discovered: false,
                    ..Setup::default()
                },
                victim: vec![Part::Registers {
                    at: vec![1000 * MS, 1500 * MS],
                    stay: 2 * SEC,
                }],
                horizon: 2500 * MS,
                leave: Some(SEC + 800 * MS),
            },
            Invariant::Queue => plain(vec![Part::Queued { at: 200 * MS }], 2 * SEC),
        }
    }
}

/// The victim registers three processes and is refused a lease (a
/// warning); meanwhile its runs, which ask for no GPU, change the state,
/// whose writes fail for a while (the broker's own warning). Each of
/// these is said alone in a quiet scene (`refusal` or `full_disk` left
/// out): the lines a scene with both and an attacker must say too.
fn logs_scene(refusal: bool, full_disk: bool) -> Scene {
    let mut victim = vec![
        Part::Registers {
            at: vec![100 * MS, 500 * MS, 900 * MS],
            stay: 2 * SEC,
        },
        Part::Runs {
            every: 300 * MS,
            hold: 100 * MS,
            mem: 0,
        },
    ];
    if refusal {
        victim.push(Part::Refused {
            at: vec![1200 * MS],
        });
    }
    Scene {
        setup: Setup {
            // From the start, a second after boot.
            state_fails: full_disk.then_some((SEC + 1400 * MS, SEC + 1700 * MS)),
            ..Setup::default()
        },
        victim,
        horizon: 2 * SEC,
        leave: None,
    }
}

/// What came of one strategy in one invariant's scene.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub invariant: Invariant,
    /// The victim's harm, in the invariant's measure.
    pub harm: f64,
    /// The figures it was made of, in words.
    pub figures: String,
}

impl Outcome {
    pub fn holds(&self) -> bool {
        self.harm <= self.invariant.threshold()
    }
}

/// Everything a run left to measure.
struct Run {
    node: Node,
    victim: Victim,
    attacker: Attacker,
    lines: Vec<Line>,
    /// From the start to where the run ended: the scene's horizon, or
    /// later when the broker's last pass went past it.
    horizon: Nanos,
}

fn play(inv: Invariant, s: &Strategy, bounds: &Bounds) -> Run {
    play_in(inv.scene(), s, bounds)
}

fn play_in(scene: Scene, s: &Strategy, bounds: &Bounds) -> Run {
    let (run, lines) = logs::capture(|| {
        let mut node = Node::new(&scene.setup);
        let start = node.start();
        let mut victim = Victim::new(scene.victim.clone(), start);
        let mut attacker = Attacker::new(s, bounds, start, scene.leave);
        let end = start + scene.horizon;
        {
            let mut actors: [&mut dyn Actor; 2] = [&mut victim, &mut attacker];
            node.run(&mut actors, end);
        }
        (node, victim, attacker)
    });
    let (node, victim, attacker) = run;
    Run {
        horizon: node.clock.now - node.start(),
        node,
        victim,
        attacker,
        lines,
    }
}

/// Set (to anything but `0`), an invariant that does not hold is reported
/// on stderr and the test goes on: for a branch whose fixes are not in
/// yet. Unset, it fails the test.
pub const REPORT_ONLY: &str = "GPUFRAC_REDTEAM_REPORT_ONLY";

/// Whether failures are only reported (`REPORT_ONLY`).
pub fn report_only() -> bool {
    std::env::var_os(REPORT_ONLY).is_some_and(|v| v != "0")
}

/// Fails the test unless `o` holds (or only says so, `REPORT_ONLY`).
pub fn verdict(o: &Outcome, what: &str) {
    if o.holds() {
        return;
    }
    let msg = format!(
        "{}: the invariant does not hold{what}: harm {:.3} against a threshold of {:.3}: {}",
        o.invariant.name(),
        o.harm,
        o.invariant.threshold(),
        o.figures
    );
    if report_only() {
        eprintln!("{msg} (reported only: {REPORT_ONLY} is set)");
    } else {
        panic!("{msg}");
    }
}

/// Plays `s` in `inv`'s scene within the test suite's bounds and fails
/// the test unless the invariant holds: a strategy found once, kept as a
/// regression test.
pub fn holds(inv: Invariant, s: &Strategy) {
    let o = evaluate(inv, s, &Bounds::QUICK);
    eprintln!("{}: harm {:.3}: {}", inv.name(), o.harm, o.figures);
    verdict(&o, &format!(" against {}", s.describe()));
}

/// The victim's questions when `s` is played in `inv`'s scene: what,
/// when asked and answered (ms from the start), and the broker's work
/// meanwhile (ms).
pub fn answers_of(
    inv: Invariant,
    s: &Strategy,
    bounds: &Bounds,
) -> Vec<(&'static str, f64, Option<f64>, f64)> {
    let r = play(inv, s, bounds);
    let start = r.node.start();
    let ms = |t: Nanos| (t - start) as f64 / MS as f64;
    let (end, end_work) = (r.node.clock.now, r.node.clock.work);
    let mut out: Vec<_> = r
        .victim
        .answers()
        .cloned()
        .chain(r.victim.bursts())
        .map(|a| {
            (
                a.what,
                ms(a.asked),
                a.answered.map(|(t, _)| ms(t)),
                a.wait(end, end_work).1 as f64 / MS as f64,
            )
        })
        .collect();
    out.sort_by(|a, b| a.1.total_cmp(&b.1));
    out
}

/// The broker's log when `s` is played in `inv`'s scene.
pub fn log_of(inv: Invariant, s: &Strategy, bounds: &Bounds) -> Vec<Line> {
    play(inv, s, bounds).lines
}

/// Plays `s`, within `bounds`, against the victim in `inv`'s scene.
pub fn evaluate(inv: Invariant, s: &Strategy, bounds: &Bounds) -> Outcome {
    let r = play(inv, s, bounds);
    let (harm, figures) = match inv {
        Invariant::Fairness => fairness(&r),
        Invariant::Service => service(&r),
        Invariant::Idle => idle(&r),
        Invariant::Logs => log_harm(&r),
        Invariant::State => state(&r),
        Invariant::Queue => queue(&r),
    };
    let figures = if r.attacker.record.cut {
        format!("{figures} (the attacker was cut short at its bound on the broker's work)")
    } else {
        figures
    };
    Outcome {
        invariant: inv,
        harm,
        figures,
    }
}

fn secs(ns: f64) -> f64 {
    ns / SEC as f64
}

fn fairness(r: &Run) -> (f64, String) {
    let g = r.node.gpu_time();
    let kept = if g.fair > 0.0 { g.victim / g.fair } else { 1.0 };
    (
        (1.0 - kept).max(0.0),
        format!(
            "victim {:.2} s of GPU against a fair part of {:.2} s ({:.0}%), attacker {:.2} s, over {:.1} s",
            secs(g.victim),
            secs(g.fair),
            kept * 100.0,
            secs(g.attacker),
            secs(r.horizon as f64)
        ),
    )
}

fn service(r: &Run) -> (f64, String) {
    let end = r.node.clock.now;
    let end_work = r.node.clock.work;
    let (mut worst, mut worst_work, mut what) = (0, 0, "none");
    let mut harm: f64 = 0.0;
    for a in r.victim.answers() {
        let (t, w) = a.wait(end, end_work);
        let within = if a.what.starts_with("run") {
            ANSWER_WITHIN + STATE_COALESCED
        } else {
            ANSWER_WITHIN
        };
        harm = harm
            .max(t as f64 / within as f64)
            .max(w as f64 / ANSWER_WORK as f64);
        if t > worst {
            worst = t;
            what = a.what;
        }
        worst_work = worst_work.max(w);
    }
    let grant = r
        .victim
        .bursts()
        .map(|a| a.wait(end, end_work).0)
        .max()
        .unwrap_or(0);
    let dropped = r.victim.record.dropped + r.victim.record.refused;
    // A process's memory is its own to make slow to read (CVE-2018-1120):
    // the broker reads no command line, of any size.
    let argv = r.node.cmdline_bytes();
    let harm = harm.max(grant as f64 / GRANT_WITHIN as f64)
        + 10.0 * dropped as f64
        + argv as f64 / COMMAND_MAX as f64;
    (
        harm,
        format!(
            "longest answer {:.2} ms ({what}), {:.2} ms of broker work; longest grant of a high burst {:.2} ms; {dropped} connection(s) dropped or refused; {argv} bytes of command lines read from /proc; broker work {:.0}% of the time",
            worst as f64 / MS as f64,
            worst_work as f64 / MS as f64,
            grant as f64 / MS as f64,
            100.0 * end_work as f64 / r.horizon as f64
        ),
    )
}

fn idle(r: &Run) -> (f64, String) {
    let g = r.node.gpu_time();
    let frac = g.idle_victim_waiting / r.horizon as f64;
    (
        frac,
        format!(
            "the low victim waited {:.2} s, {:.2} s of it with the GPU idle ({:.1}% of {:.1} s); it ran {:.2} s",
            secs(g.victim_waiting),
            secs(g.idle_victim_waiting),
            frac * 100.0,
            secs(r.horizon as f64),
            secs(g.victim)
        ),
    )
}

/// Whose a line is: the victim's, the attacker's, or the broker's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Voice {
    Victim,
    Attacker,
    Own,
    Other,
}

fn voice(l: &Line, victim: &[u32], attacker: &[u32]) -> Voice {
    let (uids, pids) = l.names();
    if uids.contains(&VICTIM) || pids.iter().any(|p| victim.contains(p)) {
        Voice::Victim
    } else if uids.contains(&ATTACKER) || pids.iter().any(|p| attacker.contains(p)) {
        Voice::Attacker
    } else if uids.is_empty() && pids.is_empty() {
        Voice::Own
    } else {
        Voice::Other
    }
}

/// Lines in each voice: (victim, attacker, the broker's own warnings).
fn voices(r: &Run) -> (usize, usize, usize) {
    let (v, a) = (&r.victim.record.pids, &r.attacker.record.pids);
    let mut n = (0, 0, 0);
    for l in &r.lines {
        match voice(l, v, a) {
            Voice::Victim => n.0 += 1,
            Voice::Attacker => n.1 += 1,
            Voice::Own if l.level <= Level::WARN => n.2 += 1,
            _ => {}
        }
    }
    n
}

/// The victim's lines with no attacker and a disk that never fills, and
/// the broker's own warnings with no attacker and no refusal of the
/// victim's: what must be said whoever else is noisy.
fn quiet_logs() -> (usize, usize) {
    static QUIET: OnceLock<(usize, usize)> = OnceLock::new();
    *QUIET.get_or_init(|| {
        let nothing = Strategy::default();
        let (victim, _, _) = voices(&play_in(logs_scene(true, false), &nothing, &Bounds::QUICK));
        let (_, _, own) = voices(&play_in(logs_scene(false, true), &nothing, &Bounds::QUICK));
        (victim, own)
    })
}

/// What one user may make the broker write (SECURITY.md): 64 lines at
/// once, then 10 a second, each let through after a gap followed by the
/// count of those left out; and a warning every 10 s.
fn line_budget(horizon: Nanos) -> usize {
    let s = horizon as f64 / SEC as f64;
    64 + (2.0 * 10.0 * s).ceil() as usize + 1 + (s / 10.0).ceil() as usize
}

fn log_harm(r: &Run) -> (f64, String) {
    let (quiet_victim, quiet_own) = quiet_logs();
    let (victim, attacker, own) = voices(r);
    let hidden = quiet_victim.saturating_sub(victim);
    let hidden_own = quiet_own.saturating_sub(own);
    let forged = r.lines.iter().filter(|l| l.forged()).count();
    let budget = line_budget(r.horizon);
    let excess = attacker.saturating_sub(budget);
    let harm = (hidden + hidden_own + forged + excess) as f64;
    let example = r
        .lines
        .iter()
        .find(|l| l.forged())
        .map(|l| format!("; a forged line: {:?}", truncate(&l.text, 160)))
        .unwrap_or_default();
    (
        harm,
        format!(
            "{hidden} of the victim's {quiet_victim} lines missing, {hidden_own} of the broker's {quiet_own} own warnings missing, {forged} line(s) with forged fields, the attacker's lines {attacker} against a budget of {budget}{example}"
        ),
    )
}

fn truncate(s: &str, n: usize) -> String {
    let mut end = n.min(s.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

fn state(r: &Run) -> (f64, String) {
    let known = r.node.shell().gpus_known();
    let own = gpufrac_common::wire::uuid_string(&uuid(0));
    let kept = known.iter().filter(|u| **u != own).count();
    let refused = r.victim.record.refused;
    let open = r.node.open_connections(1);
    (
        (kept + refused + open) as f64,
        format!(
            "after the attacker left: {kept} GPU(s) no registered process names still kept ({} known), {refused} of the victim's registrations refused, {open} of the attacker's connections still open",
            known.len()
        ),
    )
}

fn queue(r: &Run) -> (f64, String) {
    let Some((asked, placed)) = r.victim.record.queued else {
        return (0.0, "the victim never asked".into());
    };
    let jumps = r
        .attacker
        .record
        .leases
        .iter()
        .filter(|l| {
            matches!(
                l.want,
                Want::Gpu | Want::WholeMemory { .. } | Want::Memory | Want::High
            )
        })
        .filter(|l| l.asked > asked)
        .filter(|l| l.leased.is_some_and(|t| placed.is_none_or(|p| t < p)))
        .count();
    (
        jumps as f64,
        format!(
            "{jumps} of the attacker's later requests for GPU room placed before the victim's --gpus 1 (asked at {} ms, placed {})",
            (asked - r.node.start()) / MS,
            placed.map_or("never".to_owned(), |p| format!(
                "at {} ms",
                (p - r.node.start()) / MS
            ))
        ),
    )
}
