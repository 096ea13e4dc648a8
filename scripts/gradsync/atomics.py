# SPDX-License-Identifier: Apache-2.0
"""Atomics for asynchronous (Hogwild) training: Counter, Flag, Mutex and atomic_add.

    import numpy as np, gradsync as gs
    steps = gs.Counter(0)                 # 64-bit; gs.Counter(0, bits=32) for 32-bit
    old, new = steps.fetch_add(1)
    stop = gs.Flag()                      # sticky: stop.conditional_set(loss_is_nan)
    with gs.Mutex() as m: ...             # see Mutex: `with m:` locks it
    gs.atomic_add(weights, -lr * grad)    # weights[i] += ..., each element atomic

Every call releases the GIL (ctypes does), so Python threads really run these in parallel.
Counter, Flag and Mutex are internally synchronised: share one object among threads.
"""
import ctypes

from ._lib import (E_INVALID_ARG, GradsyncError, Handle, buffer_pointer, c_int, c_int32, c_int64, c_size_t,
                   c_void_p, check, declare)

__all__ = ["Counter", "Flag", "Mutex", "atomic_add"]

_P = ctypes.POINTER
for _bits, _ctype in ((32, c_int32), (64, c_int64)):
    declare(f"gradsync_counter{_bits}_create", c_int, _P(c_void_p), _ctype)
    declare(f"gradsync_counter{_bits}_free", None, c_void_p)
    declare(f"gradsync_counter{_bits}_fetch_add", c_int, c_void_p, _ctype, _P(_ctype), _P(_ctype))
    declare(f"gradsync_counter{_bits}_load", c_int, c_void_p, _P(_ctype))
    declare(f"gradsync_counter{_bits}_store", c_int, c_void_p, _ctype)
_flag_create = declare("gradsync_flag_create", c_int, _P(c_void_p))
_flag_free = declare("gradsync_flag_free", None, c_void_p)
_flag_conditional_set = declare("gradsync_flag_conditional_set", c_int, c_void_p, c_int32, _P(c_int32))
_flag_check = declare("gradsync_flag_check", c_int, c_void_p, _P(c_int32))
_flag_reset = declare("gradsync_flag_reset", c_int, c_void_p)
_mutex_create = declare("gradsync_mutex_create", c_int, _P(c_void_p))
_mutex_free = declare("gradsync_mutex_free", None, c_void_p)
_mutex_lock = declare("gradsync_mutex_lock", c_int, c_void_p)
_mutex_try_lock = declare("gradsync_mutex_try_lock", c_int, c_void_p, _P(c_int32))
_mutex_lock_timeout = declare("gradsync_mutex_lock_timeout", c_int, c_void_p, c_int64)
_mutex_unlock = declare("gradsync_mutex_unlock", c_int, c_void_p)
_add_f32 = declare("gradsync_atomic_add_f32", c_int, c_void_p, c_void_p, c_size_t)
_add_f64 = declare("gradsync_atomic_add_f64", c_int, c_void_p, c_void_p, c_size_t)


def _fit(value, bits, name):
    """A Python int as a signed `bits`-bit value; ctypes would silently truncate it instead."""
    value = int(value)
    if not -(1 << (bits - 1)) <= value < (1 << (bits - 1)):
        raise OverflowError(f"{name} {value} does not fit in int{bits}")
    return value


class _CounterFns:
    def __init__(self, bits):
        from ._lib import lib
        self.bits = bits
        self.ctype = c_int32 if bits == 32 else c_int64
        for verb in ("create", "free", "fetch_add", "load", "store"):
            setattr(self, verb, getattr(lib, f"gradsync_counter{bits}_{verb}"))


_COUNTER_FNS = {32: _CounterFns(32), 64: _CounterFns(64)}


