# SPDX-License-Identifier: Apache-2.0
"""gradsync.torch.elastic on shared memory: a rank of a training run is killed (a real SIGKILL of
its process, at a chosen step), and the survivors shrink, reshard or rebuild, and go on from the
last commit; their final weights are compared bit for bit with runs that never lost a rank."""
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import signal
import time
import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gradsync as gs  # noqa: E402
from conftest import run_ranks  # noqa: E402
from elastic_model import exact_grad, net  # noqa: E402

BOUND_S = 120  # a hang fails the test rather than blocking the suite
STEPS, KILL_AT, VICTIM = 6, 3, 2


def _group(tag):
    return f"py-el-{tag}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _run(target, nranks, *args):
    """nranks spawned processes target(rank, nranks, queue, *args); returns ({rank: result}, exit codes)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, nranks, q) + args) for r in range(nranks)]
    for p in procs:
        p.start()
    results = {}
    try:
        # Results first (a child cannot exit while its queue is full), then the exits.
        deadline = time.monotonic() + BOUND_S
        while len(results) < nranks and not all(p.exitcode is not None for p in procs):
            if time.monotonic() > deadline:
                pytest.fail(f"no result from ranks {sorted(set(range(nranks)) - set(results))} after {BOUND_S} s")
            try:
                rank, value = q.get(timeout=1.0)
                results[rank] = value
            except queue_module.Empty:
                pass
        for p in procs:
            p.join(BOUND_S)
            if p.is_alive():
                pytest.fail(f"a rank still ran after {BOUND_S} s")
        while True:
            try:
                rank, value = q.get(timeout=0.5)
                results[rank] = value
            except queue_module.Empty:
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return results, [p.exitcode for p in procs]


def zero_train(comm, replicas, victim=None, kill_at=None, steps=STEPS, seen=None):
    """ZeRO-1 Adam with the elastic helper; the victim SIGKILLs itself before its step kill_at.
    seen["committed"]: the weights at the last commit."""
    from gradsync.torch import ZeroRedundancyOptimizer, elastic

    model = net()
    opt = ZeroRedundancyOptimizer(model.parameters(), comm, optimizer="adam", lr=0.01, replicas=replicas)
    state = elastic.State(comm, model, opt)

    @elastic.run
    def train(state):
        while state.step < steps:
            if state.comm.rank == victim and state.step == kill_at and not state.recoveries:
                os.kill(os.getpid(), signal.SIGKILL)
            for i, p in enumerate(model.parameters()):
                p.grad = exact_grad(state.step, p.shape, i)
            state.optimizer.step()
            state.step += 1
            state.commit()
            if seen is not None:
                seen["committed"] = [p.detach().numpy().copy() for p in model.parameters()]
                seen["model"] = model

    train(state)
    return [p.detach().numpy().copy() for p in model.parameters()], state.recoveries, opt.shard.updates, state.comm.size


def _zero_rank(rank, size, q, group, replicas):
    torch.set_num_threads(1)
    seen = {}
    try:
        with gs.Communicator(group, rank, size, timeout_ms=20000, transport="shm") as comm:
            weights, recoveries, updates, final_size = zero_train(comm, replicas, VICTIM, KILL_AT, seen=seen)
            q.put((rank, ("ok", weights, recoveries, updates, final_size)))
    except gs.GradsyncError as e:
        # What the failed recovery left of the weights: the last commit's, never zeros.
        now = [p.detach().numpy() for p in seen["model"].parameters()]
        kept = all(np.array_equal(a, b) for a, b in zip(now, seen["committed"]))
        q.put((rank, ("error", e.status, str(e), kept)))


def test_zero_optimizer_after_a_sigkill_goes_on_bit_for_bit():
    results, codes = _run(_zero_rank, 4, _group("zero"), 1)
    assert codes[VICTIM] == -signal.SIGKILL and VICTIM not in results
    assert [codes[r] for r in (0, 1, 3)] == [0, 0, 0], (codes, results)
    # Never lost a rank: 3 ranks, which step through the same bits as 4 (see exact_grad).
    ref = run_ranks(3, lambda comm, rank: zero_train(comm, 0)[0])[0]
    for r in (0, 1, 3):
        status, weights, recoveries, updates, final_size = results[r]
        assert status == "ok"
        assert updates == STEPS and final_size == 3
        assert len(recoveries) == 1
        rec = recoveries[0]
        assert rec["failed"] == [[VICTIM]] and rec["size"] == 3 and rec["member_id"] == r
        assert rec["moved_floats"] > 0 and "first_step_s" in rec
        for got, want in zip(weights, ref):
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (r, rec, np.abs(got - want).max())


def test_zero_optimizer_without_replicas_names_the_lost_range_and_keeps_the_weights():
    results, codes = _run(_zero_rank, 3, _group("lost"), 0)
    assert codes[VICTIM] == -signal.SIGKILL
    for r in (0, 1):
        assert results[r][0] == "error", results[r]
        _, status, message, kept = results[r]
        assert status == gs.E_LOST
        assert "old rank 2" in message, message
        assert kept


# ---------------------------------------------------------------- DistributedDataParallel


def batch(step, rank, size):
    """The global batch of a step (24 rows: 4 and 3 ranks take 6 and 8 each), rank's rows."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(24, 8, generator=g)
    y = torch.randint(0, 3, (24,), generator=g)
    return x[rank::size], y[rank::size]


