"""Tests for train.py on a tiny model and a tiny learnable dataset: the depth sampler, the schedule, the
step (against one process and one micro-batch), the guard, resume, checkpoints, metrics and bad input."""
import io
import json
import math
import multiprocessing
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch._inductor.config
import torch.distributed as dist

import configurator
import model as model_lib
import train
from configurator import UserError, configure
from conftest import script_env
from model import GPT, GPTConfig, load_checkpoint, save_atomic

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--dataset=tiny", "--n_embd=32", "--n_head=2", "--n_kv_head=1", "--ffn_hidden=48", "--n_prelude=1",
        "--n_core=1", "--n_coda=1", "--block_size=16", "--batch_size=4", "--mean_loops=2", "--max_loops=4",
        "--bptt_k=1", "--eval_iters=2", "--log_interval=1"]  # on the CPU, on any machine: conftest.cpu_defaults


@pytest.fixture
def tiny_data(tmp_path, monkeypatch):
    """data/tiny with a learnable token stream (a repeating pattern with noise)."""
    monkeypatch.chdir(tmp_path)
    os.makedirs("data/tiny")
    rng = np.random.default_rng(0)
    for split, n in (("train", 20000), ("val", 2000)):
        tokens = (np.arange(n) % 7 + rng.integers(0, 2, n) * 7).astype(np.uint16)
        tokens.tofile(f"data/tiny/{split}.bin")
    meta = dict(source="test", tokenizer="none", vocab_size=14, eot_id=0, dtype="uint16", train_tokens=20000,
                val_tokens=2000, train_bytes=40000, val_bytes=4000)
    Path("data/tiny/meta.json").write_text(json.dumps(meta))
    return tmp_path


def cfg(argv):
    """train.py's settings as a dict after argv."""
    return vars(configure(vars(train), list(argv))[0])


def refusal(capsys, fn, *args):
    """fn(*args) through configurator.run, the scripts' entry point: exit 2 and one 'error: ' line -> that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        configurator.run(lambda argv: fn(*args))
    text = capsys.readouterr().err
    assert exit_info.value.code == 2 and text.count("\n") == 1 and text.startswith("error: "), text
    return text


def metrics(out_dir):
    """out_dir/metrics.jsonl, one dict a line."""
    return [json.loads(line) for line in Path(out_dir, "metrics.jsonl").read_text().splitlines()]


def untimed(records):
    """The metrics without the figure that depends on the machine's speed."""
    return [{k: v for k, v in r.items() if k != "flops_per_s"} for r in records]


# ----------------------------------------------------------------------------- the depth sampler and schedule
def draw(step, seed, mean_loops, max_loops, dist="lognormal", spread=0.5):
    """model.sample_loops of a loop distribution given by its settings."""
    config = SimpleNamespace(mean_loops=mean_loops, max_loops=max_loops, loop_dist=dist, loop_spread=spread)
    return model_lib.sample_loops(config, step, seed)



def test_depth_sampler_median_bounds_and_rank_independence():
    draws = [draw(step, 1337, 8, 32) for step in range(4000)]
    assert min(draws) >= 1 and max(draws) <= 32
    assert np.median(draws) == 8
    assert 3 < np.mean(draws) < 12 and len(set(draws)) > 8  # spread, not constant
    # two "ranks" with different global RNG states draw the same depths
    torch.manual_seed(0)
    rank0 = [draw(s, 7, 4, 16) for s in range(50)]
    torch.manual_seed(1)
    torch.rand(100)
    assert rank0 == [draw(s, 7, 4, 16) for s in range(50)]
    assert draw(3, 7, 4, 16, "fixed") == 4
    assert all(draw(s, 0, 1, 1) == 1 for s in range(20))


@pytest.mark.parametrize("spread", [0.25, 0.5, 1.0])
def test_loop_spread_sets_the_spread_and_keeps_the_median(spread):
    """Issue 31: the LogNormal's sigma is a setting; the median stays mean_loops, the clamp [1, max_loops]."""
    assert np.median([draw(step, 1337, 8, 1000, spread=spread) for step in range(4000)]) == 8
    # round(exp(N(log 1000, spread))): at a large mean the rounding is negligible, and the log of the draws has
    # the normal's interquartile range, 1.349 sigma
    draws = np.array([draw(step, 1337, 1000, 10**9, spread=spread) for step in range(4000)])
    quartiles = np.percentile(np.log(draws), [25, 75])
    assert quartiles[1] - quartiles[0] == pytest.approx(1.349 * spread, rel=0.1)
    clamped = [draw(step, 1337, 8, 12, spread=spread) for step in range(4000)]
    assert min(clamped) >= 1 and max(clamped) == 12
    assert cfg(["--loop_spread=1.0"])["loop_spread"] == 1.0


def test_a_wide_spread_is_clamped_without_overflow():
    draws = [draw(step, 0, 8, 32, spread=1000.0) for step in range(200)]
    assert min(draws) == 1 and max(draws) == 32  # exp(log 8 + 1000 z) overflows a float for |z| > 0.71


def test_lr_schedule_warmup_then_cosine_to_min():
    C = configure(vars(train), ["--max_iters=1000", "--learning_rate=1.0", "--min_lr=0.1"])[0]
    assert train.get_lr(0, C) == pytest.approx(0.1)  # warmup is 1% = 10 iters
    assert train.get_lr(9, C) == pytest.approx(1.0)
    assert train.get_lr(1000, C) == pytest.approx(0.1)
    assert train.get_lr(505, C) == pytest.approx(0.55, abs=1e-3)


# ----------------------------------------------------------------------------- one step, against references


def tiny_model(seed=0):
    """A model whose forward draws no noise (state_std 0), so that a step is the same on any rank."""
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=14, block_size=16, n_embd=32, n_head=2, n_kv_head=1, ffn_hidden=48,
                       n_prelude=1, n_core=1, n_coda=1, mean_loops=2, max_loops=4, bptt_k=2, state_std=0.0)
    return GPT(config)


def tiny_batches(n, seed=1):
    """n micro-batches (x, y) of 4 sequences each."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(14, (n, 4, 17), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


STEP = types.SimpleNamespace(dtype="float32", grad_clip=0.0)  # no clip: the gradient's scale shows in SGD


def stepped_with_sgd(batches, world=1):
    """The tiny model's weights after one train_step with SGD at lr 1 (the update is the gradient itself)."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loss, stepped = train.train_step(model, optimizer, batches, loops=3, generator=None, C=STEP, world=world)
    assert stepped and math.isfinite(loss)
    return model.state_dict()


def assert_same_weights(a, b):
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=2e-6, msg=key)


def test_gradient_accumulation_equals_one_step_on_the_doubled_micro_batch():
    """Two micro-steps of 4 sequences make the same step as one of 8 (not twice its gradient)."""
    first, second = tiny_batches(2)
    doubled = (torch.cat([first[0], second[0]]), torch.cat([first[1], second[1]]))
    accumulated = stepped_with_sgd([first, second])
    assert_same_weights(accumulated, stepped_with_sgd([doubled]))
    assert not torch.allclose(accumulated["wte.weight"], tiny_model().state_dict()["wte.weight"])  # it moved


