# SPDX-License-Identifier: Apache-2.0
"""Runs mpi_shrink_program under mpirun --enable-recovery with 4 ranks and checks every survivor.

usage: run_shrink.py MPIRUN PROGRAM MODE [RUNS]

MODE between|small|large|second|second-random|host|transfer (RUNS runs each, default 3) or stress (RUNS seeds, default 8);
or threads|threads-interleaved|threads-silent: PROGRAM is mpi_threads_shrink, 3 processes x 2 threads (6 ranks), process 1 lost
(threads-interleaved: in a subgroup of the whole group ordered thread by thread; threads-silent, 2 runs by default:
process 1 goes silent, and the survivors' shrink waits out a timeout of its silence); threads then grows back by one
spawned process of 2 threads, whose joining threads and every survivor check the grown group. Each launch is
bounded: a hang fails the test. Every survivor must have shrunk to the same failed set, checked
every collective on the new group ("verified") and finished ("done"); no rank may print WRONG.
The phases' times of every run are printed (min / median / max) for docs/mpi.md.
"""
import os
import re
import statistics
import subprocess
import sys
import time

mpirun, program, mode = sys.argv[1:4]
runs = int(sys.argv[4]) if len(sys.argv) > 4 else {"stress": 8, "threads-silent": 2}.get(mode, 3)
SILENT_TIMEOUT_MS = 3000  # threads_shrink.c's, in mode silent
bound = 120
ranks = 6 if mode.startswith("threads") else 4
base = [mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "--enable-recovery",
        "-np", "3" if mode.startswith("threads") else "4", program]
env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
figures = {}
outcomes = {}


def fail(what, out=""):
    sys.exit(f"FAIL: {what}\n{out}")


def run(args):
    start = time.monotonic()
    try:
        proc = subprocess.run(base + args, capture_output=True, text=True, timeout=bound, env=env)
    except subprocess.TimeoutExpired as exc:
        fail(f"mpirun did not exit within {bound} s (a rank hung)", f"{exc.stdout}\n{exc.stderr}")
    out = proc.stdout + proc.stderr
    print(f"--- {' '.join(args)}: mpirun exited {proc.returncode} after {time.monotonic() - start:.1f} s\n{out}")
    return out


def check_grown(out):
    """threads: the survivors grew back to 6 ranks with a spawned process of 2 threads (ids 6, 7)."""
    for who in ["rank 0", "rank 1", "rank 4", "rank 5", "joiner 0", "joiner 1"]:
        m = re.search(rf"^{who}: grew to 6 first_id 6 agree_us (\d+) form_us (\d+)$", out, re.M)
        if not m:
            fail(f"{who} did not grow to 6 ranks with the joiners' ids from 6", out)
        figures.setdefault("grow: agree (spawn, merge)", []).append(int(m.group(1)) / 1000)
        figures.setdefault("grow: form", []).append(int(m.group(2)) / 1000)
        verified = "verified" if who.startswith("joiner") else "grown verified"
        if not re.search(rf"^{who}: {verified} 4 on 6 ranks$", out, re.M) or f"{who}: done" not in out:
            fail(f"{who} did not check its collectives on the grown group and finish", out)


def check(out, lost):
    """Every rank not in `lost` shrank to `lost` (in the order of its shrinks), verified and finished."""
    if "WRONG" in out:
        fail("a collective gave a wrong result", out)
    for r in sorted(set(range(ranks)) - set(lost)):
        shrunk = re.findall(rf"^rank {r}: shrunk failed \[([\d,]*)\] size (\d+) attempts (\d+) detect_us (\d+) "
                            rf"shrink_us (\d+) agree_us (\d+) form_us (\d+)", out, re.M)
        if not shrunk:
            fail(f"rank {r} did not shrink", out)
        got = sorted(int(x) for s in shrunk for x in s[0].split(",") if x)
        if got != sorted(lost):
            fail(f"rank {r} lost {got}, expected {sorted(lost)}", out)
        if f"rank {r}: done" not in out:
            fail(f"rank {r} did not finish", out)
        if not re.search(rf"^rank {r}: verified \d+ on {ranks - len(lost)} ranks", out, re.M):
            fail(f"rank {r} did not verify its collectives on {ranks - len(lost)} ranks", out)
        for s in shrunk:
            for name, value in zip(("detect", "shrink", "agree", "form"), s[3:7]):
                figures.setdefault(name, []).append(int(value) / 1000)
    for v in lost:
        if f"rank {v}: done" in out:
            fail(f"rank {v} was to die but finished", out)


