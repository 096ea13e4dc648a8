# SPDX-License-Identifier: Apache-2.0
"""ZeroRedundancyOptimizer's checkpoints: consolidate_state_dict + state_dict gather every rank's
slice of the optimizer state in torch's optimizer format; load_state_dict takes it on any world
size (each rank keeps its slice), or from the plain torch optimizer, and training goes on bit for
bit as if it had never stopped. And the shard's restore() underneath."""
import io

import numpy as np
import pytest
import torch

import gradsync as gs
import gradsync.torch as gst
from conftest import run_ranks
from test_torch import Plain

torch.set_num_threads(1)


def batch(step):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(24, 20, generator=g), torch.randint(0, 3, (24,), generator=g)


def backward(model, step):
    """Every rank takes the gradient of the same batch, rounded to multiples of 2^-12: the sum of
    up to 4 equal such values is exact, so the ranks' mean is that gradient bit for bit whatever
    the world size, and runs on 4, 3, 2 and 1 ranks take the very same steps. (Per-rank shares of
    a batch would sum in another order on another world size, to other bits.)"""
    x, y = batch(step)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p.grad.copy_(torch.round(p.grad * 4096) / 4096)


OPTIONS = {"adam": dict(optimizer="adam", lr=0.01, weight_decay=0.01),
           "momentum": dict(optimizer="momentum", lr=0.05, momentum=0.8)}


def train(comm, rank, steps, options, start=0, checkpoint=None):
    """`steps` steps from `start`; from a checkpoint's model weights and optimizer state when given.
    Returns the weights after each step and, when start == 0, a checkpoint consolidated on rank 0."""
    model = Plain(seed=7 if checkpoint is None else 100 + rank)  # a restart's own weights are overwritten
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
    opt = gst.ZeroRedundancyOptimizer(model.parameters(), comm, **options)
    if checkpoint is not None:
        opt.load_state_dict(checkpoint["optimizer"])
    weights = []
    for step in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        backward(model, step)
        opt.step()
        weights.append(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    saved = None
    opt.consolidate_state_dict(to=0)
    if rank == 0:  # through torch.save and torch.load, as a checkpoint goes to disk
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
        saved = buf.getvalue()
    opt.close()
    return weights, saved


@pytest.mark.parametrize("kind", ["adam", "momentum"])
def test_saved_on_4_ranks_loaded_on_2_3_and_1_trains_on_bit_for_bit(kind):
    options = OPTIONS[kind]
    whole = run_ranks(4, lambda comm, rank: train(comm, rank, 6, options))
    assert all(w == whole[0][0] for w, _ in whole) and len(set(whole[0][0])) == 6
    first = run_ranks(4, lambda comm, rank: train(comm, rank, 3, options))
    assert first[0][0] == whole[0][0][:3]
    saved = first[0][1]
    for size in (2, 3, 1):
        def resumed(comm, rank):
            checkpoint = torch.load(io.BytesIO(saved))
            return train(comm, rank, 3, options, start=3, checkpoint=checkpoint)[0]

        for weights in run_ranks(size, resumed):
            assert weights == whole[0][0][3:], f"{size} ranks"


def test_the_state_dict_is_torchs_and_loads_into_torchs_optimizer():
    def body(comm, rank):
        model = Plain(seed=7)
        opt = gst.ZeroRedundancyOptimizer(model.parameters(), comm, optimizer="adam", lr=0.01, betas=(0.8, 0.99))
        for step in range(2):
            opt.zero_grad()
            backward(model, step)
            opt.step()
        opt.consolidate_state_dict(to=None)  # every rank
        sd = opt.state_dict()
        with pytest.raises(RuntimeError, match="stale"):
            opt.step()
            opt.state_dict()
        opt.consolidate_state_dict(to=1)
        if rank == 1:
            assert opt.state_dict()["state"][0]["step"].item() == 3
        else:
            with pytest.raises(RuntimeError, match="consolidate_state_dict"):
                opt.state_dict()
        opt.close()
        return sd, [p.detach().clone() for p in model.parameters()]

    (sd, params), (sd1, _), _ = run_ranks(3, body)
    assert sd["param_groups"][0]["betas"] == (0.8, 0.99) and sd["param_groups"][0]["params"] == [0, 1, 2, 3]
    for i, p in enumerate(params):
        assert sorted(sd["state"][i]) == ["exp_avg", "exp_avg_sq", "step"] and sd["state"][i]["step"].item() == 2
        assert sd["state"][i]["exp_avg"].shape == p.shape and torch.equal(sd["state"][i]["exp_avg"],
                                                                          sd1["state"][i]["exp_avg"])
        assert sd["state"][i]["exp_avg_sq"].min() >= 0 and sd["state"][i]["exp_avg"].abs().sum() > 0
    # torch's own Adam takes it, and goes on from it: close to the library's third step.
    ref = Plain(seed=0)
    with torch.no_grad():
        for r, p in zip(ref.parameters(), params):
            r.copy_(p)
    plain = torch.optim.Adam(ref.parameters(), lr=0.5)
    plain.load_state_dict(sd)
    assert plain.param_groups[0]["lr"] == 0.01 and plain.param_groups[0]["betas"] == (0.8, 0.99)
    for i, r in enumerate(ref.parameters()):
        assert torch.equal(plain.state[r]["exp_avg_sq"], sd["state"][i]["exp_avg_sq"])


def test_torchs_own_state_dict_loads_and_comes_back_bit_for_bit():
    ref = Plain(seed=3)
    plain = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.8)
    for step in range(2):
        plain.zero_grad()
        backward(ref, step)
        plain.step()
    sd = plain.state_dict()
    model_state = ref.state_dict()

    def body(comm, rank):
        model = Plain(seed=rank)
        model.load_state_dict(model_state)
        opt = gst.ZeroRedundancyOptimizer(model.parameters(), comm, optimizer="momentum", lr=0.05, momentum=0.8)
        opt.load_state_dict(sd)
        opt.consolidate_state_dict(to=0)
        back = opt.state_dict() if rank == 0 else None
        opt.close()
        return back

    back = run_ranks(2, body)[0]
    for i in range(4):
        assert torch.equal(back["state"][i]["momentum_buffer"], sd["state"][i]["momentum_buffer"])


