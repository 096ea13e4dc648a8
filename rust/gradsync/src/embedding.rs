// SPDX-License-Identifier: Apache-2.0
//! [`ShardedEmbedding`]: an embedding table sharded row-wise over a communicator's ranks
//! (embedding.h): exact, deterministic pushes and checkpoints that load into any world size.

use crate::comm::Communicator;
use crate::error::{check, Result};
use crate::table::{path_to_cstring, TableInit};
use gradsync_sys as sys;
use std::path::Path;
use std::ptr::{self, NonNull};

/// Which rank owns a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Sharding {
    /// Rank r owns the r-th range of the library's partition rule.
    Contiguous = sys::GRADSYNC_EMBEDDING_CONTIGUOUS,
    /// Rank r owns the rows g with `splitmix64(g) % size == r`.
    Hash = sys::GRADSYNC_EMBEDDING_HASH,
}

/// The row optimizer the owners apply at each push.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum RowOptimizer {
    /// `w -= lr·g`
    Sgd = sys::GRADSYNC_OPTIM_SGD,
    /// PyTorch-BigGraph's row-wise Adagrad: `s += mean(g²); w -= lr·g / (sqrt(s) + eps)`.
    RowAdagrad = sys::GRADSYNC_OPTIM_ROW_ADAGRAD,
    /// Sparse Adam as torch.optim.SparseAdam on the touched rows, each row with its own update
    /// count for the bias correction (embedding.h).
    Adam = sys::GRADSYNC_OPTIM_ADAM,
}

impl RowOptimizer {
    /// Floats of state per row that [`ShardedEmbedding::local_state`] returns: 1 for SGD (zeros)
    /// and row-wise Adagrad, `2·dim + 1` for Adam (m, v, the row's update count).
    pub fn state_width(self, dim: usize) -> usize {
        match self {
            RowOptimizer::Adam => 2 * dim + 1,
            _ => 1,
        }
    }
}

/// Options of [`ShardedEmbedding::new`] (`gradsync_embedding_options`); [`Default`] is
/// `GRADSYNC_EMBEDDING_OPTIONS_INIT` with the shape still to set.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EmbeddingOptions {
    pub rows: i64,
    pub dim: i64,
    pub sharding: Sharding,
    pub optimizer: RowOptimizer,
    pub lr: f64,
    /// 0 (the default): the optimizer's own, 1e-10 row-wise Adagrad, 1e-8 Adam.
    pub eps: f64,
    /// Adam's `(beta1, beta2)`; default torch's `(0.9, 0.999)`.
    pub betas: (f64, f64),
    /// How rows are first filled (the same values whatever the sharding).
    pub init: TableInit,
    /// Owner threads adding a rank's received gradients; `None`: 1. The result does not depend on it.
    pub threads: Option<i32>,
    /// Each rank's rows and optimizer state also live on the next `replicas` ranks of the group's
    /// replica ring (local rank, then host: on other hosts where it can), so that
    /// [`reshard`](ShardedEmbedding::reshard) after losing up to that many neighbours needs no
    /// checkpoint; default 0.
    pub replicas: i32,
}

impl Default for EmbeddingOptions {
    fn default() -> Self {
        let d = sys::GRADSYNC_EMBEDDING_OPTIONS_INIT;
        EmbeddingOptions {
            rows: 0,
            dim: 0,
            sharding: Sharding::Contiguous,
            optimizer: RowOptimizer::Sgd,
            lr: d.lr,
            eps: d.eps,
            betas: (d.beta1, d.beta2),
            init: TableInit::Zeros,
            threads: None,
            replicas: d.replicas,
        }
    }
}

impl EmbeddingOptions {
    fn to_raw(&self) -> sys::gradsync_embedding_options {
        let mut raw = sys::GRADSYNC_EMBEDDING_OPTIONS_INIT;
        raw.rows = self.rows;
        raw.dim = self.dim;
        raw.sharding = self.sharding as i32;
        raw.optimizer = self.optimizer as i32;
        raw.lr = self.lr;
        raw.eps = self.eps;
        (raw.beta1, raw.beta2) = self.betas;
        if let TableInit::Uniform { seed, lo, hi } = self.init {
            raw.init = sys::GRADSYNC_TABLE_INIT_UNIFORM;
            raw.seed = seed;
            raw.lo = lo;
            raw.hi = hi;
        }
        raw.threads = self.threads.unwrap_or(sys::GRADSYNC_UNSET_I32);
        raw.replicas = self.replicas;
        raw
    }
}

