// SPDX-License-Identifier: Apache-2.0
//! [`ShardedParameter`]: a flat parameter sharded over a communicator's ranks (shard.h, ZeRO-1).

use crate::codec::Codec;
use crate::comm::Communicator;
use crate::error::{check, Error, Result};
use crate::status;
use gradsync_sys as sys;
use std::ptr::{self, NonNull};

/// Optimizers run by the owner of each slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum ShardOptimizer {
    /// `w -= lr·(g + wd·w)`
    Sgd = sys::GRADSYNC_OPTIM_SGD,
    /// `v = μ·v + (g + wd·w); w -= lr·v`
    Momentum = sys::GRADSYNC_OPTIM_MOMENTUM,
    /// Adam with bias correction; weight decay as an L2 term.
    Adam = sys::GRADSYNC_OPTIM_ADAM,
    /// Adam with decoupled weight decay.
    AdamW = sys::GRADSYNC_OPTIM_ADAMW,
}

/// Options of [`ShardedParameter::new`] (`gradsync_shard_options`). The fields are the C struct's
/// (see shard.h); [`Default`] is `GRADSYNC_SHARD_OPTIONS_INIT`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ShardOptions {
    pub optimizer: ShardOptimizer,
    /// Gradients on the wire.
    pub compress: Codec,
    /// Keep each rank's compression residual and add it to its next gradient.
    pub error_feedback: bool,
    /// Clamp the aggregated gradient to `[clamp_min, clamp_max]`.
    pub clamp: Option<(f64, f64)>,
    pub lr: f64,
    pub momentum: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// > 0: scale the gradient by `clip_norm/‖g‖` when its global L2 norm exceeds it; 0: off.
    pub clip_norm: f64,
}

impl Default for ShardOptions {
    fn default() -> Self {
        let d = sys::GRADSYNC_SHARD_OPTIONS_INIT;
        ShardOptions {
            optimizer: ShardOptimizer::Sgd,
            compress: Codec::None,
            error_feedback: false,
            clamp: None,
            lr: d.lr,
            momentum: d.momentum,
            beta1: d.beta1,
            beta2: d.beta2,
            eps: d.eps,
            weight_decay: d.weight_decay,
            clip_norm: d.clip_norm,
        }
    }
}

impl ShardOptions {
    fn to_raw(&self) -> sys::gradsync_shard_options {
        let mut raw = sys::GRADSYNC_SHARD_OPTIONS_INIT;
        raw.optimizer = self.optimizer as i32;
        raw.compress = self.compress as i32;
        raw.error_feedback = self.error_feedback as i32;
        if let Some((lo, hi)) = self.clamp {
            raw.clamp = 1;
            raw.clamp_min = lo;
            raw.clamp_max = hi;
        }
        raw.lr = self.lr;
        raw.momentum = self.momentum;
        raw.beta1 = self.beta1;
        raw.beta2 = self.beta2;
        raw.eps = self.eps;
        raw.weight_decay = self.weight_decay;
        raw.clip_norm = self.clip_norm;
        raw
    }
}

/// Which slice [`ShardedParameter::read_slice`] copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Slice {
    /// This rank's slice of the weights.
    Weights = sys::GRADSYNC_SHARD_WEIGHTS,
    /// This rank's slice of the last aggregated (processed) gradient.
    Gradient = sys::GRADSYNC_SHARD_GRADIENT,
    /// This rank's slice of the optimizer's first state (momentum's velocity, Adam's first moment).
    State1 = sys::GRADSYNC_SHARD_STATE1,
    /// This rank's slice of the optimizer's second state (Adam's second moment).
    State2 = sys::GRADSYNC_SHARD_STATE2,
}

/// This rank's view of a parameter of `total` floats sharded over a communicator
/// (`gradsync_shard`): each rank owns one slice of the weights and its optimizer state.
///
/// **Thread safety**: `Send`, not `Sync` (every call is `@threadsafety handle`). It shares the
/// communicator's group inside the library, which keeps it valid if the [`Communicator`] is dropped
/// first (its collective stages then fail with `MISUSE`); a collective stage and a call on the
/// communicator from two threads at once fail with `MISUSE` rather than race.
///
/// ```compile_fail
/// fn shared<T: Sync>() {}
/// shared::<gradsync::ShardedParameter>(); // not Sync: every call is per handle
/// ```
pub struct ShardedParameter {
    raw: NonNull<sys::gradsync_shard>,
    total: u64,
}

