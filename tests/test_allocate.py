"""Tests for allocate.py on a tiny model trained here on a byte-level dataset of real English text.
References: the paper's masking harness (every token runs every loop, a stopped one held by torch.where),
hand-made traces, curves and FLOP counts."""
import importlib
import json
import os
import shutil
import sysconfig
from types import SimpleNamespace
from pathlib import Path

import numpy as np
import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import allocate
import configurator
import evaluate
import model as model_lib
import sample
import train
from configurator import UserError
from conftest import stderr_of_a_refusal
from evaluate import load_windows, paired_bootstrap
from model import EXIT_TESTS, MIN_EXIT_LOOP, DepthPolicy, autocast, load_checkpoint, token_loss
from studies.probe import fit_probe, probe_exit_test

R_MAX = 8  # the tiny model's max_loops


@torch.no_grad()
def masked_exit(model, x, y, depth):
    """The paper's teacher-forced masking harness: every token runs every loop and a stopped token's
    state is held by torch.where, so it keeps serving as key/value to the others, recomputed from its
    held state (the K/V of one loop further than it ran). It saves no work, it only counts it.
    -> per-token loss and loops run, (B, T) each."""
    test = depth.test
    e = model.prelude(x)
    s = model.init_state(e, "zero")
    looping = torch.ones_like(y, dtype=torch.bool)
    loops = torch.zeros_like(y)
    logits = model.readout(s)
    for loop in range(1, depth.r_max + 1):
        s_new = torch.where(looping[..., None], model.core_step(e, s), s)
        loops += looping
        new_logits = model.readout(s_new)
        if test.needs_logits:  # a stopped token carries the distribution it stopped with
            new_logits = torch.where(looping[..., None], new_logits, logits)
        if loop >= MIN_EXIT_LOOP:
            looping &= test.score(s_new, s, new_logits, logits) >= depth.threshold
        s, logits = s_new, new_logits
    if not test.needs_logits:
        logits = model.readout(s)
    return token_loss(logits, y), loops


def byte_tokenizer():
    """A tokenizer whose id b is byte b: GPT-2's byte-level characters (printable bytes as themselves, the
    others from U+0100 on, in byte order) as a vocabulary without merges."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = iter(range(256, 512))
    vocab = {(chr(b) if b in printable else chr(next(others))): b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def write_byte_dataset(root):
    """data/tiny/: the standard library's docstrings and licence as bytes (vocab 256), its byte tokenizer."""
    modules = "argparse subprocess logging re json pickle typing collections functools textwrap difflib doctest pydoc"
    text = "".join(importlib.import_module(m).__doc__ or "" for m in modules.split())
    text += Path(sysconfig.get_paths()["stdlib"], "LICENSE.txt").read_text()
    ids = np.frombuffer(text.encode(), dtype=np.uint8).astype(np.uint16)
    n_val = len(ids) // 10
    d = root / "data" / "tiny"
    d.mkdir(parents=True)
    ids[:-n_val].tofile(d / "train.bin")
    ids[-n_val:].tofile(d / "val.bin")
    meta = {"source": "stdlib", "tokenizer": "bytes", "vocab_size": 256, "eot_id": 0, "dtype": "uint16",
            "train_tokens": len(ids) - n_val, "val_tokens": n_val, "train_bytes": len(ids) - n_val, "val_bytes": n_val}
    (d / "meta.json").write_text(json.dumps(meta))
    byte_tokenizer().save(str(d / "tokenizer.json"))


