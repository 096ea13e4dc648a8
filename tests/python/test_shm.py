# SPDX-License-Identifier: Apache-2.0
"""The shared-memory transport from Python: real processes (multiprocessing, spawn), same API."""
import multiprocessing as mp
import os
import signal
import uuid

import numpy as np
import pytest

import gradsync as gs

BOUND_S = 60  # no test can hang: every process is joined with this bound, then killed


def _group(tag):
    return f"py-{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _run(target, nranks, *args):
    """Starts nranks spawned processes target(rank, nranks, queue, *args); returns {rank: result}, exit codes."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, nranks, queue) + args) for r in range(nranks)]
    for p in procs:
        p.start()
    results = {}
    try:
        for p in procs:
            p.join(BOUND_S)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
                pytest.fail(f"a rank still ran after {BOUND_S} s")
        while not queue.empty():
            rank, value = queue.get(timeout=5)
            results[rank] = value
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return results, [p.exitcode for p in procs]


def _seed(rank, size, queue, group):
    with gs.Communicator(group, rank, size, timeout_ms=20000, transport="shm") as comm:
        plain = np.array([2.0, 4.0] if rank == 0 else [4.0, 8.0], dtype=np.float32)
        comm.allreduce(plain, op="mean")
        shared = comm.empty(2, np.float32)
        shared[:] = [2.0, 4.0] if rank == 0 else [4.0, 8.0]
        comm.allreduce(shared, op="mean")
        queue.put((rank, (plain.tolist(), shared.tolist(), comm.transport)))


def test_seed_two_ranks_mean_both_data_paths():
    results, codes = _run(_seed, 2, _group("seed"))
    assert codes == [0, 0]
    for rank in range(2):
        plain, shared, transport = results[rank]
        assert plain == [3.0, 6.0] and shared == [3.0, 6.0]
        assert transport == gs.TRANSPORT_SHM and transport == "shm"  # a name, through pickling too


def _seed3(rank, size, queue, group):
    with gs.Communicator(group, rank, size, timeout_ms=20000, transport="shm") as comm:
        v = np.full(7 if rank == 1 else 4, 2.0 + rank, dtype=np.float32)
        try:
            comm.allreduce(v)
            status = gs.OK
        except gs.GradsyncError as e:
            status = e.status
        w = np.full(4, [2.0, 4.0, 3.0][rank], dtype=np.float32)
        comm.allreduce(w)
        queue.put((rank, (status, w.tolist())))


def test_seed_three_ranks_lengths_mismatch_then_a_round_works():
    results, codes = _run(_seed3, 3, _group("seed3"))
    assert codes == [0, 0, 0]
    for rank in range(3):
        status, w = results[rank]
        assert status == gs.E_MISMATCH
        assert w == [3.0] * 4


def _collectives(rank, size, queue, group):
    with gs.Communicator(group, rank, size, timeout_ms=20000, transport="shm") as comm:
        n = 1_000_003  # several pipeline chunks, not divisible by the ranks
        x = np.arange(n, dtype=np.float64) * (rank + 1)
        total = comm.allreduce(x.copy(), op="sum")
        zero_copy = comm.empty(n, np.float64)
        zero_copy[:] = x
        comm.allreduce(zero_copy, op="sum")
        part = comm.reduce_scatter(x, op="max")
        gathered = comm.allgather(np.zeros(n, dtype=np.float64), part=part)
        b = np.full(10, float(rank), dtype=np.float32)
        comm.broadcast(b, root=size - 1)
        queue.put((rank, (float(total[12345]), bool(np.array_equal(total, zero_copy)),
                          float(gathered[n - 1]), b.tolist())))


def test_collectives_across_three_processes():
    results, codes = _run(_collectives, 3, _group("coll"))
    assert codes == [0, 0, 0]
    for rank in range(3):
        t, same, last, b = results[rank]
        assert t == 12345.0 * 6 and same
        assert last == (1_000_002) * 3.0
        assert b == [2.0] * 10


def _killed(rank, size, queue, group):
    with gs.Communicator(group, rank, size, timeout_ms=60000, transport="shm") as comm:
        grad = np.ones(1 << 20, dtype=np.float32)
        comm.barrier()
        if rank == 1:
            comm.allreduce(grad)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            for _ in range(100000):
                comm.allreduce(grad)
            status, message = gs.OK, ""
        except gs.GradsyncError as e:
            status, message = e.status, e.message
    # The survivors form a new group of the same name.
    with gs.Communicator(group, 0 if rank == 0 else 1, size - 1, timeout_ms=20000, transport="shm") as comm:
        v = np.ones(3, dtype=np.float32)
        comm.allreduce(v, op="sum")
    queue.put((rank, (status, message, v.tolist())))


def test_a_killed_rank_is_reported_and_survivors_regroup():
    results, codes = _run(_killed, 3, _group("kill"))
    assert codes[1] == -signal.SIGKILL
    assert codes[0] == 0 and codes[2] == 0
    for rank in (0, 2):
        status, message, v = results[rank]
        assert status == gs.E_REMOTE, message
        assert "rank 1" in message and "died" in message
        assert v == [2.0, 2.0, 2.0]


def _late(rank, size, queue, group, timed_out):
    # The timeout also bounds joining, so it must cover the skew of spawning two interpreters.
    with gs.Communicator(group, rank, size, timeout_ms=4000, transport="shm") as comm:
        statuses = []
        if rank == 1:
            # Never arrives at rank 0's allreduce: waits (bounded) until rank 0 has given up.
            timed_out.wait(30)
        for _ in range(2 if rank == 0 else 1):
            try:
                comm.allreduce(np.ones(4, dtype=np.float32))
                statuses.append(gs.OK)
            except gs.GradsyncError as e:
                statuses.append(e.status)
        timed_out.set()
        queue.put((rank, statuses))


def test_a_rank_that_never_arrives_gives_timeout_then_calls_fail_fast():
    timed_out = mp.get_context("spawn").Event()
    results, codes = _run(_late, 2, _group("late"), timed_out)
    assert codes == [0, 0]
    assert results[0] == [gs.E_TIMEOUT, gs.E_ABORTED]
    assert results[1] == [gs.E_ABORTED]


def test_empty_on_the_thread_transport_is_ordinary_memory():
    with gs.Communicator(_group("solo"), 0, 1) as comm:
        a = comm.empty((3, 4), np.int32)
        assert a.shape == (3, 4) and a.dtype == np.int32
        a[:] = 7
        comm.allreduce(a, op="sum")
        assert (a == 7).all()
        with pytest.raises(TypeError):
            comm.empty(4, np.int8)


def test_shm_feature_is_reported():
    assert gs.has_feature(gs.FEATURE_SHM_TRANSPORT)


def _under_address_limit(rank, nranks, queue, name, headroom):
    import resource
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = vm + headroom
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        with gs.Communicator(name, 0, 1, transport="shm", timeout_ms=5000) as c:
            out = c.allreduce(np.arange(4, dtype=np.float32), op="sum")
            queue.put((rank, ("ok", out.tolist())))
    except gs.GradsyncError as e:
        queue.put((rank, ("error", e.status, str(e))))


@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="AddressSanitizer reserves terabytes of address space: no RLIMIT_AS can hold it")
@pytest.mark.parametrize("headroom_mb", [4096, 16])
def test_a_group_fits_an_address_space_limit_or_fails_clearly_leaving_nothing(headroom_mb):
    # The heaps share a quarter of the process's address-space limit: with room to spare the group
    # forms; with almost none it fails with E_NOMEM. Either way no segment is left behind.
    name = _group("vlimit")
    results, codes = _run(_under_address_limit, 1, name, headroom_mb << 20)
    assert codes == [0]
    if headroom_mb == 4096:
        assert results[0] == ("ok", [0.0, 1.0, 2.0, 3.0])
    else:
        assert results[0][0] == "error" and results[0][1] == gs.E_NOMEM, results[0]
        assert "address space" in results[0][2]
    assert not os.path.exists(f"/dev/shm/gradsync.{name}")


def _split_and_topology(rank, size, queue, group):
    # Ranks 0, 2 claim host "a", ranks 1, 3 host "b"; one process each.
    with gs.Communicator(group, rank, size, timeout_ms=20000, transport="shm", host="ab"[rank % 2]) as comm:
        topo = comm.topology
        sub = comm.split(rank % 2, key=-rank)
        x = np.array([rank + 1.0], dtype=np.float32)
        sub.allreduce(x, op="sum")
        order = np.zeros(2, dtype=np.int32)
        sub.allgather(order, part=np.array([rank], dtype=np.int32))
        none = comm.split(None if rank == 3 else 0)
        three = None if none is None else (none.size, none.topology.rank_hosts)
        sub_topo = sub.topology
        comm.close()  # the subgroup outlives its parent
        y = np.array([1.0], dtype=np.float32)
        sub.allreduce(y, op="sum")
        sub.close()
        if none is not None:
            none.close()
        queue.put((rank, (tuple(topo), None, float(x[0]), order.tolist(), three,
                          tuple(sub_topo), float(y[0]))))


def test_split_and_topology_across_processes():
    results, codes = _run(_split_and_topology, 4, _group("split"))
    assert codes == [0, 0, 0, 0]
    for rank in range(4):
        topo, _, x, order, three, sub_topo, y = results[rank]
        assert topo == (rank % 2, rank // 2, 2, 2, (0, 1, 0, 1))
        assert x == (4.0 if rank % 2 == 0 else 6.0)
        assert order == ([2, 0] if rank % 2 == 0 else [3, 1])
        assert three == (None if rank == 3 else (3, (0, 1, 0)))
        assert sub_topo[3] == 1 and sub_topo[2] == 2  # both members of a subgroup share their label
        assert y == 2.0
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("gradsync.py-split")]