// SAFETY: a handle used by one thread at a time (not Sync); the library reference-counts the
// communicator it was made on.
unsafe impl Send for ShardedParameter {}

impl ShardedParameter {
    /// Creates this rank's view (`gradsync_shard_create`). Local: every rank creates one with the
    /// same `total` and options.
    pub fn new(comm: &Communicator, total: u64, options: &ShardOptions) -> Result<ShardedParameter> {
        let opts = options.to_raw();
        let mut out = ptr::null_mut();
        check(unsafe { sys::gradsync_shard_create(&mut out, comm.as_raw(), total, &opts) })?;
        let raw = NonNull::new(out).expect("gradsync_shard_create returned OK and a NULL handle");
        Ok(ShardedParameter { raw, total })
    }

    /// The number of parameters.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// `(offset, length)` of `rank`'s part, `None` for this rank (`gradsync_shard_part`, base 0).
    pub fn part(&self, rank: Option<i32>) -> Result<(u64, u64)> {
        let (mut offset, mut length) = (0u64, 0u64);
        check(unsafe { sys::gradsync_shard_part(self.raw.as_ptr(), rank.unwrap_or(-1), 0, &mut offset, &mut length) })?;
        Ok((offset, length))
    }

    /// `(offset, length)` of every rank's part (`gradsync_shard_ranges`, base 0).
    pub fn ranges(&self) -> Result<Vec<(u64, u64)>> {
        let mut needed = 0usize;
        let rc = unsafe { sys::gradsync_shard_ranges(self.raw.as_ptr(), 0, ptr::null_mut(), 0, &mut needed) };
        if rc != sys::GRADSYNC_E_BUFS {
            check(rc)?;
        }
        let mut flat = vec![0u64; needed];
        check(unsafe { sys::gradsync_shard_ranges(self.raw.as_ptr(), 0, flat.as_mut_ptr(), flat.len(), &mut needed) })?;
        Ok(flat.chunks_exact(2).map(|p| (p[0], p[1])).collect())
    }

    /// Bytes this rank holds: `(weights, optimizer state, buffers)` (`gradsync_shard_memory`).
    pub fn memory(&self) -> Result<(u64, u64, u64)> {
        let (mut w, mut o, mut b) = (0u64, 0u64, 0u64);
        check(unsafe { sys::gradsync_shard_memory(self.raw.as_ptr(), &mut w, &mut o, &mut b) })?;
        Ok((w, o, b))
    }

    /// The number of optimizer updates applied so far on this rank (`gradsync_shard_updates`).
    pub fn updates(&self) -> Result<i64> {
        let mut n = 0i64;
        check(unsafe { sys::gradsync_shard_updates(self.raw.as_ptr(), &mut n) })?;
        Ok(n)
    }

