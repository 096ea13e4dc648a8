#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Second demo: node embeddings trained through memory-mapped tables and the sparse gradient
accumulator of libgradsync, from Python, with N threads.

Link prediction with negative sampling: logistic loss on score(u, v) = x_u . x_v + b_u + b_v, the
per-node bias b kept as the last column of each row (so that popularity is learnt by the bias and
the dot products are left for who-links-to-whom), an L2 penalty on x, the embeddings in a table
file, gradients summed by N threads into an accumulator file with one add_batch per minibatch, and
row-wise Adagrad (PyTorch-BigGraph's default) applied to the touched rows only.

Graphs (--graph, default: lesmis communities):
  lesmis       Les Miserables co-appearances (77 nodes, 254 edges, from python3-networkx).
  communities  a 50 000-node graph with planted communities and power-law degrees (a
               degree-corrected planted partition): who links to whom depends on the community,
               how much on the degree, so popularity alone does not explain it.
  karate       Zachary's karate club (34 nodes; 11 held-out edges: a noisy AUC).
  powerlaw     a Barabasi-Albert graph: a control with NO structure beyond degree (every new node
               picks its neighbours by degree alone), on which embeddings can only match the
               degree baseline. With the first version's negatives and no penalty
               (--negative-pairs tail --l2 0 --lr 0.03 --epochs 60) they memorise the training
               edges and end at chance.

Each graph prints the loss falling, edges/s, and the held-out link-prediction AUC beside the
degree baseline on the same held-out pairs (score(u, v) = deg(u) * deg(v), degrees counted on the
training edges), and fails unless the embeddings beat it on a graph with structure. A separate
Python process then reopens the trained table file after this one flushed and closed it, and
recomputes the AUC. Runs are deterministic: every step N threads compute their minibatch gradients
from the same parameters, add them into the accumulator in thread order, and one of them applies
Adagrad; a fixed seed gives the same figures on every run and machine with the same library.

Sharded (--sharded, under the launcher): the table is split over the ranks
(gradsync.ShardedEmbeddingTable); rank r computes worker r's minibatch from rows it looks up from
their owners and pushes the gradients to them, where row-wise Adagrad runs. A push sums each row's
gradients in rank order, as the threads add theirs in thread order, so N ranks end with bitwise the
embeddings of --threads N (each run prints their sha256). --checkpoint DIR --save-at E saves the
table after epoch E; --resume DIR goes on from it on any number of ranks, under either sharding:

    python3 -m gradsync.run -n 4 scripts/train_embeddings.py --graph communities --sharded \
        --checkpoint /tmp/ckpt --save-at 5
    python3 -m gradsync.run -n 3 scripts/train_embeddings.py --graph communities --sharded \
        --sharding hash --resume /tmp/ckpt

Outputs (tables, held-out pairs, embeddings_auc.png) go to --out DIR (default build/demo-output in
the checkout, or a temporary directory when that is not writable); nothing is written elsewhere.

    GRADSYNC_LIBRARY=build/libgradsync.so.0 /usr/bin/python3 scripts/train_embeddings.py --out /tmp/emb
"""
import os

# The worker threads are the parallelism; BLAS threads on top would oversubscribe the cores.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import numpy as np  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gradsync as gs  # noqa: E402

GRAPHS = ("lesmis", "communities", "karate", "powerlaw")
STRUCTURED = {"lesmis", "communities", "karate"}  # graphs on which the embeddings must beat degree


def default_out_dir():
    """build/demo-output in the checkout if it can be written, else a directory under the temp dir."""
    candidate = HERE.parent / "build" / "demo-output"
    try:
        candidate.mkdir(parents=True, exist_ok=True)
        if os.access(candidate, os.W_OK):
            return candidate
    except OSError:
        pass
    return pathlib.Path(tempfile.gettempdir()) / "gradsync-demo-output"


# --------------------------------------------------------------------------- graphs


def community_graph(n, communities, avg_degree, mixing, exponent, rng):
    """A degree-corrected planted partition: node i has a community and a power-law weight w_i
    (P(w) ~ w^-exponent). Each of n * avg_degree / 2 edges picks u with probability ~ w_u, then v
    ~ w_v among u's community with probability 1 - mixing, or among all nodes otherwise.
    Self-loops and repeats are dropped. Returns the edges (u < v), int64."""
    community = rng.integers(0, communities, n)
    weight = rng.pareto(exponent - 1.0, n) + 1.0
    order = np.argsort(community, kind="stable")  # nodes grouped by community
    cum = np.cumsum(weight[order])
    bounds = np.searchsorted(community[order], np.arange(communities + 1))  # each community's slice
    lo_of = np.r_[0.0, cum][bounds[:-1]]
    hi_of = cum[bounds[1:] - 1]
    m = n * avg_degree // 2

    def draw(lo, hi):  # a node with probability ~ weight, within the cumulative range [lo, hi)
        return order[np.minimum(np.searchsorted(cum, lo + rng.random(len(lo)) * (hi - lo), side="right"), n - 1)]

    u = draw(np.zeros(m), np.full(m, cum[-1]))
    inside = rng.random(m) >= mixing
    v = draw(np.where(inside, lo_of[community[u]], 0.0), np.where(inside, hi_of[community[u]], cum[-1]))
    edges = np.sort(np.stack([u, v], 1), axis=1)
    return np.unique(edges[edges[:, 0] != edges[:, 1]], axis=0)


def load_graph(name, args):
    """(number of nodes, edges as an int64 (m, 2) array), the same for the same seed."""
    import networkx as nx
    if name == "communities":
        rng = np.random.default_rng([args.seed, 1])
        return args.nodes, community_graph(args.nodes, args.communities, args.avg_degree, args.mixing, 2.5, rng)
    if name == "powerlaw":
        g = nx.barabasi_albert_graph(args.nodes, 4, seed=args.seed)
    elif name == "lesmis":
        g = nx.les_miserables_graph()
    else:
        g = nx.karate_club_graph()
    g = nx.convert_node_labels_to_integers(g)
    return g.number_of_nodes(), np.array(list(g.edges()), dtype=np.int64).reshape(-1, 2)


def split_edges(n, edges, holdout, rng):
    """Hold out a fraction of the edges, and as many node pairs that are not edges, both endpoints
    uniform (the training negatives are uniform too). The training edges exclude the held-out ones."""
    edges = edges[rng.permutation(len(edges))]
    test_n = max(4, int(len(edges) * holdout))
    test, train = edges[:test_n], edges[test_n:]
    existing = set(map(tuple, edges.tolist())) | set(map(tuple, edges[:, ::-1].tolist()))
    negatives, seen = [], set()
    while len(negatives) < test_n:  # held-out non-edges, same count as held-out edges, no repeats
        u, v = (int(x) for x in rng.integers(0, n, 2))
        if u != v and (u, v) not in existing and (u, v) not in seen:
            seen.add((u, v))
            negatives.append((u, v))
    return train, test, np.array(negatives, dtype=np.int64)


# --------------------------------------------------------------------------- model and evaluation


def score(a, b):
    """x_a . x_b + b_a + b_b for rows [x..., b] (broadcasts over leading axes)."""
    return (a[..., :-1] * b[..., :-1]).sum(-1) + a[..., -1] + b[..., -1]


def d_score(other, g):
    """g * d score / d self, where d score / d [x_self, b_self] = [x_other, 1]."""
    out = g * other
    out[..., -1] = g[..., 0]
    return out


def sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _auc(scores_pos, scores_neg):
    from sklearn.metrics import roc_auc_score
    y = np.r_[np.ones(len(scores_pos)), np.zeros(len(scores_neg))]
    return float(roc_auc_score(y, np.r_[scores_pos, scores_neg]))


def auc_of(emb, test_pos, test_neg):
    """Held-out AUC of the embeddings in emb (a (rows, dim + 1) array, e.g. a table's view)."""
    pair_scores = lambda pairs: score(emb[pairs[:, 0]], emb[pairs[:, 1]])  # noqa: E731
    return _auc(pair_scores(test_pos), pair_scores(test_neg))


def degree_auc(n, train_edges, test_pos, test_neg):
    """The baseline: score(u, v) = deg(u) * deg(v), degrees counted on the training edges only."""
    deg = np.bincount(train_edges.reshape(-1), minlength=n).astype(np.float64)
    pair_scores = lambda pairs: deg[pairs[:, 0]] * deg[pairs[:, 1]]  # noqa: E731
    return _auc(pair_scores(test_pos), pair_scores(test_neg))


# --------------------------------------------------------------------------- training


@dataclass
class Result:
    name: str
    losses: list  # mean training loss per epoch
    aucs: list  # (epoch, held-out AUC) at each progress line
    auc: float
    baseline: float
    seconds: float
    digest: str = ""  # of the trained embeddings' bytes (rank 0's, when sharded)


def minibatch(args, n, train_e, perm, step, workers, wid, batch, rng, fetch):
    """Worker wid's share of a step: (rows, their float32 gradients, its mean loss), computed from
    the rows fetch(ids) returns; the same bits from a table's gather and a sharded table's lookup."""
    k = args.negatives
    lo = (step * workers + wid) * batch
    pairs = train_e[perm[lo:lo + batch]]
    u, v = pairs[:, 0], pairs[:, 1]
    # k negative pairs per edge, drawn like the held-out non-edges: both ends uniform.
    # ("tail" keeps u and draws only the other end, as the first version of this demo
    # did: a popular u is then as frequent among the negatives as among the edges, so
    # its popularity carries no signal, unlike in the held-out pairs.)
    neg_b = rng.integers(0, n, len(pairs) * k)
    if args.negative_pairs == "uniform":
        neg_a = rng.integers(0, n, len(pairs) * k)
    else:
        neg_a = np.repeat(u, k)
    rows = np.concatenate([u, v, neg_a, neg_b])       # repeated rows are summed
    x = fetch(rows)                                   # one fetch: one lookup round when sharded
    eu, ev, ea, eb = np.split(x, np.cumsum([len(u), len(v), len(neg_a)]))
    s_pos, s_neg = score(eu, ev), score(ea, eb)
    g_pos = (sigmoid(s_pos) - 1.0)[:, None]            # d loss / d s_pos
    g_neg = sigmoid(s_neg)[:, None]                   # d loss / d s_neg
    g = np.concatenate([d_score(ev, g_pos), d_score(eu, g_pos), d_score(eb, g_neg), d_score(ea, g_neg)])
    g[:, :-1] += args.l2 * x[:, :-1]  # L2 on the embedding at every use, not on the bias
    loss = -np.log(sigmoid(s_pos) + 1e-9).sum() - np.log(sigmoid(-s_neg) + 1e-9).sum()
    return rows, g.astype(np.float32), loss / len(pairs)


def digest(values):
    """A short fingerprint of a table's bytes, to compare runs bit for bit."""
    import hashlib
    return hashlib.sha256(np.ascontiguousarray(values, dtype=np.float32).tobytes()).hexdigest()[:16]


def train(name, args, workdir):
    rng = np.random.default_rng(args.seed)
    n, edges = load_graph(name, args)
    train_e, test_pos, test_neg = split_edges(n, edges, args.holdout, rng)
    baseline = degree_auc(n, train_e, test_pos, test_neg)
    train_e = np.r_[train_e, train_e[:, ::-1]]  # both directions of every training edge
    dim = args.dim + 1  # embedding plus bias
    threads = args.threads
    batch = max(1, min(args.batch, len(train_e) // threads))
    paths = {part: workdir / f"{name}-{part}" for part in ("emb.gst", "adagrad.gst", "grad.gsa")}
    for p in paths.values():
        p.unlink(missing_ok=True)
    emb = gs.Table.create(paths["emb.gst"], n, dim, init="uniform", seed=args.seed, lo=-0.1, hi=0.1)
    state = gs.Table.create(paths["adagrad.gst"], n, 1)  # row-wise Adagrad: one float per row
    grads = gs.Accumulator.create(paths["grad.gsa"], n, dim)  # striped locks, shared by the threads
    view = emb.view  # zero-copy, read-only numpy view of the mapped file
    print(f"\n== {name}: {n} nodes, {len(edges)} edges ({len(test_pos)} held out, and as many non-edges), "
          f"dim {dim - 1} + bias, {threads} threads x batch {batch} edges x {args.negatives} {args.negative_pairs} negative "
          f"pairs, lr {args.lr}, L2 {args.l2}, {args.epochs} epochs")
    print(f"   tables in {workdir}; held-out AUC before training {auc_of(view, test_pos, test_neg):.3f}, "
          f"degree baseline {baseline:.3f}")

    steps = max(1, len(train_e) // (batch * threads))
    apply = lambda: grads.apply(emb, "adagrad", lr=args.lr, state=state)  # noqa: E731
    # Every step: each thread computes its minibatch's gradient from the same parameters (nobody
    # writes the table meanwhile), adds it into the accumulator in thread order (so that float
    # sums, hence the run, are reproducible), and the barrier's action applies Adagrad once, to
    # the rows touched by all of them, while the threads wait.
    barrier = threading.Barrier(threads, action=apply)
    turn = threading.Condition()
    state_of = {"turn": 0, "failed": None}

    def add_in_turn(wid, rows, g):
        with turn:
            turn.wait_for(lambda: state_of["turn"] == wid or state_of["failed"] is not None)
            if state_of["failed"] is not None:
                raise threading.BrokenBarrierError
            try:
                grads.add_batch(rows, g)  # one call per minibatch; repeated rows are summed
            finally:
                state_of["turn"] = (wid + 1) % threads
                turn.notify_all()

    def worker(wid, epoch, perm, out):
        local_rng = np.random.default_rng([args.seed, epoch, wid])
        total = 0.0
        try:
            for step in range(steps):
                rows, g, loss = minibatch(args, n, train_e, perm, step, threads, wid, batch, local_rng, emb.gather)
                add_in_turn(wid, rows, g)
                barrier.wait()
                total += loss
            out[wid] = total
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            with turn:
                if state_of["failed"] is None or isinstance(state_of["failed"], threading.BrokenBarrierError):
                    state_of["failed"] = exc  # the first real error, not the others' broken barrier
                turn.notify_all()
            barrier.abort()

    losses, aucs = [], []
    every = max(1, args.epochs // 10)
    t0 = time.monotonic()
    for epoch in range(1, args.epochs + 1):
        perm = rng.permutation(len(train_e))
        out = [0.0] * threads
        workers = [threading.Thread(target=worker, args=(w, epoch, perm, out)) for w in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        if state_of["failed"] is not None:
            raise state_of["failed"]
        losses.append(sum(out) / (steps * threads))
        if epoch == 1 or epoch % every == 0 or epoch == args.epochs:
            elapsed = time.monotonic() - t0
            aucs.append((epoch, auc_of(view, test_pos, test_neg)))
            print(f"   epoch {epoch:4d}  loss {losses[-1]:.4f}  held-out AUC {aucs[-1][1]:.3f}  "
                  f"{epoch * steps * threads * batch / elapsed:,.0f} edges/s", flush=True)
    seconds = time.monotonic() - t0
    auc = auc_of(view, test_pos, test_neg)  # the trained table itself, through the mapping
    trained_digest = digest(view)
    print(f"   embeddings sha256 {trained_digest}")
    verdict = f"{auc - baseline:+.3f} over it" if auc > baseline else f"{auc - baseline:+.3f}: NOT above it"
    print(f"   loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.epochs} epochs, {seconds:.1f} s; held-out "
          f"link-prediction AUC {auc:.3f}, degree baseline {baseline:.3f} on the same pairs ({verdict})")
    emb.flush()  # durable on return
    pairs_file = workdir / f"{name}-heldout.npz"
    np.savez(pairs_file, pos=test_pos, neg=test_neg)
    emb.close()
    del view
    state.close()
    grads.close()

    # The trained table outlives this process's handle: reopen it in a fresh interpreter.
    code = ("import sys, numpy as np, gradsync as gs; sys.path.insert(0, sys.argv[3]); "
            "from train_embeddings import auc_of; "
            "t = gs.Table.open(sys.argv[1], read_only=True); d = np.load(sys.argv[2]); "
            "print(f'{t.rows} x {t.dim}', f'{auc_of(t.view, d[\"pos\"], d[\"neg\"]):.3f}')")
    env = dict(os.environ, PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, "-c", code, str(paths["emb.gst"]), str(pairs_file), str(HERE)],
                          capture_output=True, text=True, env=env, timeout=120)
    if proc.returncode != 0:
        raise SystemExit(f"reopening the trained table failed:\n{proc.stderr}")
    rows_s, _, dim_s, reopened_auc = proc.stdout.split()
    print(f"   reopened {paths['emb.gst'].name} in a new process: {rows_s} x {dim_s}, AUC {reopened_auc} "
          f"({'same' if reopened_auc == f'{auc:.3f}' else 'DIFFERENT'})")
    if reopened_auc != f"{auc:.3f}":
        raise SystemExit(f"{name}: the reopened table gives AUC {reopened_auc}, this process {auc:.3f}")
    return Result(name, losses, aucs, auc, baseline, seconds, trained_digest)


def train_sharded(name, args, workdir, comm):
    """The same training with the table sharded over comm's ranks (under gradsync.run): rank r
    plays worker r of a --threads size run, looks its rows up from their owners and pushes its
    gradients to them, where row-wise Adagrad runs. A push sums each row in rank order, as the
    threads above add in thread order, so P ranks give bitwise the embeddings of P threads."""
    rank, size = comm.rank, comm.size
    say = print if rank == 0 else (lambda *a, **k: None)
    rng = np.random.default_rng(args.seed)
    n, edges = load_graph(name, args)
    train_e, test_pos, test_neg = split_edges(n, edges, args.holdout, rng)
    baseline = degree_auc(n, train_e, test_pos, test_neg)
    train_e = np.r_[train_e, train_e[:, ::-1]]
    dim = args.dim + 1
    batch = max(1, min(args.batch, len(train_e) // size))
    steps = max(1, len(train_e) // (batch * size))
    table = gs.ShardedEmbeddingTable(comm, n, dim, sharding=args.sharding, optimizer="row_adagrad", lr=args.lr,
                                     init="uniform", seed=args.seed, lo=-0.1, hi=0.1)
    everything = np.arange(n)

    def whole_table():  # collective: rank 0 receives every row
        return table.lookup(everything if rank == 0 else everything[:0])

    first = 1
    if args.resume:
        table.load(args.resume)
        marker = json.loads((pathlib.Path(args.resume) / "demo-epoch.json").read_text())
        first = marker["epoch"] + 1
        full = whole_table()
        say(f"   resumed from {args.resume} (saved by {marker['ranks']} ranks after epoch {marker['epoch']}, "
            f"sha256 {marker['sha256']}): loaded sha256 {digest(full) if rank == 0 else ''}")
        if rank == 0 and digest(full) != marker["sha256"]:
            raise SystemExit("the loaded table differs from the saved one")
        for _ in range(1, first):
            rng.permutation(len(train_e))  # the epochs already trained drew theirs
    say(f"\n== {name} sharded over {size} ranks ({args.sharding}): {n} nodes, {len(edges)} edges, dim {dim - 1} + "
        f"bias, {size} ranks x batch {batch} edges, {table.local_rows} rows on rank 0; degree baseline {baseline:.3f}")
    losses, aucs = [], []
    every = max(1, args.epochs // 10)
    t0 = time.monotonic()
    for epoch in range(first, args.epochs + 1):
        perm = rng.permutation(len(train_e))
        local_rng = np.random.default_rng([args.seed, epoch, rank])
        total = np.zeros(1)
        for step in range(steps):
            rows, g, loss = minibatch(args, n, train_e, perm, step, size, rank, batch, local_rng, table.lookup)
            table.push(rows, g)
            total += loss
        comm.allreduce(total, op="sum")
        losses.append(float(total[0]) / (steps * size))
        full = whole_table()
        if epoch == first or epoch % every == 0 or epoch == args.epochs:
            auc_now = auc_of(full, test_pos, test_neg) if rank == 0 else 0.0
            aucs.append((epoch, auc_now))
            say(f"   epoch {epoch:4d}  loss {losses[-1]:.4f}  held-out AUC {auc_now:.3f}  "
                f"{(epoch - first + 1) * steps * size * batch / (time.monotonic() - t0):,.0f} edges/s", flush=True)
        if args.checkpoint and epoch == args.save_at:
            table.save(args.checkpoint)
            if rank == 0:
                marker = {"epoch": epoch, "ranks": size, "sha256": digest(full)}
                (pathlib.Path(args.checkpoint) / "demo-epoch.json").write_text(json.dumps(marker))
            say(f"   checkpoint after epoch {epoch} in {args.checkpoint}, sha256 {digest(full) if rank == 0 else ''}")
    seconds = time.monotonic() - t0
    full = whole_table()
    auc = auc_of(full, test_pos, test_neg) if rank == 0 else 0.0
    say(f"   held-out link-prediction AUC {auc:.3f}, degree baseline {baseline:.3f}, {seconds:.1f} s")
    trained_digest = digest(full) if rank == 0 else ""
    say(f"   embeddings sha256 {trained_digest}")
    table.close()
    return Result(name, losses, aucs, auc, baseline, seconds, trained_digest)


def plot(results, path):
    """Held-out AUC by epoch beside the degree baseline, one panel per graph."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.2), dpi=80, squeeze=False)
    for ax, r in zip(axes[0], results):
        epochs, values = zip(*r.aucs)
        ax.plot(epochs, values, "o-", color="C0", label=f"embeddings ({r.auc:.3f})", linewidth=1.3, markersize=3)
        ax.axhline(r.baseline, color="C3", linestyle="--", label=f"degree baseline ({r.baseline:.3f})")
        ax.axhline(0.5, color="grey", linestyle=":", linewidth=0.8)
        ax.set(xlabel="epoch", ylabel="held-out link-prediction AUC", ylim=(0.45, 1.0))
        ax.set_title(r.name, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# Per-graph settings; command-line options given explicitly override them.
PRESETS = {
    "lesmis": dict(dim=16, batch=16, epochs=200, lr=0.1, holdout=0.15, l2=0.05),
    "karate": dict(dim=16, batch=16, epochs=200, lr=0.1, holdout=0.15, l2=0.05),
    "communities": dict(dim=32, batch=2048, epochs=10, lr=0.2, holdout=0.05, l2=0.05),
    "powerlaw": dict(dim=32, batch=2048, epochs=10, lr=0.2, holdout=0.05, l2=0.05),
}


def graph_args(args, name):
    """args with the graph's preset for every per-graph option not given on the command line."""
    sub = argparse.Namespace(**vars(args))
    for key, value in PRESETS[name].items():
        if getattr(args, key) is None:
            setattr(sub, key, value)
    return sub


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graph", nargs="+", choices=GRAPHS, default=["lesmis", "communities"],
                    help="graphs to train on, in order (default: lesmis communities)")
    ap.add_argument("--out", type=pathlib.Path, default=None,
                    help="directory for the tables, held-out pairs and embeddings_auc.png "
                         "(default build/demo-output, or a temp directory if that is not writable)")
    ap.add_argument("--dir", dest="out", type=pathlib.Path, help=argparse.SUPPRESS)  # the old name
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=50000, help="nodes of the communities / powerlaw graph")
    ap.add_argument("--communities", type=int, default=100, help="planted communities (default 100)")
    ap.add_argument("--avg-degree", type=int, default=10, help="of the communities graph (default 10)")
    ap.add_argument("--mixing", type=float, default=0.2,
                    help="fraction of the communities graph's edges drawn across communities (default 0.2)")
    for name, kind in (("dim", int), ("batch", int), ("epochs", int), ("lr", float), ("holdout", float),
                       ("l2", float)):
        ap.add_argument(f"--{name}", type=kind, default=None,
                        help="default per graph: " + ", ".join(f"{g} {PRESETS[g][name]}" for g in GRAPHS))
    ap.add_argument("--negatives", type=int, default=5, help="negative pairs per training edge (default 5)")
    ap.add_argument("--negative-pairs", choices=("uniform", "tail"), default="uniform",
                    help="uniform (default): both ends uniform, as the held-out non-edges; tail: (u, uniform)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--sharded", action="store_true",
                    help="shard the table over the ranks of gradsync.run (python3 -m gradsync.run -n 4 "
                         "scripts/train_embeddings.py --sharded): bitwise the embeddings of --threads 4")
    ap.add_argument("--sharding", choices=("contiguous", "hash"), default="contiguous",
                    help="--sharded: which rank owns which row")
    ap.add_argument("--checkpoint", type=pathlib.Path, default=None,
                    help="--sharded: save a checkpoint here after epoch --save-at")
    ap.add_argument("--save-at", type=int, default=None, help="--sharded: the epoch after which to save")
    ap.add_argument("--resume", type=pathlib.Path, default=None,
                    help="--sharded: load this checkpoint (saved by any number of ranks) and go on from its epoch")
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error("--threads must be >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    out = args.out or default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    if not args.sharded or os.environ.get("GRADSYNC_RANK", "0") == "0":
        print(f"libgradsync {gs.version()}: node embeddings through a table and the accumulator, "
              + (f"sharded over {os.environ.get('GRADSYNC_SIZE', '1')} ranks" if args.sharded
                 else f"{args.threads} threads") + f"; outputs in {out}")
    if args.sharded:
        with gs.Communicator.from_env() as comm:
            results = [train_sharded(name, graph_args(args, name), out, comm) for name in dict.fromkeys(args.graph)]
            if comm.rank != 0:
                return 0
    else:
        results = [train(name, graph_args(args, name), out) for name in dict.fromkeys(args.graph)]
    figure = out / "embeddings_auc.png"
    plot(results, figure)
    print(f"\n{'graph':<12} {'held-out AUC':>12} {'degree baseline':>16} {'difference':>11} {'seconds':>8}")
    for r in results:
        print(f"{r.name:<12} {r.auc:>12.3f} {r.baseline:>16.3f} {r.auc - r.baseline:>+11.3f} {r.seconds:>8.1f}")
    print(f"AUC by epoch: {figure}")
    for r in results:
        if len(r.losses) > 1 and not r.losses[-1] < r.losses[0]:
            raise SystemExit(f"{r.name}: the loss did not fall ({r.losses[0]:.4f} -> {r.losses[-1]:.4f})")
        if r.name in STRUCTURED and not r.auc > r.baseline:
            raise SystemExit(f"{r.name}: held-out AUC {r.auc:.3f} does not beat the degree baseline {r.baseline:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
