# SPDX-License-Identifier: Apache-2.0
"""torch models trained data-parallel through a gradsync Communicator (any transport).

    import gradsync as gs, gradsync.torch as gst
    comm = gs.Communicator(...)                       # threads, transport="shm" or "mpi"
    model = gst.DistributedDataParallel(net, comm)    # parameters and buffers now rank 0's
    loss_fn(model(x), y).backward()                   # gradients averaged over ranks when it returns
    optimizer.step()                                  # the same weights, bit for bit, on every rank

Gradients are packed into buckets (bucket_cap_mb, in reverse registration order, as torch's own
DistributedDataParallel does); a bucket's all-reduce (mean, rank order) is started on the
communicator's progress thread as soon as its last gradient is accumulated during backward, so
communication overlaps the rest of the backward pass, and the buckets are waited for and copied
back into each parameter's .grad when backward ends. Gradients are copied into the buckets, not
viewed, so optimizer.zero_grad(set_to_none=True) (torch 2's default) cannot detach them.
no_sync() skips the averaging for gradient accumulation; the next synchronised backward averages
the accumulated gradients.

ZeroRedundancyOptimizer is ZeRO-1 over the sharded parameter: every parameter of the model lives in
one flat float32 vector, each rank keeps the optimizer state (Adam's moments, momentum) of its
1/size slice only, and step() reduce-scatters the local gradients (optionally bf16/fp16 on the
wire), updates the slice and all-gathers the new weights into the parameters:

    model = Net()                                     # not wrapped: the optimizer averages
    opt = gst.ZeroRedundancyOptimizer(model.parameters(), comm, optimizer="adam", lr=1e-3)
    loss_fn(model(x), y).backward()                   # local gradients
    opt.step()                                        # the same weights, bit for bit, on every rank
"""
import contextlib

import numpy as np
import torch

from ._lib import E_NO_SPACE, E_NOMEM, GradsyncError
from .shard import ShardedParameter

__all__ = ["DistributedDataParallel", "ZeroRedundancyOptimizer"]


class _Bucket:
    def __init__(self, params, dtype, comm):
        self.params = params
        self.offsets = []
        at = 0
        for p in params:
            self.offsets.append(at)
            at += p.numel()
        # From the communicator's memory: on shm every rank's bucket lies in the group's segment,
        # so its all-reduce runs zero copy instead of staging the bucket through the segment.
        # Ordinary memory (still correct, on the copy path) when the segment has no room.
        self.in_comm_memory = False
        try:
            self.flat = torch.from_numpy(comm.empty(at, torch.empty(0, dtype=dtype).numpy().dtype))
            self.flat.zero_()
            self.in_comm_memory = True
        except GradsyncError as e:
            if e.status not in (E_NO_SPACE, E_NOMEM):
                raise
            self.flat = torch.zeros(at, dtype=dtype)
        except TypeError:  # a dtype the collectives do not take: the all-reduce names it
            self.flat = torch.zeros(at, dtype=dtype)
        self.arrived = [False] * len(params)
        self.pending = len(params)
        self.request = None


