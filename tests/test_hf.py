"""Tests for hf/: a tiny nanoloop checkpoint exported to the Hugging Face format, loaded offline by
transformers, and brought back. References: GPT.forward's logits at every depth, sample.py's
greedy tokens and the loops each ran (uniform depth and both exits), model.EXIT_TESTS's scores,
lm-eval's hf model against log-likelihoods computed by hand, and the round trip's logits.
Skipped without transformers."""
import ast
import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import allocate
import evaluate
import model as model_lib
import prepare
import sample
from conftest import stderr_of_a_refusal
from test_downstream import write_local_task

transformers = pytest.importorskip("transformers")

from hf import FOLDER_FILES, MODEL_FILES, TESTED_TRANSFORMERS, checkpoint, export  # noqa: E402
from hf import modeling_nanoloop  # noqa: E402

MAX_LOOPS = 4
MODEL_ARGS = dict(vocab_size=300, block_size=32, n_embd=32, n_head=2, n_kv_head=1, ffn_hidden=64,
                  n_prelude=1, n_core=2, n_coda=1, mean_loops=2, max_loops=MAX_LOOPS, bptt_k=4)
PROMPTS = ["The king said to my lord", "Sweet love"]
# the thresholds of out/allocate.json (the fixture's): generate's defaults at r_max = MAX_LOOPS
CALIBRATED = {"kl": 0.0123, "state": 0.0456}


# ---- the tiny checkpoint, its dataset and its folder --------------------------------------------
def make_dataset(root):
    """data/tiny: a 300-entry byte-level BPE over text with multi-byte characters (café, 日本)."""
    rng = random.Random(0)
    words = "the king queen said to a of and my lord good night café 日本 sweet love thou art"
    docs = []
    for _ in range(60):
        lines = [" ".join(rng.choice(words.split()) for _ in range(rng.randint(3, 9))) + "."
                 for _ in range(rng.randint(3, 8))]
        docs.append("\n".join(line.capitalize() for line in lines) + "\n")
    tok = prepare.train_bpe(300, docs)
    folder = root / "data" / "tiny"
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    counts = {}
    for split, part in (("train", docs[:54]), ("val", docs[54:])):
        ids = [i for doc in part for i in tok.encode(doc, add_special_tokens=False).ids + [0]]
        np.asarray(ids, dtype=np.uint16).tofile(folder / f"{split}.bin")
        counts |= {f"{split}_tokens": len(ids), f"{split}_bytes": len("".join(part).encode())}
    sha256 = hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()
    meta = dict(source="tiny", tokenizer="bpe:300", vocab_size=300, eot_id=0, dtype="uint16",
                tokenizer_sha256=sha256, **counts)
    (folder / "meta.json").write_text(json.dumps(meta))
    return meta


def make_checkpoint(root, meta):
    """out/ckpt.pt as train.py saves one: the tiny model after 250 AdamW steps at depths 1 to
    MAX_LOOPS (enough for greedy text that does not repeat one token); beside it an eval.json and
    an allocate.json of this checkpoint, in the scripts' formats."""
    torch.manual_seed(0)
    model = model_lib.GPT(model_lib.GPTConfig(**MODEL_ARGS))
    train_bin = np.fromfile(root / "data/tiny/train.bin", dtype=np.uint16)
    data = torch.from_numpy(train_bin.astype(np.int64))
    optimizer = model.configure_optimizers(0.1, 3e-3, (0.9, 0.95), "cpu")
    g = torch.Generator().manual_seed(0)
    for step in range(250):
        starts = torch.randint(len(data) - 33, (8,), generator=g).tolist()
        x = torch.stack([data[i:i + 32] for i in starts])
        y = torch.stack([data[i + 1:i + 33] for i in starts])
        loss = nanoloop_loss(model, x, y, 1 + step % MAX_LOOPS, "noise")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    (root / "out").mkdir()
    ckpt = {"format": model_lib.CKPT_FORMAT, "model_args": vars(model.config),
            "config": {"dataset": "tiny", "dataset_meta": meta, "run_id": "tiny0001"},
            "model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": 250,
            "rng": {}}
    torch.save(ckpt, root / "out" / "ckpt.pt")
    checkpoint_id = model_lib.checkpoint_id(ckpt)
    elasticity = [{"loops": r, "loss": 5.0 - r / 10, "bits_per_byte": 3.0 - r / 10}
                  for r in (1, 2, 4)]
    evaluation = {"checkpoint": checkpoint_id, "args": {"windows": 8}, "rows": elasticity,
                  "median_convergence_depth": 3}
    (root / "out" / "eval.json").write_text(json.dumps(evaluation))
    allocation = {"checkpoint": checkpoint_id, "r_max": MAX_LOOPS, "args": {"dtype": "float32"},
                  "windows": 8, "operating_thresholds": CALIBRATED}
    (root / "out" / "allocate.json").write_text(json.dumps(allocation))