def train_tiny(root, steps, loops):
    """data/tiny and out/ckpt.pt under root: a width-32 model trained for `steps` on it."""
    write_byte_dataset(root)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        train.main(["--dataset=tiny", "--out_dir=out", f"--max_iters={steps}", "--n_embd=32", "--n_head=2",
                    "--n_kv_head=1", "--ffn_hidden=64", "--block_size=32", "--batch_size=8",
                    f"--eval_interval={steps}", "--eval_iters=1", "--compile=False", "--learning_rate=5e-3",
                    "--log_interval=1000"] + loops)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained for 60 steps (converged enough for the exits to mean something), its dir and data."""
    root = tmp_path_factory.mktemp("alloc")
    train_tiny(root, 60, ["--n_core=2", "--mean_loops=3", f"--max_loops={R_MAX}", "--bptt_k=4"])
    model, _ = load_checkpoint(str(root / "out" / "ckpt.pt"))
    wins = load_windows(str(root / "data/tiny/val.bin"), "uint16", 8, 33, 0)
    return root, model, wins[:, :-1], wins[:, 1:].contiguous()


# ---- curves and intervals on hand-made data -------------------------------------------
def test_interpolation_on_a_hand_made_curve():
    curve = [(4, 3.0), (1, 4.0), (8, 2.9), (2, 3.5)]  # unsorted on purpose
    assert allocate.cost_at_loss(curve, 3.25) == pytest.approx(3.0)
    assert allocate.cost_at_loss(curve, 3.6) == pytest.approx(1.8)
    assert allocate.cost_at_loss(curve, 5.0) == 1  # already there at its shallowest point
    assert allocate.cost_at_loss(curve, 2.0) is None
    assert allocate.cost_at_loss([(1, 3.0), (2, 2.0), (3, 3.0), (4, 1.0)], 2.5) == pytest.approx(1.5)  # first crossing


def test_paired_bootstrap_on_a_synthetic_pair():
    """A1 is A0 minus 0.05 nats on every window, plus small noise; the windows vary much more (sd 0.3).
    The paired 95% interval holds the true -0.05 about 95% of the time, it is narrow because the pairs
    share their windows' difficulty (resampled apart, it would be ~8x wider), and it narrows as the
    windows grow (~1/sqrt(n))."""
    def stat(per_window):
        return per_window["kl", "loss"][0].mean() - per_window["uniform", "loss"][0].mean()
    widths, covered = {}, 0
    for n in (64, 1024):
        widths[n] = []
        for trial in range(40 if n == 64 else 5):
            g = np.random.default_rng(1000 * n + trial)
            a0 = g.normal(3.0, 0.3, n)
            a1 = a0 - 0.05 + g.normal(0, 0.05, n)
            estimate = paired_bootstrap(stat, {("uniform", "loss"): a0[None], ("kl", "loss"): a1[None]}, 500, trial)
            low, high = estimate["interval"]
            assert low <= estimate["value"] <= high
            covered += n == 64 and low < -0.05 < high
            widths[n].append(high - low)
    assert covered >= 34  # 95% nominal; 34 of 40 leaves room for chance
    assert np.mean(widths[64]) < 0.04  # unpaired: ~0.2
    assert np.mean(widths[1024]) < 0.4 * np.mean(widths[64])


def test_undefined_statistics_have_no_interval():
    per_window = {("uniform", "loss"): np.ones((1, 8))}
    assert paired_bootstrap(lambda pw: None, per_window, 100, 0) == {"value": None, "interval": None}


def test_a_model_whose_output_never_changes_gets_a_grid_not_an_error():
    """Every exit score 0 (a model trained on one repeated byte): any threshold stops every token at its
    first test, and the grid says so instead of raising on an empty set of positive scores."""
    scores = torch.cat([torch.full((1, 2, 3), float("inf")), torch.zeros(3, 2, 3)])
    assert allocate.log_grid(scores, 4) == [1.0] * 4


def test_policies_are_read_off_a_hand_made_trace(trained):
    """Two windows of two tokens, r_max 4. A token stops after the first loop from 2 whose score is below
    the threshold (else at r_max) and scores the loss it had after that loop."""
    model = trained[1]  # for its FLOP count
    loss = torch.tensor([[[4.0, 4.0], [3.0, 5.0]], [[3.0, 3.0], [2.0, 4.0]],
                         [[2.0, 2.0], [1.0, 3.0]], [[1.0, 1.0], [0.5, 2.0]]])  # (loops, windows, tokens)
    kl = torch.tensor([[[0.0, 0.0], [0.0, 0.0]], [[0.5, 0.2], [0.05, 0.9]],
                       [[0.05, 0.3], [0.01, 0.9]], [[0.01, 0.01], [0.0, 0.9]]])  # loop 1's is never read
    traced = {"loss": loss, "kl": kl}
    per_window = allocate.read_policies(model, traced, {"kl": EXIT_TESTS["kl"]}, {"kl": [0.1]})
    # window 0: tokens stop after loops 3 and 4; window 1: after loops 2 and 4 (never below: r_max)
    assert per_window["kl", "loops"].tolist() == [[3.5, 3.0]]
    assert per_window["kl", "loss"].tolist() == [[(2.0 + 1.0) / 2, (2.0 + 2.0) / 2]]
    assert per_window["uniform", "loss"][:, 0].tolist() == [4.0, 3.0, 2.0, 1.0]
    T = 2
    assert per_window["kl", "flops"][0, 0] == model.inference_flops(3.5, T, EXIT_TESTS["kl"])


def trace_for_policies(model, wins, batch_size):
    """The trace allocate.main reads the policies off, to R_MAX: every registered exit test's scores."""
    return evaluate.trace_windows(model, wins, R_MAX, batch_size, ("loss", "argmax", *EXIT_TESTS))


