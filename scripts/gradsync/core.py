# SPDX-License-Identifier: Apache-2.0
"""Version, feature queries and logging."""
import ctypes
import logging

from ._lib import c_int, c_int32, c_void_p, check, declare, lib

LOG_TRACE, LOG_DEBUG, LOG_INFO, LOG_WARN, LOG_ERROR, LOG_CRITICAL, LOG_OFF = range(7)
FEATURE_THREAD_TRANSPORT = 1
FEATURE_SHM_TRANSPORT = 2
FEATURE_MPI_TRANSPORT = 3
FEATURE_F16C = 4

LOG_FN = ctypes.CFUNCTYPE(None, c_void_p, c_int32, ctypes.c_char_p)
declare("gradsync_set_log_callback", c_int, LOG_FN, c_void_p, c_int32)
declare("gradsync_set_log_level", c_int, c_int32)
declare("gradsync_get_log_level", c_int32)

# ctypes does not keep a callback object alive: if it were collected while the library still
# held it, the next log line would call freed memory. This keeps the current one.
_current_callback = None


# The names users write, as GRADSYNC_LOG_LEVEL takes them (src/common/log.cpp).
LOG_LEVELS = {"trace": LOG_TRACE, "debug": LOG_DEBUG, "info": LOG_INFO, "warn": LOG_WARN, "warning": LOG_WARN,
              "error": LOG_ERROR, "critical": LOG_CRITICAL, "off": LOG_OFF}
FEATURES = {"threads": FEATURE_THREAD_TRANSPORT, "thread": FEATURE_THREAD_TRANSPORT, "shm": FEATURE_SHM_TRANSPORT,
            "mpi": FEATURE_MPI_TRANSPORT, "f16c": FEATURE_F16C}


def _named(value, names, what):
    """A code given by name (any case) or as an int; anything else is a ValueError or TypeError."""
    if isinstance(value, str):
        try:
            return names[value.lower()]
        except KeyError:
            raise ValueError(f"unknown {what} {value!r}; expected one of {sorted(names)}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be a name or an int, got {type(value).__name__}")
    return int(value)


def version():
    """The library's version, "major.minor.patch"."""
    return lib.gradsync_version_string().decode()


def abi_version():
    """The library's ABI version (its soname's number)."""
    return lib.gradsync_abi_version()


def has_feature(feature):
    """Whether this build and host can use `feature`: "threads", "shm", "mpi" (its plugin and the
    MPI runtime load; asking loads them) or "f16c", or a FEATURE_* code. Unknown codes are False."""
    return bool(lib.gradsync_has_feature(_named(feature, FEATURES, "feature")))


def set_log_level(level):
    """Log lines at `level` and above: "trace", "debug", "info", "warn", "error", "critical",
    "off", or a LOG_* code. An unknown name or code raises (ValueError, GradsyncError)."""
    check(lib.gradsync_set_log_level(_named(level, LOG_LEVELS, "log level")))


def get_log_level():
    """The current level, a LOG_* code."""
    return lib.gradsync_get_log_level()


def set_log_callback(fn, min_level=LOG_WARN):
    """Route the library's log lines at min_level and above (a name or a LOG_* code, as
    set_log_level takes) to fn(level, message); fn=None restores stderr.

    fn may be called from the library's internal threads, and must not call gradsync.
    """
    global _current_callback
    min_level = _named(min_level, LOG_LEVELS, "log level")
    if fn is None:
        check(lib.gradsync_set_log_callback(LOG_FN(), None, min_level))
        _current_callback = None
        return

    def trampoline(_user, level, message):
        try:
            fn(level, message.decode(errors="replace"))
        except Exception:  # an exception must never unwind into C
            pass

    callback = LOG_FN(trampoline)
    check(lib.gradsync_set_log_callback(callback, None, min_level))
    _current_callback = callback


def route_to_python_logging(logger_name="gradsync", min_level=LOG_WARN):
    """Send the library's log lines (min_level and above: a name or a LOG_* code) to Python's
    `logging` module, under `logger_name`."""
    logger = logging.getLogger(logger_name)
    levels = [logging.DEBUG, logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL]
    set_log_callback(lambda level, msg: logger.log(levels[min(level, 5)], msg), min_level)