def nanoloop_logits(model, idx, loops):
    """GPT.forward's logits (B, T, V) from a zero state (it returns them, or (logits, None))."""
    out = model(idx, loops=loops, state_init="zero")
    return out[0] if isinstance(out, tuple) else out


def nanoloop_loss(model, idx, targets, loops, state_init="zero"):
    """GPT.forward's mean loss (it returns the loss, or (None, loss))."""
    out = model(idx, targets, loops=loops, state_init=state_init)
    return out[1] if isinstance(out, tuple) else out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    make_checkpoint(root, make_dataset(root))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        export.main(["--out_dir=out", "--to=hf-tiny"])
    return root


@pytest.fixture
def indir(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    return workdir


@pytest.fixture(scope="module")
def loaded(workdir):
    """(the exported folder loaded by transformers, its tokenizer, the nanoloop model of out/)."""
    folder = str(workdir / "hf-tiny")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    nanoloop_model, _ = model_lib.load_checkpoint(str(workdir / "out" / "ckpt.pt"))
    return hf_model, tokenizer, nanoloop_model


def encoded(tokenizer, text):
    return torch.tensor([tokenizer.encode(text)])


# ---- the folder ---------------------------------------------------------------------------------
def imported_packages(path):
    """The top-level packages a Python file imports (relative imports left out)."""
    packages = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            packages |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            packages.add(node.module.split(".")[0])
    return packages


def test_the_folder_holds_what_transformers_loads_and_its_code_imports_no_nanoloop(workdir):
    folder = workdir / "hf-tiny"
    assert set(os.listdir(folder)) == FOLDER_FILES
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration_nanoloop.NanoloopConfig",
                                  "AutoModelForCausalLM": "modeling_nanoloop.NanoloopForCausalLM"}
    assert {key: config[key] for key in MODEL_ARGS} == MODEL_ARGS and config["num_loops"] == 2
    # the tied embedding stored once, under the base model's name
    from safetensors import safe_open
    with safe_open(folder / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
    assert "lm_head.weight" not in names and "model.wte.weight" in names
    tokenizer_json = (workdir / "data" / "tiny" / "tokenizer.json").read_bytes()
    assert (folder / "tokenizer.json").read_bytes() == tokenizer_json
    for name in MODEL_FILES:
        assert (folder / name).read_bytes() == (Path(export.__file__).parent / name).read_bytes()
        allowed = {"dataclasses", "typing", "torch", "transformers"}
        assert imported_packages(folder / name) <= allowed


def test_the_tokenizer_loads_alone_and_encodes_as_the_datasets(loaded, workdir, monkeypatch):
    """Without trust_remote_code too: transformers, reading config.json first, would ask on a
    terminal whether to run its code; with no time to answer (as in its own CI), it reads on."""
    _, tokenizer, _ = loaded
    monkeypatch.setattr(transformers.dynamic_module_utils, "TIME_OUT_REMOTE_CODE", 0)
    alone = transformers.AutoTokenizer.from_pretrained(str(workdir / "hf-tiny"))
    encode, decode = prepare.load_tokenizer(str(workdir / "data" / "tiny"))
    assert isinstance(alone, transformers.PreTrainedTokenizerFast)
    assert alone.eos_token == "<|endoftext|>" == prepare.EOT and alone.eos_token_id == 0
    for text in ["The king said", "Good night café 日本.\n", " thou art"]:
        assert alone.encode(text) == tokenizer.encode(text) == encode(text)
        assert alone.decode(encode(text)) == decode(encode(text)) == text


def test_the_exit_tests_score_as_nanoloops():
    """The modeling file's own exit tests (it imports no nanoloop): the same names, scores,
    readouts and default thresholds as model.EXIT_TESTS."""
    assert set(modeling_nanoloop.EXIT_TESTS) == set(model_lib.EXIT_TESTS)
    assert modeling_nanoloop.MIN_EXIT_LOOP == model_lib.MIN_EXIT_LOOP
    g = torch.Generator().manual_seed(0)
    s_new, s_old = torch.randn(2, 3, 5, 16, generator=g)
    logits_new, logits_old = 3 * torch.randn(2, 3, 5, 300, generator=g)
    # where two readouts agree, KL 0
    logits_new[0, 0] = logits_old[0, 0]
    for name, mine in modeling_nanoloop.EXIT_TESTS.items():
        theirs = model_lib.EXIT_TESTS[name]
        assert mine.needs_logits == theirs.needs_logits and mine.threshold == theirs.threshold
        expected = theirs.score(s_new, s_old, logits_new, logits_old)
        torch.testing.assert_close(mine.score(s_new, s_old, logits_new, logits_old), expected,
                                   rtol=1e-6, atol=1e-7)


# ---- logits and loss ----------------------------------------------------------------------------
def test_logits_at_every_depth_are_gpt_forwards_with_left_padding(loaded):
    """r = 1..max_loops, in float32: a batch of two prompts, left-padded with an attention_mask;
    each row's real tokens get GPT.forward's logits of that row alone."""
    hf_model, tokenizer, nanoloop_model = loaded
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    # the short prompt is padded on the left
    assert batch.attention_mask[1, 0] == 0
    with torch.no_grad():
        for r in range(1, MAX_LOOPS + 1):
            logits = hf_model(**batch, num_loops=r).logits
            for row, text in enumerate(PROMPTS):
                ids = encoded(tokenizer, text)
                expected = nanoloop_logits(nanoloop_model, ids, r)[0]
                torch.testing.assert_close(logits[row, -ids.size(1):], expected, rtol=0, atol=1e-5)
                alone = hf_model(ids, num_loops=r).logits[0]
                torch.testing.assert_close(alone, expected, rtol=0, atol=1e-5)
        default = hf_model(batch.input_ids[:1]).logits
        torch.testing.assert_close(default, hf_model(batch.input_ids[:1], num_loops=2).logits)


def test_the_loss_with_labels_is_nanoloops(loaded):
    hf_model, tokenizer, nanoloop_model = loaded
    ids = encoded(tokenizer, "The king said to my lord good night")
    with torch.no_grad():
        for r in (1, 3):
            loss = hf_model(ids, labels=ids, num_loops=r).loss
            expected = nanoloop_loss(nanoloop_model, ids[:, :-1], ids[:, 1:], r)
            torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)


