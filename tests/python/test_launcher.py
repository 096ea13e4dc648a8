# SPDX-License-Identifier: Apache-2.0
"""python3 -m gradsync.run: N real processes joined by shared memory through the environment; a
failing rank is named, the others stopped, its status returned."""
import os
import subprocess
import sys
import textwrap

RANK = textwrap.dedent("""
    import sys, numpy as np, gradsync as gs
    with gs.Communicator.from_env(timeout_ms=20000) as c:
        v = np.array([c.rank + 1.0], np.float32)
        c.allreduce(v, op="sum")
        # One write of a whole line: print() writes the text and the newline separately when
        # stdout is unbuffered (PYTHONUNBUFFERED), and three ranks share the launcher's pipe.
        sys.stdout.write(f"rank {c.rank} of {c.size} {v[0]} {c.transport}\\n")
        sys.stdout.flush()
        if len(sys.argv) > 1 and int(sys.argv[1]) == c.rank:
            sys.exit(3)
        c.barrier()  # the others wait here for the failed rank until stopped
""")


def launch(tmp_path, n, *args):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    return subprocess.run([sys.executable, "-m", "gradsync.run", "-n", str(n), "--grace", "2", str(script), *args],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))


def test_ranks_join_through_the_environment(tmp_path):
    done = launch(tmp_path, 3)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split("\n")[:-1]) == [f"rank {r} of 3 6.0 1" for r in range(3)]


def test_a_failed_rank_is_named_and_the_others_stopped(tmp_path):
    done = launch(tmp_path, 3, "1")
    assert done.returncode != 0
    # The others fail too (rank 1 left their group) or are stopped; rank 1 is named with its status.
    assert "ranks failed: " in done.stderr and "rank 1 (status 3)" in done.stderr, done.stderr


def test_outside_a_launcher_the_error_says_how_to_start(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_") or k == "GRADSYNC_LIBRARY"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode != 0 and "python3 -m gradsync.run -n N" in done.stderr
