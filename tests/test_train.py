import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import train
from configurator import configure
from model import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--dataset=tiny", "--n_embd=32", "--n_head=2", "--n_kv_head=1", "--ffn_hidden=48", "--n_prelude=1",
        "--n_core=1", "--n_coda=1", "--block_size=16", "--batch_size=4", "--mean_loops=2", "--max_loops=4",
        "--bptt_k=1", "--eval_iters=2", "--log_interval=1", "--compile=False", "--peak_flops=1e9"]


@pytest.fixture
def tiny_data(tmp_path, monkeypatch):
    """data/tiny with a learnable token stream (a repeating pattern with noise)."""
    monkeypatch.chdir(tmp_path)
    os.makedirs("data/tiny")
    rng = np.random.default_rng(0)
    for split, n in (("train", 20000), ("val", 2000)):
        tokens = (np.arange(n) % 7 + rng.integers(0, 2, n) * 7).astype(np.uint16)
        tokens.tofile(f"data/tiny/{split}.bin")
    meta = dict(source="test", tokenizer="none", vocab_size=14, eot_id=0, dtype="uint16", train_tokens=20000, val_tokens=2000)
    Path("data/tiny/meta.json").write_text(json.dumps(meta))
    return tmp_path


def test_depth_sampler_median_bounds_and_rank_independence():
    draws = [train.sample_loops(step, 1337, 8, 32) for step in range(4000)]
    assert min(draws) >= 1 and max(draws) <= 32
    assert np.median(draws) == 8
    assert 3 < np.mean(draws) < 12 and len(set(draws)) > 8  # spread, not constant
    # two "ranks" with different global RNG states draw the same depths
    torch.manual_seed(0)
    rank0 = [train.sample_loops(s, 7, 4, 16) for s in range(50)]
    torch.manual_seed(1)
    torch.rand(100)
    assert rank0 == [train.sample_loops(s, 7, 4, 16) for s in range(50)]
    assert train.sample_loops(3, 7, 4, 16, "fixed") == 4
    assert all(1 <= train.sample_loops(s, 0, 1, 1) <= 1 for s in range(20))


def test_lr_schedule_warmup_then_cosine_to_min():
    C = configure(train.DEFAULTS, ["--max_iters=1000", "--learning_rate=1.0", "--min_lr=0.1"])
    C = type("C", (), C)
    assert train.get_lr(0, C) == pytest.approx(0.1)  # warmup is 1% = 10 iters
    assert train.get_lr(9, C) == pytest.approx(1.0)
    assert train.get_lr(1000, C) == pytest.approx(0.1)
    assert train.get_lr(505, C) == pytest.approx(0.55, abs=1e-3)


def test_configurator_errors(tmp_path, capsys):
    d = train.DEFAULTS
    assert configure(d, ["--max_iters=5", "--batch_size", "3", "--dtype=bfloat16", "--compile=True"])["batch_size"] == 3
    assert configure(d, ["--learning_rate=1"])["learning_rate"] == 1.0
    bare = configure(d, ["--wandb_log", "--compile", "False", "--max_iters", "7"])  # a bare boolean flag is True
    assert (bare["wandb_log"], bare["compile"], bare["max_iters"]) == (True, False, 7)
    for bad in (["--nope=1"], ["--max_iters=abc"], ["--max_iters=1.5"], ["--compile=1"], ["--batch_size"],
                ["missing_config.py"]):
        with pytest.raises(SystemExit) as err:
            configure(d, bad)
        assert err.value.code != 0
    cfg = tmp_path / "c.py"
    cfg.write_text("max_iters = 3\nbogus_key = 1\n")
    with pytest.raises(SystemExit):
        configure(d, [str(cfg)])
    assert "bogus_key" in capsys.readouterr().err
    cfg.write_text("import math\nmax_iters = 3\nlearning_rate = math.sqrt(4e-6)\n")
    assert configure(d, [str(cfg), "--max_iters=4"])["max_iters"] == 4


