"""Tests for allocate.py on a tiny model trained here on a byte-level dataset of real English text."""
import importlib
import json
import os
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
import allocate  # noqa: E402
import train  # noqa: E402
from evaluate import load_windows  # noqa: E402
from model import load_checkpoint  # noqa: E402

R_MAX = 6  # 2 x the tiny model's mean_loops


def write_byte_dataset(root):
    """data/tiny/: the standard library's docstrings and licence as bytes (vocab 256, no tokenizer needed)."""
    mods = "argparse subprocess logging re json pickle typing collections functools textwrap difflib doctest pydoc".split()
    text = "".join(importlib.import_module(m).__doc__ or "" for m in mods)
    text += Path(sysconfig.get_paths()["stdlib"], "LICENSE.txt").read_text()
    ids = np.frombuffer(text.encode(), dtype=np.uint8).astype(np.uint16)
    n_val = len(ids) // 10
    d = root / "data" / "tiny"
    d.mkdir(parents=True)
    ids[:-n_val].tofile(d / "train.bin")
    ids[-n_val:].tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps({"source": "stdlib", "tokenizer": "bytes", "vocab_size": 256, "eot_id": 0,
                                             "dtype": "uint16", "train_tokens": len(ids) - n_val, "val_tokens": n_val}))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained for 60 steps (converged enough for the exits to mean something), its dir and data."""
    root = tmp_path_factory.mktemp("alloc")
    write_byte_dataset(root)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        train.main(["--dataset=tiny", "--out_dir=out", "--max_iters=60", "--n_embd=32", "--n_head=2", "--n_kv_head=1",
                    "--ffn_hidden=64", "--block_size=32", "--batch_size=8", "--eval_interval=60", "--eval_iters=1",
                    "--compile=False", "--mean_loops=3", "--max_loops=8", "--learning_rate=5e-3", "--log_interval=1000"])
    model, _ = load_checkpoint(str(root / "out" / "ckpt.pt"))
    wins = load_windows(str(root / "data/tiny/val.bin"), "uint16", 8, 33, 0)
    return root, model, wins[:, :-1], wins[:, 1:].contiguous()


def test_interpolation_on_a_hand_made_curve():
    curve = [(4, 3.0), (1, 4.0), (8, 2.9), (2, 3.5)]  # unsorted on purpose
    assert allocate.interp_loss(curve, 3) == pytest.approx(3.25)
    assert allocate.interp_loss(curve, 8) == pytest.approx(2.9)
    assert allocate.interp_loss(curve, 0.5) is None and allocate.interp_loss(curve, 9) is None
    assert allocate.depth_at_bar(curve, 3.25) == pytest.approx(3.0)
    assert allocate.depth_at_bar(curve, 3.6) == pytest.approx(1.8)
    assert allocate.depth_at_bar(curve, 5.0) == 1  # already there at its shallowest point
    assert allocate.depth_at_bar(curve, 2.0) is None
    assert allocate.depth_at_bar([(1, 3.0), (2, 2.0), (3, 3.0), (4, 1.0)], 2.5) == pytest.approx(1.5)  # first crossing


def test_label_harvester_on_crafted_argmaxes():
    argmax = torch.tensor([[5, 5, 5, 5], [1, 2, 2, 2], [1, 2, 1, 1], [3, 3, 3, 4], [1, 2, 2, 1]]).T  # (loops, tokens)
    expected = torch.tensor([[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool).T
    assert torch.equal(allocate.harvest_labels(argmax), expected)


def test_probe_learns_a_separable_toy_problem():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(600, 5, generator=g) * torch.tensor([1.0, 3.0, 0.1, 1.0, 1.0]) + 2.0  # unstandardised on purpose
    y = (x[:, 0] - 2.0) + 0.5 * (x[:, 1] - 2.0) > 0.3
    prob, accuracy, majority = allocate.fit_probe(x[:500], y[:500], x[500:], y[500:], steps=300)
    assert accuracy > 0.95 and majority < 0.75
    assert ((prob(x) > 0.5) == y).float().mean() > 0.95


def test_a1_eps_zero_is_a0_at_r_max_and_huge_eps_is_the_minimum(trained):
    _, model, X, Y = trained
    tr = allocate.trace(model, X, Y, R_MAX)
    loss, depth, _ = allocate.masked_exit(model, X, Y, R_MAX, "kl", 0.0)
    assert torch.all(depth == R_MAX)
    torch.testing.assert_close(loss, tr["loss"][-1], rtol=0, atol=1e-5)
    loss, depth, _ = allocate.masked_exit(model, X, Y, R_MAX, "kl", 1e9)
    assert torch.all(depth == 2)  # the first KL compares loops 2 and 1
    torch.testing.assert_close(loss, tr["loss"][1], rtol=0, atol=1e-5)
    assert torch.all(allocate.masked_exit(model, X, Y, R_MAX, "state", 1e9)[1] == 2)
    assert torch.all(allocate.masked_exit(model, X, Y, R_MAX, "probe", 2.0, lambda s: s[..., 0] * 0)[1] == 1)


@pytest.mark.parametrize("criterion", ["kl", "state"])
def test_frozen_tokens_stop_changing(trained, criterion):
    _, model, X, Y = trained
    tr = allocate.trace(model, X, Y, R_MAX)
    eps = (tr["kl"] if criterion == "kl" else tr["dstate"])[2].median().item()  # freezes about half by loop 3
    short_loss, short_depth, short_s = allocate.masked_exit(model, X, Y, 4, criterion, eps)
    loss, depth, s = allocate.masked_exit(model, X, Y, 8, criterion, eps)
    frozen = short_depth < 4  # frozen before the short run's last loop
    assert 0.2 < frozen.float().mean() < 1 and torch.all(depth[~frozen] >= 4) and (depth > 4).any()
    assert torch.equal(depth[frozen], short_depth[frozen])
    assert torch.equal(s[frozen], short_s[frozen])  # four more loops did not move their states
    if criterion == "kl":  # and their carried distributions did not change either
        assert torch.equal(loss[frozen], short_loss[frozen])


@pytest.mark.parametrize("criterion", ["kl", "state"])
def test_realized_matches_masking_harness_with_fewer_core_evals(trained, criterion):
    _, model, X, Y = trained
    tr = allocate.trace(model, X, Y, R_MAX)
    eps = (tr["kl"] if criterion == "kl" else tr["dstate"])[2].median().item()
    masked_loss, masked_depth, _ = allocate.masked_exit(model, X, Y, R_MAX, criterion, eps)
    runs = [allocate.realized_exit(model, x[None], y[None], R_MAX, criterion, eps) for x, y in zip(X, Y)]
    loss, depth = torch.stack([r[0] for r in runs]), torch.stack([r[1] for r in runs])
    n_core, n_read = sum(r[2] for r in runs), sum(r[3] for r in runs)
    assert abs(loss.mean().item() - masked_loss.mean().item()) < 0.005
    assert abs(depth.float().mean().item() - masked_depth.float().mean().item()) < 0.25
    assert n_core == depth.sum().item() < 0.8 * Y.numel() * R_MAX  # one core evaluation per token per loop it ran
    assert n_read == (depth.sum().item() if criterion == "kl" else Y.numel())
    run = allocate.realized_run(model, X, Y, R_MAX, 3, criterion, eps)
    assert run["loss"] == pytest.approx(loss.mean().item(), abs=1e-6) and run["core_token_evals"] == n_core
    assert run["uniform_loss"] == pytest.approx(tr["loss"][2].mean().item(), abs=1e-5)  # = A0 at mean_loops


def test_main_writes_json_table_and_plot(trained, monkeypatch):
    root, *_ = trained
    monkeypatch.chdir(root)
    res = allocate.main(["--out_dir=out", "--windows=6", "--train_windows=5", "--batch_size=4", "--n_grid=4",
                         "--timing_reps=1", "--probe_steps=50", "--plot", "--realized"])
    saved = json.loads((root / "out" / "allocate.json").read_text())
    assert (root / "out" / "allocate.png").stat().st_size > 0
    assert saved["r_max"] == R_MAX and saved["bar"] == saved["curves"]["A0"][2]["loss"] == res["bar"]
    assert [p["avg_depth"] for p in saved["curves"]["A0"]] == list(range(1, R_MAX + 1))
    for key, lowest in (("A1", 2), ("A1s", 2), ("A2", 1)):
        assert len(saved["curves"][key]) == 4
        assert all(lowest <= p["avg_depth"] <= R_MAX and np.isfinite(p["loss"]) for p in saved["curves"][key])
    assert [row["avg_depth"] for row in saved["table"]] == [3 * f / 8 for f in range(3, 8)]
    assert saved["depth_at_bar"]["A0"] <= 3 and 0 <= saved["probe"]["accuracy"] <= 1
    assert set(saved["realized"]) == {"kl", "state"} and all(saved["realized"][k] for k in ("kl", "state"))


@pytest.mark.parametrize("args", [["--out_dir=nowhere"], ["--out_dir=out", "--r_max=0"], ["--out_dir=out", "--r_max=2"],
                                  ["--out_dir=out", "--windows=1000000"], ["--out_dir=out", "--r_max=x"]])
def test_bad_input_exits_with_one_line(trained, monkeypatch, capsys, args):
    monkeypatch.chdir(trained[0])
    with pytest.raises(SystemExit) as exc:
        allocate.main(args)
    assert exc.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_checkpoint_without_its_dataset_exits(trained, tmp_path, monkeypatch, capsys):
    (tmp_path / "out").mkdir()
    os.link(trained[0] / "out" / "ckpt.pt", tmp_path / "out" / "ckpt.pt")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        allocate.main(["--out_dir=out"])
    assert exc.value.code == 2 and "data/tiny" in capsys.readouterr().err
