import io
import json
import math
import multiprocessing
import os
import random
import re
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
from model import GPTConfig, load_checkpoint, save_atomic, training_memory

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


def cfg(argv):
    """train.py's settings as a dict after argv."""
    return vars(configure(vars(train), train.RULES, list(argv))[0])


def one_line_error(capsys, fn, *args):
    """Run fn(*args), expect exit 2 with exactly one line on stderr; return that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as err:
        fn(*args)
    text = capsys.readouterr().err
    assert err.value.code == 2 and text.count("\n") == 1 and text.startswith("error: "), text
    return text


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
    C = configure(vars(train), train.RULES, ["--max_iters=1000", "--learning_rate=1.0", "--min_lr=0.1"])[0]
    assert train.get_lr(0, C) == pytest.approx(0.1)  # warmup is 1% = 10 iters
    assert train.get_lr(9, C) == pytest.approx(1.0)
    assert train.get_lr(1000, C) == pytest.approx(0.1)
    assert train.get_lr(505, C) == pytest.approx(0.55, abs=1e-3)


def test_configurator_errors(tmp_path, capsys):
    assert cfg(["--max_iters=5", "--batch_size", "3", "--dtype=bfloat16", "--compile=True"])["batch_size"] == 3
    assert cfg(["--learning_rate=1"])["learning_rate"] == 1.0
    bare = cfg(["--overwrite_checkpoint", "--compile", "False", "--max_iters", "7"])  # a bare boolean flag is True
    assert (bare["overwrite_checkpoint"], bare["compile"], bare["max_iters"]) == (True, False, 7)
    for bad, message in ((["--nope=1"], "unknown setting"),
                         (["--max_iters=abc"], "--max_iters: cannot parse 'abc'"),
                         (["--max_iters=1.5"], "--max_iters: expected int, got 1.5"),
                         (["--compile=1"], "--compile: expected bool, got 1"),
                         (["--batch_size"], "--batch_size: expected int, got True"),
                         (["missing_config.py"], "missing_config.py")):
        err = one_line_error(capsys, cfg, bad)
        assert message in err and (bad != ["--nope=1"] or "nope" in err and "--help" in err)
    path = tmp_path / "c.py"
    path.write_text("max_iters = 3\nbogus_key = 1\n")
    assert "bogus_key" in one_line_error(capsys, cfg, [str(path)])
    path.write_text("import math\nmax_iters = 3\nlearning_rate = math.sqrt(4e-6)\n")
    assert cfg([str(path), "--max_iters=4"])["max_iters"] == 4



def test_every_committed_config_file_loads(monkeypatch):
    root = Path(__file__).resolve().parent.parent
    monkeypatch.chdir(root)  # config files exec each other by relative path, as `python train.py config/x.py` does
    paths = sorted(root.glob("config/**/*.py"))
    assert len(paths) >= 11
    for path in paths:
        config = cfg([str(path.relative_to(root))])
        assert config["out_dir"].startswith("out-") and config["max_iters"] > 0
    search = cfg(["config/search/c5.py"])  # the run that became the defaults
    for key in ("n_embd", "n_core", "mean_loops", "max_loops", "bptt_k", "block_size", "batch_size", "max_iters"):
        assert search[key] == vars(train)[key]
    study, dense = cfg(["config/study.py"]), cfg(["config/study_dense.py"])
    same = ("max_iters", "batch_size", "block_size", "n_embd", "learning_rate", "lr_decay_iters",
            "warmup_iters", "min_lr", "dataset", "seed")
    assert all(study[k] == dense[k] for k in same)  # parity: the same data, tokens, schedule, width
    assert dense["n_core"] == 0 and study["out_dir"] != dense["out_dir"]
    assert cfg(["config/study_2000.py"])["max_iters"] == 2 * study["max_iters"]  # the trend


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
    out = capsys.readouterr().out
    assert out.count("non-finite loss or grad norm") == 1  # one line per skip
    assert "iter 3: non-finite loss or grad norm, optimizer step skipped (1 so far)" in out
    ckpt = torch.load("g/ckpt.pt", weights_only=True)
    assert {int(s["step"]) for s in ckpt["optimizer"]["state"].values()} == {5}  # 6 iters, 1 skipped
    calls.update(n=0, nan_at={2, 3, 4})
    err = one_line_error(capsys, train.main, TINY + ["--max_iters=8", "--eval_interval=8", "--out_dir=h"])
    assert "iter 4: 3 consecutive non-finite steps" in err
    assert "non-finite loss or grad norm" not in err
    calls.update(n=0, nan_at={3})  # after a grace of 2 steps, 1 skip in 4 steps is over 0.1%: abort
    err = one_line_error(capsys, train.main, TINY + ["--max_iters=8", "--eval_interval=8", "--out_dir=k",
                                                     "--guard_grace_iters=2"])
    assert "iter 3: 1 non-finite steps exceed 0.1% of 4" in err
    lines, skipped = [], []
    for it in (5, 1999):  # one skip inside the grace period is tolerated, and 2 in 2000 steps is 0.1%...
        train.nonfinite_guard(it, skipped, grace=100, log=lines.append)
    assert skipped == [5, 1999] and len(lines) == 2 and lines[1].startswith("iter 1999: non-finite")
    with pytest.raises(SystemExit):  # ...a third one exceeds 0.1% of 2001 steps
        train.nonfinite_guard(2000, skipped, grace=100, log=lines.append)
    assert len(lines) == 3 and "exceed 0.1% of 2001" in capsys.readouterr().err
    lines, skipped = [], []
    for it in (10, 11, 13, 14):  # a finite step 12 between: never 3 in a row
        train.nonfinite_guard(it, skipped, 100, lines.append)
    with pytest.raises(SystemExit):  # the third in a row, inside the grace
        train.nonfinite_guard(15, skipped, 100, lines.append)
    assert len(lines) == 5 and "iter 15: 3 consecutive" in capsys.readouterr().err


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
    causes = [line for line in run.stderr.splitlines() if "rror" in line or "what()" in line or "terminate" in line]
    assert run.returncode == 0, "\n".join(causes[:20]) or run.stderr[-2000:]
    assert run.stdout.count("iter 3:") == 1  # only rank 0 logs
    model, ckpt = load_checkpoint("ddp/ckpt.pt")
    assert ckpt["iter_num"] == 4 and len(ckpt["rng"]["data"]) == 2


# ----------------------------------------------------------------------------- issue 12: nothing is lost


def test_scratch_run_never_overwrites_a_checkpoint(tiny_data, capsys):
    train.main(TINY + ["--max_iters=3", "--eval_interval=3", "--out_dir=o"])
    before = Path("o/ckpt.pt").read_bytes()
    err = one_line_error(capsys, train.main, TINY + ["--max_iters=1", "--out_dir=o"])
    assert "step 3" in err and "--init_from=resume" in err and "--overwrite_checkpoint=True" in err
    assert Path("o/ckpt.pt").read_bytes() == before
    train.main(TINY + ["--max_iters=1", "--eval_interval=1", "--out_dir=o", "--overwrite_checkpoint=True"])
    assert torch.load("o/ckpt.pt", weights_only=True)["iter_num"] == 1
    Path("o/ckpt.pt").write_bytes(before[:1000])  # a corrupt checkpoint: still kept, and the way out named
    err = one_line_error(capsys, train.main, TINY + ["--max_iters=1", "--out_dir=o"])
    assert "not a readable checkpoint" in err and "--overwrite_checkpoint=True" in err
    assert Path("o/ckpt.pt").read_bytes() == before[:1000]


def test_diverged_model_is_never_saved(tiny_data, capsys):
    """The issue's reproduction: resume a trained tiny model with settings that make it diverge, evaluating
    (and, finite, saving) at every step: the non-finite model is never saved, the last finite one stays."""
    train.main(TINY + ["--max_iters=4", "--eval_interval=4", "--out_dir=o", "--weight_decay=10"])
    # lr 10 and weight decay 10: each step multiplies the matrices by 1 - 100 = -99 until they overflow (the
    # learning rate is capped at 10; both runs get the weight decay, since a resumed optimizer keeps its own)
    with pytest.raises(SystemExit):  # the non-finite guard ends it
        train.main(TINY + ["--out_dir=o", "--init_from=resume", "--max_iters=80", "--eval_interval=1",
                           "--eval_iters=1", "--learning_rate=10", "--min_lr=10", "--weight_decay=10",
                           "--grad_clip=0"])
    out = capsys.readouterr().out
    first_bad = re.search(r"step (\d+): non-finite val loss or weights, not saved", out)
    assert first_bad and "saved checkpoint" not in out[first_bad.start():]
    assert "saved checkpoint" in out[:first_bad.start()]  # always_save_checkpoint saved every finite step
    model, ckpt = load_checkpoint("o/ckpt.pt")
    assert ckpt["iter_num"] == int(first_bad.group(1)) - 1  # the last finite evaluation
    assert all(p.isfinite().all() for p in model.parameters())


def test_resume_honours_or_refuses_new_optimizer_settings(tiny_data, capsys):
    """A resumed run given --weight_decay/--beta1/--beta2 must use them (as its saved config says it did),
    or refuse them in one line: never keep the checkpoint's values silently."""
    train.main(TINY + ["--max_iters=2", "--eval_interval=2", "--out_dir=o"])
    argv = TINY + ["--out_dir=o", "--init_from=resume", "--max_iters=3", "--eval_interval=3",
                   "--weight_decay=0.5", "--beta1=0.8", "--beta2=0.9"]
    try:
        train.main(argv)
    except SystemExit as err:
        assert err.code == 2
        text = capsys.readouterr().err
        assert text.count("\n") == 1 and "weight_decay" in text, text
        return
    ckpt = torch.load("o/ckpt.pt", weights_only=True)
    groups = ckpt["optimizer"]["param_groups"]
    assert ckpt["config"]["weight_decay"] == 0.5
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0]  # matrices decay, gains do not
    assert all(tuple(g["betas"]) == (0.8, 0.9) for g in groups)


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


