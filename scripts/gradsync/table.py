# SPDX-License-Identifier: Apache-2.0
"""Memory-mapped tables and the sparse gradient accumulator.

    import numpy as np, gradsync as gs
    emb = gs.Table.create_or_open("emb.gst", rows=1000, dim=64, init="uniform", seed=1)
    grads = gs.Accumulator.anonymous(rows=1000, dim=64)   # or a file shared by processes
    grads.add_batch(np.array([3, 7, 3]), np.ones((3, 64), np.float32))   # repeats are summed
    grads.apply(emb, "sgd", lr=0.1)      # only touched rows: O(touched x dim), then zeroed
    emb.flush()                          # durable on return
    emb.view                             # read-only numpy (rows, dim) view of the mapping, no copy

Arrays go in and out without copies: float32 / int64, C-contiguous numpy arrays are passed by
pointer (other dtypes are refused rather than silently copied). Every call releases the GIL, so
threads add in parallel. Views stay valid while the table or any view of it is alive.
"""
import ctypes

import numpy as np

from ._lib import (E_BUFS, E_INVALID_ARG, GradsyncError, Handle, c_int, c_int32, c_int64, c_size_t, c_uint32,
                   c_uint64, c_void_p, check, declare, lib, numpy_array)

c_double = ctypes.c_double

__all__ = ["Table", "Accumulator", "STRIPED", "LOCK_FREE", "NONE"]

_P = ctypes.POINTER
_MODES = {"create": 1, "open": 2, "create_or_open": 3, "anonymous": 4}
_INITS = {"zeros": 0, "uniform": 1}
STRIPED, LOCK_FREE, NONE, OWNER = 0, 1, 2, 3
_CONCURRENCY = {"striped": STRIPED, "lock_free": LOCK_FREE, "lock-free": LOCK_FREE, "none": NONE, "owner": OWNER}
_OPTIMIZERS = {"sgd": 0, "adagrad": 1, "row_adagrad": 1, "adam": 2}
_UNSET_I32 = -(1 << 31)
_UNSET_I64 = -(1 << 63)


class _TableOptions(ctypes.Structure):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("mode", c_int32), ("read_only", c_int32),
                ("rows", c_int64), ("dim", c_int64), ("dtype", c_int32), ("init", c_int32), ("seed", c_uint64),
                ("lo", c_double), ("hi", c_double), ("file_mode", c_int32), ("allow_other_owner", c_int32)]


class _AccumOptions(ctypes.Structure):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("mode", c_int32), ("concurrency", c_int32),
                ("rows", c_int64), ("dim", c_int64), ("rows_per_lock", c_int64), ("threads", c_int64),
                ("file_mode", c_int32), ("allow_other_owner", c_int32)]


class _Optimizer(ctypes.Structure):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("kind", c_int32), ("reserved0", c_int32),
                ("lr", c_double), ("eps", c_double), ("beta1", c_double), ("beta2", c_double)]