def test_a_position_past_block_size_is_a_clear_error(loaded):
    hf_model, tokenizer, _ = loaded
    ids = encoded(tokenizer, "The king said to my lord")
    assert hf_model.config.max_position_embeddings == MODEL_ARGS["block_size"]
    with pytest.raises(ValueError, match="block_size = max_position_embeddings = 32"):
        hf_model.generate(ids, max_new_tokens=40, do_sample=False)
    with pytest.raises(ValueError, match="past the model's context"):
        hf_model(torch.zeros(1, 33, dtype=torch.long))


# ---- generation against sample.py ---------------------------------------------------------------
def sampled(*args):
    """sample.py's greedy tokens and the loops each new token was read after, of one sample, as
    lists: sample.main returns {"new_ids", "loops"} (earlier, the new ids alone: loops None)."""
    result = sample.main(["--out_dir=out", "--device=cpu", "--temperature=0", "--num_samples=1",
                          "--max_new_tokens=20", *args])
    if isinstance(result, dict):
        return result["new_ids"][0], result["loops"][0]
    return result[0], None


def generated(hf_model, batch, **depth):
    """generate's 20 greedy new tokens of each row, EOT not stopping it (as in sample.py) ->
    (tokens (B, 20), the loops each was read after (B, 20))."""
    out = hf_model.generate(**batch, do_sample=False, max_new_tokens=20, eos_token_id=None,
                            **depth)
    return out[:, -20:], hf_model.generation_loops


def exit_scores(nanoloop_model, tokenizer, name):
    """The exit test's scores after loops 2..MAX_LOOPS over the prompts' tokens, flattened."""
    test = model_lib.EXIT_TESTS[name]
    scores = []
    with torch.no_grad():
        for text in PROMPTS:
            e = nanoloop_model.prelude(encoded(tokenizer, text))
            s = torch.zeros_like(e)
            logits = nanoloop_model.readout(s)
            for loop in range(1, MAX_LOOPS + 1):
                s_new = nanoloop_model.core_step(e, s)
                new_logits = nanoloop_model.readout(s_new)
                if loop >= 2:
                    scores.append(test.score(s_new, s, new_logits, logits).flatten())
                s, logits = s_new, new_logits
    return torch.cat(scores)