def ddp_train(comm, start=None, victim=None, kill_at=None, steps=STEPS):
    """DDP over a torch Adam with the elastic helper, from `start` (module and optimizer state
    dicts and step) or from scratch; returns the final parameters, the recoveries and the commit at
    kill_at (the state a run on the survivors alone would start from)."""
    from gradsync.torch import DistributedDataParallel, elastic

    module = net()
    opt = torch.optim.Adam(module.parameters(), lr=0.01)
    step = 0
    if start is not None:
        module.load_state_dict(start["module"])
        opt.load_state_dict(start["optimizer"])
        step = start["step"]
    model = DistributedDataParallel(module, comm, bucket_cap_mb=1e-4)  # several buckets
    state = elastic.State(comm, model, opt, step=step)
    committed = {}

    @elastic.run
    def train(state):
        while state.step < steps:
            if state.step == kill_at and not committed:
                committed.update(module={k: v.clone() for k, v in module.state_dict().items()},
                                 optimizer=opt.state_dict(), step=state.step)
                if state.comm.rank == victim:
                    os.kill(os.getpid(), signal.SIGKILL)
            x, y = batch(state.step, state.comm.rank, state.comm.size)
            state.optimizer.zero_grad()
            torch.nn.functional.cross_entropy(state.model(x), y).backward()
            state.optimizer.step()
            state.step += 1
            state.commit()

    train(state)
    return [p.detach().numpy().copy() for p in module.parameters()], state.recoveries, committed


def _ddp_rank(rank, size, q, group):
    torch.set_num_threads(1)
    with gs.Communicator(group, rank, size, timeout_ms=20000, transport="shm") as comm:
        weights, recoveries, committed = ddp_train(comm, victim=VICTIM, kill_at=KILL_AT)
        # Pickled here: a queue would share the tensors' memory with a process about to exit.
        q.put((rank, (weights, recoveries, pickle.dumps(committed))))


def test_ddp_after_a_sigkill_goes_on_as_the_survivors_alone_from_the_commit():
    results, codes = _run(_ddp_rank, 4, _group("ddp"))
    assert codes[VICTIM] == -signal.SIGKILL
    assert [codes[r] for r in (0, 1, 3)] == [0, 0, 0], (codes, results)
    start = pickle.loads(results[0][2])
    # 3 ranks (threads) from the commit the survivors went back to, with the same global batches.
    ref = run_ranks(3, lambda comm, rank: ddp_train(comm, start=start)[0])[0]
    for r in (0, 1, 3):
        weights, recoveries, _ = results[r]
        assert len(recoveries) == 1 and recoveries[0]["failed"] == [[VICTIM]]
        assert recoveries[0]["size"] == 3
        for got, want in zip(weights, ref):
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


# ---------------------------------------------------------------- growing back


GROW_AT, GROWN_STEPS = 5, 8


def grow_with_a_joiner(members, member, join_body):
    """member(comm, rank) on `members` threads, join_body() on a thread of its own (which joins
    them); returns the members' results and the joiner's, or raises the joiner's error."""
    import threading

    joined = {}

    def joiner():
        try:
            joined["out"] = join_body()
        except BaseException as e:  # reported below
            joined["error"] = e

    t = threading.Thread(target=joiner)
    t.start()
    got = run_ranks(members, member)
    t.join(timeout=60)
    assert "error" not in joined, joined.get("error")
    return got, joined["out"]


def test_shrink_then_grow_back_on_threads_matches_an_undisturbed_run():
    from gradsync.torch import ZeroRedundancyOptimizer, elastic

    join_name = f"py-el-grow-{uuid.uuid4().hex[:8]}"

    def build(comm, joining=False):
        model = net()
        return model, ZeroRedundancyOptimizer(model.parameters(), comm, optimizer="adam", lr=0.01, replicas=1,
                                              joining=joining)

    def loop(state, until, leave=None):
        while state.step < until:
            if leave is not None and state.step == leave:
                return False
            # A schedule: the joiner builds its optimizer with the starting rate, and takes the members'.
            state.optimizer.param_groups[0]["lr"] = 0.01 if state.step < 2 else 0.005
            for i, p in enumerate(state.model.parameters()):
                p.grad = exact_grad(state.step, p.shape, i)
            state.optimizer.step()
            state.step += 1
            state.commit()
        return True

    def member(comm, rank):
        model, opt = build(comm)
        state = elastic.State(comm, model, opt)
        train = elastic.run(loop)
        if not train(state, GROW_AT, leave=KILL_AT if rank == VICTIM else None):
            opt.close()  # this member goes: on threads, a rank whose communicator is freed
            return None
        assert state.comm.size == 3 and len(state.recoveries) == 1
        record = state.grow(join_name, 1)
        assert record["size"] == 4 and record["first_member_id"] == 4
        train(state, GROWN_STEPS)
        out = [p.detach().numpy().copy() for p in model.parameters()], state.comm.rank, state.comm.member_id
        if state.comm is not comm:
            state.comm.close()
        return out

    def joiner():
        state = elastic.join(join_name, build, transport="threads", timeout_ms=60000)
        step = state.step
        elastic.run(loop)(state, GROWN_STEPS)
        out = [p.detach().numpy().copy() for p in state.model.parameters()], state.comm.rank
        state.comm.close()
        return step, out

    got, (joined_step, joined_out) = grow_with_a_joiner(4, member, joiner)
    def undisturbed(comm, rank):
        model, opt = build(comm)
        loop(elastic.State(comm, model, opt), GROWN_STEPS)
        return [p.detach().numpy().copy() for p in model.parameters()]

    ref = run_ranks(4, undisturbed)[0]
    assert got[VICTIM] is None and joined_step == GROW_AT and joined_out[1] == 3
    for weights in [got[r][0] for r in (0, 1, 3)] + [joined_out[0]]:
        for a, b in zip(weights, ref):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_train_elastic_grows_once_per_lost_member_and_only_with_a_replacement():
    import types

    from train_elastic import grow_due

    def state(step, failed, grows):
        return types.SimpleNamespace(step=step, recoveries=[{"failed": f} for f in failed], grows=[{}] * grows)

    lost_one = [[[2]]]
    assert grow_due(state(200, lost_one, 0), 200, True)
    assert not grow_due(state(199, lost_one, 0), 200, True)  # not yet
    assert not grow_due(state(200, lost_one, 0), 200, False)  # no replacement comes
    assert not grow_due(state(200, lost_one, 0), -1, True)  # never
    assert not grow_due(state(300, lost_one, 1), 200, True)  # already grown back
    # A recovery that removed nobody (a failed grow, a slow peer) asks for no other grow.
    assert not grow_due(state(300, lost_one + [[[]]], 1), 200, True)
    # Two lost in one recovery (its second shrink): two grows.
    assert grow_due(state(300, [[[1], [2]]], 1), 200, True)
    assert not grow_due(state(300, [[[1], [2]]], 2), 200, True)