def harness_and_reading(model, X, Y, name, threshold):
    """The masking harness and allocate's reading of the trace, for one policy at one threshold."""
    wins = torch.cat([X, Y[:, -1:]], dim=1)
    traced = trace_for_policies(model, wins, 4)
    test = EXIT_TESTS[name]
    per_window = allocate.read_policies(model, traced, {name: test}, {name: [threshold]})
    masked = masked_exit(model, X, Y, DepthPolicy(test, threshold, R_MAX))
    return per_window, masked, traced


def with_a_probe(monkeypatch):
    """A2's kind of exit test registered as "probe": any function of the state."""
    def probe(s):
        return torch.sigmoid(s[..., 0].float() * 3)
    monkeypatch.setitem(EXIT_TESTS, "probe", probe_exit_test(probe))


@pytest.mark.parametrize("name", ["kl", "state"])
def test_threshold_zero_is_a0_at_r_max_and_huge_is_loop_2(trained, name):
    _, model, X, Y = trained
    for threshold, loop in ((0.0, R_MAX), (1e9, MIN_EXIT_LOOP)):
        per_window, (masked_loss, masked_loops), _ = harness_and_reading(model, X, Y, name, threshold)
        assert (per_window[name, "loops"] == loop).all() and (masked_loops == loop).all()
        np.testing.assert_allclose(per_window[name, "loss"][0], per_window["uniform", "loss"][loop - 1])
        np.testing.assert_allclose(per_window[name, "loss"][0], masked_loss.double().mean(1).numpy(), atol=1e-5)


@pytest.mark.parametrize("name", ["kl", "state"])
def test_stopped_tokens_stop_changing_in_the_harness(trained, name):
    _, model, X, Y = trained
    test = EXIT_TESTS[name]
    traced = trace_for_policies(model, torch.cat([X, Y[:, -1:]], 1), 8)
    threshold = traced[name][2].median().item()  # about half stop by loop 3
    short_loss, short_loops = masked_exit(model, X, Y, DepthPolicy(test, threshold, 4))
    loss, loops = masked_exit(model, X, Y, DepthPolicy(test, threshold, R_MAX))
    stopped = short_loops < 4  # stopped before the short run's last loop
    assert 0.2 < stopped.float().mean() < 1 and torch.all(loops[~stopped] >= 4)
    # on this model every token's state change falls below a loop-3 median by loop 4
    assert (loops > 4).any() or name == "state"
    assert torch.equal(loops[stopped], short_loops[stopped])
    if name == "kl":  # four more loops did not change their carried distributions
        assert torch.equal(loss[stopped], short_loss[stopped])


@pytest.mark.parametrize("name", ["kl", "state", "probe"])
def test_the_reading_matches_the_masking_harness(trained, name, monkeypatch):
    """The reading's only difference from the paper's harness is by design: a token is read as if
    alone, where in the harness the others see its held state once it stops. On this model, at a threshold
    where the exits really differ, it moves the mean loss by under 0.001 nats (0.002 for A2's toy probe, measured
    at 0.0014) and the mean loops by under 0.1: less than the effects the paper reports (0.0003-0.0022 nats)."""
    _, model, X, Y = trained
    with_a_probe(monkeypatch)
    traced = trace_for_policies(model, torch.cat([X, Y[:, -1:]], 1), 8)
    threshold = traced[name][2].median().item()
    per_window, (masked_loss, masked_loops), _ = harness_and_reading(model, X, Y, name, threshold)
    assert 2.5 < masked_loops.float().mean() < R_MAX - 0.5  # the exits really differ
    tolerance = 0.002 if name == "probe" else 0.001
    assert abs(per_window[name, "loss"].mean() - masked_loss.double().mean().item()) < tolerance
    assert abs(per_window[name, "loops"].mean() - masked_loops.double().mean().item()) < 0.1


