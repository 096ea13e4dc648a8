# SPDX-License-Identifier: Apache-2.0
"""Ctrl-C in a rank blocked in a collective: KeyboardInterrupt at once, and the group is aborted so
its peers are told (E_ABORTED) instead of waiting out their timeout. A real SIGINT, in a child
interpreter whose main thread is the blocked rank, with its peer a thread of it or another process."""
import os
import signal
import subprocess
import sys
import textwrap
import time

SCRIPT = textwrap.dedent("""
    import os, signal, threading, time
    import numpy as np
    import gradsync as gs

    peer_status = []

    def late_peer():
        with gs.Communicator("ctrl-c", 1, 2, timeout_ms=60000) as comm:
            time.sleep(2.0)  # arrives long after the interrupt
            try:
                comm.allreduce(np.ones(4, np.float32))
                peer_status.append("ok")
            except gs.GradsyncError as e:
                peer_status.append(e.status)

    t = threading.Thread(target=late_peer)
    t.start()
    with gs.Communicator("ctrl-c", 0, 2, timeout_ms=60000) as comm:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        try:
            comm.allreduce(np.ones(4, np.float32))
            print("no interrupt")
        except KeyboardInterrupt:
            print(f"interrupted after {time.monotonic() - start:.1f} s")
        t.join()
    print("peer:", peer_status)
""")


def test_ctrl_c_interrupts_a_blocked_call_and_aborts_the_group():
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("interrupted after"), out.stdout + out.stderr
    assert float(lines[0].split()[2]) < 30  # not the 60 s deadline
    assert lines[1] == "peer: [-11]", out.stdout  # E_ABORTED


RANK = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import gradsync as gs

    rank, group = int(sys.argv[1]), sys.argv[2]
    with gs.Communicator(group, rank, 2, transport="shm", timeout_ms=60000) as comm:
        os.write(1, b"joined\\n")
        if rank == 1:
            time.sleep(3.0)  # arrives long after rank 0 was interrupted
        try:
            comm.allreduce(np.ones(4, np.float32))
            print("ok", flush=True)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            time.sleep(6.0)  # still a member when the peer arrives: it must learn of the abort, not of a leave
        except gs.GradsyncError as e:
            print("status", e.status, e.message, flush=True)
""")


def test_ctrl_c_in_one_process_of_a_shm_group_aborts_the_other():
    # The ranks are processes: the interrupted one aborts the group through the shared segment,
    # and its peer, arriving later, is told at once instead of waiting out the 60 s deadline.
    group = f"ctrl-c-shm-{os.getpid()}"
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), group], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline() == "joined\n", p.stderr.read()
        time.sleep(0.5)  # rank 0 is now blocked in its allreduce
        procs[0].send_signal(signal.SIGINT)
        outs = [p.communicate(timeout=40) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[0][0].strip() == "interrupted", outs
    assert outs[1][0].startswith("status -11 "), outs  # E_ABORTED
    assert "abort() called on rank 0" in outs[1][0], outs  # by the interrupt, not by rank 0 leaving