def _gloo_rank(rank, init_file, out_dir):
    """One of two ranks: a train_step on its own micro-batch, its weights saved for the parent."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    batch = tiny_batches(2)[rank]
    torch.save(stepped_with_sgd([batch], world=2), f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def test_ddp_step_equals_one_process_on_the_concatenated_batch(tmp_path):
    """Issue 33: two gloo ranks, one micro-batch each, end a step where one process does on both: the
    all-reduce averages the ranks' gradients (deleted, or divided by the world size twice, they differ).
    The ranks are spawned, not forked: a forked child of a process whose autograd (or CUDA) has started
    cannot run a backward pass."""
    spawn = multiprocessing.get_context("spawn")
    ranks = [spawn.Process(target=_gloo_rank, args=(rank, tmp_path / "init", tmp_path)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    assert [process.exitcode for process in ranks] == [0, 0]
    first, second = tiny_batches(2)
    together = (torch.cat([first[0], second[0]]), torch.cat([first[1], second[1]]))
    reference = stepped_with_sgd([together])
    for rank in (0, 1):
        assert_same_weights(torch.load(tmp_path / f"rank{rank}.pt"), reference)


def test_a_non_finite_step_is_not_taken():
    model = tiny_model()
    with torch.no_grad():
        model.wte.weight[0, 0] = math.inf  # as a weight that overflowed
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    x, y = tiny_batches(1)[0]
    loss, stepped = train.train_step(model, optimizer, [(x, y)], loops=3, generator=None, C=STEP)
    assert not stepped and not math.isfinite(loss)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())  # nothing left over for the next step


# ----------------------------------------------------------------------------- the non-finite guard


def test_guard_aborts_on_the_third_consecutive_skip():
    train.check_skips([10, 11], 11, grace=100)  # two in a row: go on
    train.check_skips([10, 11, 13, 14], 14, grace=100)  # a finite step 12 between: never 3 in a row
    with pytest.raises(UserError, match="iter 15: 3 consecutive non-finite steps"):
        train.check_skips([10, 11, 13, 14, 15], 15, grace=100)  # inside the grace too


def test_guard_budget_is_a_thousandth_of_the_steps_so_far_after_the_grace():
    """One skip after the grace aborts up to step 998 (1 > 0.1% of 999 steps) and not at step 999 (1 of 1000)."""
    with pytest.raises(UserError, match=r"iter 998: 1 non-finite steps exceed 0.1% of 999"):
        train.check_skips([998], 998, grace=100)
    train.check_skips([999], 999, grace=100)
    train.check_skips([5, 1999], 1999, grace=100)  # 2 of 2000: at the budget, not over it
    with pytest.raises(UserError, match=r"exceed 0.1% of 2001"):
        train.check_skips([5, 1999, 2000], 2000, grace=100)
    train.check_skips([99], 99, grace=100)  # the last step of the grace: no budget yet
    with pytest.raises(UserError, match="iter 100: 1 non-finite steps exceed"):
        train.check_skips([100], 100, grace=100)  # its first step after


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
    out = capsys.readouterr().out
    assert out.count("non-finite loss or grad norm") == 1  # one line per skip
    assert "iter 3: non-finite loss or grad norm, optimizer step skipped" in out
    ckpt = torch.load("g/ckpt.pt", weights_only=True)
    assert {int(s["step"]) for s in ckpt["optimizer"]["state"].values()} == {5}  # 6 iters, 1 skipped
    calls.update(n=0, nan_at={2, 3, 4})
    err = refusal(capsys, train.main, TINY + ["--max_iters=8", "--eval_interval=8", "--out_dir=h"])
    assert "iter 4: 3 consecutive non-finite steps" in err
    calls.update(n=0, nan_at={3})  # after a grace of 2 steps, 1 skip in 4 steps is over 0.1%: abort
    err = refusal(capsys, train.main, TINY + ["--max_iters=8", "--eval_interval=8", "--out_dir=k",
                                              "--guard_grace_iters=2"])
    assert "iter 3: 1 non-finite steps exceed 0.1% of 4" in err


# ----------------------------------------------------------------------------- settings


def test_configurator_errors(tmp_path, capsys):
    assert cfg(["--max_iters=5", "--batch_size", "3", "--dtype=bfloat16", "--compile=True"])["batch_size"] == 3
    assert cfg(["--learning_rate=1"])["learning_rate"] == 1.0
    bare = cfg(["--overwrite_checkpoint", "--compile", "False", "--max_iters", "7"])  # a bare boolean flag is True
    assert (bare["overwrite_checkpoint"], bare["compile"], bare["max_iters"]) == (True, False, 7)
    for bad, message in ((["--nope=1"], "unknown setting 'nope'"),
                         (["--out_dri=out-x"], "unknown setting 'out_dri'"),  # a typo, not "cannot parse"
                         (["--max_iters=abc"], "--max_iters: cannot parse 'abc'"),
                         (["--max_iters=1.5"], "--max_iters: expected int, got 1.5"),
                         (["--compile=1"], "--compile: expected bool, got 1"),
                         (["--batch_size"], "--batch_size: expected int, got True"),
                         (["missing_config.py"], "missing_config.py")):
        assert message in refusal(capsys, cfg, bad)
    path = tmp_path / "c.py"
    path.write_text("max_iters = 3\nbogus_key = 1\n")
    assert "bogus_key" in refusal(capsys, cfg, [str(path)])
    path.write_text("import math\nmax_iters = 3\nlearning_rate = math.sqrt(4e-6)\n")
    assert cfg([str(path), "--max_iters=4"])["max_iters"] == 4


def test_every_committed_config_file_loads(monkeypatch):
    monkeypatch.chdir(ROOT)  # config files exec each other by relative path, as `python train.py config/x.py` does
    paths = sorted(ROOT.glob("config/**/*.py"))
    assert len(paths) >= 11
    for path in paths:
        config = cfg([str(path.relative_to(ROOT))])
        assert config["out_dir"].startswith("out-") and config["max_iters"] > 0
        GPTConfig(vocab_size=1024, **{key: config[key] for key in train.MODEL_KEYS})  # a shape model.py takes
    search = cfg(["config/search/c5.py"])  # the run that became the defaults
    for key in ("n_embd", "n_core", "mean_loops", "max_loops", "bptt_k", "block_size", "batch_size", "max_iters"):
        assert search[key] == vars(train)[key]
    study, dense = cfg(["config/study.py"]), cfg(["config/study_dense.py"])
    same = ("max_iters", "batch_size", "block_size", "n_embd", "learning_rate", "lr_decay_iters",
            "warmup_iters", "min_lr", "dataset", "seed", "n_prelude", "n_coda")
    assert all(study[k] == dense[k] for k in same)  # parity: the same data, tokens, schedule, width
    assert study["out_dir"] != dense["out_dir"] and dense["loop_dist"] == "fixed"
    assert cfg(["config/study_2000.py"])["max_iters"] == 2 * study["max_iters"]  # the trend


def test_study_dense_is_the_study_models_blocks_unrolled_once(monkeypatch):
    """config/study_dense.py: n_core * mean_loops core blocks in one loop from a zero state, the rest the same;
    its forward FLOPs are the study model's at mean_loops less the adapters of loops 2..mean_loops."""
    monkeypatch.chdir(ROOT)
    study, dense = cfg(["config/study.py"]), cfg(["config/study_dense.py"])
    unrolled = dict(n_core=study["n_core"] * study["mean_loops"], mean_loops=1, max_loops=1, bptt_k=1, state_std=0.0,
                    loop_dist="fixed")
    assert {key: dense[key] for key in train.MODEL_KEYS} == {key: study[key] for key in train.MODEL_KEYS} | unrolled
    recurrent = GPT(GPTConfig(vocab_size=1024, **{key: study[key] for key in train.MODEL_KEYS}))
    twin = GPT(GPTConfig(vocab_size=1024, **{key: dense[key] for key in train.MODEL_KEYS}))
    adapter = 2 * recurrent.core.adapter.weight.numel()
    extra = (study["mean_loops"] - 1) * adapter
    assert recurrent.inference_flops(study["mean_loops"], 512) - twin.inference_flops(1, 512) == extra