def test_the_trace_runs_under_bf16_autocast_with_float32_scores(trained):
    _, model, X, Y = trained
    with autocast("cpu", "bfloat16"):
        traced = trace_for_policies(model, torch.cat([X, Y[:, -1:]], 1), 8)
    assert traced["loss"].dtype == traced["kl"].dtype == traced["state"].dtype == torch.float32
    assert torch.isfinite(traced["loss"]).all() and (traced["kl"][1:] >= 0).all()


class OpCount(TorchDispatchMode):
    """FLOPs of the aten ops run, by one stated rule: 1 per output element of an elementwise op, 4 per element
    of a log-softmax (subtract the max, exp, sum, subtract the log-sum), 1 per input element of a sum, 2 of a
    norm (a square and a sum) and of a matrix-vector product (a multiply and an add); none for moving data.
    Any other op is refused, so that a new op in an exit test fails here until the ledger counts it."""
    PER_OUTPUT = {"aten._log_softmax.default": 4, "aten.exp.default": 1, "aten.sub.Tensor": 1, "aten.mul.Tensor": 1,
                  "aten.div.Tensor": 1, "aten.add.Tensor": 1, "aten.clamp_min.default": 1}
    PER_INPUT = {"aten.sum.dim_IntList": 1, "aten.linalg_vector_norm.default": 2, "aten.mv.default": 2}
    FREE = {"aten.view.default", "aten.split.Tensor", "aten.cat.default", "aten.slice.Tensor", "aten.select.int",
            "aten._to_copy.default", "aten.detach.default", "aten._local_scalar_dense.default", "aten.squeeze.dim"}

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if name in self.PER_OUTPUT:
            self.flops += self.PER_OUTPUT[name] * out.numel()
        elif name in self.PER_INPUT:
            self.flops += self.PER_INPUT[name] * args[0].numel()
        elif name not in self.FREE:
            raise AssertionError(f"{name}: not in the counting rule")
        return out


@pytest.mark.parametrize("name", ["kl", "state", "probe"])
def test_exit_test_costs_are_the_ops_they_run(name):
    """Each exit test's FLOPs per token in the ledger (model.EXIT_TESTS, studies.probe's A2) against the
    ops its score runs, counted by OpCount: their growth per vocabulary entry (KL) or state channel."""
    tokens = 3

    def counted(n):  # the score's FLOPs on `tokens` tokens with n channels
        a, b = torch.randn(2, tokens, n)
        if name == "probe":
            test = probe_exit_test(fit_probe(torch.randn(40, n), torch.rand(40) < 0.5))
        else:
            test = EXIT_TESTS[name]
        with OpCount() as count:
            test.score(a, b, a, b)
        return count.flops, test

    (small, _), (large, test) = counted(20), counted(50)
    per_channel = (large - small) / (50 - 20) / tokens  # what does not grow with the channels cancels
    assert per_channel == test.flops(SimpleNamespace(vocab_size=1, n_embd=1))


# ---- token classes -------------------------------------------------------------------------------
def test_byte_tokenizer_reads_byte_ids():
    tok = byte_tokenizer()
    text = "Tab\there, é 1999!"
    ids = list(text.encode())
    assert tok.encode(text).ids == ids and tok.decode(ids) == text
    assert tok.decode([32]) == " " and tok.decode([0xc3]) == "\ufffd"


# ---- the command line -----------------------------------------------------------------------------
ALLOCATE_FAST = ["--out_dir=out", "--windows=6", "--train_windows=2", "--batch_size=4", "--n_grid=12",
                 "--bootstrap=50"]