def test_run_raises_the_error_when_its_recovery_found_nobody_lost():
    from gradsync.torch import elastic

    calls, nobody = [], f"py-el-nobody-{uuid.uuid4().hex[:8]}"

    def grow_nobody_joins(state):
        calls.append(state.comm.rank)
        state.grow(nobody, 1)

    def body(comm, rank):
        state = elastic.State(comm)
        with pytest.raises(gs.GradsyncError) as err:
            elastic.run(grow_nobody_joins)(state)
        assert err.value.status in elastic.RECOVERABLE
        assert [r["failed"] for r in state.recoveries] == [[[]]] and state.comm.size == 2
        state.comm.close()
        return True

    assert run_ranks(2, body, timeout_ms=500) == [True, True]
    assert sorted(calls) == [0, 1]  # one try each, no retry


def test_train_elastic_rank_main_without_replace_finishes_on_3_ranks(tmp_path):
    """The docstring's command: without --replace nobody comes, so the survivors never grow."""
    import json
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(here, "..", "..", "scripts", "train_elastic.py")
    done = subprocess.run([sys.executable, "-m", "gradsync.run", "-n", "4", "--elastic", "--no-tag-output",
                           script, "--rank-main", "--epochs", "1", "--kill-step", "3", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=BOUND_S)
    assert done.returncode == 0, done.stderr
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank.*.json"))]
    assert [r["member_id"] for r in results] == [0, 1, 3]
    assert all(r["size"] == 3 and r["grows"] == [] and len(r["recoveries"]) == 1 for r in results)


# ---------------------------------------------------------------- sharded embedding tables

EMB_ROWS, EMB_DIM = 40, 4


def emb_batch(step, rank, size):
    """The global batch of a step (24 ids and labels), rank's share."""
    g = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(0, EMB_ROWS, (24,), generator=g)
    y = torch.randint(0, 3, (24,), generator=g)
    return ids[rank::size], y[rank::size]


def emb_tables(comm, tables=1, directory=None):
    """`tables` row_adagrad ShardedEmbeddings (their shards in files under `directory` if given)."""
    from gradsync.torch import ShardedEmbedding

    return [ShardedEmbedding(comm, EMB_ROWS, EMB_DIM, optimizer="row_adagrad", lr=0.1, init="uniform", seed=3 + i,
                             directory=None if directory is None else os.path.join(directory, f"t{i}"))
            for i in range(tables)]


def emb_build(comm, joining=False, start=None, directory=None, tables=1):
    """emb_tables beside a DistributedDataParallel dense part (Adam), from `start` (dense state
    dicts and the tables' checkpoint directories) or from scratch."""
    from gradsync.torch import DistributedDataParallel

    embeddings = emb_tables(comm, tables, directory)
    dense = torch.nn.Linear(EMB_DIM, 3)
    with torch.no_grad():
        rng = np.random.default_rng(1)
        for p in dense.parameters():
            p.copy_(torch.from_numpy((rng.standard_normal(p.shape) * 0.5).astype(np.float32)))
    opt = torch.optim.Adam(dense.parameters(), lr=0.01)
    if start is not None:
        dense.load_state_dict(start["module"])
        opt.load_state_dict(start["optimizer"])
        for emb, d in zip(embeddings, start["tables"]):
            emb.table.load(d)
    return DistributedDataParallel(dense, comm, bucket_cap_mb=1e-4), opt, embeddings


def emb_loop(state, until, victim=None, kill_at=None, after=None):
    """Train to step `until`; the victim SIGKILLs itself at kill_at after its optimizer step (its
    pushes applied on every rank), before the commit. after: (state.step, the first table's steps)
    at the start of each call that follows a recovery. The features are the sum of the tables' rows."""
    if after is not None and len(after) < len(state.recoveries):
        after.append((state.step, state.embeddings[0].table.steps))
    while state.step < until:
        ids, y = emb_batch(state.step, state.comm.rank, state.comm.size)
        state.optimizer.zero_grad()
        x = sum(emb(ids) for emb in state.embeddings)
        torch.nn.functional.cross_entropy(state.model(x), y).backward()
        state.optimizer.step()
        if state.comm.rank == victim and state.step == kill_at and not state.recoveries:
            os.kill(os.getpid(), signal.SIGKILL)
        state.step += 1
        state.commit()


def committed_tables(ckpt):
    """The directories of the tables at the last complete commit of a State's checkpoint_dir."""
    from gradsync.torch import elastic

    return elastic.committed(ckpt)["directories"]


def emb_rows(parts):
    """Every rank's (ids, values, state) of a table: values and state by global id."""
    ids = np.concatenate([p[0] for p in parts])
    order = np.argsort(ids, kind="stable")
    assert np.array_equal(ids[order], np.arange(EMB_ROWS))  # each row on exactly one rank
    return np.concatenate([p[1] for p in parts])[order], np.concatenate([p[2] for p in parts])[order]


def emb_run(comm, ckpt, until, start=None, step=0, victim=None, kill_at=None, lr=None, directory=None, tables=1,
            full_every=64):
    """emb_loop from emb_build(start) at `step` (the tables' learning rate then lr if given); this
    rank's rows of each table, the dense weights and state dicts (emb_dense), the recoveries and
    (step, table steps) after each recovery."""
    from gradsync.torch import elastic

    model, opt, embeddings = emb_build(comm, start=start, directory=directory, tables=tables)
    for emb in embeddings if lr is not None else ():
        emb.table.set_lr(lr)
    state = elastic.State(comm, model, opt, embeddings=embeddings, checkpoint_dir=ckpt, step=step,
                          full_every=full_every)
    after = []
    elastic.run(emb_loop)(state, until, victim, kill_at, after)
    assert all(emb.table.steps == state.step for emb in embeddings)
    return [emb.table.local_state() for emb in embeddings], *emb_dense(model, opt), state.recoveries, after


def emb_dense(model, opt):
    """The dense part's weights, and its state dicts pickled (they share tensors' memory otherwise)."""
    weights = [p.detach().numpy().copy() for p in model.module.parameters()]
    return weights, pickle.dumps({"module": model.module.state_dict(), "optimizer": opt.state_dict()})


def _emb_rank(rank, size, q, group, ckpt, directory=None):
    torch.set_num_threads(1)
    with gs.Communicator(group, rank, size, timeout_ms=20000, transport="shm") as comm:
        rows, weights, _, recoveries, after = emb_run(comm, ckpt, STEPS, victim=VICTIM, kill_at=KILL_AT,
                                                      directory=directory)
        q.put((rank, (rows, weights, recoveries, after)))


@pytest.mark.parametrize("in_files", [False, True], ids=["memory", "files"])
def test_embedding_after_a_sigkill_comes_back_from_the_commit_and_goes_on_bit_for_bit(tmp_path, in_files):
    shards = str(tmp_path / "shards") if in_files else None
    results, codes = _run(_emb_rank, 4, _group("emb"), str(tmp_path / "run"), shards)
    assert codes[VICTIM] == -signal.SIGKILL
    assert [codes[r] for r in (0, 1, 3)] == [0, 0, 0], (codes, results)
    # The reference: 4 ranks (threads) to the commit, then 3 from it, with the same global
    # batches; the table's state after a sequence of pushes does not depend on the ranks' count,
    # and DDP's means over 4, then 3 ranks are those of the survivors.
    first = run_ranks(4, lambda comm, rank: emb_run(comm, str(tmp_path / "ref1"), KILL_AT))
    start = pickle.loads(first[0][2])
    start["tables"] = committed_tables(tmp_path / "ref1")
    ref = run_ranks(3, lambda comm, rank: emb_run(comm, str(tmp_path / "ref2"), STEPS, start=start, step=KILL_AT))
    ref_values, ref_state = emb_rows([r[0][0] for r in ref])
    values, state = emb_rows([results[r][0][0] for r in (0, 1, 3)])
    for r in (0, 1, 3):
        _, weights, recoveries, after = results[r]
        assert len(recoveries) == 1 and recoveries[0]["failed"] == [[VICTIM]] and recoveries[0]["size"] == 3
        assert recoveries[0]["tables_restored"] == 1 and recoveries[0]["reshard_s"] > 0
        # Back to the commit: the survivors had applied step KILL_AT's pushes, the table forgot them.
        assert after == [(KILL_AT, KILL_AT)], after
        for got, want in zip(weights, ref[0][1]):
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(values.view(np.uint32), ref_values.view(np.uint32)), np.abs(values - ref_values).max()
    assert np.array_equal(state.view(np.uint32), ref_state.view(np.uint32))
    if in_files:  # the survivors' layout only: the old one's files went with the reshard
        names = sorted(os.listdir(os.path.join(shards, "t0")))
        assert names and all("-of-3." in n for n in names), names


def same_bits(a, b):
    """Bit for bit: arrays, tensors, and dicts, lists and tuples of them (an optimizer's state dict)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        a, b = a.detach().numpy(), b.detach().numpy()
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return a == b


def tables_of(states):
    """Each table's (values, state) by global id from every rank's emb_run rows."""
    return [emb_rows([s[i] for s in states]) for i in range(len(states[0]))]


FULL_EVERY = 2  # commits into gen0 / gen1 in turn: c0 full, c1 full, c2 layer on c0, c3 layer on c1, c4 full...


def _in_commit_rank(rank, size, q, group, ckpt, kill_step, where, victim, directory):
    """emb_run with two tables; the victim dies in the commit of step kill_step: where="second_save":
    after the first table's save (on every rank: each save ends in an agreement), before the
    second's; "after_marker" (rank 0): once it wrote the marker, before the others learn it."""
    from gradsync.torch import elastic

    torch.set_num_threads(1)
    with gs.Communicator(group, rank, size, timeout_ms=20000, transport="shm") as comm:
        model, opt, embeddings = emb_build(comm, directory=directory, tables=2)
        second = embeddings[1].table
        if rank == victim and where == "second_save":
            def dying(save):
                def wrapper(d):
                    if second.steps == kill_step:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return save(d)
                return wrapper
            second.save, second.save_incremental = dying(second.save), dying(second.save_incremental)
        if rank == victim and where == "after_marker":
            write = elastic._write_marker_file

            def write_and_die(root, doc):
                write(root, doc)
                if doc["step"] == kill_step:
                    os.kill(os.getpid(), signal.SIGKILL)
            elastic._write_marker_file = write_and_die
        state = elastic.State(comm, model, opt, embeddings=embeddings, checkpoint_dir=ckpt, full_every=FULL_EVERY)
        at = []

        @elastic.run
        def train(state):
            if state.recoveries and not at:  # what the recovery went back to
                at.append((state.step, [e.table.steps for e in embeddings], [e.table.local_state() for e in embeddings],
                           *emb_dense(model, opt)))
            emb_loop(state, STEPS)

        train(state)
        q.put((rank, (at[0], [e.table.local_state() for e in embeddings], emb_dense(model, opt)[0],
                      state.recoveries)))


@pytest.mark.parametrize("kill_step,where,victim,back", [(3, "second_save", VICTIM, 2), (4, "second_save", VICTIM, 3),
                                                        (3, "after_marker", 0, 3)],
                         ids=["incremental", "full", "rank0_after_marker"])
def test_embedding_loss_in_a_commit_goes_back_to_the_last_complete_commit(tmp_path, kill_step, where, victim, back):
    # Commit n goes into gen(n % 2). The commit of step 3 stacks layers on gen1's step-1 save, that
    # of step 4 saves gen0 in full (FULL_EVERY): either way the other generation holds the last
    # complete commit, step kill_step - 1, whole, though one table of the dying commit is saved.
    # Rank 0 lost once the marker names the commit: the survivors, who hold it as the one they were
    # saving, take it.
    ckpt = str(tmp_path / "run")
    results, codes = _run(_in_commit_rank, 4, _group("commit"), ckpt, kill_step, where, victim,
                          str(tmp_path / "shards"))
    survivors = [r for r in range(4) if r != victim]
    assert codes[victim] == -signal.SIGKILL
    assert [codes[r] for r in survivors] == [0, 0, 0], (codes, results)
    # The reference: 4 ranks (threads) to the last complete commit; then 3 from it.
    first = run_ranks(4, lambda comm, rank: emb_run(comm, str(tmp_path / "ref1"), back, tables=2,
                                                    full_every=FULL_EVERY))
    start = pickle.loads(first[0][2])
    start["tables"] = committed_tables(tmp_path / "ref1")
    ref = run_ranks(3, lambda comm, rank: emb_run(comm, str(tmp_path / "ref2"), STEPS, start=start, step=back,
                                                  tables=2))
    for r in survivors:
        (step, steps, _, weights, dicts), _, final_weights, recoveries = results[r]
        assert len(recoveries) == 1 and recoveries[0]["failed"] == [[victim]] and recoveries[0]["size"] == 3
        assert recoveries[0]["tables_restored"] == 2 and recoveries[0]["generation"] == back % 2
        assert (step, steps) == (back, [back, back])
        assert same_bits(weights, first[0][1]) and same_bits(pickle.loads(dicts), pickle.loads(first[0][2]))
        assert same_bits(final_weights, ref[0][1])
    at = tables_of([results[r][0][2] for r in survivors])
    assert same_bits(at, tables_of([f[0] for f in first]))
    assert same_bits(tables_of([results[r][1] for r in survivors]), tables_of([f[0] for f in ref]))
    # The reference's last commit was a layer on its generation's full save: the next commit into
    # the other one was a layer on its full save (kill 3) or, FULL_EVERY reached, a full save (kill 4).
    from gradsync.torch import elastic

    marker = elastic.committed(tmp_path / "ref1")
    assert (marker["step"], marker["generation"], marker["layers"]) == (back, back % 2, [1, 1] if back > 1 else [0, 0])


class ZeroEmbNet(torch.nn.Module):
    """A ShardedEmbedding in the model, a dense layer on it: what a ZeroRedundancyOptimizer steps."""

    def __init__(self, comm, directory=None):
        super().__init__()
        self.emb = emb_tables(comm, 1, directory)[0]
        self.dense = torch.nn.Linear(EMB_DIM, 3)
        with torch.no_grad():
            rng = np.random.default_rng(1)
            for p in self.dense.parameters():
                p.copy_(torch.from_numpy((rng.standard_normal(p.shape) * 0.5).astype(np.float32)))

    def forward(self, ids):
        return self.dense(self.emb(ids))


def zero_emb_build(comm, joining=False, start=None, directory=None):
    """ZeroEmbNet and a ZeroRedundancyOptimizer (Adam, replicas=1) over its dense part, from `start`
    (the dense weights, the optimizer's consolidated state dict, the table's checkpoint) or scratch."""
    from gradsync.torch import ZeroRedundancyOptimizer

    model = ZeroEmbNet(comm, directory)
    if start is not None:
        model.dense.load_state_dict(start["dense"])
        model.emb.table.load(start["table"])
    opt = ZeroRedundancyOptimizer(model.parameters(), comm, optimizer="adam", lr=0.01, replicas=1, joining=joining)
    if start is not None:
        opt.load_state_dict(start["optimizer"])
    return model, opt


def zero_emb_state(state):
    """Collective: the step, the table's steps and this rank's rows, the dense weights and the
    optimizer's consolidated state dict, pickled."""
    state.optimizer.consolidate_state_dict(to=None)
    model = state.model
    return pickle.dumps((state.step, model.emb.table.steps, model.emb.table.local_state(),
                         {k: v.clone() for k, v in model.dense.state_dict().items()}, state.optimizer.state_dict()))


def zero_emb_run(comm, ckpt, until, start=None, step=0, victim=None, kill_at=None):
    """Train to `until`; the victim SIGKILLs itself at kill_at after its backward (its table's pushes
    applied on every rank), before the optimizer's step. Returns zero_emb_state at the start of the
    call after the recovery (None without one) and at the end."""
    from gradsync.torch import elastic

    model, opt = zero_emb_build(comm, start=start)
    state = elastic.State(comm, model, opt, checkpoint_dir=ckpt, step=step)
    at = []

    @elastic.run
    def train(state):
        if state.recoveries and not at:
            at.append(zero_emb_state(state))
        zero_emb_loop(state, until, victim, kill_at)

    train(state)
    return (at[0] if at else None), zero_emb_state(state), state.recoveries


def zero_emb_loop(state, until, victim=None, kill_at=None):
    while state.step < until:
        ids, y = emb_batch(state.step, state.comm.rank, state.comm.size)
        state.optimizer.zero_grad()
        torch.nn.functional.cross_entropy(state.model(ids), y).backward()
        if state.comm.rank == victim and state.step == kill_at and not state.recoveries:
            os.kill(os.getpid(), signal.SIGKILL)
        state.optimizer.step()
        state.step += 1
        state.commit()


def _zero_emb_rank(rank, size, q, group, ckpt):
    torch.set_num_threads(1)
    with gs.Communicator(group, rank, size, timeout_ms=20000, transport="shm") as comm:
        q.put((rank, zero_emb_run(comm, ckpt, STEPS, victim=VICTIM, kill_at=KILL_AT)))


def test_zero_optimizer_with_a_table_after_a_sigkill_goes_back_to_the_commit_bit_for_bit(tmp_path):
    results, codes = _run(_zero_emb_rank, 4, _group("zeroemb"), str(tmp_path / "run"))
    assert codes[VICTIM] == -signal.SIGKILL
    assert [codes[r] for r in (0, 1, 3)] == [0, 0, 0], (codes, results)
    # The reference: 4 ranks (threads) to the commit; then 3 from its consolidated state.
    first = [pickle.loads(f[1]) for f in run_ranks(4, lambda comm, rank: zero_emb_run(comm, str(tmp_path / "r1"),
                                                                                      KILL_AT))]
    start = {"dense": first[0][3], "optimizer": first[0][4], "table": committed_tables(tmp_path / "r1")[0]}
    ref = [pickle.loads(f[1]) for f in run_ranks(3, lambda comm, rank: zero_emb_run(comm, str(tmp_path / "r2"),
                                                                                    STEPS, start=start, step=KILL_AT))]
    back = [pickle.loads(results[r][0]) for r in (0, 1, 3)]
    final = [pickle.loads(results[r][1]) for r in (0, 1, 3)]
    for r, b, f in zip((0, 1, 3), back, final):
        recoveries = results[r][2]
        assert len(recoveries) == 1 and recoveries[0]["failed"] == [[VICTIM]] and recoveries[0]["size"] == 3
        assert recoveries[0]["tables_restored"] == 1 and recoveries[0]["moved_floats"] > 0
        # Back at the commit: the table forgot the pushes of step KILL_AT, which the optimizer never took.
        assert b[:2] == (KILL_AT, KILL_AT) and f[:2] == (STEPS, STEPS)
        assert same_bits(b[3], first[0][3]) and same_bits(b[4], first[0][4])
        assert same_bits(f[3], ref[0][3]) and same_bits(f[4], ref[0][4])
    assert same_bits(emb_rows([b[2] for b in back]), emb_rows([f[2] for f in first]))
    assert same_bits(emb_rows([f[2] for f in final]), emb_rows([r[2] for r in ref]))


def _zero_emb_commit_rank(rank, size, q, group, ckpt):
    """zero_emb_run's victim dies in the commit after its step KILL_AT instead (the optimizer's step
    went through on every rank, the table's save had begun); the survivors report their error."""
    torch.set_num_threads(1)
    if rank == VICTIM:
        from gradsync.embedding import ShardedEmbeddingTable

        def dying(save):
            def wrapper(self, d):
                if self.steps == KILL_AT + 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                return save(self, d)
            return wrapper
        ShardedEmbeddingTable.save = dying(ShardedEmbeddingTable.save)
        ShardedEmbeddingTable.save_incremental = dying(ShardedEmbeddingTable.save_incremental)
    with gs.Communicator(group, rank, size, timeout_ms=20000, transport="shm") as comm:
        try:
            zero_emb_run(comm, ckpt, STEPS)
            q.put((rank, None))
        except RuntimeError as e:
            q.put((rank, str(e)))


def test_zero_optimizer_with_a_table_lost_in_the_commit_after_its_step_is_a_clear_error(tmp_path):
    # The optimizer's step cannot go back, the table cannot go forward (the lost rank's rows of
    # step KILL_AT + 1 exist nowhere): every survivor raises RuntimeError, none hangs or goes on.
    results, codes = _run(_zero_emb_commit_rank, 4, _group("zerocommit"), str(tmp_path / "run"))
    assert codes[VICTIM] == -signal.SIGKILL
    assert [codes[r] for r in (0, 1, 3)] == [0, 0, 0], (codes, results)
    for r in (0, 1, 3):
        assert results[r] is not None and "the optimizer applied step" in results[r] and "cannot follow" in results[r]


SHM_GROW_AT = 4  # the last commit before the grow in gen0: a joiner must take the next one's gen1 from the members


def _grow_rank(rank, size, q, group, join_name, ckpt, shards):
    """Ranks 0..size-2 train a ZeroEmbNet (its table in files) to SHM_GROW_AT and grow; the last one
    joins them; all train to GROWN_STEPS."""
    from gradsync.torch import elastic

    torch.set_num_threads(1)

    def build(comm, joining=False):
        return zero_emb_build(comm, joining, directory=shards)

    if rank == size - 1:
        state = elastic.join(join_name, build, transport="shm", timeout_ms=60000, checkpoint_dir=ckpt)
        before, record = None, None
    else:
        comm = gs.Communicator(group, rank, size - 1, timeout_ms=20000, transport="shm")
        state = elastic.State(comm, *build(comm), checkpoint_dir=ckpt)
        zero_emb_loop(state, SHM_GROW_AT)
        before = state.model.emb.table.local_state()
        record = state.grow(join_name, 1)
        comm.close()
    moved = state.step, state.model.emb.table.steps, state.model.emb.table.local_state()
    zero_emb_loop(state, GROWN_STEPS)
    out = zero_emb_state(state)
    state.comm.close()
    q.put((rank, (before, record, moved, out)))


def test_grow_on_shm_processes_with_a_table_in_files_moves_the_rows_and_goes_on_bit_for_bit(tmp_path):
    shards, ckpt = str(tmp_path / "shards"), str(tmp_path / "run")
    results, codes = _run(_grow_rank, 4, _group("grow"), f"py-el-shmgrow-{uuid.uuid4().hex[:8]}", ckpt, shards)
    assert codes == [0, 0, 0, 0], (codes, results)
    assert [results[r][1]["size"] for r in range(3)] == [4, 4, 4] and results[0][1]["first_member_id"] == 3
    # The rows moved in memory, bit for bit, and the joiner owns some.
    assert all(results[r][2][:2] == (SHM_GROW_AT, SHM_GROW_AT) for r in range(4)) and len(results[3][2][2][0]) > 0
    assert same_bits(emb_rows([results[r][0] for r in range(3)]), emb_rows([results[r][2][2] for r in range(4)]))
    names = os.listdir(os.path.join(shards, "t0"))
    assert names and all("-of-4." in n for n in names), names  # the old layout's files went
    # The reference: 3 ranks (threads) to SHM_GROW_AT, then 4 from its consolidated state.
    first = [pickle.loads(f[1]) for f in run_ranks(3, lambda comm, rank: zero_emb_run(comm, str(tmp_path / "r1"),
                                                                                      SHM_GROW_AT))]
    start = {"dense": first[0][3], "optimizer": first[0][4], "table": committed_tables(tmp_path / "r1")[0]}
    ref = [pickle.loads(f[1]) for f in run_ranks(4, lambda comm, rank: zero_emb_run(comm, str(tmp_path / "r2"),
                                                                                    GROWN_STEPS, start=start,
                                                                                    step=SHM_GROW_AT))]
    final = [pickle.loads(results[r][3]) for r in range(4)]
    for f in final:
        assert f[:2] == (GROWN_STEPS, GROWN_STEPS)
        assert same_bits(f[3], ref[0][3]) and same_bits(f[4], ref[0][4])
    assert same_bits(emb_rows([f[2] for f in final]), emb_rows([r[2] for r in ref]))
    # The grown group's commits saved the table in full, then in layers: the last is whole there.
    from gradsync.torch import elastic

    marker = elastic.committed(ckpt)
    assert marker["step"] == GROWN_STEPS and marker["table_steps"] == [GROWN_STEPS]

    def load(comm, rank):
        with gs.ShardedEmbeddingTable(comm, EMB_ROWS, EMB_DIM, optimizer="row_adagrad") as t:
            t.load(marker["directories"][0])
            return t.local_state()

    assert same_bits(emb_rows(run_ranks(2, load)), emb_rows([f[2] for f in final]))


def test_embedding_grow_moves_the_rows_bit_for_bit_and_training_goes_on(tmp_path):
    from gradsync.torch import elastic

    join_name, ckpt = f"py-el-embgrow-{uuid.uuid4().hex[:8]}", str(tmp_path / "grow")
    before, after = {}, {}

    def member(comm, rank):
        model, opt, embeddings = emb_build(comm)
        state = elastic.State(comm, model, opt, embeddings=embeddings, checkpoint_dir=ckpt)
        emb_loop(state, GROW_AT)
        embeddings[0].table.set_lr(0.05)  # the joiner made its table with 0.1: it takes the members'
        before[rank] = embeddings[0].table.local_state()
        record = state.grow(join_name, 1)
        assert record["size"] == 4
        after[state.comm.rank] = embeddings[0].table.local_state()
        emb_loop(state, GROWN_STEPS)
        out = embeddings[0].table.local_state(), state.step, embeddings[0].table.steps
        state.comm.close()
        return out

    def joiner():
        state = elastic.join(join_name, emb_build, transport="threads", timeout_ms=60000, checkpoint_dir=ckpt)
        table = state.embeddings[0].table
        at = state.step, table.steps
        after[state.comm.rank] = table.local_state()
        emb_loop(state, GROWN_STEPS)
        out = table.local_state(), state.step, table.steps
        state.comm.close()
        return at, out

    got, (joined_at, joined_out) = grow_with_a_joiner(3, member, joiner)
    assert joined_at == (GROW_AT, GROW_AT)
    assert sorted(after) == [0, 1, 2, 3] and len(after[3][0]) > 0  # the joiner owns rows now
    was, now = emb_rows(list(before.values())), emb_rows(list(after.values()))
    for a, b in zip(was, now):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    # Training went on over 4 ranks: the same as 3 ranks to GROW_AT, then 4 from there.
    first = run_ranks(3, lambda comm, rank: emb_run(comm, str(tmp_path / "ref1"), GROW_AT))
    start = pickle.loads(first[0][2])
    start["tables"] = committed_tables(tmp_path / "ref1")

    def second_part(comm, rank):
        return emb_run(comm, str(tmp_path / "ref2"), GROWN_STEPS, start=start, step=GROW_AT, lr=0.05)
    ref = emb_rows([r[0][0] for r in run_ranks(4, second_part)])
    final = emb_rows([g[0] for g in got] + [joined_out[0]])
    for g in got + [joined_out]:
        assert g[1:] == (GROWN_STEPS, GROWN_STEPS)
    for a, b in zip(final, ref):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_embedding_without_a_checkpoint_dir_is_refused():
    from gradsync.torch import elastic

    def body(comm, rank):
        model, opt, embeddings = emb_build(comm)
        with pytest.raises(ValueError, match="ShardedEmbedding table.*checkpoint_dir="):
            elastic.State(comm, model, opt, embeddings=embeddings)
        # Found in the model as well as named: a module that holds the table.
        holder = torch.nn.ModuleDict({"emb": embeddings[0], "dense": model.module})
        with pytest.raises(ValueError, match="checkpoint_dir="):
            elastic.State(comm, holder, opt)
        return True

    assert run_ranks(2, body) == [True, True]


def test_embedding_commit_whose_marker_cannot_be_written_fails_on_every_rank(tmp_path):
    from gradsync.torch import elastic

    ckpt = tmp_path / "ckpt"
    (ckpt / (elastic.MARKER + ".tmp")).mkdir(parents=True)  # rank 0's temporary file cannot be made

    def body(comm, rank):
        model, opt, embeddings = emb_build(comm)
        with pytest.raises(OSError, match="rank 0 could not write the commit marker.*IsADirectoryError"):
            elastic.State(comm, model, opt, embeddings=embeddings, checkpoint_dir=str(ckpt))
        return True

    assert run_ranks(2, body) == [True, True]
    assert elastic.committed(ckpt) is None


def test_embedding_recovery_takes_no_marker_of_another_run_and_rewrites_it(tmp_path):
    # Another run's marker in checkpoint_dir names a newer commit (4) than this run's last (2): a
    # recovery (nobody lost: a grow nobody joins) goes back to this run's, and the marker says so.
    import shutil

    from gradsync.torch import elastic

    nobody, other, ckpt = f"py-el-embother-{uuid.uuid4().hex[:8]}", tmp_path / "other", tmp_path / "ckpt"

    def body(comm, rank):
        for d, steps in ((other, 4), (ckpt, 2)):
            model, opt, embeddings = emb_build(comm)
            state = elastic.State(comm, model, opt, embeddings=embeddings, checkpoint_dir=str(d))
            emb_loop(state, steps)
        comm.barrier()
        if rank == 0:
            shutil.copy(other / elastic.MARKER, ckpt / elastic.MARKER)
        comm.barrier()
        with pytest.raises(gs.GradsyncError):
            elastic.run(lambda s: s.grow(nobody, 1))(state)
        assert state.step == 2 and embeddings[0].table.steps == 2
        state.comm.close()
        return elastic.committed(ckpt)

    marker = run_ranks(2, body, timeout_ms=500)[0]
    assert marker["step"] == 2 and marker["run"] != elastic.committed(other)["run"]


@pytest.mark.parametrize("in_files", [False, True], ids=["memory", "files"])
def test_embedding_recovery_without_a_loss_reads_the_tables_back_from_the_commit(tmp_path, in_files):
    # Nobody is lost (a grow nobody joins times out), but the tables moved on since the commit (a
    # step's pushes, uncommitted): they move in memory, then are read back from the commit's save.
    # A rank whose table is at another step (here: made afresh) makes the group build like ones.
    from gradsync.torch import ShardedEmbedding, elastic

    nobody, ckpt = f"py-el-embnobody-{uuid.uuid4().hex[:8]}", str(tmp_path / "nobody")

    def step_uncommitted(state):
        emb = state.embeddings[0]
        ids, y = emb_batch(state.step, state.comm.rank, state.comm.size)
        state.optimizer.zero_grad()
        torch.nn.functional.cross_entropy(state.model(emb(ids)), y).backward()
        state.optimizer.step()
        state.step += 1

    def body(comm, rank):
        model, opt, embeddings = emb_build(comm, directory=str(tmp_path / "shards") if in_files else None)
        state = elastic.State(comm, model, opt, embeddings=embeddings, checkpoint_dir=ckpt)
        emb_loop(state, 2)
        committed = embeddings[0].table.local_state()
        weights = [p.detach().clone() for p in model.module.parameters()]
        records = []
        for fresh in (False, True):
            step_uncommitted(state)
            assert embeddings[0].table.steps == 3
            if fresh and rank == 1:
                old = embeddings[0].table
                embeddings[0].table = ShardedEmbedding(state.comm, EMB_ROWS, EMB_DIM, optimizer="row_adagrad",
                                                       lr=0.1, directory=old._options["directory"]).table
                old.close()
            with pytest.raises(gs.GradsyncError) as err:
                elastic.run(lambda s: s.grow(nobody, 1))(state)
            assert err.value.status in elastic.RECOVERABLE  # the grow's, raised again by run
            records.append(state.recoveries[-1])
            assert state.step == 2 and embeddings[0].table.steps == 2
            for a, b in zip(embeddings[0].table.local_state(), committed):
                assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
            for a, b in zip(model.module.parameters(), weights):
                assert torch.equal(a, b)
        emb_loop(state, 4)  # and on, saving incrementally on the loaded checkpoint
        assert embeddings[0].table.steps == 4
        state.comm.close()
        return records

    for records in run_ranks(2, body, timeout_ms=500):
        assert [r["failed"] for r in records] == [[[]], [[]]]
        assert [(r["tables_restored"], r["tables_loaded"]) for r in records] == [(0, 1), (0, 1)]
