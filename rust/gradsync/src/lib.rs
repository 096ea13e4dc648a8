// SPDX-License-Identifier: Apache-2.0
//! Safe Rust bindings of **libgradsync**: deterministic collectives among threads, processes or
//! MPI ranks ([`Communicator`]), memory-mapped tables ([`Table`]) and the sparse gradient
//! accumulator ([`Accumulator`]), sharded parameters ([`ShardedParameter`]), atomics
//! ([`Counter`], [`Flag`], [`Mutex`]), codecs and data-parallel helpers. The raw C API is
//! [`gradsync_sys`] (re-exported as [`sys`]).
//!
//! ```
//! use gradsync::{Communicator, ReduceOp};
//!
//! // Two threads of this process form the group "train"; each gets the mean of both gradients.
//! let means = std::thread::scope(|s| {
//!     let ranks: Vec<_> = (0..2)
//!         .map(|rank| {
//!             s.spawn(move || -> gradsync::Result<[f32; 2]> {
//!                 let comm = Communicator::threads("train", rank, 2)?;
//!                 let k = (rank + 1) as f32;
//!                 let mut grad = [2.0 * k, 4.0 * k];
//!                 comm.allreduce_in_place(&mut grad, ReduceOp::Mean)?;
//!                 Ok(grad)
//!             })
//!         })
//!         .collect();
//!     ranks.into_iter().map(|h| h.join().unwrap()).collect::<gradsync::Result<Vec<_>>>()
//! })?;
//! assert_eq!(means, [[3.0, 6.0], [3.0, 6.0]]);
//! # Ok::<(), gradsync::Error>(())
//! ```
//!
//! # Errors
//!
//! Every fallible call returns [`Result<T>`](Result), whose [`Error`] holds the C status (see
//! [`status`]) and the library's message, e.g. `gradsync_partition: part 5 out of range [0, 3)`.
//!
//! The C library keeps that message **per OS thread**, valid only until the next gradsync call on
//! the same thread. Each method of this crate therefore reads and copies it **inside the same
//! method, on the same thread, immediately after the failing C call** and before any other gradsync
//! call; an `Error` is plain owned data afterwards, free to cross threads and `.await`s. Code that
//! calls [`sys`] directly must do the same (never read `gradsync_last_error_message` later, from
//! another thread, or after an `.await` that may resume elsewhere).
//!
//! # Threads: `Send` and `Sync`
//!
//! They follow each header's `@threadsafety` notes:
//!
//! | type | Send | Sync | why |
//! |---|---|---|---|
//! | [`Communicator`] | yes | no | "one thread at a time per handle" |
//! | [`AbortHandle`] | yes | yes | `gradsync_comm_abort` is "any thread, any time" |
//! | [`Table`] | yes | yes | reads `any`; writes of one row unsynchronised, so writes take `&mut self` |
//! | [`Accumulator`] | yes | yes | add, add_batch, get, zero, apply, touched are `any` |
//! | [`ShardedParameter`] | yes | no | every call is `handle` |
//! | [`Counter`], [`Counter32`], [`Flag`], [`Mutex`] | yes | yes | internally synchronised (`any`) |
//! | [`MutexGuard`] | no | no | the thread that locked must unlock |
//!
//! `Drop` frees every handle. Handles must not cross `fork()`.
//!
//! # Linking
//!
//! `gradsync-sys` links `libgradsync.so` from `GRADSYNC_LIB_DIR` (default: the checkout's
//! `build/`), and this crate's tests find it through an rpath. A program of yours finds it the
//! usual way at run time: installed (`cmake --install`), `LD_LIBRARY_PATH`, or an rpath.

pub use gradsync_sys as sys;

// The options a table and an accumulator share, over the C struct `$raw` in field `raw`.
macro_rules! file_options {
    ($ty:ident, $raw:ty, $init:path) => {
        impl Default for $ty {
            fn default() -> Self {
                $ty { raw: $init }
            }
        }

        impl $ty {
            /// The shape to create (or to expect from an existing file): `rows x dim`, both >= 1.
            #[must_use]
            pub fn shape(mut self, rows: i64, dim: i64) -> Self {
                self.raw.rows = rows;
                self.raw.dim = dim;
                self
            }
            /// How to open the file (default [`TableMode::CreateOrOpen`](crate::TableMode::CreateOrOpen)).
            #[must_use]
            pub fn mode(mut self, mode: crate::TableMode) -> Self {
                self.raw.mode = mode as i32;
                self
            }
            /// Permission bits of a created file, exactly (umask ignored); default 0600.
            #[must_use]
            pub fn file_mode(mut self, mode: u32) -> Self {
                self.raw.file_mode = mode as i32;
                self
            }
            /// Open a file owned by another user (default: `PERMISSION` error).
            #[must_use]
            pub fn allow_other_owner(mut self, on: bool) -> Self {
                self.raw.allow_other_owner = on as i32;
                self
            }
            /// The C struct, for [`gradsync_sys`].
            pub fn as_raw(&self) -> &$raw {
                &self.raw
            }
        }
    };
}

