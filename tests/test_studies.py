"""Tests for the studies built on the core (studies/): the saturation depth, the speed at each depth, the exit
depth by token class. On a tiny model trained here (test_evaluate.py's), and on hand-made curves and traces."""
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import allocate
import configurator
import evaluate
import model as model_lib
from evaluate import load_windows
from model import GPT, GPTConfig, checkpoint_id, load_checkpoint
from prepare import load_tokenizer
from studies import laptop, matched, probe, saturation, saturation_table, timing
from studies import token_classes as studies_token_classes
from conftest import stderr_of_a_refusal
from test_allocate import train_tiny

FAST = ["--out_dir=out", "--windows=6", "--batch_size=4"]
ALLOCATE_FAST = ["--out_dir=out", "--windows=6", "--train_windows=2", "--batch_size=4", "--n_grid=12",
                 "--bootstrap=50"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """data/tiny (bytes of English text) and out/ckpt.pt trained on it by train.py (mean_loops 3, max_loops 8)."""
    root = tmp_path_factory.mktemp("studies")
    train_tiny(root, 60, ["--n_core=2", "--mean_loops=3", "--max_loops=8", "--bptt_k=4"])
    return root


@pytest.fixture
def indir(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    return workdir


def one_line_error(capsys, main, argv):
    """main must refuse argv: exit 2 and one line on stderr, through configurator.run."""
    stderr = stderr_of_a_refusal(capsys, main, argv)
    assert stderr.startswith("error: ") and stderr.count("\n") == 1, stderr
    return stderr


# ---- the saturation depth ------------------------------------------------------------------------------
def test_saturation_on_hand_made_curves():
    """Four windows whose mean losses per swept depth are set by hand (each window's: the mean plus an offset
    that cancels over the windows, so resamples move the curve)."""
    swept, mean = [1, 2, 3, 4, 6, 8, 12, 16, 32], 4
    curve = [4.0, 3.5, 3.3, 3.2004, 3.2, 3.199, 3.1985, 3.25, 3.0]  # r=32 is past 4 x mean: never the best
    offsets = np.tile([-0.01, 0.01, -0.02, 0.02], 3)  # twelve windows: enough for an interval
    losses = np.array(curve)[:, None] + offsets  # (depths, windows)
    at = {r: i for i, r in enumerate(swept)}
    result = saturation.saturation(losses, swept, mean)
    # the best up to r=16 is r=12's 3.1985: r=4 (3.2004) is the first within 0.002 of it
    assert result["depth"]["value"] == 4 and result["depth"]["interval"] == [4.0, 4.0]
    assert result["useful_range"]["value"] == pytest.approx(4.0 - 3.2004, abs=1e-6)
    losses[at[4]] += 0.0011  # r=4 now 0.003 above the best: r=6 (0.0015) is the first within it
    assert saturation.saturation(losses, swept, mean)["depth"]["value"] == 6
    losses[at[4]] -= 0.0012  # r=4 0.0018 above the best on average, but window by window 0.0048 above or 0.0012
    losses[at[4]] += np.tile([0.003, -0.003, 0.003, -0.003], 3)  # below: resamples put it on either side
    result = saturation.saturation(losses, swept, mean)
    assert result["depth"]["value"] == 4 and result["depth"]["interval"] == [4.0, 6.0]
    losses[at[16]] -= 0.1  # r=16 = 4 x mean is the best now, far ahead of the others
    assert saturation.saturation(losses, swept, mean)["depth"]["value"] == 16


def test_saturation_of_a_checkpoint_from_its_eval_json(indir, capsys):
    evaluated = evaluate.main(FAST + ["--windows=10"])  # the fewest that give an interval
    capsys.readouterr()
    result = saturation.main(["--out_dir=out"])
    assert json.loads((indir / "out" / "saturation.json").read_text()) == json.loads(json.dumps(result))
    losses = {row["loops"]: row["loss"] for row in evaluated["rows"]}  # every loop to 6, and 12 = 4 x 3
    depth = result["depth"]["value"]
    assert depth in losses and 1 <= min(result["depth"]["interval"])
    assert losses[depth] <= min(losses.values()) + saturation.SATURATION_TOL
    assert result["useful_range"]["value"] == pytest.approx(losses[1] - losses[depth])
    assert result["checkpoint"].endswith("@60") and result["swept"] == [1, 2, 3, 4, 5, 6, 12]
    assert capsys.readouterr().out.startswith(f"saturation depth {depth:g} [")


def test_fewer_windows_than_an_interval_needs_give_none(indir, capsys):
    evaluate.main(FAST + ["--windows=2"])
    capsys.readouterr()
    result = saturation.main(["--out_dir=out"])
    assert result["depth"]["interval"] is None and "[" not in capsys.readouterr().out


def test_saturation_without_an_eval_json_is_one_line(indir, tmp_path, capsys):
    assert "run `python evaluate.py" in one_line_error(capsys, saturation.main, [f"--out_dir={tmp_path}"])


# ---- tokens/s at batch 1 ------------------------------------------------------------------------------------
def test_timing_at_each_depth(indir, capsys):
    result = timing.main(["--out_dir=out", "--loops=1,8", "--timing_windows=2"])
    assert [row["loops"] for row in result["rows"]] == [1, 3, 8]  # 1 and mean_loops always
    assert all(row["tokens_per_s"] > 0 for row in result["rows"])
    assert json.loads((indir / "out" / "timing.json").read_text())["checkpoint"].endswith("@60")
    assert "| loops | tokens_per_s |" in capsys.readouterr().out


# ---- the exit depth by token class --------------------------------------------------------------------
def test_token_classes_on_hand_picked_tokens():
    expected = {" ": "space", "\n\n": "space", "\t ": "space", "12": "numeral", " 1999": "numeral",
                "3rd": "numeral", ",": "punctuation", " (": "punctuation", "...": "punctuation",
                "$": "punctuation", "!?\n": "punctuation", " the": "word", "King": "word", "'s": "word",
                "\xe9": "word", "\ufffd": "word", "": "word"}
    assert {text: studies_token_classes.token_class(text) for text in expected} == expected


def test_token_classes_at_the_operating_threshold_by_input_token():
    """A1's exits at the largest threshold whose loss reaches the bar, each counted for the token at its
    position; hand-made: 4 loops, one window of 5 tokens."""
    inf = float("inf")
    kl = torch.tensor([[inf] * 5,
                       [0.05, 0.5, 0.5, 0.005, 0.5],   # loop 2
                       [0.5, 0.05, 0.5, 0.5, 0.5],     # loop 3
                       [0.5, 0.5, 0.05, 0.5, 0.5]])[:, None]  # loop 4 (r_max: the last token's forced exit)
    grids = {"kl": [0.01, 0.1, 1.0]}
    per_window = {("kl", "loss"): np.array([[3.0], [3.1], [3.5]])}  # the threshold's mean loss
    names = {0: " ", 1: "7", 2: ",", 3: "cat", 4: "dog"}
    inputs = torch.tensor([[4, 0, 3, 1, 2]])  # dog, space, cat, 7, comma

    def decode(ids):
        return "".join(names[i] for i in ids)
    threshold = allocate.operating_threshold(per_window, "kl", grids["kl"], 3.2)
    assert threshold == 0.1  # 0.1 and 0.01 reach 3.2: the largest
    res = studies_token_classes.token_classes({"kl": kl}, threshold, inputs, decode)
    assert res["threshold"] == 0.1
    # at 0.1 the tokens stop after loops 2, 3, 4, 2, 4 (the last never below: r_max)
    depth = {row["class"]: row.get("mean_exit_depth") for row in res["rows"]}
    count = {row["class"]: row["count"] for row in res["rows"]}
    assert depth == {"space": 3.0, "numeral": 2.0, "punctuation": 4.0, "word": (2 + 4) / 2, "all": 15 / 5}
    assert count == {"space": 1, "numeral": 1, "punctuation": 1, "word": 2, "all": 5}
    assert allocate.operating_threshold(per_window, "kl", grids["kl"], 2.0) == 0.01  # none reaches: the smallest
    res = studies_token_classes.token_classes({"kl": kl}, threshold, torch.tensor([[3, 3, 3, 4, 4]]), decode)
    assert [row["count"] for row in res["rows"]] == [0, 0, 0, 5, 5] and "mean_exit_depth" not in res["rows"][0]



def test_token_classes_of_a_checkpoint_at_allocates_operating_threshold(indir, capsys):
    allocated = allocate.main(ALLOCATE_FAST)
    result = studies_token_classes.main(["--out_dir=out", "--batch_size=4"])
    assert result["threshold"] == allocated["operating_thresholds"]["kl"]
    assert json.loads((indir / "out" / "token_classes.json").read_text()) == json.loads(json.dumps(result))
    assert [row["class"] for row in result["rows"]] == [*studies_token_classes.CLASSES, "all"]
    _, decode = load_tokenizer("data/tiny")
    wins = load_windows("data/tiny/val.bin", "uint16", 6, 33, 1337)  # allocate.py's windows
    by_input = [studies_token_classes.token_class(decode([i])) for i in wins[:, :-1].flatten().tolist()]
    assert len(set(by_input)) >= 3
    counts = [by_input.count(name) for name in studies_token_classes.CLASSES] + [6 * 32]
    assert [row["count"] for row in result["rows"]] == counts
    # each class's mean exit depth, from a trace of the same windows and A1's rule written out here
    model, _ = load_checkpoint("out/ckpt.pt")
    kl = evaluate.trace_windows(model, wins, allocated["r_max"], 4, ("kl",))["kl"][1:]  # loops 2..r_max
    below = kl < result["threshold"]
    depth = torch.where(below.any(0), below.int().argmax(0) + 2, allocated["r_max"]).flatten().tolist()
    for row in result["rows"][:-1]:
        picked = [d for d, name in zip(depth, by_input) if name == row["class"]]
        assert row.get("mean_exit_depth") == (pytest.approx(np.mean(picked)) if picked else None)


def test_token_classes_refuse_an_allocate_json_of_another_checkpoint(indir, capsys):
    allocate.main(ALLOCATE_FAST)
    path = indir / "out" / "allocate.json"
    allocated = json.loads(path.read_text())
    path.write_text(json.dumps(allocated | {"checkpoint": "another@1"}))
    assert "not of ckpt.pt" in one_line_error(capsys, studies_token_classes.main, ["--out_dir=out"])


# ---- the saturation study's table (studies/saturation_table.py) ------------------------------------------
def test_training_flops_count_the_depth_drawn_for_each_step():
    settings = {"batch_size": 2, "block_size": 32, "gradient_accumulation_steps": 3, "seed": 1, "mean_loops": 4,
                "max_loops": 16, "loop_dist": "fixed", "loop_spread": 1.0, "bptt_k": 2}
    model_args = {"vocab_size": 64, "n_embd": 32, "n_head": 2, "n_kv_head": 1, "ffn_hidden": 64, "block_size": 32,
                  "n_prelude": 1, "n_core": 1, "n_coda": 1, "mean_loops": 4, "max_loops": 16, "bptt_k": 2}
    ckpt = {"config": settings, "model_args": model_args, "iter_num": 10}
    model = GPT(GPTConfig(**model_args, loop_dist="fixed", loop_spread=1.0))
    tokens = 10 * 2 * 32 * 3  # steps x a step's tokens
    assert saturation_table.training_flops(model, ckpt) == tokens * model.flops_per_token(4, 2, 32)
    # drawn from a LogNormal (spread 1: depths from 1 to 16), the steps' FLOPs lie between the extremes'
    model.config.loop_dist = "lognormal"
    per_token = saturation_table.training_flops(model, ckpt) / tokens
    assert model.flops_per_token(1, 1, 32) < per_token < model.flops_per_token(16, 2, 32)
    assert per_token != model.flops_per_token(4, 2, 32)


def measured_copy(name, windows):
    """name/ckpt.pt: out's checkpoint, evaluated on `windows` windows, with its saturation.json."""
    Path(name).mkdir(exist_ok=True)
    shutil.copy("out/ckpt.pt", f"{name}/ckpt.pt")
    evaluate.main([f"--out_dir={name}", f"--windows={windows}", "--batch_size=4"])
    saturation.main([f"--out_dir={name}"])


def test_saturation_table_of_two_runs(indir, capsys):
    measured_copy("out-a", 6)
    measured_copy("out-b", 3)
    capsys.readouterr()
    rows = saturation_table.main(["--runs=out-a,out-b", f"--figure={indir / 'saturation.png'}"])
    out = capsys.readouterr().out
    assert out.startswith("| " + " | ".join(saturation_table.HEADERS) + " |")
    assert [row[0] for row in rows] == ["out-a", "out-b"] and out.count("\n| out-") == 2
    model, ckpt = load_checkpoint("out-a/ckpt.pt")
    for row in rows:
        evaluated = json.loads(Path(row[0], "eval.json").read_text())
        saturated = json.loads(Path(row[0], "saturation.json").read_text())
        loss_at = {r["loops"]: r["loss"] for r in evaluated["rows"]}
        assert row[1:5] == [3, 0.5, 1337, 60]  # train_tiny's mean, spread, seed and steps
        assert row[5] == f"{saturation_table.training_flops(model, ckpt) / 1e15:.3f}"
        assert row[6] == evaluate.show(saturated["depth"], "g")
        assert row[8] == f"{loss_at[saturated['depth']['value']]:.4f}" and row[9] == f"{min(loss_at.values()):.4f}"
        assert row[10] == f"{evaluated['median_convergence_depth']:g}"
    if importlib.util.find_spec("matplotlib") is not None:  # the figure, where matplotlib is installed
        assert (indir / "saturation.png").read_bytes().startswith(b"\x89PNG")


def test_saturation_table_without_matplotlib_prints_the_table_and_one_line(indir, capsys, monkeypatch):
    measured_copy("out-a", 6)
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    figure = indir / "no-matplotlib.png"
    saturation_table.main(["--runs=out-a", f"--figure={figure}"])
    captured = capsys.readouterr()
    assert "| out-a |" in captured.out and not figure.exists()
    assert captured.err.count("\n") == 1 and "pip install -r studies/requirements.txt" in captured.err


def test_saturation_table_refuses_a_saturation_json_of_an_earlier_eval_json(indir, capsys):
    """evaluate.py run again after studies.saturation (other windows, other depths): the saturation depth
    is not this eval.json's, refused in one line rather than combined (or a KeyError on a depth gone)."""
    measured_copy("out-a", 6)
    evaluate.main(["--out_dir=out-a", "--windows=3", "--batch_size=4", "--loops=1,2"])
    assert "was computed from another out-a/eval.json" in one_line_error(capsys, saturation_table.main,
                                                                          ["--runs=out-a"])


def test_saturation_table_refuses_a_run_not_measured(indir, capsys):
    measured_copy("out-a", 6)
    Path("out-c").mkdir(exist_ok=True)
    shutil.copy("out/ckpt.pt", "out-c/ckpt.pt")
    shutil.copy("out-a/eval.json", "out-c/eval.json")
    stderr = one_line_error(capsys, saturation_table.main, ["--runs=out-a,out-c"])
    assert "run `python -m studies.saturation --out_dir=out-c`" in stderr
    saturated = json.loads(Path("out-a/saturation.json").read_text())
    Path("out-c/saturation.json").write_text(json.dumps(saturated | {"checkpoint": "another@1"}))
    assert "not of ckpt.pt" in one_line_error(capsys, saturation_table.main, ["--runs=out-c"])


# ---- the laptop study's parity, generation speed and bracket (studies/laptop.py) ----------------------------
def write_metrics(run_dir, rates):
    """run_dir/metrics.jsonl as train.py logs it: an evaluation's line, then a line per step with its FLOP/s."""
    run_dir.mkdir(exist_ok=True)
    lines = [json.dumps({"iter": 0, "train_loss": 7.0, "val_loss": 7.0})]
    for step, rate in enumerate(rates):
        lines.append(json.dumps({"iter": step, "loss": 5.0, "loops": 3, "lr": 1e-3, "flops_per_s": rate}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_parity_is_the_ratio_of_the_median_logged_flop_rates(tmp_path):
    write_metrics(tmp_path / "recurrent", [3e10, 1e10, 2e10, 9e10])  # median 2.5e10: an outlier moves it little
    write_metrics(tmp_path / "dense", [2e10, 1e9, 2e10])
    assert laptop.median_flop_rate(tmp_path / "recurrent") == 2.5e10
    assert laptop.median_flop_rate(tmp_path / "dense") == 2e10
    write_metrics(tmp_path / "untrained", [])
    with pytest.raises(configurator.UserError, match="logs no step"):
        laptop.median_flop_rate(tmp_path / "untrained")


def test_bracket_on_hand_made_rates():
    """README's CPU default: A1 at the bar at 5.47 loops against r=8; uniform r=5 at 1.48x r=8's tokens/s."""
    assert laptop.bracket_settings(8, 5.47, 0.004) == {"uniform": ("--loops=8",), "matched": ("--loops=5",),
                                                       "realized": ("--exit=kl", "--exit_threshold=0.004")}
    points = laptop.bracket(8, 5.47, {"uniform": 100.0, "matched": 148.0, "realized": 64.0})
    assert points == pytest.approx({"loops_saved": 1 - 5.47 / 8, "best_case": 1.48, "realized": 0.64})


def test_laptop_study_times_each_setting_once_and_reads_the_bracket_off_them(indir, capsys, monkeypatch, tmp_path):
    write_metrics(tmp_path / "recurrent", [3e10])
    write_metrics(tmp_path / "dense", [2e10])
    _, ckpt = load_checkpoint("out/ckpt.pt")
    allocated = {"checkpoint": checkpoint_id(ckpt), "mean_loops": 3, "at_bar": {"kl": {"loops": {"value": 2.4}}},
                 "operating_thresholds": {"kl": 0.005, "state": 0.05}}
    Path("out/allocate.json").write_text(json.dumps(allocated))
    rate_of = {("--loops=3",): 100.0, ("--loops=2",): 130.0, ("--exit=kl", "--exit_threshold=0.005"): 80.0}
    timed = []

    def fake_rate(out_dir, batch, args, max_new_tokens):
        timed.append((batch, args))
        return rate_of.get(args, 50.0) * batch
    monkeypatch.setattr(laptop, "generation_rate", fake_rate)
    argv = ["--out_dir=out", f"--recurrent_dir={tmp_path / 'recurrent'}", f"--dense_dir={tmp_path / 'dense'}"]
    result = laptop.main(argv)
    assert len(timed) == len(set(timed)) == len(laptop.GENERATIONS) + 5  # batch 8's --loops=2 is the table's
    assert result["parity"] == 1.5
    for batch in laptop.BRACKET_BATCHES:
        assert result["bracket"][batch] == pytest.approx({"loops_saved": 0.2, "best_case": 1.3, "realized": 0.8})
    assert "realized 0.80x" in capsys.readouterr().out
    assert json.loads(Path("out/laptop.json").read_text())["bracket"]["8"]["best_case"] == pytest.approx(1.3)
    allocated["at_bar"]["kl"]["loops"]["value"] = None  # A1 never reaches the bar: the table, no bracket
    Path("out/allocate.json").write_text(json.dumps(allocated))
    timed.clear()
    assert laptop.main(argv)["bracket"] == {} and len(timed) == len(laptop.GENERATIONS)
    assert "no bracket" in capsys.readouterr().out


def test_generation_rate_runs_the_engine_and_reads_its_json_report(indir, monkeypatch):
    """The one contract with python -m engine: the tokens/s of its JSON report; a refusal is its last line."""
    cpu = ("--device=cpu", "--dtype=float32", "--compile=False")  # a process of its own: on a GPU machine too
    assert laptop.generation_rate("out", 2, ("--loops=2", *cpu), 6) > 0
    refused = subprocess.CompletedProcess([], 2, "", "warning: a line\nerror: no checkpoint at nowhere/ckpt.pt\n")
    monkeypatch.setattr(subprocess, "run", lambda command, **kwargs: refused)  # a second Python start is seconds
    with pytest.raises(configurator.UserError, match="--loops=2 failed: error: no checkpoint at nowhere"):
        laptop.generation_rate("nowhere", 2, ("--loops=2",), 6)


# ---- A2's probe, diagnosed -------------------------------------------------------------------------------
def test_probe_accuracy_on_hand_made_labels():
    # (loops, tokens): token 0's argmax changes after loop 1, token 1's never; the last loop has no label
    argmax = torch.tensor([[1, 1], [2, 1], [2, 1]])
    scores = torch.tensor([[0.9, 0.2], [0.1, 0.4], [0.7, 0.7]])
    assert probe.probe_accuracy(argmax, scores) == {"accuracy": 1.0, "majority": 0.75}


def test_label_harvester_on_crafted_argmaxes():
    argmax = torch.tensor([[5, 5, 5, 5], [1, 2, 2, 2], [1, 2, 1, 1], [3, 3, 3, 4], [1, 2, 2, 1]]).T  # (loops, tokens)
    expected = torch.tensor([[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool).T
    assert torch.equal(probe.harvest_labels(argmax), expected)


def test_probe_learns_a_separable_toy_problem():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(600, 5, generator=g) * torch.tensor([1.0, 3.0, 0.1, 1.0, 1.0]) + 2.0  # unstandardised on purpose
    y = (x[:, 0] - 2.0) + 0.5 * (x[:, 1] - 2.0) > 0.3
    fitted = probe.fit_probe(x[:500], y[:500])
    assert ((fitted(x[500:]) > 0.5) == y[500:]).float().mean() > 0.95  # on points it did not see


def test_a2_runs_through_allocate_as_an_exit_test_registered_at_run_time(indir):
    """python -m studies.probe: A2 beside uniform depth and the exits in allocate.json, labelled A2, and the
    registry as it was afterwards; probe.json holds its accuracy and its cost at the bar."""
    registered = dict(model_lib.EXIT_TESTS)
    result = probe.main(ALLOCATE_FAST)
    assert model_lib.EXIT_TESTS == registered
    assert 0 <= result["majority"] <= 1 and 0.5 <= result["majority"] and 0 <= result["accuracy"] <= 1
    assert json.loads((indir / "out" / "probe.json").read_text()) == json.loads(json.dumps(result))
    allocated = json.loads((indir / "out" / "allocate.json").read_text())
    assert list(allocated["per_window"]) == ["uniform", *registered, "probe"]
    assert allocated["labels"]["probe"] == "A2" and result["at_bar"] == allocated["at_bar"]["probe"]
    loops = np.array(allocated["per_window"]["probe"]["loops"])
    assert (2 <= loops).all() and (loops <= 8).all()


# ---- the paper's table at matched average loops ---------------------------------------------------------
def test_interpolation_on_a_hand_made_curve():
    curve = [(4, 3.0), (1, 4.0), (8, 2.9), (2, 3.5)]  # unsorted on purpose
    assert matched.interp_loss(curve, 3) == pytest.approx(3.25)
    assert matched.interp_loss(curve, 8) == pytest.approx(2.9)
    assert matched.interp_loss(curve, 0.5) is None and matched.interp_loss(curve, 9) is None


def test_the_matched_table_of_a_checkpoint_is_read_off_allocate_json(indir, capsys):
    """Every registered exit's loss minus uniform depth's at 3/8..7/8 of mean_loops, from allocate.json."""
    allocate.main(ALLOCATE_FAST)
    capsys.readouterr()
    result = matched.main(["--out_dir=out", "--bootstrap=50"])
    assert [row["loops"] for row in result["rows"]] == [3 * f / 8 for f in range(3, 8)]
    assert all(set(row) == {"loops", "uniform", *model_lib.EXIT_TESTS} for row in result["rows"])
    assert "| kl (A1) - uniform |" in capsys.readouterr().out
    assert json.loads((indir / "out" / "matched.json").read_text()) == json.loads(json.dumps(result))
