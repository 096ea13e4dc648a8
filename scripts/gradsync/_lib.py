# SPDX-License-Identifier: Apache-2.0
"""Loading libgradsync and declaring its C functions for ctypes.

The library is found, in order, at the path in GRADSYNC_LIBRARY, in the build tree beside this
package (build/libgradsync.so.<ABI>), and by its SONAME through the dynamic loader. Every function
is declared with explicit argtypes and restype; each component module calls `declare` for its own.
"""
import ctypes
import os
import pathlib

ABI_VERSION = 0
SONAME = f"libgradsync.so.{ABI_VERSION}"

c_int = ctypes.c_int
c_int32 = ctypes.c_int32
c_int64 = ctypes.c_int64
c_uint32 = ctypes.c_uint32
c_uint64 = ctypes.c_uint64
c_size_t = ctypes.c_size_t
c_void_p = ctypes.c_void_p
c_char_p = ctypes.c_char_p
c_float_p = ctypes.POINTER(ctypes.c_float)

# Status codes, as pinned in include/gradsync/errors.h.
OK = 0
E_INVALID_ARG = -1
E_MISUSE = -2
E_NOMEM = -3
E_IO = -4
E_CORRUPT = -5
E_VERSION_MISMATCH = -6
E_MISMATCH = -7
E_TIMEOUT = -8
E_REMOTE = -9
E_IN_PROGRESS = -10
E_ABORTED = -11
E_UNSUPPORTED = -12
E_BUFS = -13
E_OUT_OF_RANGE = -14
E_ZERO_WEIGHT = -15
E_NO_SPACE = -16
E_NOT_OWNER = -17
E_PERMISSION = -18
E_LOST = -19
E_INTERNAL = -100


def _candidates():
    env = os.environ.get("GRADSYNC_LIBRARY")
    if env:
        yield env
        return
    here = pathlib.Path(__file__).resolve().parent
    # A wheel carries the library inside the package.
    if (here / SONAME).exists():
        yield str(here / SONAME)
    # cmake --install (and the .deb) puts the package in <prefix>/lib/python3/dist-packages/gradsync,
    # the library in <prefix>/lib or <prefix>/lib/<multiarch>.
    if len(here.parents) >= 4 and [p.name for p in list(here.parents)[:3]] == ["dist-packages", "python3", "lib"]:
        prefix = here.parents[3]
        for path in sorted(prefix.glob("lib*/" + SONAME)) + sorted(prefix.glob("lib/*/" + SONAME)):
            yield str(path)
    root = here.parents[1]
    for build in ("build", "build-release"):
        path = root / build / SONAME
        if path.exists():
            yield str(path)
    yield SONAME


def _load():
    errors = []
    for candidate in _candidates():
        try:
            return ctypes.CDLL(candidate)
        except OSError as exc:
            errors.append(f"{candidate}: {exc}")
    raise ImportError("libgradsync not found; build it (scripts/test.sh) or set GRADSYNC_LIBRARY.\n  "
                      + "\n  ".join(errors))


lib = _load()


def declare(name, restype, *argtypes):
    """Declare one C function's signature; returns the ctypes function."""
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


declare("gradsync_abi_version", c_int32)
declare("gradsync_version_string", c_char_p)
declare("gradsync_version_number", c_uint32)
declare("gradsync_status_string", c_char_p, c_int)
declare("gradsync_last_error_message", c_char_p)
declare("gradsync_last_error_status", c_int)
declare("gradsync_last_error_clear", None)
declare("gradsync_dtype_size", c_size_t, c_int32)
declare("gradsync_has_feature", c_int32, c_int32)

_abi = lib.gradsync_abi_version()
if _abi != ABI_VERSION:
    raise ImportError(f"libgradsync ABI version {_abi} at {lib._name} does not match these bindings' {ABI_VERSION}")


class GradsyncError(Exception):
    """A gradsync call failed. `status` is the code; `message` says exactly what was wrong."""

    def __init__(self, status, message):
        self.status = status
        self.message = message
        name = lib.gradsync_status_string(status).decode().split(":")[0]
        super().__init__(f"{name} ({status}): {message}")


def check(status):
    """Raise GradsyncError for a non-zero status, with this thread's last error message."""
    if status != OK:
        raise GradsyncError(status, lib.gradsync_last_error_message().decode(errors="replace"))
    return status


def buffer_pointer(array, dtype=None, writable=True, name="buffer"):
    """(pointer, element count) of a C-contiguous numpy array or writable buffer, without copying.

    `dtype` is a numpy dtype the array must already have; no conversion is made, since a silent
    copy would make in-place results vanish.
    """
    import numpy as np

    arr = array if isinstance(array, np.ndarray) else np.frombuffer(array, dtype=dtype or np.float32)
    if dtype is not None and arr.dtype != np.dtype(dtype):
        raise TypeError(f"{name} has dtype {arr.dtype}, expected {np.dtype(dtype)}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{name} must be writable")
    return ctypes.c_void_p(arr.ctypes.data), arr.size


def numpy_array(a, name, dtypes, writable=True):
    """The numpy array `a` itself, checked: one of `dtypes`, C-contiguous, and writable when asked.

    Never a copy: a silent copy would make in-place results vanish.
    """
    import numpy as np

    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(a).__name__}")
    allowed = [np.dtype(d) for d in dtypes]
    if a.dtype not in allowed:
        raise TypeError(f"{name} has dtype {a.dtype}; expected {' or '.join(str(d) for d in allowed)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if writable and not a.flags.writeable:
        raise ValueError(f"{name} must be writable")
    return a


def address(a):
    """The address of a numpy array's data, for a void* argument."""
    return ctypes.c_void_p(a.ctypes.data)


class Handle:
    """Base of the handle classes: owns one C handle, freed by close(), `with` or garbage collection."""

    _free = None  # set by subclasses to the C free function

    def __init__(self, ptr):
        self._ptr = ptr

    @property
    def ptr(self):
        """The C handle; raises GradsyncError E_MISUSE once the object is closed."""
        if not self._ptr:
            raise GradsyncError(E_MISUSE, f"{type(self).__name__} is closed")
        return self._ptr

    def close(self):
        """Free the C handle now (idempotent); later calls on the object raise E_MISUSE."""
        if self._ptr:
            ptr, self._ptr = self._ptr, None
            type(self)._free(ptr)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
