#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Train a handwritten-digits classifier through libgradsync: the library's main demo.

The data set is the 8x8 digits that Debian's python3-sklearn ships (1797 images, 10 classes).
The model is a small multi-layer perceptron (64 -> hidden -> 10, ReLU, softmax) written in numpy,
whose parameters live in ONE flat float32 vector, so that every mode moves gradients as flat
buffers through the library.

Modes (one function each, sharing the data loader, the model, the progress bar and the
evaluation helpers below):
  hogwild   N Python threads update shared weights without locks through gradsync.atomic_add
            (each element's add is atomic, no update is lost; ctypes releases the GIL, so the
            adds run in parallel). Progress via a gradsync.Counter, early stop via a gradsync.Flag.
  allreduce N Python threads, one weight replica each, compute gradients on their own shard and
            average them with gradsync.Communicator.weighted_mean (by sample count); the replicas
            take identical steps and stay bitwise identical.
  sharded   (default) N workers train through gradsync.ShardedParameter with Adam (ZeRO-1, BigDL's
            AllReduceParameter): each worker owns 1/N of the weights and of Adam's state; per step
            the gradients are reduce-scattered (optionally compressed to bf16 or IEEE half on the
            wire), each owner updates its slice, and every worker gathers the new weights.
            --transport threads (threads of this process), shm (the demo starts N worker
            processes on this host), or mpi (run under mpirun: each process is one worker). It
            compares 1 worker with N workers for each --compress choice on the same global batches
            and writes the loss curves to loss_curves.png in the output directory (--out).

Every invocation also runs the same mode with 1 worker, so the throughput and accuracy of N
workers are printed beside the 1-worker baseline measured in the same run.

Outputs go to --out DIR (default build/demo-output in the checkout, or a temporary directory when
that is not writable), never into the source tree: docs/loss_curves.png is the README's figure,
a copy of one run's plot, and this demo leaves it alone.

    scripts/demo.sh                               # builds the library, then runs this
    scripts/train_digits.py --workers 4 --epochs 20 --out /tmp/digits
    scripts/train_digits.py --mode sharded --transport shm --compress bf16
    mpirun -np 2 /usr/bin/python3 scripts/train_digits.py --transport mpi
