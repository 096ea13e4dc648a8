// SPDX-License-Identifier: Apache-2.0
//! 16-bit codecs for gradients on the wire (codec.h): one `u16` per float. Pure functions, any
//! thread.

use crate::error::{check, Result};
use gradsync_sys as sys;
use std::ffi::c_void;

/// `gradsync_codec`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Codec {
    /// No compression (accepted by the sharded parameter only).
    None = sys::GRADSYNC_CODEC_NONE,
    /// BigDL's "FP16": bfloat16 by truncation, stored big-endian; bit-exact to BigDL.
    BigdlFp16 = sys::GRADSYNC_CODEC_BIGDL_FP16,
    /// bfloat16, round to nearest even.
    Bf16 = sys::GRADSYNC_CODEC_BF16,
    /// IEEE binary16, round to nearest even.
    Fp16 = sys::GRADSYNC_CODEC_FP16,
}

/// `dst[i] = encode(src[i])` for every float of `src`; `dst` has room for at least `src.len()`
/// (`gradsync_codec_encode`).
pub fn encode(codec: Codec, src: &[f32], dst: &mut [u16]) -> Result<()> {
    check(unsafe {
        sys::gradsync_codec_encode(codec as i32, src.as_ptr(), src.len(), dst.as_mut_ptr() as *mut c_void, dst.len())
    })
}

/// Decodes elements `[offset, offset + dst.len())` of `src` into `dst` (`gradsync_codec_decode`).
pub fn decode(codec: Codec, src: &[u16], offset: usize, dst: &mut [f32]) -> Result<()> {
    check(unsafe {
        sys::gradsync_codec_decode(
            codec as i32,
            src.as_ptr() as *const c_void,
            src.len(),
            offset,
            dst.as_mut_ptr(),
            dst.len(),
        )
    })
}

/// `dst[offset + i] += decode(src[i])` in f32 (`gradsync_codec_accumulate`).
pub fn accumulate(codec: Codec, dst: &mut [f32], offset: usize, src: &[u16]) -> Result<()> {
    check(unsafe {
        sys::gradsync_codec_accumulate(
            codec as i32,
            dst.as_mut_ptr(),
            dst.len(),
            offset,
            src.as_ptr() as *const c_void,
            src.len(),
        )
    })
}
