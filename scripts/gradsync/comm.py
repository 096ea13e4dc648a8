# SPDX-License-Identifier: Apache-2.0
"""The communicator: a group of ranks and their collectives (allreduce, broadcast, ...).

    import threading, numpy as np, gradsync as gs

    def worker(rank):
        with gs.Communicator("train", rank, 2) as comm:     # threads of this process, by name
            grad = np.full(4, rank + 1.0, dtype=np.float32)
            comm.allreduce(grad)                            # in place, mean over ranks: 1.5 everywhere

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads: t.start()
    for t in threads: t.join()

Results are reduced in rank order, so every rank gets the same bits on every run. Ranks that
disagree (length, dtype, op, root, collective) all get GradsyncError E_MISMATCH and the next round
works; a missing rank gives E_TIMEOUT on the others; abort() from any thread wakes every waiter.
Arrays are passed without copying (C-contiguous numpy arrays of float32, float64, int32, int64 or
float16, or contiguous CPU torch tensors of those dtypes, for which the results are tensors too:
an argument returned is that tensor), and the GIL is released during every call, so Python
threads run collectives truly in parallel.

One Communicator is used by one thread at a time (each rank its own): a second thread calling it
while a call runs gets GradsyncError E_MISUSE at once, and the running call is unaffected; abort()
and the rank/size/transport properties are the exceptions. close() while another thread is in a
call aborts that call (it raises E_ABORTED) and returns once it has left the library.
"""
import collections
import ctypes
import functools
import inspect
import os
import signal
import sys
import threading
import weakref

import numpy as np

from .dataparallel import partition
from ._lib import (E_IN_PROGRESS, GradsyncError, Handle, address, c_int, c_int32, c_int64, c_size_t, c_uint32, c_uint64, c_void_p, check, declare,
                   lib, numpy_array)

__all__ = ["Communicator", "Request", "Topology", "Transport", "COLLECTIVES", "TRANSPORT_THREAD", "TRANSPORT_SHM",
           "TRANSPORT_MPI", "TRANSPORT_HIER", "OPS", "NO_TIMEOUT", "SPLIT_NONE"]

TRANSPORT_THREAD = 0
TRANSPORT_SHM = 1
TRANSPORT_MPI = 2
TRANSPORT_HIER = 3
TRANSPORTS = {"threads": TRANSPORT_THREAD, "thread": TRANSPORT_THREAD, "shm": TRANSPORT_SHM, "mpi": TRANSPORT_MPI,
              "hier": TRANSPORT_HIER}


class Transport(str):
    """A communicator's transport by name: "threads", "shm", "mpi" or "hier" (Communicator.transport).

    It also equals its TRANSPORT_* code, and int() gives the code, so code written when the
    property was an int keeps working."""

    _NAMES = {TRANSPORT_THREAD: "threads", TRANSPORT_SHM: "shm", TRANSPORT_MPI: "mpi", TRANSPORT_HIER: "hier"}

    def __new__(cls, code):
        self = super().__new__(cls, cls._NAMES.get(code, f"transport {code}"))
        self.code = code
        return self

    def __eq__(self, other):
        if isinstance(other, int) and not isinstance(other, bool):
            return self.code == other
        return str.__eq__(self, other)

    def __ne__(self, other):
        return not self == other

    __hash__ = str.__hash__

    def __int__(self):
        return self.code

    def __reduce__(self):
        return Transport, (self.code,)

OPS = {"sum": 0, "mean": 1, "min": 2, "max": 3}
# float16 (IEEE half): moved bit for bit, and reduced in f32 with one rounding.
_DTYPES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.int32): 2, np.dtype(np.int64): 3,
           np.dtype(np.float16): 5}

# Ctrl-C while the main thread waits in a collective. Python runs signal handlers only between the
# main thread's bytecodes, and the main thread is inside the library; so the library asks
# _interrupt_check now and then from the waiting thread (gradsync_comm_set_interrupt). Entering it
# lets Python run the pending handler: ours only records the interrupt while a call waits (an
# exception raised inside a C callback would be lost), the check answers "out", the library aborts
# the group (its peers get E_ABORTED; on MPI the abort is local), and the call raises
# KeyboardInterrupt as it returns. A program with its own SIGINT handler keeps it.
_main_thread = threading.main_thread()
_waiting = 0  # calls of the main thread inside the library
_interrupted = False


def _on_sigint(signum, frame):
    global _interrupted
    if _waiting:
        _interrupted = True
    else:
        signal.default_int_handler(signum, frame)


def _interrupt_check(_user):
    return 1 if _interrupted else 0


_InterruptFn = ctypes.CFUNCTYPE(c_int, c_void_p)
_interrupt_fn = _InterruptFn(_interrupt_check)


def _watch_ctrl_c():
    if threading.current_thread() is _main_thread and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)


def _blocking(fn, *args):
    """Calls a collective; a Ctrl-C that came while it waited raises KeyboardInterrupt."""
    global _waiting, _interrupted
    main = threading.current_thread() is _main_thread
    if main:
        _waiting += 1
    try:
        status = fn(*args)
    finally:
        if main:
            _waiting -= 1
    if main and _interrupted:
        _interrupted = False
        raise KeyboardInterrupt
    check(status)


NAME_MAX = 64
UNSET_I32 = -(2 ** 31)
UNSET_I64 = -(2 ** 63)
NO_TIMEOUT = 2 ** 63 - 1  # timeout_ms of a deadline that never passes (GRADSYNC_NO_TIMEOUT)


SPLIT_NONE = -1  # GRADSYNC_SPLIT_NONE


class Topology(collections.namedtuple("Topology", "host local_rank local_size num_hosts rank_hosts")):
    """Communicator.topology: this rank's host, its place and the number of ranks there, the number
    of hosts, and every rank's host (by rank). Hosts are numbered by their lowest rank."""


