import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
import types
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



def test_every_committed_config_file_loads(monkeypatch):
    root = Path(__file__).resolve().parent.parent
    monkeypatch.chdir(root)  # config files exec each other by relative path, as `python train.py config/x.py` does
    paths = sorted(root.glob("config/**/*.py"))
    assert len(paths) >= 11
    for path in paths:
        cfg = configure(train.DEFAULTS, [str(path.relative_to(root))])
        assert cfg["out_dir"].startswith("out-") and cfg["max_iters"] > 0
    search = configure(train.DEFAULTS, ["config/search/c5.py"])  # the run that became the defaults
    for key in ("n_embd", "n_core", "mean_loops", "max_loops", "bptt_k", "block_size", "batch_size", "max_iters"):
        assert search[key] == train.DEFAULTS[key]

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


# ----------------------------------------------------------------------------- issue 12: nothing is lost

def one_line_error(capsys, fn, *args):
    """Run fn(*args), expect exit 2 with exactly one line on stderr; return that line."""
    with pytest.raises(SystemExit) as err:
        fn(*args)
    text = capsys.readouterr().err
    assert err.value.code == 2 and text.count("\n") == 1 and text.startswith("error: "), text
    return text


def test_scratch_run_never_overwrites_a_checkpoint(tiny_data, capsys):
    train.main(TINY + ["--max_iters=3", "--eval_interval=3", "--out_dir=o"])
    before = Path("o/ckpt.pt").read_bytes()
    err = one_line_error(capsys, train.main, TINY + ["--max_iters=1", "--out_dir=o"])
    assert "step 3" in err and "--init_from=resume" in err and "--overwrite_checkpoint=True" in err
    assert Path("o/ckpt.pt").read_bytes() == before
    train.main(TINY + ["--max_iters=1", "--eval_interval=1", "--out_dir=o", "--overwrite_checkpoint=True"])
    assert torch.load("o/ckpt.pt", weights_only=True)["iter_num"] == 1


def test_diverged_model_is_never_saved(tiny_data, capsys):
    """The issue's reproduction: resume a trained tiny model at a learning rate that makes it diverge."""
    train.main(TINY + ["--max_iters=4", "--eval_interval=4", "--out_dir=o"])
    before = Path("o/ckpt.pt").read_bytes()
    with pytest.raises(SystemExit):  # the non-finite guard ends it
        train.main(TINY + ["--out_dir=o", "--init_from=resume", "--max_iters=80", "--eval_interval=3",
                           "--eval_iters=1", "--learning_rate=1e6", "--min_lr=1e6", "--grad_clip=0"])
    assert "non-finite val loss or weights, not saved" in capsys.readouterr().out
    assert Path("o/ckpt.pt").read_bytes() == before
    model, _ = load_checkpoint("o/ckpt.pt")
    assert all(p.isfinite().all() for p in model.parameters())