/// This rank's part of a `rows x dim` f32 table sharded over a communicator (`gradsync_embedding`).
/// [`lookup`](Self::lookup), [`push`](Self::push), [`save`](Self::save) and [`load`](Self::load)
/// are collective: every rank calls them in the same order, each with its own ids (possibly none).
///
/// **Thread safety**: `Send`, not `Sync` (its calls are `@threadsafety handle`). Like
/// [`ShardedParameter`](crate::ShardedParameter) it stays valid if the [`Communicator`] is
/// dropped first (its collective calls then fail with `MISUSE`).
///
/// ```compile_fail
/// fn shared<T: Sync>() {}
/// shared::<gradsync::ShardedEmbedding>(); // not Sync: every call is per handle
/// ```
pub struct ShardedEmbedding {
    raw: NonNull<sys::gradsync_embedding>,
    dim: usize,
    optimizer: RowOptimizer,
}

// SAFETY: a handle used by one thread at a time (not Sync); the library reference-counts the
// communicator it was made on.
unsafe impl Send for ShardedEmbedding {}

impl ShardedEmbedding {
    /// Creates this rank's part in anonymous memory, or as table files under `dir`
    /// (`gradsync_embedding_create`). Local: every rank passes the same shape and rules.
    pub fn new(comm: &Communicator, options: &EmbeddingOptions, dir: Option<&Path>) -> Result<ShardedEmbedding> {
        let opts = options.to_raw();
        let dir = dir.map(|d| path_to_cstring("gradsync::ShardedEmbedding::new", d)).transpose()?;
        let mut out = ptr::null_mut();
        check(unsafe {
            sys::gradsync_embedding_create(&mut out, comm.as_raw(), dir.as_ref().map_or(ptr::null(), |d| d.as_ptr()), &opts)
        })?;
        let raw = NonNull::new(out).expect("gradsync_embedding_create returned OK and a NULL handle");
        Ok(ShardedEmbedding { raw, dim: options.dim.max(0) as usize, optimizer: options.optimizer })
    }

    /// Floats per row.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The rows this rank owns (`gradsync_embedding_shape`).
    pub fn local_rows(&self) -> Result<usize> {
        let mut n = 0i64;
        check(unsafe { sys::gradsync_embedding_shape(self.raw.as_ptr(), ptr::null_mut(), ptr::null_mut(), &mut n) })?;
        Ok(n as usize)
    }

    /// Pushes applied so far, or as loaded (`gradsync_embedding_steps`).
    pub fn steps(&self) -> Result<i64> {
        let mut n = 0i64;
        check(unsafe { sys::gradsync_embedding_steps(self.raw.as_ptr(), &mut n) })?;
        Ok(n)
    }

    /// The rank owning each id (`gradsync_embedding_owner`).
    pub fn owners(&self, ids: &[i64]) -> Result<Vec<i32>> {
        let mut out = vec![0i32; ids.len()];
        check(unsafe { sys::gradsync_embedding_owner(self.raw.as_ptr(), ids.as_ptr(), ids.len(), out.as_mut_ptr()) })?;
        Ok(out)
    }

