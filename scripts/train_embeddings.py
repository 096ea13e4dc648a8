#!/usr/bin/env python3
"""Second demo: node embeddings trained through memory-mapped tables and the sparse gradient
accumulator of libgradsync, from Python, with N threads.

For each graph (Zachary's karate club, and a ~50K-node Barabasi-Albert power-law graph for scale):
link prediction with negative sampling (logistic loss on score(u, v) = x_u . x_v + b_u + b_v, the
per-node bias b kept as the last column of each row, so that popularity, which dominates a
power-law graph, is learnt directly instead of through the dot products), the embeddings in a table
file, gradients summed by N threads into an accumulator file with one add_batch per minibatch, and
row-wise Adagrad (PyTorch-BigGraph's default) applied to the touched rows only. Prints the loss
falling, edges/s, and the link-prediction AUC on held-out edges; then a separate Python process
reopens the trained table file after this one flushed and closed it, and recomputes the AUC.

    GRADSYNC_LIBRARY=build/libgradsync.so.0 /usr/bin/python3 scripts/train_embeddings.py --threads 2
"""
import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gradsync as gs  # noqa: E402


def load_graph(name, nodes, seed):
    import networkx as nx
    if name == "karate":
        g = nx.karate_club_graph()
    else:
        g = nx.barabasi_albert_graph(nodes, 4, seed=seed)
    edges = np.array(g.edges(), dtype=np.int64)
    return g.number_of_nodes(), edges


def split_edges(n, edges, holdout, rng):
    edges = edges[rng.permutation(len(edges))]
    test_n = max(4, int(len(edges) * holdout))
    test, train = edges[:test_n], edges[test_n:]
    existing = set(map(tuple, edges.tolist())) | set(map(tuple, edges[:, ::-1].tolist()))
    negatives = []
    while len(negatives) < test_n:  # held-out non-edges, same count as held-out edges
        u, v = rng.integers(0, n, 2)
        if u != v and (u, v) not in existing:
            negatives.append((u, v))
    return train, test, np.array(negatives, dtype=np.int64)


def score(a, b):
    """x_a . x_b + b_a + b_b for rows [x..., b] (broadcasts over leading axes)."""
    return (a[..., :-1] * b[..., :-1]).sum(-1) + a[..., -1] + b[..., -1]


def d_score(other, g):
    """g * d score / d self, where d score / d [x_self, b_self] = [x_other, 1]."""
    out = g * other
    out[..., -1] = g[..., 0]
    return out


def auc_of(emb, test_pos, test_neg):
    from sklearn.metrics import roc_auc_score
    pair_scores = lambda pairs: score(emb[pairs[:, 0]], emb[pairs[:, 1]])  # noqa: E731
    y = np.r_[np.ones(len(test_pos)), np.zeros(len(test_neg))]
    return roc_auc_score(y, np.r_[pair_scores(test_pos), pair_scores(test_neg)])


def sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def train(name, args, workdir):
    rng = np.random.default_rng(args.seed)
    n, edges = load_graph(name, args.nodes, args.seed)
    train_e, test_pos, test_neg = split_edges(n, edges, args.holdout, rng)
    # Both directions of every training edge.
    train_e = np.r_[train_e, train_e[:, ::-1]]
    dim = args.dim + 1  # embedding plus bias
    batch = min(args.batch, len(train_e))
    k = args.negatives
    paths = {part: workdir / f"{name}-{part}" for part in ("emb.gst", "adagrad.gst", "grad.gsa")}
    for p in paths.values():
        p.unlink(missing_ok=True)
    emb = gs.Table.create(paths["emb.gst"], n, dim, init="uniform", seed=args.seed, lo=-0.1, hi=0.1)
    state = gs.Table.create(paths["adagrad.gst"], n, 1)  # row-wise Adagrad: one float per row
    grads = gs.Accumulator.create(paths["grad.gsa"], n, dim)  # striped locks, shared by the threads
    view = emb.view  # zero-copy, read-only numpy view of the mapped file
    print(f"\n== {name}: {n} nodes, {len(edges)} edges ({len(test_pos)} held out), dim {dim - 1} + bias, "
          f"{args.threads} threads, batch {batch} edges x {k} negatives")
    print(f"   tables in {workdir}; AUC before training {auc_of(view, test_pos, test_neg):.3f}")

    deadline = time.monotonic() + args.seconds
    steps_per_epoch = max(1, len(train_e) // (batch * args.threads))
    losses = []
    lock = threading.Lock()

    def worker(wid, epoch_perm):
        local_rng = np.random.default_rng(args.seed * 1000 + wid + 17 * len(losses))
        total, count = 0.0, 0
        for step in range(steps_per_epoch):
            lo = (step * args.threads + wid) * batch
            pairs = train_e[epoch_perm[lo:lo + batch]]
            if len(pairs) == 0:
                break
            u, v = pairs[:, 0], pairs[:, 1]
            neg = local_rng.integers(0, n, (len(pairs), k))
            eu, ev = emb.gather(u), emb.gather(v)
            en = emb.gather(neg.reshape(-1)).reshape(len(pairs), k, dim)
            s_pos = score(eu, ev)
            s_neg = score(eu[:, None, :], en)
            loss = -np.log(sigmoid(s_pos) + 1e-9).sum() - np.log(sigmoid(-s_neg) + 1e-9).sum()
            g_pos = (sigmoid(s_pos) - 1.0)[:, None]            # d loss / d s_pos
            g_neg = sigmoid(s_neg)[:, :, None]                # d loss / d s_neg
            grad_u = d_score(ev, g_pos) + d_score(en, g_neg).sum(1)
            grad_v = d_score(eu, g_pos)
            grad_n = d_score(np.broadcast_to(eu[:, None, :], en.shape), g_neg)
            rows = np.concatenate([u, v, neg.reshape(-1)])
            g = np.concatenate([grad_u, grad_v, grad_n.reshape(-1, dim)]).astype(np.float32)
            grads.add_batch(rows, g)  # one call per minibatch; repeated rows are summed
            # Any thread may apply: it updates only the rows touched so far (by every thread),
            # and adds of the other threads wait for it, so no gradient is lost or applied twice.
            grads.apply(emb, "adagrad", lr=args.lr, state=state)
            total += loss / len(pairs)
            count += 1
        with lock:
            worker.totals.append((total, count))

    epoch, edges_done, t0 = 0, 0, time.monotonic()
    while time.monotonic() < deadline and epoch < args.epochs:
        perm = rng.permutation(len(train_e))
        worker.totals = []
        threads = [threading.Thread(target=worker, args=(w, perm)) for w in range(args.threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        total = sum(t for t, _ in worker.totals)
        count = sum(c for _, c in worker.totals)
        losses.append(total / max(count, 1))
        edges_done += count * batch
        epoch += 1
        if epoch == 1 or epoch % max(1, args.epochs // 10) == 0 or time.monotonic() >= deadline:
            rate = edges_done / (time.monotonic() - t0)
            bar = "#" * int(30 * min(1.0, (time.monotonic() - t0) / args.seconds))
            print(f"   epoch {epoch:4d} [{bar:<30}] loss {losses[-1]:.4f}  {rate:,.0f} edges/s")
    grads.apply(emb, "adagrad", lr=args.lr, state=state)
    auc = auc_of(view, test_pos, test_neg)
    print(f"   loss {losses[0]:.4f} -> {losses[-1]:.4f} in {epoch} epochs, {time.monotonic() - t0:.1f} s; "
          f"held-out link-prediction AUC {auc:.3f}")
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
    here = str(pathlib.Path(__file__).resolve().parent)
    env = dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code, str(paths["emb.gst"]), str(pairs_file), here],
                         capture_output=True, text=True, env=env, timeout=120)
    if out.returncode != 0:
        raise SystemExit(f"reopening the trained table failed:\n{out.stderr}")
    rows_s, _, dim_s, reopened_auc = out.stdout.split()
    print(f"   reopened {paths['emb.gst'].name} in a new process: {rows_s} x {dim_s}, AUC {reopened_auc} "
          f"({'same' if reopened_auc == f'{auc:.3f}' else 'DIFFERENT'})")
    return losses, auc


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--graph", choices=["karate", "powerlaw", "both"], default="both")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2048, help="edges per minibatch per thread")
    ap.add_argument("--negatives", type=int, default=5)
    ap.add_argument("--lr", type=float, default=0.03)
    ap.add_argument("--nodes", type=int, default=50000, help="nodes of the power-law graph")
    ap.add_argument("--holdout", type=float, default=0.05)
    ap.add_argument("--seconds", type=float, default=40.0, help="time budget per graph")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dir", type=pathlib.Path, default=None, help="where the table files go (default: a temp dir)")
    args = ap.parse_args()
    graphs = ["karate", "powerlaw"] if args.graph == "both" else [args.graph]
    with tempfile.TemporaryDirectory(prefix="gradsync-emb-") as tmp:
        workdir = args.dir or pathlib.Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for name in graphs:
            sub = argparse.Namespace(**vars(args))
            if name == "karate":  # tiny: small batches, more epochs, a few seconds
                sub.batch, sub.dim, sub.epochs, sub.seconds, sub.holdout, sub.lr = 16, 16, 300, min(args.seconds, 10), 0.15, 0.1
            losses, auc = train(name, sub, workdir)
            if not losses[-1] < losses[0]:
                raise SystemExit(f"{name}: the loss did not fall ({losses[0]:.4f} -> {losses[-1]:.4f})")


if __name__ == "__main__":
    main()
