# SPDX-License-Identifier: Apache-2.0
"""The communicator from Python: ranks are Python threads (ctypes releases the GIL in every call)."""
import threading
import time

import numpy as np
import pytest

import gradsync as gs
from conftest import fresh_group_name, run_ranks


def test_seed_two_ranks_mean():
    data = [np.array([2, 4], dtype=np.float32), np.array([4, 8], dtype=np.float32)]
    run_ranks(2, lambda comm, r: comm.allreduce(data[r]))
    for d in data:
        assert d.tolist() == [3.0, 6.0]


def test_seed_mismatch_on_every_rank_then_next_round_works():
    def body(comm, rank):
        first = np.ones(7 if rank == 1 else 4, dtype=np.float32)
        with pytest.raises(gs.GradsyncError) as info:
            comm.allreduce(first)
        second = np.full(4, 2.0 + rank, dtype=np.float32)
        comm.allreduce(second)
        return info.value, first, second

    for rank, (error, first, second) in enumerate(run_ranks(3, body)):
        assert error.status == gs.E_MISMATCH
        assert "rank 1 called allreduce of 7 f32 (mean) but rank 0 called allreduce of 4 f32 (mean)" in error.message
        assert (first == 1.0).all()  # nothing written
        assert second.tolist() == [3.0] * 4


def test_collectives_and_dtypes():
    n, total = 3, 10

    def body(comm, rank):
        out = {}
        out["sum_i64"] = comm.allreduce(np.arange(5, dtype=np.int64) * (rank + 1), op="sum")
        src = np.full(6, float(rank), dtype=np.float64)
        out["max_out"] = comm.allreduce(src, op="max", out=np.empty_like(src))
        out["src_untouched"] = src.copy()
        out["fused"] = comm.allreduce_many([np.full(3, rank, np.float32), np.full(1000, rank * 2, np.float32)])
        out["bcast"] = comm.broadcast(np.arange(4, dtype=np.int32) if rank == 1 else np.zeros(4, np.int32), root=1)
        start, length = comm.part(total)
        out["gather"] = comm.allgather(np.zeros(total, np.float32), part=np.arange(start, start + length, dtype=np.float32))
        out["rs"] = comm.reduce_scatter(np.ones(total, np.float32) * (rank + 1), op="sum")
        comm.barrier()
        return out

    for rank, out in enumerate(run_ranks(n, body)):
        assert out["sum_i64"].tolist() == [0, 6, 12, 18, 24]
        assert out["max_out"].tolist() == [2.0] * 6
        assert out["src_untouched"].tolist() == [float(rank)] * 6
        assert out["fused"][0].tolist() == [1.0] * 3 and (out["fused"][1] == 2.0).all()
        assert out["bcast"].tolist() == [0, 1, 2, 3]
        assert out["gather"].tolist() == list(range(total))
        assert out["rs"].tolist() == [6.0] * gs.partition(total, n, rank)[1]


def test_alltoall_sends_part_j_to_rank_j():
    total = 11  # parts of 4, 4 and 3 over 3 ranks

    def body(comm, rank):
        got = comm.alltoall(np.arange(total, dtype=np.int64) + 100 * rank)
        halves = comm.alltoall((np.arange(total) + 100 * rank).astype(np.float16))  # moved bit for bit
        with pytest.raises(ValueError):
            comm.alltoall(np.zeros(total, dtype=np.int64), out=np.zeros(2, dtype=np.int64))
        summed = comm.allreduce(np.full(4, 1.5, dtype=np.float16), op="sum")  # f32 accumulation, one rounding
        return got, halves, summed

    for rank, (got, halves, summed) in enumerate(run_ranks(3, body)):
        start, length = gs.partition(total, 3, rank)
        assert got.shape == (3, length) and halves.shape == (3, length) and halves.dtype == np.float16
        for i in range(3):
            assert got[i].tolist() == [100 * i + k for k in range(start, start + length)]
            assert halves[i].tolist() == [float(100 * i + k) for k in range(start, start + length)]
        assert summed.dtype == np.float16 and summed.tolist() == [4.5] * 4


def test_weighted_mean_by_sample_count():
    grads = [np.array([4.0], np.float32), np.array([0.0], np.float32)]
    totals = run_ranks(2, lambda comm, r: comm.weighted_mean(grads[r], [1, 3][r]))
    assert totals == [4, 4]
    assert grads[0][0] == 1.0 and grads[1][0] == 1.0


