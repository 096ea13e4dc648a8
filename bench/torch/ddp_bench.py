#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""gradsync.torch against torch's own DistributedDataParallel (gloo), 2 processes on this host,
same model, data, batch and seed, measured in the same run; and how much communication the
bucketed non-blocking all-reduce hides behind compute.

    bench/torch/ddp_bench.py [--steps 30] [--runs 3]

Table 1: steps/s of an MLP (about 10 M parameters) on synthetic data, min / median / max over
--runs runs, each the median step time of --steps steps after warm-up; final loss and whether the
weights are bitwise equal on both ranks. Table 2: one rank's step of C ms of compute with G MB of
gradients in buckets of 25 MB (torch's default) and of 5 MB: no overlap (compute, then
all-reduce), perfect overlap max(C, comm), and the buckets started as each part of the compute
finishes (iallreduce), with the share hidden of what the communication adds to a step without
overlap; once with the compute on the CPU, once on a "device" (a sleep that ends where the
device's work would, as the CPU waits for a GPU's kernels).
"""
import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one thread per rank, as torch.set_num_threads(1) below

import argparse  # noqa: E402
import hashlib  # noqa: E402
import multiprocessing as mp  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))


def model_and_data(seed=0, batch=64):
    import torch
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                              torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, 1024, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return net, x, y


def train(kind, rank, size, steps, queue, port, group, batch):
    import torch
    torch.set_num_threads(1)
    net, x, y = model_and_data(batch=batch)
    xs, ys = x[rank::size], y[rank::size]
    if kind == "gloo":
        import torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=size)
        model = torch.nn.parallel.DistributedDataParallel(net)
    else:
        import gradsync as gs
        import gradsync.torch as gst
        comm = gs.Communicator(group, rank, size, transport="shm", timeout_ms=60000)
        model = gst.DistributedDataParallel(net, comm)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for step in range(steps + 3):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(xs), ys)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    h = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters())).hexdigest()
    queue.put((rank, statistics.median(times[3:]), float(loss), h))
    if kind == "gloo":
        import torch.distributed as dist
        dist.destroy_process_group()
    else:
        comm.close()


def run(kind, steps, batch, size=2):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    group = f"ddpb-{uuid.uuid4().hex[:8]}"
    ps = [ctx.Process(target=train, args=(kind, r, size, steps, q, port, group, batch)) for r in range(size)]
    for p in ps:
        p.start()
    res = sorted(q.get(timeout=600) for _ in ps)
    for p in ps:
        p.join()
    return max(r[1] for r in res), res[0][2], len({r[3] for r in res}) == 1


def overlap_rank(rank, size, q, group, compute_ms, grad_mb, device, bucket_mb):
    import gradsync as gs
    comm = gs.Communicator(group, rank, size, transport="shm", timeout_ms=60000)
    n = int(grad_mb * 2 ** 20 / 4)
    bucket = int(bucket_mb * 2 ** 20 / 4)
    grads = [np.ones(min(bucket, n - lo), np.float32) for lo in range(0, n, bucket)]
    a = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)

    def compute(ms):  # matrix products for about `ms` milliseconds (calibrated below)
        if device:  # an accelerator computes: the CPU waits, free for the communication
            time.sleep(ms / 1000)
            return
        for _ in range(round(ms * per_ms)):
            a @ a

    t0 = time.perf_counter()
    for _ in range(50):
        a @ a
    per_ms = 50 / ((time.perf_counter() - t0) * 1000)
    comm.barrier()

    def timed(fn, reps=5):
        out = []
        for _ in range(reps):
            comm.barrier()
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return statistics.median(out) * 1000

    def communicate():
        for g in grads:
            comm.allreduce(g, op="mean")

    def sequential():
        compute(compute_ms)
        communicate()

    def overlapped():  # as backward: each bucket's gradients are ready after its share of compute
        reqs = []
        t0 = time.perf_counter()
        work = round(compute_ms * per_ms)
        for k, g in enumerate(grads):
            if device:  # the device computes on while the CPU starts the bucket's all-reduce
                time.sleep(max(0.0, t0 + (k + 1) * compute_ms / len(grads) / 1000 - time.perf_counter()))
            else:  # the same products as compute(compute_ms), shared out over the buckets
                for _ in range(round((k + 1) * work / len(grads)) - round(k * work / len(grads))):
                    a @ a
            reqs.append(comm.iallreduce(g, op="mean"))
        for r in reqs:
            r.wait()

    t_comp, t_comm = timed(lambda: compute(compute_ms)), timed(communicate)
    # Taken in turns, so that both see the same machine (other tenants come and go).
    seq, ovl = [], []
    for _ in range(7):
        seq.append(timed(sequential, reps=1))
        ovl.append(timed(overlapped, reps=1))
    q.put((rank, t_comp, t_comm, statistics.median(seq), statistics.median(ovl)))
    comm.close()


def overlap(compute_ms, grad_mb, device, bucket_mb, size=2):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    group = f"ovl-{uuid.uuid4().hex[:8]}"
    ps = [ctx.Process(target=overlap_rank, args=(r, size, q, group, compute_ms, grad_mb, device, bucket_mb))
          for r in range(size)]
    for p in ps:
        p.start()
    res = sorted(q.get(timeout=600) for _ in ps)
    for p in ps:
        p.join()
    return res[0][1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64, help="global batch (smaller: communication weighs more)")
    ap.add_argument("--no-overlap", action="store_true", help="skip the overlap table")
    a = ap.parse_args()
    print(f"2 processes, MLP 1024-2048-2048-2048-10 (10.5 M parameters), batch {a.batch} ({a.batch // 2} per rank), "
          "SGD; torch threads 1 per process")
    print(f"{'':24} | {'steps/s min / median / max':>28} | {'loss':>8} | weights equal")
    figures = {}
    for kind in ("gloo", "gradsync"):
        rates, last = [], None
        for _ in range(a.runs):
            t, loss, equal = run(kind, a.steps, a.batch)
            rates.append(1 / t)
            last = (loss, equal)
        figures[kind] = statistics.median(rates)
        print(f"{'torch DDP (gloo)' if kind == 'gloo' else 'gradsync.torch (shm)':24} | "
              f"{min(rates):8.2f} / {statistics.median(rates):6.2f} / {max(rates):6.2f} | {last[0]:8.4f} | {last[1]}")
    print(f"gradsync.torch / DDP-gloo: {figures['gradsync'] / figures['gloo']:.2f}x (median steps/s)")
    if a.no_overlap:
        return
    # Compute on the CPU: with 2 ranks on 2 cores both cores compute, so moving the buckets takes
    # CPU time from the compute and can hide only what waits. Compute on a device (a GPU's
    # kernels; here a sleep): the CPU is free, and what the progress thread moves is hidden.
    # The last bucket is all-reduced after the whole compute, as the first layers' gradients are
    # after the whole backward pass: with b buckets a step can hide at most (b - 1) / b of its
    # communication, so the table shows torch's default bucket size (25 MB) and a smaller one.
    for device in (False, True):
        print()
        print(f"overlap, one rank of 2 (shm), compute on {'a device (sleep)' if device else 'the CPU'}; "
              "ms per step (compute and comm: median of 5; C+comm and overlapped: median of 7, taken in turns)")
        print(f"{'C ms':>6} {'G MB':>6} {'bucket':>6} | {'compute':>8} {'comm':>8} | {'C+comm':>8} {'max(C,comm)':>11} "
              f"{'overlapped':>10} | hidden")
        for compute_ms, grad_mb in ((50, 50), (100, 50), (100, 100)):
            for bucket_mb in (25, 5):
                t_comp, t_comm, t_seq, t_ovl = overlap(compute_ms, grad_mb, device, bucket_mb)
                # What the communication adds to a step without overlap, from the same two figures as
                # what overlap saves (the comm column, timed alone, moves between runs of a shared machine).
                added = t_seq - t_comp
                hidden = (t_seq - t_ovl) / added if added > 0 else float("nan")
                print(f"{compute_ms:6d} {grad_mb:6d} {bucket_mb:6d} | {t_comp:8.1f} {t_comm:8.1f} | {t_seq:8.1f} "
                      f"{max(t_comp, t_comm):11.1f} {t_ovl:10.1f} | {100 * hidden:5.0f}%")


if __name__ == "__main__":
    main()
