"""Tests for the cheap exits study (studies/exits.py, studies/exit_candidates.py): candidates
registered at run time and read off allocate.py's one trace, on a tiny model trained here; each
within a tenth of a loop; each through sample.py's generation; the registry as it was; the verdict
on hand-made numbers."""
import json

import numpy as np
import pytest
import torch

import allocate
import evaluate
from configurator import configure
from model import (EXIT_TESTS, GPT, MIN_EXIT_LOOP, DepthPolicy, GPTConfig, autocast,
                   load_checkpoint, uniform_depth)
from prepare import sha256_of
from sample import generate
from studies import exit_candidates, exits
from studies.exit_candidates import (CANDIDATES, MAX_TEST_COST, build_candidates,
                                     tokens_by_frequency)
from test_allocate import train_tiny

ALLOCATE_FAST = ["--out_dir=out", "--windows=6", "--train_windows=2", "--batch_size=4",
                 "--n_grid=12", "--bootstrap=50"]
R_MAX = 8  # the tiny model's max_loops


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """data/tiny (bytes of English text) and out/ckpt.pt trained on it by train.py (mean_loops 3,
    max_loops 8)."""
    root = tmp_path_factory.mktemp("exits")
    train_tiny(root, 60, ["--n_core=2", "--mean_loops=3", f"--max_loops={R_MAX}", "--bptt_k=4"])
    return root


