"""Tests for evaluate.py on a tiny model trained here on a tiny BPE dataset (tmp dirs only).
References: a loop written out by hand with a float64 KL (trace), model.forward at r loops (the rows),
a hand-run bootstrap (intervals), hand-built KL tables."""
import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import configurator
import evaluate
import prepare
from configurator import UserError
from conftest import script_env
from model import CKPT_FORMAT, GPT, GPTConfig, autocast, load_checkpoint, save_atomic, token_kl

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--out_dir=out-tiny", "--windows=6", "--batch_size=4"]
TINY = GPTConfig(vocab_size=300, block_size=32, n_embd=32, n_head=2, n_kv_head=1, ffn_hidden=64, n_core=2,
                 mean_loops=4, max_loops=16, bptt_k=4)


def tiny_text(n_lines, seed):
    """Words, numerals, punctuation and whitespace, so that every token class occurs."""
    rng = random.Random(seed)
    words = ["the", "king", "queen", "shall", "speak", "of", "love", "and", "war", "my", "lord", "good"]
    lines = []
    for _ in range(n_lines):
        line = " ".join(rng.choice(words) for _ in range(rng.randint(3, 9)))
        line += rng.choice([".", ",", "!", "?", ";", " -- " + str(rng.randint(1, 999)) + "."])
        lines.append(line.capitalize() + ("\n\n" if rng.random() < 0.2 else "\n"))
    return "".join(lines)


def write_dataset(data_dir, train_text, val_text):
    """A BPE dataset as prepare.py writes one: bins, tokenizer.json, meta.json with byte counts."""
    tok = prepare.train_bpe(300, [train_text])
    data_dir.mkdir(parents=True)
    tok.save(str(data_dir / "tokenizer.json"))
    meta = {"source": "test", "tokenizer": "bpe:300", "vocab_size": 300, "eot_id": 0, "dtype": "uint16"}
    meta["tokenizer_sha256"] = hashlib.sha256((data_dir / "tokenizer.json").read_bytes()).hexdigest()
    for split, text in (("train", train_text), ("val", val_text)):
        ids = np.array(tok.encode(text).ids + [0], dtype=np.uint16)
        ids.tofile(data_dir / f"{split}.bin")
        meta[f"{split}_tokens"] = len(ids)
        meta[f"{split}_bytes"] = len(text.encode("utf-8"))  # the byte count, known by construction
    meta["val_sha256"] = hashlib.sha256((data_dir / "val.bin").read_bytes()).hexdigest()
    (data_dir / "meta.json").write_text(json.dumps(meta))
    return meta


