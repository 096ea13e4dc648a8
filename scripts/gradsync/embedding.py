# SPDX-License-Identifier: Apache-2.0
"""An embedding table sharded row-wise over the ranks of a communicator (include/gradsync/embedding.h).

    import numpy as np, gradsync as gs

    def worker(rank, size):
        with gs.Communicator("emb", rank, size) as comm, \\
             gs.ShardedEmbeddingTable(comm, rows=1_000_000, dim=128, optimizer="row_adagrad", lr=0.1,
                                      init="uniform", seed=1) as table:
            for ids in batches(rank):
                x = table.lookup(ids)              # (len(ids), dim), in the caller's order
                table.push(ids, grad_of(x))        # one optimizer step over every rank's batch
            table.save("/shared/ckpt")             # loadable into any world size or sharding

Every call but the queries is collective: each rank calls it in turn with its own ids (possibly
none). A push is exact and deterministic: a row's gradient is summed in the order of the global
batch (rank 0's ids first, each rank's in its own order), so the table is bitwise the same on any
number of ranks and equal to what one process computes with the accumulator. An id out of range on
one rank raises GradsyncError (E_OUT_OF_RANGE) on every rank, naming that rank and id.
"""
import ctypes
import os
from ctypes import c_double

import numpy as np

from ._lib import (Handle, address, c_int, c_int32, c_int64, c_size_t, c_uint32, c_uint64, c_void_p, check,
                   declare, lib, numpy_array)

__all__ = ["ShardedEmbeddingTable", "SHARDINGS", "EMBEDDING_OPTIMIZERS"]

SHARDINGS = {"contiguous": 0, "hash": 1}  # gradsync_embedding_sharding
EMBEDDING_OPTIMIZERS = {"sgd": 0, "row_adagrad": 1, "adam": 2}  # gradsync_optimizer_kind
_INITS = {"zeros": 0, "uniform": 1}  # gradsync_table_init
_UNSET_I32 = -2**31