@pytest.fixture
def indir(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    return workdir


def tiny_candidates():
    """The tiny checkpoint and its candidates, built as the study builds them (in the workdir)."""
    model, _ = load_checkpoint("out/ckpt.pt")
    by_frequency = tokens_by_frequency("data/tiny/train.bin", "uint16", model.config.vocab_size)
    return model, build_candidates(model, by_frequency)


# ---- the study, end to end -----------------------------------------------------------------
def test_the_study_reads_every_exit_off_allocates_trace_and_writes_its_verdict(indir, capsys):
    """python -m studies.exits: every candidate beside kl and state in allocate.json and
    exits.json, each with allocate.py's costs at the bar and their intervals, its threshold, its
    cost a loop and a verdict; the registry as it was afterwards."""
    registered = dict(EXIT_TESTS)
    result = exits.main(ALLOCATE_FAST)
    assert EXIT_TESTS == registered
    saved = json.loads((indir / "out" / "exits.json").read_text())
    assert saved == json.loads(json.dumps(result))
    allocated = json.loads((indir / "out" / "allocate.json").read_text())
    assert list(allocated["per_window"]) == ["uniform", *registered, *CANDIDATES]
    assert list(saved["exits"]) == [*registered, *CANDIDATES]
    assert saved["checkpoint"] == allocated["checkpoint"] and saved["goal"] == exits.GOAL
    assert saved["allocate_sha256"] == sha256_of(indir / "out" / "allocate.json")
    assert not saved["timed"] and saved["uniform"] == allocated["at_bar"]["uniform"]
    printed = capsys.readouterr().out
    for name, row in saved["exits"].items():
        for cost in ("loops", "loops_saved", "flops", "flops_saved"):
            assert row[cost] == allocated["at_bar"][name][cost]
        assert row["threshold"] == allocated["operating_thresholds"][name]
        assert row["verdict"] == exits.verdict(row["flops_saved"]) and row["idea"]
        outcome = "WINS" if row["verdict"]["wins"] else "no"
        assert f"\n{name}: {outcome}, {row['verdict']['why']}" in printed
        loops = np.array(allocated["per_window"][name]["loops"])
        assert (MIN_EXIT_LOOP <= loops).all() and (loops <= R_MAX).all()
    # the KL exit's readout a loop is counted in its cost
    model, _ = load_checkpoint("out/ckpt.pt")
    _, loop, readout = model.flop_terms(model.config.block_size)
    kl_test = EXIT_TESTS["kl"].flops(model.config)
    assert saved["exits"]["kl"]["per_loop_cost"] == pytest.approx((kl_test + readout) / loop)
    assert all(saved["exits"][name]["per_loop_cost"] <= MAX_TEST_COST for name in CANDIDATES)


def test_the_study_times_each_exit_against_uniform_depth(indir, monkeypatch, capsys):
    """--time=True: each exit's tokens/s at batch 1 and 8 beside uniform depth's, in its row, and
    the batch-1 ratio in its verdict (a few short runs here; the real ones: exits.py's)."""
    monkeypatch.setattr(exits, "TIMED_NEW_TOKENS", 3)
    monkeypatch.setattr(exits, "TIMED_PAIRS", 1)
    result = exits.main([*ALLOCATE_FAST, "--time=True"])
    assert result["timed"]
    for row in result["exits"].values():
        assert set(row["timing"]) == {"batch_1", "batch_8"}
        for rates in row["timing"].values():
            assert rates["uniform"] > 0 and rates["exit"] > 0
            assert rates["speedup"] == pytest.approx(rates["exit"] / rates["uniform"])
        speedup = row["timing"]["batch_1"]["speedup"]
        assert row["verdict"] == exits.verdict(row["flops_saved"], speedup)


def test_help_lists_the_studys_setting_and_allocates(capsys):
    with pytest.raises(SystemExit) as exit_:
        exits.main(["--help"])
    printed = capsys.readouterr().out
    assert exit_.value.code == 0 and "--time=False" in printed and "--r_max=0" in printed


# ---- the registry --------------------------------------------------------------------------
def test_the_registry_is_left_as_it_was_after_an_error(indir, monkeypatch):
    registered = dict(EXIT_TESTS)

    def failing_allocate(argv):
        # registered while allocate.py runs
        assert set(CANDIDATES) <= set(EXIT_TESTS)
        raise RuntimeError("allocate.py failed")
    monkeypatch.setattr(allocate, "main", failing_allocate)
    with pytest.raises(RuntimeError, match="allocate.py failed"):
        exits.main(ALLOCATE_FAST)
    assert EXIT_TESTS == registered


def test_a_name_already_registered_is_refused_and_left_alone():
    registered = dict(EXIT_TESTS)
    with pytest.raises(ValueError, match="already registered: kl"):
        with exits.registered({"kl": EXIT_TESTS["state"], "new": EXIT_TESTS["state"]}):
            pass
    assert EXIT_TESTS == registered


# ---- the candidates ------------------------------------------------------------------------
# the README's CPU default, train.py's shape
CPU_DEFAULT = GPTConfig(vocab_size=1024, block_size=512, n_embd=192, n_head=3, n_kv_head=1,
                        ffn_hidden=512, n_prelude=1, n_core=1, n_coda=1, mean_loops=8,
                        max_loops=32, bptt_k=8)


@pytest.mark.parametrize("shape", ["tiny", "cpu default"])
def test_every_candidate_costs_at_most_a_tenth_of_a_loop(indir, shape):
    """From the FLOP ledger at the model's shape: the FLOPs an exit adds a tested loop, over a
    loop's."""
    if shape == "tiny":
        model, candidates = tiny_candidates()
    else:
        model = GPT(CPU_DEFAULT)
        candidates = build_candidates(model, torch.arange(CPU_DEFAULT.vocab_size))
    assert list(candidates) == list(CANDIDATES)
    T = model.config.block_size
    loop = model.flop_terms(T)[1]
    for test in candidates.values():
        assert not test.needs_logits
        # five loops: four tested
        added = model.inference_flops(5, T, test) - model.inference_flops(5, T)
        assert 0 < added / (5 - MIN_EXIT_LOOP + 1) <= MAX_TEST_COST * loop


def test_a_candidate_over_a_tenth_of_a_loop_is_refused(indir, monkeypatch):
    monkeypatch.setattr(exit_candidates, "SIZE_BUDGET", 0.5)
    with pytest.raises(AssertionError, match="of a loop"):
        tiny_candidates()


def test_each_score_is_float32_under_a_bfloat16_autocast(indir):
    model, candidates = tiny_candidates()
    generator = torch.Generator().manual_seed(0)
    s_old, s_new = torch.randn(2, 3, 5, model.config.n_embd, generator=generator)
    for name, test in candidates.items():
        with autocast("cpu", "bfloat16"):
            score = test.score(s_new, s_old, None, None)
        assert score.dtype == torch.float32, name
        assert torch.allclose(score, test.score(s_new, s_old, None, None)), name


def test_each_score_on_hand_made_states(indir):
    """Shapes (B, T, d) -> (B, T), no logits needed; a state that did not move scores 0 where the
    test compares two loops; the margin is within [0, 1]."""
    model, candidates = tiny_candidates()
    generator = torch.Generator().manual_seed(0)
    s_old, s_new = torch.randn(2, 3, 5, model.config.n_embd, generator=generator)
    for name, test in candidates.items():
        score = test.score(s_new, s_old, None, None)
        assert score.shape == (3, 5) and (score >= 0).all(), name
        if name != "lens_margin":
            assert test.score(s_new, s_new, None, None).abs().max() < 1e-5, name
    assert (candidates["lens_margin"].score(s_new, s_old, None, None) <= 1).all()
    # a state that only grew has settled, for the cosine
    assert candidates["cosine"].score(2 * s_new, s_new, None, None).abs().max() < 1e-5


def test_lens_spread_is_the_spread_of_the_lens_change_over_the_vocabulary(indir):
    """lens_spread through d x d equals the standard deviation over the vocabulary of the head's
    logits' change between the two normed states, written out with every row of the head."""
    model, candidates = tiny_candidates()
    generator = torch.Generator().manual_seed(1)
    s_old, s_new = torch.randn(2, 2, 3, model.config.n_embd, generator=generator)
    with torch.no_grad():
        change = model.lm_head(model.norm(s_new)) - model.lm_head(model.norm(s_old))
    by_hand = change.double().std(dim=-1, correction=0)
    spread = candidates["lens_spread"].score(s_new, s_old, None, None)
    torch.testing.assert_close(spread.double(), by_hand, rtol=1e-4, atol=1e-6)


def test_tokens_by_frequency_most_frequent_first_ties_by_id(tmp_path, monkeypatch):
    path = tmp_path / "train.bin"
    np.array([3, 1, 3, 2, 3, 1, 5, 2], dtype=np.uint16).tofile(path)
    assert tokens_by_frequency(path, "uint16", 6).tolist() == [3, 1, 2, 5, 0, 4]
    # counted in pieces: two pieces of 2 tokens, at the start and the end
    monkeypatch.setattr(exit_candidates, "COUNTED_TOKENS", 4)
    monkeypatch.setattr(exit_candidates, "COUNTED_PIECES", 2)
    assert tokens_by_frequency(path, "uint16", 6).tolist() == [1, 2, 3, 5, 0, 4]


def loops_in_generation(model, test, threshold, scores=None):
    """The loops of each new token (steps, 3) in sample.py's greedy generation of 16 tokens after
    12 of the tiny val text, under test at threshold; scores, a list, gets every score given."""
    val = torch.from_numpy(np.fromfile("data/tiny/val.bin", dtype=np.uint16).astype(np.int64))
    prompts = val[:3 * 12].view(3, 12)

    def recorded(*states_and_logits):
        score = test.score(*states_and_logits)
        if scores is not None:
            scores.append(score)
        return score
    depth = DepthPolicy(test._replace(score=recorded), threshold, R_MAX)
    steps = generate(model, prompts, 16, exits.GREEDY, 3, depth)
    # the first token is read off the prefill, at the prompt's loops
    return torch.stack([loops for _, loops in steps][1:])


@pytest.mark.parametrize("name", list(CANDIDATES))
def test_a_registered_candidate_generates_and_stops_tokens(indir, name):
    """Through sample.py's generation (no logits for a test without a readout): at threshold 0
    every token runs r_max; at the median of the scores after loop 5 there, tokens stop at varied
    depths from loop 2; at a huge one each stops at loop 2. Registered, evaluate.trace scores
    it."""
    model, candidates = tiny_candidates()
    test = candidates[name]
    scores = []
    assert (loops_in_generation(model, test, 0.0, scores) == R_MAX).all()
    # a decode step scores loops 2..R_MAX of its three tokens
    after_loop_5 = torch.stack(scores).view(-1, R_MAX - 1, 3)[:, 5 - MIN_EXIT_LOOP]
    loops = loops_in_generation(model, test, after_loop_5.median().item())
    assert (MIN_EXIT_LOOP <= loops).all() and (loops <= R_MAX).all() and len(loops.unique()) > 1
    assert (loops_in_generation(model, test, 1e9) == MIN_EXIT_LOOP).all()
    windows = torch.zeros(1, 9, dtype=torch.long)
    with exits.registered(candidates):
        traced = evaluate.trace(model, windows[:, :-1], windows[:, 1:], R_MAX)
    assert traced[name].shape == (R_MAX, 1, 8) and torch.isfinite(traced[name][1:]).all()


def test_generation_is_timed_against_uniform_depth(indir, monkeypatch):
    model, candidates = tiny_candidates()
    C, _ = configure(vars(allocate), [])
    prompts = torch.zeros(2, 4, dtype=torch.long)
    depth = DepthPolicy(candidates["cosine"], 1e9, R_MAX)
    rates = exits.time_against_uniform(model, prompts, uniform_depth(3), depth, C, 3, pairs=2)
    assert rates["uniform"] > 0 and rates["exit"] > 0
    assert rates["speedup"] == rates["exit"] / rates["uniform"]


# ---- the verdict ---------------------------------------------------------------------------
@pytest.mark.parametrize("saved, interval, speedup, wins, why", [
    (0.20, [0.05, 0.30], None, True, "saves 20.0% of uniform depth's FLOPs [5.0%, 30.0%] (not"),
    (0.20, [0.05, 0.30], 1.10, True, "and generates at batch 1 at 1.10x"),
    (0.20, [0.05, 0.30], 1.00, True, "at 1.00x"),
    (0.20, [0.05, 0.30], 0.95, False, "but generates at batch 1 at 0.95x"),
    (0.15, [0.01, 0.30], None, True, "saves 15.0%"),
    (0.149, [0.10, 0.20], 2.0, False, "not 15% fewer"),
    (-0.59, [-0.70, -0.50], None, False, "spends 59.0% more FLOPs than uniform depth, not 15%"),
    (0.20, [-0.01, 0.40], None, False, "its interval [-1.0%, 40.0%] holds 0"),
    (0.20, [0.0, 0.40], None, False, "holds 0"),
    (0.20, None, None, False, "without an interval"),
    (None, None, None, False, "never reaches the bar"),
])
def test_the_verdict_on_hand_made_numbers(saved, interval, speedup, wins, why):
    judged = exits.verdict({"value": saved, "interval": interval}, speedup)
    assert judged["wins"] is wins and why in judged["why"]


def test_the_goal_is_written_where_a_reader_looks():
    assert exits.GOAL_SAVING == 0.15
    assert "15% fewer FLOPs" in exits.GOAL
    assert "15% fewer FLOPs" in " ".join(exits.__doc__.split())


@pytest.mark.parametrize("argv, own", [
    (["--time=True", "--r_max=4"], ["--time=True"]),
    (["--windows", "6", "--time", "True", "--seed=1"], ["--time", "True"]),
    (["--time", "--out_dir=x"], ["--time"]),
    (["--timeout=3"], []),
])
def test_the_studys_setting_is_told_from_allocates(argv, own):
    mine, others = exits.split_argv(argv)
    assert mine == own and [arg for arg in argv if arg not in own] == others