class CommOptions(ctypes.Structure):
    """gradsync_comm_options, field for field (include/gradsync/comm.h)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("version", c_uint32),
        ("transport", c_int32),
        ("rank", c_int32),
        ("size", c_int32),
        ("deterministic", c_int32),
        ("check_mismatch", c_int32),
        ("reserved0", c_int32),
        ("timeout_ms", c_int64),
        ("mpi_fcomm", c_int64),
        ("name", ctypes.c_char * NAME_MAX),
        ("host", ctypes.c_char * NAME_MAX),
        ("topology_independent", c_int32),
        ("reserved1", c_int32),
        ("threads", c_int32),
        ("thread", c_int32),
    ]


_P = c_void_p
_PP = ctypes.POINTER(c_void_p)
declare("gradsync_comm_options_init", c_int, ctypes.POINTER(CommOptions), c_size_t)
declare("gradsync_comm_create", c_int, ctypes.POINTER(_P), ctypes.POINTER(CommOptions))
declare("gradsync_comm_free", None, _P)
declare("gradsync_comm_abort", c_int, _P)
declare("gradsync_comm_set_interrupt", c_int, _P, _InterruptFn, _P)
declare("gradsync_comm_reset", c_int, _P)
declare("gradsync_comm_rank", c_int, _P, ctypes.POINTER(c_int32))
declare("gradsync_comm_size", c_int, _P, ctypes.POINTER(c_int32))
declare("gradsync_comm_transport", c_int, _P, ctypes.POINTER(c_int32))
declare("gradsync_comm_split", c_int, _P, c_int32, c_int32, ctypes.POINTER(_P))


class ShrinkResult(ctypes.Structure):
    """gradsync_shrink_result, field for field (include/gradsync/comm.h)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("version", c_uint32),
        ("failed_count", c_int32),
        ("attempts", c_int32),
        ("agree_ns", c_int64),
        ("form_ns", c_int64),
    ]


declare("gradsync_comm_shrink", c_int, _P, ctypes.POINTER(_P), ctypes.POINTER(c_int32), c_size_t,
        ctypes.POINTER(ShrinkResult))
declare("gradsync_comm_member_id", c_int, _P, ctypes.POINTER(c_int64))


