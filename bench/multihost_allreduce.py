#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Allreduce across 2 separate hosts x 2 ranks (tests/multihost/hosts.py), beside its limits.

    bench/multihost_allreduce.py [--runs 5] [--build build]

On one set of hosts, each run measures, interleaved:
- bench/mpi/mpi_bench across the hosts: Open MPI's own flat MPI_Allreduce (f32 sum, 1 to 16M floats)
  and the library's MPI transport on the same processes, each figure that run's median of the
  slowest rank's time per call;
- a plain TCP stream from h0 to h1 (one connection, 4 MiB writes), the cross-host limit: the time
  it takes to move 16M floats (64 MiB) is what any 2-host allreduce of 16M floats must spend at
  least, since each host has to send the other half its data's size at the very least.
Printed: min / median / max over the runs, and the median ratio (above 1: the library is faster).
Needs root (namespaces) and a build with GRADSYNC_BUILD_BENCH=ON and MPI.
"""
import argparse
import os
import statistics
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "tests", "multihost"))
sys.path.insert(0, here)
import hosts  # noqa: E402
from spread import rows  # noqa: E402  (how bench/spread.py reads a benchmark's table)

STREAM_BYTES = 1 << 30
CHUNK = 4 << 20
PORT = 47011

RECEIVER = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
print("listening", flush=True)
c, _ = s.accept(); buf = memoryview(bytearray(%d)); total = 0; start = None
while True:
    n = c.recv_into(buf)
    if not n: break
    if start is None: start = time.perf_counter()
    total += n
print(total, time.perf_counter() - start, flush=True)
""" % CHUNK

SENDER = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
chunk = bytes(%d)
for _ in range(int(sys.argv[3]) // len(chunk)): c.sendall(chunk)
c.close()
""" % CHUNK


def tcp_stream(h, src, dst):
    """Bytes per second of one TCP stream from host src to host dst (plain processes in their networks)."""
    recv = h.exec(dst, [sys.executable, "-c", RECEIVER, h.addresses[dst], str(PORT)], stdout=subprocess.PIPE, text=True)
    try:
        if recv.stdout.readline().strip() != "listening":
            raise RuntimeError("the stream's receiver did not start")
        send = h.exec(src, [sys.executable, "-c", SENDER, h.addresses[dst], str(PORT), str(STREAM_BYTES)])
        if send.wait(120) != 0:
            raise RuntimeError("the stream's sender failed")
        total, seconds = recv.stdout.readline().split()
        recv.wait(30)
    finally:
        recv.kill()
    if int(total) != STREAM_BYTES:
        raise RuntimeError(f"the stream moved {total} of {STREAM_BYTES} bytes")
    return int(total) / float(seconds)


def spread(values):
    return min(values), statistics.median(values), max(values)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--build", default=os.path.join(here, "..", "build"))
    args = ap.parse_args()
    exe = os.path.abspath(os.path.join(args.build, "bench", "mpi", "mpi_bench"))
    if not os.access(exe, os.X_OK):
        sys.exit(f"{exe} not found: build with -DGRADSYNC_BUILD_BENCH=ON (target mpi_bench)")
    flat, lib, stream = {}, {}, []
    with hosts.signals_raise(), hosts.Hosts([2, 2]) as h:
        for run in range(args.runs):
            stream.append(tcp_stream(h, 0, 1))
            result = h.run([exe], timeout=1800)
            if result.status != 0:
                sys.exit(f"mpi_bench failed ({result.status}):\n{result.output}")
            # mpi_bench's cells are min / median / max over its own runs: this run's figure is the
            # median (raw MPI_Allreduce, then the MPI transport with default options, in us).
            for key, values in rows(result.output).items():
                flat.setdefault(key, []).append(values[1])
                lib.setdefault(key, []).append(values[4])
            print(f"run {run + 1}/{args.runs} done", file=sys.stderr, flush=True)
        with open("/proc/loadavg") as f:
            load = f.read().split()[0]
        print(f"Allreduce (f32 sum) across 2 hosts x 2 ranks (network namespaces on a bridge, Open MPI over TCP,\n"
              f"shared memory within a host); {args.runs} runs, each figure a run's median of the slowest rank's\n"
              f"time per call; min / median / max over the runs (load average {load} at the end)\n")
        print(f"{'floats':>10} | {'flat MPI_Allreduce us':>26} | {'library (MPI transport) us':>26} | {'speed vs flat':>13}")
        for key in flat:
            f, l = spread(flat[key]), spread(lib[key])
            print(f"{key:>10} | {f[0]:8.1f} {f[1]:8.1f} {f[2]:8.1f} | {l[0]:8.1f} {l[1]:8.1f} {l[2]:8.1f} |"
                  f" {f[1] / l[1]:12.2f}x")
        s = spread(stream)
        floor = [(16 << 20) * 4 / b * 1e3 for b in stream]
        fl = spread(floor)
        print(f"\nCross-host limit, a plain TCP stream h0 -> h1 in the same namespaces: "
              f"{s[0] / 1e9:.2f} / {s[1] / 1e9:.2f} / {s[2] / 1e9:.2f} GB/s,\n"
              f"i.e. 16M floats (64 MiB) in {fl[0]:.1f} / {fl[1]:.1f} / {fl[2]:.1f} ms; "
              f"flat MPI_Allreduce of 16M floats: {spread(flat[str(16 << 20)])[1] / 1e3:.1f} ms (median)")


if __name__ == "__main__":
    try:
        main()
    except hosts.Interrupted as e:
        sys.exit(128 + e.signum)  # the hosts are gone already
