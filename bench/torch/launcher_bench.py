#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A torch script as a user writes it, under each library's own launcher: gradsync.torch's
DistributedDataParallel under `python3 -m gradsync.run -n 2` against torch's DDP over gloo under
`torchrun --nproc_per_node 2`, with the user's environment and nothing added (the script sets no
thread count; each launcher does what it does by default).

    bench/torch/launcher_bench.py [--runs 5] [--steps 40] [--model digits|cifar|mlp]

Each run starts both, one after the other, and the same script without communication (each rank
trains alone, under gradsync.run: the step time no library can beat), the order turning from run
to run so that all see the same machine; each reports the median step time of its slowest rank
after warm-up. Printed: steps/s min / median / max over the runs for each, and per run the ratio
gradsync / gloo and the bound no-communication / gloo (min / median / max), measured in the same
run. Models: "mlp" (bench/torch/ddp_bench.py's 10.5 M parameters: communication weighs),
"digits" (the digits demo's CNN) and "cifar" (a 2.2 M-parameter CNN): their compute dominates.

    bench/torch/launcher_bench.py --side-by-side none,none@torchrun [--runs 5] [--steps 150]

starts two at once instead (gradsync, gloo, none, or none@torchrun: no communication under
torchrun), and takes each one's steps/s over the seconds in which all four ranks were training:
on a loaded machine, whose load changes more from one launch to the next than any launcher could,
both then see the same load. none,none@torchrun compares what the two launchers give their ranks.
"""
import argparse
import bisect
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "..", "..", "scripts")

# The user's script: a CNN, batch 32 per rank, SGD with momentum; "cifar" (2.2 M parameters on
# 3x32x32 images: the compute dominates) or "digits" (the digits demo's, 0.19 M parameters on
# 1x16x16 images: a few milliseconds of compute a step, where communication counts). Nothing in it
# concerns threads or the environment.
USER_SCRIPT = r'''
import hashlib, statistics, sys, time
import torch

backend, steps, model_name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if backend == "gloo":
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
elif backend == "none":  # no communication at all: each rank trains alone, the bound of any library
    import os
    rank = int(os.environ.get("RANK", os.environ.get("GRADSYNC_RANK", "0")))
else:
    import gradsync as gs
    import gradsync.torch as gst
    comm = gs.Communicator.from_env()
    rank, size = comm.rank, comm.size

torch.manual_seed(0)
if model_name == "mlp":  # bench/torch/ddp_bench.py's
    net = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                              torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))
    shape = (1024,)
elif model_name == "cifar":
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(64, 128, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(128 * 8 * 8, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    shape = (3, 32, 32)
else:  # the digits demo's CNN (scripts/train_torch.py)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(64 * 4 * 4, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    shape = (1, 16, 16)
if backend == "gloo":
    model = torch.nn.parallel.DistributedDataParallel(net)
elif backend == "none":
    model = net
else:
    model = gst.DistributedDataParallel(net, comm)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
g = torch.Generator().manual_seed(1 + rank)
x, y = torch.randn(32, *shape, generator=g), torch.randint(0, 10, (32,), generator=g)
times, ends = [], []
for step in range(steps + 5):
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    times.append(time.perf_counter() - t0)
    ends.append(time.time())
import json, os
if os.environ.get("STEP_LOG"):  # --side-by-side: when each step after warm-up ended
    with open(f"{os.environ['STEP_LOG']}.{rank}", "w") as f:
        json.dump(ends[5:], f)
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters())).hexdigest()[:16]
print(f"RESULT {rank} {statistics.median(times[5:])} {digest}", flush=True)
'''


# torchrun itself, with one mend: torch 1.13's Std.from_str finds no member for "0" (the default of
# --redirects and --tee) under Python 3.11, whose IntFlag iteration leaves out the zero member, and
# torchrun fails before it starts a rank. The mend changes nothing else.
TORCHRUN = """
import sys
from torch.distributed.elastic.multiprocessing import api
_from_str = api.Std.from_str.__func__
api.Std.from_str = classmethod(lambda cls, vm: cls(int(vm)) if vm in "0123" else _from_str(cls, vm))
from torch.distributed.run import main
sys.argv[0] = "torchrun"
main()
"""


def command(kind, script, steps, model):
    """gloo under torchrun; gradsync or none (no communication) under gradsync.run; none@torchrun:
    no communication under torchrun."""
    backend = kind.split("@")[0]
    if kind in ("gloo", "none@torchrun"):
        return [sys.executable, "-c", TORCHRUN, "--standalone", "--nproc_per_node", "2", script, backend, str(steps),
                model]
    return [sys.executable, "-m", "gradsync.run", "-n", "2", script, backend, str(steps), model]


def launch(kind, script, steps, model, env):
    out = subprocess.run(command(kind, script, steps, model), env=env, capture_output=True, text=True, timeout=900)
    return result(kind, out)


def result(kind, out):
    if out.returncode != 0:
        raise SystemExit(f"{kind} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    # torchrun passes the ranks' output through unsplit: two ranks' lines can run together.
    results = re.findall(r"RESULT (\d+) ([0-9.e+-]+) ([0-9a-f]{16})", out.stdout)
    if len(results) != 2:
        raise SystemExit(f"{kind}: expected 2 results, got:\n{out.stdout}\n{out.stderr}")
    return 1.0 / max(float(r[1]) for r in results), len({r[2] for r in results}) == 1


def side_by_side(kinds, script, steps, model, env, tmp):
    """Both at once: the steps/s of each over the seconds in which every rank of both was past its
    warm-up and still training, so both saw the same load (run one after the other, a loaded
    machine's load changes more between them than a launcher could)."""
    procs = []
    for i, kind in enumerate(kinds):
        log = os.path.join(tmp, f"steps.{i}")
        procs.append((kind, log, subprocess.Popen(command(kind, script, steps, model), env=dict(env, STEP_LOG=log),
                                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    ends = []
    for kind, log, p in procs:
        stdout, stderr = p.communicate(timeout=900)
        result(kind, subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
        ends.append([json.load(open(f"{log}.{r}")) for r in (0, 1)])
    lo, hi = max(e[0] for rank in ends for e in rank), min(e[-1] for rank in ends for e in rank)
    if hi - lo < 1.0:
        return None  # too little overlap to measure: --steps too few
    return [min(bisect.bisect(e, hi) - bisect.bisect(e, lo) for e in rank) / (hi - lo) for rank in ends]


def spread(xs):
    return f"{min(xs):6.2f} / {statistics.median(xs):6.2f} / {max(xs):6.2f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--model", choices=("digits", "cifar", "mlp"), default="digits")
    ap.add_argument("--side-by-side", metavar="A,B", default=None,
                    help="instead: run two of gradsync, gloo, none, none@torchrun at once, and print A / B per run")
    a = ap.parse_args()
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    # Where the package would be after pip install: the only variable the runs get.
    env["PYTHONPATH"] = os.path.abspath(SCRIPTS) + os.pathsep + env.get("PYTHONPATH", "")
    kinds = ("gradsync", "gloo", "none")
    rates = {k: [] for k in kinds}
    ratios, bounds, equal = [], [], True
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "user_train.py")
        with open(script, "w") as f:
            f.write(USER_SCRIPT)
        if a.side_by_side is not None:
            pair = a.side_by_side.split(",")
            if len(pair) != 2 or not set(pair) <= {"gradsync", "gloo", "none", "none@torchrun"}:
                ap.error("--side-by-side takes two of gradsync, gloo, none, none@torchrun")
            ratios = []
            for run in range(a.runs):
                got = side_by_side(pair if run % 2 == 0 else pair[::-1], script, a.steps, a.model, env, tmp)
                if got is None:
                    print(f"run {run + 1}: too little overlap; give more --steps", flush=True)
                    continue
                rate = dict(zip(pair if run % 2 == 0 else pair[::-1], got))
                ratios.append(rate[pair[0]] / rate[pair[1]])
                print(f"run {run + 1}: {pair[0]} {rate[pair[0]]:.2f} steps/s, {pair[1]} {rate[pair[1]]:.2f} at once; "
                      f"ratio {ratios[-1]:.2f}", flush=True)
            if ratios:
                print(f"{pair[0]} / {pair[1]}, side by side, per run    {spread(ratios)}  ({len(ratios)} runs)")
            return
        for run in range(a.runs):
            got = {}
            for kind in kinds[run % 3:] + kinds[:run % 3]:  # each goes first in turn
                got[kind], same = launch(kind, script, a.steps, a.model, env)
                equal = equal and (same or kind == "none")
                rates[kind].append(got[kind])
            ratios.append(got["gradsync"] / got["gloo"])
            bounds.append(got["none"] / got["gloo"])
            print(f"run {run + 1}: gradsync {got['gradsync']:.2f} steps/s, gloo {got['gloo']:.2f}, no communication "
                  f"{got['none']:.2f}; ratio {ratios[-1]:.2f} (bound {bounds[-1]:.2f})", flush=True)
    print(f"2 ranks, the {a.model} model, batch 32 per rank, SGD momentum, {a.steps} steps after 5 warm-up; "
          f"min / median / max of {a.runs} runs")
    print(f"gradsync.torch under gradsync.run      {spread(rates['gradsync'])} steps/s")
    print(f"torch DDP (gloo) under torchrun        {spread(rates['gloo'])} steps/s")
    print(f"no communication, under gradsync.run   {spread(rates['none'])} steps/s")
    print(f"gradsync / gloo, per run               {spread(ratios)}")
    print(f"no communication / gloo, per run       {spread(bounds)}  (what any library could reach)")
    print(f"weights equal on both ranks: {equal}")

if __name__ == "__main__":
    main()
