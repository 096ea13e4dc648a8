// SPDX-License-Identifier: Apache-2.0
//! Raw declarations of libgradsync's C API, written by hand from `include/gradsync/*.h` (ABI
//! version 0, symbol version `GRADSYNC_0.1`). Every item has the C name; see the headers for the
//! full contract of each function. The safe wrapper is the `gradsync` crate.
//!
//! # Linking
//!
//! `build.rs` links `libgradsync.so` from `GRADSYNC_LIB_DIR` (default: `../../build` from this
//! crate, the checkout's CMake build) and puts that directory into the rpath of this package's
//! tests. Direct dependents get the directory as `DEP_GRADSYNC_LIB_DIR`.
//!
//! # Errors: the message is per OS thread, read it at once
//!
//! Every fallible function returns an `int` status: [`GRADSYNC_OK`] (0) or a negative
//! `GRADSYNC_E_*` code. After a failure, [`gradsync_last_error_message`] says what was wrong —
//! **on the OS thread that made the failing call only**, and only **until the next gradsync call
//! on that thread** (the pointer is library-owned thread-local storage). So a binding must read
//! (and copy) the message on the same thread, right after the failing call, with no other gradsync
//! call in between: never later, never from another thread, and never after an `.await` that may
//! resume on another thread. This holds for every function below that returns a status. The
//! status itself is authoritative; the message is stale after a success.
//!
//! # Thread safety
//!
//! Unless a function's comment says `@threadsafety any`, a handle must not be used by two threads
//! at once; different handles may be used in parallel (see each header's notes). Handles are
//! opaque: only pointers to them exist on the Rust side.
//!
//! # Layout
//!
//! The option structs are `#[repr(C)]`, field for field as in the headers. This crate's tests
//! hold every constant, size, alignment and field offset here to what a C compiler makes of the
//! headers (tests/mirrors.rs), and the `*_INIT` defaults to what the library fills (tests/layout.rs).
#![allow(non_camel_case_types)]

use std::marker::{PhantomData, PhantomPinned};
use std::mem::size_of;
pub use std::os::raw::{c_char, c_int, c_void};