_fp = c_void_p  # float* / int64* as raw addresses of numpy buffers
declare("gradsync_table_options_init", c_int, _P(_TableOptions), c_size_t)
declare("gradsync_table_open", c_int, _P(c_void_p), ctypes.c_char_p, _P(_TableOptions))
_table_free = declare("gradsync_table_free", None, c_void_p)
declare("gradsync_table_shape", c_int, c_void_p, _P(c_int64), _P(c_int64))
declare("gradsync_table_created", c_int, c_void_p, _P(c_int32))
declare("gradsync_table_get", c_int, c_void_p, c_int64, _fp, c_size_t)
declare("gradsync_table_set", c_int, c_void_p, c_int64, _fp, c_size_t)
declare("gradsync_table_gather", c_int, c_void_p, _fp, c_size_t, _fp, c_size_t)
declare("gradsync_table_scatter", c_int, c_void_p, _fp, c_size_t, _fp, c_size_t)
declare("gradsync_table_fill_zero", c_int, c_void_p)
declare("gradsync_table_fill_uniform", c_int, c_void_p, c_uint64, ctypes.c_float, ctypes.c_float)
declare("gradsync_table_flush", c_int, c_void_p)
declare("gradsync_table_prefetch", c_int, c_void_p, _fp, c_size_t)
declare("gradsync_table_view", c_int, c_void_p, _P(c_void_p), _P(c_size_t))
declare("gradsync_accum_options_init", c_int, _P(_AccumOptions), c_size_t)
declare("gradsync_optimizer_init", c_int, _P(_Optimizer), c_size_t)
declare("gradsync_accum_open", c_int, _P(c_void_p), ctypes.c_char_p, _P(_AccumOptions))
_accum_free = declare("gradsync_accum_free", None, c_void_p)
declare("gradsync_accum_shape", c_int, c_void_p, _P(c_int64), _P(c_int64))
declare("gradsync_accum_get_concurrency", c_int, c_void_p, _P(c_int32), _P(c_int64))
declare("gradsync_accum_add", c_int, c_void_p, c_int64, _fp, c_size_t)
declare("gradsync_accum_add_batch", c_int, c_void_p, _fp, c_size_t, _fp, c_size_t)
declare("gradsync_accum_get", c_int, c_void_p, c_int64, _fp, c_size_t)
declare("gradsync_accum_zero", c_int, c_void_p)
declare("gradsync_accum_touched_count", c_int, c_void_p, _P(c_int64))
declare("gradsync_accum_touched", c_int, c_void_p, _fp, c_size_t, _P(c_size_t))
declare("gradsync_accum_apply", c_int, c_void_p, c_void_p, _P(_Optimizer), c_void_p)
declare("gradsync_accum_flush", c_int, c_void_p)
declare("gradsync_accum_view", c_int, c_void_p, _P(c_void_p), _P(c_size_t))


def _f32(x, name, writable=False):
    """A float32 C-contiguous array of x, without copying numpy input (wrong dtypes are refused)."""
    if isinstance(x, np.ndarray):
        return numpy_array(x, name, (np.float32,), writable)
    if writable:
        raise TypeError(f"{name} must be a writable float32 numpy array")
    return np.ascontiguousarray(x, dtype=np.float32)


def _ids(rows):
    """Row ids as a C-contiguous int64 array (ids are small; other integer types are converted)."""
    arr = np.ascontiguousarray(rows, dtype=np.int64)
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    return arr


def _addr(arr):
    return arr.ctypes.data if arr.size else None


class _Count(int):
    """An int that calling returns: Accumulator.touched_count, a method that was a property."""

    def __call__(self):
        return int(self)


class _Owner:
    """Owns the C handle; numpy views hold it too, so the mapping outlives close() while they live."""

    def __init__(self, ptr, free):
        self.ptr = ptr
        self._free = free

    def __del__(self):
        if self.ptr:
            self._free(self.ptr)
            self.ptr = None


class _ViewSource:
    def __init__(self, owner, address, shape):
        self._owner = owner
        self.__array_interface__ = {"shape": shape, "typestr": "<f4", "data": (address, True), "version": 3}


class _Mapped(Handle):
    """Shared by Table and Accumulator: the handle, its shape and a read-only numpy view."""

    _view_fn = None

    def __init__(self, ptr, free):
        super().__init__(ptr)
        self._owner = _Owner(ptr, free)
        rows, dim = c_int64(), c_int64()
        check(self._shape_fn(ptr, ctypes.byref(rows), ctypes.byref(dim)))
        self.rows, self.dim = rows.value, dim.value

    def close(self):
        """Release the handle; the mapping itself goes when the last numpy view of it does."""
        self._ptr = None
        self._owner = None

    @property
    def shape(self):
        return (self.rows, self.dim)

    @property
    def view(self):
        """Read-only numpy (rows, dim) float32 array over the mapping itself (no copy)."""
        data, nbytes = c_void_p(), c_size_t()
        check(type(self)._view_fn(self.ptr, ctypes.byref(data), ctypes.byref(nbytes)))
        return np.asarray(_ViewSource(self._owner, data.value, (self.rows, self.dim)))

    def _row_out(self, out):
        if out is None:
            return np.empty(self.dim, dtype=np.float32)
        return _f32(out, "out", writable=True)

    def __repr__(self):
        return f"{type(self).__name__}({self.rows} x {self.dim}{'' if self._ptr else ', closed'})"


