"""Tests for bench.py: the FLOP counts it reports, the dense twin's sizing, and one tiny end-to-end run."""
import json
import sys
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
import bench  # noqa: E402
import train  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

TINY = dict(vocab_size=64, block_size=16, n_embd=32, n_head=2, n_kv_head=1, ffn_hidden=64,
            n_prelude=1, n_core=1, n_coda=1, mean_loops=2, max_loops=6, bptt_k=2)
TINY_ARGS = [f"--{k}={v}" for k, v in TINY.items()] + ["--batch_size=2", "--device=cpu", "--dtype=float32",
                                                         "--matmul_n=256"]


def test_flops_per_token_matches_a_hand_count():
    model = GPT(GPTConfig(**TINY))
    d, kv, ffn, V, T = 32, 16, 64, 64, 16  # n_kv_head * head_dim = 1 * 16
    attn_proj = d * d + 2 * d * kv + d * d  # wq, wk, wv, wo: 3072
    mlp = 3 * d * ffn  # SwiGLU gate, up, down: 6144
    block = attn_proj + mlp + 2 * d  # + two RMSNorm gains: 9280
    core = (block + 2 * d) + 2 * d * d  # sandwich norms + the adapter Linear(2d -> d): 11392
    outer = 2 * block + d + V * d  # prelude + coda + final norm + tied head: 20640
    attn = 2 * 2 * T * d  # QK^T and AV, full T x T, per layer forward: 2048
    fwd_outer, fwd_core = 2 * outer + 2 * attn, 2 * core + 1 * attn  # 45376, 24832
    loops, n_grad = 5, 2
    hand = 3 * fwd_outer + 3 * n_grad * fwd_core + (loops - n_grad) * fwd_core
    assert hand == 359_616
    assert model.flops_per_token(loops, n_grad, T) == hand
    assert bench.fwd_flops(model, 2, T) == fwd_outer + 2 * fwd_core


def test_dense_twin_has_the_recurrent_forward_flops_within_half_a_block():
    C = SimpleNamespace(block_size=16, mean_loops=2, device="cpu")
    rec = GPT(GPTConfig(**TINY))
    dense, block_fwd = bench.dense_twin(rec, C, TINY["vocab_size"])
    assert block_fwd == 2 * 9280 + 2048  # one plain block's forward: 2N + attention
    # an integer number of blocks can miss by at most half a block (here 0.41 of one: 86592 vs 95040)
    target, got = bench.fwd_flops(rec, 2, 16), bench.fwd_flops(dense, 0, 16)
    assert abs(got - target) <= 0.5 * block_fwd and dense.config.n_prelude == 4
    assert (dense.config.n_core, dense.config.n_coda, dense.config.n_embd) == (0, 0, 32)
    x = torch.randint(64, (2, 16))
    assert dense.readout(dense.prelude(x)).shape == (2, 16, 64)


def test_activation_memory_is_bounded_by_bptt_k_not_depth():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    x, y = torch.randint(64, (2, 2, 16))

    def saved(loops):
        step = lambda: bench.train_step(model, opt, x, y, loops, nullcontext(), 1.0)  # noqa: E731
        return bench.saved_activation_bytes(model, step)
    one, two, six = saved(1), saved(2), saved(6)
    assert 0 < one < two  # a second loop under grad keeps its activations
    assert six == two  # loops 1..4 of 6 run under no-grad and keep nothing


