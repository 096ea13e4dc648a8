# SPDX-License-Identifier: Apache-2.0
"""os.fork() in a process that holds communicators: in the child, every call on them raises
E_MISUSE naming the parent process, and their finalizers (which free them) leave the parent's group
alone; the parent's group works on. Shared memory with real processes, and threads; with and
without a request pending on the progress thread at the fork."""
import gc
import multiprocessing as mp
import os
import signal
import threading
import time
import uuid

import numpy as np
import pytest

import gradsync as gs

BOUND_S = 60  # no test can hang: every process is waited for with this bound, then killed


def _wait_bounded(pid):
    """The exit status of pid, killing it (and returning None) if it runs past BOUND_S."""
    until = time.monotonic() + BOUND_S
    while time.monotonic() < until:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return status
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def _wait_until_others_sleep():
    """Returns once every thread of this process but this one is asleep (state S), twice in a row:
    they then wait in a collective, not inside malloc. A sanitizer's allocator has no fork handler,
    so a fork while another thread holds its lock would leave the child's copy locked for ever."""
    me, calm = threading.get_native_id(), 0
    while calm < 2:
        asleep = True
        for tid in os.listdir("/proc/self/task"):
            if int(tid) == me:
                continue
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    state = f.read().rpartition(")")[2].split()[0]
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue  # the thread has exited
            asleep = asleep and state == "S"
        calm = calm + 1 if asleep else 0
        os.sched_yield()


def _expect_refused(call, parent_pid, what):
    try:
        call()
    except gs.GradsyncError as e:
        if e.status != gs.E_MISUSE or f"parent process (pid {parent_pid})" not in e.message:
            return [f"{what}: {e}"]
        return []
    return [f"{what} was accepted in the child"]


def _fork_child(held, segment=None):
    """Forks; the child checks that every call on the communicators in held["comms"] (and on
    held["request"], if any) is refused, then drops them so that their finalizers run (the caller
    holds them only there), and exits with the number of problems (printed). The parent gets the
    child's exit status."""
    parent = os.getpid()
    _wait_until_others_sleep()
    pid = os.fork()
    if pid != 0:
        return _wait_bounded(pid)
    problems = []
    try:
        signal.alarm(BOUND_S)  # a hang is the bug under test
        for comm in held["comms"]:
            problems += _expect_refused(lambda: comm.allreduce(np.ones(2, np.float32)), parent, "allreduce")
            problems += _expect_refused(lambda: comm.iallreduce(np.ones(2, np.float32)), parent, "iallreduce")
            problems += _expect_refused(comm.barrier, parent, "barrier")
            problems += _expect_refused(comm.reset, parent, "reset")
        if held.get("request") is not None:
            problems += _expect_refused(held["request"].wait, parent, "wait of a request made before the fork")
            problems += _expect_refused(held["request"].test, parent, "test of a request made before the fork")
        comm = None
        held["comms"].clear()  # the only references: the finalizers run here, in the child
        held.clear()
        gc.collect()
        if segment is not None:
            with open("/proc/self/maps") as maps:
                if segment in maps.read():
                    problems.append(f"{segment} is still mapped in the child after its communicator was collected")
        signal.alarm(0)
    except BaseException as e:  # noqa: BLE001 - the child must reach os._exit whatever happens
        problems.append(repr(e))
    for p in problems:
        print("child:", p, flush=True)
    os._exit(min(len(problems), 100))


def _shm_rank(rank, size, queue, group, go):
    # The communicator and the request are held in `held` only, so that a forked child can drop them.
    held = {"comms": [gs.Communicator(group, rank, size, timeout_ms=30000, transport="shm")]}
    x = np.array([rank + 1], np.int32)
    held["comms"][0].allreduce(x, op="sum")
    results = [int(x[0])]
    if rank == 0:
        segment = f"/dev/shm/gradsync.{group}"
        # No progress thread: blocking calls only so far.
        results.append(_fork_child(held, segment))
        go.set()
        x[:] = 1
        held["comms"][0].allreduce(x, op="sum")
        results.append(int(x[0]))
        # A request pending on the progress thread at the fork: rank 1 joins it after the child is gone.
        y = np.array([1], np.int32)
        held["request"] = held["comms"][0].iallreduce(y, op="sum")
        results.append(_fork_child(held, segment))
        go.set()
        held.pop("request").wait()
        results.append(int(y[0]))
    else:
        for _ in range(2):
            go.wait(BOUND_S)
            go.clear()
            x[:] = 2
            held["comms"][0].allreduce(x, op="sum")
            results.append(int(x[0]))
    comm = held["comms"][0]
    x[:] = rank + 1
    comm.allreduce(x, op="sum")
    results.append(int(x[0]))
    comm.close()
    queue.put((rank, results))


def test_shm_child_finalizer_leaves_the_parents_group_alone():
    group = f"py-fork-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    queue, go = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_shm_rank, args=(r, 2, queue, group, go)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(BOUND_S)
        assert not any(p.is_alive() for p in procs), f"a rank still ran after {BOUND_S} s"
        results = dict(queue.get(timeout=5) for _ in range(2))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    # rank 0: first sum, child exit 0, sum after it, child exit 0 (request pending), the request's
    # sum, a last sum; rank 1: its side of the same sums.
    assert results[0] == [3, 0, 3, 0, 3, 3]
    assert results[1] == [3, 3, 3, 3]
    assert not os.path.exists(f"/dev/shm/gradsync.{group}")


def test_thread_group_child_refuses_and_frees_both_ranks():
    name = f"py-fork-threads-{uuid.uuid4().hex[:8]}"
    comms = [None, None]

    def join(rank):
        comms[rank] = gs.Communicator(name, rank, 2, timeout_ms=30000)

    t = threading.Thread(target=join, args=(1,))
    t.start()
    join(0)
    t.join()
    sums = [None, None]

    def rank1_sum():
        v = np.array([2], np.int32)
        comms[1].allreduce(v, op="sum")
        sums[1] = int(v[0])

    try:
        # Idle: both ranks' handles, no progress thread.
        assert _fork_child({"comms": comms}) == 0
        # A request of rank 0 pending at the fork (rank 1 has not called yet).
        v = np.array([1], np.int32)
        held = {"comms": comms, "request": comms[0].iallreduce(v, op="sum")}
        assert _fork_child(held) == 0
        t = threading.Thread(target=rank1_sum)
        t.start()
        held["request"].wait()
        t.join(BOUND_S)
        assert not t.is_alive()
        assert int(v[0]) == 3 and sums[1] == 3
        held.pop("request").close()
        # The group works on.
        t = threading.Thread(target=rank1_sum)
        t.start()
        v[:] = 1
        comms[0].allreduce(v, op="sum")
        t.join(BOUND_S)
        assert int(v[0]) == 3 and sums[1] == 3
    finally:
        for c in comms:
            c.close()
