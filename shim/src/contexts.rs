//! The contexts this process has, by device: a revoked timeslice drains
//! exactly this process's work on that device (`client/drain.rs`), and a primary
//! context released for the last time returns the charges of what it owned
//! (`hooks/ctx.rs`).

use std::sync::Mutex;

/// (device, context) of every context created or retained.
static CONTEXTS: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());
/// (device, primary context) per device.
static PRIMARY: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn remember(dev: usize, ctx: usize) {
    let mut g = lock(&CONTEXTS);
    if !g.contains(&(dev, ctx)) {
        g.push((dev, ctx));
    }
}

pub fn forget(ctx: usize) {
    lock(&CONTEXTS).retain(|&(_, c)| c != ctx);
}

pub fn of_device(dev: usize) -> Vec<usize> {
    lock(&CONTEXTS)
        .iter()
        .filter(|(d, _)| *d == dev)
        .map(|&(_, c)| c)
        .collect()
}

pub fn set_primary(dev: usize, ctx: usize) {
    let mut g = lock(&PRIMARY);
    g.retain(|(d, _)| *d != dev);
    g.push((dev, ctx));
}

pub fn primary_of(dev: usize) -> Option<usize> {
    lock(&PRIMARY)
        .iter()
        .find(|(d, _)| *d == dev)
        .map(|&(_, c)| c)
}