macro_rules! opaque {
    ($($(#[$doc:meta])* $name:ident;)*) => {$(
        $(#[$doc])*
        #[repr(C)]
        pub struct $name {
            _data: [u8; 0],
            _marker: PhantomData<(*mut u8, PhantomPinned)>,
        }
    )*};
}

opaque! {
    /// A communicator (comm.h).
    gradsync_comm;
    /// A memory-mapped table (table.h).
    gradsync_table;
    /// A sparse gradient accumulator (accumulator.h).
    gradsync_accum;
    /// A sharded parameter (shard.h).
    gradsync_shard;
    /// A sharded embedding table (embedding.h).
    gradsync_embedding;
    /// A 32-bit atomic counter (atomics.h).
    gradsync_counter32;
    /// A 64-bit atomic counter (atomics.h).
    gradsync_counter64;
    /// A sticky flag (atomics.h).
    gradsync_flag;
    /// A thread-owned mutex (atomics.h).
    gradsync_mutex;
}

// ------------------------------------------------------------------ errors.h

pub const GRADSYNC_OK: c_int = 0;
pub const GRADSYNC_E_INVALID_ARG: c_int = -1;
pub const GRADSYNC_E_MISUSE: c_int = -2;
pub const GRADSYNC_E_NOMEM: c_int = -3;
pub const GRADSYNC_E_IO: c_int = -4;
pub const GRADSYNC_E_CORRUPT: c_int = -5;
pub const GRADSYNC_E_VERSION_MISMATCH: c_int = -6;
pub const GRADSYNC_E_MISMATCH: c_int = -7;
pub const GRADSYNC_E_TIMEOUT: c_int = -8;
pub const GRADSYNC_E_REMOTE: c_int = -9;
pub const GRADSYNC_E_IN_PROGRESS: c_int = -10;
pub const GRADSYNC_E_ABORTED: c_int = -11;
pub const GRADSYNC_E_UNSUPPORTED: c_int = -12;
pub const GRADSYNC_E_BUFS: c_int = -13;
pub const GRADSYNC_E_OUT_OF_RANGE: c_int = -14;
pub const GRADSYNC_E_ZERO_WEIGHT: c_int = -15;
pub const GRADSYNC_E_NO_SPACE: c_int = -16;
pub const GRADSYNC_E_NOT_OWNER: c_int = -17;
pub const GRADSYNC_E_PERMISSION: c_int = -18;
pub const GRADSYNC_E_LOST: c_int = -19;
pub const GRADSYNC_E_INTERNAL: c_int = -100;

extern "C" {
    /// Static description of a status, starting with its name. Never NULL. `@threadsafety any`
    pub fn gradsync_status_string(status: c_int) -> *const c_char;
    /// The message of the last failed call **on this OS thread**; valid until the next gradsync
    /// call on this thread. Never NULL. `@threadsafety any`
    pub fn gradsync_last_error_message() -> *const c_char;
    /// The status of the last failed call on this OS thread. `@threadsafety any`
    pub fn gradsync_last_error_status() -> c_int;
    /// Forget this OS thread's last error. `@threadsafety any`
    pub fn gradsync_last_error_clear();
}

// ------------------------------------------------------------------ version.h

/// The ABI version (SOVERSION) these declarations were written for.
pub const GRADSYNC_ABI_VERSION: i32 = 0;

extern "C" {
    pub fn gradsync_version_number() -> u32;
    pub fn gradsync_version_string() -> *const c_char;
    pub fn gradsync_abi_version() -> i32;
}

// ------------------------------------------------------------------ common.h

pub const GRADSYNC_UNSET_I32: i32 = i32::MIN;
pub const GRADSYNC_UNSET_I64: i64 = i64::MIN;

pub const GRADSYNC_F32: i32 = 0;
pub const GRADSYNC_F64: i32 = 1;
pub const GRADSYNC_I32: i32 = 2;
pub const GRADSYNC_I64: i32 = 3;
pub const GRADSYNC_BF16: i32 = 4;
pub const GRADSYNC_F16: i32 = 5;

pub const GRADSYNC_SUM: i32 = 0;
pub const GRADSYNC_MEAN: i32 = 1;
pub const GRADSYNC_MIN: i32 = 2;
pub const GRADSYNC_MAX: i32 = 3;

pub const GRADSYNC_OPTIM_SGD: i32 = 0;
pub const GRADSYNC_OPTIM_ROW_ADAGRAD: i32 = 1;
pub const GRADSYNC_OPTIM_ADAM: i32 = 2;
pub const GRADSYNC_OPTIM_ADAMW: i32 = 3;
pub const GRADSYNC_OPTIM_MOMENTUM: i32 = 4;

pub const GRADSYNC_FEATURE_THREAD_TRANSPORT: i32 = 1;
pub const GRADSYNC_FEATURE_SHM_TRANSPORT: i32 = 2;
pub const GRADSYNC_FEATURE_MPI_TRANSPORT: i32 = 3;
pub const GRADSYNC_FEATURE_F16C: i32 = 4;

extern "C" {
    /// Size in bytes of one element of a dtype, 0 for an unknown one. `@threadsafety any`
    pub fn gradsync_dtype_size(dtype: i32) -> usize;
    /// 1 if this build (and CPU) has the feature, else 0. `@threadsafety any`
    pub fn gradsync_has_feature(feature: i32) -> i32;
}

// ------------------------------------------------------------------ log.h

pub const GRADSYNC_LOG_TRACE: i32 = 0;
pub const GRADSYNC_LOG_DEBUG: i32 = 1;
pub const GRADSYNC_LOG_INFO: i32 = 2;
pub const GRADSYNC_LOG_WARN: i32 = 3;
pub const GRADSYNC_LOG_ERROR: i32 = 4;
pub const GRADSYNC_LOG_CRITICAL: i32 = 5;
pub const GRADSYNC_LOG_OFF: i32 = 6;

/// A log hook: called from any thread (also the library's own), must not call back into gradsync.
pub type gradsync_log_fn = Option<unsafe extern "C" fn(user_data: *mut c_void, level: i32, message: *const c_char)>;

extern "C" {
    /// `@threadsafety init-only`. Status; message on this thread.
    pub fn gradsync_set_log_callback(f: gradsync_log_fn, user_data: *mut c_void, min_level: i32) -> c_int;
    /// `@threadsafety any`. Status; message on this thread.
    pub fn gradsync_set_log_level(level: i32) -> c_int;
    /// `@threadsafety any`
    pub fn gradsync_get_log_level() -> i32;
}

// ------------------------------------------------------------------ atomics.h
// Counter, flag and mutex handles are internally synchronised (`@threadsafety any`); only *_free
// must not race with other calls on the same handle. Every status-returning function leaves its
// message on the calling OS thread.

extern "C" {
    pub fn gradsync_counter32_create(out: *mut *mut gradsync_counter32, initial: i32) -> c_int;
    pub fn gradsync_counter32_free(counter: *mut gradsync_counter32);
    pub fn gradsync_counter32_fetch_add(
        counter: *mut gradsync_counter32,
        delta: i32,
        old_value: *mut i32,
        new_value: *mut i32,
    ) -> c_int;
    pub fn gradsync_counter32_load(counter: *const gradsync_counter32, value: *mut i32) -> c_int;
    pub fn gradsync_counter32_store(counter: *mut gradsync_counter32, value: i32) -> c_int;

    pub fn gradsync_counter64_create(out: *mut *mut gradsync_counter64, initial: i64) -> c_int;
    pub fn gradsync_counter64_free(counter: *mut gradsync_counter64);
    pub fn gradsync_counter64_fetch_add(
        counter: *mut gradsync_counter64,
        delta: i64,
        old_value: *mut i64,
        new_value: *mut i64,
    ) -> c_int;
    pub fn gradsync_counter64_load(counter: *const gradsync_counter64, value: *mut i64) -> c_int;
    pub fn gradsync_counter64_store(counter: *mut gradsync_counter64, value: i64) -> c_int;

    pub fn gradsync_flag_create(out: *mut *mut gradsync_flag) -> c_int;
    pub fn gradsync_flag_free(flag: *mut gradsync_flag);
    pub fn gradsync_flag_conditional_set(flag: *mut gradsync_flag, condition: i32, is_set: *mut i32) -> c_int;
    pub fn gradsync_flag_check(flag: *const gradsync_flag, is_set: *mut i32) -> c_int;
    pub fn gradsync_flag_reset(flag: *mut gradsync_flag) -> c_int;

    pub fn gradsync_mutex_create(out: *mut *mut gradsync_mutex) -> c_int;
    pub fn gradsync_mutex_free(mutex: *mut gradsync_mutex);
    pub fn gradsync_mutex_lock(mutex: *mut gradsync_mutex) -> c_int;
    pub fn gradsync_mutex_try_lock(mutex: *mut gradsync_mutex, acquired: *mut i32) -> c_int;
    pub fn gradsync_mutex_lock_timeout(mutex: *mut gradsync_mutex, timeout_ms: i64) -> c_int;
    pub fn gradsync_mutex_unlock(mutex: *mut gradsync_mutex) -> c_int;

    /// `dst[i] += src[i]`, each element atomically with respect to other gradsync_atomic_add_* calls.
    pub fn gradsync_atomic_add_f32(dst: *mut f32, src: *const f32, n: usize) -> c_int;
    pub fn gradsync_atomic_add_f64(dst: *mut f64, src: *const f64, n: usize) -> c_int;
}

// ------------------------------------------------------------------ dataparallel.h (pure, any thread)

extern "C" {
    pub fn gradsync_partition(n: u64, parts: u32, index: u32, start: *mut u64, len: *mut u64) -> c_int;
    pub fn gradsync_split_round_robin(
        samples: u64,
        workers: u32,
        worker: u32,
        out: *mut u64,
        capacity: usize,
        needed: *mut usize,
    ) -> c_int;
    pub fn gradsync_weighted_merge_f32(
        grads: *const *const f32,
        lens: *const usize,
        counts: *const u64,
        losses: *const f64,
        workers: usize,
        out: *mut f32,
        out_len: usize,
        mean_loss: *mut f64,
        total_count: *mut u64,
    ) -> c_int;
    pub fn gradsync_weighted_merge_f64(
        grads: *const *const f64,
        lens: *const usize,
        counts: *const u64,
        losses: *const f64,
        workers: usize,
        out: *mut f64,
        out_len: usize,
        mean_loss: *mut f64,
        total_count: *mut u64,
    ) -> c_int;
}

// ------------------------------------------------------------------ codec.h (any thread)

pub const GRADSYNC_CODEC_NONE: i32 = 0;
pub const GRADSYNC_CODEC_BIGDL_FP16: i32 = 1;
pub const GRADSYNC_CODEC_BF16: i32 = 2;
pub const GRADSYNC_CODEC_FP16: i32 = 3;

extern "C" {
    pub fn gradsync_codec_encode(codec: i32, src: *const f32, count: usize, dst: *mut c_void, dst_capacity: usize)
        -> c_int;
    pub fn gradsync_codec_decode(
        codec: i32,
        src: *const c_void,
        src_count: usize,
        offset: usize,
        dst: *mut f32,
        count: usize,
    ) -> c_int;
    pub fn gradsync_codec_add(
        codec: i32,
        dst: *mut c_void,
        dst_count: usize,
        offset: usize,
        src: *const c_void,
        count: usize,
    ) -> c_int;
    pub fn gradsync_codec_accumulate(
        codec: i32,
        dst: *mut f32,
        dst_count: usize,
        offset: usize,
        src: *const c_void,
        count: usize,
    ) -> c_int;
}

// ------------------------------------------------------------------ table.h

pub const GRADSYNC_TABLE_CREATE: i32 = 1;
pub const GRADSYNC_TABLE_OPEN: i32 = 2;
pub const GRADSYNC_TABLE_CREATE_OR_OPEN: i32 = 3;
pub const GRADSYNC_TABLE_ANONYMOUS: i32 = 4;

pub const GRADSYNC_TABLE_INIT_ZEROS: i32 = 0;
pub const GRADSYNC_TABLE_INIT_UNIFORM: i32 = 1;

pub const GRADSYNC_TABLE_OPTIONS_VERSION: u32 = 2;

/// Options of [`gradsync_table_open`] (table.h, version 2).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct gradsync_table_options {
    pub struct_size: u32,
    pub version: u32,
    pub mode: i32,
    pub read_only: i32,
    pub rows: i64,
    pub dim: i64,
    pub dtype: i32,
    pub init: i32,
    pub seed: u64,
    pub lo: f64,
    pub hi: f64,
    // version 2
    pub file_mode: i32,
    pub allow_other_owner: i32,
}

/// GRADSYNC_TABLE_OPTIONS_INIT.
pub const GRADSYNC_TABLE_OPTIONS_INIT: gradsync_table_options = gradsync_table_options {
    struct_size: size_of::<gradsync_table_options>() as u32,
    version: GRADSYNC_TABLE_OPTIONS_VERSION,
    mode: GRADSYNC_TABLE_CREATE_OR_OPEN,
    read_only: 0,
    rows: GRADSYNC_UNSET_I64,
    dim: GRADSYNC_UNSET_I64,
    dtype: GRADSYNC_F32,
    init: GRADSYNC_TABLE_INIT_ZEROS,
    seed: 0,
    lo: -0.5,
    hi: 0.5,
    file_mode: 0,
    allow_other_owner: 0,
};


// Thread safety (table.h): reads and writes of distinct rows may run in parallel from any thread;
// writes to the same row from two threads at once are not synchronised.
extern "C" {
    /// `@threadsafety any`
    pub fn gradsync_table_options_init(opts: *mut gradsync_table_options, struct_size: usize) -> c_int;
    /// `@threadsafety any`
    pub fn gradsync_table_open(
        out: *mut *mut gradsync_table,
        path: *const c_char,
        opts: *const gradsync_table_options,
    ) -> c_int;
    /// `@threadsafety handle`
    pub fn gradsync_table_free(table: *mut gradsync_table);
    /// `@threadsafety any`
    pub fn gradsync_table_shape(table: *const gradsync_table, rows: *mut i64, dim: *mut i64) -> c_int;
    /// `@threadsafety any`
    pub fn gradsync_table_created(table: *const gradsync_table, created: *mut i32) -> c_int;
    /// `@threadsafety any`
    pub fn gradsync_table_get(table: *const gradsync_table, row: i64, out: *mut f32, count: usize) -> c_int;
    /// `@threadsafety any` (not synchronised with other writers of the same row)
    pub fn gradsync_table_set(table: *mut gradsync_table, row: i64, values: *const f32, count: usize) -> c_int;
    /// `@threadsafety any`
    pub fn gradsync_table_gather(
        table: *const gradsync_table,
        rows: *const i64,
        n: usize,
        out: *mut f32,
        count: usize,
    ) -> c_int;
    /// `@threadsafety any` (not synchronised with other writers of the same rows)
    pub fn gradsync_table_scatter(
        table: *mut gradsync_table,
        rows: *const i64,
        n: usize,
        values: *const f32,
        count: usize,
    ) -> c_int;
    /// `@threadsafety handle`
    pub fn gradsync_table_fill_zero(table: *mut gradsync_table) -> c_int;
    /// `@threadsafety handle`
    pub fn gradsync_table_fill_uniform(table: *mut gradsync_table, seed: u64, lo: f32, hi: f32) -> c_int;
    /// `@threadsafety any`
    pub fn gradsync_table_flush(table: *mut gradsync_table) -> c_int;
    /// `@threadsafety any`
    pub fn gradsync_table_prefetch(table: *const gradsync_table, rows: *const i64, n: usize) -> c_int;
    /// `@threadsafety any`; `*data` points into the mapping (read-only), valid until free.
    pub fn gradsync_table_view(table: *const gradsync_table, data: *mut *const c_void, bytes: *mut usize) -> c_int;
}

// ------------------------------------------------------------------ accumulator.h

pub const GRADSYNC_ACCUM_STRIPED: i32 = 0;
pub const GRADSYNC_ACCUM_LOCK_FREE: i32 = 1;
pub const GRADSYNC_ACCUM_NONE: i32 = 2;
pub const GRADSYNC_ACCUM_OWNER: i32 = 3;

pub const GRADSYNC_ACCUM_OPTIONS_VERSION: u32 = 3;

/// Options of [`gradsync_accum_open`] (accumulator.h, version 3).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct gradsync_accum_options {
    pub struct_size: u32,
    pub version: u32,
    pub mode: i32,
    pub concurrency: i32,
    pub rows: i64,
    pub dim: i64,
    pub rows_per_lock: i64,
    pub threads: i64,
    pub file_mode: i32,
    pub allow_other_owner: i32,
}

