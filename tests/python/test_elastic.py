# SPDX-License-Identifier: Apache-2.0
"""Shrink, grow, member ids and reshard through ctypes: threads (a rank closes its communicator and
goes; a joiner thread grows the group back) and shm processes (a real SIGKILL); the training
continues bit for bit like a run that never lost a rank."""
import multiprocessing as mp
import os
import signal
import uuid

import numpy as np
import pytest

import gradsync as gs
from conftest import run_ranks

TOTAL, STEPS, LOSS_AT = 517, 8, 3


def grad(step):
    # Multiples of 1/256: the mean over any number of ranks is exact, so any group size gives the same bits.
    return (((np.arange(TOTAL) * 7 + step * 13) % 17) - 8).astype(np.float32) / 256


def train(comm, lost=(), replicas=1):
    shard = gs.ShardedParameter(comm, TOTAL, optimizer="adam", lr=0.01, replicas=replicas)
    w = (np.arange(TOTAL) % 100).astype(np.float32) / 100
    shard.init(w)
    step = 0
    while step < STEPS:
        if step == LOSS_AT and lost:
            if comm.rank in lost:
                return None
            with pytest.raises(gs.GradsyncError):
                shard.step(grad(step), w)
            new, failed, info = comm.shrink()
            assert failed == sorted(lost) and info["attempts"] >= 1
            assert new.size == comm.size - len(lost)
            assert new.member_id == comm.member_id
            shard.reshard(new)
            comm.close()
            comm = new
            assert shard.updates == LOSS_AT
        shard.step(grad(step), w)
        step += 1
    return w.copy(), comm.member_id, comm.rank


def test_shrink_and_reshard_on_threads():
    ref = run_ranks(4, lambda c, r: train(c))
    got = run_ranks(4, lambda c, r: train(c, lost=(2,)))
    for r in (0, 1, 3):
        w, member, rank = got[r]
        assert member == r and rank == (r if r < 2 else r - 1)
        assert np.array_equal(w.view(np.uint32), ref[0][0].view(np.uint32))
    assert got[2] is None


def test_restored_from_a_checkpoint_of_another_size_the_replicas_survive_a_loss():
    # A checkpoint of 2 ranks (no replicas) at step 2, restored on 4 with a replica each: rank 2
    # is lost at step 3, and the survivors' reshard rebuilds its slice from the replica that the
    # restore filled. The weights end as a 4-rank run's that never stopped.
    def checkpoint(comm, rank):
        shard = gs.ShardedParameter(comm, TOTAL, optimizer="adam", lr=0.01)
        w = (np.arange(TOTAL) % 100).astype(np.float32) / 100
        shard.init(w)
        for step in range(2):
            shard.step(grad(step), w)
        counts = [n for _, n in shard.ranges()]
        m, v = (comm.allgatherv(shard.read_slice(s), counts) for s in ("state1", "state2"))
        return w, m, v, shard.updates

    saved = run_ranks(2, checkpoint)[0]

    def resumed(comm, rank):
        shard = gs.ShardedParameter(comm, TOTAL, optimizer="adam", lr=0.01, replicas=1)
        w, m, v, updates = (x.copy() if isinstance(x, np.ndarray) else x for x in saved)
        shard.restore(w, m, v, updates=updates)
        for step in range(2, STEPS):
            if step == LOSS_AT:
                if rank == 2:
                    return None
                with pytest.raises(gs.GradsyncError):
                    shard.step(grad(step), w)
                new, failed, _ = comm.shrink()
                assert failed == [2]
                shard.reshard(new)
                comm.close()
                comm = new
            shard.step(grad(step), w)
        return w

    ref = run_ranks(4, lambda c, r: train(c))[0][0]
    for r, w in enumerate(run_ranks(4, resumed)):
        assert (w is None) == (r == 2)
        if w is not None:
            assert np.array_equal(w.view(np.uint32), ref.view(np.uint32))


def test_reshard_without_replicas_names_the_lost_range():
    def body(comm, rank):
        shard = gs.ShardedParameter(comm, TOTAL, optimizer="sgd", replicas=0)
        shard.init(np.zeros(TOTAL, np.float32))
        if rank == 1:
            return None
        w = np.zeros(TOTAL, np.float32)
        with pytest.raises(gs.GradsyncError):
            shard.step(grad(0), w)
        new, failed, _ = comm.shrink()
        assert failed == [1]
        with pytest.raises(gs.GradsyncError) as e:
            shard.reshard(new)
        new.close()
        return e.value.status, str(e.value)

    out = run_ranks(3, body)
    for r in (0, 2):
        status, message = out[r]
        assert status == -19  # GRADSYNC_E_LOST
        assert "old rank 1" in message