class Table(_Mapped):
    """A rows x dim float32 table in a memory-mapped file (or anonymous memory).

    mode: "create" (fails if the file exists), "open", "create_or_open" (default), "anonymous".
    Opening an existing file with another rows/dim raises GradsyncError(E_MISMATCH), naming both.
    init ("zeros" or "uniform" in [lo, hi] from seed) applies only when the table is created.
    """

    _shape_fn = staticmethod(lib.gradsync_table_shape)
    _view_fn = staticmethod(lib.gradsync_table_view)

    def __init__(self, path=None, rows=None, dim=None, mode="create_or_open", read_only=False, init="zeros",
                 seed=0, lo=-0.5, hi=0.5, file_mode=0, allow_other_owner=False):
        if mode not in _MODES:
            raise GradsyncError(E_INVALID_ARG, f"unknown mode {mode!r}; one of {sorted(_MODES)}")
        if init not in _INITS:
            raise GradsyncError(E_INVALID_ARG, f"unknown init {init!r}; one of {sorted(_INITS)}")
        opts = _TableOptions()
        check(lib.gradsync_table_options_init(ctypes.byref(opts), ctypes.sizeof(opts)))
        opts.mode = _MODES[mode]
        opts.read_only = 1 if read_only else 0
        opts.rows = _UNSET_I64 if rows is None else int(rows)
        opts.dim = _UNSET_I64 if dim is None else int(dim)
        opts.init = _INITS[init]
        opts.seed = int(seed) & ((1 << 64) - 1)
        opts.lo, opts.hi = float(lo), float(hi)
        opts.file_mode = int(file_mode)
        opts.allow_other_owner = 1 if allow_other_owner else 0
        out = c_void_p()
        encoded = None if path is None else str(path).encode()
        check(lib.gradsync_table_open(ctypes.byref(out), encoded, ctypes.byref(opts)))
        super().__init__(out.value, _table_free)
        self.path = None if path is None else str(path)
        created = c_int32()
        check(lib.gradsync_table_created(out.value, ctypes.byref(created)))
        self.created = bool(created.value)

    @classmethod
    def create(cls, path, rows, dim, **kw):
        """Create a new table file of rows x dim float32 at path (GradsyncError E_IO if the path exists);
        see Table() for the options."""
        return cls(path, rows, dim, mode="create", **kw)

    @classmethod
    def open(cls, path, rows=None, dim=None, read_only=False):
        """Open an existing table file; rows and dim, when given, must match the file's (E_MISMATCH
        otherwise)."""
        return cls(path, rows, dim, mode="open", read_only=read_only)

    @classmethod
    def create_or_open(cls, path, rows, dim, **kw):
        """Open the table at path, or create it when absent (every process racing here gets the same file)."""
        return cls(path, rows, dim, mode="create_or_open", **kw)

    @classmethod
    def anonymous(cls, rows, dim, **kw):
        """A table in private memory, backed by no file (for tests and one-process use)."""
        return cls(None, rows, dim, mode="anonymous", **kw)

    def get(self, row, out=None):
        """Row `row` as a float32 array of dim values (written into out when given)."""
        out = self._row_out(out)
        check(lib.gradsync_table_get(self.ptr, int(row), _addr(out), out.size))
        return out

    def set(self, row, values):
        """Overwrite row `row` with dim float32 values."""
        values = _f32(values, "values")
        check(lib.gradsync_table_set(self.ptr, int(row), _addr(values), values.size))

    def gather(self, rows, out=None):
        """Rows `rows` (any order, repeats allowed) as an (n, dim) float32 array (into out when given)."""
        ids = _ids(rows)
        if out is None:
            out = np.empty((ids.size, self.dim), dtype=np.float32)
        out = _f32(out, "out", writable=True)
        check(lib.gradsync_table_gather(self.ptr, _addr(ids), ids.size, _addr(out), out.size))
        return out

    def scatter(self, rows, values):
        """Write values[i] to row rows[i]; values is (n, dim) float32. With repeated rows the last write wins."""
        ids = _ids(rows)
        values = _f32(values, "values")
        check(lib.gradsync_table_scatter(self.ptr, _addr(ids), ids.size, _addr(values), values.size))

    def fill_zero(self):
        """Set every value to 0."""
        check(lib.gradsync_table_fill_zero(self.ptr))

    def fill_uniform(self, seed, lo=-0.5, hi=0.5):
        """Fill with uniform values in [lo, hi], a fixed function of (seed, element): the same seed gives the same table bit for bit."""
        check(lib.gradsync_table_fill_uniform(self.ptr, int(seed) & ((1 << 64) - 1), float(lo), float(hi)))

    def flush(self):
        """Durable on return (msync + fsync, then the next header slot)."""
        check(lib.gradsync_table_flush(self.ptr))

    def prefetch(self, rows):
        """Hint that `rows` are about to be used (the kernel reads their pages ahead); ids are checked, no data changes."""
        ids = _ids(rows)
        check(lib.gradsync_table_prefetch(self.ptr, _addr(ids), ids.size))