/// GRADSYNC_ACCUM_OPTIONS_INIT.
pub const GRADSYNC_ACCUM_OPTIONS_INIT: gradsync_accum_options = gradsync_accum_options {
    struct_size: size_of::<gradsync_accum_options>() as u32,
    version: GRADSYNC_ACCUM_OPTIONS_VERSION,
    mode: GRADSYNC_TABLE_CREATE_OR_OPEN,
    concurrency: GRADSYNC_UNSET_I32,
    rows: GRADSYNC_UNSET_I64,
    dim: GRADSYNC_UNSET_I64,
    rows_per_lock: GRADSYNC_UNSET_I64,
    threads: GRADSYNC_UNSET_I64,
    file_mode: 0,
    allow_other_owner: 0,
};


pub const GRADSYNC_OPTIMIZER_VERSION: u32 = 2;

/// An optimizer step for [`gradsync_accum_apply`] (accumulator.h, version 2).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct gradsync_optimizer {
    pub struct_size: u32,
    pub version: u32,
    pub kind: i32,
    pub reserved0: i32,
    pub lr: f64,
    /// 0: the optimizer's default (1e-10 row-wise Adagrad, 1e-8 Adam).
    pub eps: f64,
    pub beta1: f64,
    pub beta2: f64,
}

/// GRADSYNC_OPTIMIZER_INIT.
pub const GRADSYNC_OPTIMIZER_INIT: gradsync_optimizer = gradsync_optimizer {
    struct_size: size_of::<gradsync_optimizer>() as u32,
    version: GRADSYNC_OPTIMIZER_VERSION,
    kind: GRADSYNC_OPTIM_SGD,
    reserved0: 0,
    lr: 0.01,
    eps: 0.0,
    beta1: 0.9,
    beta2: 0.999,
};


