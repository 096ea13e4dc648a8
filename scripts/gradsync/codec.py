# SPDX-License-Identifier: Apache-2.0
"""16-bit codecs for gradients on the wire, over numpy arrays (vectorised C, no Python loops).

    import numpy as np, gradsync as gs
    enc = gs.encode(np.array([1.111111, 0.1], dtype=np.float32), "bigdl_fp16")   # uint16 array
    gs.decode(enc, "bigdl_fp16")                    # [1.109375, 0.099609375], bit-exact to BigDL

Codecs: "bigdl_fp16" (BigDL's "FP16": bfloat16 by truncation, big-endian, readable by BigDL),
"bf16" (bfloat16, round to nearest even), "fp16" (IEEE half, round to nearest even, F16C when the
CPU has it). NaN stays NaN, Inf stays Inf. Encoded arrays are numpy uint16, one per float.
"""
import numpy as np

from ._lib import address, c_int, c_int32, c_size_t, c_void_p, check, declare, lib, numpy_array

__all__ = ["CODECS", "encode", "decode", "add_encoded", "accumulate_encoded"]

CODECS = {"none": 0, "bigdl_fp16": 1, "bf16": 2, "fp16": 3}

declare("gradsync_codec_encode", c_int, c_int32, c_void_p, c_size_t, c_void_p, c_size_t)
declare("gradsync_codec_decode", c_int, c_int32, c_void_p, c_size_t, c_size_t, c_void_p, c_size_t)
declare("gradsync_codec_add", c_int, c_int32, c_void_p, c_size_t, c_size_t, c_void_p, c_size_t)
declare("gradsync_codec_accumulate", c_int, c_int32, c_void_p, c_size_t, c_size_t, c_void_p, c_size_t)


def codec_id(codec):
    """The C value of a codec name ("bigdl_fp16", "bf16", "fp16", "none") or number."""
    if isinstance(codec, str):
        try:
            return CODECS[codec.lower()]
        except KeyError:
            raise ValueError(f"unknown codec {codec!r}; expected one of {sorted(CODECS)}") from None
    return int(codec)


def _checked(a, dtype, name, writable):
    return numpy_array(a, name, (dtype,), writable)


_p = address


def encode(array, codec, out=None):
    """Encode float32 values; returns a uint16 array (into `out` when given, which must be large enough)."""
    src = _checked(array, np.float32, "array", False)
    dst = np.empty(src.size, dtype=np.uint16) if out is None else _checked(out, np.uint16, "out", True)
    check(lib.gradsync_codec_encode(codec_id(codec), _p(src), src.size, _p(dst), dst.size))
    return dst


def decode(encoded, codec, offset=0, count=None, out=None):
    """Decode elements [offset, offset + count) of an encoded uint16 array into float32.

    Reading past the end of `encoded` raises GradsyncError (E_INVALID_ARG)."""
    src = _checked(encoded, np.uint16, "encoded", False)
    if count is None:
        count = max(src.size - offset, 0)
    dst = np.empty(count, dtype=np.float32) if out is None else _checked(out, np.float32, "out", True)
    if dst.size != count:
        raise ValueError(f"out holds {dst.size} floats, count is {count}")
    check(lib.gradsync_codec_decode(codec_id(codec), _p(src), src.size, int(offset), _p(dst), count))
    return dst


def add_encoded(dst, src, codec, offset=0):
    """BigDL's compressed add: dst[offset:offset+len(src)] += src, both encoded, summed in f32 and
    rounded once (bit-exact to BigDL for "bigdl_fp16"). In place; returns dst."""
    d = _checked(dst, np.uint16, "dst", True)
    s = _checked(src, np.uint16, "src", False)
    check(lib.gradsync_codec_add(codec_id(codec), _p(d), d.size, int(offset), _p(s), s.size))
    return d


def accumulate_encoded(dst, src, codec, offset=0):
    """dst[offset:offset+len(src)] += decode(src) in float32 (dst is float32). In place; returns dst."""
    d = _checked(dst, np.float32, "dst", True)
    s = _checked(src, np.uint16, "src", False)
    check(lib.gradsync_codec_accumulate(codec_id(codec), _p(d), d.size, int(offset), _p(s), s.size))
    return d
