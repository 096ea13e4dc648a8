# SPDX-License-Identifier: Apache-2.0
import numpy as np
import pytest

import gradsync as gs
from gradsync import dataparallel as dp


def test_partition_examples_and_errors():
    # gradsync.dataparallel.partition is the library's checked rule (gs.partition may be re-bound
    # by another module's import; the values must agree anyway).
    assert [gs.partition(10, 3, i) for i in range(3)] == [(0, 4), (4, 3), (7, 3)]
    assert [dp.partition(10, 3, i) for i in range(3)] == [(0, 4), (4, 3), (7, 3)]
    assert [dp.partition(2, 4, i) for i in range(4)] == [(0, 1), (1, 1), (2, 0), (2, 0)]
    with pytest.raises(gs.GradsyncError) as out_of_range:
        dp.partition(10, 3, 3)
    assert out_of_range.value.status == gs.E_OUT_OF_RANGE
    assert "part 3 out of range [0, 3)" in out_of_range.value.message
    with pytest.raises(gs.GradsyncError) as zero:
        dp.partition(10, 0, 0)
    assert zero.value.status == gs.E_INVALID_ARG
    with pytest.raises(OverflowError):
        dp.partition(-1, 3, 0)


def test_split_round_robin():
    parts = [gs.split_round_robin(10, 3, k) for k in range(3)]
    assert [p.tolist() for p in parts] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert parts[0].dtype == np.uint64
    assert [gs.split_round_robin(0, 3, k).size for k in range(3)] == [0, 0, 0]
    with pytest.raises(gs.GradsyncError) as zero:
        gs.split_round_robin(10, 0, 0)
    assert zero.value.status == gs.E_INVALID_ARG
    with pytest.raises(gs.GradsyncError) as out_of_range:
        gs.split_round_robin(10, 3, 5)
    assert out_of_range.value.status == gs.E_OUT_OF_RANGE


def test_weighted_merge_examples():
    r = gs.weighted_merge([np.array([2, 4], np.float32)] * 2, counts=[10, 10], losses=[1.0, 1.0])
    assert r.gradient.tolist() == [2.0, 4.0] and r.loss == 1.0 and r.count == 20
    r = gs.weighted_merge([np.array([4], np.float32), np.array([0], np.float32)], counts=[1, 3], losses=[2, 0])
    assert r.gradient.tolist() == [1.0] and r.loss == 0.5 and r.count == 4
    r = gs.weighted_merge(np.array([[1, 2], [3, 4]], np.float32), counts=[1, 1])  # rows = workers
    assert r.gradient.tolist() == [2.0, 3.0] and r.loss is None and r.count == 2


def test_weighted_merge_in_place_matches_and_is_deterministic():
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(5000).astype(np.float32) for _ in range(3)]
    counts = [5, 1, 9]
    first = gs.weighted_merge(grads, counts).gradient
    again = gs.weighted_merge(grads, counts).gradient
    assert first.tobytes() == again.tobytes()
    expected = sum(c * g.astype(np.float64) for c, g in zip(counts, grads)) / sum(counts)
    np.testing.assert_array_equal(first, expected.astype(np.float32))
    out = grads[2]
    gs.weighted_merge(grads, counts, out=out)
    assert out.tobytes() == first.tobytes()


def test_weighted_merge_errors():
    a, b = np.ones(3, np.float32), np.ones(4, np.float32)
    with pytest.raises(gs.GradsyncError) as mismatch:
        gs.weighted_merge([a, b], counts=[1, 1])
    assert mismatch.value.status == gs.E_MISMATCH
    assert "worker 1 gradient has 4 elements" in mismatch.value.message
    out = np.full(3, -1, np.float32)
    with pytest.raises(gs.GradsyncError) as zero:
        gs.weighted_merge([a, a], counts=[0, 0], losses=[1, 1], out=out)
    assert zero.value.status == gs.E_ZERO_WEIGHT
    assert out.tolist() == [-1, -1, -1]
    with pytest.raises(gs.GradsyncError) as none:
        gs.weighted_merge([], counts=[])
    assert none.value.status == gs.E_INVALID_ARG
    with pytest.raises(TypeError):
        gs.weighted_merge([a.astype(np.float16)], counts=[1])
    with pytest.raises(ValueError):
        gs.weighted_merge([a, a], counts=[1])
    with pytest.raises(OverflowError):
        gs.weighted_merge([a], counts=[-1])


def test_weighted_merge_f64_is_exact_to_1e_12_where_f32_rounds():
    from fractions import Fraction

    rng = np.random.default_rng(7)
    grads = [rng.standard_normal(2000) for _ in range(5)]
    counts = [int(c) for c in rng.integers(1, 1 << 62, size=5, dtype=np.int64)]  # far above 2^53
    r = gs.weighted_merge(grads, counts)
    assert r.gradient.dtype == np.float64 and r.count == sum(counts)
    total = sum(counts)
    for j in range(0, 2000, 97):
        exact = sum(Fraction(c) * Fraction(float(g[j])) for c, g in zip(counts, grads)) / total
        assert abs(Fraction(float(r.gradient[j])) - exact) <= Fraction(1, 10**12) * abs(exact)
    again = gs.weighted_merge(grads, counts)
    assert again.gradient.tobytes() == r.gradient.tobytes()  # the same bits every run
    near = gs.weighted_merge([np.array([2.0]), np.array([3.0])], counts=[1 << 33, 1])
    assert near.gradient[0] != 2.0 and abs(near.gradient[0] - (2 + 1 / ((1 << 33) + 1))) < 1e-15
    assert gs.weighted_merge([np.array([2.0], np.float32), np.array([3.0], np.float32)],
                             counts=[1 << 33, 1]).gradient[0] == 2.0


def test_weighted_merge_refuses_mixed_or_other_dtypes():
    with pytest.raises(TypeError, match="float64"):
        gs.weighted_merge([np.zeros(2), np.zeros(2, np.float32)], counts=[1, 1])
    with pytest.raises(TypeError, match="float32 or float64"):
        gs.weighted_merge([np.zeros(2, np.int32)], counts=[1])
    with pytest.raises(TypeError, match="float64"):
        gs.weighted_merge([np.zeros(2)], counts=[1], out=np.zeros(2, np.float32))
