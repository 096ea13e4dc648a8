# SPDX-License-Identifier: Apache-2.0
"""The MPI transport from Python: `mpirun -np N /usr/bin/python3 script` with Communicator(transport="mpi").

Each test writes a rank script, runs it under a real mpirun (bounded by a subprocess timeout, so
nothing can hang), and checks what every rank printed. Without MPI in the build, the transport
must say so (E_UNSUPPORTED) instead.
"""
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import gradsync as gs

HAVE_MPI = gs.has_feature(gs.FEATURE_MPI_TRANSPORT)
MPIRUN = shutil.which("mpirun") or "/usr/bin/mpirun"

RANK_PRELUDE = """
import hashlib, os, sys, threading, time
import numpy as np
import gradsync as gs
from gradsync import GradsyncError


def say(line):
    # One write per line: mpirun forwards each write as it comes, so print()'s separate
    # newline could interleave with another rank's line.
    os.write(1, (line + "\\n").encode())
"""


def run_ranks(tmp_path, body, nprocs=2, timeout=90):
    script = tmp_path / "rank.py"
    script.write_text(RANK_PRELUDE + textwrap.dedent(body))
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(nprocs),
           "/usr/bin/python3", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return proc.stdout.splitlines()


def lines_of(lines, tag):
    return sorted(line for line in lines if line.startswith(tag))


def test_transport_name_and_capability():
    assert gs.comm.TRANSPORTS["mpi"] == gs.TRANSPORT_MPI == 2
    if not HAVE_MPI:
        # A build without MPI says so at creation, instead of failing obscurely.
        with pytest.raises(gs.GradsyncError) as err:
            gs.Communicator(transport="mpi")
        assert err.value.status == gs.E_UNSUPPORTED
        # Built without MPI, or the plugin (libgradsync-mpi.so.0) or Open MPI's runtime missing.
        assert "without MPI" in err.value.message or "libgradsync-mpi.so.0" in err.value.message


# The mpirun tests exist only in builds with MPI (test_transport_name_and_capability covers the others).
mpi_only = pytest.mark.skipif(not HAVE_MPI, reason="no MPI transport here (built without MPI, or its plugin does not load)")


@mpi_only
@pytest.mark.parametrize("nprocs", [2, 3])
def test_seed_mismatch_and_next_round_under_mpirun(tmp_path, nprocs):
    lines = run_ranks(tmp_path, """
        with gs.Communicator(transport="mpi", timeout_ms=20000) as c:
            r, n = c.rank, c.size
            assert c.transport == gs.TRANSPORT_MPI
            g = np.array([2.0, 4.0], dtype=np.float32) * (r + 1)
            c.allreduce(g)  # mean: (n+1)/2 * [2, 4]; [3, 6] for 2 ranks
            say(f"seed {r} {n} {g.tolist()}")
            # The seed's mismatch: lengths 4, 7, 4 -> every rank errs, nobody hangs.
            try:
                c.allreduce(np.ones(7 if r == 1 else 4, dtype=np.float32))
                say(f"mismatch {r} none")
            except GradsyncError as e:
                say(f"mismatch {r} {e.status} {'rank 1 called allreduce' in e.message}")
            w = np.full(4, 2.0 if r % 2 == 0 else 4.0, dtype=np.float32)
            c.allreduce(w)
            say(f"after {r} {w.tolist()}")
    """, nprocs)
    mean = (nprocs + 1) / 2
    assert lines_of(lines, "seed") == [f"seed {r} {nprocs} {[2 * mean, 4 * mean]}" for r in range(nprocs)]
    if nprocs == 2:
        assert "seed 0 2 [3.0, 6.0]" in lines
    assert lines_of(lines, "mismatch") == [f"mismatch {r} {gs.E_MISMATCH} True" for r in range(nprocs)]
    evens, odds = (nprocs + 1) // 2, nprocs // 2
    want = np.float32((2.0 * evens + 4.0 * odds) / nprocs)
    assert lines_of(lines, "after") == [f"after {r} {[float(want)] * 4}" for r in range(nprocs)]


