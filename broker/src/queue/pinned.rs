//! Pinned requests (the Kubernetes device plugin's pods): the GPUs are
//! already chosen, so the queue only checks the pins and books a fraction
//! on each.

use super::refusals::{fmt_bytes, refuse, want_text};
use super::{Pinned, Queue, Refusal, Request, Share, Want};

/// What a pinned request wants: the memory of all its pins.
pub fn pinned_total(pin: &[Pinned]) -> u64 {
    pin.iter().fold(0u64, |a, p| a.saturating_add(p.mem))
}

impl Queue {
    pub(super) fn check_pinned(&self, req: &Request) -> Result<(), Refusal> {
        let sum = pinned_total(&req.pin);
        if req.want != Want::Memory(sum) {
            return Err(refuse(format!(
                "a pinned request wants the sum of its pins ({}), not {}",
                fmt_bytes(sum),
                want_text(req.want)
            )));
        }
        for (n, p) in req.pin.iter().enumerate() {
            let Some(i) = self.gpu_of(&p.uuid) else {
                let why = if self
                    .mig
                    .gpus()
                    .any(|g| g.uuid.eq_ignore_ascii_case(&p.uuid))
                {
                    "is in MIG mode, handed out only as MIG instances"
                } else {
                    "is not a GPU of this broker"
                };
                return Err(refuse(format!("GPU {} {why}", p.uuid)));
            };
            if req.pin[..n]
                .iter()
                .any(|q| q.uuid.eq_ignore_ascii_case(&p.uuid))
            {
                return Err(refuse(format!(
                    "GPU {} is named twice; name each GPU once with all its memory",
                    p.uuid
                )));
            }
            let g = &self.gpus[i].info;
            if p.mem == 0 || p.mem > g.total_mem {
                return Err(refuse(format!(
                    "requested {} on GPU {}, which has {}; ask for 1 byte to {} there",
                    fmt_bytes(p.mem),
                    g.index,
                    fmt_bytes(g.total_mem),
                    fmt_bytes(g.total_mem)
                )));
            }
        }
        Ok(())
    }

    /// A fraction on each pinned GPU, if every one has a free slot and the
    /// memory (or `overcommit`).
    pub(super) fn plan_pinned(&self, pin: &[Pinned]) -> Option<Vec<Share>> {
        pin.iter()
            .map(|p| {
                self.pin_share(p).filter(|s| {
                    let g = &self.gpus[s.gpu];
                    g.slots_used < self.cfg.overprovision
                        && (self.cfg.overcommit || g.uncommitted() >= i128::from(s.mem))
                })
            })
            .collect()
    }

    /// What a pin holds on its GPU (a fraction), if the GPU is this
    /// queue's.
    pub(super) fn pin_share(&self, p: &Pinned) -> Option<Share> {
        Some(Share {
            gpu: self.gpu_of(&p.uuid)?,
            mem: p.mem,
            slot: false,
        })
    }
}