class Counter(Handle):
    """An atomic integer counter (Caffe2's AtomicFetchAdd). Arithmetic wraps modulo 2**bits."""

    def __init__(self, value=0, bits=64):
        if bits not in _COUNTER_FNS:
            raise ValueError(f"bits must be 32 or 64, got {bits}")
        self._fns = _COUNTER_FNS[bits]
        out = c_void_p()
        check(self._fns.create(ctypes.byref(out), _fit(value, bits, "initial value")))
        super().__init__(out.value)

    @property
    def bits(self):
        """The counter's width, 32 or 64: arithmetic wraps modulo 2**bits."""
        return self._fns.bits

    def fetch_add(self, delta=1):
        """Atomically add delta; returns (old, new)."""
        old, new = self._fns.ctype(), self._fns.ctype()
        check(self._fns.fetch_add(self.ptr, _fit(delta, self.bits, "delta"), ctypes.byref(old), ctypes.byref(new)))
        return old.value, new.value

    def load(self):
        """The current value (an atomic load)."""
        value = self._fns.ctype()
        check(self._fns.load(self.ptr, ctypes.byref(value)))
        return value.value

    def store(self, value):
        """Set the value atomically; ValueError if it does not fit in `bits` bits."""
        check(self._fns.store(self.ptr, _fit(value, self.bits, "value")))

    @property
    def value(self):
        """The current value, as load()."""
        return self.load()

    def close(self):
        """Free the counter now (idempotent)."""
        if self._ptr:
            ptr, self._ptr = self._ptr, None
            self._fns.free(ptr)

    def __repr__(self):
        return f"Counter({self.load() if self._ptr else 'closed'}, bits={self.bits})"


class Flag(Handle):
    """A sticky boolean (Caffe2's AtomicBool): created False; conditional_set(False) never clears it."""

    _free = staticmethod(_flag_free)

    def __init__(self):
        out = c_void_p()
        check(_flag_create(ctypes.byref(out)))
        super().__init__(out.value)

    def conditional_set(self, condition):
        """Set the flag if condition is true; returns whether the flag is set afterwards."""
        is_set = c_int32()
        check(_flag_conditional_set(self.ptr, 1 if condition else 0, ctypes.byref(is_set)))
        return bool(is_set.value)

    def check(self):
        """Whether the flag is set."""
        is_set = c_int32()
        check(_flag_check(self.ptr, ctypes.byref(is_set)))
        return bool(is_set.value)

    def reset(self):
        """Clear the flag (the only way to clear it)."""
        check(_flag_reset(self.ptr))

    def __bool__(self):
        return self.check()


class Mutex(Handle):
    """A mutex owned by the thread that locks it; not recursive.

    `with mutex:` locks and unlocks it (it does not close it; call close() or let it be
    collected). Unlocking from a thread that does not hold it raises GradsyncError E_NOT_OWNER;
    locking it again from the holding thread raises E_MISUSE instead of deadlocking.
    """

    _free = staticmethod(_mutex_free)

    def __init__(self):
        out = c_void_p()
        check(_mutex_create(ctypes.byref(out)))
        super().__init__(out.value)

    def lock(self, timeout=None):
        """Wait for the mutex; with timeout (seconds) raise GradsyncError E_TIMEOUT when not acquired."""
        if timeout is None:
            check(_mutex_lock(self.ptr))
        else:
            if timeout < 0:
                raise ValueError(f"timeout must be >= 0 seconds, got {timeout}")
            check(_mutex_lock_timeout(self.ptr, int(round(timeout * 1000))))

    def try_lock(self):
        """Take the mutex if free; returns whether this thread now holds it."""
        acquired = c_int32()
        check(_mutex_try_lock(self.ptr, ctypes.byref(acquired)))
        return bool(acquired.value)

    def unlock(self):
        """Release the mutex, which this thread must hold (E_MISUSE otherwise)."""
        check(_mutex_unlock(self.ptr))

    def __enter__(self):
        self.lock()
        return self

    def __exit__(self, *exc):
        self.unlock()


def atomic_add(dst, src):
    """dst += src element-wise, each element's add atomic with respect to other atomic_add calls.

    dst and src are numpy arrays of the same dtype (float32 or float64) and size; dst must be
    C-contiguous and writable and is updated in place, without copying. Safe to call from many
    threads on one shared dst (Hogwild SGD): no update is lost.
    """
    import numpy as np

    if not isinstance(dst, np.ndarray) or not isinstance(src, np.ndarray):
        raise TypeError("atomic_add takes numpy arrays")
    if dst.dtype == np.float32:
        fn = _add_f32
    elif dst.dtype == np.float64:
        fn = _add_f64
    else:
        raise TypeError(f"dst has dtype {dst.dtype}, expected float32 or float64")
    dst_ptr, n = buffer_pointer(dst, dst.dtype, writable=True, name="dst")
    src_ptr, m = buffer_pointer(src, dst.dtype, writable=False, name="src")
    if n != m:
        raise GradsyncError(E_INVALID_ARG, f"dst has {n} elements but src has {m}")
    check(fn(dst_ptr, src_ptr, n))
