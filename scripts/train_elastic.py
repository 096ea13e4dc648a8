#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Lose a rank in the middle of training and go on: the digits on 4 ranks, one killed, 3 finish.

The model is a torch MLP (64 -> 64 -> 10) on the 8x8 digits, trained with Adam through
gradsync.torch.ZeroRedundancyOptimizer (ZeRO-1: each rank keeps 1/N of Adam's state, and with
replicas=1 also its neighbour's slice) under gradsync.torch.elastic. The ranks are processes
started by `python3 -m gradsync.run -n 4 --elastic`. At --kill-step, rank --kill-rank computes its
gradient and then SIGKILLs itself instead of stepping; the others, waiting for it in the step's
reduce-scatter, see it gone, shrink the group to 3, reshard Adam's state in memory, and go on from
the last committed step with the same global batches (each split 3 ways instead of 4).

This script runs it all: first an undisturbed run on 4 ranks, then --runs runs with the kill, and
prints each recovery's phases (detect: from the kill to the survivors' error; shrink: the whole
shrink, of which agree and form are its agreement on the failed set and the forming of the new
group; reshard: Adam's slices moved and the weights gathered; sync: every survivor at the latest
commit; first step: the first training step completed on 3 ranks; total: from the kill to that
step) and the held-out accuracy beside the undisturbed run's.

    scripts/train_elastic.py                         # 1 undisturbed run, 1 with a kill
    scripts/train_elastic.py --runs 5 --kill-step 100
    python3 -m gradsync.run -n 4 --elastic scripts/train_elastic.py --rank-main --kill-step 50 --out results

Then the launcher (--replace) starts a replacement for the lost rank, and at --grow-step the
survivors grow the group back to 4 (State.grow): the replacement (gradsync.torch.elastic.join) takes the weights by broadcast and its
slice of Adam's state by reshard, and the 4 ranks finish. Without it the run ends on 3 ranks.
"""
import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

STARTED_NS = time.monotonic_ns()  # before torch and the rest are loaded: a replacement's start-up counts
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gradsync as gs  # noqa: E402
from train_digits import load_digits  # noqa: E402

# shrink: the whole call, agree and form its two phases (the rest: waiting for the other survivors
# to come to it); total: from the kill to the first step done on 3 ranks.
PHASES = [("detect", "detect_s"), ("shrink", "shrink_s"), ("agree", "agree_s"), ("form", "form_s"),
          ("reshard", "reshard_s"), ("sync", "sync_s"), ("first step", "first_step_s"), ("total", "kill_to_step_s")]


def lost_members(state):
    """How many members the recoveries so far removed (a recovery may remove none: a slow peer)."""
    return sum(len(failed) for r in state.recoveries for failed in r["failed"])


def grow_due(state, grow_step, replacing):
    """Whether to grow now: from grow_step on, when the launcher starts a replacement for each lost
    rank (replacing), once per member lost and not yet replaced."""
    return replacing and 0 <= grow_step <= state.step and len(state.grows) < lost_members(state)


def rank_main(args):
    """One rank's training, under gradsync.run; writes its result to OUT/rank.<member id>.json."""
    import torch
    import gradsync.torch as gst
    from gradsync.torch import elastic

    from gradsync.run import join_name

    torch.set_num_threads(1)
    data = load_digits(seed=args.seed)
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)

    def build(comm, joining=False):
        torch.manual_seed(args.seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, args.hidden), torch.nn.ReLU(),
                                    torch.nn.Linear(args.hidden, 10))
        return model, gst.ZeroRedundancyOptimizer(model.parameters(), comm, optimizer="adam", lr=args.lr,
                                                  replicas=1, joining=joining)

    joined = None
    if "GRADSYNC_JOIN" in os.environ:  # a replacement (gradsync.run --replace): join the running group
        state = elastic.join(os.environ["GRADSYNC_JOIN"], build, timeout_ms=args.timeout_ms)
        joined = {"start_to_joined_s": (time.monotonic_ns() - STARTED_NS) / 1e9, "at_step": state.step}
        model, opt = state.model, state.optimizer
    else:
        comm = gs.Communicator.from_env(timeout_ms=args.timeout_ms)
        model, opt = build(comm)
        state = elastic.State(comm, model, opt)
    steps_per_epoch = len(y) // args.batch
    total = args.epochs * steps_per_epoch
    victim = joined is None and state.comm.rank == args.kill_rank
    group = os.environ["GRADSYNC_GROUP"]
    replacing = os.environ.get("GRADSYNC_REPLACE") == "1"  # gradsync.run --replace: a replacement per lost rank

    @elastic.run
    def train(state):
        while state.step < total:
            if grow_due(state, args.grow_step, replacing):
                state.grow(join_name(group, len(state.grows) + 1))  # the launcher's replacement joins
            epoch, i = divmod(state.step, steps_per_epoch)
            order = np.random.default_rng(args.seed + epoch).permutation(len(y))
            rows = torch.from_numpy(order[i * args.batch:(i + 1) * args.batch][state.comm.rank::state.comm.size])
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
            if victim and state.step == args.kill_step:
                if args.stamp is not None:
                    with open(args.stamp, "w") as f:
                        f.write(str(time.monotonic_ns()))  # CLOCK_MONOTONIC: one clock for every process
                os.kill(os.getpid(), signal.SIGKILL)
            opt.step(samples=len(rows))
            state.step += 1
            state.commit()

    start = time.perf_counter()
    train(state)
    seconds = time.perf_counter() - start
    with torch.no_grad():
        acc = float((model(torch.from_numpy(data.x_test)).argmax(1) == torch.from_numpy(data.y_test)).float().mean())
    out = {"member_id": state.comm.member_id, "rank": state.comm.rank, "size": state.comm.size, "accuracy": acc,
           "seconds": seconds, "steps": state.step, "recoveries": state.recoveries, "grows": state.grows,
           "joined": joined,
           "digest": hashlib.sha256(opt._weights.numpy().tobytes()).hexdigest()}
    if state.recoveries and args.stamp is not None and os.path.exists(args.stamp):
        killed = int(open(args.stamp).read())
        r = state.recoveries[0]
        r["detect_s"] = (r["error_ns"] - killed) / 1e9
        r["kill_to_step_s"] = (r["first_step_done_ns"] - killed) / 1e9
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank.{out['member_id']}.json"), "w") as f:
        json.dump(out, f)
    state.comm.close()
    return 0


