"""Tests for studies/figures.py: the paper's figures, drawn from small hand-made eval.json, allocate.json and
token_classes.json files (no checkpoint needed), and its one-line refusals."""
import hashlib
import json
import os
import sys

import numpy as np
import pytest

from conftest import stderr_of_a_refusal
from studies import figures

MEAN = 4  # the hand-made run's training mean
R_MAX = 8  # allocate.json's deepest loop


def hand_made_eval():
    """eval.json of a run whose loss falls to its training mean and stays; its KL decays tenfold a loop."""
    rows = []
    for r in [*range(1, 2 * MEAN + 1), 16]:
        loss = 3.0 + 1.0 / min(r, MEAN)
        row = {"loops": r, "loss": loss, "bits_per_byte": loss / 2, "window_losses": [loss] * 3}
        if r >= 2:
            row |= {"mean_kl": 0.3 * 10.0 ** (2 - r), "mean_state_change": 2.0 ** -r,
                    "percent_moving": 100.0 * 0.5 ** (r - 2)}
        rows.append(row)
    return {"checkpoint": "hand@10", "mean_loops": MEAN, "rows": rows, "median_convergence_depth": 3.0}


def hand_made_allocate():
    """allocate.json's parts that the figures read: every policy's points over 3 windows, the bar, the labels."""
    depths = np.arange(1.0, R_MAX + 1)
    offsets = np.array([-0.01, 0.0, 0.01])  # each window's difficulty
    uniform_loss = 3.0 + 1.0 / np.minimum(depths, MEAN)
    per_window = {"uniform": {"loss": uniform_loss[:, None] + offsets, "loops": np.repeat(depths[:, None], 3, 1),
                              "flops": np.repeat(1e6 * (1 + depths[:, None]), 3, 1)}}
    labels = {"uniform": "A0", "kl": "A1", "state": "A1s", "probe": "A2"}
    for shift, policy in enumerate(list(labels)[1:]):
        loops = np.linspace(2.0, R_MAX, 5)[:, None] + offsets
        per_window[policy] = {"loss": 3.0 + 1.0 / np.minimum(loops, MEAN) + 0.01 * shift, "loops": loops,
                              "flops": 1e6 * (1.2 + loops)}
    return {"checkpoint": "hand@10", "mean_loops": MEAN, "r_max": R_MAX, "bar": 3.0 + 1.0 / MEAN, "labels": labels,
            "settings": {"uniform": depths.tolist()},
            "per_window": {policy: {measure: array.tolist() for measure, array in measures.items()}
                           for policy, measures in per_window.items()}}


def hand_made_token_classes():
    rows = [{"class": "space", "count": 10, "mean_exit_depth": 2.5}, {"class": "numeral", "count": 0},
            {"class": "punctuation", "count": 5, "mean_exit_depth": 3.0},
            {"class": "word", "count": 20, "mean_exit_depth": 3.5}, {"class": "all", "count": 35, "mean_exit_depth": 3.2}]
    return {"checkpoint": "hand@10", "threshold": 0.004, "rows": rows}


HAND_MADE = {"eval.json": hand_made_eval, "allocate.json": hand_made_allocate,
             "token_classes.json": hand_made_token_classes}


def write_run(run_dir, names):
    """The hand-made files of `names` in run_dir, token_classes.json computed from its allocate.json."""
    run_dir.mkdir(exist_ok=True)
    for name in sorted(names):  # allocate.json first: token_classes.json names its sha256
        made = HAND_MADE[name]()
        if name == "token_classes.json" and (run_dir / "allocate.json").is_file():
            made["allocate_sha256"] = hashlib.sha256((run_dir / "allocate.json").read_bytes()).hexdigest()
        (run_dir / name).write_text(json.dumps(made))


def one_line_error(capsys, argv):
    """figures.main must refuse argv: exit 2 and one line on stderr, through configurator.run."""
    stderr = stderr_of_a_refusal(capsys, figures.main, argv)
    assert stderr.startswith("error: ") and stderr.count("\n") == 1, stderr
    return stderr


def assert_pngs(paths):
    """Each path a PNG of more than an empty frame's bytes (axes, curves and labels)."""
    for path in paths:
        with open(path, "rb") as f:
            png = f.read()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


def test_every_figure_from_the_three_files(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    write_run(tmp_path / "out-hand", HAND_MADE)
    argv = [f"--out_dir={tmp_path / 'out-hand'}", f"--figures_dir={tmp_path / 'figs'}"]
    paths = figures.main(argv)
    names = ["loss_by_depth", "convergence", "allocation", "token_classes"]
    assert paths == [str(tmp_path / "figs" / f"out-hand_{name}.png") for name in names]
    assert_pngs(paths)
    assert "not in" not in capsys.readouterr().out


def test_the_figures_of_the_files_there_and_one_line_naming_the_others(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    write_run(tmp_path / "run", ["eval.json"])
    paths = figures.main([f"--out_dir={tmp_path / 'run'}", f"--figures_dir={tmp_path}"])
    assert paths == [str(tmp_path / "run_loss_by_depth.png"), str(tmp_path / "run_convergence.png")]
    assert_pngs(paths)
    out = capsys.readouterr().out
    assert out.count("not in") == 1 and "allocate.json, token_classes.json" in out
    write_run(tmp_path / "other", ["allocate.json", "token_classes.json"])
    paths = figures.main([f"--out_dir={tmp_path / 'other'}", f"--figures_dir={tmp_path}"])
    names = ["loss_by_depth", "allocation", "token_classes"]
    assert paths == [str(tmp_path / f"other_{name}.png") for name in names]


def test_files_of_two_checkpoints_or_none_are_refused(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert "none of eval.json" in one_line_error(capsys, [f"--out_dir={tmp_path}"])
    write_run(tmp_path, HAND_MADE)
    allocated = hand_made_allocate() | {"checkpoint": "hand@20"}
    (tmp_path / "allocate.json").write_text(json.dumps(allocated))
    assert "allocate.json of hand@20" in one_line_error(capsys, [f"--out_dir={tmp_path}"])


def test_without_matplotlib_one_line_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    write_run(tmp_path, HAND_MADE)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    stderr = one_line_error(capsys, [f"--out_dir={tmp_path}", f"--figures_dir={tmp_path / 'figs'}"])
    assert "pip install -r studies/requirements.txt" in stderr
    assert not (tmp_path / "figs").exists()


def test_token_classes_of_an_earlier_allocate_json_are_refused(tmp_path, capsys):
    """token_classes.json is read at allocate.json's threshold: after allocate.py ran again, it is another's."""
    pytest.importorskip("matplotlib")
    write_run(tmp_path, HAND_MADE)
    allocated = json.loads((tmp_path / "allocate.json").read_text())
    (tmp_path / "allocate.json").write_text(json.dumps(allocated | {"bar": 3.1}))  # run again
    assert "token_classes.json was computed from another" in one_line_error(capsys, [f"--out_dir={tmp_path}"])


def test_a_redraw_that_fails_keeps_the_previous_figure_and_a_name_is_no_formula(tmp_path, monkeypatch):
    """A run named like a formula ('$x^$') is drawn; a redraw that fails (a full disk) leaves the last
    good PNG as it was."""
    pytest.importorskip("matplotlib")
    run = tmp_path / "run $x^$"
    write_run(run, ["eval.json"])
    argv = [f"--out_dir={run}", f"--figures_dir={tmp_path}"]
    first = figures.main(argv)
    before = {path: open(path, "rb").read() for path in first}

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError):
        figures.main(argv)
    assert {path: open(path, "rb").read() for path in first} == before
