# SPDX-License-Identifier: Apache-2.0
"""The demos, shortened: the embeddings learn more than popularity on graphs with structure, only
popularity on a graph without it, the runs are reproducible, and outputs go where --out says,
never into the source tree."""
import hashlib
import pathlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _train(name, tmp_path, *argv):
    import train_embeddings as te

    args = te.parse_args(["--graph", name, "--out", str(tmp_path), *argv])
    return te.train(name, te.graph_args(args, name), tmp_path)


def test_embeddings_beat_the_degree_baseline_on_les_miserables(tmp_path):
    r = _train("lesmis", tmp_path)
    assert r.losses[-1] < r.losses[0]
    assert r.auc > r.baseline + 0.05, r
    # Deterministic: threads add in a fixed order, every random draw comes from the seed.
    again = _train("lesmis", tmp_path)
    assert again.auc == r.auc and again.losses == r.losses


def test_sharded_embeddings_are_bitwise_those_of_as_many_threads(tmp_path):
    import train_embeddings as te
    from conftest import run_ranks

    argv = ["--graph", "lesmis", "--out", str(tmp_path), "--epochs", "20"]
    threads = _train("lesmis", tmp_path, "--threads", "2", "--epochs", "20")
    ckpt = tmp_path / "ckpt"

    def sharded(*extra):
        args = te.graph_args(te.parse_args(argv + ["--sharded", *extra]), "lesmis")
        return lambda comm, rank: te.train_sharded("lesmis", args, tmp_path, comm)

    two = run_ranks(2, sharded("--checkpoint", str(ckpt), "--save-at", "10"))[0]
    assert two.digest == threads.digest and two.auc == threads.auc
    # saved by 2 ranks after epoch 10, resumed by 3 under the other rule: it loads the same table
    # (train_sharded checks the loaded digest) and trains on to the end
    three = run_ranks(3, sharded("--sharding", "hash", "--resume", str(ckpt)))[0]
    assert three.auc > three.baseline and len(three.losses) == 10


def test_embeddings_beat_the_degree_baseline_on_planted_communities(tmp_path):
    r = _train("communities", tmp_path, "--nodes", "5000", "--communities", "20", "--epochs", "10")
    assert r.auc > r.baseline + 0.08, r


def test_embeddings_match_the_degree_baseline_without_structure(tmp_path):
    # Barabasi-Albert: nothing but degree to learn. The learnt biases recover it; the dot products,
    # penalised, do not drown it in memorised training edges (the first version ended at chance).
    r = _train("powerlaw", tmp_path, "--nodes", "5000")
    assert abs(r.auc - r.baseline) < 0.03, r


def test_community_graph_is_reproducible_and_clean():
    import train_embeddings as te

    a = te.community_graph(2000, 10, 8, 0.2, 2.5, np.random.default_rng(3))
    b = te.community_graph(2000, 10, 8, 0.2, 2.5, np.random.default_rng(3))
    assert np.array_equal(a, b)
    assert (a[:, 0] < a[:, 1]).all() and len(np.unique(a, axis=0)) == len(a)


def test_held_out_pairs_are_kept_out_of_training():
    import train_embeddings as te

    n, edges = 300, te.community_graph(300, 5, 8, 0.2, 2.5, np.random.default_rng(0))
    train, pos, neg = te.split_edges(n, edges, 0.1, np.random.default_rng(0))
    as_set = lambda e: set(map(tuple, np.sort(e, axis=1).tolist()))  # noqa: E731
    assert not as_set(train) & as_set(pos)
    assert not as_set(edges) & as_set(neg) and len(as_set(neg)) == len(neg)


def test_embeddings_demo_writes_only_into_out(tmp_path):
    import train_embeddings as te

    assert te.main(["--graph", "karate", "--out", str(tmp_path)]) == 0
    assert {p.name for p in tmp_path.iterdir()} == {
        "karate-emb.gst", "karate-adagrad.gst", "karate-grad.gsa", "karate-heldout.npz", "embeddings_auc.png"}


def test_digits_demo_writes_its_plot_into_out_not_docs(tmp_path):
    import train_digits

    figure = ROOT / "docs" / "loss_curves.png"
    before = hashlib.sha256(figure.read_bytes()).hexdigest()
    args = ["--epochs", "1", "--workers", "2", "--compress", "none", "--out", str(tmp_path)]
    assert train_digits.main(args) == 0
    assert (tmp_path / "loss_curves.png").stat().st_size > 0
    assert hashlib.sha256(figure.read_bytes()).hexdigest() == before


def test_default_output_directory_falls_back_to_temp_when_the_checkout_is_read_only(tmp_path, monkeypatch):
    import tempfile

    import train_digits
    import train_embeddings as te

    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")  # build/demo-output cannot be made under a file
    monkeypatch.setattr(te, "HERE", blocker / "scripts")
    monkeypatch.setattr(train_digits, "ROOT", str(blocker))
    expected = pathlib.Path(tempfile.gettempdir()) / "gradsync-demo-output"
    assert te.default_out_dir() == expected
    assert pathlib.Path(train_digits.default_out_dir()) == expected


def test_torch_demo_trains_the_same_on_one_worker_and_on_worker_processes(capsys):
    import train_torch

    assert train_torch.main(["--epochs", "2", "--workers", "2"]) == 0  # nonzero when the weights differ
    out = capsys.readouterr().out
    assert "workers' weights bitwise equal: yes" in out, out
    one, two = (float(line.split("held-out accuracy ")[1].split(",")[0]) for line in out.splitlines()
                if line.startswith(("torch x1:", "torch x2 (shm):")))
    assert one > 0.5 and two > 0.5 and abs(one - two) < 0.1, out  # it learns, and as much on two workers


def test_digits_report_shows_no_speed_up_where_speed_is_not_the_point():
    import io
    import types

    import train_digits as td

    runs = [td.RunResult("sharded", 1, 1.0, 1000, [2.0, 0.1], 0.9), td.RunResult("sharded", 4, 4.0, 1000, [2.0, 0.1], 0.9)]
    small = types.SimpleNamespace(size=4810)
    why = td.speed_is_the_point(small, 4)
    assert why is not None
    out = io.StringIO()
    td.report(runs, out, not_speed=why)
    assert "vs 1 worker" not in out.getvalue() and "0.25x" not in out.getvalue()
    assert "not speed" in out.getvalue()
    big = types.SimpleNamespace(size=10_000_000)
    assert td.speed_is_the_point(big, 1) is None
    out = io.StringIO()
    td.report(runs, out)
    assert "0.25x" in out.getvalue()
