# SPDX-License-Identifier: Apache-2.0
"""python3 -m gradsync.run: N real processes joined by shared memory through the environment; a
failing rank is named, the others stopped, its status returned (with --elastic a killed rank is
lost and the others go on); each output line tagged with its rank, whole; OMP_NUM_THREADS=1 unless
set; -m module; and whatever kills what, no rank and no segment is left behind."""
import glob
import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

import gradsync as gs
from gradsync.run import segment_path, subgroup_prefix

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
    assert sorted(done.stdout.split("\n")[:-1]) == [f"[rank {r}] rank {r} of 3 6.0 shm" for r in range(3)]


def test_a_failed_rank_is_named_and_the_others_stopped(tmp_path):
    done = launch(tmp_path, 3, "1")
    assert done.returncode != 0
    # The others fail too (rank 1 left their group) or are stopped; rank 1 is named with its status.
    assert "ranks failed: " in done.stderr and "rank 1 (status 3)" in done.stderr, done.stderr


ELASTIC_RANK = textwrap.dedent("""
    import os, signal, sys, numpy as np, gradsync as gs
    c = gs.Communicator.from_env(timeout_ms=20000)
    v = np.ones(1, np.float32)
    c.allreduce(v)
    if c.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    while True:
        try:
            c.allreduce(v)
        except gs.GradsyncError:
            break
    new, failed, _ = c.shrink()
    c.close()
    ids = new.allreduce(np.array([float(new.member_id)]), op="sum")
    sys.stdout.write(f"member {new.member_id} of {new.size} failed {failed} ids {ids[0]}\\n")
    sys.stdout.flush()
    new.close()
""")