// Thread safety (accumulator.h): add, add_batch and get from any thread at once; zero, apply and
// touched exclude this process's adds while they run. Only free is `handle`.
extern "C" {
    pub fn gradsync_accum_options_init(opts: *mut gradsync_accum_options, struct_size: usize) -> c_int;
    pub fn gradsync_optimizer_init(opt: *mut gradsync_optimizer, struct_size: usize) -> c_int;
    pub fn gradsync_accum_open(
        out: *mut *mut gradsync_accum,
        path: *const c_char,
        opts: *const gradsync_accum_options,
    ) -> c_int;
    /// `@threadsafety handle`
    pub fn gradsync_accum_free(accum: *mut gradsync_accum);
    pub fn gradsync_accum_shape(accum: *const gradsync_accum, rows: *mut i64, dim: *mut i64) -> c_int;
    pub fn gradsync_accum_get_concurrency(
        accum: *const gradsync_accum,
        concurrency: *mut i32,
        rows_per_lock: *mut i64,
    ) -> c_int;
    pub fn gradsync_accum_add(accum: *mut gradsync_accum, row: i64, grad: *const f32, count: usize) -> c_int;
    pub fn gradsync_accum_add_batch(
        accum: *mut gradsync_accum,
        rows: *const i64,
        n: usize,
        grads: *const f32,
        count: usize,
    ) -> c_int;
    pub fn gradsync_accum_get(accum: *mut gradsync_accum, row: i64, out: *mut f32, count: usize) -> c_int;
    pub fn gradsync_accum_zero(accum: *mut gradsync_accum) -> c_int;
    pub fn gradsync_accum_touched_count(accum: *mut gradsync_accum, count: *mut i64) -> c_int;
    pub fn gradsync_accum_touched(accum: *mut gradsync_accum, out: *mut i64, capacity: usize, needed: *mut usize)
        -> c_int;
    pub fn gradsync_accum_apply(
        accum: *mut gradsync_accum,
        params: *mut gradsync_table,
        opt: *const gradsync_optimizer,
        state: *mut gradsync_table,
    ) -> c_int;
    pub fn gradsync_accum_flush(accum: *mut gradsync_accum) -> c_int;
    pub fn gradsync_accum_view(accum: *const gradsync_accum, data: *mut *const c_void, bytes: *mut usize) -> c_int;
}

