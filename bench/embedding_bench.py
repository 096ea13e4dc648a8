#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The sharded embedding table against its baselines, measured in one run:

  push + lookup rows/s of gradsync.ShardedEmbeddingTable (row-wise Adagrad) on P ranks (threads of
  one process, or shm processes under gradsync.run), each rank with a batch of --batch ids (uniform,
  or Zipf with exponent 1.1 over the rows, hot rows scattered); a step is one lookup and one push;
  rows/s counts the global batch's ids per step time;
  against the single-process accumulator (owner mode, P threads: gather, add_batch, apply of the
  global batch) and torch's CPU recipe (every rank a full nn.EmbeddingBag(sparse=True), the sparse
  gradients all-gathered over gloo, then torch's sparse Adagrad).
  Checkpoint write and reload GB/s of the sharded table against a plain sequential write (and
  fsync) of as many bytes, in the same directory.

Every figure is min / median / max over --runs runs of --steps steps.

--optimizers instead compares the pushes of the table's optimizers in one run: on --ranks[0]
ranks (threads), a row-wise Adagrad table and an Adam table of the same shape push the same
batches, run after run alternately (so both see the same machine), push only; it prints each
one's rows/s and Adam's per-run ratio to Adagrad (baseline: row-wise Adagrad).

    GRADSYNC_LIBRARY=build/libgradsync.so.0 PYTHONPATH=scripts /usr/bin/python3 bench/embedding_bench.py
"""
import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "scripts"))
import gradsync as gs  # noqa: E402


def batches(args, rank, dist, count):
    """count batches of args.batch ids of this rank."""
    rng = np.random.default_rng([args.seed, rank, 0 if dist == "uniform" else 1])
    if dist == "uniform":
        return [rng.integers(0, args.rows, args.batch) for _ in range(count)]
    ranks = np.arange(1, args.rows + 1, dtype=np.float64)
    cdf = np.cumsum(ranks ** -1.1)
    cdf /= cdf[-1]
    hot = np.random.default_rng(args.seed).permutation(args.rows)  # the same on every rank
    return [hot[np.minimum(np.searchsorted(cdf, rng.random(args.batch)), args.rows - 1)] for _ in range(count)]


def stats(values):
    v = sorted(values)
    return v[0], v[len(v) // 2], v[-1]


def fmt(triple, scale=1e6, unit="M"):
    return " / ".join(f"{x / scale:6.2f}" for x in triple) + f" {unit}"


# ------------------------------------------------------------------ the sharded table, one rank

def rank_body(args, comm, dist, out):
    rank, size = comm.rank, comm.size
    table = gs.ShardedEmbeddingTable(comm, args.rows, args.dim, sharding="hash", optimizer="row_adagrad", lr=0.01,
                                      init="uniform", seed=1, lo=-0.01, hi=0.01)
    data = batches(args, rank, dist, args.steps)
    grads = np.random.default_rng(rank).standard_normal((args.batch, args.dim)).astype(np.float32) * 0.01
    table.lookup(data[0])  # a warm-up step: first touches of the tables and buffers are not measured
    table.push(data[0], grads)
    rates, cpu = [], []
    for _ in range(args.runs):
        comm.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for ids in data:
            table.lookup(ids)
            table.push(ids, grads)
        comm.barrier()
        rates.append(size * args.batch * args.steps / (time.perf_counter() - t0))
        # Rows per CPU second: the process's CPU time (every rank's, for threads; this rank's times
        # the ranks, for processes), which a machine busy with other work does not inflate as it
        # does the elapsed time.
        cpu.append(args.batch * args.steps / (time.process_time() - c0) * (size if threaded(comm) else 1))
    ckpt = None
    if dist == "uniform" and args.checkpoint_dir:
        ckpt = checkpoint_rates(args, comm, table)
    table.close()
    if rank == 0:
        out["rates"], out["cpu"], out["ckpt"] = rates, cpu, ckpt


def optimizer_rates(args, dist):
    """{optimizer: [rows/s per run]} and Adam's per-run ratio to row-wise Adagrad, alternating."""
    size, names = args.ranks[0], ("row_adagrad", "adam")
    out = {}

    def body(comm, rank):
        tables = {n: gs.ShardedEmbeddingTable(comm, args.rows, args.dim, sharding="hash", optimizer=n, lr=0.01,
                                              init="uniform", seed=1, lo=-0.01, hi=0.01) for n in names}
        data = batches(args, rank, dist, args.steps)
        grads = np.random.default_rng(rank).standard_normal((args.batch, args.dim)).astype(np.float32) * 0.01
        rates = {n: [] for n in names}
        for n in names:  # warm-up: first touches of the tables and buffers are not measured
            tables[n].push(data[0], grads)
        for _ in range(args.runs):
            for n in names:
                comm.barrier()
                t0 = time.perf_counter()
                for ids in data:
                    tables[n].push(ids, grads)
                comm.barrier()
                rates[n].append(size * args.batch * args.steps / (time.perf_counter() - t0))
        for t in tables.values():
            t.close()
        if rank == 0:
            out.update(rates)

    run_threads(size, body)
    return out, [a / b for a, b in zip(out["adam"], out["row_adagrad"])]


