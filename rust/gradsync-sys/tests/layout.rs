// SPDX-License-Identifier: Apache-2.0
//! The hand-written declarations against the linked library: the `*_INIT` mirrors equal to what
//! the library's `*_options_init` fills, and the ABI version of the library that was linked. Their
//! agreement with the C headers (constants, sizes, offsets) is tests/mirrors.rs.
use gradsync_sys::*;
use std::mem::{size_of, MaybeUninit};

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