def test_training_learns_and_writes_a_loadable_checkpoint(tiny_data, capsys):
    hist = train.main(TINY + ["--max_iters=40", "--eval_interval=20", "--learning_rate=1e-2", "--out_dir=out"])
    assert len(hist) == 40 and sum(h[2] for h in hist[-5:]) < sum(h[2] for h in hist[:5])
    assert {h[1] for h in hist} != {2}  # the depth really varies step to step
    out = capsys.readouterr().out
    assert "attention input dtypes" in out and "float32" in out and "mfu" in out
    model, ckpt = load_checkpoint("out/ckpt.pt")
    assert ckpt["iter_num"] == 40 and model.config.vocab_size == 14 and ckpt["config"]["dataset"] == "tiny"


def test_resume_equals_uninterrupted_run(tiny_data):
    common = TINY + ["--lr_decay_iters=8", "--eval_interval=4"]
    straight = train.main(common + ["--max_iters=8", "--out_dir=a"])
    first = train.main(common + ["--max_iters=4", "--out_dir=b"])
    resumed = train.main(common + ["--max_iters=8", "--out_dir=b", "--init_from=resume"])
    assert first == straight[:4]
    assert resumed == straight[4:]  # exactly: same weights, optimizer, data and noise streams


def test_nonfinite_guard_skips_logs_and_aborts(tiny_data, monkeypatch, capsys):
    real_clip = torch.nn.utils.clip_grad_norm_
    calls = {"n": 0, "nan_at": {3}}

    def clip_with_nan(params, max_norm):
        norm = real_clip(params, max_norm)
        calls["n"] += 1
        return norm * float("nan") if calls["n"] - 1 in calls["nan_at"] else norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_with_nan)
    hist = train.main(TINY + ["--max_iters=6", "--eval_interval=6", "--out_dir=g"])
    assert len(hist) == 6
    assert "iter 3: non-finite loss or grad norm, optimizer step skipped" in capsys.readouterr().out
    ckpt = torch.load("g/ckpt.pt", weights_only=True)
    assert {int(s["step"]) for s in ckpt["optimizer"]["state"].values()} == {5}  # 6 iters, 1 skipped
    calls.update(n=0, nan_at={2, 3, 4})
    with pytest.raises(SystemExit) as err:
        train.main(TINY + ["--max_iters=8", "--eval_interval=8", "--out_dir=h"])
    assert err.value.code != 0 and "3 consecutive non-finite" in capsys.readouterr().err
    skipped = []
    consecutive = 0
    for it in range(150):  # one skip inside the grace period is tolerated...
        consecutive = train.nonfinite_guard(it != 5, it, skipped, consecutive, grace=100)
    with pytest.raises(SystemExit):  # ...a second one after it exceeds 0.1% of 151 steps
        train.nonfinite_guard(False, 150, skipped, 0, grace=100)


def test_crash_during_save_keeps_the_old_checkpoint(tiny_data, monkeypatch):
    train.main(TINY + ["--max_iters=2", "--eval_interval=2", "--out_dir=c"])
    before = Path("c/ckpt.pt").read_bytes()

    def crashing_save(obj, f):
        f.write(b"partial garbage")
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(torch, "save", crashing_save)
    with pytest.raises(KeyboardInterrupt):
        train.save_checkpoint({"x": 1}, "c/ckpt.pt")
    assert Path("c/ckpt.pt").read_bytes() == before
    load_checkpoint("c/ckpt.pt")


def test_bad_inputs_exit_with_one_line(tiny_data, capsys):
    for argv in (["--dataset=nope"], ["--init_from=resume", "--out_dir=none"], ["--dtype=float16"],
                 ["--loop_dist=uniform"], ["--mean_loops=5", "--max_loops=4"]):
        with pytest.raises(SystemExit) as err:
            train.main(TINY + argv)
        assert err.value.code != 0
        assert capsys.readouterr().err.strip().count("\n") == 0
    Path("bad.pt").write_bytes(b"not a checkpoint")
    torch.save({"model": {}}, "foreign.pt")
    for path in ("bad.pt", "foreign.pt", "missing.pt"):
        with pytest.raises(SystemExit):
            load_checkpoint(path)


def test_ddp_two_cpu_processes_with_gloo(tiny_data):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py")] + TINY + ["--max_iters=4", "--eval_interval=4", "--out_dir=ddp",
                                             "--gradient_accumulation_steps=2"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("iter 3:") == 1  # only rank 0 logs
    model, ckpt = load_checkpoint("ddp/ckpt.pt")
    assert ckpt["iter_num"] == 4 and len(ckpt["rng"]["data"]) == 2
