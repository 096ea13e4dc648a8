// SPDX-License-Identifier: Apache-2.0
//! [`Accumulator`]: the sparse gradient accumulator (accumulator.h).

use crate::error::{check, Error, Result};
use crate::status;
use crate::table::{path_to_cstring, Table};
use gradsync_sys as sys;
use std::ffi::c_void;
use std::path::Path;
use std::ptr::{self, NonNull};

/// `gradsync_accum_concurrency`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Concurrency {
    /// Striped process-shared locks (default); exact.
    Striped = sys::GRADSYNC_ACCUM_STRIPED,
    /// An atomic compare-and-swap per float; exact.
    LockFree = sys::GRADSYNC_ACCUM_LOCK_FREE,
    /// No synchronisation (Hogwild): concurrent adds to one row may lose updates.
    None = sys::GRADSYNC_ACCUM_NONE,
    /// Rows partitioned over owner threads; exact and deterministic.
    Owner = sys::GRADSYNC_ACCUM_OWNER,
}

/// Options of [`Accumulator::open`] (`gradsync_accum_options`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AccumOptions {
    raw: sys::gradsync_accum_options,
}

file_options!(AccumOptions, sys::gradsync_accum_options, sys::GRADSYNC_ACCUM_OPTIONS_INIT);

impl AccumOptions {
    /// The defaults: create or open, shape from an existing file, striped locks.
    pub fn new() -> Self {
        Self::default()
    }
    /// The concurrency mode (default: what other processes on the file use, else striped).
    #[must_use]
    pub fn concurrency(mut self, concurrency: Concurrency) -> Self {
        self.raw.concurrency = concurrency as i32;
        self
    }
    /// Striped mode: rows per lock, >= 1 (default: what other processes use, else 16).
    #[must_use]
    pub fn rows_per_lock(mut self, rows: i64) -> Self {
        self.raw.rows_per_lock = rows;
        self
    }
    /// Owner mode: owner threads, 1..64 (default: the CPUs this process may run on).
    #[must_use]
    pub fn threads(mut self, threads: i64) -> Self {
        self.raw.threads = threads;
        self
    }
}

/// An optimizer step for [`Accumulator::apply`] (`gradsync_optimizer`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Optimizer {
    /// `w -= lr·g`
    Sgd { lr: f64 },
    /// PyTorch-BigGraph's row-wise Adagrad: `s[r] += mean(g²); w -= lr·g / (sqrt(s[r]) + eps)`;
    /// needs a `rows x 1` state table.
    RowAdagrad { lr: f64, eps: f64 },
    /// Sparse Adam as torch.optim.SparseAdam on the touched rows, each row with its own update
    /// count for the bias correction (accumulator.h); needs a `rows x (2·dim + 1)` state table of
    /// zeros at first. `eps` 0 is torch's 1e-8; torch's betas are (0.9, 0.999).
    Adam { lr: f64, eps: f64, beta1: f64, beta2: f64 },
}

impl Optimizer {
    fn to_raw(self) -> sys::gradsync_optimizer {
        let mut raw = sys::GRADSYNC_OPTIMIZER_INIT;
        match self {
            Optimizer::Sgd { lr } => {
                raw.kind = sys::GRADSYNC_OPTIM_SGD;
                raw.lr = lr;
            }
            Optimizer::RowAdagrad { lr, eps } => {
                raw.kind = sys::GRADSYNC_OPTIM_ROW_ADAGRAD;
                raw.lr = lr;
                raw.eps = eps;
            }
            Optimizer::Adam { lr, eps, beta1, beta2 } => {
                raw.kind = sys::GRADSYNC_OPTIM_ADAM;
                raw.lr = lr;
                raw.eps = eps;
                raw.beta1 = beta1;
                raw.beta2 = beta2;
            }
        }
        raw
    }
}

/// A gradient table plus the set of rows touched since the last apply (`gradsync_accum`).
///
/// **Thread safety**: `Send + Sync`. accumulator.h makes `add`, `add_batch` and `get` callable
/// from any thread at once, and `zero`, `apply`, `touched` exclude this process's adds while they
/// run (all `@threadsafety any`), so they all take `&self`: share it with `Arc` or scoped threads.
/// Only `gradsync_accum_free` is per handle (it runs in `Drop`). [`view`](Self::view) borrows the
/// raw gradients and therefore takes `&mut self`, so no add of this process races it.
pub struct Accumulator {
    raw: NonNull<sys::gradsync_accum>,
    rows: i64,
    dim: i64,
}

// SAFETY: see the type's documentation (internally synchronised, `@threadsafety any`).
unsafe impl Send for Accumulator {}
unsafe impl Sync for Accumulator {}

shaped_handle_open!(
    Accumulator,
    AccumOptions,
    sys::gradsync_accum_options,
    sys::gradsync_accum_open,
    sys::gradsync_accum_shape,
    open: "Opens or creates the gradient file at `path` (`gradsync_accum_open`).",
    anonymous_with: "An accumulator in memory only, `rows x dim`, other options from `options`.",
    anonymous: "An accumulator in memory only, `rows x dim`, striped locks."
);

