"""Tests for evaluate.py on a tiny model trained in-process on a tiny BPE dataset (tmp dirs only)."""
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

ROOT = Path(__file__).resolve().parents[1]
import evaluate  # noqa: E402
import prepare  # noqa: E402
import train  # noqa: E402
from model import autocast, load_checkpoint, token_kl  # noqa: E402

TINY = ["--dataset=tiny", "--out_dir=out-tiny", "--max_iters=30", "--n_embd=32", "--n_head=2", "--n_kv_head=1",
        "--ffn_hidden=64", "--n_core=2", "--mean_loops=4", "--max_loops=16", "--bptt_k=4", "--block_size=32",
        "--batch_size=8", "--eval_interval=30", "--eval_iters=2", "--compile=False", "--peak_flops=1e9", "--log_interval=100"]
FAST = ["--out_dir=out-tiny", "--windows=6", "--batch_size=4", "--timing_windows=1"]
TIMINGS = ("tokens_per_s", "relative_throughput", "seconds")


def tiny_text(n_lines, seed):
    """Words, numerals, punctuation and whitespace, so every token class occurs."""
    rng = random.Random(seed)
    words = ["the", "king", "queen", "shall", "speak", "of", "love", "and", "war", "my", "lord", "good"]
    lines = []
    for _ in range(n_lines):
        line = " ".join(rng.choice(words) for _ in range(rng.randint(3, 9)))
        line += rng.choice([".", ",", "!", "?", ";", " -- " + str(rng.randint(1, 999)) + "."])
        lines.append(line.capitalize() + ("\n\n" if rng.random() < 0.2 else "\n"))
    return "".join(lines)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """data/tiny (a BPE dataset like prepare.py writes) and out-tiny/ckpt.pt trained on it, once."""
    root = tmp_path_factory.mktemp("eval")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        train_text, val_text = tiny_text(3000, 0), tiny_text(200, 1)
        tok = prepare.train_bpe(300, [train_text])
        Path("data/tiny").mkdir(parents=True)
        tok.save("data/tiny/tokenizer.json")
        sizes = {}
        for split, text in (("train", train_text), ("val", val_text)):
            ids = np.array(tok.encode(text).ids + [0], dtype=np.uint16)
            ids.tofile(f"data/tiny/{split}.bin")
            sizes[f"{split}_tokens"] = len(ids)
            sizes[f"{split}_bytes"] = len(text.encode("utf-8"))  # the byte count, known by construction
        meta = dict(source="test", tokenizer="bpe:300", vocab_size=300, eot_id=0, dtype="uint16", **sizes)
        Path("data/tiny/meta.json").write_text(json.dumps(meta))
        train.main(TINY)
    return root


