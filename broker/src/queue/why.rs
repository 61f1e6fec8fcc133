//! Why each waiting request waits, in words and by GPU: what it needs,
//! what is free, and who holds the rest. Status shows it beside each
//! queued request, so that nobody has to work out from the GPU lines why
//! their job is not running.
//!
//! The walk is `pass`'s without placing: the same queue order and the
//! same holds, so what it says is what the next pass would decide.

use serde::{Deserialize, Serialize};

use gpufrac_common::size::format_size;

use super::refusals::{fmt_indices, plural};
use super::reserve::{Hold, closed_to};
use super::{Nanos, Queue, RequestId, Waiter, Want};

/// Why a request waits.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Why {
    /// One line: what it needs, what is free, who holds the rest.
    pub text: String,
    /// The GPUs (indices) it waits for: those it could use once their
    /// leases end, or that are held back for requests ahead of it.
    pub gpus: Vec<u32>,
    /// Why, as one of a few words (metrics' `reason` label): `fits_now`,
    /// `held_for_earlier` (it would fit, on GPUs held for requests ahead
    /// of it), `no_room`.
    #[serde(default)]
    pub reason: String,
}

impl Queue {
    /// Each waiting request, in queue order, with why it waits.
    pub fn why(&self, now: Nanos) -> Vec<(RequestId, Why)> {
        // GPUs held back so far, each with the place of the request that
        // holds it.
        let mut holds: Vec<(Hold, usize)> = Vec::new();
        let mut out = Vec::new();
        // What each GPU has free and who holds it is the same for every
        // request of the walk: put in words once, not once per request
        // (a thousand requests waiting for one GPU were a thousand
        // lists of its holders).
        let mut rooms = Rooms::of(self);
        for (place, i) in self.order(now).into_iter().enumerate() {
            let w = &self.waiting[i];
            let plain: Vec<Hold> = holds.iter().map(|(h, _)| *h).collect();
            let closed = closed_to(&plain, w.req.uid);
            let why = if self.plan(now, &w.req, &closed).is_some() {
                Why {
                    text: "fits now; placed at the queue's next pass".into(),
                    gpus: Vec::new(),
                    reason: "fits_now".into(),
                }
            } else if self.plan(now, &w.req, &[]).is_some() {
                self.held_for_others(&holds, &closed, w)
            } else {
                self.no_room(w, &mut rooms)
            };
            out.push((w.id, why));
            let held = self.held_back(now, w, &plain);
            holds.extend(held.into_iter().map(|h| (h, place + 1)));
        }
        out
    }

    /// It would fit, but on GPUs held back for requests ahead of it.
    fn held_for_others(&self, holds: &[(Hold, usize)], closed: &[usize], w: &Waiter) -> Why {
        // The held GPUs it could have now: the others are not free anyway.
        let closed: Vec<usize> = closed
            .iter()
            .copied()
            .filter(|&i| {
                let g = &self.gpus[i];
                match w.req.want {
                    _ if !w.req.pin.is_empty() => true,
                    Want::Gpus(_) => self.fits_whole(g),
                    Want::Memory(b) => {
                        g.slots_used < self.cfg.overprovision
                            && (self.cfg.overcommit || g.uncommitted() >= i128::from(b))
                    }
                }
            })
            .collect();
        let closed = &closed;
        let mut gpus: Vec<u32> = closed.iter().map(|&g| self.gpus[g].info.index).collect();
        gpus.sort_unstable();
        gpus.dedup();
        let mut places: Vec<usize> = holds
            .iter()
            .filter(|(h, _)| closed.contains(&h.gpu))
            .map(|&(_, p)| p)
            .collect();
        places.sort_unstable();
        places.dedup();
        let places: Vec<String> = places.iter().map(usize::to_string).collect();
        Why {
            text: format!(
                "{}; it would fit, but {} held for the {} at {} {} of the queue \
                 (escalated, pinned or for whole GPUs: placed first)",
                self.want_words(w),
                gpu_list(&gpus),
                if places.len() == 1 {
                    "request"
                } else {
                    "requests"
                },
                if places.len() == 1 {
                    "position"
                } else {
                    "positions"
                },
                places.join(", ")
            ),
            gpus,
            reason: "held_for_earlier".into(),
        }
    }