def test_elastic_a_rank_killed_is_lost_and_the_others_go_on(tmp_path):
    script = tmp_path / "elastic.py"
    script.write_text(ELASTIC_RANK)
    group = f"py-launch-lost-{os.getpid()}"
    done = subprocess.run([sys.executable, "-m", "gradsync.run", "-n", "3", "--elastic", "--grace", "2",
                           "--group", group, str(script)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    assert "rank 1 lost (signal SIGKILL); the others go on" in done.stderr, done.stderr
    assert sorted(done.stdout.split("\n")[:-1]) == [f"[rank {r}] member {r} of 2 failed [1] ids 2.0" for r in (0, 2)]
    assert not glob.glob(f"/dev/shm/gradsync.{group}*")  # the killed rank's segments, the shrunk group's


REPLACED_RANK = textwrap.dedent("""
    import os, signal, sys, numpy as np, gradsync as gs
    from gradsync.run import join_name
    if "GRADSYNC_JOIN" in os.environ:  # the replacement
        c, _ = gs.Communicator.join(os.environ["GRADSYNC_JOIN"], timeout_ms=60000, transport="shm")
    else:
        c = gs.Communicator.from_env(timeout_ms=60000)
        v = np.ones(1, np.float32)
        c.allreduce(v)
        if c.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        while True:
            try:
                c.allreduce(v)
            except gs.GradsyncError:
                break
        shrunk, _, _ = c.shrink()
        c.close()
        if "NO_GROW" in os.environ:  # the replacement waits in vain
            shrunk.close()
            sys.exit(0)
        c, _ = shrunk.grow(join_name(os.environ["GRADSYNC_GROUP"], 1), 1)
        shrunk.close()
    ids = c.allreduce(np.array([float(c.member_id)]), op="sum")
    sys.stdout.write(f"member {c.member_id} rank {c.rank} of {c.size} ids {ids[0]}\\n")
    sys.stdout.flush()
    c.close()
""")


def run_replaced(tmp_path, group, grace, **env):
    """REPLACED_RANK on 3 ranks under --elastic --replace; the run must end well."""
    script = tmp_path / "replaced.py"
    script.write_text(REPLACED_RANK)
    done = subprocess.run([sys.executable, "-m", "gradsync.run", "-n", "3", "--elastic", "--replace", "--grace", grace,
                           "--group", group, str(script)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **env))
    assert done.returncode == 0, done.stderr
    return done


def test_elastic_replace_a_lost_rank_joins_the_group_the_others_grow(tmp_path):
    group = f"py-launch-replaced-{os.getpid()}"
    done = run_replaced(tmp_path, group, "2")
    assert "rank 1 replaced" in done.stderr, done.stderr
    assert not glob.glob(f"/dev/shm/gradsync.{group}*")  # the lobby's and the grown group's too
    # The replacement's output is tagged as rank 1's; it is rank 2 of the grown group, member id 3.
    assert sorted(done.stdout.split("\n")[:-1]) == ["[rank 0] member 0 rank 0 of 3 ids 5.0",
                                                     "[rank 1] member 3 rank 2 of 3 ids 5.0",
                                                     "[rank 2] member 2 rank 1 of 3 ids 5.0"]


def test_elastic_replace_a_replacement_the_others_never_grow_for_is_stopped_and_not_counted(tmp_path):
    group = f"py-launch-nogrow-{os.getpid()}"
    done = run_replaced(tmp_path, group, "1", NO_GROW="1")
    assert "the replacement for rank 1 did not join" in done.stderr, done.stderr
    assert not glob.glob(f"/dev/shm/gradsync.{group}*")


def test_a_replacement_asking_from_env_is_told_to_join(monkeypatch):
    monkeypatch.setenv("GRADSYNC_JOIN", "py-launch-x.join1")
    with pytest.raises(RuntimeError, match="gradsync.torch.elastic.join"):
        gs.Communicator.from_env()


def test_elastic_across_hosts_is_refused(capsys):
    from gradsync.run import main
    with pytest.raises(SystemExit):
        main(["--hosts", "a:2", "--elastic", "x.py"])
    err = capsys.readouterr().err
    assert "--hosts" in err and "State.grow" in err  # why, and the way across hosts


def test_join_name_cuts_the_group_to_whole_characters():
    from gradsync.run import join_name
    name = join_name("é" * 40, 1)  # 80 bytes: cut at 50, between two characters
    assert name == "é" * 25 + ".join1" and len(name.encode()) <= 63
    assert len(join_name("a" * 49 + "é" * 7, 2).encode()) == 49 + len(".join2")


def test_outside_a_launcher_the_error_says_how_to_start(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_") or k == "GRADSYNC_LIBRARY"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode != 0 and "python3 -m gradsync.run -n N" in done.stderr


def run_launcher(tmp_path, source, *args, env=None, name="prog.py"):
    script = tmp_path / name
    script.write_text(textwrap.dedent(source))
    return subprocess.run([sys.executable, "-m", "gradsync.run", *args, str(script)], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ) if env is None else env)


def test_omp_num_threads_is_1_unless_the_user_set_it(tmp_path):
    source = 'import os; print(os.environ.get("OMP_NUM_THREADS"), flush=True)\n'
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = run_launcher(tmp_path, source, "-n", "2", env=env)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["[rank 0] 1", "[rank 1] 1"]
    done = run_launcher(tmp_path, source, "-n", "2", env=dict(env, OMP_NUM_THREADS="3"))
    assert sorted(done.stdout.splitlines()) == ["[rank 0] 3", "[rank 1] 3"]



def _voluntary_switches(pid):
    """The voluntary context switches of the process's main thread: one each time it sleeps."""
    status = pathlib.Path(f"/proc/{pid}/task/{pid}/status").read_text()
    return int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M).group(1))


