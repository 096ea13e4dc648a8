# SPDX-License-Identifier: Apache-2.0
"""Codecs and the sharded parameter through ctypes, on the thread transport."""
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import uuid

import numpy as np
import pytest

import gradsync as gs
from conftest import run_ranks


def status_of(fn):
    try:
        fn()
    except gs.GradsyncError as e:
        return e.status
    return 0


# ---- codecs

def test_bigdl_codec_acceptance():
    x = np.array([1.111111, 2.111111, 3.111111, 4.111111, 5.111111, -4.111111, 0.1], dtype=np.float32)
    out = gs.decode(gs.encode(x, "bigdl_fp16"), "bigdl_fp16")
    assert out.tolist() == [1.109375, 2.109375, 3.109375, 4.09375, 5.09375, -4.09375, 0.099609375]
    ints = np.arange(-256, 257, dtype=np.float32)
    for codec in ("bigdl_fp16", "bf16", "fp16"):
        assert np.array_equal(gs.decode(gs.encode(ints, codec), codec), ints)
    # BigDL's byte order: 1.0f = 0x3f800000 -> bytes 0x3f 0x80
    assert gs.encode(np.array([1.0], dtype=np.float32), "bigdl_fp16").tobytes() == b"\x3f\x80"


def test_compressed_add_whole_and_slice():
    for codec in ("bigdl_fp16", "bf16", "fp16"):
        a = gs.encode(np.arange(1, 6, dtype=np.float32), codec)
        b = gs.encode(np.arange(2, 7, dtype=np.float32), codec)
        whole = gs.add_encoded(a.copy(), b, codec)
        assert gs.decode(whole, codec).tolist() == [3, 5, 7, 9, 11]
        part = gs.add_encoded(a.copy(), b[1:3], codec, offset=1)
        assert gs.decode(part, codec).tolist() == [1, 5, 7, 4, 5]
        acc = np.ones(5, dtype=np.float32)
        gs.accumulate_encoded(acc, b[1:3], codec, offset=3)
        assert acc.tolist() == [1, 1, 1, 4, 5]


def test_codec_rounding_and_specials():
    x = np.array([1 + 3 / 256, 65520.0, np.inf, -np.inf, np.nan], dtype=np.float32)
    bf = gs.decode(gs.encode(x, "bf16"), "bf16")
    assert bf[0] == np.float32(1 + 4 / 256)
    half = gs.decode(gs.encode(x, "fp16"), "fp16")
    assert np.isinf(half[1])
    # F16C (or the scalar path) agrees with numpy's own IEEE half conversion
    r = np.random.default_rng(1).normal(0, 100, 10000).astype(np.float32)
    assert np.array_equal(gs.encode(r, "fp16"), r.astype(np.float16).view(np.uint16))
    for codec in ("bigdl_fp16", "bf16", "fp16"):
        out = gs.decode(gs.encode(x[2:], codec), codec)
        assert out[0] == np.inf and out[1] == -np.inf and np.isnan(out[2])


def test_codec_errors():
    enc = gs.encode(np.ones(5, dtype=np.float32), "bf16")
    with pytest.raises(gs.GradsyncError) as info:
        gs.decode(enc, "bf16", offset=3, count=4)
    assert info.value.status == gs.E_INVALID_ARG
    assert "past the end of the 5-element" in info.value.message
    with pytest.raises(gs.GradsyncError) as info:
        gs.encode(np.ones(5, dtype=np.float32), "bf16", out=np.empty(3, dtype=np.uint16))
    assert info.value.status == gs.E_BUFS
    with pytest.raises(gs.GradsyncError) as info:
        gs.add_encoded(enc.copy(), enc, "bf16", offset=1)
    assert info.value.status == gs.E_INVALID_ARG
    with pytest.raises(gs.GradsyncError) as info:
        gs.encode(np.ones(2, dtype=np.float32), "none")
    assert "no 16-bit encoding" in info.value.message
    with pytest.raises(ValueError):
        gs.encode(np.ones(2, dtype=np.float32), "fp8")
    with pytest.raises(TypeError):
        gs.encode(np.ones(2, dtype=np.float64), "bf16")


# ---- sharded parameter

def test_partitions_and_bigdl_offsets():
    def body(comm, rank):
        with gs.ShardedParameter(comm, 10) as p, gs.ShardedParameter(comm, 5) as q:
            return p.part, p.part_of(rank, base=1), p.ranges(), q.part

    out = run_ranks(3, body)
    assert [o[0] for o in out] == [(0, 4), (4, 3), (7, 3)]
    assert [o[1] for o in out] == [(1, 4), (5, 3), (8, 3)]
    assert out[0][2] == [(0, 4), (4, 3), (7, 3)]
    assert [o[3] for o in out] == [(0, 2), (2, 2), (4, 1)]


