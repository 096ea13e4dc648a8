# SPDX-License-Identifier: Apache-2.0
"""Every source file of the project says its licence in its first lines (SPDX), as LICENSE is Apache-2.0.

The source files are found by walking the tree, not by asking git: the check must run the same in a
checkout, in an unpacked source tarball (no .git) and on a machine without git.
"""
import fnmatch
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Fuzz corpora are the fuzzers' inputs (arbitrary bytes), not source.
EXEMPT_PREFIXES = ("docs/", "LICENSE", ".gitignore", "tests/fuzz/corpus/")
EXEMPT_SUFFIXES = (".md", ".png")
# A directory holding one of these was made by a tool, wherever it was put: a CMake build tree, a
# cache that says it is one (pytest's, cargo's target/), a Python virtual environment.
GENERATED_MARKERS = ("CMakeCache.txt", "CACHEDIR.TAG", "pyvenv.cfg")


def ignore_rules(root):
    """The top-level .gitignore as (pattern, anchored, directories only): what the project says is not source."""
    rules = []
    path = root / ".gitignore"
    for line in path.read_text().splitlines() if path.exists() else []:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        assert not line.startswith("!"), f".gitignore: negation ({line}) is not understood by this walk"
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        anchored = "/" in line  # as git: a slash anywhere but at the end ties the pattern to the root
        rules.append((line.lstrip("/"), anchored, dir_only))
    return rules


def ignored(rel, is_dir, rules):
    return any((is_dir or not dir_only) and fnmatch.fnmatch(rel if anchored else rel.rsplit("/", 1)[-1], pattern)
               for pattern, anchored, dir_only in rules)


def source_files(root):
    """Paths (relative, with /) of the files under root that are the project's own: neither generated nor ignored."""
    rules = ignore_rules(root)
    found = []
    for top, dirs, files in os.walk(root):
        here = pathlib.Path(top).relative_to(root).as_posix()
        prefix = "" if here == "." else here + "/"
        dirs[:] = sorted(d for d in dirs
                         if d != ".git" and not ignored(prefix + d, True, rules)
                         and not any((pathlib.Path(top, d, m)).exists() for m in GENERATED_MARKERS))
        found += [prefix + f for f in sorted(files) if f != ".git" and not ignored(prefix + f, False, rules)]
    return found


def missing_spdx(root):
    missing = []
    for name in source_files(root):
        if name.startswith(EXEMPT_PREFIXES) or name.endswith(EXEMPT_SUFFIXES):
            continue
        path = root / name
        if path.is_file() and b"SPDX-License-Identifier: Apache-2.0" not in path.read_bytes()[:400]:
            missing.append(name)
    return missing


def test_every_source_file_has_an_spdx_line():
    assert not missing_spdx(ROOT), missing_spdx(ROOT)


def test_the_walk_finds_the_project_and_leaves_out_what_tools_made():
    files = set(source_files(ROOT))
    for known in ("CMakeLists.txt", ".ci/run", "src/comm/transport/mpi/mpi_api.cpp", "tests/python/test_licence.py"):
        assert known in files, known
    # ctest runs this from a build tree inside the checkout (build/), whose files are not source.
    assert not [f for f in files if f.startswith("build/")]


def test_a_file_without_the_line_is_found(tmp_path):
    # A small tree with what a working checkout holds besides its sources.
    (tmp_path / ".gitignore").write_text("/build*/\n__pycache__/\n*.pyc\n/rust/target/\n")
    files = {
        "src/good.cpp": "// SPDX-License-Identifier: Apache-2.0\nint x;\n",
        "src/bad.cpp": "int y;\n",
        ".ci/run": "#!/bin/sh\necho no licence\n",
        "docs/notes.txt": "exempt\n",
        "tests/fuzz/corpus/segment/seed": "\x00\x01",
        "build/CMakeCache.txt": "ignored by .gitignore\n",
        "out/CMakeCache.txt": "a build tree elsewhere\n",
        "out/generated.cpp": "int z;\n",
        "venv/pyvenv.cfg": "home = /usr/bin\n",
        "venv/lib/site.py": "x = 1\n",
        ".pytest_cache/CACHEDIR.TAG": "Signature: 8a477f597d28d172789f06886806bc55\n",
        "src/__pycache__/m.cpython-311.pyc": "\x00",
        "src/m.pyc": "\x00",
        "rust/target/debug/build.rs": "fn main() {}\n",
        ".git/config": "[core]\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert source_files(tmp_path) == [".gitignore", ".ci/run", "docs/notes.txt", "src/bad.cpp", "src/good.cpp",
                                      "tests/fuzz/corpus/segment/seed"]
    assert missing_spdx(tmp_path) == [".ci/run", "src/bad.cpp"]