def test_help_lists_every_setting_and_exits_0(capsys):
    with pytest.raises(SystemExit) as err:
        train.main(["--help"])
    assert err.value.code == 0
    out = capsys.readouterr().out
    assert "Train a depth-recurrent transformer" in out
    line = next(line for line in out.splitlines() if line.strip().startswith("--batch_size="))
    assert "--batch_size=8" in line and "sequences per micro-step" in line
    for key in cfg([]):
        assert f"--{key}=" in out
    with pytest.raises(SystemExit) as err:  # wherever it comes
        train.main(TINY + ["--max_iters=1", "--help"])
    assert err.value.code == 0


# ----------------------------------------------------------------------------- training, checkpoints, metrics


def test_training_learns_and_writes_a_loadable_checkpoint_and_metrics(tiny_data, capsys):
    hist = train.main(TINY + ["--max_iters=40", "--eval_interval=20", "--learning_rate=1e-2", "--out_dir=out"])
    assert len(hist) == 40 and sum(h[2] for h in hist[-5:]) < sum(h[2] for h in hist[:5])
    assert {h[1] for h in hist} != {2}  # the depth really varies step to step
    assert "FLOP/s" in capsys.readouterr().out
    model, ckpt = load_checkpoint("out/ckpt.pt")
    assert ckpt["iter_num"] == 40 and model.config.vocab_size == 14 and ckpt["config"]["dataset"] == "tiny"
    records = metrics("out")
    steps = [r for r in records if "loss" in r]
    evaluations = [r for r in records if "val_loss" in r]
    assert len(steps) + len(evaluations) == len(records)
    assert [r["iter"] for r in steps] == list(range(40))  # log_interval 1: every step
    assert [(r["iter"], r["loops"], r["loss"]) for r in steps] == [tuple(h) for h in hist]
    assert all(set(r) == {"iter", "loss", "loops", "lr", "flops_per_s"} for r in steps)  # nanoGPT's, loops
    assert all(r["lr"] > 0 and r["flops_per_s"] > 0 for r in steps)
    assert [r["iter"] for r in evaluations] == [0, 20, 40]
    assert all(set(r) == {"iter", "train_loss", "val_loss", "val_bits_per_byte"} for r in evaluations)
    assert all(math.isfinite(r["train_loss"]) and math.isfinite(r["val_loss"]) for r in evaluations)


def test_resume_equals_uninterrupted_run_and_continues_the_metrics(tiny_data):
    common = TINY + ["--lr_decay_iters=8", "--eval_interval=4", "--gradient_accumulation_steps=2"]
    straight = train.main(common + ["--max_iters=8", "--out_dir=a"])
    first = train.main(common + ["--max_iters=4", "--out_dir=b"])
    resumed = train.main(common + ["--max_iters=8", "--out_dir=b", "--init_from=resume"])
    assert first == straight[:4]
    assert resumed == straight[4:]  # exactly: same weights, optimizer, data and noise streams
    # appended: the same figures in the same order, the evaluation at step 4 twice (the end, then the resume)
    straight_figures = untimed(metrics("a"))
    evaluation_at_4 = straight_figures[5]
    assert evaluation_at_4["iter"] == 4 and "val_loss" in evaluation_at_4
    assert untimed(metrics("b")) == straight_figures[:6] + [evaluation_at_4] + straight_figures[6:]


def test_the_saved_config_is_the_settings_with_the_total_accumulation(tiny_data):
    train.main(TINY + ["--max_iters=2", "--eval_interval=2", "--out_dir=o", "--gradient_accumulation_steps=3"])
    ckpt = torch.load("o/ckpt.pt", weights_only=True)
    assert ckpt["config"]["gradient_accumulation_steps"] == 3 and ckpt["config"]["loop_spread"] == 0.5
    assert set(cfg([])) <= set(ckpt["config"])  # every setting, and nothing of the process's own
    assert not {"rank", "world", "peak", "micro_steps"} & set(ckpt["config"])


def test_crash_during_save_keeps_the_old_checkpoint(tiny_data, monkeypatch):
    train.main(TINY + ["--max_iters=2", "--eval_interval=2", "--out_dir=c"])
    before = Path("c/ckpt.pt").read_bytes()

    def crashing_save(obj, f):
        f.write(b"partial garbage")
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(torch, "save", crashing_save)
    with pytest.raises(KeyboardInterrupt):
        save_atomic("c/ckpt.pt", {"x": 1})
    assert Path("c/ckpt.pt").read_bytes() == before
    load_checkpoint("c/ckpt.pt")


def test_ddp_two_cpu_processes_with_gloo(tiny_data):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py")] + TINY + ["--max_iters=4", "--eval_interval=4", "--out_dir=ddp",
                                             "--gradient_accumulation_steps=2"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=script_env())
    causes = [line for line in run.stderr.splitlines() if "rror" in line or "what()" in line or "terminate" in line]
    assert run.returncode == 0, "\n".join(causes[:20]) or run.stderr[-2000:]
    assert run.stdout.count("iter 3:") == 1  # only rank 0 logs
    model, ckpt = load_checkpoint("ddp/ckpt.pt")
    assert ckpt["iter_num"] == 4
    assert ckpt["config"]["gradient_accumulation_steps"] == 2  # the total over ranks, as the setting says
    assert len(metrics("ddp")) == 4 + 2  # written once, by rank 0


def test_scratch_run_never_overwrites_a_checkpoint(tiny_data, capsys):
    train.main(TINY + ["--max_iters=3", "--eval_interval=3", "--out_dir=o"])
    before = Path("o/ckpt.pt").read_bytes()
    err = refusal(capsys, train.main, TINY + ["--max_iters=1", "--out_dir=o"])
    assert "o/ckpt.pt exists" in err and "--init_from=resume" in err and "--overwrite_checkpoint=True" in err
    assert Path("o/ckpt.pt").read_bytes() == before
    train.main(TINY + ["--max_iters=1", "--eval_interval=1", "--out_dir=o", "--overwrite_checkpoint=True"])
    assert torch.load("o/ckpt.pt", weights_only=True)["iter_num"] == 1
    Path("o/ckpt.pt").write_bytes(before[:1000])  # a corrupt checkpoint: still kept, and the way out named
    err = refusal(capsys, train.main, TINY + ["--max_iters=1", "--out_dir=o"])
    assert "o/ckpt.pt exists" in err and "--overwrite_checkpoint=True" in err
    assert Path("o/ckpt.pt").read_bytes() == before[:1000]