def _shm_member(group, rank, q):
    # q is this rank's own pipe: a multiprocessing.Queue's write lock is shared by every writer,
    # and a rank killed while its feeder thread holds it would block the survivors' reports.
    try:
        with gs.Communicator(group, rank, 3, timeout_ms=20000, transport="shm") as comm:
            x = np.ones(4, np.float32)
            comm.allreduce(x)
            q.send(("ready", rank))
            if rank == 1:
                signal.pause()
            while True:
                try:
                    comm.allreduce(x)
                except gs.GradsyncError:
                    break
            new, failed, _ = comm.shrink()
            y = np.full(1, float(new.member_id), np.float64)
            y = new.allreduce(y, op="sum")
            q.send(("done", rank, failed, new.rank, new.size, float(y[0])))
            new.close()
    except BaseException as e:  # reported to the test
        q.send(("error", rank, repr(e)))


def test_shrink_after_sigkill_on_shm():
    ctx = mp.get_context("fork")
    pipes = [ctx.Pipe(duplex=False) for _ in range(3)]
    group = f"py-shrink-{uuid.uuid4().hex[:8]}"
    procs = [ctx.Process(target=_shm_member, args=(group, r, pipes[r][1])) for r in range(3)]
    for p in procs:
        p.start()

    def get(r):
        assert pipes[r][0].poll(60), f"rank {r} sent nothing within 60 s"
        return pipes[r][0].recv()

    for r in range(3):
        assert get(r)[0] == "ready"
    os.kill(procs[1].pid, signal.SIGKILL)
    done = [get(r) for r in (0, 2)]
    for p in procs:
        p.join(timeout=60)
    for d in done:
        assert d[0] == "done", d
        _, rank, failed, new_rank, new_size, ids = d
        assert failed == [1] and new_size == 2 and new_rank == (0 if rank == 0 else 1) and ids == 2.0


GROW_AT = 6
STEPS_GROWN = 10


def _grow_member(comm, join_name, disturbed):
    shard = gs.ShardedParameter(comm, TOTAL, optimizer="adam", lr=0.01, replicas=1)
    w = (np.arange(TOTAL) % 100).astype(np.float32) / 100
    shard.init(w)
    groups = [comm]
    for step in range(STEPS_GROWN):
        if disturbed and step == LOSS_AT:
            if comm.rank == 2:
                return None
            with pytest.raises(gs.GradsyncError):
                shard.step(grad(step), w)
            comm, _, _ = comm.shrink()
            groups.append(comm)
            shard.reshard(comm)
        if disturbed and step == GROW_AT:
            comm, info = comm.grow(join_name, 1)
            groups.append(comm)
            assert (info["old_size"], info["new_size"], info["first_member_id"]) == (3, 4, 4)
            comm.broadcast(w, root=0)
            shard.reshard(comm)
        shard.step(grad(step), w)
    result = w.copy(), comm.member_id, comm.rank
    for g in groups[1:]:
        g.close()
    return result


def test_shrink_then_grow_on_threads_matches_an_undisturbed_run():
    import threading

    join_name = f"py-grow-{uuid.uuid4().hex[:8]}"
    joined = {}

    def joiner():
        comm, info = gs.Communicator.join(join_name, 0, 1, timeout_ms=60000)
        with comm:
            w = np.full(TOTAL, np.nan, np.float32)
            comm.broadcast(w, root=0)  # the parameters, from a member
            shard = gs.ShardedParameter(comm, TOTAL, optimizer="adam", lr=0.01, replicas=1)
            assert shard.reshard(comm) > 0  # its optimizer slice, from the members
            assert shard.updates == GROW_AT
            for step in range(GROW_AT, STEPS_GROWN):
                shard.step(grad(step), w)
            joined.update(rank=comm.rank, member_id=comm.member_id, info=info, w=w.copy())

    ref = run_ranks(4, lambda c, r: _grow_member(c, join_name, False))
    t = threading.Thread(target=joiner)
    t.start()
    got = run_ranks(4, lambda c, r: _grow_member(c, join_name, True))
    t.join(timeout=60)
    assert joined["rank"] == 3 and joined["member_id"] == 4  # after the old ranks; id 2 is not reused
    assert joined["info"]["old_size"] == 3
    for r in (0, 1, 3):
        w, member, rank = got[r]
        assert member == r and rank == (r if r < 2 else r - 1)
        assert np.array_equal(w.view(np.uint32), ref[0][0].view(np.uint32))
    assert np.array_equal(joined["w"].view(np.uint32), ref[0][0].view(np.uint32))


def test_grow_failures_on_threads():
    def body(comm, rank):
        with pytest.raises(gs.GradsyncError) as e:
            comm.grow("py-grow-nobody-" + comm_tag, 1)
        with pytest.raises(gs.GradsyncError):
            comm.allreduce(np.ones(1, np.float32))
        comm.reset()
        assert comm.allreduce(np.ones(1, np.float32), op="sum")[0] == 2.0
        return e.value.status

    comm_tag = uuid.uuid4().hex[:8]
    statuses = run_ranks(2, body, timeout_ms=300)
    assert set(statuses) <= {gs.E_TIMEOUT, gs.E_ABORTED} and gs.E_TIMEOUT in statuses  # E_ABORTED: heard first
    with pytest.raises(gs.GradsyncError) as e:
        gs.Communicator.join("py-grow-never-" + comm_tag, 0, 1, timeout_ms=100)
    assert e.value.status == gs.E_TIMEOUT
