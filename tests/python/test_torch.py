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


class Plain(torch.nn.Module):  # no BatchNorm: per-rank batches then give the whole-batch gradient
    def __init__(self, seed):
        super().__init__()
        self.a = torch.nn.Linear(20, 64)
        self.c = torch.nn.Linear(64, 3)
        seeded(self, seed)

    def forward(self, x):
        return self.c(torch.relu(self.a(x)))


def test_same_as_one_process_on_the_whole_batch():
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


def _counting(comm):
    """Counts the wrapper's calls on comm: non-blocking all-reduces, and blocking ones."""
    calls = {"iallreduce": 0, "allreduce": 0}
    iallreduce, allreduce = comm.iallreduce, comm.allreduce

    def counted_i(*args, **kwargs):
        calls["iallreduce"] += 1
        return iallreduce(*args, **kwargs)

    def counted(*args, _nonblocking=False, **kwargs):
        calls["allreduce"] += not _nonblocking  # iallreduce() is allreduce(_nonblocking=True)
        return allreduce(*args, _nonblocking=_nonblocking, **kwargs)

    comm.iallreduce, comm.allreduce = counted_i, counted
    return calls


def reference_plain(steps):
    ref = Plain(0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(steps):
        x, y = data(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    return [p.detach() for p in ref.parameters()]


@pytest.mark.parametrize("bucket_cap_mb, buckets", [(100, 1), (1e-4, 4)])
def test_every_bucket_but_the_last_starts_non_blocking_and_the_last_runs_at_the_end(bucket_cap_mb, buckets):
    """The last bucket is ready only when backward has nothing left to overlap it with: it runs
    as one blocking call at the end of backward, on the caller's thread, and a model of one bucket
    makes no non-blocking call at all (no hand-off to the progress thread and back)."""
    steps = 3

    def run(comm, rank):
        model = gst.DistributedDataParallel(Plain(rank), comm, bucket_cap_mb=bucket_cap_mb)
        calls = _counting(comm)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(steps):
            x, y = data(step)
            opt.zero_grad(set_to_none=step % 2 == 0)  # a fresh .grad, then one kept and zeroed
            torch.nn.functional.cross_entropy(model(x[rank::2]), y[rank::2]).backward()
            opt.step()
        return len(model._buckets), calls, [p.detach().clone() for p in model.module.parameters()]

    results = run_ranks(2, run)
    for n, calls, _ in results:
        assert n == buckets
        assert calls == {"iallreduce": steps * (buckets - 1), "allreduce": steps}
    for a, b, want in zip(results[0][2], results[1][2], reference_plain(steps)):
        assert torch.equal(a, b)
        assert torch.allclose(a, want, rtol=1e-5, atol=1e-6)


def test_a_request_of_the_users_in_flight_over_backward():
    """A non-blocking call of the user's own, issued before backward and waited for after it: the
    step's calls go behind it (the blocking one through the progress thread, in order), on every
    rank alike, and both results are right."""
    steps = 3

    def run(comm, rank):
        model = gst.DistributedDataParallel(Plain(rank), comm, bucket_cap_mb=1e-4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sums = []
        for step in range(steps):
            x, y = data(step)
            opt.zero_grad(set_to_none=True)
            mine = np.full(1 << 20, rank + step, dtype=np.float32)
            request = comm.iallreduce(mine, op="sum")
            torch.nn.functional.cross_entropy(model(x[rank::2]), y[rank::2]).backward()
            sums.append(set(request.wait().tolist()))
            request.close()
            opt.step()
        return sums, [p.detach().clone() for p in model.module.parameters()]

    results = run_ranks(2, run)
    for sums, _ in results:
        assert sums == [{float(1 + 2 * step)} for step in range(steps)]
    for a, b, want in zip(results[0][1], results[1][1], reference_plain(steps)):
        assert torch.equal(a, b)
        assert torch.allclose(a, want, rtol=1e-5, atol=1e-6)


def train_zero(comm, rank, size, steps=5, lr_schedule=None, **options):
    model = Plain(seed=rank)  # each rank starts elsewhere: the optimizer takes rank 0's weights
    opt = gst.ZeroRedundancyOptimizer(model.parameters(), comm, **options)
    digests = []
    for step in range(steps):
        if lr_schedule is not None:
            for group in opt.param_groups:
                group["lr"] = lr_schedule(step)
        x, y = data(step)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x[rank::size]), y[rank::size]).backward()
        opt.step()
        digests.append(digest(model))
    opt.close()
    return digests, [p.detach().clone() for p in model.parameters()]


def test_zero_same_weights_on_every_rank_and_the_whole_batch_adam():
    results = run_ranks(2, lambda comm, rank: train_zero(comm, rank, 2, optimizer="adam", lr=0.01))
    assert results[0][0] == results[1][0] and len(set(results[0][0])) == 5  # bitwise, every step; moving
    ref = Plain(0)
    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for step in range(5):
        x, y = data(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    for got, want in zip(results[0][1], ref.parameters()):
        assert torch.allclose(got, want.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("size", [1, 3])
def test_zero_any_rank_count_compressed_wire_and_a_scheduler(size):
    # lr 0 from step 3 on: a scheduler's change must reach the library, so the weights stop moving.
    results = run_ranks(size, lambda comm, rank: train_zero(comm, rank, size, steps=5, optimizer="adamw",
                                                              lr=0.01, weight_decay=0.01, compress="bf16",
                                                              lr_schedule=lambda s: 0.01 if s < 3 else 0.0))
    for digests, _ in results[1:]:
        assert digests == results[0][0]
    d = results[0][0]
    assert len(set(d[:3])) == 3 and d[2] == d[3] == d[4]


def test_zero_refuses_what_it_cannot_do():
    def body(comm, rank):
        model = Plain(0)
        opt = gst.ZeroRedundancyOptimizer(model.parameters(), comm, optimizer="sgd", lr=0.1)
        with pytest.raises(RuntimeError, match="call consolidate_state_dict"):
            opt.state_dict()  # the state lives sliced over the ranks until it is consolidated
        opt.close()
        with pytest.raises(ValueError, match="float32"):
            gst.ZeroRedundancyOptimizer([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))], comm)
        return True

    assert run_ranks(1, body) == [True]


def _shm_zero_rank(rank, size, queue, group):
    import gradsync as gs
    torch.set_num_threads(1)
    with gs.Communicator(group, rank, size, timeout_ms=30000, transport="shm") as comm:
        queue.put((rank, train_zero(comm, rank, size, optimizer="momentum", lr=0.05, compress="fp16")[0]))


def test_zero_shm_processes():
    results, codes = _run(_shm_zero_rank, 2, _group("zero"))
    assert codes == [0, 0]
    assert results[0] == results[1] and len(set(results[0])) == 5


def _shm_rank(rank, size, queue, group):
    import gradsync as gs
    torch.set_num_threads(1)
    with gs.Communicator(group, rank, size, timeout_ms=30000, transport="shm") as comm:
        model = gst.DistributedDataParallel(Net(seed=rank), comm, bucket_cap_mb=0.01)
        in_segment = all(b.in_comm_memory for b in model._buckets)
        digests = train(comm, rank, size)[0]
    # The buckets lay in the group's segment, which went with the communicator: a backward now
    # must fail with a clear error, not write into unmapped memory. (The inner module's forward:
    # the wrapper's would fail first, broadcasting the BatchNorm buffers.)
    x, y = data(0)
    try:
        torch.nn.functional.cross_entropy(model.module(x), y).backward()
        after_close = "no error"
    except Exception as e:  # noqa: BLE001 (autograd may wrap the hook's error)
        after_close = str(e)
    queue.put((rank, (digests, in_segment, after_close)))


def test_shm_processes():
    results, codes = _run(_shm_rank, 2, _group("torch"))
    assert codes == [0, 0]
    assert results[0][0] == results[1][0] and len(set(results[0][0])) == 6
    assert results[0][1] and results[1][1]  # zero copy: every bucket in the segment
    assert all("Communicator is closed" in results[r][2] for r in (0, 1)), results


@pytest.mark.skipif(not HAVE_MPI, reason="no MPI transport here (built without MPI, or its plugin does not load)")
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


def _models_that_differ(rank):
    """(what, this rank's module) pairs: each pair's modules differ between ranks 0 and 1 in one
    way that equal element counts would hide, except the last, which is the same model."""
    frozen = torch.nn.Linear(4, 3)
    if rank == 1:
        frozen.bias.requires_grad_(False)
    buffered = torch.nn.Linear(4, 3)
    buffered.register_buffer("table", torch.zeros((2, 3) if rank == 0 else (3, 2)))
    renamed = torch.nn.Module()
    renamed.x = torch.nn.Linear(4, 3)
    return [
        ("transposed", torch.nn.Linear(4, 3) if rank == 0 else torch.nn.Linear(3, 4)),
        ("one more layer", torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(2 + rank)])),
        ("dtype", torch.nn.Linear(4, 3) if rank == 0 else torch.nn.Linear(4, 3).double()),
        ("frozen", frozen),
        ("buffer", buffered),
        ("renamed", torch.nn.Sequential(torch.nn.Linear(4, 3)) if rank == 0 else renamed),
        ("same", torch.nn.Linear(4, 3)),
    ]