def launch(args, out, kill_step, grow_step=-1):
    """One run of 4 ranks under the launcher; returns the results of the ranks that finished."""
    os.makedirs(out, exist_ok=True)
    command = [sys.executable, "-m", "gradsync.run", "-n", str(args.ranks), "--elastic", "--no-tag-output",
               *(["--replace"] if grow_step >= 0 else []),
               os.path.abspath(__file__), "--rank-main", "--out", out, "--stamp", os.path.join(out, "killed"),
               "--kill-step", str(kill_step), "--kill-rank", str(args.kill_rank), "--grow-step", str(grow_step),
               "--epochs", str(args.epochs),
               "--batch", str(args.batch), "--lr", str(args.lr), "--hidden", str(args.hidden),
               "--seed", str(args.seed), "--timeout-ms", str(args.timeout_ms)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])))
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lost = [line for line in done.stdout.splitlines() if line.startswith("gradsync.run:")]
    if done.returncode != 0:
        raise SystemExit(f"the run failed ({done.returncode}):\n{done.stdout}")
    results = []
    for name in sorted(os.listdir(out)):
        if name.startswith("rank."):
            with open(os.path.join(out, name)) as f:
                results.append(json.load(f))
    return results, lost


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank-main", action="store_true", help="be one rank (under python3 -m gradsync.run)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--runs", type=int, default=1, help="runs with a kill (default 1)")
    ap.add_argument("--kill-rank", type=int, default=2)
    ap.add_argument("--kill-step", type=int, default=150)
    ap.add_argument("--grow-step", type=int, default=None,
                    help="the survivors grow back to 4 here, with the launcher's replacement rank (-1: never; "
                         "default 200, and with --rank-main -1; a rank grows only under gradsync.run --replace)")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch", type=int, default=96, help="global batch (96: 24 rows on each of 4 ranks, 32 on 3)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-ms", type=int, default=20000, help="the communicators' timeout (detection beats it)")
    ap.add_argument("--out", default=None,
                    help="where the results go (with --rank-main: required; default: a new temporary directory)")
    ap.add_argument("--stamp", default=None,
                    help="with --rank-main: the file the killed rank writes its kill time to (detect_s)")
    args = ap.parse_args(argv)
    if args.rank_main:
        if args.out is None:
            ap.error("--rank-main needs --out, the directory each rank writes its result to")
        if args.grow_step is None:
            args.grow_step = -1
        return rank_main(args)
    if args.grow_step is None:
        args.grow_step = 200
    work = args.out or tempfile.mkdtemp(prefix="gradsync-elastic-")
    steps = args.epochs * (1348 // args.batch)
    grow_step = args.grow_step
    print(f"libgradsync {gs.version()}: digits MLP 64-{args.hidden}-10, ZeRO-1 Adam (replicas=1) on {args.ranks} "
          f"ranks, {steps} steps of global batch {args.batch}; rank {args.kill_rank} is SIGKILLed before its step "
          f"{args.kill_step}, the others go on {args.ranks - 1}"
          + (f" and grow back to {args.ranks} at step {grow_step} with a replacement the launcher starts"
             if grow_step >= 0 else ""), flush=True)
    base, _ = launch(args, os.path.join(work, "undisturbed"), -1)
    base_acc = base[0]["accuracy"]
    print(f"undisturbed: {len(base)} ranks, held-out accuracy {base_acc * 100:.2f}%, {base[0]['seconds']:.2f} s",
          flush=True)
    per_phase = {key: [] for _, key in PHASES}
    worst = 0.0
    for run in range(args.runs):
        results, lost = launch(args, os.path.join(work, f"run{run}"), args.kill_step, grow_step)
        for line in lost:
            print(f"  {line}")
        accs = {r["accuracy"] for r in results}
        digests = {r["digest"] for r in results}
        print(f"run {run + 1}: {len(results)} ranks (member ids {[r['member_id'] for r in results]}) finished "
              f"{results[0]['steps']} steps on {results[0]['size']} ranks, held-out accuracy "
              f"{results[0]['accuracy'] * 100:.2f}% ({(results[0]['accuracy'] - base_acc) * 100:+.2f} points), "
              f"weights {'bitwise equal on every survivor' if len(digests) == 1 else 'DIFFER'}", flush=True)
        if len(accs) != 1 or len(digests) != 1:
            raise SystemExit("the survivors' weights differ")
        worst = max(worst, abs(results[0]["accuracy"] - base_acc))
        print(f"  {'member':>6} " + " ".join(f"{name:>13}" for name, _ in PHASES))
        for r in results:
            if not r["recoveries"]:
                continue  # the replacement
            rec = r["recoveries"][0]
            print(f"  {r['member_id']:>6} " + " ".join(f"{rec[key] * 1e3:>10.1f} ms" for _, key in PHASES))
            for _, key in PHASES:
                per_phase[key].append(rec[key])
        for r in results:
            if r["grows"]:
                g = r["grows"][0]
                print(f"  member {r['member_id']} grew to {g['size']} at step {grow_step}: "
                      f"grow {g['grow_s'] * 1e3:.1f} ms "
                      f"(agree {g['agree_s'] * 1e3:.1f}, form {g['form_s'] * 1e3:.1f}, the rest waiting for the "
                      f"replacement to start), state to the new rank {g['admit_s'] * 1e3:.1f} ms")
            if r["joined"]:
                print(f"  member {r['member_id']} (the replacement) joined at step {r['joined']['at_step']}, "
                      f"{r['joined']['start_to_joined_s']:.2f} s after its script started "
                      f"(numpy, torch and the data load)")
    if args.runs > 1:
        print(f"over {args.runs} runs x {args.ranks - 1} survivors: min / median / max")
        for name, key in PHASES:
            v = per_phase[key]
            print(f"  {name:>10}: {min(v) * 1e3:8.1f} / {statistics.median(v) * 1e3:8.1f} / {max(v) * 1e3:8.1f} ms")
    print(f"detection against the deadline: the communicators' timeout is {args.timeout_ms} ms")
    if worst > 0.02:
        print(f"held-out accuracy differs from the undisturbed run by {worst * 100:.2f} points", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