@pytest.mark.parametrize("compress", ["none", "bf16", "fp16", "bigdl_fp16"])
def test_bigdl_acceptance_82(compress):
    def body(comm, rank):
        with gs.ShardedParameter(comm, 1, optimizer="sgd", lr=1.0, compress=compress) as p:
            w = np.array([100.0], dtype=np.float32)
            p.init(w)
            p.step(np.array([2.0 if rank == 0 else 4.0], dtype=np.float32), w)
            first = float(w[0])
            # round 2 through the stages, as BigDL's users drive them
            p.put(np.array([10.0 if rank == 0 else 20.0], dtype=np.float32))
            p.aggregate()
            p.update()
            p.gather(w)
            return first, float(w[0]), p.updates

    assert run_ranks(2, body) == [(97.0, 82.0, 2), (97.0, 82.0, 2)]


def test_own_optimizer_through_read_slice_and_write_weights():
    """BigDL's users run their optimizer on the partition: aggregate, read the gradient slice,
    write the new weight slice, gather."""
    def body(comm, rank):
        with gs.ShardedParameter(comm, 5, optimizer="sgd") as p:
            w = np.arange(5, dtype=np.float32)
            p.init(w)
            p.put(np.full(5, 1.0 + rank, dtype=np.float32))  # mean 1.5
            p.aggregate()
            offset, length = p.part
            grad = p.read_slice("gradient")
            mine = p.read_slice("weights")
            p.write_weights(mine - 2.0 * grad)
            p.gather(w)
            return grad.tolist(), (offset, length), w.tolist(), p.updates

    out = run_ranks(2, body)
    assert out[0][0] == [1.5] * 3 and out[1][0] == [1.5] * 2
    assert [o[1] for o in out] == [(0, 3), (3, 2)]
    assert out[0][2] == out[1][2] == [-3.0, -2.0, -1.0, 0.0, 1.0]
    assert [o[3] for o in out] == [1, 1]


def test_processors_and_zero_count():
    g = np.array([0.3, -0.4, 1.2, 0.0, 5.0], dtype=np.float32)
    norm = float(np.linalg.norm(g.astype(np.float64)))

    def body(comm, rank):
        with gs.ShardedParameter(comm, 5, optimizer="sgd", lr=1.0, clamp=(0, 0)) as a, \
             gs.ShardedParameter(comm, 5, optimizer="sgd", lr=1.0, clip_norm=0.03) as b:
            w1 = np.ones(5, dtype=np.float32)
            a.init(w1)
            a.step(g, w1)
            w2 = np.zeros(5, dtype=np.float32)
            b.init(w2)
            b.step(g, w2)
            zero = status_of(lambda: b.step(g, w2, samples=0))
            b.put(g, samples=0)
            staged_zero = status_of(b.aggregate)
            return w1, w2, zero, staged_zero

    for w1, w2, zero, staged_zero in run_ranks(2, body):
        assert np.array_equal(w1, np.ones(5, dtype=np.float32))
        np.testing.assert_allclose(w2, -g * 0.03 / norm, rtol=1e-6)
        assert zero == gs.E_ZERO_WEIGHT and staged_zero == gs.E_ZERO_WEIGHT


def test_adam_with_compression_matches_on_every_rank_and_saves_memory():
    n = 1003
    rng = np.random.default_rng(3)
    grads = rng.normal(size=(3, 4, n)).astype(np.float32)

    def body(comm, rank):
        with gs.ShardedParameter(comm, n, optimizer="adam", lr=1e-2, compress="bf16", error_feedback=True) as p:
            w = np.zeros(n, dtype=np.float32)
            p.init(w)
            for t in range(4):
                p.step(grads[rank, t], w, samples=rank + 1)
            return w, p.memory

    out = run_ranks(3, body)
    assert all(np.array_equal(out[0][0], o[0]) for o in out)
    assert [o[1]["optimizer"] for o in out] == [335 * 8, 334 * 8, 334 * 8]
    assert np.abs(out[0][0]).max() <= 4 * 1e-2 * 1.01  # Adam moves each weight at most lr per step


def test_failure_on_one_rank_raises_on_every_rank():
    def body(comm, rank):
        with gs.ShardedParameter(comm, 4, optimizer="sgd", lr=1.0) as p:
            w = np.zeros(4, dtype=np.float32)
            p.init(w)
            bad = np.zeros(3 if rank == 1 else 4, dtype=np.float32)
            statuses = [status_of(lambda: p.step(bad, bad if rank == 1 else w))]
            # a failed put is not replaced by an older gradient
            p.put(np.ones(4, dtype=np.float32))
            p.aggregate()
            p.update()
            p.gather(w)
            statuses.append(status_of(lambda: p.put(np.ones(3 if rank == 0 else 4, dtype=np.float32))))
            statuses.append(status_of(p.aggregate))
            return statuses, w.tolist()

    out = run_ranks(2, body)
    assert out[0][0] == [gs.E_REMOTE, gs.E_INVALID_ARG, gs.E_INVALID_ARG]
    assert out[1][0] == [gs.E_INVALID_ARG, 0, gs.E_REMOTE]
    assert out[0][1] == out[1][1] == [-1.0] * 4


