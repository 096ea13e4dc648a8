// SPDX-License-Identifier: Apache-2.0
//! Data-parallel helpers that need no communication (dataparallel.h). Pure functions, any thread.

use crate::error::{check, invalid, Result};
use gradsync_sys as sys;
use std::os::raw::c_int;
use std::ptr;

/// `(start, len)` of part `index` of `n` elements split into `parts` parts, the library's partition
/// rule (`gradsync_partition`): `n=10, parts=3` gives (0,4) (4,3) (7,3).
pub fn partition(n: u64, parts: u32, index: u32) -> Result<(u64, u64)> {
    let (mut start, mut len) = (0u64, 0u64);
    check(unsafe { sys::gradsync_partition(n, parts, index, &mut start, &mut len) })?;
    Ok((start, len))
}

/// The sample indices dealt round-robin to `worker` of `workers`: k, k + workers, ... below
/// `samples` (`gradsync_split_round_robin`).
pub fn split_round_robin(samples: u64, workers: u32, worker: u32) -> Result<Vec<u64>> {
    let mut needed = 0usize;
    let rc = unsafe { sys::gradsync_split_round_robin(samples, workers, worker, ptr::null_mut(), 0, &mut needed) };
    if rc != sys::GRADSYNC_E_BUFS {
        check(rc)?;
    }
    let mut out = vec![0u64; needed];
    check(unsafe {
        sys::gradsync_split_round_robin(samples, workers, worker, out.as_mut_ptr(), out.len(), &mut needed)
    })?;
    out.truncate(needed);
    Ok(out)
}

/// What [`weighted_merge`] returns besides the merged gradient.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Merged {
    /// `Σ counts[i]·losses[i] / Σ counts[i]`, when losses were given.
    pub mean_loss: Option<f64>,
    /// `Σ counts[i]`.
    pub total_count: u64,
}

/// `out[j] = Σ counts[i]·grads[i][j] / Σ counts[i]`, in double, in worker order, rounded once
/// (`gradsync_weighted_merge_f32`). A worker of count 0 is not read. `counts` (and `losses`)
/// have one entry per gradient.
pub fn weighted_merge(grads: &[&[f32]], counts: &[u64], losses: Option<&[f64]>, out: &mut [f32]) -> Result<Merged> {
    merge_with(sys::gradsync_weighted_merge_f32, grads, counts, losses, out)
}

/// [`weighted_merge`] for `f64` gradients, summed as if in twice double precision and rounded
/// once: within a relative 1e-12 of the exact weighted mean, even for counts above 2^53
/// (`gradsync_weighted_merge_f64` says when).
pub fn weighted_merge_f64(grads: &[&[f64]], counts: &[u64], losses: Option<&[f64]>, out: &mut [f64]) -> Result<Merged> {
    merge_with(sys::gradsync_weighted_merge_f64, grads, counts, losses, out)
}

type MergeFn<T> =
    unsafe extern "C" fn(*const *const T, *const usize, *const u64, *const f64, usize, *mut T, usize, *mut f64, *mut u64) -> c_int;

fn merge_with<T>(f: MergeFn<T>, grads: &[&[T]], counts: &[u64], losses: Option<&[f64]>, out: &mut [T]) -> Result<Merged> {
    if counts.len() != grads.len() || losses.map_or(false, |l| l.len() != grads.len()) {
        return Err(invalid(
            "weighted_merge",
            format!(
                "{} gradients, {} counts, {} losses",
                grads.len(),
                counts.len(),
                losses.map_or(0, |l| l.len())
            ),
        ));
    }
    let ptrs: Vec<*const T> = grads.iter().map(|g| g.as_ptr()).collect();
    let lens: Vec<usize> = grads.iter().map(|g| g.len()).collect();
    let mut mean_loss = 0f64;
    let mut total = 0u64;
    check(unsafe {
        f(
            ptrs.as_ptr(),
            lens.as_ptr(),
            counts.as_ptr(),
            losses.map_or(ptr::null(), |l| l.as_ptr()),
            grads.len(),
            out.as_mut_ptr(),
            out.len(),
            if losses.is_some() { &mut mean_loss } else { ptr::null_mut() },
            &mut total,
        )
    })?;
    Ok(Merged { mean_loss: losses.map(|_| mean_loss), total_count: total })
}
