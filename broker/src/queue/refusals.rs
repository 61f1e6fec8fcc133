//! Refusals, in words: what no GPU of this node could ever satisfy, and
//! what is busy when a `--no-wait` request finds no room; each says what
//! would work instead.

use std::cmp::Reverse;

use gpufrac_common::size::format_size_arg;

use super::{GpuState, Queue, Refusal, Request, RequestId, Want};

pub(super) fn fmt_bytes(b: u64) -> String {
    const K: f64 = 1024.0;
    let f = b as f64;
    if f >= K * K * K {
        format!("{:.1} GiB", f / (K * K * K))
    } else if f >= K * K {
        format!("{:.1} MiB", f / (K * K))
    } else if f >= K {
        format!("{:.1} KiB", f / K)
    } else {
        format!("{b} B")
    }
}

pub(super) fn fmt_indices(idx: &[u32]) -> String {
    match idx {
        [] => "none".into(),
        [one] => format!("index {one}"),
        [first, .., last] if idx.windows(2).all(|w| w[1] == w[0] + 1) => {
            format!("indices {first}-{last}")
        }
        _ => {
            let list: Vec<String> = idx.iter().map(u32::to_string).collect();
            format!("indices {}", list.join(", "))
        }
    }
}

pub(super) fn plural(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

pub(super) fn refuse(reason: impl Into<String>) -> Refusal {
    Refusal {
        reason: reason.into(),
    }
}

pub(super) fn want_text(want: Want) -> String {
    match want {
        Want::Gpus(n) => format!("--gpus {n}"),
        Want::Memory(b) => format!("--gpu-memory {}", format_size_arg(b)),
    }
}

impl Queue {
    pub(super) fn check(&self, id: RequestId, req: &Request) -> Result<(), Refusal> {
        if self.held.contains_key(&id) || self.waiting.contains(id) {
            return Err(refuse(format!("request {id} is already queued or running")));
        }
        if let Some(c) = req.compute
            && !(c.is_finite() && c > 0.0)
        {
            return Err(refuse(format!(
                "invalid compute share {c}: it must be a positive weight, e.g. 30%"
            )));
        }
        if let Some(l) = req.limit
            && !(l.is_finite() && l > 0.0 && l <= 1.0)
        {
            return Err(refuse(format!(
                "invalid compute limit {l}: it must be a fraction in (0, 1], e.g. 30%"
            )));
        }
        if self.gpus.is_empty() && self.mig.is_empty() {
            return Err(refuse("this node has no GPUs"));
        }
        if !req.pin.is_empty() {
            return self.check_pinned(req);
        }
        let indices: Vec<u32> = self.gpus.iter().map(|g| g.info.index).collect();
        match req.want {
            Want::Gpus(0) => Err(refuse("requested 0 GPUs; ask for at least 1")),
            Want::Gpus(_) if self.gpus.is_empty() => Err(refuse(format!(
                "--gpus needs whole GPUs, and every GPU of this node is in MIG mode ({}), \
                 handed out only as MIG instances; ask for --gpu-memory instead{}",
                self.mig_gpus_text(),
                self.largest_profile_text()
                    .map_or_else(String::new, |t| format!(", at most {t}"))
            ))),
            Want::Gpus(n) if n as usize > self.gpus.len() => {
                let mut reason = format!(
                    "requested {} but this node has {} ({})",
                    plural(n.into(), "GPU", "GPUs"),
                    self.gpus.len(),
                    fmt_indices(&indices)
                );
                if self.cfg.overprovision > 1 {
                    reason.push_str(&format!(
                        "; with --overprovision {} a lease still takes at most one slot \
                         per GPU, so ask for --gpu-memory, or at most --gpus {}",
                        self.cfg.overprovision,
                        self.gpus.len()
                    ));
                } else {
                    reason.push_str(&format!("; ask for at most --gpus {}", self.gpus.len()));
                }
                if !self.mig.is_empty() {
                    reason.push_str(&format!(
                        "; GPUs in MIG mode ({}) are handed out only as MIG instances, for --gpu-memory",
                        self.mig_gpus_text()
                    ));
                }
                Err(refuse(reason))
            }
            Want::Gpus(_) => Ok(()),
            Want::Memory(0) => Err(refuse(
                "requested 0 bytes of GPU memory; ask for a positive size, e.g. 4G",
            )),
            Want::Memory(b) if !self.mig.is_empty() => {
                let whole = self
                    .gpus
                    .iter()
                    .max_by_key(|g| (g.info.total_mem, Reverse(g.info.index)));
                if self.mig.could_fit(b, req.compute)
                    || whole.is_some_and(|g| b <= g.info.total_mem)
                {
                    return Ok(());
                }
                let (gpu, p) = self.mig.largest().expect("a MIG GPU has profiles");
                let mut most = p.mem;
                let mut reason = format!(
                    "requested {} but no MIG profile holds it: the largest is {} ({}, GPU {gpu})",
                    fmt_bytes(b),
                    p.name,
                    fmt_bytes(p.mem)
                );
                match whole {
                    Some(g) => {
                        most = most.max(g.info.total_mem);
                        reason.push_str(&format!(
                            ", and the largest GPU outside MIG mode has {} (GPU {})",
                            fmt_bytes(g.info.total_mem),
                            g.info.index
                        ));
                    }
                    None => reason.push_str(", and no GPU of this node is outside MIG mode"),
                }
                reason.push_str(&format!(
                    "; ask for at most --gpu-memory {}",
                    format_size_arg(most)
                ));
                Err(refuse(reason))
            }
            Want::Memory(b) => {
                let largest = self
                    .gpus
                    .iter()
                    .max_by_key(|g| (g.info.total_mem, Reverse(g.info.index)))
                    .expect("non-empty");
                if b > largest.info.total_mem {
                    Err(refuse(format!(
                        "requested {} but the largest GPU has {} (GPU {}); \
                         ask for at most --gpu-memory {}",
                        fmt_bytes(b),
                        fmt_bytes(largest.info.total_mem),
                        largest.info.index,
                        format_size_arg(largest.info.total_mem)
                    )))
                } else {
                    Ok(())
                }
            }
        }
    }

    fn mig_gpus_text(&self) -> String {
        let v: Vec<u32> = self.mig.gpus().map(|g| g.index).collect();
        let list = fmt_indices(&v);
        match list.strip_prefix("index ") {
            Some(one) => format!("GPU {one}"),
            None => format!("GPUs {}", list.trim_start_matches("indices ")),
        }
    }

    fn largest_profile_text(&self) -> Option<String> {
        self.mig.largest().map(|(gpu, p)| {
            format!(
                "(the {} profile of GPU {gpu}): --gpu-memory {}",
                p.name,
                format_size_arg(p.mem)
            )
        })
    }

    /// The jobs holding leases on `g`: "job 41", "jobs 41, pod ns/p".
    pub(super) fn owners(&self, g: &GpuState) -> String {
        // A pod's lease is named by its pod: the plugin that asked for it
        // has one pid for all of them.
        let mut jobs: Vec<(u32, Option<&str>)> = g
            .leases
            .iter()
            .filter_map(|l| self.held.get(l))
            .map(|h| (h.req.job, h.req.pod.as_deref()))
            .collect();
        jobs.sort_unstable();
        let ids: Vec<String> = jobs
            .iter()
            .map(|(j, pod)| match pod {
                Some(p) => format!("pod {p}"),
                None => j.to_string(),
            })
            .collect();
        format!(
            "{} {}",
            if ids.len() == 1 { "job" } else { "jobs" },
            ids.join(", ")
        )
    }

    pub(super) fn busy_summary(&self) -> String {
        let f = self.cfg.overprovision;
        let parts: Vec<String> = self
            .gpus
            .iter()
            .map(|g| {
                let outside = if g.outside > 0 {
                    format!(
                        ", {} held by processes outside gpufrac",
                        fmt_bytes(g.outside)
                    )
                } else {
                    String::new()
                };
                if g.leases.is_empty() {
                    return match g.outside {
                        0 => format!("GPU {}: free", g.info.index),
                        _ => format!("GPU {}: no lease{outside}", g.info.index),
                    };
                }
                let owners = self.owners(g);
                if f == 1 && g.slots_used == 1 {
                    format!("GPU {}: held whole by {owners}{outside}", g.info.index)
                } else {
                    format!(
                        "GPU {}: {}/{f} slots, {} of {} committed ({owners}){outside}",
                        g.info.index,
                        g.slots_used,
                        fmt_bytes(g.committed),
                        fmt_bytes(g.info.total_mem)
                    )
                }
            })
            .collect();
        let mut text = parts.join("; ");
        if !self.mig.is_empty() {
            if !text.is_empty() {
                text.push_str("; ");
            }
            text.push_str(&self.mig.busy_summary());
        }
        text
    }
}
