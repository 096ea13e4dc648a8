# SPDX-License-Identifier: Apache-2.0
"""Start N ranks of a program on this host, joined by shared memory, or on several hosts:

    python3 -m gradsync.run -n 4 train.py --epochs 3
    python3 -m gradsync.run -n 4 --log-dir logs -m mypackage.train --epochs 3
    python3 -m gradsync.run --hosts node1:2,node2:2 train.py --epochs 3

With --hosts, mpirun starts the ranks (GRADSYNC_TRANSPORT=hier: shared memory within a host, MPI
between hosts; rank and size come from MPI), tags their output and stops them; --mpirun and
--mpirun-args choose it and pass it options. The rest of this text is about one host.

Each rank is `python3 train.py --epochs 3` (or `python3 -m module ...`) with GRADSYNC_GROUP,
GRADSYNC_RANK, GRADSYNC_SIZE and GRADSYNC_TRANSPORT=shm in its environment, which
`gradsync.Communicator.from_env()` reads, and OMP_NUM_THREADS=1 unless it is set already (the
ranks are the parallelism: a thread pool per rank would fight the other ranks for the cores).

Output: each line a rank writes, to stdout or stderr, is passed on whole with the rank in front
("[rank 3] ..."), so that the ranks' lines never merge; --no-tag-output passes it on untouched
(the ranks then write to the launcher's own stdout and stderr). --log-dir DIR also writes each
rank's lines, untagged, to DIR/rank.<N>.log.

Stopping: when a rank fails (a non-zero exit or a signal), the launcher says which, stops the
others (SIGTERM, then SIGKILL after --grace seconds) and exits with that rank's status; when all
succeed, it exits 0. With --elastic, a rank killed by a signal is lost, not failed: the launcher
says so and lets the others go on (they shrink their group: gradsync.torch.elastic), and exits 0
when the rest succeed. --replace also starts a replacement for each lost rank, with
GRADSYNC_JOIN=join_name(group, k) (k = 1, 2, ... in the order of the losses) in its environment
instead of GRADSYNC_RANK's meaning (and every rank has GRADSYNC_REPLACE=1): it joins the running group (gradsync.torch.elastic.join), when
the others grow it by the same name (State.grow; the library's gradsync_comm_grow). When every
other rank has exited 0, a replacement still running after --grace seconds is taken to be waiting
for a grow that will not come: it is stopped (SIGTERM, then SIGKILL) and does not count.
SIGINT or SIGTERM to the launcher is passed on to every rank and escalated (SIGINT, then SIGTERM,
then SIGKILL, --grace seconds apart; a second signal escalates at once), and the launcher then
dies of the signal it got. Ranks die with the launcher, even of SIGKILL (a
parent-death signal). Once its ranks are gone, the group's shared-memory segments (its own and its
subgroups'), which a killed rank leaves behind, are removed: by the launcher, or if the launcher
itself was killed, by a small watcher process it started for this.
"""
import argparse
import ctypes
import inspect
import os
import pathlib
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid

_PR_SET_PDEATHSIG = 1
_ESCALATION = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
# The longest the launcher sleeps with nothing due: it wakes at once when a rank ends (its pidfd)
# or a signal comes (the wakeup fd), so this only bounds what an unforeseen miss could cost.
_IDLE_S = 1.0


def segment_path(group):
    """The group's shared-memory segment, named as the library names it (segment_name in
    src/comm/transport/shm/segment.cpp)."""
    return _segment(group.encode())


def _segment(name):
    safe = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-"
    return pathlib.Path("/dev/shm") / ("gradsync." + "".join(chr(c) if c in safe else f"%{c:02X}" for c in name))


def subgroup_prefix(group):
    """What the segments of the group's subgroups (Communicator.split), and theirs, begin with:
    the group's name cut to 40 bytes and a dot, then hex digits and dots only
    (Communicator::split in src/comm/communicator.cpp)."""
    return str(_segment(group.encode()[:40])) + "."


def join_name(group, k):
    """The name the k-th replacement (1, 2, ...) of --elastic --replace joins the group by: the
    members grow by it (gradsync.torch.elastic.State.grow). The group's name is cut to 50 bytes
    (a whole character), so that the join name fits the library's 63."""
    return f"{group.encode()[:50].decode(errors='ignore')}.join{k}"


def remove_segments(segment, prefix):
    """Removes the segment and those of its subgroups. The watcher runs this function's source: it
    must need nothing but the standard library, imported inside."""
    import os
    import re
    for name in os.listdir("/dev/shm"):
        path = os.path.join("/dev/shm", name)
        if path == segment or (path.startswith(prefix) and re.fullmatch(r"[0-9a-f.]+", path[len(prefix):])):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


