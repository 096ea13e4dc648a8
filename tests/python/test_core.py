# SPDX-License-Identifier: Apache-2.0
import threading

import pytest

import gradsync as gs


def test_version_and_abi():
    assert gs.abi_version() == gs.ABI_VERSION
    major, minor, patch = (int(x) for x in gs.version().split("."))
    assert gs.lib.gradsync_version_number() == major * 10000 + minor * 100 + patch


def test_features():
    assert gs.has_feature(gs.FEATURE_THREAD_TRANSPORT)
    assert not gs.has_feature(999)
    # By name, as users write them.
    assert gs.has_feature("threads") and gs.has_feature("SHM")
    assert gs.has_feature("mpi") == gs.has_feature(gs.FEATURE_MPI_TRANSPORT)
    assert gs.has_feature("f16c") == gs.has_feature(gs.FEATURE_F16C)
    with pytest.raises(ValueError, match="unknown feature 'pigeons'; expected one of"):
        gs.has_feature("pigeons")
    with pytest.raises(TypeError):
        gs.has_feature(1.5)


def test_log_levels_by_name():
    try:
        gs.set_log_level("debug")
        assert gs.get_log_level() == gs.LOG_DEBUG
        gs.set_log_level("Warning")
        assert gs.get_log_level() == gs.LOG_WARN
        gs.set_log_level(gs.LOG_ERROR)
        assert gs.get_log_level() == gs.LOG_ERROR
        with pytest.raises(ValueError, match="unknown log level 'verbose'; expected one of .*'debug'"):
            gs.set_log_level("verbose")
        assert gs.get_log_level() == gs.LOG_ERROR  # unchanged
        with pytest.raises(ValueError):
            gs.set_log_callback(lambda level, msg: None, "loud")
    finally:
        gs.set_log_level("warn")


def test_error_carries_status_and_message():
    with pytest.raises(gs.GradsyncError) as info:
        gs.set_log_level(42)
    assert info.value.status == gs.E_INVALID_ARG
    assert "log level 42 outside [0, 6]" in info.value.message
    assert "GRADSYNC_E_INVALID_ARG" in str(info.value)


def test_log_callback_from_another_thread():
    seen = []
    gs.set_log_callback(lambda level, msg: seen.append((level, msg)), gs.LOG_DEBUG)
    try:
        t = threading.Thread(target=lambda: gs.lib.gradsync_set_log_level(99))
        t.start()
        t.join()
        assert any("log level 99" in msg for _, msg in seen)
    finally:
        gs.set_log_callback(None)
    assert gs.get_log_level() == gs.LOG_WARN
