#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Train a small convolutional network on the digits through gradsync.torch: the main demo's first part.

The same training (model, seed, global batches, optimizer steps) runs twice: on one worker, then
on --workers worker processes on this host (shared memory; --transport threads for threads of
this process), each computing the gradient of its share of every global batch, averaged by
gradsync.torch.DistributedDataParallel while backward runs. Every worker runs torch on one
thread, so N workers use N cores; the CNN's compute dominates its 0.75 MB of gradients, so the
workers' samples/s is what data parallelism promises, printed beside the one worker's with both
held-out accuracies and whether the workers' weights are bitwise equal.

    scripts/train_torch.py                       # 2 worker processes against 1
    scripts/train_torch.py --workers 4 --epochs 5 --transport threads
    scripts/train_torch.py --timeline /tmp/t.json  # the workers' calls, /tmp/t.json.<rank> (chrome://tracing)
"""
import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradsync as gs  # noqa: E402
from train_digits import load_digits, run_worker_processes  # noqa: E402


def make_model(seed):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(64 * 4 * 4, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def images(x):
    """The 8x8 digits as 1x16x16 images (bilinear): four times the compute per sample, the
    regime of real image models, where arithmetic dominates the gradients' size."""
    import torch

    t = torch.from_numpy(x).reshape(-1, 1, 8, 8)
    return torch.nn.functional.interpolate(t, size=(16, 16), mode="bilinear", align_corners=False).contiguous()


def accuracy(model, x, y):
    import torch

    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def train(comm, rank, workers, args, data):
    """One worker's run; returns (samples/s, losses per epoch, held-out accuracy, weight digest)."""
    import torch
    import gradsync.torch as gst

    torch.set_num_threads(1)
    x = images(data.x_train)
    y = torch.from_numpy(data.y_train)
    net = make_model(args.seed)
    model = gst.DistributedDataParallel(net, comm) if comm is not None else net
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    steps_per_epoch = len(y) // args.batch
    losses, samples, start = [], 0, None
    for epoch in range(args.epochs):
        # The same order on every worker: worker r takes rows r, r + N, ... of each global batch.
        order = torch.from_numpy(np.random.default_rng(args.seed + epoch).permutation(len(y)))
        total = 0.0
        for step in range(steps_per_epoch):
            batch = order[step * args.batch:(step + 1) * args.batch][rank::workers]
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            opt.step()
            total += float(loss)
            if start is None:
                start = time.perf_counter()  # after one warm-up step
            else:
                samples += args.batch
        losses.append(total / steps_per_epoch)
    rate = samples / (time.perf_counter() - start)
    h = hashlib.sha256()
    for p in net.parameters():
        h.update(p.detach().numpy().tobytes())
    test_x = images(data.x_test)
    return rate, losses, accuracy(net, test_x, torch.from_numpy(data.y_test)), h.hexdigest()


def _process(rank, workers, group, args, data, results):
    try:
        with gs.Communicator(group, rank, workers, timeout_ms=60000, transport="shm") as comm:
            if args.timeline:
                comm.timeline(f"{args.timeline}.{rank}")
            results.put((rank, train(comm, rank, workers, args, data), None))
    except BaseException as exc:
        results.put((rank, None, f"{type(exc).__name__}: {exc}"))


def run_processes(args, data):
    """--workers spawned processes in one shared-memory group."""
    group = f"torch-demo-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    return run_worker_processes(_process, args.workers, group, args, data)


def run_threads(args, data):
    group = f"torch-demo-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    outs, errors = [None] * args.workers, []

    def worker(rank):
        try:
            with gs.Communicator(group, rank, args.workers, timeout_ms=60000) as comm:
                if args.timeline:
                    comm.timeline(f"{args.timeline}.{rank}")
                outs[rank] = train(comm, rank, args.workers, args, data)
        except BaseException as exc:
            errors.append(f"worker {rank}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(args.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    return outs


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="workers of the parallel run (default 2)")
    parser.add_argument("--epochs", type=int, default=10, help="passes over the training set (default 10)")
    parser.add_argument("--batch", type=int, default=128, help="global batch, split over the workers (default 128)")
    parser.add_argument("--lr", type=float, default=2e-3, help="Adam's learning rate (default 2e-3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transport", choices=("shm", "threads"), default="shm",
                        help="worker processes over shared memory (default) or threads of this process")
    parser.add_argument("--timeline", default=None,
                        help="write the parallel run's Chrome-trace timeline to TIMELINE.<rank> (one per worker)")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.epochs < 1 or args.batch < args.workers:
        parser.error("need --workers >= 1, --epochs >= 1 and --batch >= --workers")
    return args


def main(argv=None):
    args = parse_args(argv)
    data = load_digits(seed=args.seed)
    n_params = sum(p.numel() for p in make_model(args.seed).parameters())
    print(f"libgradsync {gs.version()}: digits {len(data.y_train)} train / {len(data.y_test)} held-out, "
          f"CNN of {n_params} parameters through gradsync.torch, {args.epochs} epochs, global batch "
          f"{args.batch}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
    one = train(None, 0, 1, args, data)
    print(f"torch x1: {one[0]:.0f} samples/s, held-out accuracy {one[2]:.3f}, training loss by epoch "
          f"{', '.join(f'{v:.3f}' for v in one[1])}", flush=True)
    outs = (run_processes if args.transport == "shm" else run_threads)(args, data)
    rate = sum(o[0] for o in outs) / len(outs)  # each worker counts every global batch it took part in
    same = len({o[3] for o in outs}) == 1
    print(f"torch x{args.workers} ({args.transport}): {rate:.0f} samples/s, held-out accuracy {outs[0][2]:.3f}, "
          f"training loss by epoch {', '.join(f'{v:.3f}' for v in outs[0][1])}")
    print(f"torch: {args.workers} workers train {rate / one[0]:.2f}x the samples/s of 1 worker (accuracy "
          f"{outs[0][2]:.3f} vs {one[2]:.3f}); workers' weights bitwise equal: {'yes' if same else 'NO'}")
    if args.timeline:
        print(f"timeline of the {args.workers} workers' calls: {args.timeline}.0 .. {args.timeline}.{args.workers - 1} "
              "(load them together in chrome://tracing or ui.perfetto.dev)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