def varied_threshold(loaded, batch, name):
    """A threshold of exit test `name` at which generate's new tokens stop at more than one depth:
    the first of the scores' upper quantiles that does (decoded tokens settle later)."""
    hf_model, tokenizer, nanoloop_model = loaded
    scores = exit_scores(nanoloop_model, tokenizer, name)
    for quantile in (0.5, 0.6, 0.7, 0.8, 0.9, 0.95):
        # off the scores themselves, so that no rounding can move a token across it
        threshold = scores.quantile(quantile).item() * 1.001
        _, loops_read = generated(hf_model, batch, num_loops=2, exit=name,
                                  exit_threshold=threshold, r_max=MAX_LOOPS)
        if len(set(loops_read[:, 1:].flatten().tolist())) > 1:
            return threshold
    raise AssertionError(f"no threshold of {name} stops the tiny model's tokens at varied depths")


@pytest.mark.parametrize("loops", [1, 2, MAX_LOOPS])
def test_greedy_generate_is_sample_pys_for_a_batch_and_each_sequence_alone(loaded, indir, loops):
    hf_model, tokenizer, _ = loaded
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    tokens, loops_read = generated(hf_model, batch, num_loops=loops)
    assert (loops_read == loops).all()
    for row, text in enumerate(PROMPTS):
        one = tokenizer([text], return_tensors="pt")
        alone, alone_loops = generated(hf_model, one, num_loops=loops)
        expected, expected_loops = sampled(f"--start={text}", f"--loops={loops}")
        assert tokens[row].tolist() == alone[0].tolist() == expected
        assert expected_loops in (None, alone_loops[0].tolist())


@pytest.mark.parametrize("exit", ["kl", "state"])
def test_generate_with_an_exit_is_sample_pys_tokens_and_loops(loaded, indir, exit):
    """Prompts at 2 loops, each new token until its exit test stops it (r_max = MAX_LOOPS): the
    tokens and the loops each new token was read after, sample.py's, batched or alone."""
    hf_model, tokenizer, _ = loaded
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    threshold = varied_threshold(loaded, batch, exit)
    depth = dict(num_loops=2, exit=exit, exit_threshold=threshold, r_max=MAX_LOOPS)
    tokens, loops_read = generated(hf_model, batch, **depth)
    assert (loops_read[:, 0] == 2).all()
    for row, text in enumerate(PROMPTS):
        alone, alone_loops = generated(hf_model, tokenizer([text], return_tensors="pt"), **depth)
        expected, expected_loops = sampled(f"--start={text}", "--loops=2", f"--exit={exit}",
                                           f"--exit_threshold={threshold}", f"--r_max={MAX_LOOPS}")
        assert tokens[row].tolist() == alone[0].tolist() == expected
        assert loops_read[row].tolist() == alone_loops[0].tolist()
        assert expected_loops in (None, loops_read[row].tolist())


@pytest.mark.parametrize("exit", ["kl", "state"])
def test_an_exit_stops_from_loop_2_and_at_r_max_at_the_latest(loaded, exit):
    hf_model, tokenizer, _ = loaded
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    uniform, _ = generated(hf_model, batch, num_loops=3)
    never, loops_read = generated(hf_model, batch, num_loops=3, exit=exit, exit_threshold=0.0,
                                  r_max=3)
    assert torch.equal(never, uniform) and (loops_read == 3).all()
    _, loops_read = generated(hf_model, batch, num_loops=3, exit=exit, exit_threshold=1e9,
                              r_max=3)
    assert (loops_read[:, 0] == 3).all() and (loops_read[:, 1:] == 2).all()