def test_main_writes_the_table_and_the_bar_in_loops_and_flops(trained, monkeypatch):
    root, model, *_ = trained
    monkeypatch.chdir(root)
    res = allocate.main(ALLOCATE_FAST)
    saved = json.loads((root / "out" / "allocate.json").read_text())
    assert saved["r_max"] == R_MAX and saved["args"]["r_max"] == 0  # the model's max_loops, recorded
    per_window = {policy: {measure: np.array(values) for measure, values in measures.items()}
                  for policy, measures in saved["per_window"].items()}
    assert list(per_window) == ["uniform", *EXIT_TESTS]  # every registered exit test, by its name
    uniform = per_window["uniform"]
    assert saved["bar"] == uniform["loss"][2].mean() == res["bar"]
    assert uniform["loops"][:, 0].tolist() == saved["settings"]["uniform"] == list(range(1, R_MAX + 1))
    assert saved["checkpoint"].endswith("@60")
    for name, test in EXIT_TESTS.items():
        assert len(saved["settings"][name]) == len(per_window[name]["loops"]) == 12
        assert (2 <= per_window[name]["loops"]).all() and (per_window[name]["loops"] <= R_MAX).all()
        assert np.isfinite(per_window[name]["loss"]).all()
        assert saved["operating_thresholds"][name] in saved["settings"][name]
        assert saved["labels"][name] == test.label
    at_bar = saved["at_bar"]["uniform"]
    uniform_flops_at_bar = model.inference_flops(at_bar["loops"]["value"], 32)  # linear in loops
    assert at_bar["flops"]["value"] == pytest.approx(uniform_flops_at_bar)
    assert at_bar["loops"]["value"] <= 3
    d = per_window["kl"]["loops"][0]  # per window: the KL exit pays a readout and a test every loop
    kl_flops = model.inference_flops(d, 32) + (d - 1) * (model.flop_terms(32)[2] + EXIT_TESTS["kl"].flops(model.config))
    assert per_window["kl"]["flops"][0] == pytest.approx(kl_flops)
    assert per_window["kl"]["loss"].shape == (12, 6)


def top1_score(s_new, s_old, logits_new, logits_old):
    """A third exit test: the change in the top-1 probability between two loops."""
    top1 = torch.softmax(logits_new.float(), -1).amax(-1)
    return (top1 - torch.softmax(logits_old.float(), -1).amax(-1)).abs()


def test_a_third_exit_test_registered_in_one_place_runs_through_every_script(trained, monkeypatch, capsys):
    """One entry in model.EXIT_TESTS, no other edit: evaluate.trace records its scores, allocate.py reads its
    policy off them (table, intervals, operating threshold), sample.py --exit runs it at that threshold, and
    evaluate.py still runs."""
    root, model, X, Y = trained
    top1 = model_lib.ExitTest(top1_score, lambda config: 4 * config.vocab_size, needs_logits=True,
                              threshold=0.01, label="A1p")
    monkeypatch.setitem(model_lib.EXIT_TESTS, "top1", top1)
    traced = evaluate.trace(model, X, Y, 3)
    assert torch.isinf(traced["top1"][0]).all() and (traced["top1"][1:] >= 0).all()
    monkeypatch.chdir(root)
    res = allocate.main(ALLOCATE_FAST)
    assert res["labels"]["top1"] == "A1p" and "top1" in res["at_bar"]
    assert "| top1 (A1p) |" in capsys.readouterr().out
    threshold = res["operating_thresholds"]["top1"]
    assert threshold in res["settings"]["top1"]
    generated = sample.main(["--out_dir=out", "--start=The", "--exit=top1", "--max_new_tokens=4", "--num_samples=1"])
    assert f"--exit=top1 at threshold {threshold:.3g}: allocate.py's" in capsys.readouterr().err
    assert generated["new_ids"] and max(generated["loops"][0][1:]) <= R_MAX
    evaluate.main(["--out_dir=out", "--windows=2", "--batch_size=2", "--loops=1,2"])
    os.remove("out/allocate.json")  # the module's checkpoint is shared by the tests after this one


def one_line_error(capsys, *args):
    """allocate.py with args must refuse them: exit 2 and one line on stderr, through configurator.run."""
    stderr = stderr_of_a_refusal(capsys, allocate.main, args)
    assert stderr.startswith("error: ") and stderr.count("\n") == 1, stderr
    return stderr


