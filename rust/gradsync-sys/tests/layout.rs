// SPDX-License-Identifier: Apache-2.0
//! The hand-written declarations against the C headers and the linked library: field offsets as a
//! C99 compiler lays them out (recorded from offsetof on x86-64 Linux, the same on every LP64
//! target), the `*_INIT` mirrors equal to what the library's `*_options_init` fills, and the ABI
//! version of the library that was linked.
use gradsync_sys::*;
use std::mem::{size_of, MaybeUninit};

macro_rules! check_offsets {
    ($ty:ident { $($field:ident => $off:expr),* $(,)? }, size $size:expr) => {{
        let value = MaybeUninit::<$ty>::uninit();
        let base = value.as_ptr() as usize;
        $(
            // SAFETY: addr_of! on a field of an uninitialised value only computes an address.
            let at = unsafe { std::ptr::addr_of!((*value.as_ptr()).$field) } as usize - base;
            assert_eq!(at, $off, concat!(stringify!($ty), ".", stringify!($field)));
        )*
        assert_eq!(size_of::<$ty>(), $size, stringify!($ty));
    }};
}

#[test]
fn option_structs_have_the_c_layout() {
    check_offsets!(gradsync_comm_options {
        struct_size => 0, version => 4, transport => 8, rank => 12, size => 16, deterministic => 20,
        check_mismatch => 24, reserved0 => 28, timeout_ms => 32, mpi_fcomm => 40, name => 48, host => 112,
        topology_independent => 176, reserved1 => 180,
    }, size 184);
    check_offsets!(gradsync_table_options {
        struct_size => 0, version => 4, mode => 8, read_only => 12, rows => 16, dim => 24, dtype => 32,
        init => 36, seed => 40, lo => 48, hi => 56, file_mode => 64, allow_other_owner => 68,
    }, size 72);
    check_offsets!(gradsync_accum_options {
        struct_size => 0, version => 4, mode => 8, concurrency => 12, rows => 16, dim => 24, rows_per_lock => 32,
        threads => 40, file_mode => 48, allow_other_owner => 52,
    }, size 56);
    check_offsets!(gradsync_optimizer {
        struct_size => 0, version => 4, kind => 8, reserved0 => 12, lr => 16, eps => 24,
    }, size 32);
    check_offsets!(gradsync_shard_options {
        struct_size => 0, version => 4, optimizer => 8, compress => 12, error_feedback => 16, clamp => 20,
        lr => 24, momentum => 32, beta1 => 40, beta2 => 48, eps => 56, weight_decay => 64, clamp_min => 72,
        clamp_max => 80, clip_norm => 88,
    }, size 96);
    check_offsets!(gradsync_embedding_options {
        struct_size => 0, version => 4, rows => 8, dim => 16, sharding => 24, optimizer => 28, lr => 32, eps => 40,
        init => 48, threads => 52, seed => 56, lo => 64, hi => 72,
    }, size 80);
}

macro_rules! init_matches {
    ($ty:ident, $init_fn:ident, $mirror:ident) => {{
        let mut filled = MaybeUninit::<$ty>::zeroed();
        // SAFETY: a writable struct of the size we pass; all-zero bytes are a valid value.
        let rc = unsafe { $init_fn(filled.as_mut_ptr(), size_of::<$ty>()) };
        assert_eq!(rc, GRADSYNC_OK, "{}: {}", stringify!($init_fn), last_message());
        let filled = unsafe { filled.assume_init() };
        assert_eq!(filled, $mirror, "{} differs from the library's defaults", stringify!($mirror));
    }};
}

fn last_message() -> String {
    // Same thread, right after the call that failed.
    unsafe { std::ffi::CStr::from_ptr(gradsync_last_error_message()) }.to_string_lossy().into_owned()
}

#[test]
fn init_mirrors_equal_the_library_defaults() {
    init_matches!(gradsync_comm_options, gradsync_comm_options_init, GRADSYNC_COMM_OPTIONS_INIT);
    init_matches!(gradsync_table_options, gradsync_table_options_init, GRADSYNC_TABLE_OPTIONS_INIT);
    init_matches!(gradsync_accum_options, gradsync_accum_options_init, GRADSYNC_ACCUM_OPTIONS_INIT);
    init_matches!(gradsync_optimizer, gradsync_optimizer_init, GRADSYNC_OPTIMIZER_INIT);
    init_matches!(gradsync_shard_options, gradsync_shard_options_init, GRADSYNC_SHARD_OPTIONS_INIT);
    init_matches!(gradsync_embedding_options, gradsync_embedding_options_init, GRADSYNC_EMBEDDING_OPTIONS_INIT);
}

#[test]
fn linked_library_has_our_abi_version() {
    assert_eq!(unsafe { gradsync_abi_version() }, GRADSYNC_ABI_VERSION);
    assert_eq!(unsafe { gradsync_dtype_size(GRADSYNC_F64) }, 8);
    assert_eq!(unsafe { gradsync_has_feature(GRADSYNC_FEATURE_THREAD_TRANSPORT) }, 1);
}

#[test]
fn a_failure_leaves_status_and_message_on_this_thread() {
    let mut start = 0u64;
    let mut len = 0u64;
    let rc = unsafe { gradsync_partition(10, 3, 5, &mut start, &mut len) };
    let message = last_message();
    assert_eq!(rc, GRADSYNC_E_OUT_OF_RANGE);
    assert!(message.contains("gradsync_partition"), "{}", message);
    assert_eq!(unsafe { gradsync_last_error_status() }, GRADSYNC_E_OUT_OF_RANGE);
    // Another OS thread has its own (empty) last error.
    std::thread::spawn(|| assert_eq!(last_message(), "")).join().unwrap();
}