for i in range(runs):
    if mode == "stress":
        seed = 1000 + i + int(time.time()) % 1000
        out = run(["stress", str(seed)])
        lost = sorted({int(m) for m in re.findall(r"^rank 0: round \d+ lost rank (\d+)", out, re.M)})
        if len(lost) != 2:
            fail(f"seed {seed}: rank 0 did not get through two losses", out)
        check(out, lost)
    elif mode == "second":
        out = run(["second"])
        check(out, [1, 2])
    elif mode == "second-random":
        out = run(["second-random"])
        # Rank 2 dies during the shrink or just after it: the others end with {1, 2} lost, or, when it
        # died once it had confirmed the group (in create_group), the watchdog ends the job; when it
        # died while the new communicator was set up, both fail with E_REMOTE saying so.
        set_up = re.findall(r"^rank [03]: shrink GRADSYNC_E_REMOTE\b.*lost while the survivors' group .*set up", out,
                            re.M)
        if len(set_up) == 2:  # it died while the new communicator was set up: both fail, bounded
            if "WRONG" in out:
                fail("a collective gave a wrong result", out)
            outcomes["failed in the setup"] = outcomes.get("failed in the setup", 0) + 1
        elif "MPI_Comm_create_group over a shrink's survivors" in out and "calling MPI_Abort" in out:
            if "WRONG" in out:
                fail("a collective gave a wrong result", out)
            outcomes["watchdog"] = outcomes.get("watchdog", 0) + 1
        else:
            check(out, [1, 2])
            outcomes["shrunk"] = outcomes.get("shrunk", 0) + 1
    elif mode == "threads-interleaved":
        out = run(["interleaved"])
        check(out, [1, 4])
    elif mode == "threads-silent":
        out = run(["silent"])
        check(out, [2, 3])
        if not re.search(r"^rank 0: failed GRADSYNC_E_TIMEOUT", out, re.M):
            fail("rank 0's call did not time out on the silent process", out)
        # The case this mode is for: the process-level shrink waited out a timeout of silence (had
        # process 1 been seen dead, nothing would have outlasted the team's timeout).
        for r, us in re.findall(r"^rank (\d+): shrunk failed .* shrink_us (\d+) ", out, re.M):
            if int(us) < SILENT_TIMEOUT_MS * 1000 * 0.9:
                fail(f"rank {r}'s shrink took {int(us) / 1000:.0f} ms: it did not wait out the silent process", out)
    elif mode == "threads":
        out = run([])
        check(out, [2, 3])
        check_grown(out)
    elif mode == "host":
        out = run(["host"])
        check(out, [2, 3])
    elif mode == "transfer":
        out = run(["transfer"])
        # Rank 1 dies at a random point of a loop of large calls. Inside MPI's blocking transfer
        # (the likely case) nothing can interrupt the others: the transfer watch must end the job
        # (mpirun bounded above); otherwise the others shrink without it as in `large`.
        if "died while this rank was inside MPI's blocking transfer" in out and "calling MPI_Abort" in out:
            if "WRONG" in out:
                fail("a collective gave a wrong result", out)
            if not re.search(r"\(world rank 1\) died while this rank was inside", out):
                fail("the transfer watch did not name rank 1 as the dead one", out)
            outcomes["ended by the transfer watch"] = outcomes.get("ended by the transfer watch", 0) + 1
        else:
            check(out, [1])
            outcomes["shrunk"] = outcomes.get("shrunk", 0) + 1
    else:
        out = run([mode])
        check(out, [1])

for name, values in figures.items():
    print(f"{name} ms: min {min(values):.1f} / median {statistics.median(values):.1f} / max {max(values):.1f} "
          f"over {len(values)} survivor(s)")
if outcomes:
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
print("load average: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
print("ok")