// ------------------------------------------------------------------ comm.h

pub const GRADSYNC_TRANSPORT_THREAD: i32 = 0;
pub const GRADSYNC_TRANSPORT_SHM: i32 = 1;
pub const GRADSYNC_TRANSPORT_MPI: i32 = 2;
pub const GRADSYNC_TRANSPORT_HIER: i32 = 3;

pub const GRADSYNC_COMM_OPTIONS_VERSION: u32 = 3;
pub const GRADSYNC_SPLIT_NONE: i32 = -1;
pub const GRADSYNC_GROW_RESULT_VERSION: u32 = 1;
pub const GRADSYNC_COMM_NAME_MAX: usize = 64;
pub const GRADSYNC_NO_TIMEOUT: i64 = i64::MAX;
pub const GRADSYNC_MAX_FUSED_BUFFERS: usize = 1 << 20;

/// What [`gradsync_comm_grow`] and [`gradsync_comm_join`] report besides the new group (comm.h).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct gradsync_grow_result {
    pub struct_size: u32,
    pub version: u32,
    pub old_size: i32,
    pub new_size: i32,
    pub first_member_id: i64,
    pub agree_ns: i64,
    pub form_ns: i64,
}

/// Options of [`gradsync_comm_create`] (comm.h, version 3).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct gradsync_comm_options {
    pub struct_size: u32,
    pub version: u32,
    pub transport: i32,
    pub rank: i32,
    pub size: i32,
    pub deterministic: i32,
    pub check_mismatch: i32,
    pub reserved0: i32,
    pub timeout_ms: i64,
    pub mpi_fcomm: i64,
    pub name: [c_char; GRADSYNC_COMM_NAME_MAX],
    pub host: [c_char; GRADSYNC_COMM_NAME_MAX],
    pub topology_independent: i32,
    pub reserved1: i32,
    pub threads: i32,
    pub thread: i32,
}

/// GRADSYNC_COMM_OPTIONS_INIT.
pub const GRADSYNC_COMM_OPTIONS_INIT: gradsync_comm_options = gradsync_comm_options {
    struct_size: size_of::<gradsync_comm_options>() as u32,
    version: GRADSYNC_COMM_OPTIONS_VERSION,
    transport: GRADSYNC_TRANSPORT_THREAD,
    rank: GRADSYNC_UNSET_I32,
    size: GRADSYNC_UNSET_I32,
    deterministic: GRADSYNC_UNSET_I32,
    check_mismatch: GRADSYNC_UNSET_I32,
    reserved0: 0,
    timeout_ms: GRADSYNC_UNSET_I64,
    mpi_fcomm: GRADSYNC_UNSET_I64,
    name: [0; GRADSYNC_COMM_NAME_MAX],
    host: [0; GRADSYNC_COMM_NAME_MAX],
    topology_independent: 0,
    reserved1: 0,
    threads: GRADSYNC_UNSET_I32,
    thread: GRADSYNC_UNSET_I32,
};


/// Asked now and then by a waiting collective; non-zero aborts the group.
pub type gradsync_interrupt_fn = Option<unsafe extern "C" fn(user_data: *mut c_void) -> c_int>;

