//! The queue's order among requests neither escalated nor pinned: by the
//! part of a GPU each takes.
//!
//! Whole-GPU requests go fewest GPUs first, FIFO among equals. A memory
//! request takes part of one GPU, so it goes before whole-GPU requests,
//! but never before one that came earlier: a fraction backfills only
//! where it delays no earlier whole-GPU request, and the GPUs such a
//! request waits for are held back from everyone behind it (`reserve`).
//! So the order needs no threshold on a fraction's size: `--gpu-memory`
//! of a GPU's whole memory less a byte waits behind an earlier `--gpus 1`
//! exactly as one of the whole memory does, and a stream of small
//! fractions arriving after a `--gpus 2` cannot take the GPUs it waits
//! for.

/// Appends `whole` (arrival, item) in their order and `fractions`
/// (arrival, item) in arrival order to `out`, merged: each fraction
/// right after the last of the whole-GPU requests that arrived before it.
pub(super) fn merge<T: Copy>(whole: &[(u64, T)], fractions: &[(u64, T)], out: &mut Vec<T>) {
    // first[i]: the earliest arrival among whole[i..]. A fraction goes
    // before whole[i] when every whole-GPU request from there on came
    // after it.
    let mut first = vec![u64::MAX; whole.len() + 1];
    for i in (0..whole.len()).rev() {
        first[i] = first[i + 1].min(whole[i].0);
    }
    let mut f = fractions.iter().peekable();
    for (i, &(_, item)) in whole.iter().enumerate() {
        while let Some(&(_, x)) = f.next_if(|&&(seq, _)| seq < first[i]) {
            out.push(x);
        }
        out.push(item);
    }
    out.extend(f.map(|&(_, x)| x));
}
