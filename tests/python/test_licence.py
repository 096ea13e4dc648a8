# SPDX-License-Identifier: Apache-2.0
"""Every source file of the project says its licence in its first lines (SPDX), as LICENSE is Apache-2.0."""
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Fuzz corpora are the fuzzers' inputs (arbitrary bytes), not source.
EXEMPT_PREFIXES = ("docs/", "LICENSE", ".gitignore", "tests/fuzz/corpus/")
EXEMPT_SUFFIXES = (".md", ".png")


def test_every_source_file_has_an_spdx_line():
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True)
    missing = []
    for name in listed.stdout.split():
        if name.startswith(EXEMPT_PREFIXES) or name.endswith(EXEMPT_SUFFIXES):
            continue
        path = ROOT / name
        if path.is_file() and b"SPDX-License-Identifier: Apache-2.0" not in path.read_bytes()[:400]:
            missing.append(name)
    assert not missing, missing
