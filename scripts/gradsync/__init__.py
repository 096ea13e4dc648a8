"""Python bindings of libgradsync through ctypes: no compiler needed, numpy arrays passed without copying.

    import gradsync as gs
    print(gs.version())
"""
from ._lib import ABI_VERSION, GradsyncError, check, lib  # noqa: F401
from ._lib import (E_ABORTED, E_BUFS, E_CORRUPT, E_INTERNAL, E_INVALID_ARG, E_IO, E_MISMATCH,  # noqa: F401
                   E_MISUSE, E_NO_SPACE, E_NOMEM, E_NOT_OWNER, E_OUT_OF_RANGE, E_PERMISSION, E_REMOTE, E_TIMEOUT,
                   E_UNSUPPORTED, E_VERSION_MISMATCH, E_ZERO_WEIGHT, OK)
from .core import *  # noqa: F401,F403
# component modules
from .table import *  # noqa: F401,F403
from .atomics import *  # noqa: F401,F403
from .dataparallel import *  # noqa: F401,F403
from .codec import *  # noqa: F401,F403
from .shard import *  # noqa: F401,F403
from .comm import *  # noqa: F401,F403