def threaded(comm):
    return comm.transport == "threads"


def checkpoint_rates(args, comm, table):
    where = pathlib.Path(args.checkpoint_dir) / f"ckpt-{comm.size}"
    nbytes = args.rows * (8 + 4 * args.dim + 4)
    writes, loads = [], []
    for _ in range(max(2, args.runs // 2)):
        comm.barrier()
        t0 = time.perf_counter()
        table.save(where)
        writes.append(nbytes / (time.perf_counter() - t0))
        comm.barrier()
        t0 = time.perf_counter()
        table.load(where)
        loads.append(nbytes / (time.perf_counter() - t0))
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(where, ignore_errors=True)
    return writes, loads


def plain_write_rate(args, nbytes):
    """A plain sequential write + fsync of nbytes in the checkpoint directory."""
    path = pathlib.Path(args.checkpoint_dir) / "plain.bin"
    block = np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8).tobytes()
    rates = []
    for _ in range(max(2, args.runs // 2)):
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            left = nbytes
            while left > 0:
                f.write(block[:min(left, len(block))])
                left -= len(block)
            f.flush()
            os.fsync(f.fileno())
        rates.append(nbytes / (time.perf_counter() - t0))
        path.unlink()
    return rates


def sharded_threads(args, size, dist):
    out = {}
    run_threads(size, lambda comm, rank: rank_body(args, comm, dist, out), tag=dist)
    return out


def run_threads(size, body, tag=""):
    """body(comm, rank) on each of `size` ranks, threads of this process."""
    name = f"embbench-{os.getpid()}-{size}-{tag}-{time.monotonic_ns()}"
    errors = []

    def worker(rank):
        try:
            with gs.Communicator(name, rank, size, timeout_ms=600000) as comm:
                body(comm, rank)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def sharded_shm(args, size, dist):
    """The same ranks as processes under gradsync.run; rank 0 prints its rates."""
    cmd = [sys.executable, "-m", "gradsync.run", "-n", str(size), "--no-tag-output", __file__, "--worker", dist,
           "--rows", str(args.rows), "--dim", str(args.dim), "--batch", str(args.batch), "--steps", str(args.steps),
           "--runs", str(args.runs), "--checkpoint-dir", ""]
    env = dict(os.environ, PYTHONPATH=str(HERE.parent / "scripts") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"shm ranks failed:\n{proc.stdout}\n{proc.stderr}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("RATES ")][-1]
    cpu = [x for x in proc.stdout.splitlines() if x.startswith("CPU ")][-1]
    return {"rates": [float(x) for x in line.split()[1:]], "cpu": [float(x) for x in cpu.split()[1:]], "ckpt": None}


# ------------------------------------------------------------------ baselines

def accumulator_rates(args, size, dist):
    params = gs.Table.anonymous(args.rows, args.dim, init="uniform", seed=1, lo=-0.01, hi=0.01)
    state = gs.Table.anonymous(args.rows, 1)
    accum = gs.Accumulator.anonymous(args.rows, args.dim, concurrency="owner", threads=size)
    data = [np.concatenate(b) for b in zip(*(batches(args, r, dist, args.steps) for r in range(size)))]
    grads = np.random.default_rng(0).standard_normal((size * args.batch, args.dim)).astype(np.float32) * 0.01
    params.gather(data[0])  # the same warm-up step
    accum.add_batch(data[0], grads)
    accum.apply(params, "adagrad", lr=0.01, state=state)
    rates, cpu = [], []
    for _ in range(args.runs):
        t0, c0 = time.perf_counter(), time.process_time()
        for ids in data:
            params.gather(ids)
            accum.add_batch(ids, grads)
            accum.apply(params, "adagrad", lr=0.01, state=state)
        rates.append(size * args.batch * args.steps / (time.perf_counter() - t0))
        cpu.append(size * args.batch * args.steps / (time.process_time() - c0))
    return rates, cpu


TORCH_WORKER = r'''
import os, sys, time, numpy as np, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1]); import embedding_bench as eb
args = eb.parse_args(sys.argv[3:]); distname = sys.argv[2]
rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=rank, world_size=size)
emb = torch.nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=True)
opt = torch.optim.Adagrad(emb.parameters(), lr=0.01)
data = [torch.from_numpy(b) for b in eb.batches(args, rank, distname, args.steps)]
offsets = torch.arange(args.batch)
def step(ids):
    opt.zero_grad()
    emb(ids, offsets).sum().backward()
    g = emb.weight.grad.coalesce()
    idx, val = g.indices()[0].contiguous(), g.values().contiguous()
    n = torch.tensor([idx.numel()]); ns = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(ns, n); m = int(max(x.item() for x in ns))
    pi = torch.full((m,), -1, dtype=torch.int64); pi[:idx.numel()] = idx
    pv = torch.zeros(m, args.dim); pv[:idx.numel()] = val
    ai = [torch.empty_like(pi) for _ in range(size)]; av = [torch.empty_like(pv) for _ in range(size)]
    dist.all_gather(ai, pi); dist.all_gather(av, pv)
    keep = [(i[:int(k.item())], v[:int(k.item())]) for i, v, k in zip(ai, av, ns)]
    allidx = torch.cat([k[0] for k in keep]); allval = torch.cat([k[1] for k in keep])
    emb.weight.grad = torch.sparse_coo_tensor(allidx[None], allval, emb.weight.shape).coalesce()
    opt.step()
step(data[0])  # the same warm-up step
rates, cpu = [], []
for _ in range(args.runs):
    dist.barrier(); t0, c0 = time.perf_counter(), time.process_time()
    for ids in data:
        step(ids)
    dist.barrier(); rates.append(size * args.batch * args.steps / (time.perf_counter() - t0))
    cpu.append(args.batch * args.steps / (time.process_time() - c0))
if rank == 0: print("RATES " + " ".join(str(r) for r in rates), flush=True)
if rank == 0: print("CPU " + " ".join(str(r) for r in cpu), flush=True)
dist.destroy_process_group()
'''


def torch_rates(args, size, dist):
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    argv = ["--rows", str(args.rows), "--dim", str(args.dim), "--batch", str(args.batch), "--steps",
            str(args.steps), "--runs", str(args.runs)]
    procs = []
    for r in range(size):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-c", TORCH_WORKER, str(HERE), dist] + argv, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=3600) for p in procs]
    if any(p.returncode != 0 for p in procs):
        raise SystemExit("torch ranks failed:\n" + "\n".join(o[1] for o in outs))
    line = [x for x in outs[0][0].splitlines() if x.startswith("RATES ")][-1]
    cpu = [x for x in outs[0][0].splitlines() if x.startswith("CPU ")][-1]
    return [float(x) for x in line.split()[1:]], [float(x) for x in cpu.split()[1:]]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=65536, help="ids per rank per step")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--dist", nargs="+", default=["uniform", "zipf"], choices=["uniform", "zipf"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-shm", action="store_true")
    ap.add_argument("--checkpoint-dir", default=None, help="default: a directory under the temp dir")
    ap.add_argument("--optimizers", action="store_true",
                    help="compare the pushes of row-wise Adagrad and Adam (threads, --ranks[0] ranks) instead")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main():
    args = parse_args()
    if args.worker:  # one rank of sharded_shm
        out = {}
        with gs.Communicator.from_env(timeout_ms=600000) as comm:
            rank_body(args, comm, args.worker, out)
            if comm.rank == 0:
                print("RATES " + " ".join(str(r) for r in out["rates"]), flush=True)
                print("CPU " + " ".join(str(r) for r in out["cpu"]), flush=True)
        return 0
    if args.optimizers:
        print(f"libgradsync {gs.version()}: {args.rows} x {args.dim} table, {args.ranks[0]} ranks (threads), "
              f"{args.batch} ids per rank per step, {args.runs} runs of {args.steps} pushes each, alternating; "
              f"min / median / max; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        print(f"{'ids':>8} {'row-wise Adagrad rows/s':>27} {'Adam rows/s':>27} {'Adam / Adagrad':>24}")
        for dist in args.dist:
            rates, ratio = optimizer_rates(args, dist)
            print(f"{dist:>8} {fmt(stats(rates['row_adagrad'])):>27} {fmt(stats(rates['adam'])):>27} "
                  f"{' / '.join(f'{x:.2f}' for x in stats(ratio)):>22}x", flush=True)
        print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        return 0
    tmp = None
    if args.checkpoint_dir is None:
        tmp = tempfile.mkdtemp(prefix="gradsync-embbench-")
        args.checkpoint_dir = tmp
    print(f"libgradsync {gs.version()}: {args.rows} x {args.dim} table, row-wise Adagrad, {args.batch} ids per rank "
          f"per step, {args.runs} runs of {args.steps} steps (push + lookup); min / median / max, {os.cpu_count()} CPUs")
    head = (f"{'ranks':>5} {'ids':>8} {'sharded threads':>27} {'sharded shm':>27} {'accumulator':>27} "
            f"{'torch gloo':>27} {'vs accum':>8} {'vs torch':>8}")
    print("\nrows/s (M = 1e6)\n" + head)
    ckpt_rows, cpu_rows = [], []
    for size in args.ranks:
        for dist in args.dist:
            th = sharded_threads(args, size, dist)
            shm = None if args.no_shm else sharded_shm(args, size, dist)
            acc, acc_cpu = accumulator_rates(args, size, dist)
            tor, tor_cpu = (None, None) if args.no_torch else torch_rates(args, size, dist)
            cpu_rows.append((size, dist, th["cpu"], shm["cpu"] if shm else None, acc_cpu, tor_cpu))
            med = stats(th["rates"])[1]
            print(f"{size:>5} {dist:>8} {fmt(stats(th['rates'])):>27} "
                  f"{fmt(stats(shm['rates'])) if shm else '-':>27} {fmt(stats(acc)):>27} "
                  f"{fmt(stats(tor)) if tor else '-':>27} {med / stats(acc)[1]:>7.2f}x "
                  f"{(med / stats(tor)[1]) if tor else float('nan'):>7.2f}x", flush=True)
            if th["ckpt"]:
                ckpt_rows.append((size, th["ckpt"]))
    print("\nrows per CPU second (M = 1e6; each process's CPU time, so per core whatever else runs)\n" + head)
    for size, dist, th, shm, acc, tor in cpu_rows:
        med = stats(th)[1]
        print(f"{size:>5} {dist:>8} {fmt(stats(th)):>27} {fmt(stats(shm)) if shm else '-':>27} {fmt(stats(acc)):>27} "
              f"{fmt(stats(tor)) if tor else '-':>27} {med / stats(acc)[1]:>7.2f}x "
              f"{(med / stats(tor)[1]) if tor else float('nan'):>7.2f}x", flush=True)
    if ckpt_rows:
        nbytes = args.rows * (8 + 4 * args.dim + 4)
        plain = plain_write_rate(args, nbytes)
        print(f"\ncheckpoint of {nbytes / 1e9:.2f} GB (ids, rows, Adagrad state) in {args.checkpoint_dir}, GB/s:")
        print(f"{'ranks':>5} {'save':>24} {'load':>24} {'plain write':>24} {'save/plain':>10}")
        for size, (w, l) in ckpt_rows:
            print(f"{size:>5} {fmt(stats(w), 1e9, 'GB/s'):>24} {fmt(stats(l), 1e9, 'GB/s'):>24} "
                  f"{fmt(stats(plain), 1e9, 'GB/s'):>24} {stats(w)[1] / stats(plain)[1]:>9.2f}x")
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