@mpi_only
def test_deterministic_fused_and_collectives_under_mpirun(tmp_path):
    lines = run_ranks(tmp_path, """
        c = gs.Communicator(transport="mpi", deterministic=True, timeout_ms=20000)
        r, n = c.rank, c.size
        x = (np.random.default_rng(r).standard_normal(100003) * 1e3).astype(np.float32)
        ref = sum((np.random.default_rng(k).standard_normal(100003) * 1e3).astype(np.float32) for k in range(n))
        y = x.copy()
        c.allreduce(x, op="sum")
        # Bitwise identical on every rank: compare hashes through the library itself.
        h = np.zeros(n, dtype=np.int64)
        h[r] = np.frombuffer(hashlib.sha256(x.tobytes()).digest()[:8], dtype=np.int64)[0]
        c.allgather(h)
        say(f"same {r} {bool((h == h[0]).all())} {bool(np.array_equal(x, ref))}")
        # Fused equals one call per buffer.
        bufs = [np.full(k + 1, float(r + k), dtype=np.float64) for k in range(50)]
        singles = [b.copy() for b in bufs]
        c.allreduce_many(bufs, op="sum")
        for b in singles:
            c.allreduce(b, op="sum")
        say(f"fused {r} {all(np.array_equal(a, b) for a, b in zip(bufs, singles))}")
        b = np.full(5, float(r), dtype=np.float64)
        c.broadcast(b, root=n - 1)
        part = c.reduce_scatter(np.arange(10, dtype=np.int64), op="sum")
        start, length = c.part(10)
        say(f"coll {r} {b.tolist() == [float(n - 1)] * 5} {part.tolist() == [n * i for i in range(start, start + length)]}")
        c.barrier()
        c.close()
    """)
    assert lines_of(lines, "same") == [f"same {r} True True" for r in range(2)]
    assert lines_of(lines, "fused") == [f"fused {r} True" for r in range(2)]
    assert lines_of(lines, "coll") == [f"coll {r} True True" for r in range(2)]


@mpi_only
def test_transfers_beyond_the_int_count_limit_go_in_pieces(tmp_path):
    # GRADSYNC_MPI_MAX_COUNT lowers MPI's int limit (2^30 elements per call here) so that the
    # pairwise, piecewise paths of allgather, alltoall and reduce_scatter run on small arrays;
    # ranks that disagree on it are refused at creation, on every rank.
    lines = run_ranks(tmp_path, """
        rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
        os.environ["GRADSYNC_MPI_MAX_COUNT"] = str(100 + rank)
        try:
            gs.Communicator(transport="mpi", timeout_ms=20000).close()
            say(f"differ {rank} created")
        except GradsyncError as e:
            say(f"differ {rank} {e.status} {'differs between ranks' in e.message}")
        os.environ["GRADSYNC_MPI_MAX_COUNT"] = "0"
        try:
            gs.Communicator(transport="mpi", timeout_ms=20000).close()
        except GradsyncError as e:
            say(f"bad {rank} {e.status} {'must be an integer in [1,' in e.message}")
        os.environ["GRADSYNC_MPI_MAX_COUNT"] = "7"
        with gs.Communicator(transport="mpi", timeout_ms=20000) as c:
            r, n, total = c.rank, c.size, 1003
            base = np.arange(total, dtype=np.float64)
            parts = [base[s:s + k] for s, k in (gs.partition(total, n, q) for q in range(n))]
            full = base * (r + 1)  # rank q holds base * (q + 1)
            got = c.allgather(np.zeros(total), part=parts[r] * (r + 1))
            ok_gather = np.array_equal(got, np.concatenate([parts[q] * (q + 1) for q in range(n)]))
            rows = c.alltoall(full)
            ok_a2a = all(np.array_equal(rows[q], parts[r] * (q + 1)) for q in range(n))
            red = c.reduce_scatter(full, op="sum")
            ok_rs = np.array_equal(red, parts[r] * sum(q + 1 for q in range(n)))
            say(f"pieces {r} {ok_gather} {ok_a2a} {ok_rs}")
    """, 3)
    assert lines_of(lines, "differ") == [f"differ {r} {gs.E_MISMATCH} True" for r in range(3)]
    assert lines_of(lines, "bad") == [f"bad {r} {gs.E_INVALID_ARG} True" for r in range(3)]
    assert lines_of(lines, "pieces") == [f"pieces {r} True True True" for r in range(3)]


