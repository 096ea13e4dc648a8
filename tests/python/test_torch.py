# SPDX-License-Identifier: Apache-2.0
"""gradsync.torch.DistributedDataParallel: gradients averaged over ranks during backward, weights
bit for bit equal on every rank after every step, equal to one process on the whole batch (to
float rounding: the mean of two half-batch gradients is not summed in the same order), no_sync,
zero_grad(set_to_none=True), unused parameters; over threads and shared-memory processes."""
import hashlib

import numpy as np
import pytest
import torch

import gradsync.torch as gst
from conftest import run_ranks
from test_mpi import HAVE_MPI, lines_of
from test_mpi import run_ranks as run_mpi_ranks
from test_shm import _group, _run

torch.set_num_threads(1)


def seeded(module, seed):
    """Weights from a generator of the module's own: ranks are threads, and torch's global
    generator is shared by them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return module


class Net(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        self.a = torch.nn.Linear(20, 64)
        self.b = torch.nn.Linear(64, 64)
        self.c = torch.nn.Linear(64, 3)
        self.unused = torch.nn.Linear(3, 3)
        self.norm = torch.nn.BatchNorm1d(64)
        seeded(self, seed)  # each rank starts elsewhere: the wrapper broadcasts rank 0's

    def forward(self, x):
        return self.c(torch.relu(self.b(self.norm(torch.relu(self.a(x))))))


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(32, 20, generator=g), torch.randint(0, 3, (32,), generator=g)


def digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def train(comm, rank, size, steps=6, accumulate=False, bucket_cap_mb=0.01):
    model = gst.DistributedDataParallel(Net(seed=rank), comm, bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    digests = []
    for step in range(steps):
        x, y = data(step)
        xs, ys = x[rank::size], y[rank::size]
        opt.zero_grad(set_to_none=True)
        if accumulate:  # two micro-batches, the first without communication
            with model.no_sync():
                torch.nn.functional.cross_entropy(model(xs[:8]), ys[:8]).backward()
            torch.nn.functional.cross_entropy(model(xs[8:]), ys[8:]).backward()
        else:
            torch.nn.functional.cross_entropy(model(xs), ys).backward()
        opt.step()
        digests.append(digest(model.module))
    return digests, [p.detach().clone() for p in model.module.parameters()]


def reference(steps=6):
    """One process, the whole batch, the same start (rank 0's) and the same optimizer."""
    model = Net(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = data(step)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("size", [1, 2, 3])
def test_threads_every_rank_the_same_weights_and_the_whole_batch_result(size):
    results = run_ranks(size, lambda comm, rank: train(comm, rank, size))
    for digests, _ in results[1:]:
        assert digests == results[0][0]  # bitwise, every step
    assert len(set(results[0][0])) == 6  # the weights moved every step


def test_same_as_one_process_on_the_whole_batch():
    class Plain(torch.nn.Module):  # no BatchNorm: per-rank batches then give the whole-batch gradient
        def __init__(self, seed):
            super().__init__()
            self.a = torch.nn.Linear(20, 64)
            self.c = torch.nn.Linear(64, 3)
            seeded(self, seed)

        def forward(self, x):
            return self.c(torch.relu(self.a(x)))

    def run(comm, rank):
        model = gst.DistributedDataParallel(Plain(rank), comm, bucket_cap_mb=0.001)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(5):
            x, y = data(step)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[rank::2]), y[rank::2]).backward()
            opt.step()
        return [p.detach().clone() for p in model.module.parameters()]

    got = run_ranks(2, run)
    ref = Plain(0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(5):
        x, y = data(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    for a, b, r in zip(got[0], got[1], ref.parameters()):
        assert torch.equal(a, b)
        assert torch.allclose(a, r.detach(), rtol=1e-5, atol=1e-6)


def test_no_sync_accumulates_and_the_next_backward_averages():
    results = run_ranks(2, lambda comm, rank: train(comm, rank, 2, accumulate=True))
    assert results[0][0] == results[1][0]


def test_buckets_of_any_size():
    small = run_ranks(2, lambda comm, rank: train(comm, rank, 2, bucket_cap_mb=0.0001))
    large = run_ranks(2, lambda comm, rank: train(comm, rank, 2, bucket_cap_mb=100))
    assert small[0][0] == small[1][0] and large[0][0] == large[1][0]
    # Bucketing changes only which elements travel together, never a result.
    assert small[0][0] == large[0][0]


def _shm_rank(rank, size, queue, group):
    import gradsync as gs
    torch.set_num_threads(1)
    with gs.Communicator(group, rank, size, timeout_ms=30000, transport="shm") as comm:
        queue.put((rank, train(comm, rank, size)[0]))


def test_shm_processes():
    results, codes = _run(_shm_rank, 2, _group("torch"))
    assert codes == [0, 0]
    assert results[0] == results[1] and len(set(results[0])) == 6


@pytest.mark.skipif(not HAVE_MPI, reason="libgradsync built without MPI")
def test_mpi(tmp_path):
    import inspect
    source = "\n".join(inspect.getsource(f) for f in (seeded, Net, data, digest, train))
    lines = run_mpi_ranks(tmp_path, """
import torch
import gradsync.torch as gst
torch.set_num_threads(1)
""" + source + """
with gs.Communicator(transport="mpi", timeout_ms=30000) as c:
    say(f"torch {c.rank} {train(c, c.rank, c.size)[0]}")
""", 2)
    got = lines_of(lines, "torch")
    assert len(got) == 2 and got[0].split(" ", 2)[2] == got[1].split(" ", 2)[2]
