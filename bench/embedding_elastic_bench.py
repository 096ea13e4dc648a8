#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Recovery of a sharded embedding table after a lost rank, phase by phase, on shm processes.

Each run: 4 processes train a rows x dim row-wise Adagrad table (push of `--batch` ids per rank a
step), save a checkpoint, push `--replay` more steps, then rank 1 is SIGKILLed. The survivors
time: detect (from the kill to their failed push), shrink, restore (gradsync_embedding_reshard
with the checkpoint: every row from it), replay (the pushes since the checkpoint, on 3 ranks).
Then a forked joiner grows the group back to 4 and every rank reshards in memory: grow (the join)
and reshard (the in-memory move, the slowest rank). Baselines in the same run: a plain
gradsync_embedding_load of the same checkpoint by a fresh table on the 3 survivors (what the
restore costs without the reshard around it), and one push on 3 ranks (a step). Prints each
phase's min / median / max over the runs (each run's slowest rank), the ratios to the baselines,
and the load average.

With --replicas K the table keeps K replicas of each rank's rows: restore is then the reshard
without a checkpoint (rank 1's rows from rank 2's replica, in memory), and nothing is replayed; the
added baseline step_plain is one push (its second) of a table without replicas on the same 3
ranks, so that step_baseline / step_plain is what the replicas cost a push; and each run is paired
with one without replicas (restore from the checkpoint, then replay), run right after it, whose
phases are printed too, with each pair's ratios of the whole recovery (restore + replay) and of
the grow back.

  PYTHONPATH=scripts GRADSYNC_LIBRARY=build/libgradsync.so python3 bench/embedding_elastic_bench.py --runs 5