"""
import os

# The worker threads are the parallelism; BLAS threads on top would oversubscribe the cores.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradsync as gs  # noqa: E402

DIGITS_CSV = "/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_out_dir():
    """build/demo-output in the checkout if it can be written, else a directory under the temp dir."""
    candidate = os.path.join(ROOT, "build", "demo-output")
    try:
        os.makedirs(candidate, exist_ok=True)
        if os.access(candidate, os.W_OK):
            return candidate
    except OSError:
        pass
    return os.path.join(tempfile.gettempdir(), "gradsync-demo-output")


# --------------------------------------------------------------------------- data


@dataclass
class Dataset:
    x_train: np.ndarray  # float32 [n, 64], pixels scaled to [0, 1]
    y_train: np.ndarray  # int64 [n]
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def features(self):
        return self.x_train.shape[1]

    @property
    def classes(self):
        return int(max(self.y_train.max(), self.y_test.max())) + 1


def load_digits(test_fraction=0.25, seed=0):
    """The digits data set, shuffled with `seed` and split into train and held-out test parts."""
    if os.path.exists(DIGITS_CSV):
        raw = np.loadtxt(DIGITS_CSV, delimiter=",", dtype=np.float32)
        x, y = raw[:, :-1], raw[:, -1].astype(np.int64)
    else:  # another layout of sklearn: its own loader knows where the file is
        from sklearn.datasets import load_digits as sklearn_load_digits

        bunch = sklearn_load_digits()
        x, y = bunch.data.astype(np.float32), bunch.target.astype(np.int64)
    x /= 16.0
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return Dataset(np.ascontiguousarray(x[train]), y[train], np.ascontiguousarray(x[test]), y[test])


# --------------------------------------------------------------------------- model


class MLP:
    """64 -> hidden (ReLU) -> classes (softmax) over one flat float32 parameter vector."""

    def __init__(self, features, hidden, classes):
        self.shapes = [("w1", (features, hidden)), ("b1", (hidden,)), ("w2", (hidden, classes)), ("b2", (classes,))]
        self.size = sum(int(np.prod(shape)) for _, shape in self.shapes)

    def unpack(self, flat):
        """Views (no copies) of the layers inside a flat vector."""
        views, offset = {}, 0
        for name, shape in self.shapes:
            n = int(np.prod(shape))
            views[name] = flat[offset:offset + n].reshape(shape)
            offset += n
        return views

    def init(self, seed=0):
        params = np.zeros(self.size, dtype=np.float32)
        p = self.unpack(params)
        rng = np.random.default_rng(seed)
        for name in ("w1", "w2"):
            fan_in = p[name].shape[0]
            p[name][...] = rng.standard_normal(p[name].shape) * np.sqrt(2.0 / fan_in)
        return params

    def _forward(self, p, x):
        hidden = np.maximum(x @ p["w1"] + p["b1"], 0.0)
        logits = hidden @ p["w2"] + p["b2"]
        logits -= logits.max(axis=1, keepdims=True)
        probs = np.exp(logits)
        probs /= probs.sum(axis=1, keepdims=True)
        return hidden, probs

    def loss_and_grad(self, params, x, y):
        """Mean cross-entropy over the batch and its gradient as a new flat float32 vector."""
        p = self.unpack(params)
        hidden, probs = self._forward(p, x)
        n = len(y)
        loss = float(-np.log(probs[np.arange(n), y] + 1e-12).mean())
        grad = np.empty(self.size, dtype=np.float32)
        g = self.unpack(grad)
        d_logits = probs
        d_logits[np.arange(n), y] -= 1.0
        d_logits /= n
        g["w2"][...] = hidden.T @ d_logits
        g["b2"][...] = d_logits.sum(axis=0)
        d_hidden = (d_logits @ p["w2"].T) * (hidden > 0)
        g["w1"][...] = x.T @ d_hidden
        g["b1"][...] = d_hidden.sum(axis=0)
        return loss, grad

    def loss(self, params, x, y):
        _, probs = self._forward(self.unpack(params), x)
        return float(-np.log(probs[np.arange(len(y)), y] + 1e-12).mean())

    def accuracy(self, params, x, y):
        _, probs = self._forward(self.unpack(params), x)
        return float((probs.argmax(axis=1) == y).mean())


# --------------------------------------------------------------------------- progress and evaluation


class ProgressBar:
    """One line on stderr, redrawn in place on a terminal; every 10% otherwise (logs stay short)."""

    def __init__(self, total, label, stream=None, width=30):
        # sys.stderr looked up now, not at import: a host (pytest) may have replaced it since.
        stream = sys.stderr if stream is None else stream
        self.total, self.label, self.stream, self.width = max(total, 1), label, stream, width
        self.tty = stream.isatty()
        self.start = time.perf_counter()
        self._last_decile = -1

    def update(self, done, **fields):
        fraction = min(done / self.total, 1.0)
        decile = int(fraction * 10)
        if not self.tty and decile == self._last_decile:
            return
        self._last_decile = decile
        filled = int(fraction * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        rate = done / max(time.perf_counter() - self.start, 1e-9)
        extra = "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())
        line = f"{self.label:<16} [{bar}] {fraction * 100:5.1f}%  {rate:9,.0f} samples/s  {extra}"
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        self.stream.flush()

    def close(self):
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


@dataclass
class RunResult:
    mode: str
    workers: int
    seconds: float
    samples: int
    losses: list = field(default_factory=list)  # full training loss at the start, then after each epoch
    accuracy: float = 0.0

    @property
    def throughput(self):
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def watch(progress, counter, total, threads, on_epoch, epoch_size, stop, poll=0.05):
    """Poll the shared sample counter until the workers finish: redraw the bar, and call
    on_epoch(epoch) each time the workers together have consumed another epoch of samples."""
    epoch = 0
    while True:
        alive = any(t.is_alive() for t in threads)
        done = counter.load()
        while done >= (epoch + 1) * epoch_size and epoch < total // epoch_size:
            epoch += 1
            on_epoch(epoch)
        progress.update(min(done, total), epoch=f"{epoch}/{total // epoch_size}")
        if not alive or stop.check():
            break
        time.sleep(poll)
    for t in threads:
        t.join()
    progress.close()


# --------------------------------------------------------------------------- modes


def run_hogwild(args, data, model, workers):
    """Hogwild SGD: `workers` threads, each on its round-robin share of the training samples,
    read the shared weights without locks and add their scaled gradients into them with
    gradsync.atomic_add (no update is lost)."""
    params = model.init(args.seed)
    samples_done = gs.Counter(0)
    stop = gs.Flag()  # raised by a worker that fails (or diverges), seen by all the others
    errors = []
    n = len(data.y_train)
    total = n * args.epochs
    result = RunResult("hogwild", workers, 0.0, 0, [model.loss(params, data.x_train, data.y_train)])

    def worker(k):
        try:
            share = gs.split_round_robin(n, workers, k).astype(np.int64)
            rng = np.random.default_rng(args.seed * 1000 + k)
            for _ in range(args.epochs):
                order = rng.permutation(share)
                for begin in range(0, len(order), args.batch):
                    if stop.check():
                        return
                    batch = order[begin:begin + args.batch]
                    loss, grad = model.loss_and_grad(params, data.x_train[batch], data.y_train[batch])
                    if stop.conditional_set(not np.isfinite(loss)):
                        errors.append(f"worker {k}: loss is {loss}")
                        return
                    grad *= -args.lr
                    gs.atomic_add(params, grad)
                    samples_done.fetch_add(len(batch))
        except Exception as exc:  # reported by the main thread; the flag stops the others
            errors.append(f"worker {k}: {exc!r}")
            stop.conditional_set(True)

    def on_epoch(epoch):
        result.losses.append(model.loss(params, data.x_train, data.y_train))

    progress = ProgressBar(total, f"hogwild x{workers}")
    threads = [threading.Thread(target=worker, args=(k,), name=f"hogwild-{k}") for k in range(workers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    watch(progress, samples_done, total, threads, on_epoch, n, stop)
    result.seconds = time.perf_counter() - start
    if errors:
        raise RuntimeError("; ".join(errors))
    result.samples = samples_done.load()
    result.accuracy = model.accuracy(params, data.x_test, data.y_test)
    return result


def run_allreduce(args, data, model, workers):
    """Data-parallel SGD: each of `workers` threads holds a replica of the weights and computes the
    gradient of its own minibatches, drawn from its shard of the training set (the library's
    round-robin split). Communicator.weighted_mean averages the gradients weighted by the samples
    each worker used (uneven shards count right) and every replica takes the same step; the
    reduction runs in rank order, so the replicas stay bitwise identical."""
    n = len(data.y_train)
    # The global minibatch is --batch, split over the workers, so each step is the 1-worker step
    # (same lr, same number of steps per epoch) computed in parallel: equal accuracy by design.
    local_batch = -(-args.batch // workers)
    steps = -(-n // (workers * local_batch))  # per epoch, the same on every worker
    replicas = [model.init(args.seed) for _ in range(workers)]
    samples_done = gs.Counter(0)
    stop = gs.Flag()
    errors = []
    comms = [None] * workers
    group = f"digits-allreduce-{os.getpid()}-{workers}-{time.monotonic_ns()}"
    result = RunResult("allreduce", workers, 0.0, 0, [model.loss(replicas[0], data.x_train, data.y_train)])

    def worker(k):
        try:
            with gs.Communicator(group, k, workers, timeout_ms=60000) as comm:
                comms[k] = comm
                params = replicas[k]
                share = gs.split_round_robin(n, workers, k).astype(np.int64)
                rng = np.random.default_rng(args.seed * 1000 + k)
                grad = np.zeros(model.size, dtype=np.float32)
                for _ in range(args.epochs):
                    order = rng.permutation(share)
                    for step in range(steps):
                        batch = order[step * local_batch:(step + 1) * local_batch]
                        if len(batch):
                            loss, grad = model.loss_and_grad(params, data.x_train[batch], data.y_train[batch])
                            if stop.conditional_set(not np.isfinite(loss)):
                                errors.append(f"worker {k}: loss is {loss}")
                                comm.abort()
                                return
                        else:  # this shard is used up this epoch: weight 0, the others carry the step
                            grad[:] = 0.0
                        comm.weighted_mean(grad, len(batch))
                        grad *= -args.lr
                        params += grad
                        samples_done.fetch_add(len(batch))
                comm.barrier()
        except gs.GradsyncError as exc:
            if not stop.check():  # an abort raised by a failing peer is that peer's error, not ours
                errors.append(f"worker {k}: {exc}")
            stop.conditional_set(True)
        except Exception as exc:
            errors.append(f"worker {k}: {exc!r}")
            stop.conditional_set(True)
            if comms[k] is not None:
                comms[k].abort()

    def on_epoch(epoch):
        result.losses.append(model.loss(replicas[0], data.x_train, data.y_train))

    progress = ProgressBar(n * args.epochs, f"allreduce x{workers}")
    threads = [threading.Thread(target=worker, args=(k,), name=f"allreduce-{k}") for k in range(workers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    watch(progress, samples_done, n * args.epochs, threads, on_epoch, n, stop)
    result.seconds = time.perf_counter() - start
    if errors:
        raise RuntimeError("; ".join(errors))
    if any(not np.array_equal(r, replicas[0]) for r in replicas):
        raise RuntimeError("replicas diverged: the allreduce is not bitwise identical on every rank")
    result.samples = samples_done.load()
    result.accuracy = model.accuracy(replicas[0], data.x_test, data.y_test)
    return result


def sharded_worker(comm, args, data, model, codec, global_batch, progress=None):
    """One worker of a sharded run on `comm`. Every worker walks the same shuffled global batches
    and takes its round-robin share of each (the library's split), so the union of the shares is
    the global batch and the sample-weighted mean gradient equals the 1-worker gradient."""
    rank, size = comm.rank, comm.size
    n = len(data.y_train)
    steps = n // global_batch  # full global batches only: every worker takes the same steps
    weights = model.init(args.seed)
    out = {"steps": [], "epochs": [model.loss(weights, data.x_train, data.y_train)] if rank == 0 else []}
    start = time.perf_counter()
    with gs.ShardedParameter(comm, model.size, optimizer="adam", lr=args.lr, compress=codec,
                             error_feedback=codec != "none") as param:
        param.init(weights)
        for epoch in range(args.epochs):
            order = np.random.default_rng(args.seed * 1000 + epoch).permutation(n)
            for step in range(steps):
                share = order[step * global_batch:(step + 1) * global_batch][rank::size]
                loss, grad = model.loss_and_grad(weights, data.x_train[share], data.y_train[share])
                if not np.isfinite(loss):
                    raise RuntimeError(f"worker {rank}: loss is {loss}")
                param.step(grad, weights, samples=len(share))
                out["steps"].append((loss, len(share)))
                if progress is not None:
                    progress.update((epoch * steps + step + 1) * global_batch, epoch=f"{epoch + 1}/{args.epochs}",
                                    loss=loss)
            if rank == 0:
                out["epochs"].append(model.loss(weights, data.x_train, data.y_train))
        out["optimizer_bytes"] = param.memory["optimizer"]
    out["seconds"] = time.perf_counter() - start
    out["weights"] = weights
    if progress is not None:
        progress.close()
    return out


def _sharded_threads(args, data, model, codec, workers, global_batch, label):
    group = f"digits-sharded-{os.getpid()}-{workers}-{codec}-{time.monotonic_ns()}"
    outs, errors = [None] * workers, []
    total = args.epochs * (len(data.y_train) // global_batch) * global_batch
    comms = [None] * workers

    def worker(k):
        try:
            with gs.Communicator(group, k, workers, timeout_ms=60000) as comm:
                comms[k] = comm
                progress = ProgressBar(total, label) if k == 0 else None
                outs[k] = sharded_worker(comm, args, data, model, codec, global_batch, progress)
        except Exception as exc:  # every rank of the group fails together; keep the first cause
            errors.append(f"worker {k}: {exc}")

    threads = [threading.Thread(target=worker, args=(k,), name=f"sharded-{k}") for k in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    return outs


def _sharded_process(rank, workers, group, args, data, model, codec, global_batch, label, queue):
    try:
        with gs.Communicator(group, rank, workers, timeout_ms=60000, transport="shm") as comm:
            total = args.epochs * (len(data.y_train) // global_batch) * global_batch
            progress = ProgressBar(total, label) if rank == 0 else None
            queue.put((rank, sharded_worker(comm, args, data, model, codec, global_batch, progress), None))
    except BaseException as exc:
        queue.put((rank, None, f"{type(exc).__name__}: {exc}"))


def run_worker_processes(target, workers, group, *extra):
    """target(rank, workers, group, *extra, queue) in `workers` spawned processes (no library
    state crosses a fork), each putting (rank, result, error or None) on the queue; returns the
    results by rank, or raises naming the workers that failed or died."""
    import multiprocessing as mp
    import queue as queue_module

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, workers, group, *extra, results)) for r in range(workers)]
    for p in procs:
        p.start()
    outs, errors = [None] * workers, []
    try:
        pending = workers
        while pending:
            try:
                rank, out, error = results.get(timeout=1.0)
            except queue_module.Empty:
                # A worker that died without a word (killed, crashed) must not leave us waiting.
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and outs[r] is None]
                if dead:
                    raise RuntimeError(f"worker process(es) {dead} died, exit codes "
                                       f"{[procs[r].exitcode for r in dead]}") from None
                continue
            pending -= 1
            outs[rank] = out
            if error:
                errors.append(f"worker {rank}: {error}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("; ".join(errors))
    return outs


def _sharded_shm(args, data, model, codec, workers, global_batch, label):
    """The same run on `workers` processes that this demo starts, meeting in a shared-memory group."""
    group = f"digits-{os.getpid()}-{codec}-{time.monotonic_ns() % 10**9}"
    return run_worker_processes(_sharded_process, workers, group, args, data, model, codec, global_batch, label)


def _sharded_mpi(args, data, model, codec, global_batch, label):
    """This process's part of the run under mpirun. Rank 0 gets every rank's step losses (summed
    over the group) and checks that every rank holds the same weights (max == min over the group)."""
    with gs.Communicator(f"digits-{codec}", 0, 1, transport="mpi", timeout_ms=60000) as comm:
        total = args.epochs * (len(data.y_train) // global_batch) * global_batch
        out = sharded_worker(comm, args, data, model, codec, global_batch,
                             ProgressBar(total, label) if comm.rank == 0 else None)
        weighted = np.array([[loss * n, n] for loss, n in out["steps"]], dtype=np.float64).ravel()
        comm.allreduce(weighted, op="sum")
        high, low = out["weights"].copy(), out["weights"].copy()
        comm.allreduce(high, op="max")
        comm.allreduce(low, op="min")
        seconds = np.array([out["seconds"]])
        comm.allreduce(seconds, op="max")
        rank = comm.rank
    if rank != 0:
        return None
    merged = dict(out, steps=[(s / n, int(n)) for s, n in zip(weighted[0::2], weighted[1::2])],
                  seconds=float(seconds[0]))
    # Ranks other than 0 contribute only their weights to the identity check.
    return [merged, dict(merged, weights=high), dict(merged, weights=low)]


def run_sharded(args, data, model, workers, codec="none", global_batch=None, transport="threads"):
    """Adam through gradsync.ShardedParameter on `workers` workers; returns a RunResult (on MPI
    ranks other than 0: None)."""
    global_batch = global_batch or args.batch * workers
    label = f"sharded x{workers} {codec}"
    if transport == "mpi":
        outs = _sharded_mpi(args, data, model, codec, global_batch, label)
        if outs is None:
            return None
    elif transport == "shm" and workers > 1:
        outs = _sharded_shm(args, data, model, codec, workers, global_batch, label)
    else:
        outs = _sharded_threads(args, data, model, codec, workers, global_batch, label)
    if any(not np.array_equal(o["weights"], outs[0]["weights"]) for o in outs):
        raise RuntimeError("replicas differ: the sharded parameter did not give every worker the same weights")
    steps = len(outs[0]["steps"])
    step_losses = np.array([sum(o["steps"][s][0] * o["steps"][s][1] for o in outs) /
                            sum(o["steps"][s][1] for o in outs) for s in range(steps)])
    samples = steps * global_batch
    result = RunResult("sharded" if codec == "none" else f"shard:{codec}", workers,
                       max(o["seconds"] for o in outs), samples, outs[0]["epochs"])
    result.accuracy = model.accuracy(outs[0]["weights"], data.x_test, data.y_test)
    result.step_losses = step_losses
    result.optimizer_bytes = outs[0]["optimizer_bytes"]
    return result


def plot_loss_curves(results, path):
    """Left: the training loss per step (moving average). Right: each run's distance from the
    1-worker run, which shows what compression changes (uncompressed sharding: rounding only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = 10
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 3.6), dpi=80)
    styles = ["-", "--", "-.", ":"]
    reference = results[0].step_losses
    for i, r in enumerate(results):
        label = f"{r.workers} worker{'s' if r.workers > 1 else ''}, {r.mode}"
        smooth = np.convolve(r.step_losses, np.ones(window) / window, mode="valid")
        left.plot(np.arange(len(smooth)) + window, smooth, styles[i % 4], color=f"C{i}", label=label, linewidth=1.3)
        if i > 0:
            gap = np.convolve(np.abs(r.step_losses - reference), np.ones(window) / window, mode="same") + 1e-9
            right.plot(np.arange(len(gap)), gap, styles[i % 4], color=f"C{i}", label=label, linewidth=1.1)
    left.set(yscale="log", xlabel="step (one global batch)", ylabel="training loss (moving average)")
    left.set_title("digits MLP, Adam through gradsync.ShardedParameter", fontsize=10)
    right.set(yscale="log", xlabel="step", ylabel="|loss - loss of 1 worker|")
    right.set_title("distance from the 1-worker run", fontsize=10)
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main_sharded(args, data, model):
    """1 worker, then N workers for each compression choice, on the same global batches."""
    codecs = ["none", "bf16", "fp16"] if args.compress == "all" else [args.compress]
    if args.transport == "mpi":
        # Under mpirun every process is one worker; rank 0 also runs the 1-worker reference alone.
        rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
        workers = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1")))
        if not gs.has_feature(gs.FEATURE_MPI_TRANSPORT):
            raise SystemExit("this libgradsync was built without the MPI transport")
    else:
        rank, workers = 0, args.workers
    global_batch = args.batch * workers
    if rank == 0:
        print(f"sharded parameter over {args.transport}: {workers} workers each own 1/{workers} of the weights and "
              f"of Adam's state (lr {args.lr}); global batch {global_batch} = {workers} x {args.batch}, split "
              f"round-robin; the 1-worker run takes the same global batches")
    results = []
    if rank == 0:
        results.append(run_sharded(args, data, model, 1, "none", global_batch, "threads"))
    for codec in codecs:
        r = run_sharded(args, data, model, workers, codec, global_batch, args.transport)
        if r is not None:
            results.append(r)
    if rank != 0:
        return 0
    report(results, not_speed=speed_is_the_point(model, workers))
    base = results[0]
    print(f"\n{'run':<22} {'held-out acc':>13} {'vs 1 worker':>12} {'Adam state per worker':>22}")
    for r in results:
        print(f"{r.workers} x {r.mode:<18} {r.accuracy * 100:>12.2f}% {(r.accuracy - base.accuracy) * 100:>+11.2f}% "
              f"{r.optimizer_bytes:>16,d} bytes")
    print("every worker ended with bitwise identical weights in every run")
    if args.plot != "":
        path = args.plot or os.path.join(args.out or default_out_dir(), "loss_curves.png")
        plot_loss_curves(results, path)
        print(f"loss curves: {path}")
    # Within noise: the held-out set has ~450 samples; allow 2 percentage points.
    worst = max(abs(r.accuracy - base.accuracy) for r in results)
    if worst > 0.02:
        print(f"held-out accuracy differs from 1 worker by {worst * 100:.2f} points", file=sys.stderr)
        return 1
    return 0