# The watcher: started in a session of its own (a kill of the launcher's process group spares it),
# it reads the ranks' pids from the launcher, and "segments SEGMENT PREFIX" for each further name
# (a replacement's lobby and grown groups; the paths have no spaces: see _segment). "exit" means
# the launcher cleaned up itself. End of input without it means the launcher died: the ranks had a
# parent-death signal; any still alive after the grace is killed (pidfds: no pid reuse can
# redirect the signal), then the segments go.
_WATCHER = inspect.getsource(remove_segments) + """
import os, select, signal, sys
names, grace = [(sys.argv[1], sys.argv[2])], float(sys.argv[3])
fds = []
for line in sys.stdin:
    if line == "exit\\n":
        sys.exit(0)
    if line.startswith("segments "):
        names.append(tuple(line.split()[1:3]))
        continue
    try:
        fds.append(os.pidfd_open(int(line)))
    except ProcessLookupError:
        pass
for fd in fds:
    if not select.select([fd], [], [], grace)[0]:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        select.select([fd], [], [], 10.0)
for segment, prefix in names:
    remove_segments(segment, prefix)
"""


class _Output:
    """Passes the ranks' output on line by line; one lock over every write, so lines never merge."""

    def __init__(self, nprocs, tag, log_dir):
        self.lock = threading.Lock()
        width = len(str(nprocs - 1))
        self.prefixes = [f"[rank {r:>{width}}] ".encode() if tag else b"" for r in range(nprocs)]
        self.logs = [None] * nprocs
        if log_dir is not None:
            pathlib.Path(log_dir).mkdir(parents=True, exist_ok=True)
            self.logs = [open(pathlib.Path(log_dir) / f"rank.{r}.log", "wb") for r in range(nprocs)]
        self.threads = []

    def follow(self, rank, stream, out):
        t = threading.Thread(target=self._pump, args=(rank, stream, out), daemon=True)
        t.start()
        self.threads.append(t)

    def _pump(self, rank, stream, out):
        fd, pending = stream.fileno(), b""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            if len(pending) >= 65536:  # a line too long to hold: passed on in pieces
                lines.append(pending)
                pending = b""
            self._write(rank, out, lines)
        if pending:
            self._write(rank, out, [pending])
        stream.close()

    def _write(self, rank, out, lines):
        if not lines:
            return
        prefix = self.prefixes[rank]
        with self.lock:
            try:
                out.write(b"".join(prefix + line + b"\n" for line in lines))
                out.flush()
            except (BrokenPipeError, ValueError):  # the launcher's own output is gone: keep draining
                pass
            if self.logs[rank] is not None:
                self.logs[rank].write(b"".join(line + b"\n" for line in lines))
                self.logs[rank].flush()

    def finish(self, bound):
        deadline = time.monotonic() + bound
        for t in self.threads:  # a rank's own child may hold its pipe open: bounded
            t.join(max(0.0, deadline - time.monotonic()))
        for log in self.logs:
            if log is not None:
                log.close()


class _Waker:
    """What the launcher's loop sleeps on while its ranks run: a pidfd per rank, readable when the
    rank ends, and the signals' wakeup fd, so that it wakes when there is something to do and not
    100 times a second: the ranks have the cores to themselves (a waking launcher takes a rank's
    core, and on a loaded machine its time slice). Without pidfds (Linux < 5.3) it polls."""

    def __init__(self):
        self.fds = {}  # Popen -> pidfd, opened while the rank is unreaped: its pid is still its own
        self.read, write = os.pipe()
        os.set_blocking(self.read, False)
        os.set_blocking(write, False)
        self.write = write
        self.previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self.poll = not hasattr(os, "pidfd_open")

    def wait(self, running, timeout):
        """Until a rank of `running` ends, a signal comes, or `timeout` seconds pass."""
        for p in [p for p in self.fds if p not in running]:
            os.close(self.fds.pop(p))
        for p in running:
            if p not in self.fds and not self.poll:
                try:
                    self.fds[p] = os.pidfd_open(p.pid)
                except OSError:  # no pidfds here (ENOSYS), or none left: poll instead
                    self.poll = True
        timeout = min(max(timeout, 0.0), 0.01 if self.poll else _IDLE_S)
        try:
            ready = select.select([self.read, *self.fds.values()], [], [], timeout)[0]
        except InterruptedError:
            return
        if self.read in ready:
            try:
                while os.read(self.read, 512):
                    pass
            except BlockingIOError:
                pass

    def close(self):
        signal.set_wakeup_fd(self.previous)
        for fd in [*self.fds.values(), self.read, self.write]:
            os.close(fd)
        self.fds.clear()