@pytest.fixture
def indir(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    return workdir


def without_timings(obj):
    if isinstance(obj, dict):
        return {k: without_timings(v) for k, v in obj.items() if k not in TIMINGS}
    if isinstance(obj, list):
        return [without_timings(v) for v in obj]
    return obj


def test_token_classes_on_hand_picked_tokens():
    expected = {" ": "space", "\n\n": "space", "\t ": "space", "12": "numeral", " 1999": "numeral",
                "3rd": "numeral", ",": "punctuation", " (": "punctuation", "...": "punctuation",
                "$": "punctuation", "!?\n": "punctuation", " the": "word", "King": "word", "'s": "word",
                "é": "word", "\ufffd": "word", "": "word"}
    assert {text: evaluate.token_class(text) for text in expected} == expected


def test_kl_of_a_distribution_with_itself_is_exactly_zero():
    logits = torch.randn(3, 5, 300) * torch.tensor([1.0, 30.0, 1e4])[:, None, None]
    logits[0, 0, :10] = -1e9  # probabilities that underflow to 0 must not give NaN
    kl = token_kl(logits, logits)
    assert kl.dtype == torch.float32 and torch.equal(kl, torch.zeros(3, 5))
    assert (token_kl(logits[:, :, torch.randperm(300)], logits[1:2].expand(3, 5, 300)) >= 0).all()


def test_convergence_and_exit_depth_on_hand_built_kl():
    # rows are loops 2..5 (diag_loops = 5); columns are four tokens
    kl = torch.tensor([[1e-1, 1e-4, 1e-1, 1e-1],
                       [1e-4, 1e-4, 1e-2, 1e-1],
                       [1e-2, 1e-5, 1e-4, 1e-1],
                       [1e-5, 0.0, 1e-5, 1e-1]])
    # last loop with KL > 1e-3: 4, none (-> 1), 3, 5 = the last loop (-> unconverged, 6)
    assert evaluate.convergence_depth(kl).tolist() == [4, 1, 3, 6]
    # first loop >= 2 with KL < 1e-3, else the last loop (5)
    assert evaluate.exit_depth(kl, 1e-3).tolist() == [3, 2, 4, 5]
    assert evaluate.exit_depth(kl, 1e-9).tolist() == [5, 5, 5, 5]


def test_default_loop_counts_and_bad_loops():
    assert evaluate.loop_counts("", 4) == [1, 2, 4, 8, 16]
    assert evaluate.loop_counts("", 8) == [1, 2, 4, 8, 16, 32]
    assert evaluate.loop_counts("8,1,2,2", 4) == [1, 2, 4, 8]  # mean_loops is the throughput reference
    for bad in ("0,2", "-1", "two", "²", "1,²"):  # "²".isdigit(), not a number int() reads
        with pytest.raises(SystemExit) as e:
            evaluate.loop_counts(bad, 4)
        assert e.value.code == 2


def test_eval_json_schema_ranges_and_figures(indir, tmp_path, capsys):
    control = tmp_path / "control"  # a fixed-depth control's eval.json, as study.sh compares
    control.mkdir()
    curve = [{"loops": r, "loss": 9.0 + r} for r in (1, 4, 32)]
    (control / "eval.json").write_text(json.dumps({"elasticity": curve}))
    res = evaluate.main(FAST + ["--plot", f"--versus={control}"])
    out = capsys.readouterr().out
    # the tables name their columns as eval.json does
    assert "| loops | loss | loss_per_byte | bits_per_byte | ppl | tokens_per_s | relative_throughput |" in out
    assert "| loop | mean_kl | mean_state_change | percent_moving | loss |" in out and "noise init" in out
    saved = json.loads(Path("out-tiny/eval.json").read_text())
    assert saved == json.loads(json.dumps(res))
    assert set(saved) == {"args", "checkpoint", "block_size", "elasticity", "convergence",
                          "token_classes", "seconds"}
    assert saved["args"]["windows"] == 6 and saved["args"]["plot"] is True
    assert saved["checkpoint"]["id"].endswith("@30") and saved["checkpoint"]["mean_loops"] == 4
    assert [r["loops"] for r in saved["elasticity"]] == [1, 2, 4, 8, 16]
    meta = json.loads(Path("data/tiny/meta.json").read_text())
    for row in saved["elasticity"]:
        assert set(row) == {"loops", "loss", "loss_per_byte", "bits_per_byte", "ppl", "tokens_per_s",
                            "relative_throughput", "control_loss"}
        assert 0 < row["loss"] < np.log(300) + 1 and row["ppl"] == pytest.approx(np.exp(row["loss"]))
        # per byte: the loss per token times the val split's tokens per UTF-8 byte
        assert row["loss_per_byte"] == pytest.approx(row["loss"] * meta["val_tokens"] / meta["val_bytes"])
        assert row["bits_per_byte"] == pytest.approx(row["loss_per_byte"] / np.log(2))
        assert row["tokens_per_s"] > 0
    assert next(r for r in saved["elasticity"] if r["loops"] == 4)["relative_throughput"] == 1.0

    cv, n_loops = saved["convergence"], 8  # diag_loops defaults to 2 x mean_loops (4)
    assert cv["init"] == "noise" and cv["diag_loops"] == n_loops
    assert [r["loop"] for r in cv["rows"]] == list(range(2, n_loops + 1))
    for row in cv["rows"]:
        assert set(row) == {"loop", "mean_kl", "mean_state_change", "percent_moving", "loss"}
        assert row["mean_kl"] >= 0 and row["mean_state_change"] >= 0 and 0 <= row["percent_moving"] <= 100
    assert 1 <= cv["median_depth"] <= n_loops + 1
    assert 0 <= cv["percent_moving_at_mean"] <= 100 and 0 <= cv["percent_unconverged"] <= 100
    assert cv["percent_moving_at_mean"] == cv["rows"][4 - 2]["percent_moving"]

    tc = saved["token_classes"]
    assert [r["class"] for r in tc["rows"]] == list(evaluate.CLASSES)
    assert sum(r["count"] for r in tc["rows"]) == 6 * 32  # every target token, once
    assert all(r["count"] > 0 and 2 <= r["mean_exit_depth"] <= n_loops for r in tc["rows"])
    for name in ("eval_loss_vs_loops", "eval_convergence", "eval_token_classes"):
        assert Path(f"out-tiny/{name}.png").read_bytes()[:4] == b"\x89PNG"
    # the control's loss beside this one's at each loop count, nan where it has none
    assert [r["control_loss"] for r in saved["elasticity"]] == [10.0, None, 13.0, None, None]
    assert out.count(" | 13.0000 |\n") == 1 and out.count(" | nan |\n") == 3


def test_diagnostic_pass_reproduces_the_training_path_loss(indir):
    # same noise seed: the loop-by-loop API at loop r must give model.forward's loss at r
    res = evaluate.main(FAST + ["--diag_loops=16"])
    per_loop = {r["loop"]: r["loss"] for r in res["convergence"]["rows"]}
    for row in res["elasticity"]:
        if row["loops"] >= 2:
            assert per_loop[row["loops"]] == pytest.approx(row["loss"], rel=1e-5)
    zero = evaluate.main(FAST + ["--diag_loops=16", "--diag_init=zero"])["convergence"]
    assert zero["init"] == "zero" and zero["rows"] != res["convergence"]["rows"]


def test_same_seed_same_numbers(indir):
    first = without_timings(evaluate.main(FAST + ["--loops", "1,3"]))
    second = without_timings(evaluate.main(FAST + ["--loops", "1,3"]))
    assert first == second and [r["loops"] for r in first["elasticity"]] == [1, 3, 4]
    other = without_timings(evaluate.main(FAST + ["--loops", "1,3", "--seed=7"]))
    assert other["elasticity"] != first["elasticity"]  # other windows, other noise


@pytest.mark.parametrize("args", [
    ["--out_dir=nowhere"],  # missing checkpoint
    FAST + ["--loops", "0,4"],
    FAST + ["--windows=100000"],  # more than the validation split holds
    FAST + ["--windows=0"],
    FAST + ["--diag_loops=1"],
    FAST + ["--diag_init=ones"],
    FAST + ["--no_such_key=1"],
    FAST + ["--dtype=float16"],
    FAST + ["--versus=nowhere"],  # no eval.json there: refused before the work
])
def test_bad_input_exits_with_one_line(indir, capsys, args):
    with pytest.raises(SystemExit) as e:
        evaluate.main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err


def test_a_control_with_a_non_number_loss_is_one_line(indir, tmp_path, capsys):
    (tmp_path / "eval.json").write_text(json.dumps({"elasticity": [{"loops": 1, "loss": "low"}]}))
    with pytest.raises(SystemExit) as e:  # refused before the work, not a traceback in the table
        evaluate.main(FAST + [f"--versus={tmp_path}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: --versus") and err.count("\n") == 1


def test_checkpoint_without_its_dataset(indir, tmp_path, monkeypatch, capsys):
    shutil.copytree(indir / "out-tiny", tmp_path / "out-tiny", ignore=shutil.ignore_patterns("*.png", "*.json"))
    monkeypatch.chdir(tmp_path)  # no data/ here
    with pytest.raises(SystemExit) as e:
        evaluate.main(FAST)
    assert e.value.code == 2 and "data/tiny" in capsys.readouterr().err


@pytest.mark.parametrize("package, flag", [("matplotlib", "--plot")])
def test_missing_optional_package_fails_before_the_work(indir, monkeypatch, capsys, package, flag):
    monkeypatch.setitem(sys.modules, package, None)  # makes `import package` fail
    monkeypatch.setattr(evaluate, "elasticity", lambda *a: pytest.fail("computed before the check"))
    with pytest.raises(SystemExit) as e:
        evaluate.main(FAST + [flag])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and f"pip install {package}" in err


# ----------------------------------------------------------------------------- issue 12

def test_dataset_prepared_again_with_another_tokenizer_is_refused(tmp_path, monkeypatch, capsys):
    """The issue's reproduction: train, prepare the same name with another tokenizer, evaluate or resume."""
    monkeypatch.chdir(tmp_path)
    Path("corpus.txt").write_text(tiny_text(400, 0))
    prepare.main(["corpus.txt", "--tokenizer", "bpe:300"])
    train.main(TINY + ["--dataset=corpus", "--max_iters=2", "--eval_interval=2", "--block_size=16"])
    first = json.loads(Path("data/corpus/meta.json").read_text())["tokenizer_sha256"]
    prepare.main(["corpus.txt", "--tokenizer", "bpe:300", "--val_fraction=0.5"])  # other text, another BPE
    second = json.loads(Path("data/corpus/meta.json").read_text())["tokenizer_sha256"]
    assert first != second
    capsys.readouterr()
    for run in (lambda: evaluate.main(FAST), lambda: train.main(TINY + ["--dataset=corpus", "--init_from=resume", "--block_size=16"])):
        with pytest.raises(SystemExit) as e:
            run()
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and first in err and second in err


@pytest.mark.parametrize("case, message", [("cuda", "CUDA GPU"), ("empty", "(0 bytes) is not a readable checkpoint"),
                                           ("nan", "has non-finite weights")])
def test_bad_device_or_checkpoint_is_one_line(indir, tmp_path, capsys, case, message):
    if case == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "out"
    out.mkdir()
    if case == "empty":
        (out / "ckpt.pt").write_bytes(b"")
    else:
        ckpt = torch.load("out-tiny/ckpt.pt", weights_only=True)
        if case == "nan":  # what an older train.py saved after its val loss went NaN
            ckpt["model"]["core.adapter.weight"].fill_(float("nan"))
        torch.save(ckpt, out / "ckpt.pt")
    with pytest.raises(SystemExit) as e:
        evaluate.main(FAST + [f"--out_dir={out}"] + (["--device=cuda"] if case == "cuda" else []))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and message in err and "checkpoint" not in err * (case == "cuda")


def test_ctrl_c_is_one_line(indir, monkeypatch, capsys):
    import configurator
    monkeypatch.setattr(evaluate, "sweep_point", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    monkeypatch.setattr(sys, "argv", ["evaluate.py"] + FAST)
    with pytest.raises(SystemExit) as e:
        configurator.run(evaluate.main)
    assert e.value.code == 130 and capsys.readouterr().err.endswith("interrupted\n")


# ----------------------------------------------------------------------------- issues 16, 17, 18

def test_help_lists_every_setting_and_exits_0():
    out = subprocess.run([sys.executable, "evaluate.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0 and out.stderr == ""
    for key in evaluate.RULES:
        assert f"--{key}=" in out.stdout
    assert "fixed-depth control" in out.stdout  # each setting's comment


def test_bfloat16_gives_finite_numbers_close_to_float32(indir):
    full = evaluate.main(FAST + ["--loops=4"])
    half = evaluate.main(FAST + ["--loops=4", "--dtype=bfloat16"])
    assert half["args"]["dtype"] == "bfloat16"
    for a, b in zip(full["elasticity"], half["elasticity"]):
        assert math.isfinite(b["loss"]) and b["loss"] == pytest.approx(a["loss"], rel=0.02)
    for a, b in zip(full["convergence"]["rows"], half["convergence"]["rows"]):
        assert math.isfinite(b["mean_kl"]) and b["mean_kl"] >= 0 and b["mean_state_change"] > 0
        assert b["loss"] == pytest.approx(a["loss"], rel=0.02)
    assert 2 <= half["token_classes"]["mean_exit_depth"] <= 8
    assert half["convergence"]["rows"] != full["convergence"]["rows"]  # the matmuls did run in bf16


def test_trace_states_stay_float32_under_bf16_autocast(indir):
    model, _ = load_checkpoint("out-tiny/ckpt.pt")
    x = torch.randint(300, (2, 16))
    with autocast("cpu", "bfloat16"):
        out = evaluate.trace(model, x, x, 3, keep_states=True)
    assert out["state"].dtype == torch.float32 and out["state"].shape == (3, 2, 16, 32)
    assert out["loss"].dtype == out["kl"].dtype == torch.float32
    assert torch.isfinite(out["loss"]).all() and (out["kl"][1:] >= 0).all()


def test_unwritable_out_dir_fails_before_the_work(indir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    shutil.copytree(indir / "out-tiny", out, ignore=shutil.ignore_patterns("*.png", "*.json"))
    (out / "eval.json").mkdir()  # the result could never be renamed into place
    monkeypatch.setattr(evaluate, "elasticity", lambda *a: pytest.fail("computed before the check"))
    with pytest.raises(SystemExit) as e:
        evaluate.main(FAST + [f"--out_dir={out}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "cannot write" in err
    (out / "eval.json").rmdir()
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # a read-only directory, even for root
    with pytest.raises(SystemExit) as e:
        evaluate.main(FAST + [f"--out_dir={out}"])
    assert e.value.code == 2 and "cannot write" in capsys.readouterr().err


NUMERIC = [key for key, rule in evaluate.RULES.items() if isinstance(rule, tuple) and not isinstance(rule[0], str)]


@pytest.mark.parametrize("key", NUMERIC)
def test_every_numeric_setting_at_its_edges_is_one_line_or_a_run(indir, capsys, key):
    assert len(NUMERIC) >= 6
    for value in ("0", "-1", "1e999", "True"):
        capsys.readouterr()  # a run before this one wrote progress bars to stderr
        try:
            evaluate.main(FAST + ["--loops=4", f"--{key}={value}"])
        except SystemExit as e:
            err = capsys.readouterr().err
            assert e.code == 2 and err.startswith("error: ") and err.count("\n") == 1, (key, value, err)
        else:
            assert json.loads(Path("out-tiny/eval.json").read_text())["args"][key] == int(value)