// Thread safety (comm.h): one thread at a time per handle, checked (a second thread gets
// GRADSYNC_E_MISUSE); exempt: abort (any thread, any time) and the rank/size/transport getters.
extern "C" {
    /// `@threadsafety any`
    pub fn gradsync_comm_options_init(opts: *mut gradsync_comm_options, struct_size: usize) -> c_int;
    /// Collective join. `@threadsafety any`
    pub fn gradsync_comm_create(out: *mut *mut gradsync_comm, opts: *const gradsync_comm_options) -> c_int;
    /// `@threadsafety handle` (a call running on another thread is aborted and waited for)
    pub fn gradsync_comm_free(comm: *mut gradsync_comm);
    /// `@threadsafety any-abort`
    pub fn gradsync_comm_abort(comm: *mut gradsync_comm) -> c_int;
    /// `@threadsafety handle`
    pub fn gradsync_comm_set_interrupt(comm: *mut gradsync_comm, f: gradsync_interrupt_fn, user_data: *mut c_void)
        -> c_int;
    /// Collective. `@threadsafety handle`
    pub fn gradsync_comm_reset(comm: *mut gradsync_comm) -> c_int;
    /// `@threadsafety any`
    pub fn gradsync_comm_rank(comm: *const gradsync_comm, rank: *mut i32) -> c_int;
    /// `@threadsafety any`
    pub fn gradsync_comm_size(comm: *const gradsync_comm, size: *mut i32) -> c_int;
    /// `@threadsafety any`
    pub fn gradsync_comm_transport(comm: *const gradsync_comm, transport: *mut i32) -> c_int;
    /// Collective. `@threadsafety handle`
    pub fn gradsync_comm_split(comm: *mut gradsync_comm, color: i32, key: i32, out: *mut *mut gradsync_comm)
        -> c_int;
    /// Collective over comm, with the joiners ([`gradsync_comm_join`]). `@threadsafety handle`
    pub fn gradsync_comm_grow(
        comm: *mut gradsync_comm,
        join_name: *const c_char,
        joiners: i32,
        out: *mut *mut gradsync_comm,
        result: *mut gradsync_grow_result,
    ) -> c_int;
    /// A joiner's side of [`gradsync_comm_grow`]. `@threadsafety any`
    pub fn gradsync_comm_join(
        out: *mut *mut gradsync_comm,
        opts: *const gradsync_comm_options,
        result: *mut gradsync_grow_result,
    ) -> c_int;
    /// `@threadsafety any`
    pub fn gradsync_comm_member_id(comm: *const gradsync_comm, id: *mut i64) -> c_int;
    /// `@threadsafety any`
    pub fn gradsync_comm_topology(
        comm: *const gradsync_comm,
        host: *mut i32,
        local_rank: *mut i32,
        local_size: *mut i32,
        num_hosts: *mut i32,
        rank_hosts: *mut i32,
        rank_hosts_len: usize,
    ) -> c_int;

    /// `@threadsafety handle`
    pub fn gradsync_comm_allreduce(
        comm: *mut gradsync_comm,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: i32,
        op: i32,
    ) -> c_int;
    /// `@threadsafety handle`
    pub fn gradsync_comm_allreduce_many(
        comm: *mut gradsync_comm,
        sends: *const *const c_void,
        recvs: *const *mut c_void,
        counts: *const usize,
        nbufs: usize,
        dtype: i32,
        op: i32,
    ) -> c_int;
    /// `@threadsafety handle`
    pub fn gradsync_comm_allreduce_mixed(
        comm: *mut gradsync_comm,
        sends: *const *const c_void,
        recvs: *const *mut c_void,
        counts: *const usize,
        dtypes: *const i32,
        nbufs: usize,
        op: i32,
    ) -> c_int;
    /// `@threadsafety handle`
    pub fn gradsync_comm_weighted_mean(
        comm: *mut gradsync_comm,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: i32,
        weight: u64,
        total_weight: *mut u64,
    ) -> c_int;
    /// `@threadsafety handle`
    pub fn gradsync_comm_broadcast(comm: *mut gradsync_comm, buf: *mut c_void, count: usize, dtype: i32, root: i32)
        -> c_int;
    /// `@threadsafety handle`
    pub fn gradsync_comm_allgather(
        comm: *mut gradsync_comm,
        send: *const c_void,
        recv: *mut c_void,
        total_count: usize,
        dtype: i32,
    ) -> c_int;
    /// `@threadsafety handle`
    pub fn gradsync_comm_reduce_scatter(
        comm: *mut gradsync_comm,
        send: *const c_void,
        recv: *mut c_void,
        total_count: usize,
        dtype: i32,
        op: i32,
    ) -> c_int;
    /// `@threadsafety handle`
    pub fn gradsync_comm_alltoall(
        comm: *mut gradsync_comm,
        send: *const c_void,
        recv: *mut c_void,
        total_count: usize,
        dtype: i32,
    ) -> c_int;
    /// `@threadsafety handle`
    pub fn gradsync_comm_allgatherv(
        comm: *mut gradsync_comm,
        send: *const c_void,
        recv: *mut c_void,
        counts: *const usize,
        dtype: i32,
    ) -> c_int;
    /// `@threadsafety handle`
    pub fn gradsync_comm_reduce_scatterv(
        comm: *mut gradsync_comm,
        send: *const c_void,
        recv: *mut c_void,
        counts: *const usize,
        dtype: i32,
        op: i32,
    ) -> c_int;
    /// `@threadsafety handle`
    pub fn gradsync_comm_alltoallv(
        comm: *mut gradsync_comm,
        send: *const c_void,
        send_counts: *const usize,
        send_displs: *const usize,
        recv: *mut c_void,
        recv_counts: *const usize,
        recv_displs: *const usize,
        dtype: i32,
    ) -> c_int;
    /// `@threadsafety handle`
    pub fn gradsync_comm_reduce(
        comm: *mut gradsync_comm,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: i32,
        op: i32,
        root: i32,
    ) -> c_int;
    /// `@threadsafety handle`
    pub fn gradsync_comm_gather(
        comm: *mut gradsync_comm,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: i32,
        root: i32,
    ) -> c_int;
    /// `@threadsafety handle`
    pub fn gradsync_comm_gatherv(
        comm: *mut gradsync_comm,
        send: *const c_void,
        send_count: usize,
        recv: *mut c_void,
        recv_counts: *const usize,
        dtype: i32,
        root: i32,
    ) -> c_int;
    /// `@threadsafety handle`
    pub fn gradsync_comm_scatter(
        comm: *mut gradsync_comm,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: i32,
        root: i32,
    ) -> c_int;
    /// `@threadsafety handle`
    pub fn gradsync_comm_scatterv(
        comm: *mut gradsync_comm,
        send: *const c_void,
        send_counts: *const usize,
        recv: *mut c_void,
        recv_count: usize,
        dtype: i32,
        root: i32,
    ) -> c_int;
    /// `@threadsafety handle`
    pub fn gradsync_comm_barrier(comm: *mut gradsync_comm) -> c_int;
    /// `@threadsafety handle`
    pub fn gradsync_comm_alloc(comm: *mut gradsync_comm, bytes: usize, ptr: *mut *mut c_void) -> c_int;
    /// `@threadsafety handle`
    pub fn gradsync_comm_free_buffer(comm: *mut gradsync_comm, ptr: *mut c_void) -> c_int;
}