@mpi_only
def test_stats_name_the_straggler_under_mpirun(tmp_path):
    lines = run_ranks(tmp_path, """
        with gs.Communicator(transport="mpi", timeout_ms=20000) as c:
            for _ in range(3):
                if c.rank == 1:
                    time.sleep(0.03)
                c.allreduce(np.ones(100, np.float32))
            s = c.stats()
            a = s["collectives"]["allreduce"]
            say(f"stats {c.rank} {s['straggler']} {a['calls']} {a['bytes']} {s['peers'][1]['last']} "
                f"{s['peers'][1]['late_ns'] >= 60_000_000}")
    """)
    assert lines_of(lines, "stats") == [f"stats {r} 1 3 1200 3 True" for r in range(2)]


@mpi_only
def test_timeout_abort_and_reset_under_mpirun(tmp_path):
    lines = run_ranks(tmp_path, """
        c = gs.Communicator(transport="mpi", timeout_ms=2000)
        r = c.rank
        a = np.ones(4, dtype=np.float32)
        if r == 0:
            # Rank 1 never arrives: rank 0 gets E_TIMEOUT after its 2 s deadline.
            try:
                c.allreduce(a)
            except GradsyncError as e:
                say(f"first {r} {e.status}")
        else:
            time.sleep(1.0)
        c.reset()  # collective: rank 1 joins here, and rank 0 once it has given up
        c.allreduce(a, op="sum")
        say(f"recovered {r} {a.tolist()}")
        # abort() from another thread wakes a rank waiting for a late peer, and reaches the peer.
        if r == 0:
            threading.Timer(0.1, c.abort).start()
        else:
            time.sleep(0.5)
        try:
            c.barrier()
        except GradsyncError as e:
            say(f"abort {r} {e.status}")
        c.reset()
        c.barrier()
        say(f"done {r}")
    """)
    assert lines_of(lines, "first") == [f"first 0 {gs.E_TIMEOUT}"]
    assert lines_of(lines, "recovered") == [f"recovered {r} [2.0, 2.0, 2.0, 2.0]" for r in range(2)]
    assert lines_of(lines, "abort") == [f"abort {r} {gs.E_ABORTED}" for r in range(2)]
    assert lines_of(lines, "done") == [f"done {r}" for r in range(2)]


@mpi_only
@pytest.mark.parametrize("transport", ["mpi", "hier"])
def test_threads_as_ranks_under_mpirun(tmp_path, transport):
    # 2 processes of 2 and 3 threads: 5 ranks, process 0's threads first. Each thread makes its
    # rank's Communicator with threads=(T, t) at once, then allreduces, broadcasts and splits by
    # thread index; a mismatch fails every rank alike and the group goes on.
    lines = run_ranks(tmp_path, """
        me = int(os.environ["OMPI_COMM_WORLD_RANK"])
        T = 2 + me
        out = {}

        def rank_thread(t):
            with gs.Communicator("threads-py", transport="%s", threads=(T, t), timeout_ms=30000) as c:
                r, n = c.rank, c.size
                assert c.transport == "%s"
                x = np.arange(4, dtype=np.float64) * (r + 1)
                c.allreduce(x, op="sum")
                y = np.full(5, float(r), dtype=np.float32)
                c.broadcast(y, root=4)
                try:
                    c.allreduce(np.ones(3 if r == 2 else 4, dtype=np.float32))
                    bad = "none"
                except GradsyncError as e:
                    bad = e.status
                sub = c.split(color=t, key=0)
                s = np.array([r], dtype=np.int64)
                sub.allreduce(s, op="sum")
                out[t] = (r, n, x.tolist(), y.tolist(), bad, sub.size, int(s[0]))
                sub.close()

        threads = [threading.Thread(target=rank_thread, args=(t,)) for t in range(T)]
        for th in threads: th.start()
        for th in threads: th.join()
        for t in sorted(out):
            say(f"rank {out[t]}")
    """ % (transport, transport))
    ranks = sorted(eval(line[5:]) for line in lines if line.startswith("rank "))
    assert [r[0] for r in ranks] == [0, 1, 2, 3, 4], lines
    for r, n, x, y, bad, sub_size, sub_sum in ranks:
        assert n == 5
        assert x == [0.0, 15.0, 30.0, 45.0]  # (1 + 2 + 3 + 4 + 5) * i
        assert y == [4.0] * 5
        assert bad == gs.E_MISMATCH
        # Split by thread index: thread 0 of both processes (ranks 0, 2), thread 1 (1, 3), thread 2 (4).
        members = {0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3], 4: [4]}[r]
        assert (sub_size, sub_sum) == (len(members), sum(members))
