"""Tests for allocate.py on a tiny model trained here on a byte-level dataset of real English text."""
import copy
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
from evaluate import load_windows, trace  # noqa: E402
from model import MIN_EXIT_LOOP, exit_score, token_loss  # noqa: E402
from model import autocast  # noqa: E402
from model import load_checkpoint  # noqa: E402

R_MAX = 6  # 2 x the tiny model's mean_loops


@torch.no_grad()
def masked_exit(model, x, y, r_max, criterion, threshold, probe=None):
    """The paper's teacher-forced masking harness: every token runs every loop and a frozen token's
    state is held by torch.where, so it keeps serving as key/value to the others, recomputed from its
    frozen state (the K/V of one loop further than it ran). It saves no work, it only counts it.
    Returns per-token loss and loops run, (B, T) each."""
    e = model.prelude(x)
    s = model.init_state(e, "zero")
    active = torch.ones_like(y, dtype=torch.bool)
    depth = torch.zeros_like(y)
    logits = model.readout(s) if criterion == "kl" else None
    for loop in range(1, r_max + 1):
        s_new = torch.where(active[..., None], model.core_step(e, s), s)
        depth += active
        new_logits = model.readout(s_new) if criterion == "kl" else None
        if criterion == "kl":  # a frozen token carries the distribution it stopped with
            new_logits = torch.where(active[..., None], new_logits, logits)
        if loop >= allocate.MIN_EXIT_LOOP:
            active &= (probe(s_new) if criterion == "probe" else exit_score(criterion, s_new, s, new_logits, logits)) >= threshold
        s, logits = s_new, new_logits
    if criterion != "kl":
        logits = model.readout(s)
    return token_loss(logits, y), depth


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