class Accumulator(_Mapped):
    """A gradient table plus the set of rows touched since the last apply/zero.

    concurrency: "striped" (default; exact, process-shared locks), "lock_free" (exact, atomic
    float adds), "none" (Hogwild: racy by design) or "owner" (exact and deterministic: rows
    partitioned over `threads` owner threads that apply each batch, see accumulator.h). add/add_batch/get may be called from many
    threads (and processes on one file) at once.
    """

    _shape_fn = staticmethod(lib.gradsync_accum_shape)
    _view_fn = staticmethod(lib.gradsync_accum_view)

    def __init__(self, path=None, rows=None, dim=None, mode="create_or_open", concurrency=None,
                 rows_per_lock=None, threads=None, file_mode=0, allow_other_owner=False):
        if mode not in _MODES:
            raise GradsyncError(E_INVALID_ARG, f"unknown mode {mode!r}; one of {sorted(_MODES)}")
        if concurrency is not None and concurrency not in _CONCURRENCY and concurrency not in (0, 1, 2, 3):
            raise GradsyncError(E_INVALID_ARG, f"unknown concurrency {concurrency!r}; one of {sorted(_CONCURRENCY)}")
        opts = _AccumOptions()
        check(lib.gradsync_accum_options_init(ctypes.byref(opts), ctypes.sizeof(opts)))
        opts.mode = _MODES[mode]
        if concurrency is not None:
            opts.concurrency = _CONCURRENCY.get(concurrency, concurrency)
        opts.rows = _UNSET_I64 if rows is None else int(rows)
        opts.dim = _UNSET_I64 if dim is None else int(dim)
        opts.rows_per_lock = _UNSET_I64 if rows_per_lock is None else int(rows_per_lock)
        opts.threads = _UNSET_I64 if threads is None else int(threads)
        opts.file_mode = int(file_mode)
        opts.allow_other_owner = 1 if allow_other_owner else 0
        out = c_void_p()
        encoded = None if path is None else str(path).encode()
        check(lib.gradsync_accum_open(ctypes.byref(out), encoded, ctypes.byref(opts)))
        super().__init__(out.value, _accum_free)
        self.path = None if path is None else str(path)

    @classmethod
    def create(cls, path, rows, dim, **kw):
        """Create a new accumulator file of rows x dim float32 at path; see Accumulator() for the options."""
        return cls(path, rows, dim, mode="create", **kw)

    @classmethod
    def open(cls, path, rows=None, dim=None, **kw):
        """Open an existing accumulator file; rows and dim, when given, must match the file's."""
        return cls(path, rows, dim, mode="open", **kw)

    @classmethod
    def create_or_open(cls, path, rows, dim, **kw):
        """Open the accumulator at path, or create it when absent."""
        return cls(path, rows, dim, mode="create_or_open", **kw)

    @classmethod
    def anonymous(cls, rows, dim, **kw):
        """An accumulator in private memory, backed by no file (threads of one process share it)."""
        return cls(None, rows, dim, mode="anonymous", **kw)

    @property
    def concurrency(self):
        """How concurrent adds are made safe: 'striped', 'lock_free', 'none' or 'owner'."""
        mode, rpl = c_int32(), c_int64()
        check(lib.gradsync_accum_get_concurrency(self.ptr, ctypes.byref(mode), ctypes.byref(rpl)))
        return {STRIPED: "striped", LOCK_FREE: "lock_free", NONE: "none", OWNER: "owner"}[mode.value]

    @property
    def rows_per_lock(self):
        """Rows guarded by one stripe lock (in 'striped' mode)."""
        rpl = c_int64()
        check(lib.gradsync_accum_get_concurrency(self.ptr, None, ctypes.byref(rpl)))
        return rpl.value

    def add(self, row, grad):
        """Add grad (dim float32 values) to row `row` and mark it touched."""
        grad = _f32(grad, "grad")
        check(lib.gradsync_accum_add(self.ptr, int(row), _addr(grad), grad.size))

    def add_batch(self, rows, grads):
        """grads[i] is added to row rows[i]; grads is (n, dim) float32. Repeated rows are summed."""
        ids = _ids(rows)
        grads = _f32(grads, "grads")
        check(lib.gradsync_accum_add_batch(self.ptr, _addr(ids), ids.size, _addr(grads), grads.size))

    def get(self, row, out=None):
        """Row `row`'s accumulated gradient as a float32 array of dim values (into out when given)."""
        out = self._row_out(out)
        check(lib.gradsync_accum_get(self.ptr, int(row), _addr(out), out.size))
        return out

    def zero(self):
        """Zero the touched rows and clear the touched set."""
        check(lib.gradsync_accum_zero(self.ptr))

    @property
    def touched_count(self):
        """touched_count(): how many rows are touched now. A method, as touched() is (both ask the
        accumulator, whose rows other threads and processes touch meanwhile); read as an attribute
        (`a.touched_count`, the older form) it gives the same number."""
        n = c_int64()
        check(lib.gradsync_accum_touched_count(self.ptr, ctypes.byref(n)))
        return _Count(n.value)

    def touched(self):
        """The touched rows (int64), in the order they were first touched."""
        needed = c_size_t()
        while True:
            n = int(self.touched_count)
            out = np.empty(n, dtype=np.int64)
            status = lib.gradsync_accum_touched(self.ptr, _addr(out), n, ctypes.byref(needed))
            if status == 0:
                return out[:needed.value]
            if status != E_BUFS:  # E_BUFS: rows were added meanwhile; ask again
                check(status)

    def apply(self, params, optimizer="sgd", lr=0.01, state=None, eps=None, betas=(0.9, 0.999)):
        """Update only the touched rows of `params`, then zero them.

        optimizer "sgd": p -= lr * g. "adagrad" (row-wise, as PyTorch-BigGraph): state is a
        (rows x 1) Table, s += mean(g^2); p -= lr * g / (sqrt(s) + eps), eps 1e-10 by default.
        "adam": sparse Adam as torch.optim.SparseAdam on the touched rows, each row with its own
        update count (accumulator.h): state is a (rows x (2 * dim + 1)) Table of zeros at first
        (m, v, the count), eps 1e-8 and betas as torch's by default.
        """
        if optimizer not in _OPTIMIZERS:
            raise GradsyncError(E_INVALID_ARG, f"unknown optimizer {optimizer!r}; one of {sorted(_OPTIMIZERS)}")
        opt = _Optimizer()
        check(lib.gradsync_optimizer_init(ctypes.byref(opt), ctypes.sizeof(opt)))
        opt.kind = _OPTIMIZERS[optimizer]
        opt.lr = float(lr)
        opt.eps = 0.0 if eps is None else float(eps)  # 0: the optimizer's default
        opt.beta1, opt.beta2 = (float(b) for b in betas)
        check(lib.gradsync_accum_apply(self.ptr, params.ptr, ctypes.byref(opt),
                                       None if state is None else state.ptr))

    def flush(self):
        """Make the accumulator durable on return (msync + fsync)."""
        check(lib.gradsync_accum_flush(self.ptr))