def test_a_scratch_run_keeps_an_earlier_runs_log(tiny_data, capsys):
    """A log without a checkpoint (a run that never saved) is a user's too: refused, as a checkpoint is."""
    os.makedirs("o")
    Path("o/metrics.jsonl").write_text('{"iter": 0, "val_loss": 3.0}\n' * 19)
    err = refusal(capsys, train.main, TINY + ["--max_iters=1", "--out_dir=o"])
    assert "o/metrics.jsonl exists" in err and "--overwrite_checkpoint=True" in err
    assert len(metrics("o")) == 19
    train.main(TINY + ["--max_iters=1", "--eval_interval=1", "--out_dir=o", "--overwrite_checkpoint=True"])
    assert len(metrics("o")) == 3  # replaced when asked: two evaluations and a step


def test_a_run_that_would_train_nothing_says_so(tiny_data, capsys):
    assert "--max_iters must be a finite number in [1, 281474976710656], got 0" in refusal(
        capsys, train.main, TINY + ["--max_iters=0", "--out_dir=o"])
    assert not Path("o").exists()
    train.main(TINY + ["--max_iters=2", "--eval_interval=2", "--out_dir=o"])
    before = Path("o/ckpt.pt").read_bytes()
    for max_iters in (1, 2):  # at or below the checkpoint's step
        err = refusal(capsys, train.main, TINY + ["--out_dir=o", "--init_from=resume", f"--max_iters={max_iters}"])
        assert f"o/ckpt.pt is at step 2: --max_iters={max_iters} trains nothing" in err
    assert Path("o/ckpt.pt").read_bytes() == before and len(metrics("o")) == 4


def test_resuming_on_a_dataset_prepared_again_is_refused(tiny_data, capsys):
    train.main(TINY + ["--max_iters=2", "--eval_interval=2", "--out_dir=o"])
    meta = json.loads(Path("data/tiny/meta.json").read_text())
    # prepared again with another split: the same stream, cut elsewhere
    stream = np.concatenate([np.fromfile(f"data/tiny/{split}.bin", dtype=np.uint16) for split in ("train", "val")])
    stream[:21000].tofile("data/tiny/train.bin")
    stream[21000:].tofile("data/tiny/val.bin")
    Path("data/tiny/meta.json").write_text(json.dumps(meta | {"val_tokens": 1000, "train_tokens": 21000}))
    err = refusal(capsys, train.main, TINY + ["--out_dir=o", "--init_from=resume", "--max_iters=4"])
    assert "data/tiny is not the dataset o/ckpt.pt was trained on" in err and "val_tokens 1000 (was 2000)" in err


def test_diverged_model_is_never_saved(tiny_data, capsys):
    """Resume a trained tiny model with settings that make it diverge, evaluating (and, finite, saving) at
    every step: the non-finite model is never saved, the last finite one stays. In float32 on the CPU on any
    machine (conftest.cpu_defaults): how a model diverges (its weights first, or its loss, whose steps the
    guard skips) depends on the dtype and the device, and this test needs the weights to go first."""
    train.main(TINY + ["--max_iters=4", "--eval_interval=4", "--out_dir=o", "--weight_decay=10"])
    # lr 10 and weight decay 10: each step multiplies the matrices by 1 - 100 = -99 until they overflow (the
    # resumed run gets the weight decay it is given)
    with pytest.raises(UserError, match="non-finite steps"):  # the non-finite guard ends it
        train.main(TINY + ["--out_dir=o", "--init_from=resume", "--max_iters=80", "--eval_interval=1",
                           "--eval_iters=1", "--learning_rate=10", "--min_lr=10", "--weight_decay=10",
                           "--grad_clip=0"])
    out = capsys.readouterr().out
    first_bad = re.search(r"step (\d+): non-finite val loss or weights, not saved", out)
    assert first_bad and "saved checkpoint" not in out[first_bad.start():]
    assert "saved checkpoint" in out[:first_bad.start()]  # every finite evaluation is saved
    model, ckpt = load_checkpoint("o/ckpt.pt")
    assert ckpt["iter_num"] == int(first_bad.group(1)) - 1  # the last finite evaluation
    assert all(p.isfinite().all() for p in model.parameters())


def test_resume_uses_the_new_optimizer_settings(tiny_data):
    """A resumed run given --weight_decay/--beta1/--beta2 uses them, as its saved config says it did."""
    train.main(TINY + ["--max_iters=2", "--eval_interval=2", "--out_dir=o"])
    train.main(TINY + ["--out_dir=o", "--init_from=resume", "--max_iters=3", "--eval_interval=3",
                       "--weight_decay=0.5", "--beta1=0.8", "--beta2=0.9"])
    ckpt = torch.load("o/ckpt.pt", weights_only=True)
    groups = ckpt["optimizer"]["param_groups"]
    assert ckpt["config"]["weight_decay"] == 0.5
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0]  # matrices decay, gains do not
    assert all(tuple(g["betas"]) == (0.8, 0.9) for g in groups)