def train_tiny(root, steps, loops):
    """data/tiny and out/ckpt.pt under root: a width-32 model trained for `steps` on it."""
    write_byte_dataset(root)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        train.main(["--dataset=tiny", "--out_dir=out", f"--max_iters={steps}", "--n_embd=32", "--n_head=2",
                    "--n_kv_head=1", "--ffn_hidden=64", "--block_size=32", "--batch_size=8",
                    f"--eval_interval={steps}", "--eval_iters=1", "--compile=False", "--learning_rate=5e-3",
                    "--log_interval=1000"] + loops)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained for 60 steps (converged enough for the exits to mean something), its dir and data."""
    root = tmp_path_factory.mktemp("alloc")
    train_tiny(root, 60, ["--n_core=2", "--mean_loops=3", "--max_loops=8", "--bptt_k=4"])
    model, _ = load_checkpoint(str(root / "out" / "ckpt.pt"))
    wins = load_windows(str(root / "data/tiny/val.bin"), "uint16", 8, 33, 0)
    return root, model, wins[:, :-1], wins[:, 1:].contiguous()


def test_interpolation_on_a_hand_made_curve():
    curve = [(4, 3.0), (1, 4.0), (8, 2.9), (2, 3.5)]  # unsorted on purpose
    assert allocate.interp_loss(curve, 3) == pytest.approx(3.25)
    assert allocate.interp_loss(curve, 8) == pytest.approx(2.9)
    assert allocate.interp_loss(curve, 0.5) is None and allocate.interp_loss(curve, 9) is None
    assert allocate.cost_at_loss(curve, 3.25) == pytest.approx(3.0)
    assert allocate.cost_at_loss(curve, 3.6) == pytest.approx(1.8)
    assert allocate.cost_at_loss(curve, 5.0) == 1  # already there at its shallowest point
    assert allocate.cost_at_loss(curve, 2.0) is None
    assert allocate.cost_at_loss([(1, 3.0), (2, 2.0), (3, 3.0), (4, 1.0)], 2.5) == pytest.approx(1.5)  # first crossing


def test_thresholds_are_placed_within_the_tolerance_of_each_target():
    """A synthetic policy: loops fall smoothly from 8 to 2 as the threshold rises over decades."""
    calls = []

    def measure_at(t):
        calls.append(t)
        depth = np.full(4, 2 + 6 / (1 + (t / 1e-3) ** 0.7))
        return 5 - 0.1 * depth, depth, 1e6 * depth
    points = {t: measure_at(t) for t in (1e-5, 1e-1)}
    for target in (3.0, 4.5, 6.0, 7.5):
        allocate.place(measure_at, points, 1, target, 0.05)
        assert min(abs(p[1].mean() - target) for p in points.values()) <= 0.05
    allocate.place(measure_at, points, 2, 5.2e6, 0.05)  # on FLOPs
    assert min(abs(p[2].mean() - 5.2e6) for p in points.values()) <= 0.05e6
    allocate.place(measure_at, points, 0, 4.55, 0.05)  # on loss (rises with the threshold)
    assert min(abs(p[1].mean() - 4.5) for p in points.values()) <= 0.05
    n = len(calls)
    allocate.place(measure_at, points, 1, 1.5, 0.05)  # below the grid (2 loops): left unmeasured
    assert len(calls) == n and n <= 20


def test_bootstrap_interval_on_a_synthetic_pair():
    """A1 is A0 minus 0.05 nats on every window, plus noise. Over 40 synthetic evaluations the paired 95%
    interval holds the true -0.05 about 95% of the time, and it narrows as the windows grow (~1/sqrt(n))."""
    def stat(pw):
        return pw["A1"][0][0].mean() - pw["A0"][0][0].mean()

    widths, covered = {}, 0
    for n in (64, 1024):
        widths[n] = []
        for trial in range(40 if n == 64 else 5):
            g = np.random.default_rng(1000 * n + trial)
            a0 = g.normal(3.0, 0.3, n)
            a1 = a0 - 0.05 + g.normal(0, 0.05, n)
            ones = np.ones((1, n))
            est = allocate.estimate(stat, {"A0": (a0[None], ones), "A1": (a1[None], ones)}, 500, trial)
            low, high = est["interval"]
            assert low <= est["value"] <= high
            covered += n == 64 and low < -0.05 < high
            widths[n].append(high - low)
    assert covered >= 34  # 95% nominal; 34 of 40 leaves room for chance
    assert np.mean(widths[1024]) < 0.4 * np.mean(widths[64])


def test_undefined_statistics_have_no_interval():
    ones = np.ones((1, 8))
    pw = {"A0": (ones, ones)}
    assert allocate.estimate(lambda pw: None, pw, 100, 0) == {"value": None, "interval": None}


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


@pytest.mark.parametrize("engine", [masked_exit, allocate.realized_exit])
def test_threshold_zero_is_a0_at_r_max_and_huge_is_loop_2(trained, engine):
    _, model, X, Y = trained
    tr = trace(model, X, Y, R_MAX)
    loss, depth = engine(model, X, Y, R_MAX, "kl", 0.0)[:2]
    assert torch.all(depth == R_MAX)
    torch.testing.assert_close(loss, tr["loss"][-1], rtol=0, atol=1e-5)
    for criterion, probe in (("kl", None), ("state", None), ("probe", lambda s: s[..., 0] * 0)):
        loss, depth = engine(model, X, Y, R_MAX, criterion, 1e9, probe)[:2]
        assert torch.all(depth == 2)  # no exit before loop 2, whatever the policy
        torch.testing.assert_close(loss, tr["loss"][1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("criterion", ["kl", "state"])
def test_frozen_tokens_stop_changing(trained, criterion):
    _, model, X, Y = trained
    tr = trace(model, X, Y, R_MAX)
    eps = (tr["kl"] if criterion == "kl" else tr["dstate_rel"])[2].median().item()  # freezes about half by loop 3
    short_loss, short_depth = masked_exit(model, X, Y, 4, criterion, eps)
    loss, depth = masked_exit(model, X, Y, 8, criterion, eps)
    frozen = short_depth < 4  # frozen before the short run's last loop
    assert 0.2 < frozen.float().mean() < 1 and torch.all(depth[~frozen] >= 4) and (depth > 4).any()
    assert torch.equal(depth[frozen], short_depth[frozen])
    if criterion == "kl":  # four more loops did not change their carried distributions
        assert torch.equal(loss[frozen], short_loss[frozen])


@pytest.mark.parametrize("criterion", ["kl", "state", "probe"])
def test_batched_realized_equals_batch_1_and_matches_the_masking_harness(trained, criterion):
    _, model, X, Y = trained
    model = copy.deepcopy(model).double()  # float64: batch shapes cannot flip a decision by rounding
    tr = trace(model, X, Y, R_MAX, keep_states=True)
    probe = lambda s: torch.sigmoid(s[..., 0].float() * 3)  # noqa: E731  any function of the state
    scores = {"kl": tr["kl"], "state": tr["dstate_rel"], "probe": probe(tr["state"])}
    eps = scores[criterion][2].float().median().item()
    evals = []  # tokens each core call carries
    core_step = model.core_step
    causal = []  # whether each call took the plain causal path (no positions: every token active)
    model.core_step = lambda e, *a: evals.append(e.shape[:2].numel()) or causal.append(len(a) == 2) or core_step(e, *a)
    loss, depth = allocate.realized_exit(model, X, Y, R_MAX, criterion, eps, probe)
    model.core_step = core_step
    for i in range(len(X)):  # token for token, window by window
        one_loss, one_depth = allocate.realized_exit(model, X[i:i + 1], Y[i:i + 1], R_MAX, criterion, eps, probe)
        assert torch.equal(one_depth[0], depth[i])
        torch.testing.assert_close(one_loss[0], loss[i], rtol=0, atol=1e-12)
    masked_loss, masked_depth = masked_exit(model, X, Y, R_MAX, criterion, eps, probe)
    assert abs(loss.mean().item() - masked_loss.mean().item()) < 0.005  # they differ only in frozen tokens' K/V
    assert abs(depth.float().mean().item() - masked_depth.float().mean().item()) < 0.25
    assert depth.sum().item() <= sum(evals) < 0.8 * Y.numel() * R_MAX  # frozen tokens cost nothing (padding aside)
    assert causal[:MIN_EXIT_LOOP] == [True] * MIN_EXIT_LOOP and not all(causal)
    assert all(n == Y.numel() for n, c in zip(evals, causal) if c)


def test_main_writes_json_tables_in_loops_and_flops_and_plot(trained, monkeypatch):
    root, model, *_ = trained
    monkeypatch.chdir(root)
    res = allocate.main(["--out_dir=out", "--windows=6", "--train_windows=2", "--batch_size=4", "--n_grid=4",
                         "--probe_steps=50", "--bootstrap=50", "--plot"])
    saved = json.loads((root / "out" / "allocate.json").read_text())
    assert (root / "out" / "allocate.png").stat().st_size > 0
    assert saved["r_max"] == R_MAX and saved["bar"] == saved["curves"]["A0"][2]["loss"] == res["bar"]
    assert [p["avg_depth"] for p in saved["curves"]["A0"]] == list(range(1, R_MAX + 1))
    assert saved["checkpoint"]["id"].endswith("@60")
    for key in ("A1", "A1s", "A2"):
        assert len(saved["curves"][key]) >= 4
        assert all(2 <= p["avg_depth"] <= R_MAX and np.isfinite(p["loss"]) for p in saved["curves"][key])
        depths = sorted(p["avg_depth"] for p in saved["curves"][key])
        for d in [row["avg_depth"] for row in saved["table"] if depths[0] <= row["avg_depth"] <= depths[-1]]:
            assert min(abs(x - d) for x in depths) <= 0.05 + 1e-9  # read at a measurement, not interpolated
    assert [row["avg_depth"] for row in saved["table"]] == [3 * f / 8 for f in range(3, 8)]
    # the same rows at matched FLOPs: uniform depth's FLOPs at those depths
    flops = [model.inference_flops(d, 32) for d in (3 * f / 8 for f in range(3, 8))]
    assert [row["cost"] for row in saved["table_flops"]] == pytest.approx(flops)
    assert saved["at_bar"]["A0"]["loops"]["value"] <= 3 and 0 <= saved["probe"]["accuracy"] <= 1
    a1 = saved["curves"]["A1"][0]  # the KL exit pays a readout and a test every loop
    d = a1["avg_depth"]
    assert a1["flops"] == pytest.approx(model.inference_flops(d, 32) + (d - 1) * (model.flop_terms(32)[2] + 8 * 256))
    assert len(saved["per_window"]["A1"]) == 3 and len(saved["per_window"]["A1"][0][0]) == 6


def test_policy_flops_on_a_hand_count(trained):
    model = trained[1]  # d 32, 2 core blocks, 1 prelude, 1 coda, vocab 256, ffn 64, kv 16
    d, kv, ffn, V, T = 32, 16, 64, 256, 32
    block = 2 * d * d + 2 * d * kv + 3 * d * ffn  # attention and SwiGLU matmuls
    attn = 4 * T * d
    prelude, core, readout = 2 * block + attn, 2 * (2 * block + 2 * d * d) + 2 * attn, 2 * block + 2 * V * d + attn
    assert model.flop_terms(T) == (prelude, core, readout)
    assert model.inference_flops(3, T) == prelude + 3 * core + readout
    kl = prelude + 3 * core + 3 * readout + 2 * 8 * V  # three readouts, two KL tests (loops 2 and 3)
    assert model.inference_flops(3, T, "kl") == kl
    assert model.inference_flops(3, T, "state") == prelude + 3 * core + readout + 2 * 6 * d
    assert model.inference_flops(3, T, "probe") == prelude + 3 * core + readout + 2 * 4 * d


@pytest.mark.parametrize("criterion", ["kl", "state"])
def test_realized_engine_runs_under_bf16_autocast_with_a_float32_state(trained, criterion):
    _, model, X, Y = trained
    with autocast("cpu", "bfloat16"):
        loss, depth = allocate.realized_exit(model, X, Y, R_MAX, criterion, 1e-3)
        masked_loss, _ = masked_exit(model, X, Y, R_MAX, criterion, 1e-3)
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all() and (depth >= 2).all()
    assert abs(loss.mean().item() - masked_loss.mean().item()) < 0.05


def test_settings_sweep_is_one_line_or_a_run(trained, monkeypatch, capsys):
    monkeypatch.chdir(trained[0])
    numeric = [k for k, rule in allocate.RULES.items() if isinstance(rule, tuple) and not isinstance(rule[0], str)]
    for key in numeric:
        for value in ("-1", "1e999", "nan", "True", "'x'"):
            with pytest.raises(SystemExit) as exc:
                allocate.main(["--out_dir=out", f"--{key}={value}"])
            err = capsys.readouterr().err
            assert exc.value.code == 2 and err.startswith("error:") and err.count("\n") == 1, (key, value, err)


@pytest.mark.parametrize("args", [["--out_dir=nowhere"], ["--out_dir=out", "--r_max=-1"], ["--out_dir=out", "--r_max=2"],
                                  ["--out_dir=out", "--windows=1000000"], ["--out_dir=out", "--r_max=x"],
                                  ["--out_dir=out", "--dtype=float16"], ["--out_dir=out", "--device=cpu:0"]])
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