@pytest.mark.parametrize("key, value, message", [
    ("eval_iters", "0", "--eval_iters must be in [1, 2147483648], got 0"),
    ("eval_interval", "-1", "--eval_interval must be in [1, 2147483648], got -1"),
    ("log_interval", "0", "--log_interval must be in [1, 2147483648], got 0"),
    ("batch_size", "0", "--batch_size must be in [1, 1048576], got 0"),
    ("gradient_accumulation_steps", "-1", "--gradient_accumulation_steps must be in [1, 1048576], got -1"),
    ("learning_rate", "0", "--learning_rate must be in [1e-12, 10.0], got 0.0"),
    ("learning_rate", "-1", "--learning_rate must be in [1e-12, 10.0], got -1.0"),
])
def test_non_positive_settings_are_refused(tiny_data, capsys, key, value, message):
    err = one_line_error(capsys, train.main, TINY + [f"--{key}={value}", "--out_dir=o"])
    assert message in err
    assert not Path("o").exists()


@pytest.mark.parametrize("flags, message", [
    (["--n_embd=30", "--n_head=4"], "n_head=4 must divide n_embd=30"),
    (["--n_head=4", "--n_kv_head=3"], "n_kv_head=3 must divide n_head"),
    (["--n_embd=24", "--n_head=8"], "head size n_embd / n_head = 3 must be even"),
    (["--mean_loops=5", "--max_loops=4"], "mean_loops=5 > max_loops=4"),
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
    assert "this machine has 0 CUDA GPU(s)" in one_line_error(capsys, train.main, TINY + ["--device=cuda"])
    assert "(cpu, cuda or cuda:N)" in one_line_error(capsys, train.main, TINY + ["--device=gpu"])


def _save_forever(path):
    """A child process: save a 4 MB checkpoint again and again, each one consistent in itself."""
    for i in range(10 ** 6):
        save_atomic(path, {"format": "nanoloop-1", "iter_num": i, "model": {"w": torch.full((1 << 20,), float(i))}})


def test_sigkill_during_repeated_saves_keeps_a_loadable_checkpoint(tmp_path):
    """Fault injection: SIGKILL at random moments while a process saves over and over; the checkpoint is always
    a whole one (the old or a new one), never a torn write."""
    path = str(tmp_path / "ckpt.pt")
    save_atomic(path, {"format": "nanoloop-1", "iter_num": -1, "model": {"w": torch.full((1 << 20,), -1.0)}})
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
                            stderr=subprocess.PIPE, text=True, env=env,  # a background shell ignores SIGINT:
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal
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


# ----------------------------------------------------------------------------- issue 17: the GPU path on the CPU

def attention_line(out):
    return next(line for line in out.splitlines() if line.startswith("attention input dtypes"))


def test_bf16_run_logs_bf16_attention_saves_and_resumes_exactly(tiny_data, capsys):
    common = TINY + ["--dtype=bfloat16", "--lr_decay_iters=6", "--eval_interval=3"]
    straight = train.main(common + ["--max_iters=6", "--out_dir=a"])
    out = capsys.readouterr().out
    line = attention_line(out)
    assert line.count("'bfloat16'") == 9 and "float32" not in line  # q, k, v of prelude, core and coda
    assert "cpu bfloat16" in out and "memory per micro-step:" in out and "saved checkpoint to a/ckpt.pt" in out
    first = train.main(common + ["--max_iters=3", "--out_dir=b"])
    resumed = train.main(common + ["--max_iters=6", "--out_dir=b", "--init_from=resume"])
    assert first + resumed == straight  # bf16 autocast changes nothing about what a resume restores
    model, ckpt = load_checkpoint("b/ckpt.pt")
    assert ckpt["iter_num"] == 6 and ckpt["config"]["dtype"] == "bfloat16"
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast: float32 master weights


def test_compiled_bf16_run_compiles_a_few_graphs_once_whatever_the_depth(tiny_data, monkeypatch, capsys):
    """As a GPU run does it (inductor there; aot_eager needs no C++ toolchain): prelude, core and coda compiled
    separately, so that a new depth every step never recompiles once each grad mode has been seen."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    real_step, seen = train.train_step, []

    def counting_step(*args, **kwargs):
        out = real_step(*args, **kwargs)
        seen.append((out[1], counters["stats"]["unique_graphs"], counters["frames"]["total"]))
        return out
    monkeypatch.setattr(train, "train_step", counting_step)
    try:
        hist = train.main(TINY + ["--compile=True", "--compile_backend=aot_eager", "--dtype=bfloat16",
                                  "--max_iters=6", "--eval_interval=3", "--out_dir=c"])
    finally:
        torch._dynamo.reset()
    out = capsys.readouterr().out
    assert "compiling prelude, core and coda (aot_eager)" in out and "float32" not in attention_line(out)
    assert seen[0][0] > 1  # step 0 already ran loops without and with grad (bptt_k 1): the warm-up
    assert len({loops for loops, _, _ in seen}) >= 3  # the depth really changes
    graphs, frames = seen[0][1], seen[0][2]
    assert 3 <= graphs <= 9  # 3 parts x (train with grad, train without, eval) at most
    assert all((g, f) == (graphs, frames) for _, g, f in seen)  # no recompilation after the first step
    assert load_checkpoint("c/ckpt.pt")[1]["iter_num"] == 6 and len(hist) == 6


@pytest.mark.parametrize("config_file", ["config/s1.py", "config/s0.py"])
def test_paper_configs_micro_step_fits_in_22_gb(config_file, monkeypatch):
    monkeypatch.chdir(ROOT)
    C = configure(vars(train), train.RULES, [config_file])[0]
    config = GPTConfig(**{k: getattr(C, k) for k in train.MODEL_KEYS}, vocab_size=49152)
    need = training_memory(config, C.batch_size, "bfloat16")
    with torch.device("meta"):
        n_params = sum(p.numel() for p in train.GPT(config).parameters())
    assert need["weights"] == 4 * n_params and need["adamw"] == 8 * n_params and need["activations"] > 0
    assert need["total"] == sum(v for k, v in need.items() if k != "total")
    summary = ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in need.items())
    assert need["total"] < 22e9, f"{config_file} batch_size={C.batch_size}: {summary}"


def tiny_config():
    C = cfg(TINY)
    return GPTConfig(**{k: C[k] for k in train.MODEL_KEYS}, vocab_size=14)


def test_a_run_that_would_not_fit_is_refused_naming_a_batch_that_fits(tiny_data, capsys):
    config = tiny_config()
    mem = {b: training_memory(config, b, "float32")["total"] for b in (1, 2, 3, 4)}
    assert mem[1] < mem[2] < mem[3] < mem[4]
    limit = (mem[2] + mem[3]) / 2  # batch 4 (TINY's) does not fit, 2 does
    err = one_line_error(capsys, train.main, TINY + [f"--memory_limit_gb={limit / 1e9!r}", "--out_dir=o"])
    assert "exceeds" in err and "--gradient_accumulation_steps" in err
    batch = int(re.search(r"--batch_size=(\d+)", err).group(1))
    assert 1 <= batch < 4 and training_memory(config, batch, "float32")["total"] <= limit
    train.main(TINY + [f"--memory_limit_gb={limit / 1e9!r}", f"--batch_size={batch}", "--max_iters=1",
                       "--out_dir=o"])  # and it does run
    assert "memory per micro-step:" in capsys.readouterr().out


def test_a_run_where_no_batch_fits_names_none_that_does_not(tiny_data, capsys):
    config = tiny_config()
    limit = training_memory(config, 1, "float32")["total"] / 2  # not even one sequence fits
    err = one_line_error(capsys, train.main, TINY + [f"--memory_limit_gb={limit / 1e9!r}", "--out_dir=o"])
    named = re.search(r"--batch_size=(\d+)", err)
    assert named is None or training_memory(config, int(named.group(1)), "float32")["total"] <= limit, err


def test_dry_run_of_the_papers_configuration_at_a_tiny_width(tiny_data, capsys):
    """config/s1.py as it is (2 + 4 x r + 2 blocks, mean 8 loops, bptt 8, its schedule), only narrow and short."""
    argv = [str(ROOT / "config/s1.py"), "--device=cpu", "--dtype=bfloat16", "--dataset=tiny", "--n_embd=32",
            "--n_head=4", "--n_kv_head=2", "--ffn_hidden=64", "--block_size=16", "--batch_size=2",
            "--gradient_accumulation_steps=2", "--max_iters=2", "--eval_interval=1", "--eval_iters=1",
            "--log_interval=1", "--out_dir=s1dry"]
    hist = train.main(argv)
    out = capsys.readouterr().out
    assert [h[0] for h in hist] == [0, 1] and all(1 <= h[1] <= 32 for h in hist)
    assert "float32" not in attention_line(out) and "memory per micro-step:" in out
    assert "loops lognormal mean 8 max 32, bptt_k 8; cpu bfloat16" in out and "no MFU on a CPU" in out
    assert "saved checkpoint to s1dry/ckpt.pt" in out
    resumed = train.main(argv + ["--init_from=resume", "--max_iters=3"])
    assert [h[0] for h in resumed] == [2]
    model, ckpt = load_checkpoint("s1dry/ckpt.pt")
    args = ckpt["model_args"]
    assert ckpt["iter_num"] == 3 and (args["n_prelude"], args["n_core"], args["n_coda"]) == (2, 4, 2)
    assert ckpt["config"]["learning_rate"] == 1e-4 and ckpt["config"]["gradient_accumulation_steps"] == 2


def test_no_mfu_on_a_cpu_unless_a_peak_is_given(tiny_data, capsys):
    train.main(TINY + ["--peak_flops=0", "--max_iters=1", "--out_dir=o"])
    out = capsys.readouterr().out
    assert "no MFU on a CPU" in out
    assert not [line for line in out.splitlines() if line.startswith("iter") and "mfu" in line]
    train.main(TINY + ["--peak_flops=1e9", "--max_iters=1", "--out_dir=p"])
    assert "(--peak_flops)" in capsys.readouterr().out  # and TINY's other runs log an mfu


@pytest.mark.parametrize("name, dtype, peak", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12),
    ("NVIDIA H200", "bfloat16", 989e12),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12),  # not the A10's
    ("NVIDIA GeForce RTX 4090", "bfloat16", 165e12),
    ("NVIDIA GeForce GTX 1080 Ti", "bfloat16", 0.0),  # no datasheet entry: no MFU
    ("NVIDIA H100 80GB HBM3", "float32", 0.0),  # the table holds bf16 peaks only
])
def test_mfu_ceiling_is_a_datasheet_peak_on_cuda(monkeypatch, name, dtype, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    C = types.SimpleNamespace(peak_flops=0.0, device="cuda:0", dtype=dtype)
    got, why = train.mfu_ceiling(C)
    assert got == peak
    assert ("datasheet bf16 peak" in why) if peak else ("no MFU" in why and "--peak_flops" in why and name in why)
    C.peak_flops = 5e14
    assert train.mfu_ceiling(C) == (5e14, "--peak_flops")
    C.peak_flops, C.device = 0.0, "cpu"
    assert train.mfu_ceiling(C)[0] == 0.0 and "no MFU on a CPU" in train.mfu_ceiling(C)[1]


# ----------------------------------------------------------------------------- issue 18: bad input

NUMERIC = [key for key, rule in train.RULES.items() if isinstance(rule, tuple) and not isinstance(rule[0], str)]


def run_or_refuse(capsys, argv):
    """train.main(argv): a normal run ("ran") or exit 2 with one 'error: ' line ("refused", the line); any
    other exception fails the test."""
    capsys.readouterr()
    try:
        train.main(argv)
    except SystemExit as err:
        text = capsys.readouterr().err
        assert err.code == 2 and text.count("\n") == 1 and text.startswith("error: "), (argv[-1], err.code, text)
        return "refused", text
    text = capsys.readouterr().err
    assert "Traceback" not in text and "error" not in text, text
    return "ran", ""


@pytest.mark.parametrize("key", NUMERIC)
def test_every_numeric_setting_takes_any_value_without_a_traceback(tiny_data, capsys, key):
    low, high = train.RULES[key]
    for i, value in enumerate(["0", "-1", "1e999", "nan", "True"]):
        argv = TINY + ["--max_iters=1", "--eval_interval=1", "--eval_iters=1", f"--out_dir=o{i}", f"--{key}={value}"]
        outcome, err = run_or_refuse(capsys, argv)
        if value in ("0", "-1"):
            assert outcome == ("ran" if low <= int(value) <= high else "refused"), (key, value, err)
            assert outcome == "ran" or f"--{key} must be in [{low}, {high}], got " in err
        else:  # infinity is no setting's value, nan no Python literal, True no number
            assert outcome == "refused", (key, value)
            assert f"--{key}" in err


@pytest.mark.parametrize("key", ["seed", "warmup_iters", "lr_decay_iters", "eval_interval", "log_interval",
                                 "guard_grace_iters", "max_loops", "rope_theta", "norm_eps", "state_std",
                                 "peak_flops", "memory_limit_gb", "grad_clip", "beta1", "beta2", "min_lr"])
def test_the_largest_value_of_a_setting_runs_or_is_refused(tiny_data, capsys, key):
    """Each rule's upper bound is a value the user may give: it runs, or is refused in one line. (Not here: the
    bounds that make a run long, such as max_iters, eval_iters or a 1024-loop bptt_k's memory count.)"""
    high = train.RULES[key][1]
    run_or_refuse(capsys, TINY + ["--max_iters=1", "--eval_interval=1", "--eval_iters=1", "--out_dir=o",
                                  f"--{key}={high!r}"])


@pytest.mark.parametrize("flags, message", [
    (["--beta1=2"], "--beta1 must be in [0.0, 0.9999], got 2.0"),
    (["--batch_size=True"], "--batch_size: expected int, got True"),
    (["--max_iters=True"], "--max_iters: expected int, got True"),
    (["--out_dir="], "--out_dir must not be empty"),
    (["--n_core=-1"], "--n_core must be in [0, 256], got -1"),
    (["--norm_eps=-1"], "--norm_eps must be in [1e-12, 1.0], got -1.0"),
    (["--rope_theta=0"], "--rope_theta must be in [1.0, 1000000000.0], got 0.0"),
    (["--learning_rate=inf"], "--learning_rate: cannot parse 'inf'"),
    (["--dtype=float16"], "--dtype must be one of float32, bfloat16, got 'float16'"),
    (["--compile_backend=  "], "--compile_backend must not be empty"),
    (["--out_dir", "--max_iters=1"], "--out_dir: expected str, got True"),  # a bare flag is no text
    (["--dataset"], "--dataset: expected str, got True"),
])
def test_bad_values_are_one_line(tiny_data, capsys, flags, message):
    assert message in one_line_error(capsys, train.main, TINY + ["--out_dir=o"] + flags)
    assert not Path("o").exists()  # refused before anything is written


def test_bits_per_byte_only_from_a_known_byte_count(tiny_data, capsys):
    args = TINY + ["--max_iters=1", "--eval_interval=1", "--out_dir=o", "--overwrite_checkpoint=True"]
    train.main(args)  # this meta.json has no val_bytes: no made-up figure
    assert "val nan bits/byte" in capsys.readouterr().out
    meta = json.loads(Path("data/tiny/meta.json").read_text()) | {"val_bytes": 4000}
    Path("data/tiny/meta.json").write_text(json.dumps(meta))
    train.main(args)
    loss, bits = re.search(r"step 1: .* val loss ([\d.]+), val ([\d.]+) bits/byte", capsys.readouterr().out).groups()
    assert float(bits) == pytest.approx(float(loss) * 2000 / 4000 / math.log(2), abs=1e-4)


def test_out_dir_that_is_a_file_is_one_line(tiny_data, capsys):
    Path("taken").write_text("not a directory")
    assert "taken" in one_line_error(capsys, train.main, TINY + ["--out_dir=taken", "--max_iters=1"])
    assert Path("taken").read_text() == "not a directory"


def test_ctrl_c_inside_torch_save_is_one_line(tmp_path, monkeypatch, capsys):
    """A Ctrl-C while torch.save writes: its zip writer fails on the way out and
    raises a RuntimeError from the KeyboardInterrupt, a traceback unless run() knows."""
    import configurator

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


def test_out_dir_under_a_file_is_one_line(tiny_data, capsys):
    Path("taken").write_text("not a directory")
    assert "--out_dir=taken/run" in one_line_error(capsys, train.main, TINY + ["--out_dir=taken/run"])
    assert Path("taken").read_text() == "not a directory"


def test_bad_config_files_are_one_line(tiny_data, capsys):
    Path("exits.py").write_text("import sys\nsys.exit()\n")  # not a silent exit 0
    assert "exits.py:2: SystemExit" in one_line_error(capsys, train.main, ["exits.py"])
    Path("latin1.py").write_bytes("max_iters = 3  # caf\u00e9\n".encode("latin-1"))
    assert "latin1.py" in one_line_error(capsys, train.main, ["latin1.py"])
    Path("nan.py").write_text("learning_rate = float('nan')\n")
    assert "--learning_rate must be in [1e-12, 10.0], got nan" in one_line_error(capsys, train.main, ["nan.py"])
    Path("inf.py").write_text("batch_size = float('inf')\n")
    assert "--batch_size: expected int, got inf" in one_line_error(capsys, train.main, ["inf.py"])
    Path("bool.py").write_text("max_iters = False\n")
    assert "--max_iters: expected int, got False" in one_line_error(capsys, train.main, ["bool.py"])
    Path("shape.py").write_text("n_core = 257\n")
    assert "--n_core must be in [0, 256], got 257" in one_line_error(capsys, train.main, ["shape.py"])


def test_help_lists_every_setting_and_exits_0(capsys):
    with pytest.raises(SystemExit) as err:
        train.main(["--help"])
    assert err.value.code == 0
    out = capsys.readouterr().out
    assert "Train a depth-recurrent transformer" in out
    line = next(line for line in out.splitlines() if line.strip().startswith("--batch_size="))
    assert "--batch_size=8" in line and "sequences per micro-step" in line
    for key in train.RULES:
        assert f"--{key}=" in out
    with pytest.raises(SystemExit) as err:  # wherever it comes
        train.main(TINY + ["--max_iters=1", "--help"])
    assert err.value.code == 0