def test_numeric_settings_refuse_odd_values_in_one_line(trained, monkeypatch, capsys):
    monkeypatch.chdir(trained[0])
    numeric = [k for k, (default, _) in configurator.read_settings(vars(allocate)).items()
               if type(default) in (int, float)]
    for key in numeric:
        for value in ("-1", "1e999", "nan", "True", "'x'"):
            with pytest.raises(UserError) as err:
                allocate.main(["--out_dir=out", f"--{key}={value}"])
            assert f"--{key}" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("args", [["--out_dir=nowhere"], ["--out_dir=out", "--r_max=-1"], ["--out_dir=out", "--r_max=2"],
                                  ["--out_dir=out", "--windows=1000000"], ["--out_dir=out", "--r_max=x"],
                                  ["--out_dir=out", "--dtype=float16"], ["--out_dir=out", "--device=cpu:0"]])
def test_bad_input_is_one_line(trained, monkeypatch, capsys, args):
    monkeypatch.chdir(trained[0])
    one_line_error(capsys, *args)


def test_checkpoint_without_its_dataset_is_one_line(trained, tmp_path, monkeypatch, capsys):
    (tmp_path / "out").mkdir()
    os.link(trained[0] / "out" / "ckpt.pt", tmp_path / "out" / "ckpt.pt")
    monkeypatch.chdir(tmp_path)
    assert "data/tiny" in one_line_error(capsys, "--out_dir=out")


def test_a_dataset_prepared_again_is_refused_before_the_work(trained, tmp_path, monkeypatch, capsys):
    """The same name and tokenizer, another split (as prepare.py --val_fraction=0.5 would give): refused."""
    shutil.copytree(trained[0] / "data", tmp_path / "data")
    (tmp_path / "out").mkdir()
    os.link(trained[0] / "out" / "ckpt.pt", tmp_path / "out" / "ckpt.pt")
    meta = json.loads((tmp_path / "data" / "tiny" / "meta.json").read_text())
    val = tmp_path / "data" / "tiny" / "val.bin"
    np.concatenate([np.fromfile(val, dtype=np.uint16)] * 2).tofile(val)  # a val split twice as long
    (tmp_path / "data" / "tiny" / "meta.json").write_text(json.dumps(meta | {"val_tokens": meta["val_tokens"] * 2}))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(allocate, "trace_windows", lambda *a, **k: pytest.fail("traced before the check"))
    assert "data/tiny is not the dataset out/ckpt.pt was trained on: val_tokens" in one_line_error(capsys, "--out_dir=out")


@pytest.mark.cuda
def test_on_cuda_allocate_gives_the_cpus_uniform_losses_and_every_policy(trained, tmp_path, monkeypatch):
    """allocate.py with its defaults on a GPU machine (cuda, float32), on the tiny checkpoint: uniform depth's
    losses (the bar among them) as the CPU gives them, up to the GPU's kernels, and every policy read off."""
    root, *_ = trained
    (tmp_path / "out").mkdir()
    os.link(root / "out" / "ckpt.pt", tmp_path / "out" / "ckpt.pt")  # its own allocate.json, not the module's
    monkeypatch.chdir(root)  # where its dataset is
    args = [f"--out_dir={tmp_path / 'out'}", *ALLOCATE_FAST[1:]]
    on_the_gpu = allocate.main(args)
    on_the_cpu = allocate.main(args + ["--device=cpu"])
    assert (on_the_gpu["args"]["device"], on_the_gpu["args"]["dtype"]) == ("cuda", "float32")
    assert on_the_gpu["bar"] == pytest.approx(on_the_cpu["bar"], rel=1e-3)
    gpu_losses = np.array(on_the_gpu["per_window"]["uniform"]["loss"])
    np.testing.assert_allclose(gpu_losses, np.array(on_the_cpu["per_window"]["uniform"]["loss"]), rtol=1e-3)
    for name in EXIT_TESTS:
        loops = np.array(on_the_gpu["per_window"][name]["loops"])
        assert (MIN_EXIT_LOOP <= loops).all() and (loops <= R_MAX).all(), name
