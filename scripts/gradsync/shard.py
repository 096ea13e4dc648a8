# SPDX-License-Identifier: Apache-2.0
"""The sharded parameter (BigDL's AllReduceParameter, ZeRO-1) over any communicator.

    import numpy as np, gradsync as gs

    def worker(rank, size=2):
        with gs.Communicator("train", rank, size) as comm, \\
             gs.ShardedParameter(comm, weights.size, optimizer="adam", lr=1e-3, compress="bf16") as p:
            w = weights.copy()
            p.init(w)                                   # keeps this rank's slice (and its Adam state)
            for batch in batches(rank):
                grad = compute_gradient(w, batch)
                p.step(grad, w, samples=len(batch))     # reduce-scatter, Adam on the slice, allgather

Each rank owns one slice of the weights (`p.part` gives (offset, length)) and the optimizer state
for that slice only. Gradients may travel compressed ("bf16", "fp16", "bigdl_fp16"); they are
summed in float32 in rank order, and the weights every rank receives are always full precision and
bitwise identical. The stages can also be driven one by one, as BigDL's users do:
put(grad), aggregate(), update() (or read_slice("gradient") + write_weights(slice)), gather(w).
A stale gradient is never reused, and a failure on one rank raises GradsyncError on every rank.
"""
import ctypes
from ctypes import c_double

import numpy as np

from ._lib import (Handle, address, c_int, c_int32, c_int64, c_size_t, c_uint32, c_uint64, c_void_p, check,
                   declare, lib, numpy_array)
from .codec import codec_id

__all__ = ["ShardedParameter", "OPTIMIZERS"]

OPTIMIZERS = {"sgd": 0, "adam": 2, "adamw": 3, "momentum": 4}  # gradsync_optimizer_kind
_SLICES = {"weights": 0, "gradient": 1, "state1": 2, "state2": 3}


