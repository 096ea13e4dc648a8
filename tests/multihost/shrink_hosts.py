#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""gradsync_comm_shrink on the MPI or the hierarchical transport across 2 hosts x 2 ranks, under
mpirun --enable-recovery.

    shrink_hosts.py [--mpirun PATH] [--transport mpi|hier] [--pid-namespaces] [--timeout-ms MS]
                    [--seeds N] [--mode loop|embedding|zero|torch] [--layout 2,2 --lost-host 1]
                    --what rank|small|large|transfer|host|stress|threads|threads-host -- PROGRAM

PROGRAM is tests/mpi/mpi_shrink_program (with --mode torch: python3 tests/multihost/torch_elastic.py,
on hier, which prints the same lines).
- rank: rank 3 (on h1) SIGKILLs itself between calls. Rank 2 (h1) sees the death by its PID,
  ranks 0 and 1 (h0) cannot, and learn it from rank 2's proposal: every survivor must shrink to
  {3}, check every collective on the 3 ranks left and finish.
- small: as rank, but rank 3 is killed at a random point of a loop of 1-float allreduces.
- large: as rank, but rank 3 is killed while the others wait for it inside a 256K-float allreduce
  (on hier: in its levels, rank 2 in the shared-memory level, rank 1 in the cross-host one).
- transfer: rank 3 is killed at a random point of a loop of 4M-float allreduces, most often inside
  MPI's blocking transfer, which nothing interrupts: the survivors' transfer watch must end the job
  (naming rank 3), or, the death outside the transfer, they shrink as in large.
- host: once every rank is under way, every process of the lost host (--lost-host of --layout's
  hosts, by default h1 of 2 x 2: its ranks and its Open MPI daemon) is SIGKILLed. Every survivor
  sees the loss as a death (E_REMOTE), never as a timeout: by PID, or with --pid-namespaces by its
  liveness links to the lost host's ranks (run with a timeout longer than the bound, so that
  waiting it out fails). They agree that exactly that host's ranks are lost and form a group: a
  shared-memory one when they are all on one host, otherwise the transport's own (on hier, with
  survivors on two hosts, its levels again); they check every collective on it and finish; the
  job must end within the bound. With --mode embedding the ranks push into a sharded embedding
  table with one replica of each rank's rows instead (the program's ranks 2 and 3 die: the layout
  must put them, and only them, on the lost host), and after the shrink its reshard must take
  their rows from the replicas on other hosts (no checkpoint), and the survivors' rows must then
  be bitwise one process's ("verified" counts them). --mode zero does the same with a ZeRO-1
  Adam parameter with one replica of each slice: its weights must end bitwise a one-rank run's;
  --mode torch with gradsync.torch.elastic and a ZeroRedundancyOptimizer(replicas=1) in Python.
- threads: PROGRAM is tests/mpi/mpi_threads_shrink: 3 hosts x 1 process x 2 threads (threads as
  ranks), the process of h1 SIGKILLs itself in the middle of allreduces; the 4 ranks left must shrink
  to {2, 3}, check the new group's topology and every collective on it, and finish. Their grow
  back by a spawned process must be refused (E_UNSUPPORTED): h1's process was the host's only one,
  and Open MPI 4.1's spawn would end the job once a host is lost. With --layout 2,1 process 1 shares
  h0 with process 0: the survivors, on both hosts, grow back to 6 ranks by one process that MPI
  spawns (its 2 threads join as ranks 4 and 5, member ids 6 and 7) and check every collective on the
  grown group, members and joiner alike.