class DistributedDataParallel(torch.nn.Module):
    """Wraps `module`; its forward is the module's. See the module docstring."""

    def __init__(self, module, comm, bucket_cap_mb=25.0, broadcast_buffers=True):
        super().__init__()
        self.module = module
        self.comm = comm
        self.broadcast_buffers = broadcast_buffers
        self._sync = True
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                self._broadcast(t)
        # Reverse registration order approximates the order in which backward produces gradients.
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        cap = max(1, int(bucket_cap_mb * 2 ** 20))
        self._buckets, self._where = [], {}
        group, size = [], 0
        for p in params:
            if group and (size + p.numel() * p.element_size() > cap or p.dtype != group[0].dtype):
                self._buckets.append(_Bucket(group, group[0].dtype, comm))
                group, size = [], 0
            group.append(p)
            size += p.numel() * p.element_size()
        if group:
            self._buckets.append(_Bucket(group, group[0].dtype, comm))
        for b, bucket in enumerate(self._buckets):
            for i, p in enumerate(bucket.params):
                self._where[p] = (b, i)
        self._hooks = []
        self._grad_accs = []  # the AccumulateGrad nodes must live for their hooks to fire
        for p in params:
            acc = p.expand_as(p).grad_fn.next_functions[0][0]
            self._hooks.append(acc.register_hook(self._make_hook(p)))
            self._grad_accs.append(acc)
        self._next = 0  # the next bucket to start: buckets start in index order on every rank
        self._callback_queued = False

    def _broadcast(self, tensor):
        a = tensor.detach().numpy()
        if not a.flags["C_CONTIGUOUS"]:
            raise ValueError("parameters and buffers must be contiguous CPU tensors")
        self.comm.broadcast(a, root=0)

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self._sync:
            with torch.no_grad():
                for t in self.module.buffers():
                    self._broadcast(t)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally, without communication."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _make_hook(self, p):
        def hook(*_):
            if not self._sync:
                return
            self.comm.ptr  # raises once the communicator is closed: the buckets were its memory
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            b, i = self._where[p]
            bucket = self._buckets[b]
            n = p.numel()
            view = bucket.flat[bucket.offsets[i]:bucket.offsets[i] + n]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
            bucket.arrived[i] = True
            bucket.pending -= 1
            self._start_ready()
        return hook

    def _start_ready(self):
        while self._next < len(self._buckets) and self._buckets[self._next].pending == 0:
            bucket = self._buckets[self._next]
            bucket.request = self.comm.iallreduce(bucket.flat.numpy(), op="mean")
            self._next += 1

    def _finish(self):
        """End of backward: start what is left (parameters without a gradient this step count as
        zero), wait for every bucket in order, and put the averages into .grad."""
        self._callback_queued = False
        for bucket in self._buckets[self._next:]:
            for i, (p, at) in enumerate(zip(bucket.params, bucket.offsets)):
                if not bucket.arrived[i]:
                    bucket.flat[at:at + p.numel()].zero_()
            bucket.pending = 0
        self._start_ready()
        for bucket in self._buckets:
            bucket.request.wait()
            bucket.request.close()
            bucket.request = None
            for p, at in zip(bucket.params, bucket.offsets):
                g = bucket.flat[at:at + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
            bucket.pending = len(bucket.params)
            bucket.arrived = [False] * len(bucket.params)
        self._next = 0


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """ZeRO-1 through gradsync.ShardedParameter. See the module docstring.

    params: the model's parameters (float32 CPU tensors, one parameter group). They are moved into
    one flat vector (each parameter becomes a view of it) and set to rank 0's values, so the ranks
    start from the same weights. optimizer: "adam" (default), "adamw", "sgd" or "momentum", with
    lr, betas, eps, weight_decay, momentum as torch's own; compress: "none", "bf16", "fp16" or
    "bigdl_fp16" for the gradients on the wire (the weights travel in full precision);
    error_feedback, clip_norm: as ShardedParameter has them.

    Use it on the plain model, not on one wrapped in DistributedDataParallel: step() averages the
    gradients itself (a wrapper would average them twice, for nothing). A parameter whose .grad is
    None this step contributes zeros. A learning-rate change in param_groups (a scheduler's) is
    applied at the next step; it must be the same on every rank, as must every step() call.
    The optimizer state lives sliced in the library, so state_dict() and load_state_dict() are
    refused: checkpoint the weights.
    """

    def __init__(self, params, comm, optimizer="adam", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 momentum=0.9, compress="none", error_feedback=False, clip_norm=None):
        super().__init__(params, dict(lr=lr))
        if len(self.param_groups) != 1:
            raise ValueError("ZeroRedundancyOptimizer takes one parameter group")
        self._params = list(self.param_groups[0]["params"])
        for p in self._params:
            if p.dtype != torch.float32 or p.device.type != "cpu":
                raise ValueError(f"parameters must be float32 CPU tensors, got {p.dtype} on {p.device}")
        self._offsets, total = [], 0
        for p in self._params:
            self._offsets.append(total)
            total += p.numel()
        self._weights = torch.empty(total, dtype=torch.float32)
        self._grad = torch.zeros(total, dtype=torch.float32)
        with torch.no_grad():
            for p, at in zip(self._params, self._offsets):
                view = self._weights[at:at + p.numel()]
                view.copy_(p.reshape(-1))
                p.data = view.view_as(p)  # the parameter now reads the weights the library writes
        comm.broadcast(self._weights.numpy(), root=0)
        self._lr = float(lr)
        self.shard = ShardedParameter(comm, total, optimizer=optimizer, lr=self._lr, compress=compress,
                                      error_feedback=error_feedback, momentum=momentum, betas=betas, eps=eps,
                                      weight_decay=weight_decay, clip_norm=clip_norm)
        self.shard.init(self._weights.numpy())

    @torch.no_grad()
    def step(self, closure=None, samples=None):
        """Collective: average the gradients (weighted by `samples`, this rank's sample count, when
        given), update this rank's slice, and gather every rank's new weights into the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lr = float(self.param_groups[0]["lr"])
        if lr != self._lr:
            self.shard.set_lr(lr)
            self._lr = lr
        for p, at in zip(self._params, self._offsets):
            part = self._grad[at:at + p.numel()]
            if p.grad is None:
                part.zero_()
            else:
                part.copy_(p.grad.reshape(-1))
        self.shard.step(self._grad.numpy(), self._weights.numpy(), samples=samples)
        return loss

    def state_dict(self):
        raise NotImplementedError("ZeroRedundancyOptimizer: the optimizer state is sliced over the ranks inside "
                                  "the library and cannot be saved; checkpoint the model's weights")

    def load_state_dict(self, state_dict):
        raise NotImplementedError("ZeroRedundancyOptimizer: the optimizer state is sliced over the ranks inside "
                                  "the library and cannot be loaded; restore the model's weights")

    def close(self):
        """Free this rank's slice (and its optimizer state) now rather than at garbage collection."""
        self.shard.close()