def _shm_differ_rank(rank, size, queue, group):
    import gradsync as gs
    torch.set_num_threads(1)
    outcome = {}
    with gs.Communicator(group, rank, size, timeout_ms=30000, transport="shm") as comm:
        for what, module in _models_that_differ(rank):
            try:
                gst.DistributedDataParallel(module, comm)
                outcome[what] = "wrapped"
            except ValueError as e:
                outcome[what] = str(e)
        for what, module in (("zero transposed", torch.nn.Linear(4, 3) if rank == 0 else torch.nn.Linear(3, 4)),
                             ("zero same", torch.nn.Linear(4, 3))):
            try:
                gst.ZeroRedundancyOptimizer(module.parameters(), comm, optimizer="sgd").close()
                outcome[what] = "made"
            except ValueError as e:
                outcome[what] = str(e)
    queue.put((rank, outcome))


def test_ranks_that_wrap_different_models_all_fail_naming_the_first_difference():
    results, codes = _run(_shm_differ_rank, 2, _group("differ"))
    assert codes == [0, 0]
    assert results[0] == results[1]  # every rank fails alike, naming the same difference
    got = results[0]
    assert ("parameter 'weight' float32 (3, 4) on rank 0 but parameter 'weight' float32 (4, 3) on rank 1"
            in got["transposed"])
    assert "nothing (it has fewer parameters and buffers) on rank 0" in got["one more layer"]
    assert "'2.weight'" in got["one more layer"]
    assert "float32 (3, 4) on rank 0 but parameter 'weight' float64 (3, 4) on rank 1" in got["dtype"]
    assert ("parameter 'bias' float32 (3,) on rank 0 but parameter 'bias' float32 (3,) (frozen) on rank 1"
            in got["frozen"])
    assert "buffer 'table' float32 (2, 3) on rank 0 but buffer 'table' float32 (3, 2) on rank 1" in got["buffer"]
    assert got["same"] == "wrapped"  # and the failed checks left the group usable
    assert got["zero transposed"].startswith("ZeroRedundancyOptimizer: the ranks wrap different models; the first "
                                             "difference is parameter 'params[0]' float32 (3, 4) on rank 0 but "
                                             "parameter 'params[0]' float32 (4, 3) on rank 1")
    assert got["zero same"] == "made"
    assert "'0.weight'" in got["renamed"] and "'x.weight'" in got["renamed"]