// The opening of a handle of `rows x dim` rows (a table, an accumulator): from a file, or in
// memory only, then its shape read once. `$ty` has fields `raw`, `rows` and `dim`; its options
// type `$opts` holds the C options in `raw`.
macro_rules! shaped_handle_open {
    ($ty:ident, $opts:ty, $raw_opts:ty, $open:path, $shape:path,
     open: $open_doc:literal, anonymous_with: $anon_with_doc:literal, anonymous: $anon_doc:literal) => {
        impl $ty {
            #[doc = $open_doc]
            pub fn open<P: AsRef<Path>>(path: P, options: &$opts) -> Result<$ty> {
                let c_path = path_to_cstring(concat!(stringify!($ty), "::open"), path.as_ref())?;
                $ty::open_raw(c_path.as_ptr(), &options.raw)
            }

            #[doc = $anon_with_doc]
            pub fn anonymous_with(rows: i64, dim: i64, options: &$opts) -> Result<$ty> {
                let mut raw = options.raw;
                raw.mode = sys::GRADSYNC_TABLE_ANONYMOUS;
                raw.rows = rows;
                raw.dim = dim;
                $ty::open_raw(ptr::null(), &raw)
            }

            #[doc = $anon_doc]
            pub fn anonymous(rows: i64, dim: i64) -> Result<$ty> {
                $ty::anonymous_with(rows, dim, &<$opts>::default())
            }

            fn open_raw(path: *const sys::c_char, opts: &$raw_opts) -> Result<$ty> {
                let mut out = ptr::null_mut();
                check(unsafe { $open(&mut out, path, opts) })?;
                let raw = NonNull::new(out)
                    .expect(concat!(stringify!($open), " returned OK and a NULL handle"));
                let mut handle = $ty { raw, rows: 0, dim: 0 };
                let (mut rows, mut dim) = (0i64, 0i64);
                check(unsafe { $shape(handle.raw.as_ptr(), &mut rows, &mut dim) })?;
                handle.rows = rows;
                handle.dim = dim;
                Ok(handle)
            }

            /// `(rows, dim)`.
            pub fn shape(&self) -> (i64, i64) {
                (self.rows, self.dim)
            }
        }
    };
}

mod accumulator;
mod atomics;
pub mod codec;
mod comm;
mod embedding;
pub mod dataparallel;
mod error;
mod shard;
mod table;
mod types;

pub use accumulator::{AccumOptions, Accumulator, Concurrency, Optimizer};
pub use atomics::{Counter, Counter32, Flag, Mutex, MutexGuard};
pub use codec::Codec;
pub use comm::{AbortHandle, CommBuffer, CommOptions, Communicator, GrowInfo, Topology, Transport};
pub use embedding::{EmbeddingOptions, RowOptimizer, ShardedEmbedding, Sharding};
pub use dataparallel::{partition, split_round_robin, weighted_merge, weighted_merge_f64, Merged};
pub use error::{status, status_string, Error, Result};
pub use shard::{ShardOptimizer, ShardOptions, ShardedParameter, Slice};
pub use table::{Table, TableInit, TableMode, TableOptions};
pub use types::{DType, Element, ReduceOp};

use std::ffi::CStr;

/// Release version of the loaded library, e.g. `"0.1.0"` (`gradsync_version_string`).
pub fn version() -> String {
    unsafe { CStr::from_ptr(sys::gradsync_version_string()) }.to_string_lossy().into_owned()
}

/// ABI version (SOVERSION) of the loaded library; these bindings are for [`sys::GRADSYNC_ABI_VERSION`].
pub fn abi_version() -> i32 {
    unsafe { sys::gradsync_abi_version() }
}

/// Features that a build may or may not have (`gradsync_feature`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Feature {
    ThreadTransport = sys::GRADSYNC_FEATURE_THREAD_TRANSPORT,
    ShmTransport = sys::GRADSYNC_FEATURE_SHM_TRANSPORT,
    MpiTransport = sys::GRADSYNC_FEATURE_MPI_TRANSPORT,
    /// The CPU converts half floats in hardware.
    F16c = sys::GRADSYNC_FEATURE_F16C,
}

/// Whether this build, here (the MPI plugin and runtime load; for CPU features, this machine), has `feature`.
pub fn has_feature(feature: Feature) -> bool {
    unsafe { sys::gradsync_has_feature(feature as i32) != 0 }
}

/// Sets the library's log level, 0 (trace) to 6 (off) (`gradsync_set_log_level`).
pub fn set_log_level(level: i32) -> Result<()> {
    error::check(unsafe { sys::gradsync_set_log_level(level) })
}