// ------------------------------------------------------------------ shard.h

pub const GRADSYNC_SHARD_SGD: i32 = GRADSYNC_OPTIM_SGD;
pub const GRADSYNC_SHARD_MOMENTUM: i32 = GRADSYNC_OPTIM_MOMENTUM;
pub const GRADSYNC_SHARD_ADAM: i32 = GRADSYNC_OPTIM_ADAM;
pub const GRADSYNC_SHARD_ADAMW: i32 = GRADSYNC_OPTIM_ADAMW;

pub const GRADSYNC_SHARD_WEIGHTS: i32 = 0;
pub const GRADSYNC_SHARD_GRADIENT: i32 = 1;
pub const GRADSYNC_SHARD_STATE1: i32 = 2;
pub const GRADSYNC_SHARD_STATE2: i32 = 3;

pub const GRADSYNC_SHARD_OPTIONS_VERSION: u32 = 3;

/// Options of [`gradsync_shard_create`] (shard.h, version 3).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct gradsync_shard_options {
    pub struct_size: u32,
    pub version: u32,
    pub optimizer: i32,
    pub compress: i32,
    pub error_feedback: i32,
    pub clamp: i32,
    pub lr: f64,
    pub momentum: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub clamp_min: f64,
    pub clamp_max: f64,
    pub clip_norm: f64,
    pub replicas: i32,
    pub reserved0: i32,
}

/// GRADSYNC_SHARD_OPTIONS_INIT.
pub const GRADSYNC_SHARD_OPTIONS_INIT: gradsync_shard_options = gradsync_shard_options {
    struct_size: size_of::<gradsync_shard_options>() as u32,
    version: GRADSYNC_SHARD_OPTIONS_VERSION,
    optimizer: GRADSYNC_SHARD_SGD,
    compress: GRADSYNC_CODEC_NONE,
    error_feedback: 0,
    clamp: 0,
    lr: 0.01,
    momentum: 0.9,
    beta1: 0.9,
    beta2: 0.999,
    eps: 1e-8,
    weight_decay: 0.0,
    clamp_min: 0.0,
    clamp_max: 0.0,
    clip_norm: 0.0,
    replicas: 0,
    reserved0: 0,
};


// Thread safety (shard.h): every function on a shard handle is `handle` except create (`any`).
extern "C" {
    pub fn gradsync_shard_options_init(opts: *mut gradsync_shard_options, struct_size: usize) -> c_int;
    pub fn gradsync_shard_create(
        out: *mut *mut gradsync_shard,
        comm: *mut gradsync_comm,
        total: u64,
        opts: *const gradsync_shard_options,
    ) -> c_int;
    pub fn gradsync_shard_free(shard: *mut gradsync_shard);
    pub fn gradsync_shard_part(
        shard: *const gradsync_shard,
        rank: i32,
        base: u64,
        offset: *mut u64,
        length: *mut u64,
    ) -> c_int;
    pub fn gradsync_shard_ranges(
        shard: *const gradsync_shard,
        base: u64,
        out: *mut u64,
        capacity: usize,
        needed: *mut usize,
    ) -> c_int;
    pub fn gradsync_shard_memory(
        shard: *const gradsync_shard,
        weight_bytes: *mut u64,
        optimizer_bytes: *mut u64,
        buffer_bytes: *mut u64,
    ) -> c_int;
    pub fn gradsync_shard_updates(shard: *const gradsync_shard, updates: *mut i64) -> c_int;
    pub fn gradsync_shard_set_lr(shard: *mut gradsync_shard, lr: f64) -> c_int;
    pub fn gradsync_shard_init(shard: *mut gradsync_shard, weights: *const f32, count: usize) -> c_int;
    pub fn gradsync_shard_restore(
        shard: *mut gradsync_shard,
        weights: *const f32,
        state1: *const f32,
        state2: *const f32,
        count: usize,
        updates: i64,
    ) -> c_int;
    pub fn gradsync_shard_step(
        shard: *mut gradsync_shard,
        gradient: *const f32,
        weights: *mut f32,
        count: usize,
        samples: u64,
    ) -> c_int;
    pub fn gradsync_shard_put(shard: *mut gradsync_shard, gradient: *const f32, count: usize, samples: u64) -> c_int;
    pub fn gradsync_shard_aggregate(shard: *mut gradsync_shard) -> c_int;
    pub fn gradsync_shard_update(shard: *mut gradsync_shard) -> c_int;
    pub fn gradsync_shard_read_slice(shard: *const gradsync_shard, which: i32, out: *mut f32, count: usize) -> c_int;
    pub fn gradsync_shard_write_weights(shard: *mut gradsync_shard, slice: *const f32, count: usize) -> c_int;
    pub fn gradsync_shard_gather(shard: *mut gradsync_shard, weights: *mut f32, count: usize) -> c_int;
}

