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


def version():
    return lib.gradsync_version_string().decode()


def abi_version():
    return lib.gradsync_abi_version()


def has_feature(feature):
    return bool(lib.gradsync_has_feature(feature))


def set_log_level(level):
    check(lib.gradsync_set_log_level(level))


def get_log_level():
    return lib.gradsync_get_log_level()


def set_log_callback(fn, min_level=LOG_WARN):
    """Route the library's log lines to fn(level, message); fn=None restores stderr.

    fn may be called from the library's internal threads, and must not call gradsync.
    """
    global _current_callback
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
    """Send the library's log lines to Python's `logging` module."""
    logger = logging.getLogger(logger_name)
    levels = [logging.DEBUG, logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL]
    set_log_callback(lambda level, msg: logger.log(levels[min(level, 5)], msg), min_level)