def test_a_state_dict_of_another_optimizer_or_model_is_refused_and_changes_nothing():
    def saved(optimizer, module):
        opt = optimizer(module.parameters())
        opt.zero_grad()
        backward(module, 0) if isinstance(module, Plain) else module(torch.ones(2, 4)).sum().backward()
        opt.step()
        return opt.state_dict()

    momentum = saved(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), Plain(0))
    amsgrad = saved(lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True), Plain(0))
    other_model = saved(lambda ps: torch.optim.Adam(ps, lr=0.1), torch.nn.Sequential(torch.nn.Linear(4, 3),
                                                                                     torch.nn.Linear(3, 2)))
    transposed = saved(lambda ps: torch.optim.Adam(ps, lr=0.1), Plain(0))
    transposed["state"][0]["exp_avg"] = transposed["state"][0]["exp_avg"].t()

    def body(comm, rank):
        model = Plain(0)
        opt = gst.ZeroRedundancyOptimizer(model.parameters(), comm, optimizer="adam", lr=0.01)
        opt.zero_grad()
        backward(model, 0)
        opt.step()
        before = [opt.shard.read_slice(w) for w in ("weights", "state1", "state2")], opt.shard.updates
        with pytest.raises(ValueError, match=r"another kind of optimizer's than this one \(adam\): its parameter group lacks 'betas'"):
            opt.load_state_dict(momentum)
        with pytest.raises(ValueError, match="amsgrad"):
            opt.load_state_dict(amsgrad)
        with pytest.raises(ValueError, match="holds 4 parameters|2 parameters|parameter 0"):
            opt.load_state_dict(other_model)
        with pytest.raises(ValueError, match=r"parameter 0: the state dict's exp_avg has shape \(20, 64\)"):
            opt.load_state_dict(transposed)
        after = [opt.shard.read_slice(w) for w in ("weights", "state1", "state2")], opt.shard.updates
        assert all(np.array_equal(a, b) for a, b in zip(before[0], after[0])) and before[1] == after[1] == 1
        with pytest.raises(ValueError, match="to must be a rank"):
            opt.consolidate_state_dict(to=2)
        opt.close()
        return True

    assert run_ranks(2, body) == [True, True]


def test_shard_restore_takes_each_ranks_slice_and_the_update_count():
    n = 11
    w, m, v = (np.arange(n, dtype=np.float32) + k for k in (0, 100, 1000))

    def body(comm, rank):
        with gs.ShardedParameter(comm, n, optimizer="adam", lr=0.1, replicas=1) as p:
            p.restore(w, m, v, updates=5)
            start, length = p.part
            got = [p.read_slice(s) for s in ("weights", "state1", "state2")]
            assert p.updates == 5
            with pytest.raises(gs.GradsyncError, match="keeps a second state, and it is NULL"):
                p.restore(w, m, None)
            with pytest.raises(gs.GradsyncError, match="negative"):
                p.restore(w, m, v, updates=-1)
            with pytest.raises(ValueError, match="state2 holds 3 floats"):
                p.restore(w, m, v[:3])
            # a failed restore is reported again by the next collective stage (as a failed init is,
            # on every rank), since this rank's state is not what its peers restored; a good one clears it
            p.restore(w, m, v, updates=5)
            # a step goes on from the restored state: every rank the same weights, all of them moved
            out = w.copy()
            p.step(np.ones(n, np.float32), out)
            assert p.updates == 6
        with gs.ShardedParameter(comm, n, optimizer="sgd") as p:
            with pytest.raises(gs.GradsyncError, match="the optimizer \\(sgd\\) keeps no first state"):
                p.read_slice("state1")
            with pytest.raises(gs.GradsyncError, match="keeps no first state, but one was given"):
                p.restore(w, m)
        return start, length, got, out

    results = run_ranks(3, body)
    for start, length, got, out in results:
        for full, mine in zip((w, m, v), got):
            assert np.array_equal(mine, full[start:start + length])
        assert np.array_equal(out, results[0][3]) and not np.any(out == w)
