# SPDX-License-Identifier: Apache-2.0
"""Start N ranks of a program on this host, joined by shared memory:

    python3 -m gradsync.run -n 4 train.py --epochs 3

Each rank is `python3 train.py --epochs 3` with GRADSYNC_GROUP, GRADSYNC_RANK, GRADSYNC_SIZE and
GRADSYNC_TRANSPORT=shm in its environment, which `gradsync.Communicator.from_env()` reads.
SIGINT and SIGTERM are passed on to every rank. When a rank fails (a non-zero exit or a signal),
the launcher says which, stops the others (SIGTERM, then SIGKILL after --grace seconds) and exits
with that rank's status; when all succeed, it exits 0.
"""
import argparse
import os
import signal
import subprocess
import sys
import time
import uuid


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m gradsync.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--nprocs", type=int, required=True, help="number of ranks")
    ap.add_argument("--group", default=None, help="group name (default: a fresh unique one)")
    ap.add_argument("--timeout-ms", type=int, default=None, help="the communicators' timeout")
    ap.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL")
    ap.add_argument("program", help="a Python script (run with this interpreter)")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if a.nprocs < 1:
        ap.error("-n must be at least 1")
    group = a.group or f"run-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    procs = []
    for rank in range(a.nprocs):
        env = dict(os.environ, GRADSYNC_GROUP=group, GRADSYNC_RANK=str(rank), GRADSYNC_SIZE=str(a.nprocs),
                   GRADSYNC_TRANSPORT="shm")
        if a.timeout_ms is not None:
            env["GRADSYNC_TIMEOUT_MS"] = str(a.timeout_ms)
        procs.append(subprocess.Popen([sys.executable, a.program, *a.args], env=env))

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)

    def describe(code):
        return f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"

    # Children are reaped as they exit. A rank's failure usually makes the others fail at once (it
    # left their group), and which exit comes first is a race: every rank that failed on its own
    # within a short settling time is reported, the first seen giving the exit status.
    rank_of = {p.pid: r for r, p in enumerate(procs)}
    codes, stopped = {}, set()

    def reap(block):
        while len(codes) < len(procs):
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            if pid == 0:
                return
            if pid in rank_of:
                codes[rank_of[pid]] = os.waitstatus_to_exitcode(status)
                if codes[rank_of[pid]] != 0:
                    return

    first = None
    while len(codes) < len(procs) and first is None:
        reap(block=True)
        first = next((r for r in codes if codes[r] != 0), None)
    if first is None:
        return 0
    settle = time.monotonic() + 0.5
    while len(codes) < len(procs) and time.monotonic() < settle:
        reap(block=False)
        time.sleep(0.01)
    for rank, p in enumerate(procs):
        if rank not in codes:
            p.terminate()
            stopped.add(rank)
    deadline = time.monotonic() + a.grace
    while len(codes) < len(procs):
        if time.monotonic() >= deadline:
            for rank, p in enumerate(procs):
                if rank not in codes:
                    p.kill()
            deadline = float("inf")
        reap(block=False)
        time.sleep(0.01)
    failed = [f"rank {r} ({describe(codes[r])})" for r in sorted(codes) if codes[r] != 0 and r not in stopped]
    print(f"gradsync.run: {len(failed)} of {a.nprocs} ranks failed: {', '.join(failed)}"
          f"{f'; stopped ranks {sorted(stopped)}' if stopped else ''}", file=sys.stderr)
    code = codes[first]
    return code if code > 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
