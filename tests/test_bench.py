"""Tests for bench.py: the FLOP counts it reports, the dense twin's sizing, and one tiny end-to-end run."""
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
import bench  # noqa: E402
import train  # noqa: E402
from model import GPT, GPTConfig, load_checkpoint  # noqa: E402

TINY = dict(vocab_size=64, block_size=16, n_embd=32, n_head=2, n_kv_head=1, ffn_hidden=64,
            n_prelude=1, n_core=1, n_coda=1, mean_loops=2, max_loops=6, bptt_k=2)
TINY_ARGS = [f"--{k}={v}" for k, v in TINY.items()] + ["--batch_size=2", "--device=cpu", "--dtype=float32"]


def test_flops_per_token_matches_a_hand_count():
    model = GPT(GPTConfig(**TINY))
    d, kv, ffn, V, T = 32, 16, 64, 64, 16  # n_kv_head * head_dim = 1 * 16
    block = d * d + 2 * d * kv + d * d + 3 * d * ffn  # wq, wk, wv, wo and SwiGLU: 9216 weights
    attn = 2 * 2 * T * d  # QK^T and AV, full T x T, per layer forward: 2048
    fwd_outer = 2 * (2 * block + V * d) + 2 * attn  # prelude, coda and the tied head
    fwd_core = 2 * (block + 2 * d * d) + attn  # the core block and the adapter Linear(2d -> d)
    loops, n_grad = 5, 2
    hand = 3 * fwd_outer + 3 * n_grad * fwd_core + (loops - n_grad) * fwd_core
    assert model.flops_per_token(loops, n_grad, T) == hand
    assert model.inference_flops(2, T) == fwd_outer + 2 * fwd_core


def test_dense_twin_has_the_recurrent_forward_flops_within_half_a_block():
    C = SimpleNamespace(block_size=16, mean_loops=2, device="cpu", vocab_size=64)
    rec = GPT(GPTConfig(**TINY))
    dense = bench.dense_twin(rec, C)
    block_fwd = 2 * 9216 + 2048  # one plain block's forward: 2N + attention
    target, got = rec.inference_flops(2, 16), dense.inference_flops(1, 16)
    assert abs(got - target) <= 0.5 * block_fwd
    assert (dense.config.n_core, dense.config.n_coda, dense.config.n_embd) == (0, 0, 32)
    x = torch.randint(64, (2, 16))
    assert dense(x, loops=1)[0].shape == (2, 16, 64)
    assert torch.equal(dense(x, loops=1)[0], dense(x, loops=1)[0])  # s_0 = 0: no noise


