# SPDX-License-Identifier: Apache-2.0
"""The sharded embedding table through ctypes and torch, on the thread transport: bitwise equality
with one process's accumulator over 1 to 4 ranks, checkpoints across world sizes and sharding
rules, errors on every rank, and the torch modules."""
import numpy as np
import pytest

import gradsync as gs
from conftest import run_ranks

ROWS, DIM, GLOBAL = 300, 6, 240


def global_batch(step):
    rng = np.random.default_rng([7, step])
    hot = rng.integers(0, 8, GLOBAL)
    ids = np.where(rng.random(GLOBAL) < 0.4, hot, rng.integers(0, ROWS, GLOBAL)).astype(np.int64)
    grads = (rng.standard_normal((GLOBAL, DIM)) * np.array([1e-3, 1.0, 30.0, 1e-2, 3.0, 0.1])).astype(np.float32)
    return ids, grads


def slice_of(step, rank, size):
    bounds = np.linspace(0, GLOBAL, size + 1).astype(int)
    if step % 2:  # uneven: rank 0's share moves to the last rank
        bounds[1:-1] = (bounds[1:-1] + bounds[2:]) // 2
    return bounds[rank], bounds[rank + 1]


def state_width(optimizer):
    return 2 * DIM + 1 if optimizer == "adam" else 1


def reference(optimizer, steps):
    """(values, state) after `steps` global batches in one process: the public table and accumulator."""
    params = gs.Table.anonymous(ROWS, DIM, init="uniform", seed=5, lo=-0.2, hi=0.2)
    width = state_width(optimizer)
    state = gs.Table.anonymous(ROWS, width)
    accum = gs.Accumulator.anonymous(ROWS, DIM, concurrency="owner", threads=2)
    for s in range(steps):
        ids, grads = global_batch(s)
        accum.add_batch(ids, grads)
        if optimizer == "sgd":
            accum.apply(params, "sgd", lr=0.05)
        else:
            accum.apply(params, "adagrad" if optimizer == "row_adagrad" else optimizer, lr=0.05, state=state)
    state = np.array(state.view).reshape((ROWS, width) if width > 1 else ROWS).copy()
    return np.array(params.view).reshape(ROWS, DIM).copy(), state


def make(comm, sharding="contiguous", optimizer="row_adagrad", **kw):
    return gs.ShardedEmbeddingTable(comm, ROWS, DIM, sharding=sharding, optimizer=optimizer, lr=0.05,
                                    init="uniform", seed=5, lo=-0.2, hi=0.2, **kw)


def train(table, rank, size, steps, first=0):
    for s in range(first, steps):
        ids, grads = global_batch(s)
        lo, hi = slice_of(s, rank, size)
        table.push(ids[lo:hi], grads[lo:hi])


def leave_or_shrink(table, comm, rank, lost, step):
    """Rank `lost` leaves (its table closed here, its communicator as its body returns); the others'
    push of `step` fails, and they shrink: the survivors' group, or None on the lost rank."""
    if rank == lost:
        table.close()
        return None
    ids, grads = global_batch(step)
    with pytest.raises(gs.GradsyncError):
        table.push(ids[:0], grads[:0])
    shrunk, failed, _ = comm.shrink()
    assert failed == [lost]
    return shrunk


def gather_rows(parts):
    values = np.full((ROWS, DIM), np.nan, dtype=np.float32)
    state = np.full((ROWS,) + parts[0][2].shape[1:], np.nan, dtype=np.float32)
    for ids, v, s in parts:
        values[ids], state[ids] = v, s
    return values, state


@pytest.mark.parametrize("optimizer", ["sgd", "row_adagrad", "adam"])
@pytest.mark.parametrize("sharding", ["contiguous", "hash"])
def test_bitwise_equal_to_one_process_on_1_to_4_ranks(optimizer, sharding):
    ref_values, ref_state = reference(optimizer, 3)

    def body(comm, rank):
        with make(comm, sharding, optimizer, threads=1 + rank % 2) as t:
            train(t, rank, comm.size, 3)
            probe = np.array([3, 3, 299, 0, 7, 150, 3], dtype=np.int64)
            looked = t.lookup(probe)
            assert t.steps == 3
            return t.local_state(), probe, looked

    for size in (1, 2, 3, 4):
        results = run_ranks(size, body)
        values, state = gather_rows([r[0] for r in results])
        assert values.tobytes() == ref_values.tobytes(), f"{size} ranks, {sharding}"
        if optimizer != "sgd":
            assert state.tobytes() == ref_state.tobytes()
        for _, probe, looked in results:
            assert looked.tobytes() == ref_values[probe].tobytes()