def test_bench_runs_end_to_end_and_depth_changes_do_not_recompile(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = TINY_ARGS + ["--warmup_steps=1", "--bench_steps=4", "--rounds=3", "--profile_rows=4",
                        "--compile=True", "--compile_backend=eager", "--bench_json=out.json"]
    out = bench.main(argv)
    assert json.loads((tmp_path / "out.json").read_text())["depths"] == out["depths"]
    depths = [train.sample_loops(i, 1337, 2, 6) for i in range(4)]
    assert out["depths"] == depths and len(set(depths)) > 1 and max(depths) > TINY["bptt_k"]
    rec, dense = out["recurrent"], out["dense"]
    model = GPT(GPTConfig(**TINY))
    expected = sum(model.flops_per_token(r, min(r, 2), 16) for r in depths) / len(depths)
    assert rec["train_flops_per_token"] == pytest.approx(expected)
    for x in (rec, dense):
        assert x["tokens_per_s"] > 0
        assert x["flops_per_s"] == pytest.approx(x["tokens_per_s"] * x["train_flops_per_token"])
        assert x["mfu"] == pytest.approx(x["flops_per_s"] / out["ceiling_flops"]) and x["activation_bytes"] > 0
    # prelude, core with grad, core without grad, coda; then no recompile as the depth changes every step
    assert (rec["graphs_compiled"], dense["graphs_compiled"]) == (4, 1)
    assert out["recompiles_during_timed_steps"] == 0
    assert len(out["profile"]) == 4 and all(p["self_ms"] >= 0 for p in out["profile"])
    assert out["vocab_from"] == "--vocab_size"


def test_bf16_autocast_without_compile_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = bench.main(TINY_ARGS + ["--dtype=bfloat16", "--warmup_steps=1", "--bench_steps=2", "--rounds=1",
                                  "--profile_rows=0", "--compile=False"])  # later flags override earlier ones
    assert out["recompiles_during_timed_steps"] is None and "profile" not in out
    assert out["recurrent"]["flops_per_s"] > 0 and out["dense"]["flops_per_s"] > 0


def test_vocab_comes_from_the_flag_the_prepared_dataset_or_its_tokenizer(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "mine").mkdir(parents=True)
    (tmp_path / "data" / "mine" / "meta.json").write_text(json.dumps({"vocab_size": 300}))
    C = SimpleNamespace(vocab_size=0, dataset="mine")
    assert bench.resolve_vocab(C) == (300, "data/mine/meta.json")
    assert bench.resolve_vocab(SimpleNamespace(vocab_size=0, dataset="shakespeare"))[0] == 1024
    assert bench.resolve_vocab(SimpleNamespace(vocab_size=0, dataset="fineweb-edu"))[0] == 49152
    assert bench.resolve_vocab(SimpleNamespace(vocab_size=77, dataset="mine")) == (77, "--vocab_size")


@pytest.mark.parametrize("bad", ["--bench_steps=0", "--rounds=0", "--dtype=float16", "--mean_loops=9", "--nope=1",
                                 "--compile_backend=nonsense", "--bench_json=no/such/dir/bench.json",
                                 "--n_head=3", "--matmul_n=-1"])
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
    monkeypatch.setattr(sys, "argv", ["bench.py"] + TINY_ARGS)
    with pytest.raises(SystemExit) as exit_info:
        configurator.run(bench.main)
    assert exit_info.value.code == 130 and capsys.readouterr().err.endswith("interrupted\n")
    assert not (tmp_path / "bench.json").exists()


def test_frontier_on_a_hand_made_curve():
    # uniform r = 1..4 as (loss, tokens/s); r=4 is slower than r=3 and no better: off the frontier
    uniform = [(4.0, 1000.0), (3.0, 600.0), (2.5, 400.0), (2.6, 300.0)]
    front = bench.frontier(uniform)
    assert front == [(2.5, 400.0), (3.0, 600.0), (4.0, 1000.0)]
    # a point at loss 3.5 running 1600 tokens/s: the frontier runs 800 there (half way from 600 to 1000)
    assert bench.iso_loss_speedup(front, 3.5, 1600.0) == (pytest.approx(2.0), "inside")
    # at 800 tokens/s the frontier's loss is 3.5: 0.25 nats better than it at 3.25
    assert bench.iso_speed_gain(front, 3.25, 800.0) == pytest.approx(0.25)
    # better than every uniform depth: read against the best uniform point, flagged as a lower bound
    assert bench.iso_loss_speedup(front, 2.0, 500.0) == (pytest.approx(1.25), "below")
    assert bench.iso_speed_gain(front, 2.0, 500.0) == pytest.approx(2.75 - 2.0)
    assert bench.iso_loss_speedup(front, 4.5, 500.0)[1] == "above"
    assert bench.iso_speed_gain(front, 3.0, 2000.0) is None  # faster than the fastest uniform depth
