//! The optimiser: a (μ+λ) evolution over strategies, maximising the
//! victim's harm in one invariant's scene. A population starts from the
//! seeds given (the review's strategies, or none) and random strategies;
//! each generation breeds children from parents picked by tournament,
//! by crossover (cohorts taken from either parent) and mutation (a
//! cohort added, dropped or copied; one of its numbers or choices
//! changed), plus one newcomer at random; the best survive. Everything
//! is drawn from one ChaCha stream seeded by the seed and the
//! invariant, so a seed and a budget give the same strategy on every
//! machine. The best found is then made as simple as it can be while it
//! does as much harm (`simplify`), so that what is printed is the
//! attack, not its noise.

use std::collections::HashMap;

use gpufrac_common::config::Priority;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::attack::{
    Bounds, Cohort, MAX_ARGV_KIB, MAX_COHORTS, MAX_MEMBERS, MAX_NAME_KIB, NEAR_WHOLE, Play, Recall,
    Space, Strategy, Want, cohort,
};
use crate::check::{Invariant, Outcome, evaluate};
use crate::host::{Argv, Text};

/// The test suite's seed (the project's pinned seed for property tests,
/// `PROPTEST_RNG_SEED` in .cargo/config.toml): every machine searches
/// the same strategies and reaches the same verdict.
pub const SEED: u64 = 20261126;

const MU: usize = 8;
const LAMBDA: usize = 8;

/// What a search found.
#[derive(Debug, Clone)]
pub struct Found {
    /// The most harmful strategy played, made simpler (`simplify`).
    pub strategy: Strategy,
    pub outcome: Outcome,
    /// The most harmful strategy played, as it was.
    pub best: (Strategy, Outcome),
    /// Strategies played.
    pub evaluations: usize,
    /// The seed strategy it descends from most (by name), if any.
    pub best_seed: Option<(&'static str, f64)>,
}

/// Hears of each new best: strategies played so far, the strategy, what
/// came of it.
pub type Progress<'a> = &'a mut dyn FnMut(usize, &Strategy, &Outcome);

struct Searcher<'a> {
    inv: Invariant,
    bounds: Bounds,
    space: Space,
    rng: ChaCha8Rng,
    cache: HashMap<Strategy, Outcome>,
    budget: usize,
    log: Option<Progress<'a>>,
    best: Option<(Strategy, Outcome)>,
}

impl Searcher<'_> {
    fn spent(&self) -> usize {
        self.cache.len()
    }

    /// A strategy of the space at random.
    fn random(&mut self) -> Strategy {
        loop {
            if let Some(s) = self.space.fit(&random_strategy(&mut self.rng)) {
                return s;
            }
        }
    }

    /// `s` in the space (a random one if nothing of it is), its inputs
    /// cut to the bounds.
    fn fit(&mut self, s: &Strategy) -> Strategy {
        match self.space.fit(s) {
            Some(s) => self.bounds.clamp(&s),
            None => {
                let r = self.random();
                self.bounds.clamp(&r)
            }
        }
    }

    /// Plays `s` (in the space, within the bounds): its harm.
    fn eval(&mut self, s: &Strategy) -> f64 {
        let s = &self.fit(s);
        if let Some(o) = self.cache.get(s) {
            return o.harm;
        }
        let o = evaluate(self.inv, s, &self.bounds);
        let h = o.harm;
        let better = self.best.as_ref().is_none_or(|(_, b)| h > b.harm);
        self.cache.insert(s.clone(), o.clone());
        if better {
            if let Some(log) = self.log.as_mut() {
                log(self.cache.len(), s, &o);
            }
            self.best = Some((s.clone(), o));
        }
        h
    }
}

/// What to search: where, from which seed, for how long, with inputs
/// how large, starting from which strategies.
pub struct Plan<'a> {
    pub invariant: Invariant,
    pub seed: u64,
    /// Strategies played in the search (a quarter more to simplify).
    pub budget: usize,
    pub bounds: Bounds,
    pub space: Space,
    pub seeds: &'a [(&'static str, Strategy)],
}