def train_tiny(data_dir, out_dir, steps=40):
    """out_dir/ckpt.pt: TINY trained for `steps` at random depths 1..8, saved as train.py saves it."""
    torch.manual_seed(0)
    model = GPT(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.from_numpy(np.fromfile(data_dir / "train.bin", dtype=np.uint16).astype(np.int64))
    for step in range(steps):
        starts = torch.randint(len(ids) - 33, (8,))
        batch = torch.stack([ids[i:i + 33] for i in starts])
        loss = model(batch[:, :-1], batch[:, 1:], loops=1 + step % 8)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    meta = json.loads((data_dir / "meta.json").read_text())
    ckpt = {"format": CKPT_FORMAT, "model_args": dataclasses.asdict(TINY), "model": model.state_dict(),
            "optimizer": optimizer.state_dict(), "iter_num": steps, "best_val_loss": loss.item(),
            "config": {"dataset": data_dir.name, "dataset_meta": meta, "run_id": "test"}, "rng": {}}
    out_dir.mkdir()
    save_atomic(str(out_dir / "ckpt.pt"), ckpt)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """data/tiny and out-tiny/ckpt.pt trained on it, once."""
    root = tmp_path_factory.mktemp("eval")
    write_dataset(root / "data" / "tiny", tiny_text(3000, 0), tiny_text(200, 1))
    train_tiny(root / "data" / "tiny", root / "out-tiny")
    return root


@pytest.fixture
def indir(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    return workdir


@pytest.fixture(scope="module")
def result(workdir):
    """evaluate.py's result with FAST settings and the eval.json it wrote, run once."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(workdir)
        res = evaluate.main(FAST)
        return res, json.loads(Path("out-tiny/eval.json").read_text())


def one_line_error(capsys, args):
    """evaluate.py must refuse args: exit 2 and one line on stderr, through configurator.run."""
    capsys.readouterr()  # progress bars of earlier runs
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["evaluate.py", *args])
        with pytest.raises(SystemExit) as exit_:
            configurator.run(evaluate.main)
    stderr = capsys.readouterr().err
    assert exit_.value.code == 2 and stderr.startswith("error: ") and stderr.count("\n") == 1, stderr
    return stderr


TIMINGS = ("seconds",)


def without_timings(obj):
    """eval.json without what depends on the machine's speed."""
    if isinstance(obj, dict):
        return {k: without_timings(v) for k, v in obj.items() if k not in TIMINGS}
    if isinstance(obj, list):
        return [without_timings(v) for v in obj]
    return obj


# ---- definitions on hand-made inputs ----------------------------------------------------------------
def test_kl_of_a_distribution_with_itself_is_exactly_zero():
    logits = torch.randn(3, 5, 300) * torch.tensor([1.0, 30.0, 1e4])[:, None, None]
    logits[0, 0, :10] = -1e9  # probabilities that underflow to 0 must not give NaN
    kl = token_kl(logits, logits)
    assert kl.dtype == torch.float32 and torch.equal(kl, torch.zeros(3, 5))
    assert (token_kl(logits[:, :, torch.randperm(300)], logits[1:2].expand(3, 5, 300)) >= 0).all()


def test_convergence_on_hand_built_kl():
    # rows are loops 2..5; columns are four tokens
    kl = torch.tensor([[1e-1, 1e-4, 1e-1, 1e-1],
                       [1e-4, 1e-4, 1e-2, 1e-1],
                       [1e-2, 1e-5, 1e-4, 1e-1],
                       [1e-5, 0.0, 1e-5, 1e-1]])
    # last loop with KL > 1e-3: 4, none (-> 1), 3, 5 = the last loop (-> unconverged, 6)
    assert evaluate.convergence_depth(kl, first_loop=2).tolist() == [4, 1, 3, 6]
    traced = {"loss": torch.zeros(5, 1, 4), "kl": torch.cat([torch.full((1, 4), math.inf), kl])[:, None],
              "dstate": torch.ones(5, 1, 4)}
    rows = evaluate.by_loop(traced, [1, 2, 3, 4, 5], {"val_tokens": 1, "val_bytes": 1})
    assert "percent_moving" not in rows[0]  # loop 1 has nothing to compare with
    assert [row["percent_moving"] for row in rows[1:]] == [75.0, 50.0, 50.0, 25.0]


def test_default_loop_counts_and_bad_loops():
    assert evaluate.loop_counts("", 4) == [1, 2, 3, 4, 5, 6, 7, 8, 16]
    assert evaluate.loop_counts("", 8) == [*range(1, 17), 32]
    assert evaluate.loop_counts("8,2,2", 4) == [1, 2, 4, 8]  # r=1 and mean_loops always
    for bad in ("0,2", "-1", "two", "²", "1,²", "2000"):  # "²".isdigit(), not a number int() reads
        with pytest.raises(UserError) as err:
            evaluate.loop_counts(bad, 4)
        assert "--loops" in str(err.value) and "\n" not in str(err.value)


def test_paired_bootstrap_against_a_hand_run_resampling():
    rng = np.random.default_rng(0)
    a = rng.normal(3.0, 0.5, (2, 50))  # the last axis is the window
    b = a + 0.1 + rng.normal(0, 0.01, (2, 50))
    def stat(pw):
        return float(pw["b"].mean() - pw["a"].mean())
    estimate = evaluate.paired_bootstrap(stat, {"a": a, "b": b}, 300, seed=7)
    picks = np.random.default_rng(7)
    by_hand = []
    for _ in range(300):
        pick = picks.integers(0, 50, 50)
        by_hand.append(b[:, pick].mean() - a[:, pick].mean())
    assert estimate["value"] == stat({"a": a, "b": b})
    assert estimate["interval"] == pytest.approx(list(np.percentile(by_hand, [2.5, 97.5])))
    # paired: the windows' spread (sd 0.5) cancels, only the pairs' noise (sd 0.01) is left
    low, high = estimate["interval"]
    assert low < estimate["value"] < high and high - low < 0.01


def test_paired_bootstrap_without_a_value_or_mostly_undefined_has_no_interval():
    per_window = {"loss": np.arange(20.0)}
    assert evaluate.paired_bootstrap(lambda pw: None, per_window, 100, 0) == {"value": None, "interval": None}
    def defined_if_window_0_drawn(pw):  # undefined in (19/20)^20 = 36% of the resamples
        return 1.0 if (pw["loss"] == 0).any() else None
    estimate = evaluate.paired_bootstrap(defined_if_window_0_drawn, per_window, 200, 0)
    assert estimate == {"value": 1.0, "interval": None}
    # one window resamples to itself: no interval (a zero-width one would read as certainty)
    one_window = {"loss": np.array([[3.0], [2.5]])}
    estimate = evaluate.paired_bootstrap(lambda pw: pw["loss"][1, 0] - pw["loss"][0, 0], one_window, 100, 0)
    assert estimate == {"value": -0.5, "interval": None}
    assert evaluate.show(estimate) == "-0.5000"


# ---- trace against a loop written out here -----------------------------------------------------------
def kl_float64(logits_p, logits_q):
    """KL(p || q) per token, as sum p (log p - log q) in float64."""
    log_p = F.log_softmax(logits_p.double(), -1)
    log_q = F.log_softmax(logits_q.double(), -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


@torch.no_grad()
def test_trace_against_a_loop_written_out():
    torch.manual_seed(0)
    model = GPT(TINY).eval()  # untrained: its outputs still move a lot from loop to loop
    x = torch.randint(300, (2, 16))
    y = torch.randint(300, (2, 16))
    traced = evaluate.trace(model, x, y, 5, "noise", torch.Generator().manual_seed(3))
    e = model.prelude(x)
    s = torch.randn(e.shape, generator=torch.Generator().manual_seed(3)) * TINY.state_std  # as in training
    logits = None
    for i in range(5):
        s_new = model.core_step(e, s)
        new_logits = model.readout(s_new)
        loss = F.cross_entropy(new_logits.flatten(0, 1), y.flatten(), reduction="none").view(2, 16)
        change = (s_new - s).norm(dim=-1)
        torch.testing.assert_close(traced["loss"][i], loss)
        torch.testing.assert_close(traced["dstate"][i], change)
        if i > 0:  # each registered exit test's score, from loop 2 (before it: inf)
            torch.testing.assert_close(traced["state"][i], change / s_new.norm(dim=-1))
        assert torch.equal(traced["argmax"][i], new_logits.argmax(-1))
        if logits is None:
            assert torch.isinf(traced["kl"][0]).all() and torch.isinf(traced["state"][0]).all()  # nothing before
        else:
            new_given_old = kl_float64(new_logits, logits)
            old_given_new = kl_float64(logits, new_logits)
            # float32 against float64: log-probabilities of ~6 nats agree to ~1e-7 each
            torch.testing.assert_close(traced["kl"][i].double(), new_given_old, rtol=1e-3, atol=1e-6)
            assert not torch.allclose(old_given_new, new_given_old, rtol=1e-3, atol=1e-6)  # the direction shows
        s = s_new
        logits = new_logits
    assert (traced["argmax"][1:] != traced["argmax"][:-1]).any()  # a test that can tell the loops apart


def test_trace_scores_stay_float32_under_bf16_autocast(indir):
    model, _ = load_checkpoint("out-tiny/ckpt.pt")
    x = torch.randint(300, (2, 16))
    with autocast("cpu", "bfloat16"):
        out = evaluate.trace(model, x, x, 3)
    assert out["loss"].dtype == out["kl"].dtype == out["dstate"].dtype == torch.float32
    assert torch.isfinite(out["loss"]).all() and (out["kl"][1:] >= 0).all()


# ---- the script ------------------------------------------------------------------------------------
def test_eval_json_schema_and_ranges(indir, result):
    res, saved = result
    assert saved == json.loads(json.dumps(res))
    assert set(saved) == {"args", "checkpoint", "dataset", "mean_loops", "rows", "median_convergence_depth",
                          "seconds"}
    assert saved["args"]["windows"] == 6 and saved["args"]["dtype"] == "float32"
    assert saved["checkpoint"] == "test@40" and saved["dataset"] == "tiny" and saved["mean_loops"] == 4
    assert [r["loops"] for r in saved["rows"]] == [1, 2, 3, 4, 5, 6, 7, 8, 16]  # every loop to 2 x mean, 4 x mean
    meta = json.loads(Path("data/tiny/meta.json").read_text())
    for row in saved["rows"]:
        converging = {"mean_kl", "mean_state_change", "percent_moving"} if row["loops"] > 1 else set()
        assert set(row) == {"loops", "loss", "bits_per_byte", "window_losses"} | converging
        assert 0 < row["loss"] < np.log(300) + 1 and len(row["window_losses"]) == 6
        assert row["loss"] == pytest.approx(np.mean(row["window_losses"]))  # windows of equal length
        # per byte: the loss per token times the val split's tokens per UTF-8 byte, in bits
        assert row["bits_per_byte"] == pytest.approx(row["loss"] * meta["val_tokens"] / meta["val_bytes"] / np.log(2))
        if converging:
            assert row["mean_kl"] >= 0 and row["mean_state_change"] >= 0 and 0 <= row["percent_moving"] <= 100
    assert 1 <= saved["median_convergence_depth"] <= 8 + 1



def test_the_sweep_is_model_forward_at_each_loop_count(indir, result):
    """The one pass gives, at loop r, the loss model.forward (the training path) gives at r loops
    from the same noise."""
    device = result[0]["args"]["device"]  # the noise is drawn on it
    model, _ = load_checkpoint("out-tiny/ckpt.pt", device)
    wins = evaluate.load_windows("data/tiny/val.bin", "uint16", 6, 33, 1337).to(device)
    for row in result[0]["rows"]:
        generator = torch.Generator(device).manual_seed(1337)
        total = 0.0
        with torch.no_grad():
            for batch in wins.split(4):
                loss = model(batch[:, :-1], batch[:, 1:], loops=row["loops"], generator=generator)
                total += loss.item() * len(batch)
        assert row["loss"] == pytest.approx(total / len(wins), rel=1e-5)


def test_same_seed_same_numbers(indir, result):
    again = without_timings(evaluate.main(FAST))
    assert again == without_timings(result[0])
    other = without_timings(evaluate.main(FAST + ["--loops", "1,3", "--seed=7"]))
    assert [r["loops"] for r in other["rows"]] == [1, 3, 4]
    assert other["rows"][0]["loss"] != again["rows"][0]["loss"]  # other windows, other noise


def test_float32_by_default_and_bfloat16_when_asked(indir, result):
    assert evaluate.dtype == "float32"  # on every device: bf16 floors the convergence tail
    half = evaluate.main(FAST + ["--dtype=bfloat16"])
    assert half["args"]["dtype"] == "bfloat16"
    full = result[0]
    for a, b in zip(full["rows"], half["rows"]):
        assert math.isfinite(b["loss"]) and b["loss"] == pytest.approx(a["loss"], rel=0.02)
    for b in half["rows"][1:]:
        assert math.isfinite(b["mean_kl"]) and b["mean_kl"] >= 0 and b["mean_state_change"] > 0
    assert half["rows"] != full["rows"]  # the matmuls did run in bf16


@pytest.mark.parametrize("args", [
    ["--out_dir=nowhere"],  # no checkpoint
    FAST + ["--loops", "0,4"],
    FAST + ["--windows=100000"],  # more than the validation split holds
    FAST + ["--windows=0"],
    FAST + ["--no_such_key=1"],
    FAST + ["--dtype=float16"],
    FAST + ["--device=cpu:0"],
])
def test_bad_input_is_one_line_and_exit_2(indir, capsys, args):
    one_line_error(capsys, args)


def test_every_numeric_setting_at_its_edges_is_one_line_or_a_run(indir, capsys):
    numeric = [key for key, (default, _) in configurator.read_settings(vars(evaluate)).items()
               if type(default) in (int, float)]
    assert len(numeric) >= 3
    for key in numeric:
        for value in ("0", "-1", "1e999", "True"):
            try:
                evaluate.main(FAST + ["--loops=4", f"--{key}={value}"])
            except UserError as err:
                assert f"--{key}" in str(err) and "\n" not in str(err), (key, value)
            else:  # accepted: then it was used as given
                assert json.loads(Path("out-tiny/eval.json").read_text())["args"][key] == int(value)


def test_checkpoint_without_its_dataset(indir, tmp_path, monkeypatch, capsys):
    (tmp_path / "out-tiny").mkdir()
    os.link(indir / "out-tiny" / "ckpt.pt", tmp_path / "out-tiny" / "ckpt.pt")
    monkeypatch.chdir(tmp_path)  # no data/ here
    assert "data/tiny" in one_line_error(capsys, FAST)


def test_dataset_prepared_again_with_another_tokenizer_is_refused(indir, tmp_path, monkeypatch, capsys):
    """Issue 12: the checkpoint's dataset name now holds other token ids (another BPE): refused, naming both."""
    trained_with = json.loads(Path("data/tiny/meta.json").read_text())["tokenizer_sha256"]
    other_text = tiny_text(500, 2).upper()  # other merges, other ids
    now = write_dataset(tmp_path / "data" / "tiny", other_text, tiny_text(100, 3))["tokenizer_sha256"]
    assert now != trained_with
    shutil.copytree(indir / "out-tiny", tmp_path / "out-tiny", ignore=shutil.ignore_patterns("*.json"))
    monkeypatch.chdir(tmp_path)
    err = one_line_error(capsys, FAST)
    assert trained_with in err and now in err


def test_dataset_prepared_again_with_the_same_tokenizer_and_another_split_is_refused(indir, tmp_path, monkeypatch,
                                                                                     capsys):
    """The same tokenizer.json, but val cut elsewhere (as --val_fraction=0.5 would): the old checkpoint's losses
    would be on text it trained on. Refused in one line, naming what changed, before any work."""
    shutil.copytree(indir / "data", tmp_path / "data")
    shutil.copytree(indir / "out-tiny", tmp_path / "out-tiny", ignore=shutil.ignore_patterns("*.json"))
    monkeypatch.chdir(tmp_path)
    meta = json.loads(Path("data/tiny/meta.json").read_text())
    train_ids = np.fromfile("data/tiny/train.bin", dtype=np.uint16)
    val_ids = np.fromfile("data/tiny/val.bin", dtype=np.uint16)
    moved = len(train_ids) // 2  # half the training text is val now
    np.concatenate([train_ids[moved:], val_ids]).tofile("data/tiny/val.bin")
    train_ids[:moved].tofile("data/tiny/train.bin")
    meta |= {"train_tokens": moved, "val_tokens": len(train_ids) - moved + len(val_ids),
             "val_sha256": hashlib.sha256(Path("data/tiny/val.bin").read_bytes()).hexdigest()}
    Path("data/tiny/meta.json").write_text(json.dumps(meta))
    monkeypatch.setattr(evaluate, "trace_windows", lambda *a, **k: pytest.fail("computed before the check"))
    err = one_line_error(capsys, FAST)
    assert "is not the dataset out-tiny/ckpt.pt was trained on" in err and "val_tokens" in err
    assert not Path("out-tiny/eval.json").exists()


@pytest.mark.parametrize("change", ["reordered", "cut"])
def test_a_checkpoint_refuses_a_val_split_its_meta_json_no_longer_describes(indir, tmp_path, monkeypatch, capsys,
                                                                             change):
    """meta.json byte for byte the same, the data not: val's lines in another order (the same size), or val
    cut to half its length. Either would move every loss, silently."""
    shutil.copytree(indir / "data", tmp_path / "data")
    shutil.copytree(indir / "out-tiny", tmp_path / "out-tiny", ignore=shutil.ignore_patterns("*.json"))
    monkeypatch.chdir(tmp_path)
    val = np.fromfile("data/tiny/val.bin", dtype=np.uint16)
    changed = val[::-1] if change == "reordered" else val[:len(val) // 2]
    changed.tofile("data/tiny/val.bin")
    err = one_line_error(capsys, FAST)
    assert ("val.bin changed since prepare.py" if change == "reordered" else "not the size meta.json says") in err


def test_a_device_this_machine_lacks_is_one_line(indir, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert "--device must be one of cpu" in one_line_error(capsys, FAST + ["--device=cuda"])


def test_unwritable_out_dir_fails_before_the_work(indir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    out.mkdir()
    os.link(indir / "out-tiny" / "ckpt.pt", out / "ckpt.pt")
    monkeypatch.setattr(evaluate, "trace_windows", lambda *a: pytest.fail("computed before the check"))
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # a read-only directory, even for root
    assert "is not writable" in one_line_error(capsys, FAST + [f"--out_dir={out}"])


def test_ctrl_c_is_one_line(indir, monkeypatch, capsys):
    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(evaluate, "trace_windows", interrupted)
    monkeypatch.setattr(sys, "argv", ["evaluate.py"] + FAST)
    with pytest.raises(SystemExit) as e:
        configurator.run(evaluate.main)
    assert e.value.code == 130 and capsys.readouterr().err.endswith("interrupted\n")


def test_help_lists_every_setting_and_exits_0():
    out = subprocess.run([sys.executable, "evaluate.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                         env=script_env())
    assert out.returncode == 0 and out.stderr == ""
    for key in configurator.read_settings(vars(evaluate)):
        assert f"--{key}=" in out.stdout
    assert "validation windows of block_size + 1 tokens" in out.stdout  # each setting's comment


@pytest.mark.cuda
def test_on_cuda_evaluate_gives_the_cpus_losses(indir, result, tmp_path, monkeypatch):
    """evaluate.py with its defaults on a GPU machine (cuda, float32), on the tiny checkpoint: the losses the
    CPU gave at each depth, up to the GPU's own noise draws and kernels."""
    out = tmp_path / "out"
    out.mkdir()
    os.link(indir / "out-tiny" / "ckpt.pt", out / "ckpt.pt")  # its own eval.json, not the module's
    on_the_gpu = evaluate.main(FAST + [f"--out_dir={out}"])
    assert (on_the_gpu["args"]["device"], on_the_gpu["args"]["dtype"]) == ("cuda", "float32")
    on_the_cpu = result[0]
    assert [row["loops"] for row in on_the_gpu["rows"]] == [row["loops"] for row in on_the_cpu["rows"]]
    for cpu_row, gpu_row in zip(on_the_cpu["rows"], on_the_gpu["rows"]):
        assert gpu_row["loss"] == pytest.approx(cpu_row["loss"], rel=0.02)
    assert json.loads((out / "eval.json").read_text())["args"]["device"] == "cuda"