def test_resume_keeps_the_checkpoints_model_and_says_so(tiny_data, capsys):
    train.main(TINY + ["--max_iters=2", "--eval_interval=2", "--out_dir=o"])  # block 16, mean 2, max 4, bptt 1
    # a value given on the command line or in a config file that differs from the checkpoint's is an error
    for flag, saved in (("--block_size=32", "block_size=16"), ("--mean_loops=3", "mean_loops=2"),
                        ("--max_loops=8", "max_loops=4"), ("--bptt_k=2", "bptt_k=1"), ("--n_embd=64", "n_embd=32"),
                        ("--dataset=other", "dataset=tiny")):
        err = refusal(capsys, train.main, TINY + ["--out_dir=o", "--init_from=resume", flag])
        assert flag[2:] in err and saved in err
    Path("cfg.py").write_text("n_head = 4\n")
    assert "n_head=2" in refusal(capsys, train.main, ["cfg.py", "--out_dir=o", "--init_from=resume"])
    # nothing given: the checkpoint's model and dataset, whatever the defaults, and the saved config says so
    hist = train.main(["--init_from=resume", "--out_dir=o", "--max_iters=4", "--eval_interval=2", "--eval_iters=1",
                       "--batch_size=2"])
    assert [h[0] for h in hist] == [2, 3] and max(h[1] for h in hist) <= 4
    ckpt = torch.load("o/ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == 4 and ckpt["config"]["dataset"] == "tiny"
    for key in train.MODEL_KEYS:
        assert ckpt["config"][key] == ckpt["model_args"][key]
    assert (ckpt["config"]["block_size"], ckpt["config"]["mean_loops"], ckpt["config"]["bptt_k"]) == (16, 2, 1)


def test_a_steps_batches_and_noise_depend_on_the_seed_step_and_rank_alone():
    """No generator state to save: a resumed run draws what an uninterrupted one does, each rank its own."""
    def draws(seed, step, rank):
        data, noise = train.step_generators(seed, step, rank, "cpu")
        return torch.randint(100, (4,), generator=data).tolist(), torch.randn(3, generator=noise).tolist()
    assert draws(1, 5, 0) == draws(1, 5, 0)
    assert len({str(draws(*key)) for key in ((1, 5, 0), (2, 5, 0), (1, 6, 0), (1, 5, 1))}) == 4


# ----------------------------------------------------------------------------- bad input: one line, exit 2


@pytest.mark.parametrize("flags, message", [
    (["--dataset=nope"], "data/nope"),
    (["--init_from=resume", "--out_dir=none"], "no checkpoint at none/ckpt.pt"),
    (["--dtype=float16"], "--dtype must be one of float32, bfloat16, got 'float16'"),
    (["--loop_dist=uniform"], "--loop_dist must be one of lognormal, fixed"),
    (["--mean_loops=5", "--max_loops=4"], "mean_loops=5 > max_loops=4"),
    (["--n_embd=30", "--n_head=4"], "n_head=4 must divide n_embd=30"),
    (["--n_head=4", "--n_kv_head=3"], "n_kv_head=3 must divide n_head"),
    (["--n_embd=24", "--n_head=8"], "head size n_embd / n_head = 3 must be even"),
    (["--n_core=0"], "--n_core must be a finite number in [1, 281474976710656], got 0"),
    (["--block_size=30000"], "fewer than block_size + 2"),
])
def test_bad_inputs_are_one_line(tiny_data, capsys, flags, message):
    assert message in refusal(capsys, train.main, TINY + ["--max_iters=1"] + flags)


@pytest.mark.parametrize("flags, message", [
    (["--beta1=2"], "--beta1 must be a finite number in [0, 0.9999], got 2.0"),
    (["--beta2=1"], "--beta2 must be a finite number in [0, 0.9999], got 1.0"),
    (["--seed=4294967296"], "--seed must be a finite number in [0, 4294967295]"),
    (["--warmup_iters=-2"], "--warmup_iters must be a finite number in [-1, 281474976710656], got -2"),
    (["--batch_size=True"], "--batch_size: expected int, got True"),
    (["--max_iters=True"], "--max_iters: expected int, got True"),
    (["--out_dir="], "--out_dir must not be empty"),
    (["--n_core=-1"], "--n_core must be a finite number in [1, 281474976710656], got -1"),
    (["--learning_rate=inf"], "--learning_rate: cannot parse 'inf'"),
    (["--init_from=  "], "no checkpoint at   "),  # whitespace is a value: a path to no checkpoint
    (["--out_dir", "--max_iters=1"], "--out_dir: expected str, got True"),  # a bare flag is no text
    (["--dataset"], "--dataset: expected str, got True"),
    (["--device=gpu"], "--device must be one of cpu"),
])
def test_bad_values_are_one_line_before_anything_is_written(tiny_data, capsys, flags, message):
    assert message in refusal(capsys, train.main, TINY + ["--out_dir=o"] + flags)
    assert not Path("o").exists()


@pytest.mark.parametrize("key, value, message", [
    ("eval_iters", "0", "--eval_iters must be a finite number in [1, 281474976710656], got 0"),
    ("eval_interval", "-1", "--eval_interval must be a finite number in [1, 281474976710656], got -1"),
    ("log_interval", "0", "--log_interval must be a finite number in [1, 281474976710656], got 0"),
    ("batch_size", "0", "--batch_size must be a finite number in [1, 281474976710656], got 0"),
    ("gradient_accumulation_steps", "0", "--gradient_accumulation_steps must be a finite number in [1, "),
    ("learning_rate", "-1", "--learning_rate must be a finite number in [0, 3e+38], got -1.0"),
])
def test_non_positive_counts_are_refused(tiny_data, capsys, key, value, message):
    assert message in refusal(capsys, train.main, TINY + [f"--{key}={value}", "--out_dir=o"])
    assert not Path("o").exists()


NUMERIC = [key for key, value in cfg([]).items() if type(value) in (int, float)]


def run_or_refuse(capsys, argv):
    """train.main(argv) through configurator.run: a normal run ("ran") or exit 2 with one 'error: ' line
    ("refused", the line); any other exception fails the test."""
    capsys.readouterr()
    try:
        configurator.run(lambda _: train.main(argv))
    except SystemExit as err:
        text = capsys.readouterr().err
        assert err.code == 2 and text.count("\n") == 1 and text.startswith("error: "), (argv[-1], err.code, text)
        return "refused", text
    text = capsys.readouterr().err
    assert "Traceback" not in text and "error" not in text, text
    return "ran", ""


@pytest.mark.parametrize("key", NUMERIC)
def test_every_numeric_setting_takes_any_value_without_a_traceback(tiny_data, capsys, key):
    low, high = train.RULES.get(key, (0, math.inf))
    high = min(high, configurator.LIMITS[type(cfg([])[key])])  # no setting is larger
    for i, value in enumerate(["0", "-1", "1e999", "nan", "True"]):
        argv = TINY + ["--max_iters=1", "--eval_interval=1", "--eval_iters=1", f"--out_dir=o{i}", f"--{key}={value}"]
        outcome, err = run_or_refuse(capsys, argv)
        if value in ("0", "-1") and not low <= int(value) <= high:
            assert outcome == "refused" and f"--{key} must be a finite number in [{low}, {high}]" in err
        if value not in ("0", "-1"):  # infinity is no setting's value, nan no Python literal, True no number
            assert outcome == "refused" and f"--{key}" in err, (key, value)


BOUNDED = [key for key, rule in train.RULES.items() if not isinstance(rule[0], str) and math.isfinite(rule[1])]


@pytest.mark.parametrize("key", BOUNDED)
def test_the_largest_value_of_a_bounded_setting_runs(tiny_data, capsys, key):
    high = train.RULES[key][1]
    deepest = [f"--max_loops={high}"] if key == "mean_loops" else []  # the mean is at most the max
    outcome, err = run_or_refuse(capsys, TINY + ["--max_iters=1", "--eval_interval=1", "--eval_iters=1",
                                                 "--out_dir=o", f"--{key}={high!r}", *deepest])
    assert outcome == "ran", err


def test_bad_config_files_are_one_line(tiny_data, capsys):
    Path("exits.py").write_text("import sys\nsys.exit()\n")  # not a silent exit 0
    assert "exits.py: SystemExit" in refusal(capsys, train.main, ["exits.py"])
    Path("latin1.py").write_bytes("max_iters = 3  # caf\u00e9\n".encode("latin-1"))
    assert "latin1.py" in refusal(capsys, train.main, ["latin1.py"])
    Path("nan.py").write_text("learning_rate = float('nan')\n")
    assert "--learning_rate must be a finite number" in refusal(capsys, train.main, ["nan.py"])
    Path("inf.py").write_text("batch_size = float('inf')\n")
    assert "--batch_size: expected int, got inf" in refusal(capsys, train.main, ["inf.py"])
    Path("bool.py").write_text("max_iters = False\n")
    assert "--max_iters: expected int, got False" in refusal(capsys, train.main, ["bool.py"])
    Path("syntax.py").write_text("max_iters = 3\nlearning_rate = (1e-3\n")
    assert "syntax.py: SyntaxError" in refusal(capsys, train.main, ["syntax.py"])  # with its line, as Python says it
    Path("runtime.py").write_text("max_iters = 3\nbatch_size = 8 // 0\n")
    assert "runtime.py: ZeroDivisionError" in refusal(capsys, train.main, ["runtime.py"])


def test_cuda_without_a_gpu_is_one_line(tiny_data, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert "--device must be one of cpu, got 'cuda'" in refusal(capsys, train.main, TINY + ["--device=cuda"])


def test_out_dir_that_is_a_file_or_under_one_is_one_line(tiny_data, capsys):
    Path("taken").write_text("not a directory")
    assert "'taken'" in refusal(capsys, train.main, TINY + ["--out_dir=taken", "--max_iters=1"])
    assert "'taken/run'" in refusal(capsys, train.main, TINY + ["--out_dir=taken/run"])
    assert Path("taken").read_text() == "not a directory"


def test_bits_per_byte_from_the_datasets_byte_count(tiny_data, capsys):
    train.main(TINY + ["--max_iters=1", "--eval_interval=1", "--out_dir=o"])
    loss, bits = re.search(r"step 1: .* val loss ([\d.]+), val ([\d.]+) bits/byte", capsys.readouterr().out).groups()
    assert float(bits) == pytest.approx(float(loss) * 2000 / 4000 / math.log(2), abs=1e-4)


def test_ctrl_c_inside_torch_save_is_one_line(tmp_path, monkeypatch, capsys):
    """A Ctrl-C while torch.save writes: its zip writer fails on the way out and
    raises a RuntimeError from the KeyboardInterrupt, a traceback unless run() knows."""

    class Interrupting(io.RawIOBase):  # Ctrl-C lands in the second write
        writes = 0

        def writable(self):
            return True

        def write(self, data):
            Interrupting.writes += 1
            if Interrupting.writes == 2:
                raise KeyboardInterrupt
            return len(data)

    def main(argv):
        torch.save({"w": torch.zeros(1000)}, Interrupting())
    with pytest.raises(SystemExit) as e:
        configurator.run(main)
    assert e.value.code == 130 and capsys.readouterr().err == "interrupted\n"
    with pytest.raises(RuntimeError):  # any other RuntimeError stays one
        configurator.run(lambda argv: torch.zeros(2) @ torch.zeros(3))


def test_out_of_memory_is_one_line(capsys):
    """No memory prediction any more: a batch that does not fit ends in one line, not a traceback."""
    with pytest.raises(SystemExit) as e:
        configurator.run(lambda argv: torch.empty(10 ** 14))  # 400 TB: the allocator refuses at once
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: out of memory") and err.count("\n") == 1


def _save_forever(path):
    """A child process: save a 4 MB checkpoint again and again, each one consistent in itself."""
    for i in range(10 ** 6):
        save_atomic(path, {"format": "nanoloop-1", "iter_num": i, "model": {"w": torch.full((1 << 20,), float(i))}})


def test_sigkill_during_repeated_saves_keeps_a_loadable_checkpoint(tmp_path):
    """Fault injection: SIGKILL at random moments while a process saves over and over; the checkpoint is always
    a whole one (the old or a new one), never a torn write. Each kill waits for the child's first save, so that
    it lands among the saves however slow the machine is."""
    path = str(tmp_path / "ckpt.pt")
    rng = random.Random(0)
    fork = multiprocessing.get_context("fork")
    for _ in range(5):
        save_atomic(path, {"format": "nanoloop-1", "iter_num": -1, "model": {"w": torch.full((1 << 20,), -1.0)}})
        child = fork.Process(target=_save_forever, args=(path,))
        child.start()
        while torch.load(path, weights_only=True)["iter_num"] == -1:
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.1))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        ckpt = torch.load(path, weights_only=True)
        assert ckpt["iter_num"] >= 0 and bool((ckpt["model"]["w"] == ckpt["iter_num"]).all())