    /// Changes the learning rate of later pushes; set the same on every rank.
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        check(unsafe { sys::gradsync_embedding_set_lr(self.raw.as_ptr(), lr) })
    }

    /// Collective: the rows of `ids` (any order, repeats allowed) into `out` (`ids.len() * dim`
    /// floats), in the caller's order (`gradsync_embedding_lookup`).
    pub fn lookup(&mut self, ids: &[i64], out: &mut [f32]) -> Result<()> {
        check(unsafe {
            sys::gradsync_embedding_lookup(self.raw.as_ptr(), ids.as_ptr(), ids.len(), out.as_mut_ptr(), out.len())
        })
    }

    /// Collective: one optimizer step with `grads[i*dim..]` the gradient of row `ids[i]`
    /// (`gradsync_embedding_push`).
    pub fn push(&mut self, ids: &[i64], grads: &[f32]) -> Result<()> {
        check(unsafe {
            sys::gradsync_embedding_push(self.raw.as_ptr(), ids.as_ptr(), ids.len(), grads.as_ptr(), grads.len())
        })
    }

    /// Collective: a checkpoint of every row and its optimizer state in `dir`.
    pub fn save(&mut self, dir: &Path) -> Result<()> {
        let d = path_to_cstring("gradsync::ShardedEmbedding::save", dir)?;
        check(unsafe { sys::gradsync_embedding_save(self.raw.as_ptr(), d.as_ptr()) })
    }

    /// Collective: only the rows pushed since the checkpoint in `dir`, as a layer on it: the
    /// table's last save or load, or its save before that into another directory
    /// (`gradsync_embedding_save_incremental`).
    pub fn save_incremental(&mut self, dir: &Path) -> Result<()> {
        let d = path_to_cstring("gradsync::ShardedEmbedding::save_incremental", dir)?;
        check(unsafe { sys::gradsync_embedding_save_incremental(self.raw.as_ptr(), d.as_ptr()) })
    }

    /// Collective: loads a checkpoint written by any world size and sharding rule.
    pub fn load(&mut self, dir: &Path) -> Result<()> {
        let d = path_to_cstring("gradsync::ShardedEmbedding::load", dir)?;
        check(unsafe { sys::gradsync_embedding_load(self.raw.as_ptr(), d.as_ptr()) })
    }

    /// Collective over `comm` (`gradsync_embedding_reshard`): moves the table onto a group grown
    /// from its own (every joiner taking part with a table it made on `comm` with the members'
    /// options), the survivors of a loss, or its own communicator under another `sharding`
    /// (`None` keeps the rule). Rows that live on a member move in memory with their optimizer
    /// state, bit for bit. Rows that lived only on a lost rank are gone: without `checkpoint` this
    /// fails with `LOST` naming them, and nothing changes; with the last checkpoint's directory
    /// every row and the step count come from it (the caller replays its pushes since).
    /// Returns `(rows received from others, whether the rows came from the checkpoint)`.
    pub fn reshard(
        &mut self,
        comm: &Communicator,
        sharding: Option<Sharding>,
        checkpoint: Option<&Path>,
    ) -> Result<(u64, bool)> {
        let dir = checkpoint.map(|d| path_to_cstring("gradsync::ShardedEmbedding::reshard", d)).transpose()?;
        let (mut moved, mut restored) = (0u64, 0i32);
        check(unsafe {
            sys::gradsync_embedding_reshard(
                self.raw.as_ptr(),
                comm.as_raw(),
                sharding.map_or(sys::GRADSYNC_EMBEDDING_KEEP_SHARDING, |s| s as i32),
                dir.as_ref().map_or(ptr::null(), |d| d.as_ptr()),
                &mut moved,
                &mut restored,
            )
        })?;
        Ok((moved, restored != 0))
    }

    /// This rank's rows: `(ids ascending, values, state)`, `state` holding
    /// [`RowOptimizer::state_width`] floats per row.
    pub fn local_state(&self) -> Result<(Vec<i64>, Vec<f32>, Vec<f32>)> {
        let n = self.local_rows()?;
        let w = self.optimizer.state_width(self.dim);
        let (mut ids, mut values, mut state) = (vec![0i64; n], vec![0f32; n * self.dim], vec![0f32; n * w]);
        check(unsafe {
            sys::gradsync_embedding_local_rows(
                self.raw.as_ptr(),
                ids.as_mut_ptr(),
                values.as_mut_ptr(),
                state.as_mut_ptr(),
                n,
            )
        })?;
        Ok((ids, values, state))
    }
}

impl Drop for ShardedEmbedding {
    fn drop(&mut self) {
        // SAFETY: owned handle, freed once.
        unsafe { sys::gradsync_embedding_free(self.raw.as_ptr()) }
    }
}

impl std::fmt::Debug for ShardedEmbedding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedEmbedding").field("dim", &self.dim).finish()
    }
}