def test_a_nan_score_stops_no_token(workdir, monkeypatch):
    """The modeling file's class itself (not the folder's copy), its state exit scoring NaN: every
    new token runs r_max loops, as model.keeps_looping has it."""
    hf_model = modeling_nanoloop.NanoloopForCausalLM.from_pretrained(str(workdir / "hf-tiny"))

    def nan_score(s_new, s_old, logits_new, logits_old):
        return torch.full(s_new.shape[:-1], float("nan"))
    nan_test = modeling_nanoloop.ExitTest(nan_score, needs_logits=False, threshold=0.05)
    monkeypatch.setitem(modeling_nanoloop.EXIT_TESTS, "state", nan_test)
    ids = torch.tensor([[5, 80, 120, 7]])
    hf_model.generate(ids, exit="state", r_max=3, max_new_tokens=4, do_sample=False)
    assert hf_model.generation_loops.tolist() == [[2, 3, 3, 3]]
    depth = model_lib.DepthPolicy(model_lib.EXIT_TESTS["state"], 0.05, 3)
    assert model_lib.keeps_looping(2, torch.tensor(float("nan")), depth)


def test_the_loops_come_back_on_generates_output_too(loaded):
    hf_model, tokenizer, _ = loaded
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    out = hf_model.generate(**batch, num_loops=2, exit="state", max_new_tokens=5, do_sample=False,
                            return_dict_in_generate=True)
    assert out.loops.shape == (2, 5) and torch.equal(out.loops, hf_model.generation_loops)


def test_without_the_cache_each_step_is_gpt_forward_of_the_sequence_so_far(loaded):
    """use_cache=False: every step runs the whole sequence at num_loops, nanoGPT's uncached loop
    over GPT.forward; at 1 loop this is the cached decode, deeper its logits differ. An exit needs
    the cache."""
    hf_model, tokenizer, nanoloop_model = loaded
    ids = encoded(tokenizer, "The king said to my lord")
    greedy = dict(do_sample=False, max_new_tokens=12, eos_token_id=None)
    for r in (1, 3):
        uncached = hf_model.generate(ids, num_loops=r, use_cache=False, **greedy)
        reference = ids
        with torch.no_grad():
            for _ in range(12):
                next_token = nanoloop_logits(nanoloop_model, reference, r)[:, -1].argmax(-1)
                reference = torch.cat([reference, next_token[:, None]], dim=1)
        assert torch.equal(uncached, reference)
    # the same logits at 1 loop; deeper, the cache holds each earlier token's last loop
    scored = dict(greedy, return_dict_in_generate=True, output_logits=True)
    for r, same in ((1, True), (3, False)):
        cached = hf_model.generate(ids, num_loops=r, **scored).logits
        uncached = hf_model.generate(ids, num_loops=r, use_cache=False, **scored).logits
        differences = [(a - b).abs().max().item() for a, b in zip(cached, uncached)]
        assert (max(differences) < 1e-5) == same
    with pytest.raises(ValueError, match="exits need the cache"):
        hf_model.generate(ids, exit="kl", use_cache=False, max_new_tokens=2)


def test_an_unknown_exit_or_depth_is_refused(loaded):
    hf_model, tokenizer, _ = loaded
    ids = encoded(tokenizer, "The king")
    with pytest.raises(ValueError, match="exit must be 'none' or one of kl, state"):
        hf_model.generate(ids, exit="never", max_new_tokens=2)
    with pytest.raises(ValueError, match="r_max must be at least 2"):
        hf_model.generate(ids, exit="kl", r_max=1, max_new_tokens=2)
    with pytest.raises(ValueError, match="not used by the model"):
        hf_model.generate(ids, exitt="kl", max_new_tokens=2)


def test_the_calibrated_thresholds_are_defaults_at_their_r_max_and_dtype(loaded, workdir):
    hf_model, _, _ = loaded
    assert hf_model.config.operating_thresholds == CALIBRATED
    for name, threshold in CALIBRATED.items():
        default = model_lib.EXIT_TESTS[name].threshold
        assert hf_model.depth(exit=name)[1].threshold == threshold
        assert hf_model.depth(exit=name, exit_threshold=0.5)[1].threshold == 0.5
        assert hf_model.depth(exit=name, r_max=3)[1].threshold == default
    folder = str(workdir / "hf-tiny")
    in_bf16 = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True,
                                                                dtype=torch.bfloat16)
    assert in_bf16.depth(exit="kl")[1].threshold == model_lib.EXIT_TESTS["kl"].threshold
    ids = torch.tensor([[5, 80, 120, 7]])
    with torch.no_grad():
        close_to = hf_model(ids).logits
        torch.testing.assert_close(in_bf16(ids).logits.float(), close_to, atol=0.2, rtol=0.05)


