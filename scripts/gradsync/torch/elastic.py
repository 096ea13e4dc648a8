# SPDX-License-Identifier: Apache-2.0
"""Training that survives a lost rank in place: shrink the group, reshard the optimizer, go on.

In the manner of Horovod Elastic's State.commit/restore:

    import gradsync as gs, gradsync.torch as gst
    from gradsync.torch import elastic
    comm = gs.Communicator.from_env()                         # shm (python3 -m gradsync.run --elastic)
    opt = gst.ZeroRedundancyOptimizer(net.parameters(), comm, replicas=1)
    state = elastic.State(comm, net, opt, step=0)             # commits the starting point

    @elastic.run
    def train(state):
        while state.step < steps:
            x, y = batch(state.step, state.comm.rank, state.comm.size)   # derive the batch from step
            loss_fn(state.model(x), y).backward()
            state.optimizer.step()
            state.step += 1
            state.commit()

    train(state)

When a collective raises because a member is gone (GradsyncError E_REMOTE, E_TIMEOUT or
E_ABORTED), every survivor lands in State.recover, which
  1. shrinks the group (Communicator.shrink: one agreed failed set, dense new ranks),
  2. reshards a ZeroRedundancyOptimizer onto it in memory (ShardedParameter.reshard: the lost
     slices come from their replicas) and gathers the weights, or rebuilds a
     DistributedDataParallel's buckets on it,
  3. goes back to the last commit, the latest any survivor made (the others take it by broadcast:
     a survivor may have finished the failed step before the loss showed), and returns; run()
     then calls the training function again, which goes on from state.step.
A member lost during the recovery is left out by shrinking again.

What a commit holds, and so what a recovery goes back to:
  - the fields (step=0 and any other keyword of State: epoch, a data cursor), deep copies;
  - with DistributedDataParallel (or any module and a torch optimizer, every rank holding all of
    the state): the module's parameters and buffers and the optimizer's state_dict, copies in
    memory on every rank, as Horovod keeps them;
  - with ZeroRedundancyOptimizer: the module's buffers and the optimizer's update count. Its
    weights and moments are not copied: they live sliced in the library, and with replicas >= 1 a
    lost slice survives on a neighbour. They cannot go back either: when the loss showed only in
    the step's final gather, that step is applied on every survivor, and state.step then resumes
    one past the commit (fields other than step are the commit's). So with this optimizer,
    commit after every optimizer.step() and derive what a step needs from state.step.
  - with ShardedEmbedding / ShardedEmbeddingBag tables (found in the model, or passed as
    embeddings=, as beside a DistributedDataParallel): every row and its optimizer state, saved by
    each commit into checkpoint_dir (required then; a directory every rank sees). So a commit with
    tables, and State() which commits, is collective. Commits go into two generations in turn,
    checkpoint_dir/gen0 and gen1 (a subdirectory per table in each): a commit saves every table into
    the generation the last complete commit is not in, then rank 0 writes the marker
    checkpoint_dir/committed.json (atomically: a temporary file, fsync, rename, fsync of the
    directory), which names the run, the commit, its step, its generation and the tables' steps;
    every rank learns that it was written (committed() reads it; a recovery takes no other run's).
    Each generation keeps its own chain: its first save of a table is full, the next ones
    incremental layers on it (a full one every full_every of the generation's saves, and after the
    tables moved in memory). A loss at any point of a commit, between two tables' saves or before
    the marker, leaves the last complete commit whole in the other generation. recover goes back to
    the newest complete commit (one a survivor saw complete, or the one the marker names: every
    survivor holds it, as its last commit or as the one it was saving) and brings each table back to
    it: after a lost rank every row comes from its generation (a lost rank's rows exist nowhere
    else); when nobody was lost the rows move in memory and, if they moved on since (the failed
    step's pushes, a commit that did not complete), are read back from it. table.steps then agrees
    with the step of the commit; the tables, the fields and a DistributedDataParallel's weights and
    optimizer state are all that commit's, never a mix. With a ZeroRedundancyOptimizer whose failed
    step went through (above: a loss in the step's final gather, or during the commit that follows
    it), recover raises RuntimeError instead, as the tables cannot follow it.
Without replicas (and no checkpoint), the lost slices exist nowhere: recover raises the
GradsyncError E_LOST of the reshard, which names the lost ranges, and nothing is zeroed.

Growing back: a replacement rank calls join(join_name, build), which returns its State, while the
members call state.grow(join_name) at a step boundary; the joiner takes the latest commit and, from
the members, the parameters by broadcast, its optimizer slices and its tables' rows by reshard, in
memory (see Communicator.grow: over MPI and hier the members start the joiners, this program
again with GRADSYNC_JOIN set); the next two commits (one per generation)
save the tables in full on the grown group. `python3 -m gradsync.run --elastic --replace` starts a
replacement for each lost rank.
"""
import copy
import functools
import json
import os
import pickle
import time
import uuid