class ShardOptions(ctypes.Structure):
    """gradsync_shard_options, field for field (include/gradsync/shard.h)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("version", c_uint32),
        ("optimizer", c_int32),
        ("compress", c_int32),
        ("error_feedback", c_int32),
        ("clamp", c_int32),
        ("lr", c_double),
        ("momentum", c_double),
        ("beta1", c_double),
        ("beta2", c_double),
        ("eps", c_double),
        ("weight_decay", c_double),
        ("clamp_min", c_double),
        ("clamp_max", c_double),
        ("clip_norm", c_double),
        ("replicas", c_int32),
        ("reserved0", c_int32),
    ]


_P = c_void_p
_U64P = ctypes.POINTER(c_uint64)
declare("gradsync_shard_options_init", c_int, ctypes.POINTER(ShardOptions), c_size_t)
declare("gradsync_shard_create", c_int, ctypes.POINTER(_P), _P, c_uint64, ctypes.POINTER(ShardOptions))
declare("gradsync_shard_free", None, _P)
declare("gradsync_shard_part", c_int, _P, c_int32, c_uint64, _U64P, _U64P)
declare("gradsync_shard_ranges", c_int, _P, c_uint64, _U64P, c_size_t, ctypes.POINTER(c_size_t))
declare("gradsync_shard_memory", c_int, _P, _U64P, _U64P, _U64P)
declare("gradsync_shard_updates", c_int, _P, ctypes.POINTER(c_int64))
declare("gradsync_shard_set_lr", c_int, _P, c_double)
declare("gradsync_shard_init", c_int, _P, _P, c_size_t)
declare("gradsync_shard_restore", c_int, _P, _P, _P, _P, c_size_t, c_int64)
declare("gradsync_shard_step", c_int, _P, _P, _P, c_size_t, c_uint64)
declare("gradsync_shard_put", c_int, _P, _P, c_size_t, c_uint64)
declare("gradsync_shard_aggregate", c_int, _P)
declare("gradsync_shard_update", c_int, _P)
declare("gradsync_shard_read_slice", c_int, _P, c_int32, _P, c_size_t)
declare("gradsync_shard_write_weights", c_int, _P, _P, c_size_t)
declare("gradsync_shard_gather", c_int, _P, _P, c_size_t)
declare("gradsync_shard_reshard", c_int, _P, _P, ctypes.POINTER(c_uint64))


def _f32(a, name, writable):
    return numpy_array(a, name, (np.float32,), writable)


_p = address


def _samples(samples):
    return 1 if samples is None else int(samples)


class ShardedParameter(Handle):
    """This rank's view of a flat float32 parameter of `total` elements, sharded over `comm`.

    optimizer: "adam" (default), "adamw", "sgd" or "momentum"; lr (default 1e-3), momentum, betas,
    eps, weight_decay as usual.
    compress: "none", "bf16", "fp16" or "bigdl_fp16" for gradients on the wire; error_feedback
    keeps each rank's compression residual for its next step. clamp=(lo, hi) clamps the aggregated
    gradient; clip_norm scales it to a global L2 norm of at most clip_norm.
    The communicator is borrowed (kept alive by this object); every rank creates its own shard with
    the same arguments. Once the communicator is closed, the collective stages (step, aggregate,
    gather) raise E_MISUSE; the local calls still work.
    """

    _free = lib.gradsync_shard_free

    def __init__(self, comm, total, optimizer="adam", lr=1e-3, compress="none", error_feedback=False,
                 momentum=0.9, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, clamp=None, clip_norm=None,
                 replicas=0):
        opts = ShardOptions()
        check(lib.gradsync_shard_options_init(ctypes.byref(opts), ctypes.sizeof(opts)))
        if isinstance(optimizer, str):
            if optimizer.lower() not in OPTIMIZERS:
                raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZERS)}")
            optimizer = OPTIMIZERS[optimizer.lower()]
        opts.optimizer = int(optimizer)
        opts.compress = codec_id(compress)
        opts.error_feedback = 1 if error_feedback else 0
        opts.lr = float(lr)
        opts.momentum = float(momentum)
        opts.beta1, opts.beta2 = (float(b) for b in betas)
        opts.eps = float(eps)
        opts.weight_decay = float(weight_decay)
        if clamp is not None:
            opts.clamp = 1
            opts.clamp_min, opts.clamp_max = (float(c) for c in clamp)
        if clip_norm is not None:
            opts.clip_norm = float(clip_norm)
        opts.replicas = int(replicas)
        out = c_void_p()
        check(lib.gradsync_shard_create(ctypes.byref(out), comm.ptr, int(total), ctypes.byref(opts)))
        super().__init__(out)
        self._comm = comm  # the C shard borrows the communicator: keep it alive
        self.total = int(total)

    # ---- queries
    def part_of(self, rank=-1, base=0):
        """(offset, length) of a rank's slice (-1: this rank); base=1 gives BigDL's 1-based offsets."""
        offset, length = c_uint64(), c_uint64()
        check(lib.gradsync_shard_part(self.ptr, int(rank), int(base), ctypes.byref(offset), ctypes.byref(length)))
        return offset.value, length.value

    @property
    def part(self):
        """(offset, length) of this rank's slice, 0-based."""
        return self.part_of(-1, 0)

    def ranges(self, base=0):
        """[(offset, length)] of every rank's slice."""
        needed = c_size_t()
        lib.gradsync_shard_ranges(self.ptr, int(base), None, 0, ctypes.byref(needed))
        out = (c_uint64 * needed.value)()
        check(lib.gradsync_shard_ranges(self.ptr, int(base), out, needed.value, ctypes.byref(needed)))
        return [(out[i], out[i + 1]) for i in range(0, needed.value, 2)]

    @property
    def memory(self):
        """Bytes this rank holds: {"weights", "optimizer", "buffers"}."""
        w, o, b = c_uint64(), c_uint64(), c_uint64()
        check(lib.gradsync_shard_memory(self.ptr, ctypes.byref(w), ctypes.byref(o), ctypes.byref(b)))
        return {"weights": w.value, "optimizer": o.value, "buffers": b.value}

    @property
    def updates(self):
        """How many optimizer updates this rank's slice has had (the same on every rank)."""
        v = c_int64()
        check(lib.gradsync_shard_updates(self.ptr, ctypes.byref(v)))
        return v.value

    def set_lr(self, lr):
        """New learning rate for later updates (set the same on every rank)."""
        check(lib.gradsync_shard_set_lr(self.ptr, float(lr)))

    # ---- training
    def init(self, weights):
        """Keep this rank's slice of `weights` (the full float32 parameter) and zero the optimizer state."""
        w = _f32(weights, "weights", False)
        check(lib.gradsync_shard_init(self.ptr, _p(w), w.size))

    def restore(self, weights, state1=None, state2=None, updates=0):
        """Local: init() with the optimizer state, to continue from a checkpoint taken on any number
        of ranks. weights, state1 (momentum's velocity, Adam's first moment; None for SGD) and state2
        (Adam's second moment) are full float32 arrays of `total`; each rank keeps its slice.
        updates: the updates applied so far (Adam's bias correction goes on from it). Pass the same
        on every rank; the error-feedback residual starts from zero."""
        w = _f32(weights, "weights", False)
        s1 = None if state1 is None else _f32(state1, "state1", False)
        s2 = None if state2 is None else _f32(state2, "state2", False)
        for name, s in (("state1", s1), ("state2", s2)):
            if s is not None and s.size != w.size:
                raise ValueError(f"{name} holds {s.size} floats, weights {w.size}")
        check(lib.gradsync_shard_restore(self.ptr, _p(w), None if s1 is None else _p(s1),
                                         None if s2 is None else _p(s2), w.size, int(updates)))

    def step(self, grad, weights, samples=None):
        """Collective: one training step. `weights` (may be `grad`) receives the new full weights.
        samples: this rank's sample count, its weight in the mean (None: 1, the plain mean)."""
        g = _f32(grad, "grad", False)
        w = _f32(weights, "weights", True)
        if w.size != g.size:
            raise ValueError(f"weights hold {w.size} floats, grad {g.size}")
        check(lib.gradsync_shard_step(self.ptr, _p(g), _p(w), g.size, _samples(samples)))
        return w

    def put(self, grad, samples=None):
        """Local: stage this rank's gradient (copied or encoded; the array is not kept)."""
        g = _f32(grad, "grad", False)
        check(lib.gradsync_shard_put(self.ptr, _p(g), g.size, _samples(samples)))

    def aggregate(self):
        """Collective: this rank's slice of the (weighted) mean gradient, then clamping and clipping."""
        check(lib.gradsync_shard_aggregate(self.ptr))

    def update(self):
        """Local: the optimizer on this rank's weight slice."""
        check(lib.gradsync_shard_update(self.ptr))

    def read_slice(self, which="weights"):
        """A copy of this rank's slice of the "weights", the aggregated "gradient", or the optimizer's
        "state1" (momentum's velocity, Adam's first moment) or "state2" (Adam's second moment)."""
        if which not in _SLICES:
            raise ValueError(f"which must be one of {sorted(_SLICES)}, got {which!r}")
        out = np.empty(self.part[1], dtype=np.float32)
        check(lib.gradsync_shard_read_slice(self.ptr, _SLICES[which], _p(out), out.size))
        return out

    def write_weights(self, slice_):
        """Local: set this rank's weight slice (e.g. from your own optimizer instead of update())."""
        s = _f32(slice_, "slice", False)
        check(lib.gradsync_shard_write_weights(self.ptr, _p(s), s.size))

    def gather(self, weights):
        """Collective: every rank's weight slice into `weights` (full precision). Returns it."""
        w = _f32(weights, "weights", True)
        check(lib.gradsync_shard_gather(self.ptr, _p(w), w.size))
        return w

    def reshard(self, comm):
        """Collective over `comm`, the survivors' group (Communicator.shrink) or a grown one
        (Communicator.grow): the slices move onto it in one all-to-all-v, the lost ones from
        replicas; afterwards this parameter runs on comm. A joiner takes part with a
        ShardedParameter it made on comm with the members' options and never init()ed: it
        receives its slice and the step count. Raises E_LOST (naming the ranges, nothing changed)
        when a slice lived only on lost ranks. Returns the floats this member received."""
        moved = c_uint64()
        check(lib.gradsync_shard_reshard(self.ptr, comm.ptr, ctypes.byref(moved)))
        self._comm = comm
        return moved.value

    def __repr__(self):
        if not self._ptr:
            return "<gradsync.ShardedParameter closed>"
        offset, length = self.part
        return f"<gradsync.ShardedParameter total {self.total}, slice [{offset}, {offset + length})>"