def test_the_model_card_says_what_out_dir_holds(workdir):
    card = (workdir / "hf-tiny" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert '# hf-tiny\n' in card and 'from_pretrained("hf-tiny", trust_remote_code=True)' in card
    assert "Checkpoint `tiny0001@250` of dataset `tiny`" in card
    assert "| 4 | 4.6000 | 2.6000 |" in card and "Median convergence depth" in card
    assert "`kl` 0.0123, `state` 0.0456" in card and f"r_max =\n{MAX_LOOPS} in float32" in card
    assert all(version in card for version in TESTED_TRANSFORMERS) and "use_cache=False" in card


# ---- lm-eval ------------------------------------------------------------------------------------
ITEMS = [{"context": "The king said to my", "choices": ["lord", "café"], "label": 0},
         {"context": "Good night sweet", "choices": ["love", "the"], "label": 0},
         {"context": "Thou art", "choices": ["good", "said"], "label": 1},
         {"context": "My lord", "choices": ["queen", "of"], "label": 1}]


def log_likelihood(model, tokenizer, context, continuation, loops):
    """log p(continuation | context) from GPT.forward's logits at `loops`, tokenized as lm-eval
    does: the pair whole, its first tokens the context's."""
    context_ids = tokenizer.encode(context)
    whole = tokenizer.encode(context + continuation)
    with torch.no_grad():
        logits = nanoloop_logits(model, torch.tensor([whole[:-1]]), loops)[0]
    log_probs = logits.log_softmax(-1)
    return sum(log_probs[i - 1, whole[i]].item() for i in range(len(context_ids), len(whole)))


def test_lm_evals_hf_model_scores_a_local_task_at_the_depth_asked(loaded, workdir):
    """hf/README.md's command through lm-eval's Python API: each choice's log-likelihood is the
    one GPT.forward's logits at num_loops=3 give by hand (not at 1 loop), and the accuracy the
    one they give."""
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    _, tokenizer, nanoloop_model = loaded
    readme = (Path(export.__file__).parent / "README.md").read_text()
    command = "--model hf --model_args pretrained=hf-shakespeare,trust_remote_code=True,num_loops="
    assert command in readme
    write_local_task(workdir / "tasks", "tiny_mc", ITEMS)
    folder = workdir / "hf-tiny"
    model_args = f"pretrained={folder},trust_remote_code=True,num_loops=3,dtype=float32"
    manager = TaskManager(include_path=str(workdir / "tasks"), include_defaults=False)
    result = simple_evaluate(model="hf", model_args=model_args, tasks=["tiny_mc"],
                             task_manager=manager, device="cpu", batch_size=2, log_samples=True)
    scored = {}
    for row in result["samples"]["tiny_mc"]:
        scored[row["doc_id"]] = [response[0] for response in row["filtered_resps"]]
    correct = []
    at_one_loop = []
    for doc_id, item in enumerate(ITEMS):
        # lm-eval puts its target delimiter, a space, before each choice
        by_hand = [log_likelihood(nanoloop_model, tokenizer, item["context"], f" {choice}", 3)
                   for choice in item["choices"]]
        assert scored[doc_id] == pytest.approx(by_hand, abs=1e-4)
        correct.append(int(np.argmax(by_hand)) == item["label"])
        at_one_loop += [log_likelihood(nanoloop_model, tokenizer, item["context"], f" {choice}", 1)
                        for choice in item["choices"]]
    assert result["results"]["tiny_mc"]["acc,none"] == pytest.approx(np.mean(correct))
    all_scored = [value for doc_id in sorted(scored) for value in scored[doc_id]]
    assert all_scored != pytest.approx(at_one_loop, abs=1e-3)


# ---- back to a nanoloop checkpoint --------------------------------------------------------------
def test_back_to_a_checkpoint_that_gives_the_same_logits_and_runs_the_scripts(indir, capsys):
    checkpoint.main(["--from=hf-tiny", "--out_dir=back", "--dataset=tiny"])
    original, ckpt = model_lib.load_checkpoint("out/ckpt.pt")
    imported, back = model_lib.load_checkpoint("back/ckpt.pt")
    assert back["model_args"] == ckpt["model_args"] and back["config"]["dataset"] == "tiny"
    ids = torch.tensor([[5, 80, 120, 7, 33, 2]])
    with torch.no_grad():
        for r in range(1, MAX_LOOPS + 1):
            expected = nanoloop_logits(original, ids, r)
            assert torch.equal(nanoloop_logits(imported, ids, r), expected)
    # the scripts run on it: sample.py's tokens are the original's; evaluate.py, allocate.py write
    greedy = ["--temperature=0", "--num_samples=1", "--max_new_tokens=8"]
    assert sample.main(["--out_dir=back", *greedy]) == sample.main(["--out_dir=out", *greedy])
    evaluate.main(["--out_dir=back", "--loops=1,2", "--windows=2", "--batch_size=2"])
    allocate.main(["--out_dir=back", "--windows=2", "--train_windows=2", "--bootstrap=10",
                   "--n_grid=4"])
    # exported again, the folder carries allocate.py's thresholds and eval.json's losses
    export.main(["--out_dir=back", "--to=hf-back"])
    config = json.loads(Path("hf-back", "config.json").read_text())
    allocation = json.loads(Path("back", "allocate.json").read_text())
    assert config["operating_thresholds"] == allocation["operating_thresholds"]
    assert config["calibrated_r_max"] == allocation["r_max"]
    assert config["calibrated_dtype"] == "float32"
    assert "## Loss by depth" in Path("hf-back", "README.md").read_text()
    capsys.readouterr()


def fake_hub_cache(root, repo_id, folder):
    """huggingface_hub's cache holding folder as repo_id's main revision, as downloads leave it."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return root


def test_a_hub_repository_is_read_from_the_hubs_cache_offline(indir, monkeypatch, capsys):
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cache = fake_hub_cache(indir / "hub", "someone/tiny", indir / "hf-tiny")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    checkpoint.main(["--from", "someone/tiny", "--out_dir=from-hub", "--dataset=tiny"])
    _, ckpt = model_lib.load_checkpoint("out/ckpt.pt")
    _, from_hub = model_lib.load_checkpoint("from-hub/ckpt.pt")
    assert all(torch.equal(from_hub["model"][name], ckpt["model"][name]) for name in ckpt["model"])
    argv = ["--from=someone/other", "--out_dir=x", "--dataset=tiny"]
    stderr = one_line_error(capsys, checkpoint.main, argv)
    assert "the hub is out of reach and its cache has no copy" in stderr


# ---- what export and checkpoint refuse ----------------------------------------------------------
def one_line_error(capsys, main, argv):
    """main must refuse argv: exit 2 and one line on stderr, through configurator.run -> it."""
    stderr = stderr_of_a_refusal(capsys, main, argv)
    assert stderr.startswith("error: ") and stderr.count("\n") == 1, stderr
    return stderr


def test_export_replaces_its_own_folder_and_no_other_unless_told(indir, capsys):
    export.main(["--out_dir=out", "--to=again", "--num_loops=3"])
    export.main(["--out_dir=out", "--to=again", "--exit=kl"])
    config = json.loads(Path("again", "config.json").read_text())
    assert config["num_loops"] == 2 and config["exit"] == "kl" and not os.path.exists(".again.tmp")
    Path("mine").mkdir()
    Path("mine", "notes.txt").write_text("a user's")
    refused = "not a folder hf.export wrote"
    assert refused in one_line_error(capsys, export.main, ["--to=mine", "--out_dir=out"])
    assert Path("mine", "notes.txt").read_text() == "a user's"
    Path("again", "notes.txt").write_text("a user's, added to an export")
    assert refused in one_line_error(capsys, export.main, ["--to=again", "--out_dir=out"])
    export.main(["--out_dir=out", "--to=mine", "--overwrite=True"])
    assert set(os.listdir("mine")) == FOLDER_FILES
    capsys.readouterr()


def test_export_is_whole_or_not_at_all(indir, monkeypatch, capsys):
    """A failure while writing leaves the earlier export as it was and no half folder; the next
    run clears what the failed one left."""
    export.main(["--out_dir=out", "--to=whole", "--num_loops=3"])
    before = {name: Path("whole", name).read_bytes() for name in os.listdir("whole")}

    def broken(*args):
        raise RuntimeError("the disk filled up")
    with monkeypatch.context() as mp:
        mp.setattr(export, "write_tokenizer", broken)
        with pytest.raises(RuntimeError, match="disk filled"):
            export.main(["--out_dir=out", "--to=whole", "--num_loops=4"])
    assert {name: Path("whole", name).read_bytes() for name in os.listdir("whole")} == before
    export.main(["--out_dir=out", "--to=whole", "--num_loops=4"])
    assert json.loads(Path("whole", "config.json").read_text())["num_loops"] == 4
    assert not os.path.exists(".whole.tmp") and not os.path.exists(".whole.old")
    capsys.readouterr()


@pytest.mark.parametrize("argv, says", [
    (["--out_dir=nowhere", "--to=x"], "no checkpoint at nowhere/ckpt.pt"),
    (["--out_dir=out"], "--to: name the folder"),
    (["--out_dir=out", "--to=x", "--exit=never"], "--exit must be none or one of kl, state"),
    (["--out_dir=out", "--to=x", "--exit=kl", "--r_max=1"], "an exit needs r_max >= 2"),
    (["--out_dir=out", "--to=no/such/parent"], "its parent folder no/such does not exist"),
    (["--out_dir=foreign", "--to=x"], "is not a nanoloop checkpoint"),
    (["--out_dir=untokenized", "--to=x"], "data/untokenized/ has no tokenizer.json"),
])
def test_export_refuses_bad_input_in_one_line(indir, capsys, argv, says):
    Path("foreign").mkdir(exist_ok=True)
    torch.save({"model": {}}, "foreign/ckpt.pt")
    if not Path("untokenized").exists():
        shutil.copytree("data/tiny", "data/untokenized")
        os.remove("data/untokenized/tokenizer.json")
        Path("untokenized").mkdir()
        ckpt = torch.load("out/ckpt.pt", weights_only=True)
        ckpt["config"]["dataset"] = "untokenized"
        torch.save(ckpt, "untokenized/ckpt.pt")
    assert says in one_line_error(capsys, export.main, argv)
    assert not Path("x").exists()


def another_model_type(folder):
    (folder / "config.json").write_text('{"model_type": "llama"}')


def no_config(folder):
    (folder / "config.json").unlink()


def no_tokenizer(folder):
    (folder / "tokenizer.json").unlink()


def no_weights(folder):
    (folder / "model.safetensors").unlink()


def another_tokenizer(folder):
    (folder / "tokenizer.json").write_text('{"model": "another"}')


@pytest.mark.parametrize("edit, says", [
    (another_model_type, "is not a nanoloop model"),
    (no_config, "is not a model folder: it has no config.json"),
    (no_tokenizer, "has no tokenizer.json"),
    (no_weights, "has no model.safetensors"),
    (another_tokenizer, "data/tiny/tokenizer.json is not hf-edited's tokenizer"),
])
def test_checkpoint_refuses_a_folder_that_is_not_one_in_one_line(indir, capsys, edit, says):
    shutil.copytree("hf-tiny", "hf-edited")
    edit(Path("hf-edited"))
    argv = ["--from=hf-edited", "--out_dir=refused", "--dataset=tiny"]
    assert says in one_line_error(capsys, checkpoint.main, argv)
    assert not Path("refused", "ckpt.pt").exists()
    shutil.rmtree("hf-edited")


def test_checkpoint_refuses_another_tokenizer_an_existing_checkpoint_and_a_missing_name(indir,
                                                                                         capsys):
    shutil.copytree("data/tiny", "data/other", dirs_exist_ok=True)
    tokenizer = json.loads(Path("data/other/tokenizer.json").read_text())
    tokenizer["model"]["vocab"]["<|endoftext|>"] = 299
    Path("data/other/tokenizer.json").write_text(json.dumps(tokenizer))
    meta = json.loads(Path("data/other/meta.json").read_text())
    meta.pop("tokenizer_sha256")
    Path("data/other/meta.json").write_text(json.dumps(meta))
    refusals = {"data/other/tokenizer.json is not hf-tiny's tokenizer":
                ["--from=hf-tiny", "--out_dir=refused", "--dataset=other"],
                "out/ckpt.pt exists: --overwrite=True replaces it":
                ["--from=hf-tiny", "--out_dir=out", "--dataset=tiny"],
                "no such folder, and not a hub repository id":
                ["--from=nothing-here", "--out_dir=refused", "--dataset=tiny"],
                "--dataset is required": ["--from=hf-tiny", "--out_dir=refused"],
                "data/nothing/ has no meta.json":
                ["--from=hf-tiny", "--out_dir=refused", "--dataset=nothing"]}
    for says, argv in refusals.items():
        assert says in one_line_error(capsys, checkpoint.main, argv)
    assert not Path("refused").exists()
