# SPDX-License-Identifier: Apache-2.0
"""The Communicator's collectives take contiguous CPU torch tensors beside numpy arrays, without a
copy, and give tensors back: in place into the tensor passed, or new tensors for what they
allocate; the non-blocking forms too. Ranks are threads; the conversion is the same on every
transport."""
import numpy as np
import pytest
import torch

from conftest import run_ranks

torch.set_num_threads(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64, torch.float16])
def test_allreduce_in_place_into_the_tensor_itself(dtype):
    def body(comm, rank):
        t = torch.full((2, 3), rank + 1, dtype=dtype)
        where = t.data_ptr()
        got = comm.allreduce(t, op="sum")
        request = comm.iallreduce(t, op="max")
        waited = request.wait()
        return got is t and waited is t and t.data_ptr() == where, t.clone()

    for same, t in run_ranks(2, body):
        assert same  # no copy: the very tensor, its memory written
        assert t.dtype == dtype and torch.equal(t, torch.full((2, 3), 3, dtype=dtype))


def test_what_the_binding_allocates_comes_back_as_tensors():
    def body(comm, rank):
        out = {}
        x = torch.arange(6, dtype=torch.float32) + 10 * rank
        out["reduce_scatter"] = comm.reduce_scatter(x, op="sum")
        out["ireduce_scatter"] = comm.ireduce_scatter(x, op="sum").wait()
        out["allgatherv"] = comm.allgatherv(torch.full((rank + 1,), float(rank)), [1, 2])
        out["gather"] = comm.gather(x, root=0)
        out["scatter"] = comm.scatter(torch.arange(4, dtype=torch.int64) if rank == 0 else None, 2, root=0,
                                      dtype=torch.int64)
        into = torch.zeros(6)
        out["allreduce out"] = comm.allreduce(x, op="sum", out=into) is into
        parts = [torch.ones(2) * (rank + 1), torch.ones(3, dtype=torch.float64) * (rank + 1)]
        done = comm.allreduce_many(parts, op="sum")
        out["many"] = all(a is b for a, b in zip(done, parts)) and [p.tolist() for p in parts]
        mixed = comm.allgather(torch.zeros(4), part=np.full(2, rank, np.float32))  # numpy and tensor together
        out["mixed"] = mixed
        return out

    r0, r1 = run_ranks(2, body)
    assert isinstance(r0["reduce_scatter"], torch.Tensor) and r0["reduce_scatter"].tolist() == [10, 12, 14]
    assert r1["ireduce_scatter"].tolist() == [16, 18, 20]
    assert isinstance(r1["allgatherv"], torch.Tensor) and r1["allgatherv"].tolist() == [0, 1, 1]
    assert isinstance(r0["gather"], torch.Tensor) and r0["gather"].shape == (2, 6) and r1["gather"] is None
    assert r1["scatter"].dtype == torch.int64 and r1["scatter"].tolist() == [2, 3]  # a torch dtype off the root
    assert r0["allreduce out"] and r1["many"] == [[3, 3], [3, 3, 3]]
    assert isinstance(r0["mixed"], torch.Tensor) and r0["mixed"].tolist() == [0, 0, 1, 1]


def test_what_cannot_go_without_a_copy_is_refused():
    def body(comm, rank):
        errors = []
        for bad in (torch.zeros(4, 4).t(), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bool)):
            try:
                comm.allreduce(bad)
                errors.append(None)
            except (TypeError, ValueError) as e:
                errors.append(f"{type(e).__name__}: {e}")
        return errors

    for errors in run_ranks(1, body):
        assert errors[0].startswith("ValueError: array must be contiguous")
        assert errors[1].startswith("TypeError: array has dtype torch.bfloat16")
        assert errors[2].startswith("TypeError: array has dtype torch.bool")


def test_a_parameter_that_requires_grad_is_written_in_place():
    def body(comm, rank):
        p = torch.nn.Parameter(torch.full((3,), float(rank)))
        comm.broadcast(p, root=1)
        return p.detach().tolist(), p.requires_grad

    for values, requires_grad in run_ranks(2, body):
        assert values == [1.0, 1.0, 1.0] and requires_grad