import numpy as np
import torch

from .._lib import E_ABORTED, E_REMOTE, E_TIMEOUT, GradsyncError
from ..embedding import ShardedEmbeddingTable
from . import DistributedDataParallel, ShardedEmbedding, ZeroRedundancyOptimizer, _check_same_model

__all__ = ["State", "run", "join", "committed", "RECOVERABLE"]

# The statuses of a collective that a lost member causes: recover() handles them.
RECOVERABLE = (E_REMOTE, E_TIMEOUT, E_ABORTED)


def _module_of(model):
    return model.module if isinstance(model, DistributedDataParallel) else model


class _Table:
    """A ShardedEmbedding of the state, and where its commits are saved."""

    def __init__(self, module, dirs):
        self.module = module
        self.dirs = dirs  # per generation: the directory its saves go to
        # Per generation: the incremental layers on the full save in its directory, when the table
        # can stack one more there (the directory holds one of its last two saves, or its last load,
        # and the table knows the rows pushed since: ShardedEmbeddingTable.save_incremental); None:
        # its next save there is a full one.
        self.chain = [None, None]


MARKER = "committed.json"  # in checkpoint_dir: the last commit whose tables were all saved, and where


def _marker_doc(checkpoint_dir):
    """The marker's contents (a dict), None when there is none."""
    try:
        with open(os.path.join(checkpoint_dir, MARKER), "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None


def _write_marker_file(checkpoint_dir, doc):
    """Atomically, and durably on return: a reader finds the old marker or the new one, whole."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    path = os.path.join(checkpoint_dir, MARKER)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(json.dumps(doc, indent=1).encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(checkpoint_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)  # the rename itself
    finally:
        os.close(fd)


def committed(checkpoint_dir):
    """The last complete commit of the tables a State saves into checkpoint_dir, as its marker
    says: {"run" (the State's name), "commit" (its number), "step", "table_steps", "generation",
    "layers", "directories" (one per table, in the order of State.embeddings: each a checkpoint
    ShardedEmbeddingTable.load reads)}, or None when there is none. Local: reads the marker only."""
    doc = _marker_doc(os.fspath(checkpoint_dir))
    if doc is None:
        return None
    return dict(doc, directories=[os.path.join(os.fspath(checkpoint_dir), d) for d in doc["directories"]])


def _broadcast_blob(comm, blob, root):
    """Collective: root's bytes on every rank (the collectives move numbers: a length, then words)."""
    n = np.array([len(blob) if comm.rank == root else 0], dtype=np.int64)
    comm.broadcast(n, root=root)
    words = np.zeros((int(n[0]) + 3) // 4, dtype=np.int32)
    if comm.rank == root:
        words.view(np.uint8)[:len(blob)] = np.frombuffer(blob, dtype=np.uint8)
    comm.broadcast(words, root=root)
    return words.view(np.uint8)[:int(n[0])].tobytes()


class State:
    """What a training run goes back to after losing a rank; see the module docstring.

    comm: this rank's Communicator (shm or threads: the transports that shrink). model: the module
    trained (a DistributedDataParallel, or the plain module a ZeroRedundancyOptimizer steps).
    optimizer: a ZeroRedundancyOptimizer, a torch optimizer, or None. fields: the counters to
    commit with it (step=0 unless given), read and written as attributes (state.step).
    embeddings: ShardedEmbedding modules outside the model (beside a DistributedDataParallel);
    those inside it are found. checkpoint_dir: required with any table (ValueError otherwise): a
    directory every rank sees, where commits save the tables (two generations and a marker: see
    the module docstring); full_every: a generation's saves of a table per full one (the others
    are incremental layers on it). The state is committed once here (collective with tables).
    state.comm, state.model and state.optimizer are the current ones (the communicator changes at
    each recovery); state.embeddings the tables' modules. state.recoveries lists what each recovery
    did and how long each phase took (see recover), state.grows each grow (see grow).
    """

    def __init__(self, comm, model=None, optimizer=None, *, embeddings=(), checkpoint_dir=None, full_every=64,
                 **fields):
        self._setup(comm, model, optimizer, embeddings, checkpoint_dir, full_every, fields)
        self.commit()

    @classmethod
    def _joiner(cls, comm, model, optimizer, embeddings, checkpoint_dir=None, full_every=64, **fields):
        """A joiner's State: its first commit stays local (its tables have nothing to save yet)."""
        self = cls.__new__(cls)
        self._setup(comm, model, optimizer, embeddings, checkpoint_dir, full_every, fields)
        self._commit = self._snapshot()
        return self

    def _setup(self, comm, model, optimizer, embeddings, checkpoint_dir, full_every, fields):
        self.comm = comm
        self.model = model
        self.optimizer = optimizer
        fields.setdefault("step", 0)
        self._names = list(fields)
        for k, v in fields.items():
            setattr(self, k, v)
        self.recoveries = []
        self.grows = []
        self._commit = None
        self._pending_first_step = None
        # With tables, a commit is numbered (the same on every rank) and saved into one of two
        # generations of directories, the other one than the last commit's (see _save_tables); its
        # snapshot then holds "commit", "generation" and, once saved, each table's "layers" there.
        self._seq = 0
        self._pending = None  # the commit whose tables are being saved
        found = list(_module_of(model).modules()) if model is not None else []
        modules = []
        for m in found + list(embeddings):
            if isinstance(m, ShardedEmbedding) and all(m is not n for n in modules):
                modules.append(m)
        if modules and checkpoint_dir is None:
            raise ValueError(f"State: the model holds {len(modules)} ShardedEmbedding table(s): pass checkpoint_dir=, "
                             "a directory every rank sees, where each commit saves them (after a lost rank every "
                             "row comes back from there)")
        if int(full_every) < 1:
            raise ValueError(f"State: full_every must be >= 1, got {full_every}")
        self.checkpoint_dir = checkpoint_dir
        self.full_every = int(full_every)
        self._tables = [_Table(m, [os.path.join(os.fspath(checkpoint_dir), f"gen{g}", f"embedding{i}") for g in (0, 1)])
                        for i, m in enumerate(modules)]

    @property
    def embeddings(self):
        """The ShardedEmbedding modules whose tables this state commits and moves (found in the
        model, and those passed as embeddings=), in that order."""
        return [t.module for t in self._tables]

    @property
    def sharded(self):
        """Whether the optimizer keeps its state sliced over the ranks (a ZeroRedundancyOptimizer)."""
        return isinstance(self.optimizer, ZeroRedundancyOptimizer)

    # ---- commit and restore (local)

    def commit(self):
        """Remember the fields and the state they describe (see the module docstring). Local, except
        with ShardedEmbedding tables: then collective, as it saves every table into checkpoint_dir
        (GradsyncError as a collective's when that fails: elastic.run recovers). The first commit
        after a recovery also completes that recovery's figures (first_step_s)."""
        c = self._snapshot()
        if self._tables:
            self._save_tables(c)
        self._commit = c
        if self._pending_first_step is not None:
            r, started = self._pending_first_step
            now = time.monotonic_ns()
            r["first_step_s"] = (now - started) / 1e9
            r["first_step_done_ns"] = now
            self._pending_first_step = None

    def _snapshot(self):
        """Local copies of what a commit holds."""
        module = _module_of(self.model)
        c = {"fields": copy.deepcopy({k: getattr(self, k) for k in self._names})}
        if module is not None:
            if self.sharded:
                c["buffers"] = [b.detach().clone() for b in module.buffers()]
            else:
                c["module"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
        if self.sharded:
            c["updates"] = self.optimizer.shard.updates
        elif self.optimizer is not None:
            c["optimizer"] = copy.deepcopy(self.optimizer.state_dict())
        c["table_steps"] = [t.module.table.steps for t in self._tables]
        return c

    def _save_tables(self, c):
        """Collective: every table into the generation the last complete commit is not in, then the
        marker names this commit. A loss before the marker's rename leaves the last commit's
        generation whole; once every table's save returned on rank 0, every rank wrote every part
        and rank 0 every manifest (each save ends in an agreement of all ranks). Each generation
        keeps its own chain: a full save, then incremental layers, each on the table's save there
        two commits before (save_incremental knows the rows pushed since either of the last two)."""
        first = self._commit is None or "generation" not in self._commit
        g = 0 if first else 1 - self._commit["generation"]
        # The run's name, in the marker: one a State of an earlier run left in checkpoint_dir is not ours.
        run = uuid.uuid4().hex.encode() if first and self.comm.rank == 0 else b""
        c["run"] = _broadcast_blob(self.comm, run, 0).decode() if first else self._commit["run"]
        c["commit"], c["generation"] = self._seq, g
        self._seq += 1
        self._pending = c
        for t in self._tables:
            layers, t.chain[g] = t.chain[g], None
            if layers is not None and layers + 1 < self.full_every:
                t.module.table.save_incremental(t.dirs[g])
                t.chain[g] = layers + 1
            else:
                t.module.table.save(t.dirs[g])
                t.chain[g] = 0
        c["layers"] = [t.chain[g] for t in self._tables]
        # Still pending: rank 0 may write the marker and be lost before the others learn it, who
        # then find this commit named there (see _choose_commit).
        self._write_marker(self.comm, c)
        self._pending = None

    def _write_marker(self, comm, c):
        """Collective over comm: rank 0 writes the marker naming commit c; every rank raises rank 0's
        error if that fails."""
        root = os.fspath(self.checkpoint_dir)
        error = b""
        if comm.rank == 0:
            g = c["generation"]
            try:  # rank 0's failure, whatever it is, must reach the others waiting below
                doc = {"format": 1, "run": c["run"], "commit": c["commit"], "generation": g,
                       "step": int(c["fields"]["step"]), "table_steps": c["table_steps"], "layers": c["layers"],
                       "directories": [os.path.relpath(t.dirs[g], root) for t in self._tables]}
                _write_marker_file(root, doc)
            except (OSError, TypeError, ValueError) as e:
                error = f"{type(e).__name__}: {e}".encode()
        error = _broadcast_blob(comm, b"ok" + error, 0)[2:]
        if error:
            raise OSError(f"elastic: rank 0 could not write the commit marker in {root}: {error.decode()}")

    def restore(self):
        """Local: back to the last commit (the fields, and the parameters, buffers and optimizer
        state a commit copies; a ZeroRedundancyOptimizer's sliced state and the tables stay where
        they are: only recover, collective, brings tables back)."""
        c = self._commit
        for k, v in copy.deepcopy(c["fields"]).items():
            setattr(self, k, v)
        module = _module_of(self.model)
        with torch.no_grad():
            if "module" in c:
                module.load_state_dict(c["module"])
            for b, saved in zip(module.buffers() if "buffers" in c else (), c.get("buffers", ())):
                b.copy_(saved)
        if "optimizer" in c:
            self.optimizer.load_state_dict(copy.deepcopy(c["optimizer"]))

    # ---- recovery (collective over the survivors)

    def recover(self, error=None):
        """Collective over the survivors, after `error` (a GradsyncError whose status is in
        RECOVERABLE) showed that a member may be gone: shrink, reshard or rebuild, go back to the
        latest commit (when nobody was lost, failed holds only empty lists: see run). Returns this
        recovery's record, also appended to state.recoveries: failed (the lost members' ranks in
        each group shrunk, a list per shrink), size (the new group's), attempts, and the phases'
        times in seconds: shrink_s (agree_s + form_s of it: agreeing on the failed set, forming the
        group), reshard_s (the optimizer's slices and the tables), rebuild_s (DDP's buckets),
        sync_s (the commit to every survivor), total_s; table_moved_rows, tables_restored (from
        their save, after a loss) and tables_loaded (read back after moving in memory), generation
        (the one the tables came back from; with tables only); error_ns
        (time.monotonic_ns() when recover began) and, after the next commit, first_step_s.
        Raises GradsyncError E_LOST (naming the ranges) when optimizer state lived only on lost
        ranks, RuntimeError when the tables cannot go back with the rest (see the module
        docstring), and any error that is not a lost member's."""
        started = time.monotonic_ns()
        if error is not None and not (isinstance(error, GradsyncError) and error.status in RECOVERABLE):
            raise error
        record = {"error": None if error is None else str(error), "error_ns": started, "failed": [],
                  "attempts": 0, "agree_s": 0.0, "form_s": 0.0, "shrink_s": 0.0, "reshard_s": 0.0,
                  "rebuild_s": 0.0, "sync_s": 0.0, "moved_floats": 0,
                  "table_moved_rows": 0, "tables_restored": 0, "tables_loaded": 0}
        old = [self.comm]  # every group left behind; closed once the state has moved off them
        while True:
            t = time.perf_counter()
            new, failed, info = old[-1].shrink()
            record["shrink_s"] += time.perf_counter() - t
            record["failed"].append(failed)
            record["attempts"] += info["attempts"]
            record["agree_s"] += info["agree_s"]
            record["form_s"] += info["form_s"]
            try:
                self._move_to(new, record)
                break
            except GradsyncError as e:
                if e.status not in RECOVERABLE:
                    new.close()
                    for c in old[1:]:  # the groups shrunk on the way; self.comm stays the caller's
                        c.close()
                    raise
                old.append(new)  # another member lost on the way: shrink again
        for c in old:
            c.close()
        record["size"] = self.comm.size
        record["rank"] = self.comm.rank
        record["member_id"] = self.comm.member_id
        record["total_s"] = (time.monotonic_ns() - started) / 1e9
        self.recoveries.append(record)
        self._pending_first_step = (record, time.monotonic_ns())
        return record

    def _move_to(self, comm, record):
        """Collective over comm: the optimizer's state and the model's buckets onto comm, then the
        latest commit on every member. Changes nothing of self.comm's until it succeeds."""
        if self.sharded:
            t = time.perf_counter()
            record["moved_floats"] += self.optimizer.shard.reshard(comm)
            # The failed step's gather may have left the weights half written.
            self.optimizer.shard.gather(self.optimizer._weights.numpy())
            record["reshard_s"] += time.perf_counter() - t
        if self._tables:
            t = time.perf_counter()
            self._recover_tables(comm, record)
            record["reshard_s"] += time.perf_counter() - t
        if isinstance(self.model, DistributedDataParallel):
            t = time.perf_counter()
            self.model._attach(comm)
            record["rebuild_s"] += time.perf_counter() - t
        t = time.perf_counter()
        self._sync(comm)
        record["sync_s"] += time.perf_counter() - t
        self.comm = comm

    def _choose_commit(self, comm):
        """Collective over comm: the last complete commit, which becomes self._commit: the newest that
        a member saw complete (its last commit) or that the marker names (rank 0 writes it last, and
        may be lost after). Every member holds it, as its last commit or as the one it was saving.
        The marker is brought in line, as the next commit goes into the other generation."""
        held = [self._commit, self._pending]
        marked = -1
        if comm.rank == 0:
            try:
                doc = _marker_doc(os.fspath(self.checkpoint_dir))
                if doc["run"] in [c.get("run") for c in held if c is not None]:
                    marked = int(doc["commit"])
            except (OSError, ValueError, KeyError, TypeError):
                pass  # none (TypeError), or unreadable: the members know a complete commit, and rewrite it
        mine = np.array([-1 if c is None else c.get("commit", -1) for c in held] + [marked], dtype=np.int64)
        every = comm.allgatherv(mine, [3] * comm.size).reshape(comm.size, 3)
        chosen = int(max(every[:, 0].max(), every[0, 2]))
        if chosen < 0:
            raise RuntimeError("elastic: no commit of the tables is complete (a loss during the first commit's saves)")
        lacking = [r for r in range(comm.size) if chosen not in every[r, :2]]
        if lacking:
            raise RuntimeError(f"elastic: commit {chosen} of the tables is complete, but members {lacking} do not "
                               "hold it")
        self._commit = next(c for c in held if c is not None and c.get("commit") == chosen)
        self._pending = None
        if every[0, 2] != chosen:
            self._write_marker(comm, self._commit)
        return self._commit

    def _recover_tables(self, comm, record):
        """Collective over comm: every table onto comm as the last complete commit's generation holds
        it. Rows lost: all come from there (reshard). Nobody's rows lost: they move in memory, then
        are read back from there if the table is at another step (pushes of the failed step, a
        commit that did not complete); ranks at different steps (a push that failed on some only)
        cannot move as one table: each makes a like one on comm and reads it."""
        entry = self._choose_commit(comm)
        g = record["generation"] = entry["generation"]
        n = len(self._tables)
        mine = np.array([t.module.table.steps for t in self._tables], dtype=np.int64)
        every = comm.allgatherv(mine, [n] * comm.size).reshape(comm.size, n)
        for i, t in enumerate(self._tables):
            table, d, want = t.module.table, t.dirs[g], entry["table_steps"][i]
            steps = every[:, i]
            t.chain = [None, None]
            if (steps == steps[0]).all():
                moved, restored = table.reshard(comm, checkpoint=d)
                record["table_moved_rows"] += moved
                if restored:
                    t.chain[g] = entry["layers"][i]
                    record["tables_restored"] += 1
                elif steps[0] != want:  # no push since means the same rows; a push, other rows
                    table.load(d)
                    t.chain[g] = entry["layers"][i]
                    record["tables_loaded"] += 1
            else:
                if table._options["directory"] is not None:
                    table.close()  # its files may be the like table's (same rank and size): let go of them first
                try:
                    fresh = ShardedEmbeddingTable(comm, table.rows, table.dim, **table._options)
                except BaseException:
                    if table._options["directory"] is not None:
                        t.module.table = None  # closed: a failure here leaves no table to use
                    raise
                try:
                    fresh.load(d)
                except BaseException:
                    if table._options["directory"] is None:
                        fresh.close()
                        raise
                    t.module.table = fresh  # closed the old one: this one, on comm, reads it again
                    raise
                t.module.table = fresh
                table.close()
                t.chain[g] = entry["layers"][i]
                record["tables_loaded"] += 1
            if t.module.table.steps != want:
                raise RuntimeError(f"elastic: table {i} in {d} is at step {t.module.table.steps}, the commit "
                                   f"the marker names there at {want}")

    def _admit_tables(self, comm):
        """Collective over a grown comm: the members' tables move in memory onto it, a joiner's (made
        on comm by its build) take their rows; the members' learning rates first, as a joiner made
        its tables with the starting ones."""
        # Even with none: a joiner cannot tell whether the members keep tables.
        lrs = pickle.loads(_broadcast_blob(comm, pickle.dumps([t.module.table._options["lr"]
                                                                for t in self._tables]), 0))
        if len(lrs) != len(self._tables):
            raise ValueError(f"join: the members keep {len(lrs)} ShardedEmbedding table(s), this joiner's build "
                             f"made {len(self._tables)}")
        for t, lr in zip(self._tables, lrs):
            if lr != t.module.table._options["lr"]:
                t.module.table.set_lr(lr)
            t.module.table.reshard(comm)
            t.chain = [None, None]  # a joiner never saved; a member's in-memory reshard needs full saves next

    def _sync(self, comm):
        """Collective: every member takes the commit of the member that committed last (the lowest
        rank among equals), and a ZeroRedundancyOptimizer's step count decides state.step. With
        tables, every member holds the same, the one _choose_commit chose."""
        self._pending = None
        self.restore()
        c = self._commit
        mine = np.array([c["fields"]["step"], c.get("updates", 0)], dtype=np.int64)
        every = comm.allgatherv(mine, [2] * comm.size).reshape(comm.size, 2)
        source = int(np.lexsort((np.arange(comm.size), -every[:, 0]))[0])
        blob = pickle.dumps({k: v for k, v in c.items() if k not in ("module", "buffers")})
        theirs = pickle.loads(_broadcast_blob(comm, blob, source))
        module = _module_of(self.model)
        with torch.no_grad():
            tensors = []
            if module is not None:
                tensors = list(module.buffers()) if self.sharded else list(module.state_dict().values())
            for t in tensors:
                comm.broadcast(t.detach().numpy(), root=source)
        # A joiner may not name every field the members keep (join(**fields)): it takes theirs too.
        self._names += [k for k in theirs["fields"] if k not in self._names]
        for k, v in theirs["fields"].items():
            setattr(self, k, v)
        if "optimizer" in theirs:
            self.optimizer.load_state_dict(theirs["optimizer"])
        if self.sharded:
            # The optimizer's steps cannot go back: the count the survivors share goes on.
            self.step = theirs["fields"]["step"] + self.optimizer.shard.updates - theirs["updates"]
            if self._tables and self.step != theirs["fields"]["step"]:
                raise RuntimeError(f"elastic: the optimizer applied step {theirs['fields']['step']} on every "
                                   "survivor, which the tables, back at the commit, cannot follow")
        self._commit = self._snapshot()
        # Where the tables' commit is (a joiner's generation, commit number and layers are the members').
        for k in ("run", "commit", "generation", "layers"):
            if k in theirs:
                self._commit[k] = theirs[k]
        if "commit" in theirs:
            self._seq = theirs["commit"] + 1

    def grow(self, join_name, joiners=1):
        """Collective over the members, at a step boundary (after a commit): let `joiners` new ranks
        in, which call join() with the same join_name; they take the parameters and the commit by
        broadcast, and a ZeroRedundancyOptimizer's slices and the tables' rows (with the members'
        learning rates) by reshard, in memory (Communicator.grow).
        Returns this grow's record, also appended to state.grows: size,
        first_member_id, and the phases' times in seconds: grow_s (agree_s + form_s of it, and
        waiting for the joiners to come), admit_s (state onto the grown group), total_s.
        On failure this group is stopped, as after a failed collective (see Communicator.grow)."""
        started = time.monotonic_ns()
        new, info = self.comm.grow(join_name, joiners)
        grown = time.monotonic_ns()
        try:
            if self.sharded:
                # The members' side of the joiners' ZeroRedundancyOptimizer(joining=True).
                opt = self.optimizer
                _check_same_model(opt._params, new, opt._agreed, who="ZeroRedundancyOptimizer")
                new.broadcast(opt._weights.numpy(), root=0)
                # The learning rate is in the slices' configuration: the joiners built theirs with
                # the starting one. Both the one applied and the one param_groups holds for the next step.
                new.broadcast(np.array([opt._lr, opt.param_groups[0]["lr"]], dtype=np.float64), root=0)
                opt.shard.reshard(new)
            if isinstance(self.model, DistributedDataParallel):
                self.model._attach(new)  # the members' side of the joiners' DistributedDataParallel
            self._admit_tables(new)
            self._sync(new)
        except BaseException:
            new.close()
            raise
        self.comm.close()
        self.comm = new
        done = time.monotonic_ns()
        record = {"size": new.size, "first_member_id": info["first_member_id"], "agree_s": info["agree_s"],
                  "form_s": info["form_s"], "grow_s": (grown - started) / 1e9, "admit_s": (done - grown) / 1e9,
                  "total_s": (done - started) / 1e9}
        self.grows.append(record)
        return record


def join(join_name, build, index=0, joiners=1, timeout_ms=None, transport=None, **fields):
    """Join a running training group as a new rank (the other side of State.grow): returns its
    State, at the members' latest commit. build(comm, joining=True) makes the model and optimizer
    on the grown group as every rank made them at the start (the same calls, in the same order:
    a DistributedDataParallel, or a ZeroRedundancyOptimizer(..., joining=joining)) and returns
    (model, optimizer), or (model, optimizer, embeddings) with ShardedEmbedding modules outside the
    model, made on comm as the members made theirs (their rows then come from the members).
    fields: as State's, checkpoint_dir and full_every included. Waits up to timeout_ms (default: GRADSYNC_TIMEOUT_MS,
    else the library's) for the members to grow (Communicator.join: index among the joiners, their
    count, transport: default GRADSYNC_TRANSPORT, else "shm"; over MPI and hier, a process that the
    members' State.grow started, GRADSYNC_JOIN naming the join)."""
    from .. import Communicator
    from ..run import arm_parent_death

    arm_parent_death()  # a replacement of gradsync.run --replace dies with the launcher, as the ranks do

    if timeout_ms is None and "GRADSYNC_TIMEOUT_MS" in os.environ:
        timeout_ms = int(os.environ["GRADSYNC_TIMEOUT_MS"])
    if transport is None:
        transport = os.environ.get("GRADSYNC_TRANSPORT", "shm")
    comm, info = Communicator.join(join_name, index, joiners, timeout_ms=timeout_ms, transport=transport)
    try:
        built = build(comm, joining=True)
        model, optimizer = built[0], built[1]
        embeddings = built[2] if len(built) > 2 else ()
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            lr = np.zeros(2, dtype=np.float64)
            comm.broadcast(lr, root=0)  # State.grow's: the members' learning rate
            if float(lr[0]) != optimizer._lr:
                optimizer.shard.set_lr(float(lr[0]))
                optimizer._lr = float(lr[0])
            optimizer.param_groups[0]["lr"] = float(lr[1])
            optimizer.shard.reshard(comm)
        state = State._joiner(comm, model, optimizer, embeddings, **fields)
        state._admit_tables(comm)
        state._sync(comm)
    except BaseException:
        comm.close()
        raise
    state.joined = info
    return state


def run(fn):
    """Decorator: fn(state, ...) is called again after each recovery from a lost member, until it
    returns (its value is returned). Errors that no lost member caused propagate: a status not in
    RECOVERABLE at once, and a RECOVERABLE one once its recovery found nobody lost (a slow peer's
    timeout, a grow nobody joined, an abort of this rank's own); state.comm is then the same
    members' new group, at the latest commit."""

    @functools.wraps(fn)
    def wrapper(state, *args, **kwargs):
        while True:
            try:
                return fn(state, *args, **kwargs)
            except GradsyncError as e:
                if e.status not in RECOVERABLE:
                    raise
                record = state.recover(e)
                if not any(record["failed"]):
                    raise  # the same error again would come after every retry

    return wrapper