def test_order_matters_so_the_test_can_fail():
    ids, grads = global_batch(0)
    a = gs.Accumulator.anonymous(ROWS, DIM, concurrency="owner", threads=1)
    b = gs.Accumulator.anonymous(ROWS, DIM, concurrency="owner", threads=1)
    a.add_batch(ids, grads)
    b.add_batch(ids[::-1].copy(), grads[::-1].copy())
    assert np.array(a.view).tobytes() != np.array(b.view).tobytes()


@pytest.mark.parametrize("optimizer", ["row_adagrad", "adam"])
def test_checkpoint_loads_into_other_world_sizes_and_rules(tmp_path, optimizer):
    ckpt = tmp_path / "ckpt"
    ref_values, ref_state = reference(optimizer, 3)
    more_values, more_state = reference(optimizer, 5)

    def saver(comm, rank):
        with make(comm, "hash", optimizer) as t:
            train(t, rank, comm.size, 3)
            t.save(ckpt)

    run_ranks(4, saver)
    for size, sharding in ((3, "contiguous"), (2, "hash"), (1, "contiguous")):
        def loader(comm, rank):
            with make(comm, sharding, optimizer) as t:
                t.load(ckpt)
                loaded = t.local_state()
                steps = t.steps
                train(t, rank, comm.size, 5, first=3)
                return loaded, steps, t.local_state()

        results = run_ranks(size, loader)
        values, state = gather_rows([r[0] for r in results])
        assert values.tobytes() == ref_values.tobytes() and state.tobytes() == ref_state.tobytes()
        assert all(r[1] == 3 for r in results)
        after = gather_rows([r[2] for r in results])
        assert after[0].tobytes() == more_values.tobytes() and after[1].tobytes() == more_state.tobytes()


def test_bad_id_on_one_rank_fails_every_rank():
    def body(comm, rank):
        with make(comm) as t:
            ids = np.array([1, 2, ROWS + 5 if rank == 2 else 3], dtype=np.int64)
            with pytest.raises(gs.GradsyncError) as info:
                t.push(ids, np.ones((3, DIM), dtype=np.float32))
            assert info.value.status == gs.E_OUT_OF_RANGE
            assert "rank 2" in str(info.value) and "id 305 at position 2" in str(info.value)
            with pytest.raises(gs.GradsyncError):
                t.lookup(np.array([-1 if rank == 0 else 0]))
            t.push(ids[:2], np.ones((2, DIM), dtype=np.float32))  # the group goes on
            steps = t.steps
        # a rank whose learning rate differs would update its rows differently: refused on every rank
        with gs.ShardedEmbeddingTable(comm, ROWS, DIM, lr=0.5 if rank == 1 else 0.1) as t:
            with pytest.raises(gs.GradsyncError) as info:
                t.push(np.array([1]), np.ones((1, DIM), dtype=np.float32))
            assert info.value.status == gs.E_MISMATCH and "rank 1" in str(info.value)
        return steps

    assert run_ranks(3, body) == [1, 1, 1]