def test_resume_keeps_the_checkpoints_model_and_says_so(tiny_data, capsys):
    train.main(TINY + ["--max_iters=2", "--eval_interval=2", "--out_dir=o"])  # block 16, mean 2, max 4, bptt 1
    # a value given on the command line or in a config file that differs from the checkpoint's is an error
    for flag, saved in (("--block_size=32", "block_size=16"), ("--mean_loops=3", "mean_loops=2"),
                        ("--max_loops=8", "max_loops=4"), ("--bptt_k=2", "bptt_k=1"), ("--n_embd=64", "n_embd=32")):
        err = one_line_error(capsys, train.main, TINY + ["--out_dir=o", "--init_from=resume", flag])
        assert flag[2:] in err and saved in err
    Path("cfg.py").write_text("n_head = 4\n")
    assert "n_head=2" in one_line_error(capsys, train.main, ["cfg.py", "--out_dir=o", "--init_from=resume"])
    # nothing given: the checkpoint's model and dataset, whatever the defaults, and the saved config says so
    hist = train.main(["--init_from=resume", "--out_dir=o", "--max_iters=4", "--eval_interval=2", "--eval_iters=1",
                       "--batch_size=2", "--compile=False", "--peak_flops=1e9"])
    assert [h[0] for h in hist] == [2, 3] and max(h[1] for h in hist) <= 4
    ckpt = torch.load("o/ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == 4 and ckpt["config"]["dataset"] == "tiny"
    for key in train.MODEL_KEYS:
        assert ckpt["config"][key] == ckpt["model_args"][key]
    assert (ckpt["config"]["block_size"], ckpt["config"]["mean_loops"], ckpt["config"]["bptt_k"]) == (16, 2, 1)


@pytest.mark.parametrize("key", ["eval_iters", "eval_interval", "log_interval", "batch_size",
                                 "gradient_accumulation_steps", "learning_rate"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_non_positive_settings_are_refused(tiny_data, capsys, key, value):
    err = one_line_error(capsys, train.main, TINY + [f"--{key}={value}", "--out_dir=o"])
    assert f"--{key} must be > 0, got {value}" in err
    assert not Path("o").exists()


@pytest.mark.parametrize("flags, message", [
    (["--n_embd=30", "--n_head=4"], "--n_head=4 must divide --n_embd=30"),
    (["--n_head=4", "--n_kv_head=3"], "--n_kv_head=3 must divide --n_head=4"),
    (["--n_embd=24", "--n_head=8"], "head size n_embd / n_head = 3 must be even"),
])
def test_bad_model_shape_is_one_line(tiny_data, capsys, flags, message):
    assert message in one_line_error(capsys, train.main, TINY + flags)


def test_config_file_errors_name_file_and_line(tiny_data, capsys):
    Path("syntax.py").write_text("max_iters = 3\nlearning_rate = (1e-3\n")
    Path("runtime.py").write_text("max_iters = 3\nbatch_size = 8 // 0\n")
    assert "syntax.py:2: SyntaxError" in one_line_error(capsys, train.main, ["syntax.py"])
    assert "runtime.py:2: ZeroDivisionError" in one_line_error(capsys, train.main, ["runtime.py"])


def test_cuda_without_a_gpu_is_one_line(tiny_data, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert "no CUDA GPU" in one_line_error(capsys, train.main, TINY + ["--device=cuda"])


def test_wandb_missing_or_present(tiny_data, monkeypatch, capsys):
    """wandb is not a requirement, and its offline mode starts a background service: a stub module records the
    calls instead (their arguments are wandb's documented ones)."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails as if not installed
    assert "pip install wandb" in one_line_error(capsys, train.main, TINY + ["--wandb_log=True"])
    calls = []
    stub = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)), log=lambda d: calls.append(("log", d)))
    monkeypatch.setitem(sys.modules, "wandb", stub)
    train.main(TINY + ["--wandb_log=True", "--max_iters=2", "--eval_interval=2", "--out_dir=w"])
    assert calls[0][0] == "init" and calls[0][1]["project"] == "nanoloop" and calls[0][1]["config"]["max_iters"] == 2
    logged = [d for name, d in calls if name == "log"]
    assert {"iter", "train/loss", "val/loss", "lr"} <= set(logged[0]) and any("train/step_loss" in d for d in logged)


def test_matmul_ceiling_takes_seconds_even_in_bf16_on_cpu():
    t0 = time.perf_counter()
    flops = train.measure_matmul_flops("cpu", torch.bfloat16)
    assert flops > 0 and time.perf_counter() - t0 < 20  # was ~100 s: six 2048^2 bf16 matmuls on this CPU


def _save_forever(path):
    """A child process: save a 4 MB checkpoint again and again, each one consistent in itself."""
    for i in range(10 ** 6):
        train.save_checkpoint({"format": "nanoloop-1", "iter_num": i, "model": {"w": torch.full((1 << 20,), float(i))}},
                              path)


def test_sigkill_during_repeated_saves_keeps_a_loadable_checkpoint(tmp_path):
    """Fault injection: SIGKILL at random moments while a process saves over and over; the checkpoint is always
    a whole one (the old or a new one), never a torn write."""
    path = str(tmp_path / "ckpt.pt")
    train.save_checkpoint({"format": "nanoloop-1", "iter_num": -1, "model": {"w": torch.full((1 << 20,), -1.0)}}, path)
    rng, fork = random.Random(0), multiprocessing.get_context("fork")
    seen = set()
    for _ in range(10):
        child = fork.Process(target=_save_forever, args=(path,))
        child.start()
        time.sleep(rng.uniform(0.02, 0.3))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        ckpt = torch.load(path, weights_only=True)
        assert bool((ckpt["model"]["w"] == ckpt["iter_num"]).all())
        seen.add(ckpt["iter_num"])
    assert len(seen) > 1  # the kills did land among the saves


def test_ctrl_c_is_one_line_and_keeps_the_checkpoint(tiny_data):
    """A real SIGINT to `python train.py`, after its first checkpoint."""
    argv = TINY + ["--max_iters=100000", "--eval_interval=3", "--out_dir=o"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    while not Path("o/ckpt.pt").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    assert load_checkpoint("o/ckpt.pt")[1]["iter_num"] >= 3


def test_the_default_dataset_prepares_itself(tmp_path, monkeypatch, capsys):
    """The quick start is `python train.py`: with no data/shakespeare, train.py runs prepare.py's default
    preparation (here a stand-in that writes a tiny dataset under that name) and says so."""
    monkeypatch.chdir(tmp_path)
    calls = []

    def fake_prepare(argv):
        calls.append(argv)
        os.makedirs("data/shakespeare")
        np.tile(np.arange(14, dtype=np.uint16), 200).tofile("data/shakespeare/train.bin")
        np.tile(np.arange(14, dtype=np.uint16), 20).tofile("data/shakespeare/val.bin")
        meta = dict(source="shakespeare", tokenizer="none", vocab_size=14, eot_id=0, dtype="uint16")
        Path("data/shakespeare/meta.json").write_text(json.dumps(meta))
    monkeypatch.setattr(train.prepare, "main", fake_prepare)
    flags = [f for f in TINY if not f.startswith("--dataset")]
    train.main(flags + ["--out_dir=out", "--max_iters=2", "--eval_interval=2"])
    assert calls == [[]] and "running `python prepare.py` first" in capsys.readouterr().out
    train.main(flags + ["--out_dir=out2", "--max_iters=2", "--eval_interval=2"])
    assert calls == [[]]  # prepared once, then found