def test_the_launcher_sleeps_while_its_ranks_run(tmp_path):
    # It wakes when a rank ends or a signal comes, not on a clock: a launcher that polled woke ~100
    # times a second, taking a core from the ranks. Its main thread is the one that waits.
    script = tmp_path / "sleeper.py"
    script.write_text("import sys, time\nprint('up', flush=True)\ntime.sleep(float(sys.argv[1]))\n")
    launcher = subprocess.Popen([sys.executable, "-m", "gradsync.run", "-n", "2", str(script), "4"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert sorted(launcher.stdout.readline() for _ in range(2)) == ["[rank 0] up\n", "[rank 1] up\n"]
        before = _voluntary_switches(launcher.pid)
        time.sleep(2)
        woke = _voluntary_switches(launcher.pid) - before
        assert launcher.poll() is None, "the ranks sleep 4 s: the launcher must still be waiting"
        assert woke <= 10, f"the launcher woke {woke} times while its ranks slept"
        # And it still sees the ranks end at once and returns their status.
        assert launcher.wait(timeout=60) == 0, launcher.stderr.read()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


CHATTY = """
    import os, sys
    r = int(os.environ["GRADSYNC_RANK"])
    for i in range(300):
        # Two writes a line: unbuffered (as the launcher asks), each reaches the pipe alone, and
        # another rank's line could land between them.
        sys.stdout.write(f"line {i} ")
        sys.stdout.write(f"of rank {r}\\n")
        if i % 100 == 0:
            sys.stderr.write(f"err {i} of rank {r}\\n")
    sys.stdout.write(f"no newline from rank {r}")
"""


def test_each_line_whole_and_tagged_with_its_rank_and_logs_per_rank(tmp_path):
    done = run_launcher(tmp_path, CHATTY, "-n", "3", "--log-dir", str(tmp_path / "logs"))
    assert done.returncode == 0, done.stderr
    by_rank = {r: [] for r in range(3)}
    for line in done.stdout.splitlines():
        m = re.fullmatch(r"\[rank (\d)\] (.*)", line)
        assert m, line
        by_rank[int(m.group(1))].append(m.group(2))
    for r, lines in by_rank.items():
        assert lines == [f"line {i} of rank {r}" for i in range(300)] + [f"no newline from rank {r}"]
    err = sorted(done.stderr.splitlines())
    assert err == sorted(f"[rank {r}] err {i} of rank {r}" for r in range(3) for i in (0, 100, 200))
    for r in range(3):
        # Both streams, untagged, each in its order (how they interleave is the pipes' race).
        log = (tmp_path / "logs" / f"rank.{r}.log").read_text().splitlines()
        assert [x for x in log if not x.startswith("err")] == by_rank[r]
        assert [x for x in log if x.startswith("err")] == [f"err {i} of rank {r}" for i in (0, 100, 200)]


def test_untagged_output_on_request(tmp_path):
    # One write per rank: untagged output is the ranks' own, and a print() of two arguments is
    # several writes when stdout is unbuffered, which may interleave between the ranks.
    done = run_launcher(tmp_path, 'import os; os.write(1, f"rank {os.environ[\'GRADSYNC_RANK\']}\\n".encode())\n',
                        "-n", "2", "--no-tag-output")
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["rank 0", "rank 1"]


def test_a_module_with_its_arguments(tmp_path):
    package = tmp_path / "trainpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "main.py").write_text('import sys\nprint("module", __name__, sys.argv[1:])\n')
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run([sys.executable, "-m", "gradsync.run", "-n", "2", "-m", "trainpkg.main", "-m", "x", "--y"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [f"[rank {r}] module __main__ ['-m', 'x', '--y']" for r in range(2)]


# The kill matrix: each case starts 2 ranks that join a group (its segment now exists) and say
# their pids, kills something, and then waits (bounded) for every rank and the segment to be gone.
KILL_RANK = """
    import os, signal, sys, time
    import gradsync as gs
    mode = sys.argv[1]
    if mode == "ignore-int":  # as a program that ignores SIGINT (or a background job that inherited it)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    with gs.Communicator.from_env(timeout_ms=60000) as c, c.split(0) as sub:  # a subgroup: a segment too
        print("joined", os.getpid(), flush=True)
        if mode == "stuck":
            if c.rank == 1:
                sys.exit(3)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stuck in Python: only SIGKILL ends it
        while True:
            time.sleep(0.1)
"""


def _alive(pid):
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has ended; its new parent reaps it


def _watchers(segment):
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(segment).encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass
    return [pid for pid in found if _alive(pid)]


def _start(tmp_path, mode, group, ignore_int=False, grace=1):
    script = tmp_path / "kill_rank.py"
    script.write_text(textwrap.dedent(KILL_RANK))
    def background():  # as a shell starts a background job: SIGINT ignored
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    launcher = subprocess.Popen([sys.executable, "-m", "gradsync.run", "-n", "2", "--grace", str(grace),
                                 "--group", group, str(script), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, preexec_fn=background if ignore_int else None)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in launcher.stdout] + [lines.put(None)], daemon=True).start()
    pids = []
    while len(pids) < 2:
        line = lines.get(timeout=60)
        assert line is not None, launcher.stderr.read()
        if " joined " in line:
            pids.append(int(line.split()[-1]))
    # The launcher names the segments as the library does.
    assert segment_path(group).exists() and _subgroup_segments(group)
    return launcher, pids


def _subgroup_segments(group):
    prefix = subgroup_prefix(group)
    return [p for p in pathlib.Path("/dev/shm").iterdir() if str(p).startswith(prefix)]


def _nothing_left(pids, group, bound_s=30):
    segment = segment_path(group)
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if (not any(_alive(p) for p in pids) and not segment.exists() and not _subgroup_segments(group)
                and not _watchers(segment)):
            return True
        time.sleep(0.05)
    return (f"alive: {[p for p in pids if _alive(p)]}, segment: {segment.exists()}, "
            f"subgroups: {_subgroup_segments(group)}, watchers: {_watchers(segment)}")


def _group(tag):
    return f"kill {tag}+{os.getpid()}-{uuid.uuid4().hex[:6]}"  # a space and a +: escaped in the segment's name


def test_kill_a_rank_stuck_in_python_the_segment_is_removed(tmp_path):
    group = _group("stuck")
    launcher, pids = _start(tmp_path, "stuck", group)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 3, err  # rank 1's status; rank 0 ignored SIGTERM and got SIGKILL
    assert "rank 1 (status 3)" in err and "stopped ranks [0]" in err, err
    assert _nothing_left(pids, group) is True


def test_kill_sigterm_to_the_launcher(tmp_path):
    group = _group("term, longer than the 40 bytes kept")
    launcher, pids = _start(tmp_path, "wait", group)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == -signal.SIGTERM, err  # it dies of the signal it got
    assert "stopped by SIGTERM" in err
    assert _nothing_left(pids, group) is True


def test_kill_sigint_to_a_launcher_whose_ranks_ignore_it_escalates(tmp_path):
    group = _group("int")
    launcher, pids = _start(tmp_path, "ignore-int", group, ignore_int=True)
    launcher.send_signal(signal.SIGINT)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == -signal.SIGINT, err
    assert _nothing_left(pids, group) is True


def test_kill_a_second_sigint_escalates_at_once(tmp_path):
    group = _group("int-twice")
    launcher, pids = _start(tmp_path, "ignore-int", group, grace=3600)  # only the second SIGINT can end it
    launcher.send_signal(signal.SIGINT)
    time.sleep(0.5)  # two deliveries: two pending SIGINTs would be one
    launcher.send_signal(signal.SIGINT)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == -signal.SIGINT, err
    assert _nothing_left(pids, group) is True


def test_kill_sigint_to_a_launcher_ranks_that_take_it_end_cleanly(tmp_path):
    group = _group("int-clean")
    launcher, pids = _start(tmp_path, "wait", group)
    launcher.send_signal(signal.SIGINT)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == -signal.SIGINT, err
    assert "KeyboardInterrupt" in err  # the ranks' own traceback, tagged
    assert _nothing_left(pids, group) is True


def test_kill_sigkill_to_the_launcher_its_ranks_die_with_it(tmp_path):
    group = _group("kill")
    launcher, pids = _start(tmp_path, "wait", group)
    launcher.kill()
    launcher.wait(timeout=60)
    assert _nothing_left(pids, group) is True


def test_a_group_name_too_long_is_refused_before_any_rank_starts(tmp_path):
    done = run_launcher(tmp_path, 'print("started")\n', "-n", "2", "--group", "g" * 64)
    assert done.returncode == 2 and "--group must be 1 to 63 bytes, got 64" in done.stderr
    assert done.stdout == ""