def test_bad_arguments():
    def body(comm, rank):
        with pytest.raises(gs.GradsyncError) as info:
            gs.ShardedParameter(comm, 0)
        assert "total parameter count is 0" in info.value.message
        with pytest.raises(gs.GradsyncError):
            gs.ShardedParameter(comm, 3, lr=-1)
        with pytest.raises(ValueError):
            gs.ShardedParameter(comm, 3, optimizer="lbfgs")
        with gs.ShardedParameter(comm, 3) as p:
            with pytest.raises(gs.GradsyncError) as info:
                p.part_of(5)
            assert info.value.status == gs.E_OUT_OF_RANGE
            with pytest.raises(gs.GradsyncError) as info:
                p.update()
            assert info.value.status == gs.E_MISUSE
            with pytest.raises(gs.GradsyncError) as info:
                p.init(np.zeros(2, dtype=np.float32))
            assert "weights hold 2 floats, the parameter has 3" in info.value.message
        return True

    assert run_ranks(1, body) == [True]


# ---- the same acceptance over the other transports, where this build has them

def _acceptance_rank(comm, rank, compress):
    """BigDL's 100 -> 97 -> 82 and bad input on one rank; returns what the test checks."""
    with gs.ShardedParameter(comm, 3, optimizer="sgd", lr=1.0, compress=compress) as p:
        w = np.full(3, 100.0, dtype=np.float32)
        p.init(w)
        p.step(np.full(3, 2.0 if rank == 0 else 4.0, dtype=np.float32), w)
        first = w.tolist()
        p.step(np.full(3, 10.0 if rank == 0 else 20.0, dtype=np.float32), w)
        bad = np.zeros(2 if rank == 1 else 3, dtype=np.float32)
        status = status_of(lambda: p.step(bad, bad if rank == 1 else w))
        return first, w.tolist(), status, p.part


def _shm_rank(rank, size, queue, group, compress):
    try:
        with gs.Communicator(group, rank, size, timeout_ms=20000, transport="shm") as comm:
            queue.put((rank, _acceptance_rank(comm, rank, compress)))
    except BaseException as exc:
        queue.put((rank, repr(exc)))


@pytest.mark.skipif(not gs.has_feature(gs.FEATURE_SHM_TRANSPORT), reason="no shared-memory transport in this build")
@pytest.mark.parametrize("compress", ["none", "bf16"])
def test_acceptance_over_shared_memory(compress):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    group = f"py-shard-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    procs = [ctx.Process(target=_shm_rank, args=(r, 2, queue, group, compress)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for rank in range(2):
        first, second, status, part = results[rank]
        assert first == [97.0] * 3 and second == [82.0] * 3
        assert part == [(0, 2), (2, 1)][rank]
    assert [results[0][2], results[1][2]] == [gs.E_REMOTE, gs.E_INVALID_ARG]


# Each rank writes its own file: mpirun interleaves the ranks' standard outputs.
_MPI_WORKER = """
import json, os, sys
sys.path.insert(0, {tests!r})
import gradsync as gs
from test_shard import _acceptance_rank
with gs.Communicator("py-shard-mpi", 0, 1, transport="mpi", timeout_ms=20000) as comm:
    result = _acceptance_rank(comm, comm.rank, "fp16")
    with open(os.path.join({out!r}, f"rank{{comm.rank}}.json"), "w") as f:
        json.dump(result, f)
"""


@pytest.mark.skipif(not gs.has_feature(gs.FEATURE_MPI_TRANSPORT) or shutil.which("mpirun") is None,
                    reason="no MPI transport in this build, or no mpirun")
def test_acceptance_over_mpi(tmp_path):
    import json

    code = _MPI_WORKER.format(tests=os.path.dirname(os.path.abspath(__file__)), out=str(tmp_path))
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    out = subprocess.run(["mpirun", "--oversubscribe", "--bind-to", "none", "-np", "2", sys.executable, "-c", code],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)}
    for rank in range(2):
        first, second, status, part = results[rank]
        assert first == [97.0] * 3 and second == [82.0] * 3
        assert tuple(part) == [(0, 2), (2, 1)][rank]
    assert [results[0][2], results[1][2]] == [gs.E_REMOTE, gs.E_INVALID_ARG]


def test_shard_after_its_communicator_is_closed():
    comm = gs.Communicator(f"pytest-shard-orphan-{uuid.uuid4().hex[:8]}", 0, 1)
    p = gs.ShardedParameter(comm, 4, optimizer="sgd", lr=0.5)
    p.init(np.ones(4, np.float32))
    w = np.empty(4, np.float32)
    p.step(np.ones(4, np.float32), w)
    assert w.tolist() == [0.5] * 4
    comm.close()
    # a group of one never communicates: without the check this step would succeed
    with pytest.raises(gs.GradsyncError) as info:
        p.step(np.ones(4, np.float32), w)
    assert info.value.status == gs.E_MISUSE and "was freed (gradsync_comm_free)" in info.value.message
    with pytest.raises(gs.GradsyncError) as info:
        p.gather(w)
    assert info.value.status == gs.E_MISUSE
    assert p.part == (0, 4) and p.read_slice().tolist() == [0.5] * 4  # local calls still work
    p.close()