class GrowResult(ctypes.Structure):
    """gradsync_grow_result, field for field (include/gradsync/comm.h)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("version", c_uint32),
        ("old_size", c_int32),
        ("new_size", c_int32),
        ("first_member_id", c_int64),
        ("agree_ns", c_int64),
        ("form_ns", c_int64),
    ]

    def _info(self):
        return {"old_size": self.old_size, "new_size": self.new_size, "first_member_id": self.first_member_id,
                "agree_s": self.agree_ns / 1e9, "form_s": self.form_ns / 1e9}


declare("gradsync_comm_grow", c_int, _P, ctypes.c_char_p, c_int32, ctypes.POINTER(_P), ctypes.POINTER(GrowResult))
declare("gradsync_comm_join", c_int, ctypes.POINTER(_P), ctypes.POINTER(CommOptions), ctypes.POINTER(GrowResult))
declare("gradsync_comm_topology", c_int, _P, ctypes.POINTER(c_int32), ctypes.POINTER(c_int32),
        ctypes.POINTER(c_int32), ctypes.POINTER(c_int32), ctypes.POINTER(c_int32), c_size_t)
declare("gradsync_comm_allreduce", c_int, _P, _P, _P, c_size_t, c_int32, c_int32)
declare("gradsync_comm_allreduce_many", c_int, _P, _PP, _PP, ctypes.POINTER(c_size_t), c_size_t, c_int32, c_int32)
declare("gradsync_comm_allreduce_mixed", c_int, _P, _PP, _PP, ctypes.POINTER(c_size_t), ctypes.POINTER(c_int32),
        c_size_t, c_int32)
declare("gradsync_comm_weighted_mean", c_int, _P, _P, _P, c_size_t, c_int32, c_uint64, ctypes.POINTER(c_uint64))
declare("gradsync_comm_broadcast", c_int, _P, _P, c_size_t, c_int32, c_int32)
declare("gradsync_comm_allgather", c_int, _P, _P, _P, c_size_t, c_int32)
declare("gradsync_comm_allgatherv", c_int, _P, _P, _P, ctypes.POINTER(c_size_t), c_int32)
declare("gradsync_comm_reduce_scatterv", c_int, _P, _P, _P, ctypes.POINTER(c_size_t), c_int32, c_int32)
declare("gradsync_comm_alltoall", c_int, _P, _P, _P, c_size_t, c_int32)
declare("gradsync_comm_reduce_scatter", c_int, _P, _P, _P, c_size_t, c_int32, c_int32)
declare("gradsync_comm_barrier", c_int, _P)
_PS = ctypes.POINTER(c_size_t)
_ROOTED = {
    "alltoallv": (_P, _PS, _PS, _P, _PS, _PS, c_int32),
    "reduce": (_P, _P, c_size_t, c_int32, c_int32, c_int32),
    "gather": (_P, _P, c_size_t, c_int32, c_int32),
    "gatherv": (_P, c_size_t, _P, _PS, c_int32, c_int32),
    "scatter": (_P, _P, c_size_t, c_int32, c_int32),
    "scatterv": (_P, _PS, _P, c_size_t, c_int32, c_int32),
}
declare("gradsync_comm_alloc", c_int, _P, c_size_t, ctypes.POINTER(c_void_p))
_PR = ctypes.POINTER(_P)
declare("gradsync_comm_iallreduce", c_int, _P, _P, _P, c_size_t, c_int32, c_int32, _PR)
declare("gradsync_comm_iallreduce_many", c_int, _P, _PP, _PP, ctypes.POINTER(c_size_t), c_size_t, c_int32, c_int32,
        _PR)
declare("gradsync_comm_iallreduce_mixed", c_int, _P, _PP, _PP, ctypes.POINTER(c_size_t), ctypes.POINTER(c_int32),
        c_size_t, c_int32, _PR)
declare("gradsync_comm_iweighted_mean", c_int, _P, _P, _P, c_size_t, c_int32, c_uint64, ctypes.POINTER(c_uint64),
        _PR)
declare("gradsync_comm_ibroadcast", c_int, _P, _P, c_size_t, c_int32, c_int32, _PR)
declare("gradsync_comm_iallgather", c_int, _P, _P, _P, c_size_t, c_int32, _PR)
declare("gradsync_comm_iallgatherv", c_int, _P, _P, _P, ctypes.POINTER(c_size_t), c_int32, _PR)
declare("gradsync_comm_ireduce_scatterv", c_int, _P, _P, _P, ctypes.POINTER(c_size_t), c_int32, c_int32, _PR)
declare("gradsync_comm_ialltoall", c_int, _P, _P, _P, c_size_t, c_int32, _PR)
declare("gradsync_comm_ireduce_scatter", c_int, _P, _P, _P, c_size_t, c_int32, c_int32, _PR)
declare("gradsync_comm_ibarrier", c_int, _P, _PR)
for _name, _args in _ROOTED.items():
    declare("gradsync_comm_" + _name, c_int, _P, *_args)
    declare("gradsync_comm_i" + _name, c_int, _P, *_args, _PR)
declare("gradsync_comm_get_async_error", c_int, _P, ctypes.POINTER(c_int32))
declare("gradsync_request_wait", c_int, _P, c_int64)
declare("gradsync_request_test", c_int, _P, ctypes.POINTER(c_int32))
declare("gradsync_request_free", None, _P)

# A wait of the main thread returns this often, so that a Ctrl-C raises KeyboardInterrupt promptly.
_WAIT_SLICE_MS = 100


class Request(Handle):
    """A non-blocking call in flight (Communicator.iallreduce and the others).

    wait() returns the call's result (what the blocking form returns) or raises its error; the
    arrays stay borrowed, and are kept alive by the request, until it completes. Requests of one
    communicator complete in the order they were made. close() (or `with`, or garbage collection)
    waits for a pending request first.
    """

    _free = lib.gradsync_request_free

    def __init__(self, ptr, comm, result, keep):
        super().__init__(ptr)
        self._comm = comm
        self._result = result
        self._keep = keep

    def _value(self):
        return self._result() if callable(self._result) else self._result

    def wait(self, timeout_ms=None):
        """Wait (at most timeout_ms, if given) and return the result; raises GradsyncError with
        status E_IN_PROGRESS when it is still pending after timeout_ms."""
        main = threading.current_thread() is _main_thread
        left = None if timeout_ms is None else int(timeout_ms)
        try:
            while True:
                step = _WAIT_SLICE_MS if main and (left is None or left > _WAIT_SLICE_MS) else (-1 if left is None else left)
                status = lib.gradsync_request_wait(self.ptr, step)
                if status != E_IN_PROGRESS or step == left:
                    break
                if left is not None:
                    left -= step
        except KeyboardInterrupt:
            # As for a blocking call: the group is aborted, so no rank waits out its timeout.
            self._comm.abort()
            raise
        check(status)
        return self._value()

    def test(self):
        """True once completed (raising its error if it failed), False while pending."""
        done = c_int32()
        check(lib.gradsync_request_test(self.ptr, ctypes.byref(done)))
        return bool(done.value)

    def __repr__(self):
        return f"Request({'closed' if not self._ptr else 'open'})"

declare("gradsync_comm_free_buffer", c_int, _P, _P)


def _free_buffer(comm, address):
    # Runs when the last view of an array from Communicator.empty is collected.
    if comm._ptr:
        lib.gradsync_comm_free_buffer(comm._ptr, address)


def _transport(value):
    if isinstance(value, str):
        try:
            return TRANSPORTS[value.lower()]
        except KeyError:
            raise ValueError(f"unknown transport {value!r}; expected one of {sorted(TRANSPORTS)}") from None
    return int(value)


def _op(value):
    if isinstance(value, str):
        try:
            return OPS[value.lower()]
        except KeyError:
            raise ValueError(f"unknown op {value!r}; expected one of {sorted(OPS)}") from None
    return int(value)


# gradsync_collective: the statistics' index of each collective.
COLLECTIVES = {1: "allreduce", 2: "broadcast", 3: "allgather", 4: "reduce_scatter", 5: "barrier", 6: "weighted_mean",
               7: "alltoall"}


class _CollectiveStats(ctypes.Structure):
    _fields_ = [("calls", c_uint64), ("failed", c_uint64), ("bytes", c_uint64), ("wait_ns", c_uint64),
                ("move_ns", c_uint64)]


class _PeerStats(ctypes.Structure):
    _fields_ = [("late_ns", c_uint64), ("max_late_ns", c_uint64), ("last", c_uint64)]


class _Statistics(ctypes.Structure):
    _fields_ = [("struct_size", c_uint32), ("version", c_uint32), ("rank", c_int32), ("size", c_int32),
                ("straggler", c_int32), ("reserved0", c_int32), ("rounds", c_uint64),
                ("collective", _CollectiveStats * 8)]


declare("gradsync_comm_stats", c_int, _P, ctypes.POINTER(_Statistics), ctypes.POINTER(_PeerStats), c_size_t)
declare("gradsync_comm_timeline", c_int, _P, ctypes.c_char_p)


def _array(a, name, writable=True):
    return numpy_array(a, name, _DTYPES, writable)


# torch tensors, beside numpy arrays: a CPU tensor's numpy view shares its memory, so a tensor goes
# in without a copy, and a result that is an argument comes back as that very tensor; a result the
# binding allocates comes back as a tensor over the same memory. torch is never imported here: a
# tensor can only exist once the program has imported it.
def _torch():
    return sys.modules.get("torch")


def _is_tensor(x):
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _tensor_view(t, name):
    if t.device.type != "cpu":
        raise TypeError(f"{name} is a tensor on {t.device}; the collectives take CPU tensors")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() and pass that tensor)")
    try:
        view = t.detach().numpy()
    except (TypeError, RuntimeError) as e:  # bfloat16, complex views, ...: no numpy form
        raise TypeError(f"{name} has dtype {t.dtype}; expected torch.float32, float64, int32, int64 or float16"
                        f" ({e})") from None
    if view.dtype not in _DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; expected torch.float32, float64, int32, int64 or float16")
    return view


def _tensors_in_out(method):
    """Lets a collective take CPU torch tensors (in lists too, and a torch dtype) wherever it takes
    numpy arrays, and give tensors back; its non-blocking form's wait() too."""
    names = list(inspect.signature(method).parameters)[1:]

    @functools.wraps(method)
    def collective(self, *args, **kwargs):
        views = {}  # id(numpy view) -> (view, tensor): the tensor a result that is a view stands for
        as_tensors = False

        def to_numpy(x, name):
            nonlocal as_tensors
            if _is_tensor(x):
                view = _tensor_view(x, name)
                views[id(view)] = (view, x)
                as_tensors = True
                return view
            if isinstance(x, (list, tuple)) and any(_is_tensor(y) for y in x):
                return [to_numpy(y, f"{name}[{i}]") for i, y in enumerate(x)]
            torch = _torch()
            if torch is not None and isinstance(x, torch.dtype):
                as_tensors = True
                return torch.empty(0, dtype=x).numpy().dtype
            return x

        args = [to_numpy(a, names[i] if i < len(names) else f"argument {i + 1}") for i, a in enumerate(args)]
        kwargs = {k: to_numpy(v, k) for k, v in kwargs.items()}
        result = method(self, *args, **kwargs)
        if not as_tensors:
            return result

        def to_tensors(r):
            if isinstance(r, np.ndarray):
                hit = views.get(id(r))
                return hit[1] if hit is not None and hit[0] is r else _torch().from_numpy(r)
            if isinstance(r, list):
                return [to_tensors(y) for y in r]
            return r

        if isinstance(result, Request):
            inner = result._result
            result._result = lambda: to_tensors(inner() if callable(inner) else inner)
            return result
        return to_tensors(result)
    return collective


_ptr = address


