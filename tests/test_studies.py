"""Tests for the studies built on the core (studies/): the saturation depth, the speed at each depth, the exit
depth by token class. On a tiny model trained here (test_evaluate.py's), and on hand-made curves and traces."""
import json

import numpy as np
import pytest
import torch

import allocate
import configurator
import evaluate
from evaluate import load_windows
from model import load_checkpoint
from prepare import load_tokenizer
from studies import saturation, timing
from studies import token_classes as studies_token_classes
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
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("sys.argv", ["study", *argv])
        with pytest.raises(SystemExit) as exit_:
            configurator.run(main)
    stderr = capsys.readouterr().err
    assert exit_.value.code == 2 and stderr.startswith("error: ") and stderr.count("\n") == 1, stderr
    return stderr


# ---- the saturation depth ------------------------------------------------------------------------------
def test_saturation_on_hand_made_curves():
    """Four windows whose mean losses per swept depth are set by hand (each window's: the mean plus an offset
    that cancels over the windows, so resamples move the curve)."""
    swept, mean = [1, 2, 3, 4, 6, 8, 12, 16, 32], 4
    curve = [4.0, 3.5, 3.3, 3.2004, 3.2, 3.199, 3.1985, 3.25, 3.0]  # r=32 is past 4 x mean: never the best
    offsets = np.array([-0.01, 0.01, -0.02, 0.02])
    losses = np.array(curve)[:, None] + offsets  # (depths, windows)
    at = {r: i for i, r in enumerate(swept)}
    result = saturation.saturation(losses, swept, mean)
    # the best up to r=16 is r=12's 3.1985: r=4 (3.2004) is the first within 0.002 of it
    assert result["depth"]["value"] == 4 and result["depth"]["interval"] == [4.0, 4.0]
    assert result["useful_range"]["value"] == pytest.approx(4.0 - 3.2004, abs=1e-6)
    losses[at[4]] += 0.0011  # r=4 now 0.003 above the best: r=6 (0.0015) is the first within it
    assert saturation.saturation(losses, swept, mean)["depth"]["value"] == 6
    losses[at[4]] -= 0.0012  # r=4 0.0018 above the best on average, but window by window 0.0048 above or 0.0012
    losses[at[4]] += np.array([0.003, -0.003, 0.003, -0.003])  # below: resamples put it on either side
    result = saturation.saturation(losses, swept, mean)
    assert result["depth"]["value"] == 4 and result["depth"]["interval"] == [4.0, 6.0]
    losses[at[16]] -= 0.1  # r=16 = 4 x mean is the best now, far ahead of the others
    assert saturation.saturation(losses, swept, mean)["depth"]["value"] == 16


def test_saturation_of_a_checkpoint_from_its_eval_json(indir, capsys):
    evaluated = evaluate.main(FAST)
    capsys.readouterr()
    result = saturation.main(["--out_dir=out"])
    assert json.loads((indir / "out" / "saturation.json").read_text()) == json.loads(json.dumps(result))
    losses = {row["loops"]: row["loss"] for row in evaluated["elasticity"]}  # swept: 1, 2, 3, 6, 12 <= 4 x 3
    depth = result["depth"]["value"]
    assert depth in losses and 1 <= min(result["depth"]["interval"])
    assert losses[depth] <= min(losses.values()) + saturation.SATURATION_TOL
    assert result["useful_range"]["value"] == pytest.approx(losses[1] - losses[depth])
    assert result["checkpoint"].endswith("@60") and result["swept"] == [1, 2, 3, 6, 12]
    assert capsys.readouterr().out.startswith(f"saturation depth {depth:g} [")


def test_one_window_gives_no_interval(indir, capsys):
    evaluate.main(FAST + ["--windows=1"])
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
    grids = {"A1": [0.01, 0.1, 1.0]}
    per_window = {("A1", "loss"): np.array([[3.0], [3.1], [3.5]])}  # the threshold's mean loss
    names = {0: " ", 1: "7", 2: ",", 3: "cat", 4: "dog"}
    inputs = torch.tensor([[4, 0, 3, 1, 2]])  # dog, space, cat, 7, comma

    def decode(ids):
        return "".join(names[i] for i in ids)
    threshold = allocate.operating_threshold(per_window, "A1", grids["A1"], 3.2)
    assert threshold == 0.1  # 0.1 and 0.01 reach 3.2: the largest
    res = studies_token_classes.token_classes({"kl": kl}, threshold, inputs, decode)
    assert res["threshold"] == 0.1
    # at 0.1 the tokens stop after loops 2, 3, 4, 2, 4 (the last never below: r_max)
    depth = {row["class"]: row.get("mean_exit_depth") for row in res["rows"]}
    count = {row["class"]: row["count"] for row in res["rows"]}
    assert depth == {"space": 3.0, "numeral": 2.0, "punctuation": 4.0, "word": (2 + 4) / 2, "all": 15 / 5}
    assert count == {"space": 1, "numeral": 1, "punctuation": 1, "word": 2, "all": 5}
    assert allocate.operating_threshold(per_window, "A1", grids["A1"], 2.0) == 0.01  # none reaches: the smallest
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
