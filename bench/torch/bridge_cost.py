#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The torch bridge's own cost per step: one process, a group of one (no peer to wait for), the
MLP of ddp_bench.py at batch 32. Plain torch (the baseline), gradsync.torch's
DistributedDataParallel and torch's DDP over gloo take turns in each round, in the same process.

    bench/torch/bridge_cost.py [--rounds 5] [--steps 20]

Printed: ms per step (each round's median) min / median / max over the rounds for each, and each
wrapper's per-round difference from plain torch; then a cProfile of gradsync.torch's steps.
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import pstats  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))
sys.path.insert(0, HERE)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    import torch
    import torch.distributed as dist
    import gradsync as gs
    import gradsync.torch as gst
    from ddp_bench import model_and_data
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    net, x, y = model_and_data(batch=32)
    comm = gs.Communicator(f"bridge-{uuid.uuid4().hex[:8]}", 0, 1, transport="threads", timeout_ms=60000)
    models = {"plain": net, "gradsync": gst.DistributedDataParallel(net, comm),
              "gloo": torch.nn.parallel.DistributedDataParallel(net)}
    opt = torch.optim.SGD(net.parameters(), lr=0.001)

    def step(m):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()

    res = {k: [] for k in models}
    for _ in range(args.rounds):
        for k, m in models.items():
            for _ in range(3):
                step(m)
            ts = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step(m)
                ts.append(time.perf_counter() - t0)
            res[k].append(statistics.median(ts) * 1e3)
    print(f"ms per step, min / median / max over {args.rounds} rounds of {args.steps} steps")
    for k, v in res.items():
        print(f"  {k:9s} {min(v):8.2f} / {statistics.median(v):8.2f} / {max(v):8.2f}")
    for k in ("gradsync", "gloo"):
        d = [a - b for a, b in zip(res[k], res["plain"])]
        print(f"  {k} - plain, per round: {min(d):.2f} / {statistics.median(d):.2f} / {max(d):.2f} ms")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(args.steps):
        step(models["gradsync"])
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(12)
    print(out.getvalue())
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