def test_ctrl_c_is_one_line_and_keeps_the_checkpoint(tiny_data):
    """A real SIGINT to `python train.py`, once its first checkpoint is there."""
    argv = TINY + ["--max_iters=100000", "--eval_interval=3", "--out_dir=o"]
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=script_env(),  # a background shell ignores SIGINT:
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal
    while not Path("o/ckpt.pt").exists() and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1]  # still training
    proc.send_signal(signal.SIGINT)
    err = proc.communicate()[1]
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    assert load_checkpoint("o/ckpt.pt")[1]["iter_num"] >= 3


def test_the_default_dataset_not_yet_prepared_is_one_line(tmp_path, monkeypatch, capsys):
    """The quick start prepares Shakespeare first (python prepare.py); train.py alone says so, in one line."""
    monkeypatch.chdir(tmp_path)
    flags = [f for f in TINY if not f.startswith("--dataset")]
    err = refusal(capsys, train.main, flags + ["--out_dir=out", "--max_iters=2"])
    assert err == "error: data/shakespeare/ has no meta.json: run prepare.py for it\n"


# ----------------------------------------------------------------------------- the GPU path on the CPU


@pytest.fixture
def attention_dtypes(monkeypatch):
    """The dtypes of every scaled_dot_product_attention call's q, k and v, as train.py's autocast gives them."""
    seen = set()
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        seen.update((q.dtype, k.dtype, v.dtype))
        return sdpa(q, k, v, *args, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return seen


def test_bf16_run_attends_in_bf16_saves_and_resumes_exactly(tiny_data, capsys, attention_dtypes):
    common = TINY + ["--dtype=bfloat16", "--lr_decay_iters=6", "--eval_interval=3"]
    straight = train.main(common + ["--max_iters=6", "--out_dir=a"])
    assert attention_dtypes == {torch.bfloat16}  # q, k and v of the prelude, the core and the coda
    out = capsys.readouterr().out
    assert "saved checkpoint to a/ckpt.pt" in out
    first = train.main(common + ["--max_iters=3", "--out_dir=b"])
    resumed = train.main(common + ["--max_iters=6", "--out_dir=b", "--init_from=resume"])
    assert first + resumed == straight  # bf16 autocast changes nothing about what a resume restores
    model, ckpt = load_checkpoint("b/ckpt.pt")
    assert ckpt["iter_num"] == 6 and ckpt["config"]["dtype"] == "bfloat16"
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast: float32 master weights


def test_compiled_bf16_run_compiles_a_few_graphs_once_whatever_the_depth(tiny_data, monkeypatch, capsys,
                                                                        fresh_compiler):
    """As a GPU run does it, with inductor (the backend CUDA users get; this CPU has a C++ compiler): prelude,
    core and coda compiled separately, so that a new depth every step never recompiles once each grad mode
    has been seen."""
    counters = fresh_compiler
    real_step, seen = train.train_step, []

    def counting_step(model, optimizer, batches, loops, generator, C, world=1):
        out = real_step(model, optimizer, batches, loops, generator, C, world)
        seen.append((loops, counters["stats"]["unique_graphs"], counters["frames"]["total"]))
        return out
    monkeypatch.setattr(train, "train_step", counting_step)
    hist = train.main(TINY + ["--compile=True", "--dtype=bfloat16",
                              "--max_iters=6", "--eval_interval=3", "--out_dir=c"])
    assert "compiling prelude, core and readout" in capsys.readouterr().out
    assert seen[0][0] > 1  # step 0 already ran loops without and with grad (bptt_k 1): the warm-up
    assert len({loops for loops, _, _ in seen}) >= 3  # the depth really changes
    graphs, frames = seen[0][1], seen[0][2]
    # 3 parts x (train with grad, train without, eval) at most, and the loops backprop reaches
    assert 4 <= graphs <= 10
    assert all((g, f) == (graphs, frames) for _, g, f in seen)  # no recompilation after the first step
    assert load_checkpoint("c/ckpt.pt")[1]["iter_num"] == 6 and len(hist) == 6


def test_compiled_training_loses_what_eager_does_within_bf16s_rounding(tiny_data, fresh_compiler):
    """The loops backprop reaches, compiled as one graph (their tied gradients summed inside it),
    train as the eager loops do: the same depths, the losses of 4 steps within bf16's rounding."""
    argv = TINY + ["--dtype=bfloat16", "--bptt_k=3", "--max_loops=6", "--max_iters=4",
                   "--eval_interval=4"]
    eager = train.main(argv + ["--out_dir=eager"])
    compiled = train.main(argv + ["--out_dir=compiled", "--compile=True"])
    assert [loops for _, loops, _ in compiled] == [loops for _, loops, _ in eager]
    assert any(loops >= 3 for _, loops, _ in eager)
    for (_, _, loss), (_, _, reference) in zip(compiled, eager):
        assert loss == pytest.approx(reference, rel=2 ** -6)


def test_dry_run_of_the_papers_configuration_at_a_tiny_width(tiny_data, capsys, attention_dtypes):
    """config/s1.py as it is (2 + 4 x r + 2 blocks, mean 8 loops, bptt 8, its schedule), only narrow and short."""
    argv = [str(ROOT / "config/s1.py"), "--dtype=bfloat16", "--dataset=tiny", "--n_embd=32",
            "--n_head=4", "--n_kv_head=2", "--ffn_hidden=64", "--block_size=16", "--batch_size=2",
            "--gradient_accumulation_steps=2", "--max_iters=2", "--eval_interval=1", "--eval_iters=1",
            "--log_interval=1", "--out_dir=s1dry"]
    hist = train.main(argv)
    out = capsys.readouterr().out
    assert [h[0] for h in hist] == [0, 1] and all(1 <= h[1] <= 32 for h in hist)
    assert attention_dtypes == {torch.bfloat16}
    assert "saved checkpoint to s1dry/ckpt.pt" in out
    resumed = train.main(argv + ["--init_from=resume", "--max_iters=3"])
    assert [h[0] for h in resumed] == [2]
    model, ckpt = load_checkpoint("s1dry/ckpt.pt")
    args = ckpt["model_args"]
    assert ckpt["iter_num"] == 3 and (args["n_prelude"], args["n_core"], args["n_coda"]) == (2, 4, 2)
    assert (args["mean_loops"], args["max_loops"], args["bptt_k"], ckpt["config"]["loop_spread"]) == (8, 32, 8, 0.5)
    assert ckpt["config"]["learning_rate"] == 1e-4 and ckpt["config"]["gradient_accumulation_steps"] == 2


def test_flop_rate_is_the_steps_flops_over_its_time(tiny_data, capsys, monkeypatch):
    """FLOP/s (MFU once divided by a card's peak): this step's FLOPs over its time."""
    clock = iter(range(100))  # train.py's clock: each reading one second after the last, so a step takes 1 s
    monkeypatch.setattr(train, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    hist = train.main(TINY + ["--max_iters=1", "--out_dir=p"])
    loops = hist[0][1]
    model = GPT(GPTConfig(vocab_size=14, **{key: cfg(TINY)[key] for key in train.MODEL_KEYS}))
    step_flops = model.flops_per_token(loops, min(loops, 1), 16) * 4 * 16  # bptt_k 1, batch 4, block 16
    assert metrics("p")[1]["flops_per_s"] == pytest.approx(step_flops)  # the dense twin's parity is read from it
    assert f"{step_flops:.3g} FLOP/s" in capsys.readouterr().out


# ----------------------------------------------------------------------------- on a GPU


@pytest.mark.cuda
def test_on_cuda_a_compiled_bf16_run_trains_and_saves(tiny_data, capsys, fresh_compiler, tf32_restored):
    """train.py's own defaults on a GPU machine: cuda, bf16 autocast, each part compiled with inductor."""
    on_the_gpu = [flag for flag in TINY if not flag.startswith("--compile")]
    torch.cuda.reset_peak_memory_stats()
    hist = train.main(on_the_gpu + ["--max_iters=2", "--eval_interval=2", "--out_dir=c"])
    assert "compiling prelude, core and readout" in capsys.readouterr().out
    assert len(hist) == 2 and all(math.isfinite(loss) for _, _, loss in hist)
    assert torch.cuda.max_memory_allocated() > 0  # it ran on the GPU
    model, ckpt = load_checkpoint("c/ckpt.pt")
    settings = ckpt["config"]
    assert (settings["device"], settings["dtype"], settings["compile"]) == ("cuda", "bfloat16", True)
    assert ckpt["iter_num"] == 2 and all(p.dtype == torch.float32 for p in model.parameters())
    assert all(r["flops_per_s"] > 0 for r in metrics("c") if "loss" in r)


# ----------------------------------------------------------------------------- fine-tuning: init_from a ckpt.pt
def second_dataset(name, tokenizer_sha256="same", vocab_size=14):
    """data/<name>: another token stream, prepared with the tokenizer tokenizer_sha256."""
    os.makedirs(f"data/{name}")
    rng = np.random.default_rng(1)
    for split, n in (("train", 5000), ("val", 1000)):
        (rng.integers(0, 7, n) * 2 % vocab_size).astype(np.uint16).tofile(f"data/{name}/{split}.bin")
    meta = dict(source="other", tokenizer="none", vocab_size=vocab_size, eot_id=0, dtype="uint16",
                train_tokens=5000, val_tokens=1000, train_bytes=10000, val_bytes=2000,
                tokenizer_sha256=tokenizer_sha256)
    Path(f"data/{name}/meta.json").write_text(json.dumps(meta))


def test_fine_tuning_starts_from_a_checkpoints_weights_with_a_fresh_optimizer_and_schedule(tiny_data):
    meta = json.loads(Path("data/tiny/meta.json").read_text())
    Path("data/tiny/meta.json").write_text(json.dumps(meta | {"tokenizer_sha256": "same"}))
    train.main(TINY + ["--max_iters=6", "--eval_interval=6", "--out_dir=base"])
    second_dataset("other")
    tuned = train.main(TINY[1:] + ["--dataset=other", "--init_from=base/ckpt.pt", "--out_dir=tuned",
                                   "--max_iters=3", "--eval_interval=3"])
    assert [step for step, _, _ in tuned] == [0, 1, 2]  # its own schedule, from step 0
    base, base_ckpt = load_checkpoint("base/ckpt.pt")
    _, tuned_ckpt = load_checkpoint("tuned/ckpt.pt")
    assert tuned_ckpt["config"]["dataset"] == "other" and tuned_ckpt["model_args"] == base_ckpt["model_args"]
    assert tuned_ckpt["config"]["run_id"] != base_ckpt["config"]["run_id"]
    # step 0's evaluation is the base model's loss on the new data: its weights, nothing trained yet
    untrained = train.main(TINY[1:] + ["--dataset=other", "--init_from=base/ckpt.pt", "--out_dir=again",
                                       "--max_iters=1", "--eval_interval=1"])
    first = json.loads(Path("again/metrics.jsonl").read_text().splitlines()[0])
    C = configure(vars(train), TINY[1:] + ["--dataset=other"])[0]
    data_dir, other_meta = "data/other", json.loads(Path("data/other/meta.json").read_text())
    expected = train.estimate_loss(base, data_dir, other_meta, (4, 16), C, "cpu")["val"]
    assert first["val_loss"] == pytest.approx(expected) and untrained


def test_fine_tuning_on_another_tokenizer_or_another_shape_is_refused_in_one_line(tiny_data, capsys):
    meta = json.loads(Path("data/tiny/meta.json").read_text())
    Path("data/tiny/meta.json").write_text(json.dumps(meta | {"tokenizer_sha256": "same"}))
    train.main(TINY + ["--max_iters=2", "--eval_interval=2", "--out_dir=base"])
    second_dataset("other", tokenizer_sha256="another")
    tune = TINY[1:] + ["--dataset=other", "--init_from=base/ckpt.pt", "--out_dir=tuned", "--max_iters=2"]
    assert "tokenizer_sha256 another (was same)" in refusal(capsys, train.main, tune)
    assert "--n_embd=64, but base/ckpt.pt has n_embd=32" in refusal(capsys, train.main, tune + ["--n_embd=64"])


def test_a_checkpoint_without_an_optimizer_is_fine_tuned_not_resumed(tiny_data, capsys):
    train.main(TINY + ["--max_iters=2", "--eval_interval=2", "--out_dir=o"])
    ckpt = torch.load("o/ckpt.pt", weights_only=True)
    torch.save(ckpt | {"optimizer": None}, "o/ckpt.pt")  # as hf.checkpoint writes one
    resume = ["--out_dir=o", "--init_from=resume", "--max_iters=3"]
    assert "has no optimizer state: fine-tune from it" in refusal(capsys, train.main, resume)


# ----------------------------------------------------------------------------- what a run trusts and keeps
def test_one_run_at_a_time_writes_an_out_dir(tiny_data, capsys):
    """Two train.py into one out_dir would write one ckpt.pt.tmp and mix their logs: the second is refused
    while the first holds out_dir's lock (the OS's: a killed run holds it no more)."""
    os.makedirs("o")
    holder = configurator.hold_lock("o/.lock", "held")
    try:
        assert "another train.py is writing o now" in refusal(capsys, train.main, TINY + ["--out_dir=o"])
        assert not Path("o/metrics.jsonl").exists()
    finally:
        holder.close()
    train.main(TINY + ["--max_iters=1", "--eval_interval=1", "--out_dir=o"])  # the lock went with it


def test_two_resumed_copies_of_a_run_are_two_runs(tiny_data):
    train.main(TINY + ["--max_iters=2", "--eval_interval=2", "--out_dir=a"])
    shutil.copytree("a", "b")
    for out_dir in ("a", "b"):
        train.main(TINY + ["--max_iters=4", "--eval_interval=2", f"--out_dir={out_dir}", "--init_from=resume"])
    ids = {load_checkpoint(f"{out_dir}/ckpt.pt")[1]["config"]["run_id"] for out_dir in ("a", "b")}
    assert len(ids) == 2


def test_a_schedule_that_never_moves_the_weights_is_refused(tiny_data, capsys):
    assert "no step would change the weights" in refusal(
        capsys, train.main, TINY + ["--out_dir=o", "--learning_rate=0", "--min_lr=0"])
    train.main(TINY + ["--max_iters=1", "--eval_interval=1", "--out_dir=o", "--learning_rate=0"])  # min_lr moves


def test_a_run_that_failed_before_its_first_line_leaves_no_log_in_the_way(tiny_data):
    os.makedirs("o")
    Path("o/metrics.jsonl").write_text("")  # a scratch run that failed at its first evaluation
    train.main(TINY + ["--max_iters=1", "--eval_interval=1", "--out_dir=o"])
    assert Path("o/metrics.jsonl").read_text()


def test_a_checkpoint_the_disk_refuses_is_one_line_and_the_old_one_stays(tiny_data):
    """Under a file-size limit (ulimit -f) a save fails: one line, exit 2, the last checkpoint intact."""
    train.main(TINY + ["--max_iters=2", "--eval_interval=2", "--out_dir=o"])
    before = Path("o/ckpt.pt").read_bytes()
    limit = len(before) // 2

    def small_files():
        import resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    cmd = [sys.executable, str(ROOT / "train.py"), *TINY, "--out_dir=o", "--init_from=resume", "--max_iters=4",
           "--eval_interval=2"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=script_env(), preexec_fn=small_files)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "File too large" in done.stderr, done.stderr
    assert Path("o/ckpt.pt").read_bytes() == before


def test_compiling_without_a_cpp_compiler_is_one_line(tiny_data, capsys, fresh_compiler):
    with torch._inductor.config.patch({"cpp.cxx": (None, "/nonexistent/g++")}):
        message = refusal(capsys, train.main, TINY + ["--out_dir=o", "--compile=True", "--max_iters=1"])
    assert "needs a C++ compiler" in message


@pytest.mark.parametrize("key, value", [("ffn_hidden", str(2 ** 63)), ("batch_size", str(2 ** 63)),
                                        ("block_size", str(2 ** 100)), ("learning_rate", "1e300"),
                                        ("state_std", "1e39"), ("mean_loops", "5000")])
def test_numbers_no_machine_takes_are_one_line(tiny_data, capsys, key, value):
    """Past 2**48 for a whole number, past float32 for a decimal, past MAX_LOOPS for loops: refused."""
    assert f"--{key} must be a finite number in" in refusal(capsys, train.main, TINY + ["--out_dir=o", f"--{key}={value}"])


def test_cs_own_out_of_memory_is_the_out_of_memory_line(capsys):
    """std::bad_alloc, as torch's C++ raises it on a huge allocation, is out of memory, not a traceback."""
    def main(argv):
        raise RuntimeError("std::bad_alloc")
    assert "out of memory" in refusal(capsys, main, [])