def _train_through_a_timeout(rank, size, comm, timed_out, steps=6, lost=2):
    """Plain over `steps` steps; at step `lost` rank 1 holds its backward back until rank 0 has
    timed out waiting for it; then every rank resets the group and trains on."""
    from gradsync import GradsyncError
    model = gst.DistributedDataParallel(Plain(rank), comm, bucket_cap_mb=0.001)  # a bucket per parameter
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    failures = []
    for step in range(steps):
        x, y = data(step)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x[rank::size]), y[rank::size])
        if step == lost and rank == 1:
            assert timed_out.wait(60)
        try:
            loss.backward()
        except GradsyncError as e:
            failures.append((step, e.status))
            if rank == 0:
                timed_out.set()
            comm.reset()
            continue
        opt.step()
    return failures, [p.detach().clone() for p in model.module.parameters()]


def _shm_timeout_rank(rank, size, queue, group, timed_out, started):
    import gradsync as gs
    torch.set_num_threads(1)
    started.wait(60)  # the short timeout bounds the join too: join together, however slow the start
    with gs.Communicator(group, rank, size, timeout_ms=3000, transport="shm") as comm:
        failures, weights = _train_through_a_timeout(rank, size, comm, timed_out)
    queue.put((rank, (failures, [w.numpy() for w in weights])))


