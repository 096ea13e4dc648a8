#!/usr/bin/env python3
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

Every invocation also runs the same mode with 1 worker, so the throughput and accuracy of N
workers are printed beside the 1-worker baseline measured in the same run.

    scripts/demo.sh                               # builds the library, then runs this
    scripts/train_digits.py --workers 4 --epochs 20
"""
import os

# The worker threads are the parallelism; BLAS threads on top would oversubscribe the cores.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradsync as gs  # noqa: E402

DIGITS_CSV = "/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz"


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

    def __init__(self, total, label, stream=sys.stderr, width=30):
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
    steps = -(-n // (workers * args.batch))  # per epoch, the same on every worker
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
                        batch = order[step * args.batch:(step + 1) * args.batch]
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


MODES = {"hogwild": run_hogwild, "allreduce": run_allreduce}


# --------------------------------------------------------------------------- main


def report(results, stream=sys.stdout):
    base = results[0]
    print(f"\n{'mode':<10} {'workers':>7} {'samples/s':>11} {'vs 1 worker':>12} {'start loss':>11} "
          f"{'final loss':>11} {'held-out acc':>13}", file=stream)
    for r in results:
        first = r.losses[0] if r.losses else float("nan")
        final = r.losses[-1] if r.losses else float("nan")
        print(f"{r.mode:<10} {r.workers:>7} {r.throughput:>11,.0f} {r.throughput / base.throughput:>11.2f}x "
              f"{first:>11.4f} {final:>11.4f} {r.accuracy * 100:>12.2f}%", file=stream)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=sorted(MODES), default="hogwild", help="training mode (default hogwild)")
    parser.add_argument("--workers", type=int, default=4, help="worker threads (default 4)")
    parser.add_argument("--epochs", type=int, default=30, help="passes over the training set (default 30)")
    parser.add_argument("--batch", type=int, default=32, help="minibatch size per worker step (default 32)")
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate (default 0.1)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden units (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
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
    run = MODES[args.mode]
    results = [run(args, data, model, 1)]
    if args.workers != 1:
        results.append(run(args, data, model, args.workers))
    for r in results:
        shown = ", ".join(f"{x:.3f}" for x in r.losses)
        print(f"{r.mode} x{r.workers}: training loss at start and after each epoch: {shown}")
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
