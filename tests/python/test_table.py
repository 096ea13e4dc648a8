# SPDX-License-Identifier: Apache-2.0
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import gradsync as gs


@pytest.fixture(params=["striped", "lock_free", "owner"])
def acc(request, tmp_path):
    with gs.Accumulator.create(tmp_path / "g.gsa", 100, 64, concurrency=request.param) as a:
        yield a


def test_seed_acceptance(acc, tmp_path):
    ones = np.ones(64, np.float32)
    acc.add(0, ones)
    acc.add(0, [2.0] * 64)
    assert (acc.get(0) == 3.0).all()
    acc.add(0, np.full(64, 1.5, np.float32))
    acc.zero()
    assert (acc.get(0) == 0.0).all()

    threads = [threading.Thread(target=acc.add, args=(0, ones)) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert (acc.get(0) == 10.0).all()
    acc.zero()

    params = gs.Table.anonymous(100, 64)
    params.set(0, np.full(64, 10.0, np.float32))
    acc.add(0, ones)
    acc.apply(params, "sgd", lr=0.1)
    assert np.allclose(params.get(0), 9.9, atol=1e-6)
    assert (acc.get(0) == 0.0).all()

    with pytest.raises(gs.GradsyncError) as e:
        acc.add(0, np.ones(32, np.float32))
    assert e.value.status == gs.E_INVALID_ARG and "32 floats" in e.value.message

    path = acc.path
    acc.close()
    with pytest.raises(gs.GradsyncError) as e:
        gs.Accumulator.open(path, 100, 32)
    assert e.value.status == gs.E_MISMATCH and "file has 100 x 64, asked for 100 x 32" in e.value.message


def test_table_reopen_and_mismatch(tmp_path):
    path = tmp_path / "emb.gst"
    with gs.Table.create(path, 100, 64) as t:
        assert t.created and t.shape == (100, 64)
        t.set(10, np.full(64, 1.5, np.float32))
        t.flush()
    with gs.Table.open(path) as t:
        assert not t.created
        assert (t.get(10) == 1.5).all()
        assert (t.view[10] == 1.5).all() and (t.view[11] == 0).all()
    with pytest.raises(gs.GradsyncError) as e:
        gs.Table.open(path, 100, 32)
    assert e.value.status == gs.E_MISMATCH and "file has 100 x 64, asked for 100 x 32" in e.value.message
    with pytest.raises(gs.GradsyncError) as e:
        gs.Table.create(path, 100, 64)
    assert e.value.status == gs.E_IO and "already exists" in e.value.message
    with pytest.raises(gs.GradsyncError) as e:
        gs.Accumulator.open(path)
    assert e.value.status == gs.E_MISMATCH


def test_corrupt_file_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.gst"
    path.write_bytes(b"\0" * 20000)
    with pytest.raises(gs.GradsyncError) as e:
        gs.Table.open(path)
    assert e.value.status == gs.E_CORRUPT and "bad magic" in e.value.message
    path.write_bytes(b"x" * 100)
    with pytest.raises(gs.GradsyncError) as e:
        gs.Table.open(path)
    assert e.value.status == gs.E_CORRUPT and "shorter than its two header pages" in e.value.message


def test_view_is_zero_copy_and_read_only():
    t = gs.Table.anonymous(5, 3, init="uniform", seed=9)
    v = t.view
    assert v.dtype == np.float32 and v.shape == (5, 3) and not v.flags.writeable
    with pytest.raises(ValueError):
        v[0, 0] = 1.0
    t.set(2, np.array([7, 8, 9], np.float32))
    assert list(v[2]) == [7, 8, 9]  # the same memory, seen at once
    t.close()
    assert list(v[2]) == [7, 8, 9]  # the mapping lives on while a view does
    with pytest.raises(gs.GradsyncError):
        t.flush()
    same = gs.Table.anonymous(5, 3, init="uniform", seed=9)
    other = gs.Table.anonymous(5, 3, init="uniform", seed=10)
    assert np.array_equal(same.view[0], v[0]) and not np.array_equal(other.view, same.view)


def test_gather_scatter_and_bad_ids():
    t = gs.Table.anonymous(10, 2)
    t.scatter([1, 3], np.array([[1, 2], [3, 4]], np.float32))
    assert t.gather(np.array([3, 1, 3])).tolist() == [[3, 4], [1, 2], [3, 4]]
    with pytest.raises(gs.GradsyncError) as e:
        t.scatter([0, 10], np.ones((2, 2), np.float32))
    assert e.value.status == gs.E_OUT_OF_RANGE and "row 10 (entry 1 of 2) out of range [0, 10)" in e.value.message
    assert (t.get(0) == 0).all()
    with pytest.raises(TypeError):
        t.set(0, np.ones(2, np.float64))  # never a silent copy
    t.prefetch([1, 2, 3])


def test_add_batch_touched_and_adagrad():
    a = gs.Accumulator.anonymous(8, 4, rows_per_lock=2)
    assert a.concurrency == "striped" and a.rows_per_lock == 2
    a.add_batch(np.array([5, 1, 5]), np.ones((3, 4), np.float32))
    assert a.get(5).tolist() == [2, 2, 2, 2]
    assert a.touched().tolist() == [5, 1] and a.touched_count() == 2
    assert a.touched_count == 2  # the older attribute form reads the same number
    with pytest.raises(gs.GradsyncError) as e:
        a.add_batch([0, 8], np.ones((2, 4), np.float32))
    assert e.value.status == gs.E_OUT_OF_RANGE and (a.get(0) == 0).all()
    params = gs.Table.anonymous(8, 4)
    state = gs.Table.anonymous(8, 1)
    a.apply(params, "adagrad", lr=1.0, state=state)
    assert state.view[5, 0] == pytest.approx(4.0) and state.view[1, 0] == pytest.approx(1.0)
    assert params.view[5].tolist() == pytest.approx([-1.0] * 4)
    assert (params.view[0] == 0).all() and a.touched_count() == 0
    with pytest.raises(gs.GradsyncError) as e:
        a.apply(gs.Table.anonymous(8, 3), "sgd", lr=0.1)
    assert e.value.status == gs.E_MISMATCH


def test_threads_add_batch_exact():
    a = gs.Accumulator.anonymous(1000, 16)
    ids = np.arange(1000, dtype=np.int64) % 50
    grads = np.ones((1000, 16), np.float32)

    def work():
        for _ in range(20):
            a.add_batch(ids, grads)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert (a.view[:50] == 4 * 20 * 20).all() and (a.view[50:] == 0).all()


def test_reopen_in_another_process(tmp_path):
    path = tmp_path / "e.gst"
    with gs.Table.create(path, 3, 2, init="uniform", seed=5) as t:
        expected = t.view.copy()
        t.flush()
    code = (f"import gradsync as gs, numpy as np; t = gs.Table.open({str(path)!r}, read_only=True); "
            f"print(repr(t.view.tolist()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert eval(out.stdout) == expected.tolist()


def test_owner_mode_is_bitwise_the_same_for_any_owner_count():
    rng = np.random.default_rng(3)
    batches = [(rng.integers(0, 50, 900), (rng.standard_normal((900, 16)) * 10.0 ** rng.integers(-6, 6, (900, 1))).astype(np.float32))
               for _ in range(5)]
    tables = []
    for threads in (1, 2, 4):
        with gs.Accumulator.anonymous(50, 16, concurrency="owner", threads=threads) as a:
            assert a.concurrency == "owner"
            for ids, grads in batches:
                a.add_batch(ids, grads)
            tables.append(np.stack([a.get(r) for r in range(50)]))
    ref = np.zeros((50, 16), np.float32)
    for ids, grads in batches:
        for i, g in zip(ids, grads):
            ref[i] += g  # float32 adds in batch, then position order
    for t in tables:
        assert t.tobytes() == ref.tobytes()
    with pytest.raises(gs.GradsyncError) as e:
        gs.Accumulator.anonymous(50, 16, concurrency="owner", threads=0)
    assert e.value.status == gs.E_INVALID_ARG and "threads" in e.value.message


def test_files_are_private_unless_shared(tmp_path):
    # Tables and gradient files are 0600 whatever the umask; file_mode shares them, exactly (a umask
    # of 077 would otherwise take the group's read bit away).
    old_umask = os.umask(0o077)
    try:
        check_file_modes(tmp_path)
    finally:
        os.umask(old_umask)


def check_file_modes(tmp_path):
    for cls, name in ((gs.Table, "t.gst"), (gs.Accumulator, "g.gsa")):
        with cls(tmp_path / name, rows=4, dim=2, mode="create"):
            assert os.stat(tmp_path / name).st_mode & 0o7777 == 0o600
        with cls(tmp_path / ("shared-" + name), rows=4, dim=2, mode="create", file_mode=0o640):
            assert os.stat(tmp_path / ("shared-" + name)).st_mode & 0o7777 == 0o640
        with pytest.raises(gs.GradsyncError) as err:
            cls(tmp_path / ("bad-" + name), rows=4, dim=2, mode="create", file_mode=0o4777)
        assert err.value.status == gs.E_INVALID_ARG and "file_mode 4777" in err.value.message