def test_a_step_that_timed_out_then_a_reset_and_training_goes_on():
    import multiprocessing as mp
    import gradsync as gs
    ctx = mp.get_context("spawn")
    results, codes = _run(_shm_timeout_rank, 2, _group("timeout"), ctx.Event(), ctx.Barrier(2))
    assert codes == [0, 0]
    # Step 2 failed on both ranks, and no other step (a stale request would fail every later one).
    assert results[0][0] == [(2, gs.E_TIMEOUT)], results[0][0]
    assert [step for step, _ in results[1][0]] == [2], results[1][0]
    assert results[1][0][0][1] in (gs.E_TIMEOUT, gs.E_ABORTED)
    for a, b in zip(results[0][1], results[1][1]):
        assert np.array_equal(a, b)  # bitwise the same weights
    # and the right ones: one process on the whole batch, without step 2's update.
    ref = Plain(0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(6):
        if step == 2:
            continue
        x, y = data(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    for got, want in zip(results[0][1], ref.parameters()):
        assert np.allclose(got, want.detach().numpy(), rtol=1e-5, atol=1e-6)


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom")


class Breaking(Plain):
    """Plain whose backward can fail halfway, after the last layer's buckets have started."""
    boom = False

    def forward(self, x):
        h = self.a(x)
        return self.c(torch.relu(_Boom.apply(h) if self.boom else h))


@pytest.mark.parametrize("bucket_cap_mb", [1e-5, 100])
def test_a_backward_that_failed_on_one_rank_only_and_training_goes_on(bucket_cap_mb):
    from gradsync import GradsyncError

    def run(comm, rank):
        model = gst.DistributedDataParallel(Breaking(rank), comm, bucket_cap_mb=bucket_cap_mb)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        failures, done, attempt = [], 0, 0
        while done < 5:  # a failed step's batch is tried again
            model.module.boom = rank == 1 and attempt == 2
            attempt += 1
            x, y = data(done)
            opt.zero_grad(set_to_none=True)
            try:
                torch.nn.functional.cross_entropy(model(x[rank::2]), y[rank::2]).backward()
            except GradsyncError as e:
                failures.append((done, e.status))
                comm.reset()
                continue
            except RuntimeError as e:
                failures.append((done, str(e)))  # this rank's own: the user sees no group error
                continue
            opt.step()
            done += 1
        return failures, [p.detach().clone() for p in model.module.parameters()]

    import gradsync as gs
    results = run_ranks(2, run, timeout_ms=60000)
    if bucket_cap_mb < 1:
        # A bucket per parameter: rank 1 started the last layer's and never the first layer's,
        # which rank 0 waits for. Its next forward aborts the group, so that rank 0 fails now (not
        # after the timeout) and no bucket of the next step is paired with another of this one.
        assert results[0][0] == [(2, gs.E_ABORTED)]
        assert results[1][0] == [(2, "boom"), (2, gs.E_ABORTED)]
    else:
        # One bucket, never started: rank 0's waits for rank 1's next try of the same batch.
        assert results[0][0] == []
        assert results[1][0] == [(2, "boom")]
    ref = Plain(0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(5):
        x, y = data(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    for a, b, want in zip(results[0][1], results[1][1], ref.parameters()):
        assert torch.equal(a, b)
        assert torch.allclose(a, want.detach(), rtol=1e-5, atol=1e-6)
