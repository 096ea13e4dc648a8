# SPDX-License-Identifier: Apache-2.0
import threading

import numpy as np
import pytest

import gradsync as gs


@pytest.mark.parametrize("bits", [32, 64])
def test_caffe2_checksum_with_python_threads(bits):
    # Caffe2's own test (skipped upstream as flaky): exact every run.
    for _ in range(2):
        counter, checksum = gs.Counter(20000, bits=bits), gs.Counter(0, bits=bits)

        def worker():
            for _ in range(200):
                old, new = counter.fetch_add(-1)
                assert new == old - 1
                checksum.fetch_add(old)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(100)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
            assert not t.is_alive()
        assert checksum.load() == 200010000
        assert counter.value == 0


def test_counter_wraps_and_stores():
    c = gs.Counter(2**31 - 1, bits=32)
    assert c.fetch_add(1) == (2**31 - 1, -2**31)
    c.store(5)
    assert c.load() == 5
    c64 = gs.Counter(-2**63)
    assert c64.fetch_add(-1) == (-2**63, 2**63 - 1)
    with pytest.raises(OverflowError):
        c.fetch_add(2**31)
    with pytest.raises(OverflowError):
        gs.Counter(2**40, bits=32)
    with pytest.raises(ValueError):
        gs.Counter(0, bits=16)


def test_closed_and_wrong_handles_raise():
    c = gs.Counter(1)
    c.close()
    c.close()  # idempotent
    with pytest.raises(gs.GradsyncError) as info:
        c.load()
    assert info.value.status == gs.E_MISUSE
    flag = gs.Flag()
    # A flag's pointer handed to a counter function: the library's type tag catches it.
    status = gs.lib.gradsync_counter64_store(flag.ptr, 3)
    assert status == gs.E_MISUSE
    assert "expected a counter64, got a flag" in gs.lib.gradsync_last_error_message().decode()
    assert gs.lib.gradsync_counter32_load(None, None) in (gs.E_MISUSE, gs.E_INVALID_ARG)


def test_flag_is_sticky():
    f = gs.Flag()
    assert not f.check() and not f
    assert f.conditional_set(False) is False
    assert f.conditional_set(True) is True
    assert f.conditional_set(False) is True
    assert f.check()
    f.reset()
    assert not f.check()


def test_mutex_context_manager_and_ownership():
    m = gs.Mutex()
    with m:
        with pytest.raises(gs.GradsyncError) as again:
            m.lock()
        assert again.value.status == gs.E_MISUSE
        seen = {}

        def other():
            seen["try"] = m.try_lock()
            try:
                m.lock(timeout=0.02)
            except gs.GradsyncError as e:
                seen["timeout"] = e.status
            try:
                m.unlock()
            except gs.GradsyncError as e:
                seen["unlock"] = (e.status, e.message)

        t = threading.Thread(target=other, daemon=True)
        t.start()
        t.join(timeout=60)
        assert seen["try"] is False
        assert seen["timeout"] == gs.E_TIMEOUT
        assert seen["unlock"][0] == gs.E_NOT_OWNER
        assert f"held by thread {threading.get_native_id()}" in seen["unlock"][1]
    assert m.try_lock()
    m.unlock()
    with pytest.raises(gs.GradsyncError) as info:
        m.unlock()
    assert info.value.status == gs.E_NOT_OWNER
    with pytest.raises(ValueError):
        m.lock(timeout=-1)


def test_mutex_excludes_python_threads():
    m, total = gs.Mutex(), [0]

    def worker():
        for _ in range(2000):
            with m:
                v = total[0]
                total[0] = v + 1

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert total[0] == 8000


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_atomic_add_loses_no_update(dtype):
    n, reps, workers = 100_003, 20, 4
    dst = np.zeros(n, dtype=dtype)
    src = (np.arange(n) % 5).astype(dtype)

    def worker():
        for _ in range(reps):
            gs.atomic_add(dst, src)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    np.testing.assert_array_equal(dst, src * (reps * workers))


def test_atomic_add_in_place_on_a_view_and_bad_input():
    big = np.zeros(10, dtype=np.float32)
    gs.atomic_add(big[3:7], np.ones(4, dtype=np.float32))
    assert big.tolist() == [0, 0, 0, 1, 1, 1, 1, 0, 0, 0]
    gs.atomic_add(np.zeros(0, dtype=np.float32), np.zeros(0, dtype=np.float32))
    with pytest.raises(TypeError):
        gs.atomic_add(big, np.ones(10))  # float64 into float32: no silent conversion
    with pytest.raises(TypeError):
        gs.atomic_add(np.zeros(3, dtype=np.int32), np.zeros(3, dtype=np.int32))
    with pytest.raises(ValueError):
        gs.atomic_add(big[::2], np.ones(5, dtype=np.float32))  # not contiguous
    with pytest.raises(gs.GradsyncError) as info:
        gs.atomic_add(big, np.ones(9, dtype=np.float32))
    assert info.value.status == gs.E_INVALID_ARG
    with pytest.raises(gs.GradsyncError) as overlap:
        gs.atomic_add(big[1:], big[:-1])
    assert "overlaps" in overlap.value.message
    readonly = np.zeros(4, dtype=np.float32)
    readonly.flags.writeable = False
    with pytest.raises(ValueError):
        gs.atomic_add(readonly, np.ones(4, dtype=np.float32))


def test_hogwild_demo_learns(capsys):
    # The main demo's hogwild mode, shortened: N threads through atomic_add reach a useful
    # held-out accuracy and lose no sample (the shared counter saw every one).
    import train_digits

    args = train_digits.parse_args(["--mode", "hogwild", "--workers", "3", "--epochs", "10", "--lr", "0.05", "--seed", "1"])
    data = train_digits.load_digits(seed=1)
    model = train_digits.MLP(data.features, args.hidden, data.classes)
    result = train_digits.run_hogwild(args, data, model, 3)
    assert result.samples == 10 * len(data.y_train)
    assert len(result.losses) == 11 and result.losses[-1] < result.losses[0] / 4
    assert result.accuracy > 0.85, result
