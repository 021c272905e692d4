"""Tests for bench.py: the dense twin's construction, the FLOPs it reports, and tiny end-to-end runs."""
import json
import sys
from pathlib import Path

import pytest
import torch

import bench
import configurator
import train
from model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(vocab_size=64, block_size=16, n_embd=32, n_head=2, n_kv_head=1, ffn_hidden=64,
            n_prelude=1, n_core=1, n_coda=1, mean_loops=2, max_loops=6, bptt_k=2)
TINY_ARGS = [f"--{k}={v}" for k, v in TINY.items()] + ["--batch_size=2", "--device=cpu", "--dtype=float32",
                                                        "--compile=False", "--bench_steps=4", "--rounds=2"]


def refusal(capsys, argv):
    """bench.main(argv) through configurator.run: exit 2 and one 'error: ' line -> that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        configurator.run(lambda _: bench.main(argv))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return err


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


@pytest.mark.parametrize("n_core, mean_loops", [(1, 2), (2, 3), (4, 8)])
def test_dense_twin_is_the_same_blocks_unrolled_once(n_core, mean_loops):
    """n_core * mean_loops core blocks in one loop from s_0 = 0, the same prelude, coda and width: its forward
    FLOPs are the recurrent model's at mean_loops less one adapter Linear(2d -> d) a loop after the first."""
    config = GPTConfig(**TINY | dict(n_core=n_core, mean_loops=mean_loops, max_loops=8, bptt_k=2))
    twin = bench.dense_twin(config)
    assert (twin.n_core, twin.mean_loops, twin.max_loops, twin.bptt_k, twin.state_std) == \
        (n_core * mean_loops, 1, 1, 1, 0.0)
    same = ("vocab_size", "block_size", "n_embd", "n_head", "n_kv_head", "ffn_hidden", "n_prelude", "n_coda")
    assert all(getattr(twin, key) == getattr(config, key) for key in same)
    recurrent, dense = GPT(config), GPT(twin)
    d, T = config.n_embd, config.block_size
    adapter = 2 * (2 * d * d)
    assert recurrent.inference_flops(mean_loops, T) - dense.inference_flops(1, T) == (mean_loops - 1) * adapter
    assert dense.get_num_params() == recurrent.get_num_params() + (n_core * mean_loops - n_core) * \
        sum(p.numel() for p in recurrent.core.blocks[0].parameters())  # its core holds every unrolled block
    x = torch.randint(64, (2, 16))
    assert torch.equal(dense(x, loops=1)[0], dense(x, loops=1)[0])  # s_0 = 0: no noise


def test_bench_runs_end_to_end_and_depth_changes_do_not_recompile(tmp_path, monkeypatch, capsys):
    """Compiled with inductor, as a GPU user's run is: a new depth every step compiles no new graph."""
    monkeypatch.chdir(tmp_path)
    torch._dynamo.reset()
    argv = TINY_ARGS + ["--compile=True", "--compile_backend=inductor", "--dtype=bfloat16", "--peak_flops=1e12"]
    try:
        out = bench.main(argv)
    finally:
        torch._dynamo.reset()
    assert json.loads((tmp_path / "bench.json").read_text()) == out
    depths = [train.sample_loops(i, 1337, 2, 6, "lognormal", 0.5) for i in range(4)]
    assert out["depths"] == depths and len(set(depths)) > 1 and max(depths) > TINY["bptt_k"]
    assert out["recompiles"] == 0  # the depth changes every step; the graphs do not
    for figures in (out["recurrent"], out["dense"]):
        assert figures["tokens_per_s"] > 0 and figures["flops_per_s"] > 0
        assert figures["mfu"] == pytest.approx(figures["flops_per_s"] / 1e12)
    printed = capsys.readouterr().out
    assert "recurrent / dense FLOP/s" in printed and "MFU" in printed and "recompiles while timing: 0" in printed


def test_flop_rate_counts_each_steps_own_depth(tmp_path, monkeypatch):
    """FLOP/s = the FLOPs of the steps timed (train.py's count, at each step's depth) / the median round."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench.statistics, "median", lambda seconds: 2.0)  # every round took 2 s
    out = bench.main(TINY_ARGS)
    recurrent = GPT(GPTConfig(**TINY))
    per_step = [recurrent.flops_per_token(r, min(r, 2), 16) * 2 * 16 for r in out["depths"]]
    assert out["recurrent"]["flops_per_s"] == pytest.approx(sum(per_step) / 2.0)
    dense = GPT(bench.dense_twin(GPTConfig(**TINY)))
    assert out["dense"]["flops_per_s"] == pytest.approx(4 * dense.flops_per_token(1, 1, 16) * 2 * 16 / 2.0)
    assert out["recurrent"]["tokens_per_s"] == out["dense"]["tokens_per_s"] == 4 * 2 * 16 / 2.0
    assert "mfu" not in out["recurrent"]  # a CPU without --peak_flops has no peak to measure against


@pytest.mark.parametrize("bad", ["--bench_steps=0", "--rounds=0", "--dtype=float16", "--mean_loops=9", "--nope=1",
                                 "--n_head=3", "--vocab_size=-1", "--vocab_size=0", "--device=gpu",
                                 "--compile=True --compile_backend=nonesuch"])
def test_bad_input_is_one_line_before_the_benchmark_runs(bad, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train, "train_step", None)  # a step would fail: every check comes first
    refusal(capsys, TINY_ARGS + bad.split())
    assert not (tmp_path / "bench.json").exists()


def test_every_numeric_setting_refuses_bad_values_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train, "train_step", None)
    for key in ("bench_steps", "rounds", "vocab_size", "batch_size", "n_embd", "mean_loops"):
        for value in ("-2", "1e999", "nan", "True", "'x'"):
            refusal(capsys, TINY_ARGS + [f"--{key}={value}"])


def test_ctrl_c_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)

    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(train, "train_step", interrupted)
    monkeypatch.setattr(sys, "argv", ["bench.py"] + TINY_ARGS)
    with pytest.raises(SystemExit) as exit_info:
        configurator.run(bench.main)
    assert exit_info.value.code == 130 and capsys.readouterr().err.endswith("interrupted\n")
    assert not (tmp_path / "bench.json").exists()


def test_help_lists_benchs_settings_and_trains(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "dense twin" in out
    assert "--bench_steps=4" in out and "--batch_size=8" in out