def test_lookup_sends_each_distinct_id_once_and_answers_in_the_callers_order():
    def body(comm, rank):
        other = 1 - rank
        with make(comm, sharding="hash") as t:
            train(t, rank, 2, 2)
            owners = t.owner(np.arange(ROWS))
            mine, theirs = np.flatnonzero(owners == rank), np.flatnonzero(owners == other)
            rng = np.random.default_rng(rank)
            # hot ids of both owners, repeated many times, among a few distinct cold ones; then
            # calls of other sizes reuse (and outgrow) the buffers of the first
            hot = np.array([theirs[3], mine[5], theirs[7]])
            cold = rng.choice(theirs, 20, replace=False)
            batches = [np.concatenate([rng.choice(hot, 500), cold]), rng.choice(hot, 3), np.array([], dtype=np.int64),
                       rng.integers(0, ROWS, 5000)]
            for ids in batches:
                rng.shuffle(ids)
            answers, sent = [], []
            for ids in batches:
                before = comm.stats()["collectives"].get("alltoall", {"bytes": 0})["bytes"]
                answers.append((ids, t.lookup(ids)))
                sent.append(comm.stats()["collectives"]["alltoall"]["bytes"] - before)
            ids_local, values, _ = t.local_state()
            return answers, sent, [set(np.unique(ids)[owners[np.unique(ids)] == other].tolist()) for ids in batches], \
                (ids_local, values)

    results = run_ranks(2, body)
    table = np.full((ROWS, DIM), np.nan, dtype=np.float32)
    for r in results:
        ids_local, values = r[3]
        table[ids_local] = values
    for rank, (answers, sent, asked, _) in enumerate(results):
        other = results[1 - rank]
        for (ids, rows) in answers:
            assert rows.tobytes() == table[ids].tobytes()  # each id's row, in the caller's order
        for b in range(len(sent)):
            # this rank's part of the two exchanges: each distinct id it asks of the other rank once,
            # and each distinct row the other asks of it once
            assert sent[b] == 8 * len(asked[b]) + 4 * DIM * len(other[2][b])
    assert results[0][1][0] < 8 * 100  # 500 repeats of hot ids sent as at most 3 + 20 ids


def test_rank_0_pushes_each_distinct_id_once_and_the_table_stays_bitwise_exact():
    ids, grads = global_batch(0)  # 40% of its ids among 8 hot ones

    def body(comm, rank):
        with make(comm, sharding="hash") as t:
            owners = t.owner(np.arange(ROWS))
            lo, hi = slice_of(0, rank, 2)
            before = comm.stats()["collectives"].get("alltoall", {"bytes": 0})["bytes"]
            t.push(ids[lo:hi], grads[lo:hi])
            sent = comm.stats()["collectives"]["alltoall"]["bytes"] - before
            to_other = ids[lo:hi][owners[ids[lo:hi]] != rank]
            return sent, len(to_other), len(np.unique(to_other)), t.local_state()

    results = run_ranks(2, body)
    width = 4 * (2 + DIM)  # an id (two floats) and its gradient
    sent, every, distinct, _ = results[0]
    assert distinct < every and sent == width * distinct  # rank 0: each distinct id once, summed
    sent, every, _, _ = results[1]
    assert sent == width * every  # rank 1: as they come (its sums would follow rank 0's)
    values, state = gather_rows([r[3] for r in results])
    ref_values, ref_state = reference("row_adagrad", 1)
    assert values.tobytes() == ref_values.tobytes() and state.tobytes() == ref_state.tobytes()


def test_checkpoint_of_another_shape_is_refused(tmp_path):
    def body(comm, rank):
        with make(comm) as t:
            t.save(tmp_path)
        with gs.ShardedEmbeddingTable(comm, ROWS, DIM + 1, optimizer="row_adagrad") as wide:
            with pytest.raises(gs.GradsyncError) as info:
                wide.load(tmp_path)
            assert info.value.status == gs.E_MISMATCH and "300 x 6" in str(info.value)
        with pytest.raises(gs.GradsyncError) as info:
            with make(comm) as t:
                t.load(tmp_path / "nothing-here")
        assert info.value.status == gs.E_IO

    run_ranks(2, body)


def test_torch_sharded_embedding_matches_embedding_bag_with_sgd():
    torch = pytest.importorskip("torch")
    import gradsync.torch as gst

    ids = torch.tensor([[1, 4, 4], [0, 9, 2]])
    target = torch.randn(2, DIM, generator=torch.Generator().manual_seed(3))

    def body(comm, rank):
        bag = gst.ShardedEmbeddingBag(comm, 10, DIM, mode="mean", optimizer="sgd", lr=0.5, init="uniform", seed=5)
        emb = gst.ShardedEmbedding(comm, 10, DIM, optimizer="sgd", lr=0.5, init="uniform", seed=5)
        mine = ids[rank:rank + 1]
        loss = ((bag(mine) - target[rank:rank + 1]) ** 2).sum()
        loss.backward()
        x = emb(mine)
        assert x.shape == (1, 3, DIM)
        (x.sum() * 0).backward()  # a zero gradient still pushes (collective), changing nothing
        out = bag.table.lookup(np.arange(10)), emb.table.lookup(np.arange(10))
        bag.table.close()
        emb.table.close()
        return out

    results = run_ranks(2, body)
    # torch's own EmbeddingBag on the whole batch, plain SGD: the same weights
    w0 = gs.Table.anonymous(10, DIM, init="uniform", seed=5, lo=-0.5, hi=0.5)
    ref = torch.nn.EmbeddingBag(10, DIM, mode="mean")
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(np.array(w0.view).reshape(10, DIM)))
    ((ref(ids) - target) ** 2).sum().backward()
    with torch.no_grad():
        expected = (ref.weight - 0.5 * ref.weight.grad).numpy()
    for bag_rows, emb_rows in results:
        np.testing.assert_allclose(bag_rows, expected, rtol=1e-6, atol=1e-6)
        assert emb_rows.tobytes() == np.array(w0.view).reshape(10, DIM).tobytes()


