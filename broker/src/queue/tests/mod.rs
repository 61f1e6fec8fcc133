//! Admission queue unit tests, by topic. This file holds what they share:
//! GPUs, requests and queues to build them from (one with a GPU in MIG
//! mode).

mod backfill;
mod mig_leases;
mod order;
mod pinned;
mod placement;
mod props;
mod requests;
mod reserve;
mod why;

use super::*;

const GIB: u64 = 1 << 30;
const SEC: Nanos = 1_000_000_000;

fn gpus(totals: &[u64]) -> Vec<GpuInfo> {
    totals
        .iter()
        .enumerate()
        .map(|(i, &t)| GpuInfo {
            index: i as u32,
            uuid: format!("GPU-{i:04}"),
            total_mem: t,
        })
        .collect()
}

fn req(want: Want) -> Request {
    Request {
        want,
        compute: None,
        limit: None,
        label: format!("job {want:?}"),
        job: 0,
        uid: 0,
        pin: Vec::new(),
        pod: None,
    }
}

/// A pod's request: `gib` on each GPU of `on` (positions, as `gpus`
/// names them).
fn pinned(on: &[(u32, u64)]) -> Request {
    let pin: Vec<Pinned> = on
        .iter()
        .map(|&(i, gib)| Pinned {
            uuid: format!("GPU-{i:04}"),
            mem: gib * GIB,
        })
        .collect();
    Request {
        want: Want::Memory(pin.iter().map(|p| p.mem).sum()),
        label: "pod ns/p".into(),
        pin,
        ..req(Want::Gpus(1))
    }
}

/// `r`, as `uid`'s.
fn by(uid: u32, r: Request) -> Request {
    Request { uid, ..r }
}

fn whole(n: u32) -> Request {
    req(Want::Gpus(n))
}

fn mem(gib: u64) -> Request {
    req(Want::Memory(gib * GIB))
}

fn placed(leases: &[Lease]) -> Vec<(RequestId, Vec<u32>)> {
    leases.iter().map(|l| (l.id, l.gpus.clone())).collect()
}

fn two_80g() -> Queue {
    Queue::new(gpus(&[80 * GIB, 80 * GIB]), QueueConfig::default())
}

/// GPU 1 (80 GiB) outside MIG mode, GPU 0 an A100-40GB in MIG mode.
fn with_mig() -> Queue {
    let mut q = Queue::new(
        vec![GpuInfo {
            index: 1,
            uuid: "GPU-0001".into(),
            total_mem: 80 * GIB,
        }],
        QueueConfig::default(),
    );
    q.set_mig(mig::Planner::new(vec![mig::models::a100_40gb(0)]));
    q
}
