#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Kills one host's ranks in the middle of allreduces across 2 hosts x 2 ranks, and checks the end.

    kill_host.py [--mpirun PATH] --what ranks|host -- PROGRAM loop

PROGRAM (tests/mpi/mpi_fault_program in mode loop) calls allreduces on every rank until one fails.
Once all four say they are under way, host h1's ranks (--what ranks), or all of h1's processes
including Open MPI's daemon (--what host, as when a machine dies), are SIGKILLed. The job must
then end by itself, well before the bound (a hang fails the test), taking every process of it
along (survivors, daemons); mpirun must fail and name a
killed rank (ranks) or the lost daemon's node (host); no survivor may finish as if nothing had
happened; and nothing may be left: no namespace, link or process of the run, and none of the
hosts' IPC and mount namespaces (whose tmpfs are their /dev/shm and /tmp) still alive.
"""
import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hosts  # noqa: E402

BOUND = 60  # seconds after the kill; Open MPI takes well under one here


def fail(what, output=""):
    sys.exit(f"FAIL: {what}\n{output}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--what", choices=("ranks", "host"), required=True)
    ap.add_argument("program", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    layout = [2, 2]
    victims = [2, 3]  # ranks are placed host by host: h1 holds ranks 2 and 3

    with hosts.signals_raise():
        with hosts.Hosts(layout, mpirun=args.mpirun) as h:
            job = h.start(program)
            if not job.wait_for(r"rank \d: looping", count=sum(layout), timeout=BOUND):
                fail("the ranks did not all get under way", job.output())
            namespaces = set().union(*(h.host_namespaces(i) for i in range(len(layout))))
            killed = h.kill_host(1, only=program[0] if args.what == "ranks" else None)
            killed_at = time.monotonic()
            result = job.wait(BOUND)
            ended_after = time.monotonic() - killed_at
            print(f"killed {args.what} of h1 (pids {killed}); mpirun exited {result.status} "
                  f"{ended_after:.2f} s later\n--- job output\n{result.output}--- end of job output")
            if result.timed_out:
                fail(f"the job did not end within {BOUND} s of the kill (a hang)")
            # Before the harness's clean-up kills whatever is left: mpirun's end must end them all.
            stragglers = []
            for _ in range(100):
                stragglers = [p for i in range(len(layout)) for p in h.pids(i)]
                if not stragglers:
                    break
                time.sleep(0.1)
            if stragglers:
                fail(f"processes of the job still running 10 s after mpirun ended: {stragglers}")
        left = h.leftovers()

    if len(killed) < 2:
        fail(f"expected h1's two ranks (and its daemon) to be killed, killed {killed}")
    if result.status == 0:
        fail("mpirun reported success although a host's ranks were killed")
    out = result.output
    if args.what == "ranks":
        if not re.search(rf"rank ({'|'.join(map(str, victims))}) with PID \d+ on node \S+ exited on signal 9", out):
            fail("mpirun did not name a killed rank and its signal")
    elif not re.search(rf"{re.escape(h.addresses[1])}|{h.names[1]}", out):
        fail(f"mpirun did not name the lost host ({h.addresses[1]})")
    if re.search(r"rank \d: done", out):
        fail("a rank finished normally although its peers were killed")
    if left:
        fail(f"left behind: {', '.join(left)}")
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        mine = (hosts._ns_inode(pid, "ipc"), hosts._ns_inode(pid, "mnt"), hosts._ns_inode(pid, "uts"))
        if mine in namespaces:
            alive.append(pid)
    if alive:
        fail(f"processes still in a host's IPC/mount namespaces: {alive}")
    print(f"ok: the job ended {ended_after:.2f} s after the kill; nothing left behind")


if __name__ == "__main__":
    main()
