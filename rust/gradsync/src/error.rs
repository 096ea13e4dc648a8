// SPDX-License-Identifier: Apache-2.0
//! [`Error`]: a status code and the library's message, taken on the thread of the failing call.

use gradsync_sys as sys;
use std::ffi::CStr;
use std::fmt;

/// The status codes of `include/gradsync/errors.h` (pinned values, never renumbered).
pub mod status {
    use gradsync_sys as sys;
    pub const OK: i32 = sys::GRADSYNC_OK;
    pub const INVALID_ARG: i32 = sys::GRADSYNC_E_INVALID_ARG;
    pub const MISUSE: i32 = sys::GRADSYNC_E_MISUSE;
    pub const NOMEM: i32 = sys::GRADSYNC_E_NOMEM;
    pub const IO: i32 = sys::GRADSYNC_E_IO;
    pub const CORRUPT: i32 = sys::GRADSYNC_E_CORRUPT;
    pub const VERSION_MISMATCH: i32 = sys::GRADSYNC_E_VERSION_MISMATCH;
    pub const MISMATCH: i32 = sys::GRADSYNC_E_MISMATCH;
    pub const TIMEOUT: i32 = sys::GRADSYNC_E_TIMEOUT;
    pub const REMOTE: i32 = sys::GRADSYNC_E_REMOTE;
    pub const IN_PROGRESS: i32 = sys::GRADSYNC_E_IN_PROGRESS;
    pub const ABORTED: i32 = sys::GRADSYNC_E_ABORTED;
    pub const UNSUPPORTED: i32 = sys::GRADSYNC_E_UNSUPPORTED;
    pub const BUFS: i32 = sys::GRADSYNC_E_BUFS;
    pub const OUT_OF_RANGE: i32 = sys::GRADSYNC_E_OUT_OF_RANGE;
    pub const ZERO_WEIGHT: i32 = sys::GRADSYNC_E_ZERO_WEIGHT;
    pub const NO_SPACE: i32 = sys::GRADSYNC_E_NO_SPACE;
    pub const NOT_OWNER: i32 = sys::GRADSYNC_E_NOT_OWNER;
    pub const PERMISSION: i32 = sys::GRADSYNC_E_PERMISSION;
    pub const INTERNAL: i32 = sys::GRADSYNC_E_INTERNAL;
}

/// A failed gradsync call: its status (a negative `GRADSYNC_E_*` value, see [`status`]) and what
/// the library said was wrong, e.g. `gradsync_accum_add: row 1000 out of range [0, 1000)`.
///
/// The message is copied from `gradsync_last_error_message()` on the thread that made the failing
/// C call, immediately after it (the C message is per OS thread and valid only until the next
/// gradsync call there). Errors that this crate detects itself before calling C (a slice of the
/// wrong length, a name with a NUL byte) have status [`status::INVALID_ARG`] and a message naming
/// the Rust method.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    /// A negative `GRADSYNC_E_*` status.
    pub status: i32,
    /// What was wrong, as the library (or this crate) said it.
    pub message: String,
}

/// `Result<T, gradsync::Error>`.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// The error of a C call that just returned `rc` on this thread. Must run right after that call,
    /// on the same thread, before any other gradsync call (see the crate documentation).
    fn from_last_call(rc: i32) -> Error {
        // SAFETY: never NULL; library-owned thread-local storage, valid until the next gradsync
        // call on this thread, which is why it is copied here and now.
        let message = unsafe { CStr::from_ptr(sys::gradsync_last_error_message()) }.to_string_lossy().into_owned();
        Error { status: rc, message }
    }

    /// An error found on the Rust side, before any C call.
    pub(crate) fn local(status: i32, message: String) -> Error {
        Error { status, message }
    }

    /// The status's static description, starting with its name, e.g.
    /// `"GRADSYNC_E_MISMATCH: ..."` (`gradsync_status_string`).
    pub fn status_string(&self) -> String {
        status_string(self.status)
    }
}

/// The library's static description of any status, starting with its name.
pub fn status_string(status: i32) -> String {
    // SAFETY: never NULL, static storage; touches no thread-local error state.
    unsafe { CStr::from_ptr(sys::gradsync_status_string(status)) }.to_string_lossy().into_owned()
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let full = status_string(self.status);
        let name = full.split(':').next().unwrap_or("");
        write!(f, "{} ({}): {}", name, self.status, self.message)
    }
}

impl std::error::Error for Error {}

/// Turns the status of a C call into a `Result`, reading the message on failure.
///
/// Use it only as `check(unsafe { sys::gradsync_x(...) })`: the argument is the C call itself, so
/// the message is read on the same OS thread, right after the failing call, with no gradsync call
/// in between. Every fallible method of this crate goes through here.
#[inline]
pub(crate) fn check(rc: i32) -> Result<()> {
    if rc == sys::GRADSYNC_OK {
        Ok(())
    } else {
        Err(Error::from_last_call(rc))
    }
}

/// A local argument error naming the Rust method (status INVALID_ARG).
pub(crate) fn invalid(method: &str, what: String) -> Error {
    Error::local(status::INVALID_ARG, format!("gradsync::{}: {}", method, what))
}