class Communicator(Handle):
    """One rank of a group. Collective: the constructor returns once all `size` ranks have joined.

    name: the group's name (ranks with the same name form one group); rank in [0, size);
    timeout_ms: deadline of joining and of every collective (default: the library's, 300 s;
    NO_TIMEOUT: none);
    transport: "threads" (default; ranks are threads of this process), "shm" (ranks are processes
    of this host, meeting in /dev/shm/gradsync.<name>; see empty() for zero-copy arrays), or "mpi"
    (ranks are the processes of an mpirun job: name, rank and size come from MPI, so
    `Communicator(transport="mpi")` is enough; mpi_comm is an mpi4py communicator or a Fortran
    handle to use instead of MPI_COMM_WORLD; deterministic=True reduces in rank order, which MPI's
    own reduction does not promise; check_mismatch=False skips comparing the ranks' calls).
    host: a label that replaces the detected host identity (see topology()); for odd clusters and tests.
    transport="hier": the processes of an mpirun job on any number of hosts, shared memory within a
    host and MPI between hosts (as "mpi", name, rank and size come from MPI); its large float
    allreduces reduce host by host, so their bits depend on the layout unless topology_independent=True.
    threads=(T, t), with transport "mpi" or "hier": this process holds T ranks of the group, one per
    thread that creates a Communicator, and this is its thread t (T threads call the constructor at
    once, t = 0 .. T-1); process p's threads are the ranks after those of processes 0 .. p-1. The
    threads of a process meet by name: a group made beside another one in the same process needs
    its own name.

    A communicator belongs to the process that created it: in a child made by os.fork() (or
    multiprocessing's "fork" start method), every call on it and on its requests raises
    GradsyncError (E_MISUSE) naming the parent's pid, and closing it there (or its finalizer)
    releases only the child's share, leaving the parent's group running. Create a new one in the
    child to communicate.
    """

    _free = lib.gradsync_comm_free

    def __init__(self, name=None, rank=None, size=None, timeout_ms=None, transport="threads", *,
                 deterministic=None, check_mismatch=None, mpi_comm=None, host=None, topology_independent=None,
                 threads=None):
        opts = self._options(name, rank, size, timeout_ms, transport, deterministic=deterministic,
                             check_mismatch=check_mismatch, mpi_comm=mpi_comm, host=host,
                             topology_independent=topology_independent, threads=threads)
        out = c_void_p()
        check(lib.gradsync_comm_create(ctypes.byref(out), ctypes.byref(opts)))
        self._adopt(out)

    @staticmethod
    def _options(name, rank, size, timeout_ms, transport, *, deterministic=None, check_mismatch=None, mpi_comm=None,
                 host=None, topology_independent=None, threads=None):
        opts = CommOptions()
        check(lib.gradsync_comm_options_init(ctypes.byref(opts), ctypes.sizeof(opts)))
        opts.transport = _transport(transport)
        over_mpi = opts.transport in (TRANSPORT_MPI, TRANSPORT_HIER)
        if over_mpi and mpi_comm is not None:
            opts.mpi_fcomm = int(mpi_comm.py2f()) if hasattr(mpi_comm, "py2f") else int(mpi_comm)
        if not over_mpi and (name is None or rank is None or size is None):
            raise TypeError("name, rank and size are required (except with transport='mpi')")
        if name is not None:  # over MPI only a join's (rank and size come from MPI)
            encoded = name.encode()
            if len(encoded) >= NAME_MAX:
                raise ValueError(f"group name is {len(encoded)} bytes; at most {NAME_MAX - 1}")
            opts.name = encoded
        if not over_mpi:
            opts.rank = rank
            opts.size = size
        if deterministic is not None:
            opts.deterministic = int(bool(deterministic))
        if check_mismatch is not None:
            opts.check_mismatch = int(bool(check_mismatch))
        if timeout_ms is not None:
            opts.timeout_ms = int(timeout_ms)
        if topology_independent is not None:
            opts.topology_independent = int(bool(topology_independent))
        if threads is not None:
            opts.threads, opts.thread = (int(v) for v in threads)
        if host is not None:
            encoded = host.encode()
            if len(encoded) >= NAME_MAX:
                raise ValueError(f"host label is {len(encoded)} bytes; at most {NAME_MAX - 1}")
            opts.host = encoded
        return opts

    def _adopt(self, ptr):
        Handle.__init__(self, ptr)
        check(lib.gradsync_comm_set_interrupt(self.ptr, _interrupt_fn, None))
        _watch_ctrl_c()

    @classmethod
    def from_env(cls, **kwargs):
        """The communicator that `python3 -m gradsync.run` (or any launcher) describes in the
        environment: GRADSYNC_GROUP, GRADSYNC_RANK, GRADSYNC_SIZE, and optionally
        GRADSYNC_TRANSPORT (default shm) and GRADSYNC_TIMEOUT_MS; GRADSYNC_TRANSPORT=hier or mpi
        (`gradsync.run --hosts`) needs only MPI's launcher. Keyword arguments are passed on. A
        replacement rank (GRADSYNC_JOIN set: gradsync.run --replace) gets a RuntimeError: it joins
        with gradsync.torch.elastic.join."""
        env = os.environ
        if "GRADSYNC_JOIN" in env:
            raise RuntimeError(f"this process replaces a lost rank (GRADSYNC_JOIN={env['GRADSYNC_JOIN']}): it joins "
                               "the running group with gradsync.torch.elastic.join (or Communicator.join), not "
                               "from_env")
        if "GRADSYNC_TIMEOUT_MS" in env:
            kwargs.setdefault("timeout_ms", int(env["GRADSYNC_TIMEOUT_MS"]))
        if env.get("GRADSYNC_TRANSPORT") in ("mpi", "hier"):  # gradsync.run --hosts: rank and size from MPI
            return cls(transport=env["GRADSYNC_TRANSPORT"], **kwargs)
        missing = [k for k in ("GRADSYNC_GROUP", "GRADSYNC_RANK", "GRADSYNC_SIZE") if k not in env]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} not set: start this program with python3 -m gradsync.run -n N")
        return cls(env["GRADSYNC_GROUP"], int(env["GRADSYNC_RANK"]), int(env["GRADSYNC_SIZE"]),
                   transport=env.get("GRADSYNC_TRANSPORT", "shm"), **kwargs)

    def _query(self, fn):
        v = c_int32()
        check(fn(self.ptr, ctypes.byref(v)))
        return v.value

    @property
    def rank(self):
        """This member's rank in the group, 0 <= rank < size."""
        return self._query(lib.gradsync_comm_rank)

    @property
    def size(self):
        """The number of ranks in the group."""
        return self._query(lib.gradsync_comm_size)

    @property
    def transport(self):
        """"threads", "shm", "mpi" or "hier" (a Transport: it equals the TRANSPORT_* code too)."""
        return Transport(self._query(lib.gradsync_comm_transport))

    def split(self, color, key=0):
        """A subgroup, as MPI_Comm_split: ranks passing the same color (>= 0) form a new
        Communicator, ranked by key, then by rank here; color None joins none and returns None.
        Collective over this group. The subgroup is independent of this one (close either first)."""
        out = _P()
        _blocking(lib.gradsync_comm_split, self.ptr, SPLIT_NONE if color is None else int(color), int(key),
                  ctypes.byref(out))
        if not out:
            return None
        sub = type(self).__new__(type(self))
        sub._adopt(out)
        return sub

    def shrink(self):
        """After this group lost a member: the survivors' group, in place. Collective over the
        survivors (call it once a collective raised E_REMOTE, E_TIMEOUT or E_ABORTED). Returns
        (new Communicator, failed ranks of this group, info dict with attempts, agree_s, form_s).
        Ranks are dense in the old order; member_id stays. This group is stopped: close it.
        THREAD, SHM, and MPI or HIER under mpirun --enable-recovery (a whole host lost: survivors
        all on one host get an SHM group, survivors on several hosts one of this group's transport)."""
        out = _P()
        n = self.size
        failed = (c_int32 * n)()
        res = ShrinkResult()
        res.struct_size = ctypes.sizeof(res)
        res.version = 1
        _blocking(lib.gradsync_comm_shrink, self.ptr, ctypes.byref(out), failed, n, ctypes.byref(res))
        sub = type(self).__new__(type(self))
        sub._adopt(out)
        info = {"attempts": res.attempts, "agree_s": res.agree_ns / 1e9, "form_s": res.form_ns / 1e9}
        return sub, [failed[i] for i in range(res.failed_count)], info

    def grow(self, join_name, joiners=1):
        """Grow this group by `joiners` new ranks at a round boundary; they call Communicator.join
        with the same join_name. Collective over this group (every member passes the same name and
        count). Returns (new Communicator, info dict with old_size, new_size, first_member_id,
        agree_s, form_s): the members keep their ranks and member ids, joiner j is rank
        old_size + j with member id first_member_id + j (ids are never reused). This group is left
        as it was: move state onto the new one (broadcast the parameters, Shard.reshard the
        optimizer slices), then close it. On failure (GradsyncError) this group is stopped as
        after a failed collective: reset() it (or shrink() it if a member is lost) and grow again.
        MPI and HIER (under mpirun): the members start the joiners themselves, rank 0's command
        line again with GRADSYNC_JOIN=join_name in its environment, which then calls join(); a
        joiner that never joins, or a rank lost inside the spawn, ends the job after the timeout.
        Refused (E_UNSUPPORTED) once a shrink of the job lost a whole host. Threads as ranks:
        joiners counts processes, whose threads join with threads=(T, t)."""
        out = _P()
        res = GrowResult()
        res.struct_size = ctypes.sizeof(res)
        res.version = 1
        _blocking(lib.gradsync_comm_grow, self.ptr, str(join_name).encode(), int(joiners), ctypes.byref(out),
                  ctypes.byref(res))
        grown = type(self).__new__(type(self))
        grown._adopt(out)
        return grown, GrowResult._info(res)

    @classmethod
    def join(cls, join_name, index=0, joiners=1, timeout_ms=None, transport="threads", *, host=None, threads=None):
        """Join a running group as a new rank: the other side of grow(). Waits up to timeout_ms
        for the members to grow by `joiners` at join_name; index is this joiner's place among them
        in [0, joiners). Returns (Communicator, info dict as grow's); the communicator takes the
        group's options (timeout, check_mismatch), its rank is info["old_size"] + index. Catch up
        from the members: the parameters by broadcast, a ZeRO-1 Shard by creating it on the new
        communicator (not init) and calling Shard.reshard. transport "mpi" or "hier": only in a
        process that the members' grow started (GRADSYNC_JOIN names the join); index and joiners
        are then MPI's, and the arguments are ignored. threads=(T, t) there: threads as ranks, every
        one of the process's T threads calling join with its index t (the members' grow counts
        processes)."""
        opts = cls._options(join_name, index, joiners, timeout_ms, transport, host=host, threads=threads)
        out = c_void_p()
        res = GrowResult()
        res.struct_size = ctypes.sizeof(res)
        res.version = 1
        _blocking(lib.gradsync_comm_join, ctypes.byref(out), ctypes.byref(opts), ctypes.byref(res))
        comm = cls.__new__(cls)
        comm._adopt(out)
        return comm, GrowResult._info(res)

    @property
    def member_id(self):
        """This member's stable id: its rank in the group it was created in, kept by shrinks, grows
        and splits; a joiner's is new (see grow())."""
        v = c_int64()
        check(lib.gradsync_comm_member_id(self.ptr, ctypes.byref(v)))
        return v.value

    @property
    def topology(self):
        """Which ranks share a host, the same on every rank: a Topology with host, local_rank,
        local_size, num_hosts and rank_hosts (every rank's host). Hosts come from facts (hostname,
        boot id, the /dev/shm mount, and a shared-memory probe), or the host label of the options."""
        host, local_rank, local_size, num_hosts = c_int32(), c_int32(), c_int32(), c_int32()
        n = self.size
        hosts = (c_int32 * n)()
        check(lib.gradsync_comm_topology(self.ptr, ctypes.byref(host), ctypes.byref(local_rank),
                                         ctypes.byref(local_size), ctypes.byref(num_hosts), hosts, n))
        return Topology(host.value, local_rank.value, local_size.value, num_hosts.value, tuple(hosts))

    def part(self, total):
        """(start, length) of this rank's part of `total` elements (reduce_scatter, allgather)."""
        return partition(total, self.size, self.rank)

    def _issue(self, name, nonblocking, args, result, keep=()):
        """The blocking call gradsync_comm_<name> (returns result), or its non-blocking form (a Request)."""
        if not nonblocking:
            _blocking(getattr(lib, "gradsync_comm_" + name), self.ptr, *args)
            return result() if callable(result) else result
        request = _P()
        check(getattr(lib, "gradsync_comm_i" + name)(self.ptr, *args, ctypes.byref(request)))
        return Request(request, self, result, keep)

    def allreduce(self, array, op="mean", out=None, *, _nonblocking=False):
        """Reduce `array` over ranks (rank order); into `out`, or in place when out is None. Returns the result."""
        send = _array(array, "array", writable=out is None)
        recv = send if out is None else _array(out, "out")
        if recv.shape != send.shape or recv.dtype != send.dtype:
            raise ValueError(f"out has shape {recv.shape} {recv.dtype}, array {send.shape} {send.dtype}")
        return self._issue("allreduce", _nonblocking,
                           (_ptr(send), _ptr(recv), send.size, _DTYPES[send.dtype], _op(op)), recv, (send, recv))

    def allreduce_many(self, arrays, op="mean", *, _nonblocking=False):
        """One fused allreduce, in place, over a list of arrays (a gradient bucket); the same bits
        as one allreduce per array. Arrays of several dtypes (a mixed-precision model's) are one
        call too: every rank must pass the same dtypes in the same order."""
        arrays = [_array(a, f"arrays[{i}]") for i, a in enumerate(arrays)]
        n = len(arrays)
        recvs = (c_void_p * max(n, 1))(*[a.ctypes.data for a in arrays])
        counts = (c_size_t * max(n, 1))(*[a.size for a in arrays])
        if not arrays and not _nonblocking:
            return arrays
        if len({a.dtype for a in arrays}) > 1:
            dtypes = (c_int32 * n)(*[_DTYPES[a.dtype] for a in arrays])
            return self._issue("allreduce_mixed", _nonblocking, (None, recvs, counts, dtypes, n, _op(op)), arrays,
                               (arrays, recvs, counts, dtypes))
        dtype = arrays[0].dtype if arrays else np.dtype(np.float32)
        return self._issue("allreduce_many", _nonblocking, (None, recvs, counts, n, _DTYPES[dtype], _op(op)), arrays,
                           (arrays, recvs, counts))

    def weighted_mean(self, array, weight, out=None, *, _nonblocking=False):
        """array <- Σ wᵢ·arrayᵢ / Σ wᵢ over ranks (w = this rank's sample count); returns Σ wᵢ."""
        send = _array(array, "array", writable=out is None)
        recv = send if out is None else _array(out, "out")
        total = c_uint64()
        return self._issue("weighted_mean", _nonblocking,
                           (_ptr(send), _ptr(recv), send.size, _DTYPES[send.dtype], int(weight), ctypes.byref(total)),
                           lambda: total.value, (send, recv, total))

    def broadcast(self, array, root=0, *, _nonblocking=False):
        """Copy root's array into every rank's array (in place). Returns the array."""
        a = _array(array, "array")
        return self._issue("broadcast", _nonblocking, (_ptr(a), a.size, _DTYPES[a.dtype], int(root)), a, (a,))

    def allgather(self, array, part=None, *, _nonblocking=False):
        """Fill `array` (all elements) with every rank's part; this rank's part comes from `part`,
        or is already in place in `array` when part is None. Returns the array."""
        recv = _array(array, "array")
        send = None
        if part is not None:
            send = _array(part, "part", writable=False)
            start, length = self.part(recv.size)
            if send.size != length or send.dtype != recv.dtype:
                raise ValueError(f"part has {send.size} {send.dtype} elements; this rank's part is {length} {recv.dtype}")
        return self._issue("allgather", _nonblocking,
                           (None if send is None else _ptr(send), _ptr(recv), recv.size, _DTYPES[recv.dtype]), recv,
                           (send, recv))

    def allgatherv(self, part, counts, out=None, *, _nonblocking=False):
        """Every rank's `part` (rank r's holds counts[r] elements, maybe 0), one after the other in
        rank order, on every rank; every rank passes the same counts. Returns the concatenation
        (into `out` when given)."""
        send = _array(part, "part", writable=False)
        counts = [int(c) for c in counts]
        if len(counts) != self.size or any(c < 0 for c in counts):
            raise ValueError(f"counts must hold {self.size} counts >= 0, got {counts}")
        if send.size != counts[self.rank]:
            raise ValueError(f"part has {send.size} elements; counts[{self.rank}] is {counts[self.rank]}")
        recv = np.empty(sum(counts), dtype=send.dtype) if out is None else _array(out, "out")
        if recv.size != sum(counts) or recv.dtype != send.dtype:
            raise ValueError(f"out has {recv.size} {recv.dtype} elements; the parts make {sum(counts)} {send.dtype}")
        c_counts = (c_size_t * self.size)(*counts)
        return self._issue("allgatherv", _nonblocking, (_ptr(send), _ptr(recv), c_counts, _DTYPES[send.dtype]), recv,
                           (send, recv, c_counts))

    def reduce_scatter(self, array, op="mean", out=None, *, _nonblocking=False):
        """Reduce `array` over ranks; returns this rank's part (into `out` when given)."""
        send = _array(array, "array", writable=False)
        start, length = self.part(send.size)
        recv = np.empty(length, dtype=send.dtype) if out is None else _array(out, "out")
        if recv.size != length or recv.dtype != send.dtype:
            raise ValueError(f"out has {recv.size} {recv.dtype} elements; this rank's part is {length} {send.dtype}")
        return self._issue("reduce_scatter", _nonblocking,
                           (_ptr(send), _ptr(recv), send.size, _DTYPES[send.dtype], _op(op)), recv, (send, recv))

    def reduce_scatterv(self, array, counts, op="mean", out=None, *, _nonblocking=False):
        """Reduce `array` (the sum of the counts) over ranks; rank r receives the counts[r]
        elements after the counts before it (into `out` when given); every rank passes the same
        counts. Returns this rank's part."""
        send = _array(array, "array", writable=False)
        counts = [int(c) for c in counts]
        if len(counts) != self.size or any(c < 0 for c in counts) or sum(counts) != send.size:
            raise ValueError(f"counts must hold {self.size} counts >= 0 summing to {send.size}, got {counts}")
        length = counts[self.rank]
        recv = np.empty(length, dtype=send.dtype) if out is None else _array(out, "out")
        if recv.size != length or recv.dtype != send.dtype:
            raise ValueError(f"out has {recv.size} {recv.dtype} elements; this rank's part is {length} {send.dtype}")
        c_counts = (c_size_t * self.size)(*counts)
        return self._issue("reduce_scatterv", _nonblocking,
                           (_ptr(send), _ptr(recv), c_counts, _DTYPES[send.dtype], _op(op)), recv, (send, recv, c_counts))

    def alltoall(self, array, out=None, *, _nonblocking=False):
        """Send part j of `array` (parts by the partition rule) to rank j. Returns an array of
        shape (size, part length): row i is rank i's part for this rank (into `out` when given)."""
        send = _array(array, "array", writable=False)
        start, length = self.part(send.size)
        recv = np.empty((self.size, length), dtype=send.dtype) if out is None else _array(out, "out")
        if recv.size != self.size * length or recv.dtype != send.dtype:
            raise ValueError(f"out has {recv.size} {recv.dtype} elements; alltoall gives {self.size} x {length} "
                             f"{send.dtype}")
        return self._issue("alltoall", _nonblocking, (_ptr(send), _ptr(recv), send.size, _DTYPES[send.dtype]), recv,
                           (send, recv))

    def _counts(self, counts, what):
        counts = [int(c) for c in counts]
        if len(counts) != self.size or any(c < 0 for c in counts):
            raise ValueError(f"{what} must hold {self.size} counts >= 0, got {counts}")
        return counts

    def alltoallv(self, array, send_counts, recv_counts, out=None, *, _nonblocking=False):
        """Send the send_counts[d] elements of `array` after those for ranks before d to rank d
        (packed in rank order); receive recv_counts[s] elements from rank s, packed in rank order
        into the result (into `out` when given). Ranks whose counts disagree all raise a mismatch."""
        send = _array(array, "array", writable=False)
        sc, rc = self._counts(send_counts, "send_counts"), self._counts(recv_counts, "recv_counts")
        if sum(sc) != send.size:
            raise ValueError(f"array has {send.size} elements; send_counts sum to {sum(sc)}")
        recv = np.empty(sum(rc), dtype=send.dtype) if out is None else _array(out, "out")
        if recv.size != sum(rc) or recv.dtype != send.dtype:
            raise ValueError(f"out has {recv.size} {recv.dtype} elements; recv_counts sum to {sum(rc)} {send.dtype}")
        c_sc, c_rc = (c_size_t * self.size)(*sc), (c_size_t * self.size)(*rc)
        return self._issue("alltoallv", _nonblocking,
                           (_ptr(send), c_sc, None, _ptr(recv), c_rc, None, _DTYPES[send.dtype]), recv,
                           (send, recv, c_sc, c_rc))

    def reduce(self, array, root=0, op="mean", out=None, *, _nonblocking=False):
        """Reduce `array` over ranks (in rank order) to `root`: returns the result there (into
        `out` when given, which may be `array` itself), None on the other ranks."""
        send = _array(array, "array", writable=False)
        recv = None
        if self.rank == root:
            recv = np.empty_like(send) if out is None else _array(out, "out")
            if recv.size != send.size or recv.dtype != send.dtype:
                raise ValueError(f"out has {recv.size} {recv.dtype} elements; reduce gives {send.size} {send.dtype}")
        return self._issue("reduce", _nonblocking,
                           (_ptr(send), None if recv is None else _ptr(recv), send.size, _DTYPES[send.dtype], _op(op),
                            int(root)), recv, (send, recv))

    def gather(self, array, root=0, *, _nonblocking=False):
        """Every rank's `array` (the same size on every rank) at `root`, as an array of shape
        (size, n); None on the other ranks."""
        send = _array(array, "array", writable=False)
        recv = np.empty((self.size, send.size), dtype=send.dtype) if self.rank == root else None
        return self._issue("gather", _nonblocking,
                           (_ptr(send), None if recv is None else _ptr(recv), send.size, _DTYPES[send.dtype],
                            int(root)), recv, (send, recv))

    def gatherv(self, array, counts=None, root=0, *, _nonblocking=False):
        """Every rank's `array` (any size, 0 too) at `root`, one after the other in rank order;
        `counts` (every rank's size) is needed at the root only. None on the other ranks."""
        send = _array(array, "array", writable=False)
        recv = c_counts = None
        if self.rank == root:
            if counts is None:
                raise ValueError("gatherv needs the counts at the root")
            counts = self._counts(counts, "counts")
            recv = np.empty(sum(counts), dtype=send.dtype)
            c_counts = (c_size_t * self.size)(*counts)
        return self._issue("gatherv", _nonblocking,
                           (_ptr(send), send.size, None if recv is None else _ptr(recv), c_counts,
                            _DTYPES[send.dtype], int(root)), recv, (send, recv, c_counts))

    def scatter(self, array, count, root=0, dtype=None, *, _nonblocking=False):
        """Rank r receives block r of root's `array` (size x count elements; ignored elsewhere,
        where `dtype` says the element type if `array` is None)."""
        send, dt = self._root_array(array, root, dtype)
        recv = np.empty(int(count), dtype=dt)
        if send is not None and send.size != self.size * recv.size:
            raise ValueError(f"array has {send.size} elements; scatter of {count} needs {self.size * recv.size}")
        return self._issue("scatter", _nonblocking,
                           (None if send is None else _ptr(send), _ptr(recv), recv.size, _DTYPES[dt], int(root)), recv,
                           (send, recv))

    def scatterv(self, array, count, counts=None, root=0, dtype=None, *, _nonblocking=False):
        """Rank r receives counts[r] elements (its `count`) of root's `array`, parts packed in
        rank order; `array` and `counts` are needed at the root only."""
        send, dt = self._root_array(array, root, dtype)
        c_counts = None
        if send is not None:
            if counts is None:
                raise ValueError("scatterv needs the counts at the root")
            counts = self._counts(counts, "counts")
            if sum(counts) != send.size:
                raise ValueError(f"array has {send.size} elements; counts sum to {sum(counts)}")
            c_counts = (c_size_t * self.size)(*counts)
        recv = np.empty(int(count), dtype=dt)
        return self._issue("scatterv", _nonblocking,
                           (None if send is None else _ptr(send), c_counts, _ptr(recv), recv.size, _DTYPES[dt],
                            int(root)), recv, (send, recv, c_counts))

    def _root_array(self, array, root, dtype):
        if self.rank == root:
            send = _array(array, "array", writable=False)
            return send, send.dtype
        if array is not None:
            return None, _array(array, "array", writable=False).dtype
        if dtype is None:
            raise ValueError("away from the root, pass the array or its dtype")
        return None, np.dtype(dtype)

    def barrier(self, *, _nonblocking=False):
        """Collective: return once every rank has entered the barrier."""
        return self._issue("barrier", _nonblocking, (), None)

    # The non-blocking forms: the same arguments, a Request whose wait() returns the same result.
    def iallreduce(self, array, op="mean", out=None):
        """Non-blocking allreduce(): the same arguments; returns a Request whose wait() returns what
        allreduce() returns. The arrays must stay untouched until then."""
        return self.allreduce(array, op, out, _nonblocking=True)

    def iallreduce_many(self, arrays, op="mean"):
        """Non-blocking allreduce_many(): returns a Request whose wait() returns the reduced arrays."""
        return self.allreduce_many(arrays, op, _nonblocking=True)

    def iweighted_mean(self, array, weight, out=None):
        """Non-blocking weighted_mean(): returns a Request whose wait() returns (mean, total weight)."""
        return self.weighted_mean(array, weight, out, _nonblocking=True)

    def ibroadcast(self, array, root=0):
        """Non-blocking broadcast(): returns a Request whose wait() returns the root's array."""
        return self.broadcast(array, root, _nonblocking=True)

    def iallgather(self, array, part=None):
        """Non-blocking allgather(): returns a Request whose wait() returns every rank's part, in rank order."""
        return self.allgather(array, part, _nonblocking=True)

    def iallgatherv(self, part, counts, out=None):
        """Non-blocking allgatherv(): returns a Request whose wait() returns the concatenated parts."""
        return self.allgatherv(part, counts, out, _nonblocking=True)

    def ireduce_scatterv(self, array, counts, op="mean", out=None):
        """Non-blocking reduce_scatterv(): returns a Request whose wait() returns this rank's reduced part."""
        return self.reduce_scatterv(array, counts, op, out, _nonblocking=True)

    def ireduce_scatter(self, array, op="mean", out=None):
        """Non-blocking reduce_scatter(): returns a Request whose wait() returns this rank's reduced part."""
        return self.reduce_scatter(array, op, out, _nonblocking=True)

    def ialltoall(self, array, out=None):
        """Non-blocking alltoall(): returns a Request whose wait() returns the received blocks."""
        return self.alltoall(array, out, _nonblocking=True)

    def ialltoallv(self, array, send_counts, recv_counts, out=None):
        """Non-blocking alltoallv(): returns a Request whose wait() returns the received blocks."""
        return self.alltoallv(array, send_counts, recv_counts, out, _nonblocking=True)

    def ireduce(self, array, root=0, op="mean", out=None):
        """Non-blocking reduce(): returns a Request whose wait() returns the result at the root (None
        elsewhere)."""
        return self.reduce(array, root, op, out, _nonblocking=True)

    def igather(self, array, root=0):
        """Non-blocking gather(): returns a Request whose wait() returns the parts at the root (None
        elsewhere)."""
        return self.gather(array, root, _nonblocking=True)

    def igatherv(self, array, counts=None, root=0):
        """Non-blocking gatherv(): returns a Request whose wait() returns the parts at the root (None
        elsewhere)."""
        return self.gatherv(array, counts, root, _nonblocking=True)

    def iscatter(self, array, count, root=0, dtype=None):
        """Non-blocking scatter(): returns a Request whose wait() returns this rank's part."""
        return self.scatter(array, count, root, dtype, _nonblocking=True)

    def iscatterv(self, array, count, counts=None, root=0, dtype=None):
        """Non-blocking scatterv(): returns a Request whose wait() returns this rank's part."""
        return self.scatterv(array, count, counts, root, dtype, _nonblocking=True)

    def ibarrier(self):
        """Non-blocking barrier(): returns a Request whose wait() returns once every rank has entered it."""
        return self.barrier(_nonblocking=True)

    def async_error(self):
        """The first failure of a non-blocking call since creation or the last reset: None, or
        the GradsyncError it raised."""
        status = c_int32()
        check(lib.gradsync_comm_get_async_error(self.ptr, ctypes.byref(status)))
        if status.value == 0:
            return None
        return GradsyncError(status.value, lib.gradsync_last_error_message().decode())

    def empty(self, shape, dtype=np.float32):
        """An uninitialised array for this group's collectives.

        With transport "shm" it lies in the group's shared-memory segment, and collectives whose
        arrays come from here on every rank run zero copy (peers reduce straight from them). Other
        transports give ordinary memory. The memory returns to the group when the array (and every
        view of it) is collected; it must not be used after the communicator is closed.
        """
        dtype = np.dtype(dtype)
        if dtype not in _DTYPES:
            raise TypeError(f"dtype {dtype}; expected float32, float64, int32 or int64")
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = max(count * dtype.itemsize, 1)
        address = c_void_p()
        check(lib.gradsync_comm_alloc(self.ptr, nbytes, ctypes.byref(address)))
        memory = (ctypes.c_char * nbytes).from_address(address.value)
        weakref.finalize(memory, _free_buffer, self, address.value)
        return np.frombuffer(memory, dtype=dtype, count=count).reshape(shape)

    def stats(self):
        """This rank's figures since creation (gradsync_comm_stats), as a dict: "collectives" maps
        each collective called to its calls, failed, bytes, wait_ns (waiting for peers) and
        move_ns (moving data); "peers" lists every rank's arrivals, as every rank saw them alike
        (late_ns summed over rounds after the round's first arrival, max_late_ns, last: rounds
        it arrived last); "straggler" is the rank latest in sum, or None; "rounds" the rounds
        compared. Safe from any thread, also while a call runs."""
        s = _Statistics(struct_size=ctypes.sizeof(_Statistics), version=1)
        peers = (_PeerStats * self.size)()
        check(lib.gradsync_comm_stats(self.ptr, ctypes.byref(s), peers, self.size))
        collectives = {}
        for value, name in COLLECTIVES.items():
            c = s.collective[value]
            if c.calls or c.failed:
                collectives[name] = {f: getattr(c, f) for f, _ in _CollectiveStats._fields_}
        return {"rank": s.rank, "size": s.size, "rounds": s.rounds,
                "straggler": None if s.straggler < 0 else s.straggler, "collectives": collectives,
                "peers": [{f: getattr(p, f) for f, _ in _PeerStats._fields_} for p in peers]}

    def timeline(self, path):
        """Write this rank's calls to `path` as Chrome-trace JSON from now on (None: stop and
        complete the file). GRADSYNC_TIMELINE=prefix does it for every communicator, at prefix.<rank>."""
        check(lib.gradsync_comm_timeline(self.ptr, None if path is None else os.fsencode(path)))

    def abort(self):
        """Wake every rank waiting in a collective with E_ABORTED; safe from any thread."""
        check(lib.gradsync_comm_abort(self.ptr))

    def reset(self):
        """Make an aborted or timed-out group usable again. Collective: every rank calls it."""
        check(lib.gradsync_comm_reset(self.ptr))

    def __repr__(self):
        if not self._ptr:
            return "<gradsync.Communicator closed>"
        return f"<gradsync.Communicator rank {self.rank} of {self.size}>"


for _name in ("allreduce", "allreduce_many", "weighted_mean", "broadcast", "allgather", "allgatherv", "reduce_scatter",
              "reduce_scatterv", "alltoall", "alltoallv", "reduce", "gather", "gatherv", "scatter", "scatterv"):
    # The i* forms call these, so they take and give tensors too.
    setattr(Communicator, _name, _tensors_in_out(getattr(Communicator, _name)))
