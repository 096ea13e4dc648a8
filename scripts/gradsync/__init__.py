# SPDX-License-Identifier: Apache-2.0
"""Python bindings of libgradsync through ctypes: no compiler needed, numpy arrays passed without copying.

    import gradsync as gs
    print(gs.version())
"""
from ._lib import ABI_VERSION, GradsyncError, check, lib  # noqa: F401
from . import _lib as _codes

# Every status code of errors.h (mirrored in _lib.py; tests/python/test_mirrors.py holds them equal).
globals().update({name: getattr(_codes, name) for name in dir(_codes) if name == "OK" or name.startswith("E_")})
from .core import *  # noqa: F401,F403
# component modules
from .table import *  # noqa: F401,F403
from .atomics import *  # noqa: F401,F403
from .dataparallel import *  # noqa: F401,F403
from .codec import *  # noqa: F401,F403
from .shard import *  # noqa: F401,F403
from .comm import *  # noqa: F401,F403
from .embedding import *  # noqa: F401,F403