class EmbeddingOptions(ctypes.Structure):
    """gradsync_embedding_options, field for field (include/gradsync/embedding.h)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("version", c_uint32),
        ("rows", c_int64),
        ("dim", c_int64),
        ("sharding", c_int32),
        ("optimizer", c_int32),
        ("lr", c_double),
        ("eps", c_double),
        ("init", c_int32),
        ("threads", c_int32),
        ("seed", c_uint64),
        ("lo", c_double),
        ("hi", c_double),
        ("beta1", c_double),
        ("beta2", c_double),
        ("replicas", c_int32),
        ("reserved0", c_int32),
    ]


_P = c_void_p
declare("gradsync_embedding_options_init", c_int, ctypes.POINTER(EmbeddingOptions), c_size_t)
declare("gradsync_embedding_create", c_int, ctypes.POINTER(_P), _P, ctypes.c_char_p, ctypes.POINTER(EmbeddingOptions))
declare("gradsync_embedding_free", None, _P)
declare("gradsync_embedding_shape", c_int, _P, ctypes.POINTER(c_int64), ctypes.POINTER(c_int64),
        ctypes.POINTER(c_int64))
declare("gradsync_embedding_owner", c_int, _P, _P, c_size_t, _P)
declare("gradsync_embedding_steps", c_int, _P, ctypes.POINTER(c_int64))
declare("gradsync_embedding_set_lr", c_int, _P, c_double)
declare("gradsync_embedding_lookup", c_int, _P, _P, c_size_t, _P, c_size_t)
declare("gradsync_embedding_push", c_int, _P, _P, c_size_t, _P, c_size_t)
declare("gradsync_embedding_save", c_int, _P, ctypes.c_char_p)
declare("gradsync_embedding_save_incremental", c_int, _P, ctypes.c_char_p)
declare("gradsync_embedding_load", c_int, _P, ctypes.c_char_p)
declare("gradsync_embedding_local_rows", c_int, _P, _P, _P, _P, c_size_t)
declare("gradsync_embedding_reshard", c_int, _P, _P, c_int32, ctypes.c_char_p, ctypes.POINTER(c_uint64),
        ctypes.POINTER(c_int32))
_KEEP_SHARDING = -1


def _choice(value, table, what):
    if isinstance(value, str):
        if value.lower() not in table:
            raise ValueError(f"unknown {what} {value!r}; expected one of {sorted(table)}")
        return table[value.lower()]
    return int(value)


def _ids(ids):
    a = np.ascontiguousarray(ids)
    if a.dtype != np.int64:
        if a.size and not np.issubdtype(a.dtype, np.integer):
            raise TypeError(f"ids must be integers, got {a.dtype}")
        a = a.astype(np.int64)
    return a.reshape(-1)


def _path(p):
    return None if p is None else os.fsencode(os.fspath(p))


class ShardedEmbeddingTable(Handle):
    """This rank's part of a rows x dim float32 table sharded over `comm`.

    sharding: "contiguous" (rank r owns the r-th range of the partition rule) or "hash"
    (splitmix64(id) % size). optimizer: "sgd", "row_adagrad" (PyTorch-BigGraph's; eps 1e-10 by
    default) or "adam" (torch.optim.SparseAdam's arithmetic on the touched rows, each row with its
    own update count for the bias correction; betas and eps 1e-8 by default as torch's), with lr.
    init: "zeros" or "uniform" in [lo, hi] from seed (the same values whatever the sharding).
    threads: owner threads adding this rank's received gradients (the result does not depend on it).
    directory: None (anonymous memory) or where this rank keeps its shard's table files.
    replicas: k >= 1 keeps each rank's rows and optimizer state also on the next k ranks of the
    group's replica ring (local rank, then host: on other hosts where it can; in memory), updated
    by every push, so that reshard after losing up to k neighbouring ranks of the ring (with one
    replica on even hosts, a whole host) takes their rows from the replicas without a checkpoint;
    costs k shards of memory and k more transfers and updates of each owner's batch per push.
    The communicator is borrowed and kept alive by this object; every rank creates its table with
    the same rows, dim, sharding and optimizer.
    """

    _free = lib.gradsync_embedding_free

    def __init__(self, comm, rows, dim, sharding="contiguous", optimizer="sgd", lr=0.01, eps=None, init="zeros",
                 seed=0, lo=-0.5, hi=0.5, threads=None, directory=None, betas=(0.9, 0.999), replicas=0):
        opts = EmbeddingOptions()
        check(lib.gradsync_embedding_options_init(ctypes.byref(opts), ctypes.sizeof(opts)))
        opts.rows, opts.dim = int(rows), int(dim)
        opts.sharding = _choice(sharding, SHARDINGS, "sharding")
        opts.optimizer = _choice(optimizer, EMBEDDING_OPTIMIZERS, "optimizer")
        opts.lr = float(lr)
        opts.eps = 0.0 if eps is None else float(eps)  # 0: the optimizer's default
        opts.beta1, opts.beta2 = (float(b) for b in betas)
        opts.init = _choice(init, _INITS, "init")
        opts.seed = int(seed)
        opts.lo, opts.hi = float(lo), float(hi)
        opts.threads = _UNSET_I32 if threads is None else int(threads)
        opts.replicas = int(replicas)
        out = c_void_p()
        check(lib.gradsync_embedding_create(ctypes.byref(out), comm.ptr, _path(directory), ctypes.byref(opts)))
        super().__init__(out)
        self._comm = comm  # the C table borrows the communicator: keep it alive
        self.rows, self.dim = int(rows), int(dim)
        # What a like table on another group needs (gradsync.torch.elastic); lr as set_lr leaves it.
        self._options = dict(sharding=sharding, optimizer=optimizer, lr=float(lr), eps=eps, betas=tuple(betas),
                             threads=threads, directory=directory, replicas=int(replicas))
        kind = opts.optimizer
        self.state_width = 2 * self.dim + 1 if kind == EMBEDDING_OPTIMIZERS["adam"] else 1

    # ---- queries (local)
    @property
    def local_rows(self):
        """How many rows this rank owns."""
        n = c_int64()
        check(lib.gradsync_embedding_shape(self.ptr, None, None, ctypes.byref(n)))
        return n.value

    @property
    def steps(self):
        """Pushes applied since creation, or as loaded from a checkpoint."""
        n = c_int64()
        check(lib.gradsync_embedding_steps(self.ptr, ctypes.byref(n)))
        return n.value

    def owner(self, ids):
        """The rank owning each id (int32 array)."""
        a = _ids(ids)
        out = np.empty(a.size, dtype=np.int32)
        check(lib.gradsync_embedding_owner(self.ptr, address(a), a.size, address(out)))
        return out

    def set_lr(self, lr):
        """Learning rate of later pushes (set the same on every rank)."""
        check(lib.gradsync_embedding_set_lr(self.ptr, float(lr)))
        self._options["lr"] = float(lr)

    def local_state(self):
        """(ids, values, state) of this rank's rows, ascending by id: copies. state is (n,) for
        "sgd" (zeros) and "row_adagrad"; (n, 2 * dim + 1) for "adam": m, v, then the row's update count."""
        n = self.local_rows
        ids = np.empty(n, dtype=np.int64)
        values = np.empty((n, self.dim), dtype=np.float32)
        state = np.empty(n if self.state_width == 1 else (n, self.state_width), dtype=np.float32)
        check(lib.gradsync_embedding_local_rows(self.ptr, address(ids), address(values), address(state), n))
        return ids, values, state

    # ---- collective calls
    def lookup(self, ids, out=None):
        """Rows of `ids` (any order, repeats allowed) as a (len(ids), dim) float32 array."""
        a = _ids(ids)
        if out is None:
            out = np.empty((a.size, self.dim), dtype=np.float32)
        o = numpy_array(out, "out", (np.float32,), True)
        check(lib.gradsync_embedding_lookup(self.ptr, address(a), a.size, address(o), o.size))
        return out

    def push(self, ids, grads):
        """One optimizer step: grads[i] is the gradient of row ids[i] (repeats are summed)."""
        a = _ids(ids)
        g = numpy_array(np.ascontiguousarray(grads, dtype=np.float32), "grads", (np.float32,), False)
        check(lib.gradsync_embedding_push(self.ptr, address(a), a.size, address(g), g.size))

    def save(self, directory):
        """Checkpoint every row and its optimizer state into `directory` (the same on every rank)."""
        check(lib.gradsync_embedding_save(self.ptr, _path(directory)))

    def save_incremental(self, directory):
        """Only the rows pushed since the checkpoint in `directory`, as a layer on it: the table's
        last save or load, or its save before that into another directory (two directories saved
        in turn each keep a chain of their own); E_MISUSE when it is neither, or no longer there."""
        check(lib.gradsync_embedding_save_incremental(self.ptr, _path(directory)))

    def load(self, directory):
        """Load a checkpoint written by any world size and sharding rule."""
        check(lib.gradsync_embedding_load(self.ptr, _path(directory)))

    def reshard(self, comm, sharding=None, checkpoint=None):
        """Collective over `comm`, the survivors' group (Communicator.shrink), a grown one
        (Communicator.grow, every joiner taking part with a table it made on comm with the members'
        options) or this table's own communicator with another `sharding` ("contiguous", "hash";
        None keeps the rule). When every old rank's rows live on a member, they move in memory,
        with their optimizer state, bit for bit, and so do a lost rank's when a member holds a
        replica of them (`replicas`). When a rank was lost otherwise, its rows' live state is
        gone: without `checkpoint` this raises E_LOST naming the rows, and nothing changes; with
        the last checkpoint's directory EVERY row and the step count come from it, so the table is
        as of that checkpoint and the caller replays its pushes since (`steps` says from where).
        A table in files (`directory`) moves to the new layout's files there, and the old
        layout's go. Returns (rows received from others, whether the rows came from the
        checkpoint)."""
        rule = _KEEP_SHARDING if sharding is None else _choice(sharding, SHARDINGS, "sharding")
        moved, restored = c_uint64(), c_int32()
        check(lib.gradsync_embedding_reshard(self.ptr, comm.ptr, rule, _path(checkpoint), ctypes.byref(moved),
                                             ctypes.byref(restored)))
        self._comm = comm
        if sharding is not None:
            self._options["sharding"] = sharding
        return moved.value, bool(restored.value)

    def __repr__(self):
        if not self._ptr:
            return "<gradsync.ShardedEmbeddingTable closed>"
        return f"<gradsync.ShardedEmbeddingTable {self.rows} x {self.dim}, {self.local_rows} rows here>"
