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
back into each parameter's .grad when backward ends. The last bucket is the exception: it is
ready only when every gradient is, with nothing of backward left to overlap, so it is all-reduced
at the end of backward on the caller's thread (a model of one bucket never involves the progress
thread). Gradients are copied into the buckets, not
viewed, so optimizer.zero_grad(set_to_none=True) (torch 2's default) cannot detach them.
no_sync() skips the averaging for gradient accumulation; the next synchronised backward averages
the accumulated gradients.

Wrapping is collective and checks that every rank wraps the same model: the parameters' and
buffers' names, shapes, dtypes and requires_grad, and the bucket size, in order. Ranks that
differ all raise ValueError naming the first difference, as torch's DDP does; equal sizes are
not enough (a (4, 3) weight on one rank and a (3, 4) one on another would otherwise train as two
readings of the same bytes). A backward that fails (a timeout, an abort) leaves no call in
flight and no bucket state behind: after comm.reset() on every rank, the next step runs. A
backward that fails for a reason of its own (an exception in the model's backward) after it
started a bucket aborts the group at the next forward, as its peers wait for buckets this rank
never starts; so every rank fails that step, and the same reset recovers.

ZeroRedundancyOptimizer is ZeRO-1 over the sharded parameter: every parameter of the model lives in
one flat float32 vector, each rank keeps the optimizer state (Adam's moments, momentum) of its
1/size slice only, and step() reduce-scatters the local gradients (optionally bf16/fp16 on the
wire), updates the slice and all-gathers the new weights into the parameters:

    model = Net()                                     # not wrapped: the optimizer averages
    opt = gst.ZeroRedundancyOptimizer(model.parameters(), comm, optimizer="adam", lr=1e-3)
    loss_fn(model(x), y).backward()                   # local gradients
    opt.step()                                        # the same weights, bit for bit, on every rank

ShardedEmbedding and ShardedEmbeddingBag keep their table sharded over the ranks
(gradsync.ShardedEmbeddingTable): forward looks the rows up from their owners, and backward pushes
the rows' gradients back, where the owners apply the table's own optimizer (SGD, row-wise
Adagrad or sparse Adam) at once, exactly and deterministically. They sit beside DistributedDataParallel, which
averages the dense part of the model (keep them out of the module DDP wraps, or they would be
wrapped twice):

    emb = gst.ShardedEmbedding(comm, rows, dim, optimizer="row_adagrad", lr=0.1, init="uniform")
    model = gst.DistributedDataParallel(dense, comm)
    loss_fn(model(emb(ids)), y).backward()            # pushes the embedding gradients, one step
    opt.step()                                        # the dense part

Every forward and its backward are collective: each rank runs as many of them, in the same order
(a rank with no ids passes an empty tensor), and uses each forward's output in its loss.
"""
import contextlib
import hashlib
import json

import numpy as np
import torch

from .._lib import E_NO_SPACE, E_NOMEM, GradsyncError
from ..embedding import ShardedEmbeddingTable
from ..shard import ShardedParameter

__all__ = ["DistributedDataParallel", "ZeroRedundancyOptimizer", "ShardedEmbedding", "ShardedEmbeddingBag"]


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
        # Made once: each step's hooks and copies back use them, and the collectives take the array.
        self.views = [self.flat[o:o + p.numel()].view_as(p) for p, o in zip(params, self.offsets)]
        try:
            self.array = self.flat.numpy()
        except TypeError:  # bf16 and the like: the collective takes the tensor and names its dtype
            self.array = self.flat
        self.arrived = [False] * len(params)
        self.pending = len(params)
        self.request = None


def _describe(module, options):
    """What every rank must agree on, in order: the options, then one entry per parameter and
    buffer (a module's, or a list of parameters named by their index)."""
    entries = [["option", k, repr(v), "", False] for k, v in options.items()]
    if isinstance(module, torch.nn.Module):
        tensors = [("parameter", module.named_parameters()), ("buffer", module.named_buffers())]
    else:
        tensors = [("parameter", ((f"params[{i}]", p) for i, p in enumerate(module)))]
    for kind, named in tensors:
        for name, t in named:
            entries.append([kind, name, list(t.shape), str(t.dtype).replace("torch.", ""), bool(t.requires_grad)])
    return entries


def _show(entry):
    if entry is None:
        return "nothing (it has fewer parameters and buffers)"
    kind, name, shape, dtype, requires_grad = entry
    if kind == "option":
        return f"{name}={shape}"
    return f"{kind} {name!r} {dtype} {tuple(shape)}{'' if requires_grad or kind == 'buffer' else ' (frozen)'}"


def _check_same_model(module, comm, options, who="DistributedDataParallel"):
    """Collective: raises ValueError on every rank when the ranks' models (a module, or a list of
    parameters) or options differ.

    One allgather of a digest settles the common case; only when the digests differ do the ranks
    gather every rank's whole description, so that each names the same first difference."""
    mine = _describe(module, options)
    text = json.dumps(mine, separators=(",", ":")).encode()
    size, rank = comm.size, comm.rank
    if size == 1:
        return
    digest = np.frombuffer(hashlib.sha256(text).digest(), dtype=np.int64)
    digests = comm.allgatherv(digest, [digest.size] * size)
    if all((digests[r * digest.size:(r + 1) * digest.size] == digest).all() for r in range(size)):
        return
    lengths = comm.allgatherv(np.array([len(text)], dtype=np.int64), [1] * size)
    words = [(int(n) + 3) // 4 for n in lengths]
    padded = np.zeros(words[rank], dtype=np.int32)
    padded.view(np.uint8)[:len(text)] = np.frombuffer(text, dtype=np.uint8)
    everyone = comm.allgatherv(padded, words)
    descriptions, at = [], 0
    for r in range(size):
        raw = everyone[at:at + words[r]].view(np.uint8)[:int(lengths[r])].tobytes()
        descriptions.append(json.loads(raw))
        at += words[r]
    # The first entry where some rank differs from rank 0, and the first such rank.
    first = descriptions[0]
    for i in range(max(len(d) for d in descriptions)):
        for r in range(1, size):
            a = first[i] if i < len(first) else None
            b = descriptions[r][i] if i < len(descriptions[r]) else None
            if a != b:
                raise ValueError(f"{who}: the ranks wrap different models; the first difference "
                                 f"is {_show(a)} on rank 0 but {_show(b)} on rank {r}; every rank must wrap the same "
                                 f"model (parameters and buffers in the same order, same shapes and dtypes)")
    raise AssertionError("the digests differ but the descriptions are equal")  # unreachable: json is canonical


class DistributedDataParallel(torch.nn.Module):
    """Wraps `module`; its forward is the module's. See the module docstring."""

    def __init__(self, module, comm, bucket_cap_mb=25.0, broadcast_buffers=True):
        super().__init__()
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        self._sync = True
        self._bucket_cap_mb = float(bucket_cap_mb)
        self._hooks = []
        self._attach(comm)

    def _attach(self, comm):
        """Collective over comm: check the model, broadcast rank 0's parameters and buffers, and
        build the buckets and gradient hooks on comm. Also after a shrink (gradsync.torch.elastic),
        where the buckets of the old group, in its memory, are dropped for new ones."""
        module, bucket_cap_mb = self.module, self._bucket_cap_mb
        for h in self._hooks:
            h.remove()
        self._hooks, self._buckets = [], []
        self.comm = comm
        _check_same_model(module, comm, {"bucket_cap_mb": float(bucket_cap_mb)})
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                self._broadcast(t)
        # Reverse registration order approximates the order in which backward produces gradients.
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        cap = max(1, int(bucket_cap_mb * 2 ** 20))
        group, size = [], 0
        for p in params:
            if group and (size + p.numel() * p.element_size() > cap or p.dtype != group[0].dtype):
                self._buckets.append(_Bucket(group, group[0].dtype, comm))
                group, size = [], 0
            group.append(p)
            size += p.numel() * p.element_size()
        if group:
            self._buckets.append(_Bucket(group, group[0].dtype, comm))
        self._grad_accs = []  # the AccumulateGrad nodes must live for their hooks to fire
        for bucket in self._buckets:
            for i, p in enumerate(bucket.params):
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                self._hooks.append(acc.register_hook(self._make_hook(p, bucket, i)))
                self._grad_accs.append(acc)
        self._next = 0  # the next bucket to start: buckets start in index order on every rank
        self._in_step = False  # a synchronised backward has begun and not ended
        self._step = 0  # its number: the end-of-backward callback of an earlier one is stale

    def _broadcast(self, tensor):
        a = tensor.detach().numpy()
        if not a.flags["C_CONTIGUOUS"]:
            raise ValueError("parameters and buffers must be contiguous CPU tensors")
        self.comm.broadcast(a, root=0)

    def forward(self, *args, **kwargs):
        """Run the wrapped module (after broadcasting its buffers from rank 0 when broadcast_buffers); the
        backward pass then all-reduces the gradients in buckets."""
        if self._in_step:
            self._abandon_unfinished()
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

    def _make_hook(self, p, bucket, i):
        def hook(*_):
            if not self._sync:
                return
            try:
                self._arrive(p, bucket, i)
            except BaseException as e:
                self._fail(e)
                raise
        return hook

    def _arrive(self, p, bucket, i):
        self.comm.ptr  # raises once the communicator is closed: the buckets were its memory
        if self._in_step and bucket.arrived[i]:  # a gradient twice: a new backward, the last unfinished
            self._abandon_unfinished()
        if not self._in_step:
            self._in_step = True
            self._step += 1
            step = self._step
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._finish(step))
        grad = p.grad
        if grad is None:
            bucket.views[i].zero_()
        else:
            bucket.views[i].copy_(grad)
        bucket.arrived[i] = True
        bucket.pending -= 1
        if bucket.pending == 0:
            self._start_ready()

    def _start_ready(self):
        """Start the ready buckets, in index order, on the progress thread; all but the last.

        The last bucket is ready only once every parameter has its gradient: backward has nothing
        left to overlap it with, and its end waits for it at once. _complete all-reduces it on this
        thread instead, which spares the two hand-offs (to the progress thread and back) that
        cost more than the all-reduce itself when ranks fill the cores; with a single bucket the
        step makes no non-blocking call at all."""
        last = len(self._buckets) - 1
        while self._next < last and self._buckets[self._next].pending == 0:
            bucket = self._buckets[self._next]
            bucket.request = self.comm.iallreduce(bucket.array, op="mean")
            self._next += 1

    def _finish(self, step):
        """End of backward: start what is left (parameters without a gradient this step count as
        zero), wait for every bucket in order, and put the averages into .grad."""
        if step != self._step or not self._in_step:
            return  # the step failed and was cleared already
        self._in_step = False
        try:
            self._complete()
        except BaseException as e:
            self._fail(e)
            raise

    def _complete(self):
        for bucket in self._buckets[self._next:]:
            for i, view in enumerate(bucket.views):
                if not bucket.arrived[i]:
                    view.zero_()
            bucket.pending = 0
        # The buckets in flight first: once they are done the communicator has nothing pending, and
        # the rest run on this thread (a blocking call behind pending ones would go through the
        # progress thread).
        for bucket in self._buckets:
            if bucket.request is not None:
                bucket.request.wait()
                bucket.request.close()
                bucket.request = None
            else:
                self.comm.allreduce(bucket.array, op="mean")
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)
            bucket.pending = len(bucket.params)
            bucket.arrived = [False] * len(bucket.params)
        self._next = 0

    def _fail(self, error):
        """A step failed: leave nothing of it behind, so that after comm.reset() the next step runs.

        An error of the group (a timeout, an abort, a mismatch) is every rank's. Any other error
        stops this rank's step halfway, and its peers would wait out the timeout for the buckets
        it will never start: the group is aborted, so that they fail now too."""
        self._in_step = False
        if not isinstance(error, GradsyncError):
            with contextlib.suppress(GradsyncError):
                self.comm.abort()
        self._abandon()

    def _abandon_unfinished(self):
        """A backward that began and never ended: it failed outside the hooks (autograd then drops
        the end-of-backward callback). If it started buckets, its peers wait for the rest, which
        would pair with other buckets of this rank's next step: the group is aborted, so that
        every rank fails now and resets. If it started none, the peers' buckets pair with the
        next step's, as if this rank had skipped the failed batch."""
        self._in_step = False
        if self._next > 0:
            with contextlib.suppress(GradsyncError):
                self.comm.abort()
        self._abandon()

    def _abandon(self):
        """Wait out the step's calls in flight (their buckets are borrowed until they end; once the
        group has failed they fail at once) and forget its bucket state."""
        for bucket in self._buckets:
            if bucket.request is not None:
                with contextlib.suppress(GradsyncError):  # the step's error is raised already
                    bucket.request.wait()
                bucket.request.close()
                bucket.request = None
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
    error_feedback, clip_norm, replicas: as ShardedParameter has them (replicas=k keeps each slice
    on k more ranks, so that gradsync.torch.elastic can reshard after losing up to k of them).
    joining=True on a rank joining a running group (gradsync.torch.elastic.join): its slice and
    step count come from the members by reshard, not from the weights.

    Construction is collective and checks, as DistributedDataParallel does, that every rank passes
    parameters of the same shapes in the same order (and the same optimizer and compression).
    Use it on the plain model, not on one wrapped in DistributedDataParallel: step() averages the
    gradients itself (a wrapper would average them twice, for nothing). A parameter whose .grad is
    None this step contributes zeros. A learning-rate change in param_groups (a scheduler's) is
    applied at the next step; it must be the same on every rank, as must every step() call.

    Checkpoints, as torch's own ZeroRedundancyOptimizer: consolidate_state_dict(to=rank) (collective)
    gathers every rank's slice of the optimizer state onto rank `to` (every rank with to=None), and
    state_dict() there returns it in the format of the torch optimizer of the same arithmetic
    (torch.optim.Adam, AdamW, or SGD with or without momentum): {"state": {i: {"step", "exp_avg",
    "exp_avg_sq"} or {"momentum_buffer"}}, "param_groups": [...]}, so it loads into that optimizer
    too. load_state_dict() takes such a dict (from any world size, or from the plain torch
    optimizer) on every rank; each keeps its slice, and training goes on bit for bit as it would
    have. Load the model's weights first (model.load_state_dict), as with torch: the weights the
    optimizer goes on from are the parameters' values when load_state_dict() is called. Not in the
    dict: the error-feedback residuals (each rank's own; they restart from zero) and, for SGD and
    momentum, the update count (torch's format has none; nothing they compute uses it).
    """

    # The torch optimizer whose arithmetic each of the library's runs, the hyperparameters it takes
    # from ours, and its per-parameter state, in the order of the library's arrays (state1, state2).
    _TORCH_EQUIVALENTS = {
        "adam": (torch.optim.Adam, ("betas", "eps", "weight_decay"), ("exp_avg", "exp_avg_sq")),
        "adamw": (torch.optim.AdamW, ("betas", "eps", "weight_decay"), ("exp_avg", "exp_avg_sq")),
        "momentum": (torch.optim.SGD, ("momentum", "weight_decay"), ("momentum_buffer",)),
        "sgd": (torch.optim.SGD, ("weight_decay",), ()),
    }
    # What a loaded state dict's parameter group must share with ours (lr may differ: it is taken).
    _SEMANTIC_KEYS = ("betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "amsgrad", "maximize")

    def __init__(self, params, comm, optimizer="adam", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 momentum=0.9, compress="none", error_feedback=False, clip_norm=None, replicas=0, joining=False):
        super().__init__(params, dict(lr=lr))
        if len(self.param_groups) != 1:
            raise ValueError("ZeroRedundancyOptimizer takes one parameter group")
        self._params = list(self.param_groups[0]["params"])
        for p in self._params:
            if p.dtype != torch.float32 or p.device.type != "cpu":
                raise ValueError(f"parameters must be float32 CPU tensors, got {p.dtype} on {p.device}")
        _check_same_model(self._params, comm, {"optimizer": optimizer, "compress": compress},
                          who="ZeroRedundancyOptimizer")
        self._kind = optimizer.lower() if isinstance(optimizer, str) else optimizer
        self._hyper = dict(betas=tuple(float(b) for b in betas), eps=float(eps), weight_decay=float(weight_decay),
                           momentum=float(momentum))
        self._consolidated = None
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
                                      weight_decay=weight_decay, clip_norm=clip_norm, replicas=replicas)
        if not joining:
            self.shard.init(self._weights.numpy())
        self._agreed = {"optimizer": optimizer, "compress": compress}  # what a joiner is checked against

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

    def _torch_equivalent(self):
        """The torch optimizer class of the same arithmetic, its parameter group (hyperparameters as
        torch names them, the current lr) and the names of its per-parameter state."""
        if self._kind not in self._TORCH_EQUIVALENTS:
            raise ValueError(f"state dicts need the optimizer by name ({', '.join(self._TORCH_EQUIVALENTS)}), "
                             f"got {self._kind!r}")
        cls, hyper, names = self._TORCH_EQUIVALENTS[self._kind]
        kwargs = {k: self._hyper[k] for k in hyper}
        group = dict(cls([torch.zeros(1)], lr=float(self.param_groups[0]["lr"]), **kwargs).param_groups[0])
        del group["params"]
        return cls, group, names

    @staticmethod
    def _plain(value):
        """A tensor or a tuple of numbers as plain Python numbers, to compare hyperparameters and steps."""
        if isinstance(value, torch.Tensor):
            return value.item()
        if isinstance(value, (tuple, list)):
            return tuple(ZeroRedundancyOptimizer._plain(v) for v in value)
        return value

    @torch.no_grad()
    def consolidate_state_dict(self, to=0):
        """Collective: gather every rank's slice of the optimizer state onto rank `to` (every rank
        when to is None), for state_dict() there. Call it on every rank with the same `to`."""
        comm = self.shard._comm
        if to is not None and not 0 <= int(to) < comm.size:
            raise ValueError(f"to must be a rank in [0, {comm.size}) or None, got {to}")
        _, group, names = self._torch_equivalent()
        counts = [length for _, length in self.shard.ranges()]
        updates = self.shard.updates
        whole = []
        for k in range(len(names)):
            mine = self.shard.read_slice(f"state{k + 1}")
            whole.append(comm.allgatherv(mine, counts) if to is None else comm.gatherv(mine, counts, root=int(to)))
        self._consolidated = None
        if to is not None and comm.rank != int(to):
            return
        state = {}
        # Adam's state says its step; momentum's has no count (torch's SGD keeps none), so it is
        # always there, zeros before the first step (which torch's SGD then takes as its own first).
        if names and (updates > 0 or self._kind == "momentum"):
            for i, (p, at) in enumerate(zip(self._params, self._offsets)):
                entry = {"step": torch.tensor(float(updates))} if self._kind in ("adam", "adamw") else {}
                for name, full in zip(names, whole):  # a copy each: a view would save the whole vector
                    entry[name] = torch.from_numpy(full[at:at + p.numel()].copy()).reshape(p.shape)
                state[i] = entry
        group = {**group, **{k: v for k, v in self.param_groups[0].items() if k != "params"}}
        group["params"] = list(range(len(self._params)))
        self._consolidated = (updates, {"state": state, "param_groups": [group]})

    def state_dict(self):
        """The optimizer state consolidated on this rank by consolidate_state_dict(), in torch's
        format (see the class docstring). RuntimeError on a rank that did not receive it, or when
        the optimizer has stepped since."""
        if self._consolidated is None:
            raise RuntimeError("ZeroRedundancyOptimizer: the optimizer state has not been consolidated on this "
                               "rank: call consolidate_state_dict(to=...) on every rank first")
        updates, state_dict = self._consolidated
        if updates != self.shard.updates:
            raise RuntimeError(f"ZeroRedundancyOptimizer: the state consolidated after update {updates} is stale "
                               f"(the optimizer is at update {self.shard.updates}): consolidate it again")
        return state_dict

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        """Local, on every rank with the same dict: continue from a state dict of this optimizer
        (consolidated on any world size) or of the torch optimizer of the same arithmetic. The
        weights are the parameters' current values (load the model's first). ValueError, with
        nothing changed, when the dict is another optimizer's or another model's."""
        _, ours, names = self._torch_equivalent()
        groups = state_dict["param_groups"]
        if len(groups) != 1:
            raise ValueError(f"the state dict has {len(groups)} parameter groups; this optimizer has 1")
        group = groups[0]
        if len(group["params"]) != len(self._params):
            raise ValueError(f"the state dict holds {len(group['params'])} parameters; this optimizer has "
                             f"{len(self._params)}")
        for key in ("betas", "momentum"):  # Adam's groups have betas, SGD's momentum
            if (key in group) != (key in ours):
                raise ValueError(f"the state dict is another kind of optimizer's than this one ({self._kind}): its "
                                 f"parameter group {'has' if key in group else 'lacks'} {key!r}")
        for key in self._SEMANTIC_KEYS:
            if key in group and key in ours and self._plain(group[key]) != self._plain(ours[key]):
                raise ValueError(f"the state dict's {key} is {group[key]!r}; this optimizer's ({self._kind}) is "
                                 f"{ours[key]!r}")
        entries = [state_dict["state"].get(pid) or {} for pid in group["params"]]
        whole = [np.zeros(self._weights.numel(), dtype=np.float32) for _ in names]
        updates = 0
        if names and any(entries):
            steps = set()
            for i, (entry, p, at) in enumerate(zip(entries, self._params, self._offsets)):
                for name, full in zip(names, whole):
                    if name not in entry:
                        raise ValueError(f"parameter {i} has no {name!r} in the state dict")
                    t = torch.as_tensor(entry[name])
                    if tuple(t.shape) != tuple(p.shape):
                        raise ValueError(f"parameter {i}: the state dict's {name} has shape {tuple(t.shape)}, the "
                                         f"parameter {tuple(p.shape)}")
                    full[at:at + p.numel()] = t.detach().to(torch.float32).reshape(-1).numpy()
                steps.add(int(self._plain(entry.get("step", 0))))
            if len(steps) != 1:
                raise ValueError(f"the parameters' states are at different steps {sorted(steps)}")
            updates = steps.pop()
        self.shard.restore(self._weights.numpy(), *whole, updates=updates)
        self.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
        self._consolidated = None

    def close(self):
        """Free this rank's slice (and its optimizer state) now rather than at garbage collection."""
        self.shard.close()


class _LookupPush(torch.autograd.Function):
    """Rows of ids from a sharded table; backward pushes their gradient (one optimizer step)."""

    @staticmethod
    def forward(ctx, anchor, ids, table):
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        ctx.table, ctx.ids = table, flat
        return torch.from_numpy(table.lookup(flat.numpy()))

    @staticmethod
    def backward(ctx, grad):
        g = grad.detach().to(torch.float32).contiguous()
        ctx.table.push(ctx.ids.numpy(), g.numpy())
        return None, None, None


class ShardedEmbedding(torch.nn.Module):
    """torch.nn.Embedding whose rows live sharded over comm's ranks, updated by the table itself.

    Arguments after comm, rows and dim are those of gradsync.ShardedEmbeddingTable (sharding,
    optimizer ("sgd", "row_adagrad" or "adam"), lr, eps, betas, init, seed, lo, hi, threads,
    directory); `table` is that table, for save() and load(). The weights are no torch parameter:
    the optimizer step happens in backward.
    """

    def __init__(self, comm, rows, dim, **table_options):
        super().__init__()
        self.table = ShardedEmbeddingTable(comm, rows, dim, **table_options)
        self.rows, self.dim = int(rows), int(dim)
        # Makes the output require grad, so that backward reaches the push; never a parameter.
        self._anchor = torch.empty(0, requires_grad=True)

    def _rows(self, ids):
        if ids.is_floating_point():
            raise TypeError(f"ids must be integers, got {ids.dtype}")
        return _LookupPush.apply(self._anchor, ids.detach().cpu(), self.table)

    def forward(self, ids):
        """The rows of ids (any integer shape), as a float32 tensor of shape ids.shape + (dim,)."""
        return self._rows(ids).reshape(*ids.shape, self.dim)

    def extra_repr(self):
        """Shape and this rank's share, for print(module)."""
        return f"{self.rows}, {self.dim}, {self.table.local_rows} rows on this rank"


class ShardedEmbeddingBag(ShardedEmbedding):
    """torch.nn.EmbeddingBag (mode "sum" or "mean") over a sharded table: ids of all bags in one
    1-D tensor and offsets (the start of each bag), or a 2-D tensor of equal bags."""

    def __init__(self, comm, rows, dim, mode="mean", **table_options):
        if mode not in ("sum", "mean"):
            raise ValueError(f"mode must be 'sum' or 'mean', got {mode!r}")
        super().__init__(comm, rows, dim, **table_options)
        self.mode = mode

    def forward(self, ids, offsets=None):
        """Each bag's sum or mean of rows: (bags, dim)."""
        if ids.dim() == 2:
            if offsets is not None:
                raise ValueError("offsets must be None with 2-D ids")
            bags, per = ids.shape
            bag_of = torch.arange(bags).repeat_interleave(per)
        else:
            if offsets is None:
                raise ValueError("1-D ids need offsets")
            offsets = offsets.to(torch.int64).cpu()
            bags = offsets.numel()
            lengths = torch.diff(offsets, append=torch.tensor([ids.numel()]))
            if bags and (offsets[0] != 0 or bool((lengths < 0).any())):
                raise ValueError("offsets must start at 0 and not decrease")
            bag_of = torch.arange(bags).repeat_interleave(lengths)
        rows = self._rows(ids)
        out = torch.zeros(bags, self.dim, dtype=rows.dtype).index_add(0, bag_of, rows)
        if self.mode == "mean":
            counts = torch.bincount(bag_of, minlength=bags).clamp(min=1).to(rows.dtype)
            out = out / counts.unsqueeze(1)
        return out