def test_incremental_save_writes_only_pushed_rows_and_loads_in_layers(tmp_path):
    ref_values, ref_state = reference("row_adagrad", 4)

    def saver(comm, rank):
        with make(comm, "contiguous") as t:
            with pytest.raises(gs.GradsyncError) as info:
                t.save_incremental(tmp_path)          # nothing to stack a layer on
            assert info.value.status == gs.E_MISUSE
            train(t, rank, comm.size, 2)
            t.save(tmp_path)
            train(t, rank, comm.size, 3, first=2)
            t.save_incremental(tmp_path)
            train(t, rank, comm.size, 4, first=3)
            t.save_incremental(tmp_path)

    run_ranks(2, saver)
    part_bytes = sorted(p.stat().st_size for p in tmp_path.glob("part-*.gsemb"))
    assert len(part_bytes) == 6
    full = 128 + (ROWS // 2) * (8 + 4 * DIM + 4)
    assert part_bytes[-1] == full and part_bytes[0] < full  # the layers hold only the pushed rows

    def loader(comm, rank):
        with make(comm, "hash") as t:
            t.load(tmp_path)
            return t.local_state(), t.steps

    results = run_ranks(3, loader)
    values, state = gather_rows([r[0] for r in results])
    assert values.tobytes() == ref_values.tobytes() and state.tobytes() == ref_state.tobytes()
    assert [r[1] for r in results] == [4, 4, 4]


def test_incremental_saves_alternate_between_two_directories_each_its_own_chain(tmp_path):
    """Two generations, as gradsync.torch.elastic keeps them: a layer on the save before the last
    holds the rows pushed since that one, not only since the last."""
    a, b, c = (str(tmp_path / n) for n in "abc")
    refs = {n: reference("row_adagrad", n) for n in (4, 5, 6)}

    def saver(comm, rank):
        with make(comm) as t:
            train(t, rank, comm.size, 2)
            t.save(a)
            train(t, rank, comm.size, 3, first=2)
            t.save(b)
            train(t, rank, comm.size, 4, first=3)
            t.save_incremental(a)  # steps 2 and 3's rows
            train(t, rank, comm.size, 5, first=4)
            t.save_incremental(b)  # steps 3 and 4's
            train(t, rank, comm.size, 6, first=5)
            t.save(c)
            with pytest.raises(gs.GradsyncError) as info:
                t.save_incremental(a)  # three saves back: its pushed rows are not known
            assert info.value.status == gs.E_MISUSE and "saved before that" in str(info.value)
            t.save_incremental(b)  # steps 5's rows
            t.load(c)
            with pytest.raises(gs.GradsyncError) as info:
                t.save_incremental(b)  # a load knows the rows pushed since it only
            assert info.value.status == gs.E_MISUSE

    run_ranks(2, saver)

    def loader(comm, rank):
        with make(comm, "hash") as t:
            out = []
            for d in (a, b):
                t.load(d)
                out.append((t.local_state(), t.steps))
            return out

    results = run_ranks(3, loader)
    for i, want in enumerate((4, 6)):
        values, state = gather_rows([r[i][0] for r in results])
        assert [r[i][1] for r in results] == [want] * 3
        assert values.tobytes() == refs[want][0].tobytes() and state.tobytes() == refs[want][1].tobytes()


def _torch_sparse_adam_rows(torch, w0, steps, lr, betas, eps, per_row):
    """torch.optim.SparseAdam on the rows of w0 after the gradients of `steps` ((ids, grads) in
    global batch order). per_row: each row a parameter of its own with its own SparseAdam, stepped
    only when the batch touches it (so its step count is the row's update count, as the table's);
    otherwise one SparseAdam over the whole table (its step count is the optimizer's)."""
    rows = w0.shape[0]
    if not per_row:
        emb = torch.nn.Embedding(rows, w0.shape[1], sparse=True)
        with torch.no_grad():
            emb.weight.copy_(torch.from_numpy(w0))
        opt = torch.optim.SparseAdam(emb.parameters(), lr=lr, betas=betas, eps=eps)
        for ids, grads in steps:
            opt.zero_grad()
            emb.weight.grad = torch.sparse_coo_tensor(torch.from_numpy(ids)[None], torch.from_numpy(grads),
                                                      w0.shape)
            opt.step()
        return emb.weight.detach().numpy().copy()
    params = [torch.nn.Parameter(torch.from_numpy(w0[r:r + 1].copy())) for r in range(rows)]
    opts = [torch.optim.SparseAdam([p], lr=lr, betas=betas, eps=eps) for p in params]
    for ids, grads in steps:
        for r in np.unique(ids):
            params[r].grad = torch.sparse_coo_tensor(torch.zeros(1, int((ids == r).sum()), dtype=torch.int64),
                                                     torch.from_numpy(grads[ids == r]), (1, w0.shape[1]))
            opts[r].step()
    return np.concatenate([p.detach().numpy() for p in params])


@pytest.mark.parametrize("every_row_every_step", [True, False])
def test_adam_matches_torch_sparse_adam(every_row_every_step):
    """The table's Adam against torch.optim.SparseAdam: close within float tolerance (the order of
    torch's arithmetic differs), on 2 ranks. When every row is touched at every step a single
    SparseAdam is the reference; otherwise torch's SparseAdam per row, since the table's bias
    correction counts each row's own updates, which a single SparseAdam's step count does not."""
    torch = pytest.importorskip("torch")
    rows, dim, lr, betas, eps = 24, 5, 0.03, (0.8, 0.95), 1e-6
    rng = np.random.default_rng(11)
    steps = []
    for s in range(30):
        n = 60
        ids = rng.integers(0, rows if every_row_every_step else 6 + s % 7, n)
        if every_row_every_step:
            ids[:rows] = np.arange(rows)
        steps.append((ids.astype(np.int64), (rng.standard_normal((n, dim)) * rng.choice([1e-3, 1.0, 10.0], (n, 1)))
                      .astype(np.float32)))
    w0 = np.array(gs.Table.anonymous(rows, dim, init="uniform", seed=9, lo=-0.5, hi=0.5).view).reshape(rows, dim)

    def body(comm, rank):
        with gs.ShardedEmbeddingTable(comm, rows, dim, sharding="hash", optimizer="adam", lr=lr, betas=betas,
                                      eps=eps, init="uniform", seed=9) as t:
            for ids, grads in steps:
                lo, hi = (0, 25) if rank == 0 else (25, len(ids))
                t.push(ids[lo:hi], grads[lo:hi])
            return t.lookup(np.arange(rows)), t.local_state()

    results = run_ranks(2, body)
    mine, (ids0, _, state0) = results[0]
    expected = _torch_sparse_adam_rows(torch, w0, steps, lr, betas, eps, per_row=not every_row_every_step)
    np.testing.assert_allclose(mine, expected, rtol=2e-5, atol=2e-6)
    assert not np.array_equal(mine, w0)
    # the last float of a row's state is its update count
    counts = {r: sum(int(r in ids) for ids, _ in steps) for r in range(rows)}
    assert [int(c) for c in state0[:, 2 * dim]] == [counts[r] for r in ids0]
    if not every_row_every_step:
        # a single SparseAdam (step count = the optimizer's) gives other rows: the test tells them apart
        global_count = _torch_sparse_adam_rows(torch, w0, steps, lr, betas, eps, per_row=False)
        assert not np.allclose(mine, global_count, rtol=2e-5, atol=2e-6)


def test_adam_checkpoint_refused_by_another_optimizer(tmp_path):
    def body(comm, rank):
        with make(comm, optimizer="adam") as t:
            train(t, rank, comm.size, 1)
            t.save(tmp_path)
        with make(comm, optimizer="row_adagrad") as t:
            with pytest.raises(gs.GradsyncError) as info:
                t.load(tmp_path)
            assert info.value.status == gs.E_MISMATCH and "(Adam, 13 floats per row)" in str(info.value)
        for betas in ((1.0, 0.999), (0.9, -0.1), (0.9, float("nan"))):
            with pytest.raises(gs.GradsyncError) as info:
                make(comm, optimizer="adam", betas=betas)
            assert info.value.status == gs.E_INVALID_ARG and "beta1 and beta2 must be in [0, 1)" in str(info.value)

    run_ranks(2, body)


@pytest.mark.parametrize("in_files", [False, True], ids=["memory", "files"])
def test_reshard_after_a_loss_restores_from_the_checkpoint_then_grows_back_in_memory(tmp_path, in_files):
    # 4 ranks, checkpoint at step 2, rank 1 goes after step 4. The survivors shrink; without the
    # checkpoint the reshard names the lost rows (E_LOST, on every survivor, nothing changed); with
    # it every row comes from the checkpoint (step 2) and they replay. Grown back to 4 with a
    # joiner whose rows come in memory, then changed to the hash rule in place, the table ends
    # bitwise equal to one process's. In files (one directory for every rank): each reshard leaves
    # exactly the new layout's shard files, which a table created again reopens with their rows.
    import threading
    import uuid

    ckpt, steps, loss_at, grow_at = tmp_path / "ckpt", 9, 4, 6
    shards = tmp_path / "shards" if in_files else None
    join_name = f"py-emb-grow-{uuid.uuid4().hex[:8]}"
    ref_values, ref_state = reference("row_adagrad", steps)
    finals = {}
    listings = {}

    def layout_files(size):
        return sorted(f"shard-{r}-of-{size}{ext}" for r in range(size) for ext in (".params", ".state", ".grad"))

    def finish(table, comm):
        moved, restored = table.reshard(comm, sharding="hash")
        assert not restored
        train(table, comm.rank, 4, steps, 8)
        finals[comm.member_id] = table.local_state()
        if in_files:
            table.close()
            comm.barrier()  # every rank's files closed, and the listing final
            with make(comm, sharding="hash", directory=shards) as again:
                reopened = again.local_state()
            assert all(np.array_equal(a.view(np.uint32) if a.dtype != np.int64 else a,
                                      b.view(np.uint32) if b.dtype != np.int64 else b)
                       for a, b in zip(reopened, finals[comm.member_id]))
            listings["end"] = sorted(p.name for p in shards.iterdir())

    def member(comm, rank):
        table = make(comm, directory=shards)
        train(table, rank, 4, 2)
        table.save(ckpt)
        train(table, rank, 4, loss_at, 2)
        shrunk = leave_or_shrink(table, comm, rank, 1, loss_at)
        if shrunk is None:
            return None
        with pytest.raises(gs.GradsyncError, match=r"old rank 1's rows \[75, 150\)") as lost:
            table.reshard(shrunk)
        assert lost.value.status == -19 and table.steps == loss_at  # GRADSYNC_E_LOST
        moved, restored = table.reshard(shrunk, checkpoint=ckpt)
        assert restored and moved == 0 and table.steps == 2
        if in_files:
            shrunk.barrier()
            listings["shrunk"] = sorted(p.name for p in shards.iterdir())
        train(table, shrunk.rank, 3, grow_at, 2)  # the replay, then on
        grown, _ = shrunk.grow(join_name, 1)
        moved, restored = table.reshard(grown)
        assert not restored and table.steps == grow_at
        train(table, grown.rank, 4, 8, grow_at)
        finish(table, grown)
        table.close()
        grown.close()
        shrunk.close()
        return True

    def joiner():
        comm, _ = gs.Communicator.join(join_name, 0, 1, timeout_ms=60000)
        with comm:
            table = make(comm, directory=shards)
            moved, restored = table.reshard(comm)
            assert moved > 0 and not restored and table.steps == grow_at
            train(table, comm.rank, 4, 8, grow_at)
            finish(table, comm)
            table.close()

    t = threading.Thread(target=joiner)
    t.start()
    run_ranks(4, member)
    t.join(timeout=60)
    assert len(finals) == 4
    values, state = gather_rows(list(finals.values()))
    assert np.array_equal(values.view(np.uint32), ref_values.view(np.uint32))
    assert np.array_equal(state.view(np.uint32), ref_state.view(np.uint32))
    if in_files:
        assert listings == {"shrunk": layout_files(3), "end": layout_files(4)}


def test_a_failed_reshard_in_files_leaves_the_old_shard_files_alone(tmp_path):
    # 3 ranks in files, rank 2 lost after a checkpoint. A reshard from a checkpoint of another shape
    # fails on every survivor after building its new shard's files: those go, the old ones stay
    # byte for byte, and so do the rows; the reshard from the right checkpoint then succeeds.
    shards, ckpt, other = tmp_path / "shards", tmp_path / "ckpt", tmp_path / "other"

    def member(comm, rank):
        table = make(comm, directory=shards)
        train(table, rank, 3, 2)
        table.save(ckpt)
        with gs.ShardedEmbeddingTable(comm, ROWS, DIM + 1, optimizer="row_adagrad", lr=0.05) as wider:
            wider.save(other)
        if rank == 2:
            table.close()
            return None
        with pytest.raises(gs.GradsyncError):
            table.push(*[a[:0] for a in global_batch(2)])
        shrunk, failed, _ = comm.shrink()
        with shrunk:
            assert failed == [2]
            shrunk.barrier()
            before = {p.name: p.read_bytes() for p in shards.iterdir()}
            held = table.local_state()
            with pytest.raises(gs.GradsyncError) as info:
                table.reshard(shrunk, checkpoint=other)
            assert info.value.status == gs.E_MISMATCH
            shrunk.barrier()
            assert {p.name: p.read_bytes() for p in shards.iterdir()} == before
            assert all(np.array_equal(a, b) for a, b in zip(table.local_state(), held))
            moved, restored = table.reshard(shrunk, checkpoint=ckpt)
            assert restored and table.steps == 2
            shrunk.barrier()
            names = sorted(p.name for p in shards.iterdir())
            assert names == sorted(f"shard-{r}-of-2{e}" for r in range(2) for e in (".params", ".state", ".grad"))
            table.close()
        return True

    assert run_ranks(3, member) == [True, True, None]


def test_planned_shrink_goes_through_a_fresh_checkpoint(tmp_path):
    # Rank 3 leaves by plan: the group saves, the stayers split off and reshard with that
    # checkpoint (the leaver's rows are not on a stayer), so every row comes from it and nothing
    # needs replaying; they train on 3 ranks to one process's table.
    ckpt, steps = tmp_path / "ckpt", 5
    ref_values, ref_state = reference("row_adagrad", steps)

    def member(comm, rank):
        table = make(comm, sharding="hash")
        train(table, rank, 4, 3)
        table.save(ckpt)
        stayers = comm.split(None if rank == 3 else 0)
        if stayers is None:
            table.close()
            return None
        with stayers:
            moved, restored = table.reshard(stayers, sharding="contiguous", checkpoint=ckpt)
            assert restored and table.steps == 3
            train(table, stayers.rank, 3, steps, 3)
            result = table.local_state()
            table.close()
        return result

    parts = [p for p in run_ranks(4, member) if p is not None]
    assert len(parts) == 3
    values, state = gather_rows(parts)
    assert np.array_equal(values.view(np.uint32), ref_values.view(np.uint32))
    assert np.array_equal(state.view(np.uint32), ref_state.view(np.uint32))


def test_replicas_carry_a_lost_ranks_rows_through_a_reshard_without_a_checkpoint():
    # replicas=1, 4 ranks, Adam: rank 2 goes after step 3; the survivors' reshard with no checkpoint
    # takes its rows from rank 3's replica, in memory, at the same step, and the table ends
    # bitwise equal to one process's. A bad replicas count is refused at creation.
    steps, loss_at = 6, 3
    ref_values, ref_state = reference("adam", steps)
    finals = {}

    def member(comm, rank):
        with pytest.raises(gs.GradsyncError, match=r"replicas must be in \[0, 64\], got 65"):
            make(comm, optimizer="adam", replicas=65)
        table = make(comm, optimizer="adam", replicas=1)
        train(table, rank, 4, loss_at)
        shrunk = leave_or_shrink(table, comm, rank, 2, loss_at)
        if shrunk is None:
            return None
        moved, restored = table.reshard(shrunk)
        assert not restored and table.steps == loss_at
        train(table, shrunk.rank, 3, steps, loss_at)
        finals[shrunk.rank] = table.local_state()
        table.close()
        shrunk.close()
        return True

    run_ranks(4, member)
    assert len(finals) == 3
    values, state = gather_rows(list(finals.values()))
    assert np.array_equal(values.view(np.uint32), ref_values.view(np.uint32))
    assert np.array_equal(state.view(np.uint32), ref_state.view(np.uint32))
