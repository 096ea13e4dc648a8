// SPDX-License-Identifier: Apache-2.0
//! Element types, reduction ops and optimizer kinds shared by the components.

use gradsync_sys as sys;

mod sealed {
    pub trait Sealed {}
}

/// The element types a buffer of a collective may have: `f32`, `f64`, `i32`, `i64`, each mapped
/// to its `gradsync_dtype`. Sealed: it cannot be implemented outside this crate, since the library
/// reads and writes `len * size_of::<T>()` bytes according to [`Element::DTYPE`].
pub trait Element: sealed::Sealed + Copy + Send + Sync + 'static {
    /// The matching `gradsync_dtype`.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$d;
        }
    )*};
}
element!(f32 => F32, f64 => F64, i32 => I32, i64 => I64);

/// `gradsync_dtype`: element types of buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum DType {
    F32 = sys::GRADSYNC_F32,
    F64 = sys::GRADSYNC_F64,
    I32 = sys::GRADSYNC_I32,
    I64 = sys::GRADSYNC_I64,
    /// bfloat16 (reduced in f32, rounded once)
    BF16 = sys::GRADSYNC_BF16,
    /// IEEE binary16 (reduced in f32, rounded once)
    F16 = sys::GRADSYNC_F16,
}

impl DType {
    /// Size in bytes of one element (`gradsync_dtype_size`).
    pub fn size(self) -> usize {
        // SAFETY: pure function, any thread.
        unsafe { sys::gradsync_dtype_size(self as i32) }
    }
}

/// `gradsync_op`: reduction operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum ReduceOp {
    Sum = sys::GRADSYNC_SUM,
    /// Sum divided by the number of ranks (integers: truncated toward zero).
    Mean = sys::GRADSYNC_MEAN,
    Min = sys::GRADSYNC_MIN,
    Max = sys::GRADSYNC_MAX,
}
