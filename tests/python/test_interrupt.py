# SPDX-License-Identifier: Apache-2.0
"""Ctrl-C in a rank blocked in a collective: KeyboardInterrupt at once, and the group is aborted so
its peers are told (E_ABORTED) instead of waiting out their timeout. A real SIGINT, in a child
interpreter whose main thread is the blocked rank."""
import os
import subprocess
import sys
import textwrap

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
