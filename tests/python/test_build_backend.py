# SPDX-License-Identifier: Apache-2.0
"""The in-tree PEP 517 backend (scripts/pep517/gradsync_backend.py) writes a complete wheel: every
file of the package, the library this build made byte for byte, METADATA from pyproject.toml with
the version from CMakeLists.txt, and a RECORD whose hashes and sizes are the files'. It packs the
build the tests run against (config setting build-dir); CI's 40-wheel stage installs such wheels
with two Pythons and imports them."""
import base64
import csv
import hashlib
import io
import os
import pathlib
import re
import sys
import tarfile
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "pep517"))
import gradsync_backend as backend  # noqa: E402

BUILD = pathlib.Path(os.environ["GRADSYNC_LIBRARY"]).resolve().parent
VERSION = re.search(r"project\(gradsync VERSION ([0-9.]+)", (ROOT / "CMakeLists.txt").read_text()).group(1)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    with pytest.MonkeyPatch.context() as mp:
        # CMake need not run under a sanitizer runtime preloaded for this interpreter.
        mp.delenv("LD_PRELOAD", raising=False)
        name = backend.build_wheel(str(out), {"build-dir": str(BUILD)})
    with zipfile.ZipFile(out / name) as z:
        yield name, {info.filename: (info, z.read(info)) for info in z.infolist()}


def test_wheel_name_and_tags(wheel):
    name, files = wheel
    assert re.fullmatch(rf"gradsync-{re.escape(VERSION)}-py3-none-linux_\w+\.whl", name), name
    tags = files[f"gradsync-{VERSION}.dist-info/WHEEL"][1].decode()
    assert "Root-Is-Purelib: false" in tags and f"Tag: {name[len(f'gradsync-{VERSION}-'):-4]}" in tags


def test_wheel_carries_the_package_and_this_builds_libraries(wheel):
    _, files = wheel
    package = {f"gradsync/{p.relative_to(ROOT / 'scripts' / 'gradsync').as_posix()}"
               for p in (ROOT / "scripts" / "gradsync").rglob("*.py") if "__pycache__" not in p.parts}
    assert package and package <= set(files)
    for line in (BUILD / backend.MANIFEST).read_text().splitlines():
        path, soname = line.split("\t")
        info, data = files[f"gradsync/{soname}"]
        assert data == pathlib.Path(path).read_bytes(), soname
        assert (info.external_attr >> 16) & 0o777 == 0o755, soname
    assert "gradsync/libgradsync.so.0" in files
    assert not [n for n in files if "__pycache__" in n or n.endswith(".pyc")]


def test_metadata_comes_from_pyproject_and_cmake(wheel):
    _, files = wheel
    text = files[f"gradsync-{VERSION}.dist-info/METADATA"][1].decode()
    head, body = text.split("\n\n", 1)
    fields = [tuple(line.split(": ", 1)) for line in head.splitlines()]
    assert ("Name", "gradsync") in fields and ("Version", VERSION) in fields
    assert ("Requires-Dist", "numpy") in fields and ("Requires-Python", ">=3.9") in fields
    assert body == (ROOT / "README.md").read_text()


def test_record_lists_every_file_with_its_hash_and_size(wheel):
    _, files = wheel
    record_name = f"gradsync-{VERSION}.dist-info/RECORD"
    rows = list(csv.reader(io.StringIO(files[record_name][1].decode())))
    assert {row[0] for row in rows} == set(files)
    for path, digest, size in rows:
        if path == record_name:
            assert digest == size == ""
            continue
        data = files[path][1]
        expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert digest == f"sha256={expected}" and int(size) == len(data), path


def test_the_project_table_reader_agrees_with_tomllib():
    tomllib = pytest.importorskip("tomllib")  # 3.11+; the reader serves 3.9 and 3.10
    text = (ROOT / "pyproject.toml").read_text()
    assert backend._read_project_table(text) == tomllib.loads(text)["project"]


def test_sdist_holds_the_sources_and_pkg_info(tmp_path):
    name = backend.build_sdist(str(tmp_path))
    assert name == f"gradsync-{VERSION}.tar.gz"
    with tarfile.open(tmp_path / name) as tar:
        names = set(tar.getnames())
    base = f"gradsync-{VERSION}"
    for member in ("PKG-INFO", "pyproject.toml", "CMakeLists.txt", "scripts/pep517/gradsync_backend.py",
                   "scripts/gradsync/__init__.py", "include/gradsync/gradsync.h"):
        assert f"{base}/{member}" in names, member
    assert not [n for n in names if n.startswith(f"{base}/build/") or "/__pycache__/" in n]
