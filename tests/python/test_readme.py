# SPDX-License-Identifier: Apache-2.0
"""Every code example in README.md runs as written: the Python ones as scripts in a fresh directory,
the C one compiled against the headers and library with a main that runs it on two threads, and
the Rust one is the crate's example `readme` (run by CI's Rust stage), kept equal here."""
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def blocks(lang):
    return re.findall(r"```" + lang + r"\n(.*?)```\n", README, re.S)


PYTHON = blocks("python")


def test_the_readme_has_its_examples():
    assert len(PYTHON) >= 5 and len(blocks("c")) == 1 and len(blocks("rust")) == 1


@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_python_example_runs_as_written(index):
    code = PYTHON[index]
    with tempfile.TemporaryDirectory() as tmp:
        # Nothing but the package on the path, as after an install; run where it may write files.
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp, env=dict(os.environ), capture_output=True,
                              text=True, timeout=300)
    assert done.returncode == 0, f"README example {index} failed:\n{code}\n{done.stdout}\n{done.stderr}"


def test_python_examples_print_what_their_comments_say():
    atomics = next(c for c in PYTHON if "gs.atomic_add" in c)
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, "-c", atomics], cwd=tmp, capture_output=True, text=True,
                             timeout=120).stdout.split("\n")
    assert out[0] == "(4, 3)" and out[1] == "[0 3 6 9]" and out[2] == "[2.5 2.5 2.5 2.5] 0.65 40", out


def test_c_example_compiles_and_runs():
    lib = pathlib.Path(os.environ["GRADSYNC_LIBRARY"]).resolve()
    build = lib.parent
    main = r"""
#include <pthread.h>
#include <string.h>
struct arg { int32_t rank; float grad[2]; int rc; };
static void *run(void *p) {
  struct arg *a = p;
  a->rc = train_step(a->rank, 2, a->grad, 2);
  return NULL;
}
int main(void) {
  struct arg a[2] = {{0, {2.0f, 4.0f}, -1}, {1, {4.0f, 8.0f}, -1}};
  pthread_t t[2];
  for (int r = 0; r < 2; ++r) pthread_create(&t[r], NULL, run, &a[r]);
  for (int r = 0; r < 2; ++r) pthread_join(t[r], NULL);
  for (int r = 0; r < 2; ++r)
    if (a[r].rc != GRADSYNC_OK || a[r].grad[0] != 3.0f || a[r].grad[1] != 6.0f) return 1;
  return 0;
}
"""
    compiler_env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "example.c"
        src.write_text(blocks("c")[0] + main)
        exe = pathlib.Path(tmp) / "example"
        subprocess.run(["cc", "-std=c99", "-Wall", "-Werror", "-D_POSIX_C_SOURCE=200809L", f"-I{ROOT / 'include'}",
                        f"-I{build / 'include'}", str(src), "-o", str(exe), str(lib), f"-Wl,-rpath,{build}",
                        "-pthread"], check=True, env=compiler_env, timeout=120)
        done = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_rust_example_is_the_crates_example():
    example = (ROOT / "rust/gradsync/examples/readme.rs").read_text()
    body = "".join(line + "\n" for line in example.split("\n")[:-1] if not line.startswith("// "))
    assert body == blocks("rust")[0], "rust/gradsync/examples/readme.rs and README.md's Rust example differ"