// ------------------------------------------------------------------ embedding.h

pub const GRADSYNC_EMBEDDING_CONTIGUOUS: i32 = 0;
pub const GRADSYNC_EMBEDDING_HASH: i32 = 1;
pub const GRADSYNC_EMBEDDING_KEEP_SHARDING: i32 = -1;

pub const GRADSYNC_EMBEDDING_OPTIONS_VERSION: u32 = 3;

/// Options of [`gradsync_embedding_create`] (embedding.h, version 2).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct gradsync_embedding_options {
    pub struct_size: u32,
    pub version: u32,
    pub rows: i64,
    pub dim: i64,
    pub sharding: i32,
    pub optimizer: i32,
    pub lr: f64,
    pub eps: f64,
    pub init: i32,
    pub threads: i32,
    pub seed: u64,
    pub lo: f64,
    pub hi: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub replicas: i32,
    pub reserved0: i32,
}

/// GRADSYNC_EMBEDDING_OPTIONS_INIT.
pub const GRADSYNC_EMBEDDING_OPTIONS_INIT: gradsync_embedding_options = gradsync_embedding_options {
    struct_size: size_of::<gradsync_embedding_options>() as u32,
    version: GRADSYNC_EMBEDDING_OPTIONS_VERSION,
    rows: 0,
    dim: 0,
    sharding: GRADSYNC_EMBEDDING_CONTIGUOUS,
    optimizer: GRADSYNC_OPTIM_SGD,
    lr: 0.01,
    eps: 0.0,
    init: GRADSYNC_TABLE_INIT_ZEROS,
    threads: GRADSYNC_UNSET_I32,
    seed: 0,
    lo: -0.5,
    hi: 0.5,
    beta1: 0.9,
    beta2: 0.999,
    replicas: 0,
    reserved0: 0,
};


// Thread safety (embedding.h): every function on a table handle is `handle`, except create,
// shape, owner and steps (`any`).
extern "C" {
    pub fn gradsync_embedding_options_init(opts: *mut gradsync_embedding_options, struct_size: usize) -> c_int;
    pub fn gradsync_embedding_create(
        out: *mut *mut gradsync_embedding,
        comm: *mut gradsync_comm,
        dir: *const c_char,
        opts: *const gradsync_embedding_options,
    ) -> c_int;
    pub fn gradsync_embedding_free(table: *mut gradsync_embedding);
    pub fn gradsync_embedding_shape(
        table: *const gradsync_embedding,
        rows: *mut i64,
        dim: *mut i64,
        local_rows: *mut i64,
    ) -> c_int;
    pub fn gradsync_embedding_owner(table: *const gradsync_embedding, ids: *const i64, n: usize, owners: *mut i32)
        -> c_int;
    pub fn gradsync_embedding_steps(table: *const gradsync_embedding, steps: *mut i64) -> c_int;
    pub fn gradsync_embedding_set_lr(table: *mut gradsync_embedding, lr: f64) -> c_int;
    pub fn gradsync_embedding_lookup(
        table: *mut gradsync_embedding,
        ids: *const i64,
        n: usize,
        out: *mut f32,
        count: usize,
    ) -> c_int;
    pub fn gradsync_embedding_push(
        table: *mut gradsync_embedding,
        ids: *const i64,
        n: usize,
        grads: *const f32,
        count: usize,
    ) -> c_int;
    pub fn gradsync_embedding_save(table: *mut gradsync_embedding, dir: *const c_char) -> c_int;
    pub fn gradsync_embedding_save_incremental(table: *mut gradsync_embedding, dir: *const c_char) -> c_int;
    pub fn gradsync_embedding_load(table: *mut gradsync_embedding, dir: *const c_char) -> c_int;
    pub fn gradsync_embedding_reshard(
        table: *mut gradsync_embedding,
        new_comm: *mut gradsync_comm,
        sharding: i32,
        checkpoint_dir: *const c_char,
        moved_rows: *mut u64,
        restored: *mut i32,
    ) -> c_int;
    pub fn gradsync_embedding_local_rows(
        table: *const gradsync_embedding,
        ids: *mut i64,
        values: *mut f32,
        state: *mut f32,
        capacity: usize,
    ) -> c_int;
}