/// Searches for the strategy that harms the victim most in the plan's
/// scene, playing `budget` strategies, then at most a quarter as many
/// again to make the best simpler. `log` hears of each new best.
pub fn search(plan: &Plan<'_>, log: Option<Progress<'_>>) -> Found {
    let (inv, seed, budget, seeds) = (plan.invariant, plan.seed, plan.budget, plan.seeds);
    let stream = seed ^ (inv as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut s = Searcher {
        inv,
        bounds: plan.bounds,
        space: plan.space.clone(),
        rng: ChaCha8Rng::seed_from_u64(stream),
        cache: HashMap::new(),
        budget: budget.max(1),
        log,
        best: None,
    };
    let mut best_seed: Option<(&'static str, f64)> = None;
    let mut pop: Vec<(Strategy, f64)> = Vec::new();
    for (name, st) in seeds {
        if s.spent() >= s.budget {
            break;
        }
        let st = s.fit(st);
        let h = s.eval(&st);
        if best_seed.is_none_or(|(_, b)| h > b) {
            best_seed = Some((name, h));
        }
        pop.push((st, h));
    }
    while pop.len() < MU && s.spent() < s.budget {
        let st = s.random();
        let h = s.eval(&st);
        pop.push((st, h));
    }
    survive(&mut pop);
    let mut stale = 0;
    while s.spent() < s.budget && stale < 50 {
        let before = s.spent();
        let mut children = Vec::new();
        for k in 0..LAMBDA {
            if s.spent() >= s.budget {
                break;
            }
            let child = if k == LAMBDA - 1 {
                s.random()
            } else {
                let a = tournament(&mut s.rng, &pop);
                let mut c = if s.rng.random_bool(0.3) {
                    let b = tournament(&mut s.rng, &pop);
                    crossover(&mut s.rng, &a, &b)
                } else {
                    a
                };
                for _ in 0..s.rng.random_range(1..=3) {
                    mutate(&mut s.rng, &mut c);
                }
                c
            };
            let child = s.fit(&child);
            let h = s.eval(&child);
            children.push((child, h));
        }
        pop.extend(children);
        survive(&mut pop);
        // Every child already played: the population has converged.
        stale = if s.spent() == before { stale + 1 } else { 0 };
    }
    // Simplifying what was found may play a quarter as many again.
    s.budget = s.spent() + (s.budget / 4).max(8);
    let best = s.best.clone().expect("at least one strategy was played");
    let simple = simplify(&mut s, best.0.clone());
    let simple = s.fit(&simple);
    let outcome = s.cache[&simple].clone();
    Found {
        strategy: simple,
        outcome,
        best,
        evaluations: s.spent(),
        best_seed,
    }
}

/// The best `MU`, most harmful first, one of each.
fn survive(pop: &mut Vec<(Strategy, f64)>) {
    pop.sort_by(|a, b| b.1.total_cmp(&a.1));
    let mut seen = std::collections::HashSet::new();
    pop.retain(|(s, _)| seen.insert(s.clone()));
    pop.truncate(MU);
}

fn tournament(rng: &mut ChaCha8Rng, pop: &[(Strategy, f64)]) -> Strategy {
    let a = &pop[rng.random_range(0..pop.len())];
    let b = &pop[rng.random_range(0..pop.len())];
    if a.1 >= b.1 { a.0.clone() } else { b.0.clone() }
}

fn crossover(rng: &mut ChaCha8Rng, a: &Strategy, b: &Strategy) -> Strategy {
    let n = a.cohorts.len().max(b.cohorts.len());
    let mut cohorts = Vec::new();
    for i in 0..n {
        let pick = if rng.random_bool(0.5) { a } else { b };
        let other = if std::ptr::eq(pick, a) { b } else { a };
        if let Some(c) = pick.cohorts.get(i).or(other.cohorts.get(i)) {
            cohorts.push(*c);
        }
    }
    cohorts.truncate(MAX_COHORTS);
    Strategy { cohorts }
}

fn pick<T: Copy>(rng: &mut ChaCha8Rng, xs: &[T]) -> T {
    xs[rng.random_range(0..xs.len())]
}

const MEMBERS: &[u8] = &[1, 2, 3, 4, 8, 12, 16, 24, 32, 48, 64];
const PERIODS: &[u16] = &[2, 5, 10, 20, 40, 80, 160, 320, 640, 1000, 2000];
const ARGV_KIB: &[u32] = &[0, 4, 64, 256, 1024, 2048, MAX_ARGV_KIB];
const FRAMES: &[u16] = &[1, 4, 16, 64, 256, 1024, 4096];
const LABEL_KIB: &[u16] = &[1, 16, 64, 128, MAX_NAME_KIB];
const TRICKLE_BYTES: &[u16] = &[1, 3, 64, 1024, 16384, 65535];

fn class(rng: &mut ChaCha8Rng) -> Priority {
    pick(rng, &Priority::ALL)
}

fn random_play(rng: &mut ChaCha8Rng) -> Play {
    match rng.random_range(0..9) {
        0..=3 => Play::Shim {
            class: class(rng),
            work: rng.random_bool(0.7),
            recall: pick(rng, &[Recall::Honest, Recall::Reask, Recall::Ignore]),
            uuids: if rng.random_bool(0.2) {
                rng.random_range(1..=32)
            } else {
                0
            },
        },
        4 => Play::Ping {
            frames: pick(rng, FRAMES),
        },
        5 => Play::Status {
            frames: pick(rng, FRAMES),
        },
        6 => Play::Name {
            kib: pick(rng, LABEL_KIB),
            frames: pick(rng, &[1, 2, 4, 16]),
        },
        7 => Play::Trickle {
            kib: pick(rng, LABEL_KIB),
            bytes: pick(rng, TRICKLE_BYTES),
        },
        _ => Play::Lease {
            want: random_want(rng),
            queued: rng.random_bool(0.5),
        },
    }
}

/// One of [`Want::ALL`], a GPU's memory less one of [`NEAR_WHOLE`] for
/// the near-whole one.
fn random_want(rng: &mut ChaCha8Rng) -> Want {
    match pick(rng, &Want::ALL) {
        Want::WholeMemory { .. } => Want::WholeMemory {
            less: pick(rng, NEAR_WHOLE),
        },
        want => want,
    }
}

fn random_cohort(rng: &mut ChaCha8Rng) -> Cohort {
    let members = pick(rng, MEMBERS);
    Cohort {
        play: random_play(rng),
        members,
        procs: if rng.random_bool(0.5) {
            1
        } else {
            rng.random_range(1..=members)
        },
        start_ms: pick(rng, &[0, 0, 0, 100, 300, 700]),
        period_ms: pick(rng, PERIODS),
        duty: pick(rng, &[5, 10, 25, 50, 75, 100, 100]),
        stagger: pick(rng, &[0, 0, 10, 25, 50]),
        reconnect: rng.random_bool(0.25),
        respawn: rng.random_bool(0.1),
        argv: Argv {
            kib: if rng.random_bool(0.7) {
                0
            } else {
                pick(rng, ARGV_KIB)
            },
            text: pick(
                rng,
                &[Text::Plain, Text::Plain, Text::Controls, Text::Fields],
            ),
        },
        slow: rng.random_bool(0.1),
    }
}

fn random_strategy(rng: &mut ChaCha8Rng) -> Strategy {
    let n = rng.random_range(1..=2);
    Strategy {
        cohorts: (0..n).map(|_| random_cohort(rng)).collect(),
    }
}

/// A number moved: halved, doubled, nudged, or drawn afresh.
fn nudge(rng: &mut ChaCha8Rng, x: u32, lo: u32, hi: u32, fresh: &[u32]) -> u32 {
    let y = match rng.random_range(0..5) {
        0 => x / 2,
        1 => x.saturating_mul(2),
        2 => x.saturating_add(rng.random_range(1..=(x / 4).max(1))),
        3 => x.saturating_sub(rng.random_range(1..=(x / 4).max(1))),
        _ => pick(rng, fresh),
    };
    y.clamp(lo, hi)
}

/// A `Name` label's size nudged, in KiB (whole or trickled frames alike).
fn nudge_label_kib(rng: &mut ChaCha8Rng, kib: u16) -> u16 {
    nudge(
        rng,
        u32::from(kib),
        1,
        u32::from(MAX_NAME_KIB),
        &[1, 64, 250],
    ) as u16
}

fn mutate_play(rng: &mut ChaCha8Rng, p: Play) -> Play {
    if rng.random_bool(0.2) {
        return random_play(rng);
    }
    match p {
        Play::Shim {
            class: c,
            work,
            recall,
            uuids,
        } => match rng.random_range(0..4) {
            0 => Play::Shim {
                class: class(rng),
                work,
                recall,
                uuids,
            },
            1 => Play::Shim {
                class: c,
                work: !work,
                recall,
                uuids,
            },
            2 => Play::Shim {
                class: c,
                work,
                recall: pick(rng, &[Recall::Honest, Recall::Reask, Recall::Ignore]),
                uuids,
            },
            _ => Play::Shim {
                class: c,
                work,
                recall,
                uuids: nudge(rng, u32::from(uuids), 0, 64, &[0, 1, 8, 15, 16, 32, 64]) as u8,
            },
        },
        Play::Ping { frames } => Play::Ping {
            frames: nudge(rng, u32::from(frames), 1, 4096, &[1, 64, 1024]) as u16,
        },
        Play::Status { frames } => Play::Status {
            frames: nudge(rng, u32::from(frames), 1, 4096, &[1, 16, 64]) as u16,
        },
        Play::Name { kib, frames } => {
            if rng.random_bool(0.5) {
                Play::Name {
                    kib: nudge_label_kib(rng, kib),
                    frames,
                }
            } else {
                Play::Name {
                    kib,
                    frames: nudge(rng, u32::from(frames), 1, 64, &[1, 2, 8]) as u8,
                }
            }
        }
        Play::Lease { want, queued } => {
            if rng.random_bool(0.5) {
                Play::Lease {
                    want: random_want(rng),
                    queued,
                }
            } else {
                Play::Lease {
                    want,
                    queued: !queued,
                }
            }
        }
        Play::Trickle { kib, bytes } => {
            if rng.random_bool(0.5) {
                Play::Trickle {
                    kib: nudge_label_kib(rng, kib),
                    bytes,
                }
            } else {
                Play::Trickle {
                    kib,
                    bytes: nudge(rng, u32::from(bytes), 1, 65535, &[1, 64, 16384]) as u16,
                }
            }
        }
    }
}

fn mutate_cohort(rng: &mut ChaCha8Rng, c: &mut Cohort) {
    match rng.random_range(0..12) {
        0 | 1 => c.play = mutate_play(rng, c.play),
        2 => {
            c.members = nudge(
                rng,
                u32::from(c.members),
                1,
                u32::from(MAX_MEMBERS),
                &[1, 4, 16, 64],
            ) as u8;
            c.procs = c.procs.min(c.members);
        }
        // Now and then the processes of the cohort before (0).
        3 if rng.random_range(0..4) == 0 => c.procs = 0,
        3 => {
            c.procs = nudge(
                rng,
                u32::from(c.procs.max(1)),
                1,
                u32::from(c.members),
                &[1],
            ) as u8
        }
        4 => c.start_ms = nudge(rng, u32::from(c.start_ms), 0, 1500, &[0, 200, 500]) as u16,
        5 => {
            c.period_ms = nudge(
                rng,
                u32::from(c.period_ms),
                2,
                2000,
                &PERIODS.iter().map(|&p| u32::from(p)).collect::<Vec<_>>(),
            ) as u16
        }
        6 => c.duty = nudge(rng, u32::from(c.duty), 1, 100, &[5, 25, 50, 100]) as u8,
        7 => c.stagger = nudge(rng, u32::from(c.stagger), 0, 100, &[0, 5, 10, 50]) as u8,
        8 => {
            c.reconnect = !c.reconnect;
            if rng.random_bool(0.3) {
                c.respawn = !c.respawn;
            }
        }
        9 => c.argv.kib = nudge(rng, c.argv.kib, 0, MAX_ARGV_KIB, ARGV_KIB),
        10 => c.argv.text = pick(rng, &[Text::Plain, Text::Controls, Text::Fields]),
        _ => c.slow = !c.slow,
    }
}

fn mutate(rng: &mut ChaCha8Rng, s: &mut Strategy) {
    let n = s.cohorts.len();
    match rng.random_range(0..10) {
        0 if n < MAX_COHORTS => s.cohorts.push(random_cohort(rng)),
        1 if n > 1 => {
            s.cohorts.remove(rng.random_range(0..n));
        }
        2 if n < MAX_COHORTS && n > 0 => {
            let mut c = s.cohorts[rng.random_range(0..n)];
            mutate_cohort(rng, &mut c);
            s.cohorts.push(c);
        }
        _ if n > 0 => {
            let i = rng.random_range(0..n);
            mutate_cohort(rng, &mut s.cohorts[i]);
        }
        _ => s.cohorts.push(random_cohort(rng)),
    }
}

/// `best` made simpler while it harms at least four fifths as much (and,
/// when it breaks the invariant, still breaks it): cohorts dropped, then
/// each cohort's numbers brought down and its extras switched off.
fn simplify(s: &mut Searcher<'_>, best: Strategy) -> Strategy {
    let target = s.cache[&best].harm;
    let threshold = s.inv.threshold();
    let good = |h: f64| h >= 0.8 * target && (target <= threshold || h > threshold);
    let mut cur = best;
    let mut tries: Vec<Strategy> = Vec::new();
    let mut progress = true;
    while progress && s.spent() < s.budget {
        progress = false;
        tries.clear();
        for i in 0..cur.cohorts.len() {
            if cur.cohorts.len() > 1 {
                let mut t = cur.clone();
                t.cohorts.remove(i);
                tries.push(t);
            }
            let c = cur.cohorts[i];
            let plain = cohort(c.play);
            let mut simpler = |f: &dyn Fn(&mut Cohort)| {
                let mut t = cur.clone();
                f(&mut t.cohorts[i]);
                if t != cur {
                    tries.push(t);
                }
            };
            simpler(&|c| c.slow = plain.slow);
            simpler(&|c| c.respawn = plain.respawn);
            simpler(&|c| c.reconnect = plain.reconnect);
            simpler(&|c| c.argv = plain.argv);
            simpler(&|c| c.argv.kib /= 2);
            simpler(&|c| c.start_ms = plain.start_ms);
            simpler(&|c| c.procs = 1);
            simpler(&|c| {
                c.members = (c.members / 2).max(1);
                c.procs = c.procs.min(c.members);
            });
            simpler(&|c| {
                if let Play::Shim { uuids, .. } = &mut c.play {
                    *uuids /= 2;
                }
            });
        }
        for t in std::mem::take(&mut tries) {
            if s.spent() >= s.budget {
                break;
            }
            if good(s.eval(&t)) {
                cur = t;
                progress = true;
                break;
            }
        }
    }
    cur
}

/// What a search found, in words, and as a regression test to paste
/// into redteam/tests/found.rs.
pub fn report(f: &Found, seed: u64) -> String {
    let inv = f.outcome.invariant;
    let verdict = if f.outcome.holds() { "holds" } else { "BROKEN" };
    let seeded = f
        .best_seed
        .map(|(n, h)| format!("; the best seed strategy was {n} (harm {h:.3})"))
        .unwrap_or_default();
    let simpler = if f.best.0 == f.strategy {
        String::new()
    } else {
        format!(
            " (made simpler from the most harmful played, harm {:.3}: {})",
            f.best.1.harm,
            f.best.0.describe()
        )
    };
    let rotation = if f.strategy.rotates() {
        " (connections of one user taking turns: a rotation)"
    } else {
        ""
    };
    let code = f.strategy.to_rust().replace('\n', "\n    ");
    format!(
        "{}: {verdict}, harm {:.3} against a threshold of {:.3}: {}\n  strategy: {}{rotation}{simpler}\n  found in {} strategies played (seed {seed}){seeded}\n  regression test:\n\n#[test]\nfn {}_seed_{seed}() {{\n    let s = {code};\n    holds(Invariant::{:?}, &s);\n}}\n",
        inv.name(),
        f.outcome.harm,
        inv.threshold(),
        f.outcome.figures,
        f.strategy.describe(),
        f.evaluations,
        inv.name(),
        inv,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutations_stay_within_the_bounds() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut s = random_strategy(&mut rng);
        for _ in 0..5000 {
            mutate(&mut rng, &mut s);
            assert!(!s.cohorts.is_empty() && s.cohorts.len() <= MAX_COHORTS);
            for c in &s.cohorts {
                assert!((1..=MAX_MEMBERS).contains(&c.members), "{c:?}");
                assert!(c.procs <= c.members, "{c:?}");
                assert!((2..=2000).contains(&c.period_ms) && (1..=100).contains(&c.duty));
                assert!(c.argv.kib <= MAX_ARGV_KIB);
            }
        }
    }
}