MODES = {"hogwild": run_hogwild, "allreduce": run_allreduce, "sharded": run_sharded}


# --------------------------------------------------------------------------- main


def speed_is_the_point(model, workers):
    """Why a run's speed-up means nothing, or None: more workers than cores share the cores, and a
    model this small steps in microseconds, so synchronisation, not arithmetic, sets the pace."""
    cores = len(os.sched_getaffinity(0))
    if workers > cores:
        return f"{workers} workers on {cores} cores"
    if model.size < 1_000_000:
        return f"a {model.size:,}-parameter model, whose step takes microseconds"
    return None


def report(results, stream=None, not_speed=None):
    """The results table. With not_speed (why speed is not what this run shows), the speed-up column
    is left out and a line says that the run shows correctness: bitwise equality, not speed."""
    stream = sys.stdout if stream is None else stream  # looked up now: a host may have replaced it
    base = results[0]
    ratio_head = "" if not_speed else f" {'vs 1 worker':>12}"
    print(f"\n{'mode':<10} {'workers':>7} {'samples/s':>11}{ratio_head} {'start loss':>11} "
          f"{'final loss':>11} {'held-out acc':>13}", file=stream)
    for r in results:
        first = r.losses[0] if r.losses else float("nan")
        final = r.losses[-1] if r.losses else float("nan")
        ratio = "" if not_speed else f" {r.throughput / base.throughput:>11.2f}x"
        print(f"{r.mode:<10} {r.workers:>7} {r.throughput:>11,.0f}{ratio} "
              f"{first:>11.4f} {final:>11.4f} {r.accuracy * 100:>12.2f}%", file=stream)
    if not_speed:
        print(f"{not_speed}: this run shows that N workers learn what 1 worker learns, not speed "
              f"(the torch part shows speed, with as many workers as cores and a model that needs them)", file=stream)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=sorted(MODES), default="sharded", help="training mode (default sharded)")
    parser.add_argument("--workers", type=int, default=4, help="worker threads (default 4)")
    parser.add_argument("--epochs", type=int, default=30, help="passes over the training set (default 30)")
    parser.add_argument("--batch", type=int, default=32, help="minibatch size per worker step (default 32)")
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate (default 0.1 for hogwild and allreduce's SGD, 0.01 for sharded's Adam)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden units (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transport", choices=("threads", "shm", "mpi"), default="threads",
                        help="sharded mode: threads of this process (default), shm (worker processes this demo "
                             "starts), mpi (under mpirun, one worker per process)")
    parser.add_argument("--compress", choices=("none", "bf16", "fp16", "all"), default="all",
                        help="sharded mode: gradient compression on the wire; all (default) compares the three")
    parser.add_argument("--out", default=None,
                        help="output directory (default build/demo-output in the checkout, or a temporary "
                             "directory if that is not writable)")
    parser.add_argument("--plot", default=None,
                        help="sharded mode: PNG of the loss curves (default OUT/loss_curves.png; '' for none)")
    args = parser.parse_args(argv)
    if args.lr is None:
        args.lr = 0.01 if args.mode == "sharded" else 0.1
    for name in ("workers", "epochs", "batch", "hidden"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    data = load_digits(seed=args.seed)
    model = MLP(data.features, args.hidden, data.classes)
    print(f"libgradsync {gs.version()}: digits {len(data.y_train)} train / {len(data.y_test)} held-out, "
          f"MLP {data.features}-{args.hidden}-{data.classes} ({model.size} parameters), mode {args.mode}, "
          f"{args.epochs} epochs, batch {args.batch}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    if args.mode == "sharded":
        return main_sharded(args, data, model)
    run = MODES[args.mode]
    results = [run(args, data, model, 1)]
    if args.workers != 1:
        results.append(run(args, data, model, args.workers))
    for r in results:
        shown = ", ".join(f"{x:.3f}" for x in r.losses)
        print(f"{r.mode} x{r.workers}: training loss at start and after each epoch: {shown}")
    report(results, not_speed=speed_is_the_point(model, args.workers) if args.workers != 1 else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