- threads-host: PROGRAM is tests/mpi/mpi_threads_shrink: 2 processes on h0 and 1 on h1 (--layout
  2,1), 2 threads each; once every rank is under way, the whole of h1 (its process and its Open MPI
  daemon) is SIGKILLed. The 4 ranks left, all on h0, must shrink to {4, 5} over a process-level group
  of shared memory (the lane's shrink forms one without MPI), check every collective on it, and
  finish.
- stress: --seeds launches of the program's stress mode, each with a seed of its own: twice, a
  random rank other than 0 dies at a random point (between calls, in a small call or in a large
  one), 4 -> 3 -> 2 ranks; the two survivors must shrink each time to the ranks lost, check every
  collective on each new group and finish. A survivor lost with a victim (COLLATERAL below) is
  taken: then every rank that finishes must have shrunk alike, by sets holding every victim.
"""
import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hosts  # noqa: E402

WATCH = "died while this rank was inside MPI's blocking transfer"
COLLATERAL = """Open MPI 4.1's ob1 ends a process whose TCP connection to a peer breaks while a send to
that peer is pending (the BTL's error callback aborts it): a survivor in a transfer with the dead rank
may be lost with it. The survivors must then agree on the larger set, as on any loss."""
BOUND = 90  # seconds; the ranks' timeout is 5 s unless --timeout-ms says otherwise


def fail(what, output=""):
    sys.exit(f"FAIL: {what}\n{output}")


def launch(args, program, what, seed=0):
    """One job on namespace hosts (2 x 2 but for --what host); returns its output once every rank
    has ended (or fails)."""
    layout = args.layout if what in ("host", "threads-host", "threads") else [2, 2]
    with hosts.signals_raise():
        with hosts.Hosts(layout, mpirun=args.mpirun, pid_namespaces=args.pid_namespaces) as h:
            env = dict(os.environ, SHRINK_TRANSPORT=args.transport, SHRINK_TIMEOUT_MS=str(args.timeout_ms))
            mpirun_args = ["--enable-recovery", "-x", "SHRINK_TRANSPORT", "-x", "SHRINK_TIMEOUT_MS"]
            if what == "host":
                if args.mode == "torch":  # PROGRAM is tests/multihost/torch_elastic.py, which takes no mode
                    env.update(GRADSYNC_TRANSPORT="hier", OMP_NUM_THREADS="1")
                    for var in ("GRADSYNC_TRANSPORT", "OMP_NUM_THREADS", "PYTHONPATH", "GRADSYNC_LIBRARY"):
                        if var in env:
                            mpirun_args += ["-x", var]
                job = h.start(program + ([] if args.mode == "torch" else [args.mode]), mpirun_args=mpirun_args, env=env)
                if not job.wait_for(r"rank \d: looping", count=sum(layout), timeout=BOUND):
                    fail("the ranks did not all get under way", job.output())
                h.kill_host(args.lost_host)
                survivors = sum(layout) - layout[args.lost_host]
            elif what == "threads-host":
                job = h.start(program + ["host"], mpirun_args=mpirun_args, env=env)
                if not job.wait_for(r"rank \d: looping", count=2 * sum(layout), timeout=BOUND):
                    fail("the ranks did not all get under way", job.output())
                h.kill_host(args.lost_host)
                survivors = 2 * (sum(layout) - layout[args.lost_host])
            elif what == "stress":
                job = h.start(program + ["stress", str(seed)], mpirun_args=mpirun_args, env=env)
                survivors = 2
            elif what == "threads":
                job = h.start(program, mpirun_args=mpirun_args, env=env)
                survivors = 4
            else:
                job = h.start(program + ["victim" if what == "rank" else what, "3"], mpirun_args=mpirun_args, env=env)
                survivors = 3
            start = time.monotonic()
            if what in ("transfer", "stress"):
                # Done when every survivor finished, or the transfer watch ended the job, or every
                # rank has ended with at least one finished: Open MPI 4.1 may end a survivor whose
                # TCP connection to the dead rank broke with a send pending (COLLATERAL).
                end = start + BOUND
                finished = False
                while not finished and time.monotonic() < end:
                    out = job.output()
                    done = len(re.findall(r"^rank \d: done", out, re.M))
                    finished = done >= survivors or (WATCH in out and "calling MPI_Abort" in out) or (
                        done >= 1 and not h.running(program[0]))
                    time.sleep(0.2)
            else:
                # threads on 2,1: the grown group's joiner process's 2 threads finish too.
                joiners = 2 if what == "threads" and args.layout == [2, 1] else 0
                finished = job.wait_for(r"^(rank|joiner) \d: done", count=survivors + joiners, timeout=BOUND)
            # The ranks end (by MPI_Abort at exit: the old group holds abandoned requests); mpirun
            # may stay (hosts.Hosts.wait_ended).
            ranks_left = h.wait_ended(program[0])
            ended = time.monotonic() - start
            result = job.wait(5)
            out = result.output
            print(f"the survivors finished: {finished}; every rank ended {ended:.1f} s after the start or the kill; "
                  f"mpirun {'stayed and was killed' if result.timed_out else f'exited {result.status}'}"
                  f"\n--- job output\n{out}--- end of job output")
            if not finished:
                fail(f"the survivors did not finish within {BOUND} s (a hang)")
            if ranks_left:
                fail(f"ranks still running 30 s after the survivors finished: {ranks_left}")
    if "WRONG" in out:
        fail("a collective gave a wrong result")
    return out


def shrinks(out, r):
    """Rank r's shrinks, in turn: (the old ranks it lost, the new size)."""
    return [([int(x) for x in g.split(",") if x], int(n))
            for g, n in re.findall(rf"^rank {r}: shrunk failed \[([\d,]*)\] size (\d+)", out, re.M)]


def check_finishers(out, drawn, what):
    """The ranks that finished all shrank alike, by sets that hold every rank drawn to die, each
    verified its collectives on the last group, and every rank lost beyond those drawn died (the
    COLLATERAL case): none of them finished. Returns the collateral ranks."""
    finishers = [r for r in range(4) if f"rank {r}: done" in out]
    if not finishers:
        fail(f"{what}: no rank finished", out)
    seen = {r: shrinks(out, r) for r in finishers}
    first = seen[finishers[0]]
    for r in finishers:
        if seen[r] != first:
            fail(f"{what}: ranks {finishers[0]} and {r} shrank differently: {first} and {seen[r]}", out)
    lost = [x for sets, _ in first for x in sets]
    if not first or any(v not in lost for v in drawn):
        fail(f"{what}: the finishers shrank by {first}, which does not hold every rank drawn to die {drawn}", out)
    if sorted(finishers) != sorted(set(range(4)) - set(lost)):
        fail(f"{what}: finishers {finishers}, but the ranks not lost are {sorted(set(range(4)) - set(lost))}", out)
    for r in finishers:
        if not re.search(rf"^rank {r}: verified \d+ on {first[-1][1]} ranks", out, re.M):
            fail(f"{what}: rank {r} did not check its collectives on {first[-1][1]} ranks", out)
    collateral = sorted(set(lost) - set(drawn))
    if collateral:
        print(f"{what}: collateral loss of {collateral} (see COLLATERAL in this script)")
    return collateral


def check(what, out, args):
    if what == "transfer":
        if WATCH in out:
            # It names rank 3, or a survivor lost with it (COLLATERAL) before rank 3's death showed.
            named = re.findall(r"\(world rank (\d+)\) died while this rank was inside", out)
            if not named:
                fail("the transfer watch ended the job without naming the dead rank", out)
            print(f"ended by the transfer watch (naming world rank(s) {sorted(set(named))})")
            if re.search(r"^rank \d: done", out, re.M):
                check_finishers(out, [3], "transfer")
        else:
            check_finishers(out, [3], "transfer")
        return
    if what in ("threads", "threads-host"):
        # threads: h1's process holds ranks 2 and 3; threads-host (2,1): h1's holds 4 and 5.
        lost, kept = ((2, 3), (0, 1, 4, 5)) if what == "threads" else ((4, 5), (0, 1, 2, 3))
        for r in kept:
            if not re.search(rf"^rank {r}: shrunk failed \[{lost[0]},{lost[1]}\] size 4 attempts (\d+)", out, re.M):
                fail(f"rank {r} did not shrink to the 4 ranks left without host h1's process (ranks {lost})", out)
            if not re.search(rf"^rank {r}: verified \d+ on 4 ranks", out, re.M) or f"rank {r}: done" not in out:
                fail(f"rank {r} did not check its collectives on the new group and finish", out)
            if (what == "threads" and args.layout == [1, 1, 1]
                    and not re.search(rf"^rank {r}: grow refused: .*lose every rank of a host", out, re.M)):
                fail(f"rank {r}'s grow after h1 was lost was not refused as unsupported", out)
        if what == "threads" and args.layout == [2, 1]:
            for who in [f"rank {r}" for r in kept] + ["joiner 0", "joiner 1"]:
                verified = "verified" if who.startswith("joiner") else "grown verified"
                if (not re.search(rf"^{who}: grew to 6 first_id 6 ", out, re.M)
                        or not re.search(rf"^{who}: {verified} 4 on 6 ranks$", out, re.M)):
                    fail(f"{who} did not grow back to 6 ranks and check its collectives there", out)
    elif what != "host":
        for r in (0, 1, 2):
            m = re.search(rf"^rank {r}: shrunk failed \[3\] size 3 attempts (\d+)", out, re.M)
            if not m:
                fail(f"rank {r} did not shrink to the 3 ranks left without rank 3")
            if not re.search(rf"^rank {r}: verified \d+ on 3 ranks", out, re.M) or f"rank {r}: done" not in out:
                fail(f"rank {r} did not check its collectives on the new group and finish")
            # A level's message names the level's ranks; the group's own come with it.
            if (what == "large" and args.transport == "hier"
                    and not re.search(rf"^rank {r}: call GRADSYNC_E_\w+: .*\[in the levels of this hier group of 4: "
                                      r"the shared-memory level's ranks 0, 1, \.\.\. are the group's \d, \d; "
                                      r"the cross-host level's are the group's \d, \d\]$", out, re.M)):
                fail(f"rank {r}'s failure inside the levels does not say which of the group's ranks the level's are")
    else:
        first = sum(args.layout[:args.lost_host])
        lost = list(range(first, first + args.layout[args.lost_host]))
        survivors = [r for r in range(sum(args.layout)) if r not in lost]
        gone = ",".join(map(str, lost))
        for r in survivors:
            # Seen as a death (by PID, a liveness link or a peer's notice of either), never by
            # waiting out the deadline, with or without the hosts' PIDs in view.
            m = re.search(rf"^rank {r}: call (GRADSYNC_E_\w+)", out, re.M)
            if not m or m.group(1) != "GRADSYNC_E_REMOTE":
                fail(f"rank {r}'s call ended with {m.group(1) if m else 'nothing'}, not GRADSYNC_E_REMOTE: the loss "
                     f"of host h{args.lost_host} was not seen before the deadline")
            if not re.search(rf"^rank {r}: shrunk failed \[{gone}\] size {len(survivors)} attempts (\d+)", out, re.M):
                fail(f"rank {r} did not shrink to the {len(survivors)} ranks left after the loss of host "
                     f"h{args.lost_host} (ranks {gone})")
            if (not re.search(rf"^rank {r}: verified \d+ on {len(survivors)} ranks", out, re.M)
                    or f"rank {r}: done" not in out):
                fail(f"rank {r} did not check its collectives on the survivors' group and finish")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--what", choices=("rank", "small", "large", "transfer", "host", "stress", "threads", "threads-host"),
                    required=True)
    ap.add_argument("--seeds", type=int, default=3, help="stress: the launches")
    ap.add_argument("--transport", choices=("mpi", "hier"), default="mpi")
    ap.add_argument("--pid-namespaces", action="store_true",
                    help="each host in a PID namespace of its own: no rank sees another host's deaths by PID")
    ap.add_argument("--timeout-ms", type=int, default=5000, help="the group's timeout (for figures)")
    ap.add_argument("--mode", choices=("loop", "embedding", "zero", "torch"), default="loop",
                    help="host: what the ranks run until h1 is lost (PROGRAM's mode)")
    ap.add_argument("--layout", help="host, threads-host, threads: ranks (threads: processes) per host (default "
                                     "2,2; threads 1,1,1)")
    ap.add_argument("--lost-host", type=int, default=1, help="host: the host killed")
    ap.add_argument("program", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    args.layout = [int(n) for n in (args.layout or ("1,1,1" if args.what == "threads" else "2,2")).split(",")]
    if not 0 <= args.lost_host < len(args.layout) or len(args.layout) < 2:
        ap.error("--lost-host must name one of two or more hosts")
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if args.what != "stress":
        check(args.what, launch(args, program, args.what), args)
    else:
        seed0 = int(time.time()) % 100000
        for k in range(args.seeds):
            out = launch(args, program, "stress", seed0 + k)
            finisher = next((r for r in range(4) if f"rank {r}: done" in out), None)
            drawn = [int(x) for x in re.findall(rf"^rank {finisher}: round \d+ lost rank (\d+)", out, re.M)]
            collateral = check_finishers(out, drawn, f"seed {seed0 + k}")
            if not collateral and (len(drawn) != 2 or [x for sets, _ in shrinks(out, finisher) for x in sets] != drawn):
                fail(f"seed {seed0 + k}: expected two losses, each shrunk in turn: drawn {drawn}, "
                     f"shrunk {shrinks(out, finisher)}", out)
            print(f"seed {seed0 + k}: lost {drawn}" + (f" and {collateral} with them" if collateral else "") + ": ok")
    print("ok")


if __name__ == "__main__":
    main()