def arm_parent_death():
    """In a replacement rank (GRADSYNC_LAUNCHER_PID set by --replace): SIGKILL when the launcher
    dies, as the ranks it started have from their preexec_fn; exits at once if it died already."""
    launcher = os.environ.get("GRADSYNC_LAUNCHER_PID")
    if launcher is None:
        return
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != int(launcher):  # the launcher died before the signal was armed
        os._exit(127)


def _parent_death_signal(launcher):
    """preexec_fn of each rank: SIGKILL when the launcher dies, even of SIGKILL."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork: nothing is loaded in the child

    def arm():
        if prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            os._exit(127)
        if os.getppid() != launcher:  # the launcher died before the signal was armed
            os._exit(127)
    return arm


def _across_hosts(ap, a):
    """--hosts: mpirun starts the ranks, tags their output and stops them all when one fails or a
    signal comes; the launcher becomes mpirun. Each rank's Communicator.from_env() is then a group
    of the hierarchical transport, its rank and size from MPI."""
    try:
        slots = [int(h.rsplit(":", 1)[1]) if ":" in h else 1 for h in a.hosts.split(",")]
    except ValueError:
        ap.error(f"--hosts must be HOST:N,HOST:N,..., got {a.hosts!r}")
    if not slots or min(slots) < 1:
        ap.error(f"--hosts must name at least one host with at least 1 rank, got {a.hosts!r}")
    n = a.nprocs if a.nprocs is not None else sum(slots)
    if n < 1 or n > sum(slots):
        ap.error(f"-n {n} does not fit the {sum(slots)} ranks of --hosts")
    env = {"GRADSYNC_TRANSPORT": "hier", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if a.timeout_ms is not None:
        env["GRADSYNC_TIMEOUT_MS"] = str(a.timeout_ms)
    command = [a.mpirun, "-H", a.hosts, "-np", str(n), "--bind-to", "none"]
    if a.tag_output:
        command.append("--tag-output")
    if a.log_dir is not None:
        command += ["--output-filename", a.log_dir]
    command += shlex.split(a.mpirun_args)
    for key, value in env.items():
        os.environ[key] = value
        command += ["-x", key]
    command += [sys.executable, *(["-m"] if a.module else []), a.program, *a.args]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(command[0], command)
    except OSError as e:
        print(f"gradsync.run: cannot start {command[0]}: {e}", file=sys.stderr)
        return 127


def main(argv=None):
    """Entry point of `python3 -m gradsync.run`: parse argv (sys.argv[1:] when None), start the ranks, and
    return the exit status."""
    ap = argparse.ArgumentParser(prog="python3 -m gradsync.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--nprocs", type=int, default=None, help="number of ranks (with --hosts: their sum)")
    ap.add_argument("--hosts", default=None,
                    help="HOST:N,HOST:N,...: N ranks on each host, started by mpirun, in one group of the hierarchical "
                         "transport (shared memory within a host, MPI between hosts)")
    ap.add_argument("--mpirun", default="mpirun", help="with --hosts: the mpirun to use (default: mpirun)")
    ap.add_argument("--mpirun-args", default="",
                    help="with --hosts: more mpirun options, as one string (e.g. \"--mca plm_rsh_agent ssh\")")
    ap.add_argument("--group", default=None, help="group name (default: a fresh unique one)")
    ap.add_argument("--timeout-ms", type=int, default=None, help="the communicators' timeout")
    ap.add_argument("--grace", type=float, default=5.0,
                    help="seconds between the stopping signals: SIGINT, SIGTERM, SIGKILL (default 5)")
    ap.add_argument("--tag-output", action=argparse.BooleanOptionalAction, default=True,
                    help="put [rank N] in front of each line of rank N's output (default: on)")
    ap.add_argument("--log-dir", default=None, help="also write rank N's output to LOG_DIR/rank.N.log")
    ap.add_argument("--elastic", action="store_true",
                    help="a rank killed by a signal is lost, not failed: the others go on (one host only)")
    ap.add_argument("--replace", action="store_true",
                    help="with --elastic: start a replacement for each lost rank, which joins the running group")
    ap.add_argument("-m", "--module", action="store_true", help="the program is a module, run as python3 -m")
    ap.add_argument("program", help="a Python script (run with this interpreter), or with -m a module")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if a.hosts is not None:
        if a.elastic or a.replace:
            ap.error("--elastic and --replace are for one host: they cannot be used with --hosts (after a lost "
                     "rank Open MPI's mpirun --enable-recovery stays after every rank has ended, so the launcher "
                     "would never return; run mpirun --enable-recovery yourself, with gradsync.torch.elastic: "
                     "its State.grow starts replacements across hosts, see docs/mpi.md)")
        return _across_hosts(ap, a)
    if a.nprocs is None or a.nprocs < 1:
        ap.error("-n must be given, at least 1")
    if a.grace < 0:
        ap.error("--grace must be >= 0")
    if a.replace and not a.elastic:
        ap.error("--replace needs --elastic")
    group = a.group or f"run-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    if not group or len(group.encode()) > 63:  # gradsync_comm_options.name
        ap.error(f"--group must be 1 to 63 bytes, got {len(group.encode())}")
    segment, prefix = str(segment_path(group)), subgroup_prefix(group)
    piped = a.tag_output or a.log_dir is not None
    output = _Output(a.nprocs, a.tag_output, a.log_dir)
    base = dict(os.environ, GRADSYNC_GROUP=group, GRADSYNC_SIZE=str(a.nprocs), GRADSYNC_TRANSPORT="shm")
    base.setdefault("OMP_NUM_THREADS", "1")
    if piped:
        base.setdefault("PYTHONUNBUFFERED", "1")  # lines as they are written, as on a terminal
    if a.timeout_ms is not None:
        base["GRADSYNC_TIMEOUT_MS"] = str(a.timeout_ms)
    if a.replace:
        base["GRADSYNC_REPLACE"] = "1"  # the ranks may grow back: a replacement comes for each lost rank
    command = [sys.executable, *(["-m"] if a.module else []), a.program, *a.args]

    watcher = subprocess.Popen([sys.executable, "-c", _WATCHER, segment, prefix, str(a.grace)], stdin=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                               text=True)
    # Signals only record what was asked until every rank runs: the loop below acts on them.
    requests = []

    def on_signal(signum, _frame):
        requests.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    waker = _Waker()
    arm = _parent_death_signal(os.getpid())
    procs = []
    pipe = subprocess.PIPE if piped else None
    try:
        for rank in range(a.nprocs):
            procs.append(subprocess.Popen(command, env=dict(base, GRADSYNC_RANK=str(rank)), stdout=pipe, stderr=pipe,
                                          preexec_fn=arm))
            watcher.stdin.write(f"{procs[-1].pid}\n")
            watcher.stdin.flush()
    except OSError as e:
        print(f"gradsync.run: cannot start rank {len(procs)}: {e}", file=sys.stderr)
        for p in procs:
            p.kill()
    if piped:  # threads only now: preexec_fn runs between fork and exec, where threads are unsafe
        for rank, p in enumerate(procs):
            output.follow(rank, p.stdout, sys.stdout.buffer)
            output.follow(rank, p.stderr, sys.stderr.buffer)

    codes, stopped, lost = {}, set(), set()
    first = None  # the first rank that failed on its own
    stop_at = None  # (time, index into _ESCALATION) of the next stopping signal
    received = None  # the signal that stopped the launcher
    settle = None

    def send(sig):
        for rank, p in enumerate(procs):
            if rank not in codes:
                p.send_signal(sig)  # a no-op once the rank is reaped: never another process
                stopped.add(rank)

    def describe(code):
        return f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"

    joins = []
    replacements, abandoned = set(), set()  # the ranks a replacement runs as; those stopped unjoined
    cut = None  # (time, signal): the replacements still running when every other rank is done

    def replace(rank):
        """A new process in the lost rank's place (its output tagged as that rank's), joining the
        group by the next join name. No preexec_fn: the output threads run, and it is unsafe with
        threads; the replacement arms its parent-death signal itself (arm_parent_death, from
        gradsync.torch.elastic.join), and the watcher stops it if the launcher dies first."""
        name = join_name(group, len(joins) + 1)
        watcher.stdin.write(f"segments {segment_path(name)} {subgroup_prefix(name)}\n")  # before it can make them
        watcher.stdin.flush()
        try:
            p = subprocess.Popen(command, env=dict(base, GRADSYNC_RANK=str(rank), GRADSYNC_JOIN=name,
                                                   GRADSYNC_LAUNCHER_PID=str(os.getpid())),
                                 stdout=pipe, stderr=pipe)
        except OSError as e:
            print(f"gradsync.run: cannot start a replacement for rank {rank}: {e}", file=sys.stderr)
            return
        joins.append(name)
        procs[rank] = p
        replacements.add(rank)
        codes.pop(rank)
        lost.discard(rank)
        watcher.stdin.write(f"{p.pid}\n")
        watcher.stdin.flush()
        if piped:
            output.follow(rank, p.stdout, sys.stdout.buffer)
            output.follow(rank, p.stderr, sys.stderr.buffer)
        print(f"gradsync.run: rank {rank} replaced (pid {p.pid}), joining as {joins[-1]}", file=sys.stderr, flush=True)

    sent = -1  # the index into _ESCALATION of the strongest signal sent

    def escalate(index):
        nonlocal stop_at, sent
        index = min(index, len(_ESCALATION) - 1)
        send(_ESCALATION[index])
        sent = max(sent, index)
        stop_at = (time.monotonic() + a.grace, index + 1) if index + 1 < len(_ESCALATION) else None

    if len(procs) < a.nprocs:
        first = -1
        escalate(2)
    while len(codes) < len(procs):
        while requests:
            # The signal asked for, or, once the ranks are being stopped, the next one now.
            signum = requests.pop(0)
            escalate(max(_ESCALATION.index(signum) if received is None else 0, sent + 1))
            received = received or signum
        for rank, p in enumerate(procs):
            if rank not in codes and p.poll() is not None:
                codes[rank] = p.returncode
                if p.returncode != 0 and first is None and received is None and rank not in stopped | abandoned:
                    if a.elastic and p.returncode < 0 and len(lost) + 1 < len(procs):
                        lost.add(rank)
                        print(f"gradsync.run: rank {rank} lost ({describe(p.returncode)}); the others go on",
                              file=sys.stderr, flush=True)
                        if a.replace:
                            replace(rank)
                        continue
                    first = rank
                    # A rank's failure usually makes the others fail at once (it left their
                    # group), and which exit comes first is a race: every rank that fails on its
                    # own within a short settling time is reported.
                    settle = time.monotonic() + 0.5
        now = time.monotonic()
        if (cut is None and replacements and first is None and received is None
                and all(r in codes and (codes[r] == 0 or r in lost) for r in range(len(procs)) if r not in replacements)):
            # The others finished without growing: a replacement waiting to join would wait out its
            # timeout and fail a run that succeeded. One that joined ends within the grace.
            cut = (now + a.grace, signal.SIGTERM)
        if cut is not None and now >= cut[0]:
            for rank in sorted(replacements - set(codes)):
                if rank not in abandoned:
                    print(f"gradsync.run: the replacement for rank {rank} did not join; the others are done, "
                          f"stopping it", file=sys.stderr, flush=True)
                abandoned.add(rank)
                procs[rank].send_signal(cut[1])
            cut = (now + a.grace, signal.SIGKILL)
        if settle is not None and now >= settle:
            settle = None
            escalate(1)
        if stop_at is not None and now >= stop_at[0]:
            escalate(stop_at[1])
        pending = [d for d in (settle, stop_at and stop_at[0], cut and cut[0]) if d is not None]
        waker.wait([p for rank, p in enumerate(procs) if rank not in codes],
                   max(min(pending) - time.monotonic(), 0.01) if pending else _IDLE_S)

    # Every rank is gone: what a killed one left is removed, and the watcher is told all is done.
    remove_segments(segment, prefix)
    for name in joins:
        remove_segments(str(segment_path(name)), subgroup_prefix(name))  # the lobby and the grown groups
    try:
        watcher.stdin.write("exit\n")
        watcher.stdin.close()
    except OSError:
        pass
    try:
        watcher.wait(10)
    except subprocess.TimeoutExpired:
        watcher.kill()
        watcher.wait()
    output.finish(bound=max(a.grace, 1.0))
    waker.close()
    for s, handler in previous.items():
        signal.signal(s, handler)

    if received is not None:
        print(f"gradsync.run: stopped by {signal.Signals(received).name}", file=sys.stderr)
        signal.signal(received, signal.SIG_DFL)
        os.kill(os.getpid(), received)  # dies of it, as the caller asked
        return 128 + received
    if first is None:
        return 0
    if first < 0:
        return 1
    failed = [f"rank {r} ({describe(codes[r])})" for r in sorted(codes)
              if codes[r] != 0 and r not in stopped and r not in lost and r not in abandoned]
    print(f"gradsync.run: {len(failed)} of {a.nprocs} ranks failed: {', '.join(failed)}"
          f"{f'; stopped ranks {sorted(stopped)}' if stopped else ''}", file=sys.stderr)
    code = codes[first]
    return code if code > 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
