# SPDX-License-Identifier: Apache-2.0
"""Non-blocking collectives from Python, on every transport: many requests in flight give the
blocking calls' bits, in issue order; a mismatch fails the request on every rank and is the
communicator's async error until reset; an abort fails every pending request."""
import numpy as np
import pytest

import gradsync as gs
from conftest import run_ranks
from test_mpi import HAVE_MPI, lines_of
from test_mpi import run_ranks as run_mpi_ranks
from test_shm import _group, _run

# One rank's script, the same on every transport: returns what the parent checks.
def _exercise(c):
    r, n = c.rank, c.size
    rng = np.random.default_rng(7 + r)
    arrays = [rng.standard_normal(size).astype(np.float32) for size in (1, 100, 5000, 70000, 300007)]
    blocking = [a.copy() for a in arrays]
    for b in blocking:
        c.allreduce(b, op="sum")
    requests = [c.iallreduce(a, op="sum") for a in arrays]
    # Issue order: a sum then a max over one buffer give n(n+1)/2; a max then a sum would give n*n.
    order = np.array([r + 1.0], np.float32)
    first, second = c.iallreduce(order, op="sum"), c.iallreduce(order, op="max")
    gathered = c.iallgather(np.zeros(2 * n, np.int32), part=np.full(2, r, np.int32))
    total = c.iweighted_mean(np.array([r + 1.0]), r + 1)
    c.barrier()  # a blocking call among pending requests runs after them
    same = all(np.array_equal(q.wait(), b) for q, b in zip(requests, blocking))
    first.wait()
    second.wait()
    # A disagreement: every rank's request fails, the next call works, reset clears the async error.
    bad = c.iallreduce(np.ones(3 + (r == n - 1), np.float32))
    try:
        bad.wait()
        mismatch = None
    except gs.GradsyncError as e:
        mismatch = e.status
    error = c.async_error()
    async_status = 0 if error is None else error.status
    after = c.iallreduce(np.full(4, r + 1.0, np.float32), op="sum").wait().tolist()
    c.reset()
    return (same, float(order[0]), gathered.wait().tolist(), total.wait(), mismatch, async_status, after,
            c.async_error() is None)


def _expected(n):
    return (True, float(n * (n + 1) // 2), [r for r in range(n) for _ in range(2)], n * (n + 1) // 2, gs.E_MISMATCH,
            gs.E_MISMATCH, [float(n * (n + 1) // 2)] * 4, True)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_threads(size):
    results = run_ranks(size, lambda comm, rank: _exercise(comm))
    for rank, got in enumerate(results):
        want = _expected(size)
        if size == 1:  # a group of one has nobody to disagree with
            want = want[:4] + (None, 0) + want[6:]
        assert got == want, rank


def _shm_rank(rank, size, queue, group):
    with gs.Communicator(group, rank, size, timeout_ms=20000, transport="shm") as comm:
        queue.put((rank, _exercise(comm)))


def test_shm_processes():
    results, codes = _run(_shm_rank, 3, _group("async"))
    assert codes == [0, 0, 0]
    assert all(results[r] == _expected(3) for r in range(3)), results


def test_abort_fails_every_pending_request():
    def body(comm, rank):
        statuses = []
        if rank == 0:
            requests = [comm.iallreduce(np.ones(10, np.float32)) for _ in range(3)]
            comm.abort()
        else:
            requests = [comm.iallreduce(np.ones(10, np.float32))]  # may meet rank 0's first before the abort
        for q in requests:
            try:
                q.wait()
                statuses.append(0)
            except gs.GradsyncError as e:
                statuses.append(e.status)
        comm.reset()
        return statuses, comm.iallreduce(np.full(2, rank + 1.0, np.float32), op="sum").wait().tolist()
    results = run_ranks(2, body)
    # The first call has one outcome on both ranks (it may have completed before the abort); the
    # two that rank 1 never made fail.
    assert results[0][0][0] == results[1][0][0] and results[0][0][0] in (0, gs.E_ABORTED)
    assert results[0][0][1:] == [gs.E_ABORTED] * 2
    assert results[0][1] == results[1][1] == [3.0, 3.0]


def test_pending_request_times_out_and_reports_in_progress():
    import threading
    finished = threading.Event()

    def body(comm, rank):
        if rank == 1:
            finished.wait(30)  # stays in the group without joining the round: rank 0's request times out
            return None
        q = comm.iallreduce(np.ones(4, np.float32))
        with pytest.raises(gs.GradsyncError) as pending:
            q.wait(timeout_ms=0)
        with pytest.raises(gs.GradsyncError) as timed_out:
            q.wait()
        finished.set()
        return pending.value.status, timed_out.value.status, "gradsync_comm_iallreduce" in timed_out.value.message
    results = run_ranks(2, body, timeout_ms=300)
    assert results[0] == (gs.E_IN_PROGRESS, gs.E_TIMEOUT, True)


@pytest.mark.skipif(not HAVE_MPI, reason="no MPI transport here (built without MPI, or its plugin does not load)")
def test_mpi(tmp_path):
    import inspect
    source = inspect.getsource(_exercise)
    lines = run_mpi_ranks(tmp_path, source + """
with gs.Communicator(transport="mpi", timeout_ms=20000, deterministic=True) as c:
    say(f"async {c.rank} {_exercise(c)}")
""", 3)
    assert lines_of(lines, "async") == [f"async {r} {_expected(3)}" for r in range(3)]
