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
"""
import contextlib

import numpy as np
import torch

__all__ = ["DistributedDataParallel"]


class _Bucket:
    def __init__(self, params, dtype):
        self.params = params
        self.offsets = []
        at = 0
        for p in params:
            self.offsets.append(at)
            at += p.numel()
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
                self._buckets.append(_Bucket(group, group[0].dtype))
                group, size = [], 0
            group.append(p)
            size += p.numel() * p.element_size()
        if group:
            self._buckets.append(_Bucket(group, group[0].dtype))
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