    /// Changes the learning rate for later updates; set the same on every rank
    /// (`gradsync_shard_set_lr`).
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        check(unsafe { sys::gradsync_shard_set_lr(self.raw.as_ptr(), lr) })
    }

    /// Local: keeps this rank's slice of the full `weights` (`total` floats) and zeroes the
    /// optimizer state (`gradsync_shard_init`).
    pub fn init(&mut self, weights: &[f32]) -> Result<()> {
        check(unsafe { sys::gradsync_shard_init(self.raw.as_ptr(), weights.as_ptr(), weights.len()) })
    }

    /// Local: [`init`](Self::init) with the optimizer state and the update count, to continue
    /// from a checkpoint taken on any number of ranks (`gradsync_shard_restore`). Each array holds
    /// `total` floats; `state1` for momentum and Adam, `state2` for Adam, `None` where the
    /// optimizer keeps no such state. Pass the same on every rank: each keeps its slice.
    pub fn restore(&mut self, weights: &[f32], state1: Option<&[f32]>, state2: Option<&[f32]>, updates: i64) -> Result<()> {
        for (name, state) in [("state1", state1), ("state2", state2)] {
            if let Some(s) = state {
                if s.len() != weights.len() {
                    return Err(crate::error::invalid(
                        "ShardedParameter::restore",
                        format!("{} holds {} floats, weights {}", name, s.len(), weights.len()),
                    ));
                }
            }
        }
        let ptr = |s: Option<&[f32]>| s.map_or(ptr::null(), |s| s.as_ptr());
        check(unsafe {
            sys::gradsync_shard_restore(self.raw.as_ptr(), weights.as_ptr(), ptr(state1), ptr(state2), weights.len(), updates)
        })
    }

    /// Collective: one whole training step — put, aggregate, update, gather
    /// (`gradsync_shard_step`). `weights` receives the new full weights.
    pub fn step(&mut self, gradient: &[f32], weights: &mut [f32], samples: u64) -> Result<()> {
        if gradient.len() != weights.len() {
            // Still call the library, with a NULL gradient: it reports a bad argument on every
            // rank (this one INVALID_ARG, the others REMOTE) instead of leaving the peers waiting.
            let rc = unsafe {
                sys::gradsync_shard_step(self.raw.as_ptr(), ptr::null(), weights.as_mut_ptr(), weights.len(), samples)
            };
            let c = check(rc).err().unwrap_or_else(|| Error::local(status::INVALID_ARG, String::new()));
            return Err(Error::local(
                c.status,
                format!(
                    "gradsync::ShardedParameter::step: gradient has {} floats, weights {} ({})",
                    gradient.len(),
                    weights.len(),
                    c.message
                ),
            ));
        }
        check(unsafe {
            sys::gradsync_shard_step(self.raw.as_ptr(), gradient.as_ptr(), weights.as_mut_ptr(), weights.len(), samples)
        })
    }

    /// [`step`](Self::step) with the gradient in `buf`, replaced by the new weights.
    pub fn step_in_place(&mut self, buf: &mut [f32], samples: u64) -> Result<()> {
        let p = buf.as_mut_ptr();
        check(unsafe { sys::gradsync_shard_step(self.raw.as_ptr(), p, p, buf.len(), samples) })
    }

    /// Local: stages this rank's gradient and sample count (`gradsync_shard_put`).
    pub fn put(&mut self, gradient: &[f32], samples: u64) -> Result<()> {
        check(unsafe { sys::gradsync_shard_put(self.raw.as_ptr(), gradient.as_ptr(), gradient.len(), samples) })
    }

    /// Collective: this rank's part of the weighted mean of the put gradients
    /// (`gradsync_shard_aggregate`).
    pub fn aggregate(&mut self) -> Result<()> {
        check(unsafe { sys::gradsync_shard_aggregate(self.raw.as_ptr()) })
    }

    /// Local: runs the optimizer on this rank's slice (`gradsync_shard_update`).
    pub fn update(&mut self) -> Result<()> {
        check(unsafe { sys::gradsync_shard_update(self.raw.as_ptr()) })
    }

    /// Local: copies this rank's weight or gradient slice into `out` (its part length;
    /// `gradsync_shard_read_slice`).
    pub fn read_slice(&self, which: Slice, out: &mut [f32]) -> Result<()> {
        check(unsafe { sys::gradsync_shard_read_slice(self.raw.as_ptr(), which as i32, out.as_mut_ptr(), out.len()) })
    }

    /// Local: sets this rank's weight slice (`gradsync_shard_write_weights`).
    pub fn write_weights(&mut self, slice: &[f32]) -> Result<()> {
        check(unsafe { sys::gradsync_shard_write_weights(self.raw.as_ptr(), slice.as_ptr(), slice.len()) })
    }

    /// Collective: gathers every rank's weight slice into `weights` (`total` floats;
    /// `gradsync_shard_gather`).
    pub fn gather(&mut self, weights: &mut [f32]) -> Result<()> {
        check(unsafe { sys::gradsync_shard_gather(self.raw.as_ptr(), weights.as_mut_ptr(), weights.len()) })
    }
}

impl Drop for ShardedParameter {
    fn drop(&mut self) {
        // SAFETY: owned handle, freed once.
        unsafe { sys::gradsync_shard_free(self.raw.as_ptr()) }
    }
}

impl std::fmt::Debug for ShardedParameter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedParameter").field("total", &self.total).finish()
    }
}
