# SPDX-License-Identifier: Apache-2.0
"""Data-parallel helpers: partition, split_round_robin, weighted_merge.

    import gradsync as gs
    gs.partition(10, 3, 1)               # (4, 3): elements [4, 7) of 10 are part 1 of 3
    gs.split_round_robin(10, 3, 0)       # array([0, 3, 6, 9], dtype=uint64)
    r = gs.weighted_merge([g0, g1], counts=[10, 30], losses=[0.5, 0.7])
    r.gradient, r.loss, r.count          # sum c_i g_i / sum c_i, weighted mean loss, 40
"""
import ctypes
from collections import namedtuple

from ._lib import E_BUFS, c_int, c_size_t, c_uint32, c_uint64, c_void_p, check, declare

__all__ = ["partition", "split_round_robin", "weighted_merge", "MergeResult"]

_P = ctypes.POINTER
_partition = declare("gradsync_partition", c_int, c_uint64, c_uint32, c_uint32, _P(c_uint64), _P(c_uint64))
_split = declare("gradsync_split_round_robin", c_int, c_uint64, c_uint32, c_uint32, c_void_p, c_size_t, _P(c_size_t))
_MERGE_ARGS = (_P(c_void_p), _P(c_size_t), _P(c_uint64), _P(ctypes.c_double), c_size_t, c_void_p, c_size_t,
               _P(ctypes.c_double), _P(c_uint64))
_merge = {"float32": declare("gradsync_weighted_merge_f32", c_int, *_MERGE_ARGS),
          "float64": declare("gradsync_weighted_merge_f64", c_int, *_MERGE_ARGS)}

MergeResult = namedtuple("MergeResult", "gradient loss count")


def _unsigned(value, bits, name):
    """A Python int as an unsigned `bits`-bit value; ctypes would silently wrap a negative one."""
    value = int(value)
    if not 0 <= value < (1 << bits):
        raise OverflowError(f"{name} {value} outside [0, 2**{bits})")
    return value


def partition(n, parts, index):
    """(start, length) of part `index` of n elements split into `parts` contiguous parts."""
    start, length = c_uint64(), c_uint64()
    check(_partition(_unsigned(n, 64, "n"), _unsigned(parts, 32, "parts"), _unsigned(index, 32, "index"),
                     ctypes.byref(start), ctypes.byref(length)))
    return start.value, length.value


def split_round_robin(samples, workers, worker):
    """The sample indices of `worker`: worker, worker + workers, ... below samples (uint64 array)."""
    import numpy as np

    samples = _unsigned(samples, 64, "samples")
    workers, worker = _unsigned(workers, 32, "workers"), _unsigned(worker, 32, "worker")
    needed = c_size_t()
    status = _split(samples, workers, worker, None, 0, ctypes.byref(needed))
    if status != E_BUFS:
        check(status)  # an argument error; or success, for a worker with no samples
        return np.empty(0, dtype=np.uint64)
    out = np.empty(needed.value, dtype=np.uint64)
    check(_split(samples, workers, worker, c_void_p(out.ctypes.data), out.size, ctypes.byref(needed)))
    return out


def weighted_merge(grads, counts, losses=None, out=None):
    """Merge per-worker gradients weighted by their sample counts.

    grads: a list of 1-D float32 or float64 arrays (one per worker, all of one dtype), or a 2-D
    array (one row per worker); none is copied. counts: per-worker sample counts. losses:
    per-worker losses or None. out: array of the gradients' dtype for the result (may be one of
    grads), allocated when None. float32 is summed in double and rounded once; float64 as if in
    twice double precision, within a relative 1e-12 of the exact weighted mean (see
    gradsync_weighted_merge_f64).
    Returns MergeResult(gradient, loss, count): loss is None without losses. Raises GradsyncError
    E_ZERO_WEIGHT when every count is 0, E_MISMATCH when lengths differ.
    """
    import numpy as np

    rows = list(grads) if not isinstance(grads, np.ndarray) or grads.ndim != 1 else [grads]
    workers = len(rows)
    dtype = rows[0].dtype if workers and isinstance(rows[0], np.ndarray) else np.dtype(np.float32)
    if dtype.name not in _merge:
        raise TypeError(f"gradients must be float32 or float64 numpy arrays, got {dtype}")
    for i, g in enumerate(rows):
        if not isinstance(g, np.ndarray) or g.dtype != dtype:
            raise TypeError(f"gradient {i} must be a {dtype} numpy array, as gradient 0 is")
        if not g.flags.c_contiguous:
            raise ValueError(f"gradient {i} must be C-contiguous")
    if len(counts) != workers:
        raise ValueError(f"{workers} gradients but {len(counts)} counts")
    if losses is not None and len(losses) != workers:
        raise ValueError(f"{workers} gradients but {len(losses)} losses")
    length = rows[0].size if workers else 0
    if out is None:
        out = np.empty(length, dtype=dtype)
    elif not isinstance(out, np.ndarray) or out.dtype != dtype or not out.flags.c_contiguous \
            or not out.flags.writeable:
        raise TypeError(f"out must be a writable C-contiguous {dtype} numpy array")
    ptrs = (c_void_p * max(workers, 1))(*[g.ctypes.data for g in rows])
    lens = (c_size_t * max(workers, 1))(*[g.size for g in rows])
    count_arr = (c_uint64 * max(workers, 1))(*[_unsigned(c, 64, "count") for c in counts])
    loss_arr = (ctypes.c_double * workers)(*losses) if losses is not None else None
    mean_loss, total = ctypes.c_double(), c_uint64()
    check(_merge[dtype.name](ptrs, lens, count_arr, loss_arr, workers, c_void_p(out.ctypes.data), out.size,
                 ctypes.byref(mean_loss) if losses is not None else None, ctypes.byref(total)))
    return MergeResult(out, mean_loss.value if losses is not None else None, total.value)