"""
import argparse
import multiprocessing as mp
import os
import signal
import statistics
import tempfile
import time
import uuid

import numpy as np

PHASES = ["detect", "shrink", "restore", "replay", "grow", "reshard", "load_baseline", "step_baseline", "step_plain"]


def now():
    return time.monotonic_ns()


def batch(args, step, rank, size):
    rng = np.random.default_rng([step, 17])
    ids = rng.integers(0, args.rows, args.batch * 4, dtype=np.int64)
    grads = rng.standard_normal((args.batch * 4, args.dim), dtype=np.float32)
    lo, hi = len(ids) * rank // size, len(ids) * (rank + 1) // size
    return ids[lo:hi], grads[lo:hi]


def make(gs, comm, args, replicas=None):
    return gs.ShardedEmbeddingTable(comm, args.rows, args.dim, optimizer="row_adagrad", lr=0.05, init="uniform",
                                    seed=1, replicas=args.replicas if replicas is None else replicas)


def member(args, name, ckpt, rank, board, ready, go_grow):
    import gradsync as gs

    comm = gs.Communicator(name, rank, 4, timeout_ms=60000, transport="shm")
    table = make(gs, comm, args)
    for s in range(2):
        table.push(*batch(args, s, rank, 4))
    table.save(ckpt)
    for s in range(2, 2 + args.replay):
        table.push(*batch(args, s, rank, 4))
    ready[rank] = 1
    if rank == 1:
        while True:
            time.sleep(1)
    phase = lambda p, ns: board.__setitem__(rank * len(PHASES) + PHASES.index(p), ns)  # noqa: E731
    ids, grads = batch(args, 2 + args.replay, rank, 4)
    try:
        table.push(ids, grads)
        raise SystemExit("a push succeeded without rank 1")
    except gs.GradsyncError:
        phase("detect", now() - board[4 * len(PHASES)])
    t = now()
    shrunk, _, _ = comm.shrink()
    phase("shrink", now() - t)
    t = now()
    if args.replicas:
        _, restored = table.reshard(shrunk)
        phase("restore", now() - t)
        assert not restored and table.steps == 2 + args.replay
        phase("replay", 0)
    else:
        _, restored = table.reshard(shrunk, checkpoint=ckpt)
        phase("restore", now() - t)
        assert restored and table.steps == 2
        t = now()
        for s in range(2, 2 + args.replay):
            table.push(*batch(args, s, shrunk.rank, 3))
        phase("replay", now() - t)
    unreplicated = make(gs, shrunk, args, replicas=0)
    unreplicated.push(*batch(args, 1 + args.replay, shrunk.rank, 3))  # its first push faults its pages in
    t = now()
    unreplicated.push(*batch(args, 2 + args.replay, shrunk.rank, 3))
    phase("step_plain", now() - t)
    unreplicated.close()
    plain = make(gs, shrunk, args, replicas=0)
    t = now()
    plain.load(ckpt)
    phase("load_baseline", now() - t)
    plain.close()
    t = now()
    table.push(*batch(args, 2 + args.replay, shrunk.rank, 3))
    phase("step_baseline", now() - t)
    ready[rank] = 2
    while not go_grow.value:
        time.sleep(0.001)
    grown, _ = shrunk.grow(name + "-join", 1)
    t = now()
    table.reshard(grown)
    phase("reshard", now() - t)
    table.push(*batch(args, 3 + args.replay, grown.rank, 4))
    table.close()
    for c in (grown, shrunk, comm):
        c.close()


def joiner(args, name, board):
    import gradsync as gs

    t = now()
    grown, _ = gs.Communicator.join(name + "-join", 0, 1, timeout_ms=60000, transport="shm")
    board[4 * len(PHASES) + 1] = now() - t
    table = make(gs, grown, args)
    t = now()
    moved, restored = table.reshard(grown)
    board[4 * len(PHASES) + 2] = now() - t
    assert moved > 0 and not restored and table.steps == 3 + args.replay
    table.push(*batch(args, 3 + args.replay, grown.rank, 4))
    table.close()
    grown.close()


def run_once(args, ctx, tmp):
    name = f"emb-elastic-bench-{uuid.uuid4().hex[:8]}"
    ckpt = os.path.join(tmp, name)
    board = ctx.Array("q", 5 * len(PHASES), lock=False)
    ready = ctx.Array("i", 4, lock=False)
    go_grow = ctx.Value("i", 0, lock=False)
    procs = [ctx.Process(target=member, args=(args, name, ckpt, r, board, ready, go_grow)) for r in range(4)]
    for p in procs:
        p.start()
    while not all(ready[r] == 1 for r in range(4)):
        time.sleep(0.001)
    board[4 * len(PHASES)] = now()
    os.kill(procs[1].pid, signal.SIGKILL)
    while not all(ready[r] == 2 for r in (0, 2, 3)):
        time.sleep(0.001)
    j = ctx.Process(target=joiner, args=(args, name, board))
    j.start()
    go_grow.value = 1
    for p in procs + [j]:
        p.join(120)
    bad = [p.exitcode for p in procs + [j] if p is not procs[1] and p.exitcode != 0]
    if bad:
        raise SystemExit(f"a process failed: exit codes {bad}")
    out = {}
    for i, ph in enumerate(PHASES):
        out[ph] = max(board[r * len(PHASES) + i] for r in (0, 2, 3)) / 1e6
    out["grow"] = max(out["grow"], board[4 * len(PHASES) + 1] / 1e6)
    out["reshard"] = max(out["reshard"], board[4 * len(PHASES) + 2] / 1e6)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16384, help="ids per rank and step (4 ranks)")
    ap.add_argument("--replay", type=int, default=2, help="pushes between the checkpoint and the loss")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--replicas", type=int, default=0, help="replicas of each rank's rows (0: restore from the checkpoint)")
    args = ap.parse_args()
    ctx = mp.get_context("fork")
    runs = []
    load = []
    plain_args = argparse.Namespace(**{**vars(args), "replicas": 0})
    paired = []  # the run without replicas beside each run with them
    with tempfile.TemporaryDirectory(prefix="gradsync-emb-elastic-bench-") as tmp:
        for _ in range(args.runs):
            load.append(os.getloadavg()[0])
            runs.append(run_once(args, ctx, tmp))
            if args.replicas:
                paired.append(run_once(plain_args, ctx, tmp))
    mb = args.rows * (args.dim + 1) * 4 / 1e6
    print(f"sharded embedding recovery, 4 shm ranks, rank 1 SIGKILLed, {args.rows} x {args.dim} row-wise Adagrad "
          f"({mb:.0f} MB of rows and state), {args.batch} ids per rank a step, {args.replay} steps replayed, "
          f"replicas {args.replicas}, {args.runs} runs; load average {min(load):.1f}-{max(load):.1f} on {os.cpu_count()} CPUs")
    table(f"replicas {args.replicas}", runs)
    if paired:
        table("replicas 0, the paired runs", paired)

        def ratios(f):
            v = sorted(f(a) / f(b) for a, b in zip(runs, paired))
            return f"{v[0]:.2f} / {statistics.median(v):.2f} / {v[-1]:.2f}"

        print(f"with / without replicas, each pair, min / median / max: recovery (restore + replay) "
              f"{ratios(lambda r: r['restore'] + r['replay'])}; grow back (reshard) {ratios(lambda r: r['reshard'])}")


def table(title, runs):
    print(f"{title}\n{'phase':<16}| min ms | median ms | max ms | median / baseline")
    base = {"restore": "load_baseline", "replay": "step_baseline", "reshard": "load_baseline",
            "step_baseline": "step_plain"}
    for ph in PHASES:
        v = sorted(r[ph] for r in runs)
        ratio = ""
        if ph in base and all(r[base[ph]] > 0 for r in runs):
            ratio = f"{statistics.median(r[ph] / r[base[ph]] for r in runs):.2f}x {base[ph]}"
        print(f"{ph:<16}| {v[0]:8.1f} | {statistics.median(v):9.1f} | {v[-1]:8.1f} | {ratio}")


if __name__ == "__main__":
    main()