def test_timeout_abort_and_reset():
    name = fresh_group_name()
    comms = [None, None]

    def join(rank):
        comms[rank] = gs.Communicator(name, rank, 2, timeout_ms=200, transport="threads")

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    a, b = comms
    assert a.transport == "threads" and f"{a.transport}" == "threads" and (a.rank, a.size) == (0, 2)
    # A name that still equals the code it was before, for code written then.
    assert a.transport == gs.TRANSPORT_THREAD and int(a.transport) == 0 and a.transport != gs.TRANSPORT_SHM
    assert a.transport in {"threads"} and a.transport != "shm"
    with pytest.raises(gs.GradsyncError) as info:
        a.allreduce(np.ones(3, np.float32))  # rank 1 never comes
    assert info.value.status == gs.E_TIMEOUT
    with pytest.raises(gs.GradsyncError) as info:
        b.barrier()
    assert info.value.status == gs.E_ABORTED
    errors = []

    def reset_and_sum(comm, value, out):
        try:
            comm.reset()
            out.append(comm.allreduce(np.array([value], np.float64), op="sum")[0])
        except gs.GradsyncError as exc:
            errors.append(exc)

    results = []
    threads = [threading.Thread(target=reset_and_sum, args=(c, v, results)) for c, v in ((a, 1.0), (b, 2.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and results == [3.0, 3.0]

    # abort() from another thread wakes a waiter at once
    waiter_error = []

    def wait_alone():
        try:
            a.allreduce(np.ones(3, np.float32))
        except gs.GradsyncError as exc:
            waiter_error.append(exc)

    a_comm_timeout = threading.Thread(target=wait_alone)
    a_comm_timeout.start()
    time.sleep(0.05)
    b.abort()
    a_comm_timeout.join(30)
    assert waiter_error and waiter_error[0].status in (gs.E_ABORTED, gs.E_TIMEOUT)
    a.close()
    b.close()


def test_bad_arguments():
    with pytest.raises(gs.GradsyncError) as info:
        gs.Communicator("pytest-bad", 3, 2)
    assert info.value.status == gs.E_OUT_OF_RANGE
    with pytest.raises(ValueError):
        gs.Communicator("pytest-bad", 0, 1, transport="pigeons")
    with gs.Communicator(fresh_group_name(), 0, 1) as comm:
        with pytest.raises(TypeError):
            comm.allreduce(np.ones(3, np.uint8))
        with pytest.raises(ValueError):
            comm.allreduce(np.ones((4, 4), np.float32)[:, 1])
        with pytest.raises(gs.GradsyncError) as info:
            comm.broadcast(np.ones(3, np.float32), root=1)
        assert info.value.status == gs.E_OUT_OF_RANGE
        with pytest.raises(ValueError):
            comm.allreduce(np.ones(3, np.float32), op="median")
    with pytest.raises(gs.GradsyncError) as info:
        comm.barrier()  # closed
    assert info.value.status == gs.E_MISUSE


def test_threads_run_collectives_in_parallel():
    # Every round needs both threads inside the C call at once: with the GIL held across the call
    # the first rank would wait for the second until its timeout. 200 rounds must all succeed.
    def body(comm, rank):
        x = np.ones(16, np.float32)
        for _ in range(200):
            comm.allreduce(x, op="sum")
            x /= 2
        return x

    results = run_ranks(2, body)
    assert np.array_equal(results[0], results[1]) and (results[0] == 1.0).all()


def test_no_timeout():
    # INT64_MAX ms: a deadline that never passes, not one that overflowed into the past
    def body(comm, rank):
        x = comm.allreduce(np.array([rank + 1.0, 2.0 * (rank + 1)]), op="sum")
        comm.barrier()
        b = comm.broadcast(np.arange(3, dtype=np.int32) * (rank + 1), root=1)
        return x.tolist(), b.tolist()

    assert gs.NO_TIMEOUT == 2 ** 63 - 1
    assert run_ranks(2, body, timeout_ms=gs.NO_TIMEOUT) == [([3.0, 6.0], [0, 2, 4])] * 2


def join_pair(timeout_ms=20000):
    """Both ranks of a fresh 2-rank group, to drive from one thread."""
    name = fresh_group_name()
    comms = [None, None]

    def join(rank):
        comms[rank] = gs.Communicator(name, rank, 2, timeout_ms=timeout_ms)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert None not in comms
    return comms


BUSY = "already in a call on another thread"


def wait_until_in_call(comm):
    """Returns once another thread is inside a call on comm: exactly then is a second caller refused."""
    while True:
        try:
            comm.empty(1)  # allocates and (collected at once) frees: a call that never blocks
        except gs.GradsyncError as exc:
            assert exc.status == gs.E_MISUSE and BUSY in exc.message, exc
            return
        time.sleep(0)


def in_thread(call):
    """Runs call() on a new thread, again while it meets the prober above; returns (thread, outcome)."""
    outcome = {}

    def run():
        while True:
            try:
                outcome["result"] = call()
                return
            except gs.GradsyncError as exc:
                if exc.status == gs.E_MISUSE and BUSY in exc.message:
                    continue
                outcome["error"] = exc
                return

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_two_threads_on_one_communicator():
    a, b = join_pair()
    x = np.array([1.0, 2.0], np.float32)
    thread, outcome = in_thread(lambda: a.allreduce(x, op="sum"))  # waits for rank 1
    wait_until_in_call(a)
    mine = np.full(2, 7.0, np.float32)
    with pytest.raises(gs.GradsyncError) as info:
        a.allreduce(mine, op="sum")
    assert info.value.status == gs.E_MISUSE
    assert (f"is {BUSY} (gradsync_comm_allreduce); a handle must not be used by two threads at once"
            in info.value.message)
    assert (mine == 7.0).all()
    with pytest.raises(gs.GradsyncError) as info:
        a.barrier()
    assert info.value.status == gs.E_MISUSE
    assert (a.rank, a.size) == (0, 2)  # read-only properties stay available
    assert thread.is_alive()  # the refusals did not end the running call
    assert b.allreduce(np.array([10.0, 20.0], np.float32), op="sum").tolist() == [11.0, 22.0]
    thread.join(30)
    assert "error" not in outcome and x.tolist() == [11.0, 22.0]
    a.close()
    b.close()


def test_close_during_a_call_on_another_thread():
    a, b = join_pair()
    thread, outcome = in_thread(lambda: a.allreduce(np.ones(3, np.float32)))  # rank 1 never calls
    wait_until_in_call(a)
    a.close()  # aborts that call and waits for it to leave the library
    thread.join(30)
    assert not thread.is_alive()
    assert outcome["error"].status == gs.E_ABORTED
    with pytest.raises(gs.GradsyncError) as info:
        b.barrier()
    assert info.value.status == gs.E_ABORTED
    b.close()


def test_allreduce_many_over_mixed_dtypes_is_one_call_per_array():
    def body(comm, rank):
        rng = np.random.default_rng(rank)
        arrays = [rng.standard_normal(7).astype(np.float32), rng.integers(-9, 9, 1000).astype(np.int64),
                  rng.standard_normal(5), rng.standard_normal(300).astype(np.float16),
                  rng.integers(-9, 9, 3).astype(np.int32), rng.standard_normal(2).astype(np.float32)]
        singles = [comm.allreduce(a.copy(), op="sum") for a in arrays]
        comm.allreduce_many(arrays, op="sum")
        same = all(a.tobytes() == b.tobytes() for a, b in zip(arrays, singles))
        with comm.iallreduce_many([a.copy() for a in singles], op="max") as request:  # the non-blocking form
            done = request.wait()
        if rank == 1:  # one rank's list differs in one dtype: every rank fails, no array changes
            arrays[4] = arrays[4].astype(np.float32)
        kept = [a.copy() for a in arrays]
        with pytest.raises(gs.GradsyncError) as err:
            comm.allreduce_many(arrays, op="sum")
        return same, [d.dtype for d in done], err.value.status, all(np.array_equal(a, b) for a, b in zip(arrays, kept))

    for same, dtypes, status, kept in run_ranks(2, body):
        assert same and kept and status == gs.E_MISMATCH
        assert dtypes == [np.float32, np.int64, np.float64, np.float16, np.int32, np.float32]


def test_allgatherv_uneven_parts_blocking_and_not():
    def body(comm, rank):
        counts = [3, 0, 5]
        part = np.arange(counts[rank], dtype=np.float64) + 10 * rank
        got = comm.allgatherv(part, counts)
        with comm.iallgatherv(part, counts) as request:
            again = request.wait()
        with pytest.raises(ValueError, match="counts"):
            comm.allgatherv(part, [3, 0])
        return got.tolist(), again.tolist()

    want = [0.0, 1.0, 2.0, 20.0, 21.0, 22.0, 23.0, 24.0]
    assert run_ranks(3, body) == [(want, want)] * 3


def test_reduce_scatterv_uneven_parts_blocking_and_not():
    def body(comm, rank):
        counts = [2, 0, 3]
        x = np.arange(5, dtype=np.float32) * (rank + 1)
        got = comm.reduce_scatterv(x, counts, op="sum")
        with comm.ireduce_scatterv(x, counts, op="max") as request:
            most = request.wait()
        return got.tolist(), most.tolist()

    got = run_ranks(3, body)
    assert got[0] == ([0.0, 6.0], [0.0, 3.0]) and got[1] == ([], []) and got[2] == ([12.0, 18.0, 24.0], [6.0, 9.0, 12.0])


def test_alltoallv_routes_uneven_parts_and_names_a_disagreement():
    def body(comm, rank):
        # Rank s sends s + d elements to rank d, valued 100 * s + d.
        send_counts = [rank + d for d in range(3)]
        recv_counts = [s + rank for s in range(3)]
        x = np.concatenate([np.full(rank + d, 100 * rank + d, dtype=np.int64) for d in range(3)])
        got = comm.alltoallv(x, send_counts, recv_counts)
        with comm.ialltoallv(x, send_counts, recv_counts) as request:
            again = request.wait()
        wrong = list(recv_counts)
        if rank == 2:
            wrong[0] += 1
        with pytest.raises(gs.GradsyncError) as e:
            comm.alltoallv(x, send_counts, wrong)
        return got.tolist(), again.tolist(), e.value.status, str(e.value)

    for rank, (got, again, status, message) in enumerate(run_ranks(3, body)):
        want = [100 * s + rank for s in range(3) for _ in range(s + rank)]
        assert got == want and again == want
        assert status == gs.E_MISMATCH and "rank 0 sends 2 elements to rank 2, but rank 2 expects 3" in message


def test_rooted_reduce_gather_scatter_and_their_v_forms():
    def body(comm, rank):
        x = np.arange(4, dtype=np.float32) + rank
        total = comm.reduce(x, root=1, op="sum")
        with comm.ireduce(x, root=2, op="max") as request:
            most = request.wait()
        rows = comm.gather(x, root=0)
        part = comm.scatter(np.arange(6, dtype=np.int32) if rank == 2 else None, 2, root=2, dtype=np.int32)
        mine = np.full(rank, rank, dtype=np.float64)  # rank r gives r elements
        packed = comm.gatherv(mine, counts=[0, 1, 2], root=1)
        back = comm.scatterv(packed if rank == 1 else None, rank, counts=[0, 1, 2], root=1, dtype=np.float64)
        with pytest.raises(gs.GradsyncError) as e:
            comm.reduce(x, root=rank % 2, op="sum")
        return (None if total is None else total.tolist(), None if most is None else most.tolist(),
                None if rows is None else rows.tolist(), part.tolist(),
                None if packed is None else packed.tolist(), back.tolist(), e.value.status)

    got = run_ranks(3, body)
    assert [g[0] for g in got] == [None, [3.0, 6.0, 9.0, 12.0], None]
    assert [g[1] for g in got] == [None, None, [2.0, 3.0, 4.0, 5.0]]
    assert got[0][2] == [[0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5]] and got[1][2] is None
    assert [g[3] for g in got] == [[0, 1], [2, 3], [4, 5]]
    assert [g[4] for g in got] == [None, [1.0, 2.0, 2.0], None]
    assert [g[5] for g in got] == [[], [1.0], [2.0, 2.0]]
    assert all(g[6] == gs.E_MISMATCH for g in got)


def test_a_forming_group_names_the_ranks_it_waits_for():
    # A rank that never joins gives periodic warnings naming it (the first after 5 s), then the
    # timeout: on threads and on shared memory, whose joins are written apart.
    seen = []
    gs.set_log_callback(lambda level, msg: seen.append(msg), gs.LOG_WARN)
    errors = {}

    def join(transport):
        try:
            gs.Communicator(fresh_group_name(), 0, 3, timeout_ms=5600, transport=transport)
        except gs.GradsyncError as e:
            errors[transport] = e

    try:
        threads = [threading.Thread(target=join, args=(t,)) for t in ("threads", "shm")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        gs.set_log_callback(None)
    assert sorted(errors) == ["shm", "threads"]
    assert all(e.status == gs.E_TIMEOUT for e in errors.values())
    waiting = [m for m in seen if "waiting for rank(s)" in m and "1, 2" in m and "(1 of 3 joined" in m]
    assert any("shm group" in m for m in waiting), seen
    assert any("shm group" not in m for m in waiting), seen
