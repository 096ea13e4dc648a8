# SPDX-License-Identifier: Apache-2.0
"""MPI as a plugin: libgradsync does not link MPI; libgradsync-mpi.so.0 does, and is loaded on the
first MPI communicator. Without the plugin the MPI transport says what to install (E_UNSUPPORTED)
and every other transport works. Each case that swaps the plugin runs in a fresh interpreter,
since a process loads the plugin (or fails to) once.
"""
import os
import pathlib
import struct
import subprocess
import sys

import pytest

import gradsync as gs

LIBRARY = pathlib.Path(gs.lib._name).resolve()
PLUGIN = LIBRARY.parent / "libgradsync-mpi.so.0"
# Set by ctest from the build's configuration: 1 when the build found Open MPI.
EXPECT_MPI = os.environ.get("GRADSYNC_TEST_EXPECT_MPI")


def needed(path):
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return [line.split("[")[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def run_python(code, **env):
    full = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=full)


def test_the_core_library_does_not_link_mpi():
    assert not [n for n in needed(LIBRARY) if "mpi" in n.lower()], needed(LIBRARY)


def test_a_build_with_mpi_has_the_plugin_and_it_loads():
    # A build that found MPI must deliver the transport: a plugin that silently failed to load
    # would otherwise turn every MPI test into a skip.
    assert EXPECT_MPI in ("0", "1"), "GRADSYNC_TEST_EXPECT_MPI is set by ctest"
    if EXPECT_MPI == "0":
        assert not PLUGIN.exists()
        assert not gs.has_feature(gs.FEATURE_MPI_TRANSPORT)
    else:
        assert PLUGIN.exists(), PLUGIN
        assert [n for n in needed(PLUGIN) if n.startswith("libmpi.so")], needed(PLUGIN)
        assert gs.has_feature(gs.FEATURE_MPI_TRANSPORT)


CREATE_MPI = """
import gradsync as gs
print("feature", gs.has_feature(gs.FEATURE_MPI_TRANSPORT))
try:
    gs.Communicator(transport="mpi", timeout_ms=5000)
    print("created")
except gs.GradsyncError as e:
    print("status", e.status)
    print(e.message)
# The other transports do not need the plugin.
with gs.Communicator("no-plugin", 0, 1) as c:
    import numpy as np
    x = np.arange(4, dtype=np.float32)
    c.allreduce(x, op="sum")
    print("threads", x.tolist())
"""


def test_without_the_plugin_the_mpi_transport_says_what_to_install():
    proc = run_python(CREATE_MPI, GRADSYNC_MPI_PLUGIN="/nonexistent/libgradsync-mpi.so.0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "feature False"
    assert lines[1] == f"status {gs.E_UNSUPPORTED}"
    message = "\n".join(lines[2:-1])
    if EXPECT_MPI == "1":
        assert "libgradsync-mpi.so.0" in message and "apt install" in message, message
        assert "/nonexistent/libgradsync-mpi.so.0" in message, message  # and why it could not load
    assert lines[-1] == "threads [0.0, 1.0, 2.0, 3.0]"


def test_a_library_that_is_not_the_plugin_is_refused():
    # The core library loads but has no plugin table: refused, and said so.
    if EXPECT_MPI != "1":
        pytest.skip("built without MPI: there is no plugin to stand in for")
    proc = run_python(CREATE_MPI, GRADSYNC_MPI_PLUGIN=str(LIBRARY))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "feature False"
    assert lines[1] == f"status {gs.E_UNSUPPORTED}"
    assert "not the gradsync MPI plugin (it has no gradsync_mpi_plugin_api)" in proc.stdout, proc.stdout


def test_a_plugin_built_against_another_mpi_h_is_refused():
    # The plugin's own code with another mpi.h recorded in its table (tests/mpi/skewed_plugin.cpp):
    # the types the table's functions take may differ, so it is refused, and the message says so.
    if EXPECT_MPI != "1":
        pytest.skip("built without MPI: there is no plugin to skew")
    skewed = os.environ["GRADSYNC_TEST_SKEWED_PLUGIN"]
    proc = run_python(CREATE_MPI, GRADSYNC_MPI_PLUGIN=skewed)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "feature False"
    assert lines[1] == f"status {gs.E_UNSUPPORTED}"
    assert f"{skewed}: built against another mpi.h" in proc.stdout, proc.stdout
    assert lines[-1] == "threads [0.0, 1.0, 2.0, 3.0]"


def load_segments(image):
    """End of the program header table and (offset, file size) of each PT_LOAD of a 64-bit ELF image."""
    assert image[:4] == b"\x7fELF" and image[4] == 2, "a 64-bit ELF file"
    order = "<" if image[5] == 1 else ">"
    phoff, = struct.unpack_from(order + "Q", image, 0x20)
    phentsize, phnum = struct.unpack_from(order + "HH", image, 0x36)
    loads = []
    for i in range(phnum):
        p_type, _, p_offset, _, _, p_filesz = struct.unpack_from(order + "IIQQQQ", image, phoff + i * phentsize)
        if p_type == 1 and p_filesz > 0:
            loads.append((p_offset, p_filesz))
    return phoff + phnum * phentsize, loads


def damaged_copies(tmp_path):
    """Name -> (path of a damaged copy of the built plugin, what the refusal must say)."""
    image = PLUGIN.resolve().read_bytes()
    headers_end, loads = load_segments(image)
    assert len(loads) >= 2, loads
    cuts = {
        "empty": (0, "truncated: 0 bytes, shorter than an ELF header"),
        "half an ELF header": (40, "truncated: 40 bytes, shorter than an ELF header"),
        "program headers cut": (headers_end - 1, "truncated or damaged: its program headers"),
        "second segment cut": (loads[1][0] + 1, "truncated or damaged: its loadable segment"),
        "last segment half there": (loads[-1][0] + loads[-1][1] // 2, "truncated or damaged: its loadable segment"),
        # The loader would map this one without a fault (the byte is on a page the file still
        # reaches) and run the plugin with a byte of its data zeroed.
        "last byte of the last segment gone": (loads[-1][0] + loads[-1][1] - 1,
                                               "truncated or damaged: its loadable segment"),
    }
    copies = {}
    for name, (size, says) in cuts.items():
        path = tmp_path / (name.replace(" ", "-") + ".so")
        path.write_bytes(image[:size])
        copies[name] = (path, says)
    text = tmp_path / "text.so"
    text.write_text("a shell script or a download's error page, not a library\n" * 4)
    copies["not ELF"] = (text, "not an ELF file")
    order = "<" if image[5] == 1 else ">"
    machine, = struct.unpack_from(order + "H", image, 0x12)
    foreign = tmp_path / "foreign.so"  # e_machine: aarch64's, or x86-64's on aarch64
    foreign.write_bytes(image[:0x12] + struct.pack(order + "H", 183 if machine != 183 else 62) + image[0x14:])
    copies["another machine"] = (foreign, "an ELF file for another machine")
    return copies


def test_a_truncated_or_foreign_plugin_file_is_refused_before_it_is_mapped(tmp_path):
    # A partial copy of the plugin made the loader map segments past the end of the file, and the
    # process died of SIGBUS inside dlopen. Each damaged file is now refused with E_UNSUPPORTED and
    # a message naming it and what is wrong, and the other transports still work.
    if EXPECT_MPI != "1":
        pytest.skip("built without MPI: there is no plugin to damage")
    for name, (path, says) in damaged_copies(tmp_path).items():
        proc = run_python(CREATE_MPI, GRADSYNC_MPI_PLUGIN=str(path))
        assert proc.returncode == 0, (name, proc.returncode, proc.stdout + proc.stderr)
        lines = proc.stdout.splitlines()
        assert lines[:2] == ["feature False", f"status {gs.E_UNSUPPORTED}"], (name, proc.stdout)
        assert f"{path}: {says}" in proc.stdout, (name, proc.stdout)
        assert lines[-1] == "threads [0.0, 1.0, 2.0, 3.0]", (name, proc.stdout)


def test_a_copy_cut_right_after_its_last_segment_still_loads(tmp_path):
    # Past the last segment are only the section headers, which the loader never reads: the check
    # refuses what would fault or lose bytes, not a file the loader can use whole.
    if EXPECT_MPI != "1":
        pytest.skip("built without MPI: there is no plugin to cut")
    image = PLUGIN.resolve().read_bytes()
    _, loads = load_segments(image)
    end = max(offset + size for offset, size in loads)
    assert end < len(image)
    cut = tmp_path / "cut.so"
    cut.write_bytes(image[:end])
    proc = run_python("import gradsync as gs; print(gs.has_feature(gs.FEATURE_MPI_TRANSPORT))",
                      GRADSYNC_MPI_PLUGIN=str(cut))
    assert proc.returncode == 0 and proc.stdout == "True\n", proc.stdout + proc.stderr