impl Accumulator {
    /// The concurrency mode and rows per lock in use (`gradsync_accum_get_concurrency`).
    pub fn concurrency(&self) -> Result<(Concurrency, i64)> {
        let (mut mode, mut per_lock) = (0i32, 0i64);
        check(unsafe { sys::gradsync_accum_get_concurrency(self.raw.as_ptr(), &mut mode, &mut per_lock) })?;
        let mode = match mode {
            sys::GRADSYNC_ACCUM_STRIPED => Concurrency::Striped,
            sys::GRADSYNC_ACCUM_LOCK_FREE => Concurrency::LockFree,
            sys::GRADSYNC_ACCUM_NONE => Concurrency::None,
            sys::GRADSYNC_ACCUM_OWNER => Concurrency::Owner,
            other => {
                return Err(Error::local(
                    status::INTERNAL,
                    format!("gradsync_accum_get_concurrency: unknown mode {}", other),
                ))
            }
        };
        Ok((mode, per_lock))
    }

    /// The raw handle, for calls into [`gradsync_sys`]; it stays owned by `self`.
    pub fn as_raw(&self) -> *mut sys::gradsync_accum {
        self.raw.as_ptr()
    }

    /// `grad[row] += grad` (`dim` floats) and marks the row touched (`gradsync_accum_add`).
    pub fn add(&self, row: i64, grad: &[f32]) -> Result<()> {
        check(unsafe { sys::gradsync_accum_add(self.raw.as_ptr(), row, grad.as_ptr(), grad.len()) })
    }

    /// For each i: `grad[rows[i]] += grads[i*dim .. (i+1)*dim]`; repeated ids are summed; every id
    /// and the length are checked before anything is written (`gradsync_accum_add_batch`).
    pub fn add_batch(&self, rows: &[i64], grads: &[f32]) -> Result<()> {
        check(unsafe {
            sys::gradsync_accum_add_batch(self.raw.as_ptr(), rows.as_ptr(), rows.len(), grads.as_ptr(), grads.len())
        })
    }

    /// Copies the gradient of one row into `out` (`dim` floats; `gradsync_accum_get`).
    pub fn get(&self, row: i64, out: &mut [f32]) -> Result<()> {
        check(unsafe { sys::gradsync_accum_get(self.raw.as_ptr(), row, out.as_mut_ptr(), out.len()) })
    }

    /// The gradient of one row as a new vector.
    pub fn row(&self, row: i64) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.dim.max(0) as usize];
        self.get(row, &mut out)?;
        Ok(out)
    }

    /// Zeroes the touched rows and empties the touched set (`gradsync_accum_zero`).
    pub fn zero(&self) -> Result<()> {
        check(unsafe { sys::gradsync_accum_zero(self.raw.as_ptr()) })
    }

    /// The number of touched rows (`gradsync_accum_touched_count`).
    pub fn touched_count(&self) -> Result<i64> {
        let mut n = 0i64;
        check(unsafe { sys::gradsync_accum_touched_count(self.raw.as_ptr(), &mut n) })?;
        Ok(n)
    }

    /// The touched rows, in the order they were first touched (`gradsync_accum_touched`).
    pub fn touched(&self) -> Result<Vec<i64>> {
        let mut ids: Vec<i64> = Vec::new();
        loop {
            let mut needed = 0usize;
            let rc = unsafe {
                sys::gradsync_accum_touched(self.raw.as_ptr(), ids.as_mut_ptr(), ids.capacity(), &mut needed)
            };
            if rc == sys::GRADSYNC_E_BUFS {
                // Other threads may keep adding: ask again with the size reported, plus room.
                ids.reserve(needed + needed / 8 + 16);
                continue;
            }
            check(rc)?;
            // SAFETY: the library wrote `needed` ids, and needed <= capacity on success.
            unsafe { ids.set_len(needed) };
            return Ok(ids);
        }
    }

    /// Updates `params` (and `state` for row-wise Adagrad, a `rows x 1` table) from the touched
    /// rows' gradients, then zeroes exactly those rows and empties the touched set
    /// (`gradsync_accum_apply`). O(touched x dim); nothing is written on error.
    pub fn apply(&self, params: &mut Table, optimizer: Optimizer, state: Option<&mut Table>) -> Result<()> {
        let opt = optimizer.to_raw();
        let state = state.map_or(ptr::null_mut(), |t| t.as_raw());
        check(unsafe { sys::gradsync_accum_apply(self.raw.as_ptr(), params.as_raw(), &opt, state) })
    }

    /// Makes the gradients and the touched set durable (`gradsync_accum_flush`).
    pub fn flush(&self) -> Result<()> {
        check(unsafe { sys::gradsync_accum_flush(self.raw.as_ptr()) })
    }

    /// All gradients, `rows * dim` floats row-major, borrowed from the mapping
    /// (`gradsync_accum_view`). `&mut self` keeps this process's adds out while it is borrowed;
    /// other processes on the same file must be kept out by the caller.
    pub fn view(&mut self) -> Result<&[f32]> {
        let mut data: *const c_void = ptr::null();
        let mut bytes = 0usize;
        check(unsafe { sys::gradsync_accum_view(self.raw.as_ptr(), &mut data, &mut bytes) })?;
        if bytes == 0 {
            return Ok(&[]);
        }
        if data.is_null() || (data as usize) % std::mem::align_of::<f32>() != 0 {
            return Err(Error::local(status::INTERNAL, "gradsync_accum_view: NULL or misaligned data".into()));
        }
        // SAFETY: `bytes` bytes of floats, valid until gradsync_accum_free.
        Ok(unsafe { std::slice::from_raw_parts(data as *const f32, bytes / 4) })
    }
}

impl Drop for Accumulator {
    fn drop(&mut self) {
        // SAFETY: owned handle, freed once, no borrow left.
        unsafe { sys::gradsync_accum_free(self.raw.as_ptr()) }
    }
}

impl std::fmt::Debug for Accumulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accumulator").field("rows", &self.rows).field("dim", &self.dim).finish()
    }
}
