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