def test_bench_runs_end_to_end_and_depth_changes_do_not_recompile(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch._dynamo.reset()
    argv = TINY_ARGS + ["--warmup_steps=2", "--bench_steps=4", "--rounds=2", "--vocab_size=64",
                        "--compile=True", "--compile_backend=aot_eager", "--dtype=bfloat16"]
    out = bench.main(argv)
    assert json.loads((tmp_path / "bench.json").read_text())["depths"] == out["depths"]
    depths = [train.sample_loops(i, 1337, 2, 6) for i in range(4)]
    assert out["depths"] == depths and len(set(depths)) > 1 and max(depths) > TINY["bptt_k"]
    assert out["recompiles"] == 0  # the depth changes every step; the graphs do not
    for x in (out["recurrent"], out["dense"]):
        assert x["tokens_per_s"] > 0 and x["flops_per_s"] > 0


@pytest.mark.parametrize("bad", ["--bench_steps=0", "--rounds=0", "--dtype=float16", "--mean_loops=9", "--nope=1",
                                 "--frontier=x", "--n_head=3", "--vocab_size=-1", "--cache=x",
                                 "--bench_tokens=1"])
def test_bad_input_dies_with_one_line_before_the_benchmark_runs(bad, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "GPT", None)  # building a model would fail: every check comes first
    with pytest.raises(SystemExit) as exit_info:
        bench.main(TINY_ARGS + [bad])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1


def test_ctrl_c_is_one_line(tmp_path, monkeypatch, capsys):
    import configurator
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "dense_twin", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    monkeypatch.setattr(bench, "GPT", GPT)
    monkeypatch.setattr(sys, "argv", ["bench.py"] + TINY_ARGS)
    with pytest.raises(SystemExit) as exit_info:
        configurator.run(bench.main)
    assert exit_info.value.code == 130 and capsys.readouterr().err.endswith("interrupted\n")
    assert not (tmp_path / "bench.json").exists()


def test_frontier_on_a_hand_made_curve():
    # uniform r = 1..4 as (loss, tokens/s); r=4 is slower than r=3 and no better: off the frontier
    uniform = [(4.0, 1000.0), (3.0, 600.0), (2.5, 400.0), (2.6, 300.0)]
    front = bench.uniform_frontier(uniform)
    assert front == [(2.5, 400.0), (3.0, 600.0), (4.0, 1000.0)]
    # a point at loss 3.5 running 1600 tokens/s: the frontier runs 800 there (half way from 600 to 1000)
    assert bench.iso_loss_speedup(front, 3.5, 1600.0) == (pytest.approx(2.0), "inside")
    # better than every uniform depth: read against the best uniform point, flagged
    assert bench.iso_loss_speedup(front, 2.0, 500.0) == (pytest.approx(1.25), "below")
    assert bench.iso_loss_speedup(front, 4.5, 500.0)[1] == "above"


def fake_allocation():
    """Uniform r = 1..4 (10..40 MFLOP/token) and an exit with many placed thresholds, its loops
    falling as the threshold rises (as allocate.py sorts them); per-window losses of 8 windows."""
    a0 = [dict(threshold=r, avg_depth=r, flops=r * 10e6, loss=loss)
          for r, loss in zip((1, 2, 3, 4), (4.0, 3.0, 2.5, 2.6))]
    depths = (4.5, 3.9, 3.3, 3.1, 2.6, 2.05, 1.9, 1.5, 1.2)
    a1 = [dict(threshold=0.01 * (i + 1), avg_depth=d, flops=d * 10e6, loss=5.0 - d)
          for i, d in enumerate(depths)]
    table = [{"avg_depth": d} for d in (1.5, 1.6, 2.0, 3.0, 3.5)]  # 1.5 and 1.6: one point
    noise = torch.linspace(-0.01, 0.01, 8).double().numpy()
    pw = {k: ([[p["loss"] + e for e in noise] for p in c],) for k, c in (("A0", a0), ("A1", a1))}
    pw = {k: tuple(map(np.array, arrays)) for k, arrays in pw.items()}
    return {"curves": {"A0": a0, "A1": a1}, "table": table, "args": {"seed": 0}}, pw


def test_exits_are_timed_only_near_the_tables_loops_at_their_original_indices():
    alloc, _ = fake_allocation()
    assert bench.timed_points(alloc, "A0") == [0, 1, 2, 3]  # every uniform depth
    # 1.5 -> 1.5 (index 7), 1.6 -> 1.5 again, 2.0 -> 2.05 (5), 3.0 -> 3.1 (3), 3.5 -> 3.3 (2)
    assert bench.timed_points(alloc, "A1") == [2, 3, 5, 7]
    alloc["table"] = [{"avg_depth": d} for d in (1.2, 1.5, 1.9, 2.05, 2.6, 3.1, 3.3, 3.9)]
    assert len(bench.timed_points(alloc, "A1")) == 5  # at most 5 a policy


def test_frontier_rows_read_each_timed_point_against_uniform(capsys):
    alloc, pw = fake_allocation()
    # uniform r = 1..4 run 400, 200, 133, 100 tokens/s; A1's points 2 (33 MFLOP/token), 6 (19) and 0
    # (45: beyond every uniform cost); 6 has loss 3.1 and 0 has 0.5, below every uniform loss
    speeds = {("A0", 0): 400.0, ("A0", 1): 200.0, ("A0", 2): 133.0, ("A0", 3): 100.0,
              ("A1", 2): 150.0, ("A1", 6): 300.0, ("A1", 0): 90.0}
    rows = bench.frontier_rows(alloc, pw, speeds, spent={})
    assert [r["policy"] for r in rows] == ["A0"] * 4 + ["A1"] * 3
    assert [r["threshold"] for r in rows[4:]] == [alloc["curves"]["A1"][i]["threshold"] for i in (2, 6, 0)]
    point2, point6, point0 = rows[4:]
    # realization: tokens/s over uniform depth's at the same FLOPs (33 MFLOP/token: 133 + 0.3 * -33)
    assert point2["realization"] == pytest.approx(150 / (133 - 0.3 * 33))
    assert point6["realization"] == pytest.approx(300 / (400 - 0.9 * 200))
    assert point0["realization"] is None  # beyond the uniform costs
    # iso-loss: 6 at loss 3.1 against the frontier's 200 + 0.1 * 200 = 220 at loss 3.1
    assert point6["where"] == "inside" and point6["speedup"]["value"] == pytest.approx(300 / 220)
    assert point6["speedup"]["interval"][0] <= 300 / 220 <= point6["speedup"]["interval"][1]
    assert point0["where"] == "below" and "below uniform" in capsys.readouterr().out
    # generation: a point is read at the FLOPs its own decoded tokens took (2.3 loops), not scoring's
    spent = {("A1", 2): {"avg_depth": 2.3, "flops": 23e6}}
    point2 = bench.frontier_rows(alloc, pw, speeds, spent)[4]
    assert point2["realization"] == pytest.approx(150 / (200 - 0.3 * 67)) and point2["avg_depth"] == 2.3
    assert point2["threshold"] == alloc["curves"]["A1"][2]["threshold"] and "| 2.30 | 23 |" in capsys.readouterr().out


@pytest.fixture(scope="module")
def allocated(tmp_path_factory):
    """A tiny trained checkpoint and its allocate.json (the test_allocate recipe, smaller)."""
    import allocate
    from test_allocate import train_tiny
    root = tmp_path_factory.mktemp("frontier")
    train_tiny(root, 30, ["--mean_loops=2", "--max_loops=4", "--bptt_k=2"])
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        allocate.main(["--out_dir=out", "--windows=40", "--train_windows=4", "--batch_size=4", "--n_grid=2",
                       "--probe_steps=20", "--bootstrap=20"])
    return root


@pytest.mark.parametrize("frontier", ["scoring", "generation"])
def test_frontier_bench_times_every_policy_and_reads_it_against_uniform(allocated, monkeypatch, frontier):
    monkeypatch.chdir(allocated)
    out = bench.main(["--out_dir=out", f"--frontier={frontier}", "--rounds=1", "--timing_windows=4",
                      "--bench_tokens=8", "--device=cpu", "--dtype=bfloat16"])
    saved = json.loads((allocated / "out" / f"{frontier}_bench.json").read_text())
    batches = ["1", "8", "32"] if frontier == "generation" else ["1", "4"]
    assert [k for k in saved if k.isdigit()] == batches and set(out) - {"command", "date"} == set(map(int, batches))
    alloc = json.loads((allocated / "out" / "allocate.json").read_text())
    model = load_checkpoint("out/ckpt.pt")[0]
    timed = [(k, i) for k in ("A0", "A1", "A1s") for i in bench.timed_points(alloc, k)]
    assert all(len(bench.timed_points(alloc, k)) <= 5 for k in ("A1", "A1s"))
    for rows in out.values():
        if not isinstance(rows, list):
            continue
        assert [(r["policy"], r["threshold"]) for r in rows] == [(k, alloc["curves"][k][i]["threshold"])
                                                                  for k, i in timed]
        assert all(r["tokens_per_s"] > 0 for r in rows)
        for r in rows[4:]:
            assert r["speedup"]["value"] > 0 and (r["realization"] is None or r["realization"] > 0)
        for r in rows if frontier == "generation" else ():  # read at the decoded tokens' own FLOPs
            assert r["flops"] == pytest.approx(model.inference_flops(r["avg_depth"], 32, bench.EXITS[r["policy"]]))
            assert r["avg_depth"] == r["threshold"] if r["policy"] == "A0" else 2 <= r["avg_depth"] <= alloc["r_max"]


def test_a_stale_allocation_is_refused(allocated, monkeypatch, capsys):
    monkeypatch.chdir(allocated)
    path = allocated / "out" / "allocate.json"
    alloc = json.loads(path.read_text())
    monkeypatch.setattr(bench, "checkpoint_id", lambda ckpt: "another-run@30")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--out_dir=out", "--frontier=scoring"])
    assert exc.value.code == 2 and "rerun allocate.py" in capsys.readouterr().err
    assert json.loads(path.read_text()) == alloc


def test_every_numeric_setting_refuses_bad_values_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rules = train.RULES | bench.BENCH_RULES
    numeric = [k for k, rule in rules.items() if isinstance(rule, tuple) and not isinstance(rule[0], str)]
    for key in numeric:
        for value in ("-2", "1e999", "nan", "True", "'x'"):
            with pytest.raises(SystemExit) as exc:
                bench.main(TINY_ARGS + [f"--{key}={value}"])
            err = capsys.readouterr().err
            assert exc.value.code == 2 and err.startswith("error:") and err.count("\n") == 1, (key, value, err)


def test_frontier_timing_runs_without_autograd(allocated, monkeypatch):
    """A graph per timed forward held every activation (the CPU default's scoring bench was killed
    at 24 GB) and slowed the uniform side."""
    monkeypatch.chdir(allocated)
    grad_modes = []
    forward = GPT.forward
    monkeypatch.setattr(GPT, "forward", lambda *a, **k: grad_modes.append(torch.is_grad_enabled()) or forward(*a, **k))
    bench.main(["--out_dir=out", "--frontier=scoring", "--rounds=1", "--timing_windows=2", "--device=cpu"])
    assert grad_modes and not any(grad_modes)