    /// No GPU has the room now: what it needs, and what each GPU it could
    /// use has.
    fn no_room(&self, w: &Waiter, rooms: &mut Rooms) -> Why {
        let mut gpus = Vec::new();
        let mut parts = Vec::new();
        if !w.req.pin.is_empty() {
            for p in &w.req.pin {
                let Some(i) = self.gpu_of(&p.uuid) else {
                    continue;
                };
                gpus.push(self.gpus[i].info.index);
                parts.push(rooms.gpu(self, i));
            }
            return Why {
                text: format!("{}; {}", self.want_words(w), parts.join("; ")),
                gpus,
                reason: "no_room".into(),
            };
        }
        match w.req.want {
            Want::Gpus(_) => {
                let free: Vec<u32> = self
                    .gpus
                    .iter()
                    .filter(|g| g.leases.is_empty() && g.outside == 0)
                    .map(|g| g.info.index)
                    .collect();
                parts.push(format!(
                    "{} free{}",
                    free.len(),
                    if free.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", fmt_indices(&free))
                    }
                ));
                for (i, g) in self.gpus.iter().enumerate() {
                    if !g.leases.is_empty() || g.outside > 0 {
                        gpus.push(g.info.index);
                        parts.push(rooms.gpu(self, i));
                    }
                }
            }
            Want::Memory(b) => {
                for (i, g) in self.gpus.iter().enumerate() {
                    if !self.cfg.overcommit && g.info.total_mem < b {
                        continue;
                    }
                    gpus.push(g.info.index);
                    parts.push(rooms.gpu(self, i));
                }
                if !self.mig.is_empty() {
                    parts.push(rooms.mig(self));
                }
            }
        }
        Why {
            text: format!("{}; {}", self.want_words(w), parts.join("; ")),
            gpus,
            reason: "no_room".into(),
        }
    }

    /// What a request asks for, as a clause: "needs 2 whole GPUs".
    fn want_words(&self, w: &Waiter) -> String {
        if !w.req.pin.is_empty() {
            let parts: Vec<String> = w
                .req
                .pin
                .iter()
                .map(|p| {
                    let gpu = self
                        .gpu_of(&p.uuid)
                        .map_or_else(|| p.uuid.clone(), |i| self.gpus[i].info.index.to_string());
                    format!("{} on GPU {gpu}", format_size(p.mem))
                })
                .collect();
            return format!("needs {} (pinned)", parts.join(", "));
        }
        match w.req.want {
            Want::Gpus(n) if self.cfg.overprovision > 1 => format!(
                "needs a free slot on {}",
                plural(n.into(), "GPU", "different GPUs")
            ),
            Want::Gpus(n) => format!("needs {}", plural(n.into(), "whole GPU", "whole GPUs")),
            Want::Memory(b) => format!("needs {} on one GPU", format_size(b)),
        }
    }

    /// What one GPU has free and who holds the rest, in a few words.
    fn gpu_room(&self, g: &super::GpuState) -> String {
        let f = self.cfg.overprovision;
        let free = u64::try_from(g.uncommitted().max(0)).unwrap_or(u64::MAX);
        let outside = if g.outside > 0 {
            format!(
                "; {} held by processes outside gpufrac",
                format_size(g.outside)
            )
        } else {
            String::new()
        };
        if g.leases.is_empty() && g.outside == 0 {
            return format!(
                "GPU {}: free, {}",
                g.info.index,
                format_size(g.info.total_mem)
            );
        }
        if g.leases.is_empty() {
            return format!(
                "GPU {}: {} free of {}{outside}",
                g.info.index,
                format_size(free),
                format_size(g.info.total_mem)
            );
        }
        let owners = self.owners(g);
        if f == 1 && g.slots_used == 1 {
            format!("GPU {}: held whole by {owners}{outside}", g.info.index)
        } else if g.slots_used >= f {
            format!(
                "GPU {}: no free slot ({f}/{f} taken by {owners}){outside}",
                g.info.index
            )
        } else {
            format!(
                "GPU {}: {} free of {} (the rest held by {owners}{outside})",
                g.info.index,
                format_size(free),
                format_size(g.info.total_mem)
            )
        }
    }
}

/// Each GPU's words (`gpu_room`) and the MIG instances' (`busy_summary`),
/// made the first time a walk needs them: the queue does not change
/// during one.
struct Rooms {
    gpus: Vec<Option<String>>,
    mig: Option<String>,
}

impl Rooms {
    /// None yet, for `q`'s GPUs.
    fn of(q: &Queue) -> Rooms {
        Rooms {
            gpus: vec![None; q.gpus.len()],
            mig: None,
        }
    }

    fn gpu(&mut self, q: &Queue, i: usize) -> String {
        self.gpus[i]
            .get_or_insert_with(|| q.gpu_room(&q.gpus[i]))
            .clone()
    }

    fn mig(&mut self, q: &Queue) -> String {
        self.mig.get_or_insert_with(|| q.mig.busy_summary()).clone()
    }
}

/// "GPU 1 is" / "GPUs 0, 2 are".
fn gpu_list(gpus: &[u32]) -> String {
    let list: Vec<String> = gpus.iter().map(u32::to_string).collect();
    match gpus {
        [one] => format!("GPU {one} is"),
        _ => format!("GPUs {} are", list.join(", ")),
    }
}
