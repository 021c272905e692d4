"""Tests for downstream/: lm-eval's tasks at every depth and under the exits, on a tiny model trained here on bytes of
English text (test_allocate's), offline. References: evaluate.trace read by hand at each token's depth, lm-eval's own
task configurations (sciq, lambada_openai) on local rows in their datasets' formats, accuracies and perplexities
computed by hand. Skipped without lm-eval, except its one-line refusal (that the core never imports lm-eval is
test_repository's)."""
import json
import math
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import evaluate
from model import EXIT_TESTS, DepthPolicy, exit_depth, load_checkpoint, uniform_depth
from prepare import load_tokenizer
from conftest import stderr_of_a_refusal
from test_allocate import train_tiny

R_MAX = 8  # the depth the tests trace to: the tiny model's max_loops


def test_without_lm_eval_the_command_says_what_to_install_in_one_line(monkeypatch, capsys):
    import downstream
    from downstream import __main__ as command
    # as if lm-eval were not installed, even where a test before this one imported it
    for name in [name for name in sys.modules if name.startswith("lm_eval.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.delitem(sys.modules, "downstream.harness", raising=False)
    monkeypatch.delattr(downstream, "harness", raising=False)
    stderr = one_line_error(capsys, command.main, ["--tasks=sciq"])
    assert "pip install -r downstream/requirements.txt" in stderr


# ---- the tiny model and its scorer --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def harness():
    pytest.importorskip("lm_eval")
    from downstream import harness
    return harness


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained for 60 steps on bytes of English text (data/tiny, vocab 256, EOT 0), its folder."""
    root = tmp_path_factory.mktemp("downstream")
    train_tiny(root, 60, ["--n_core=2", "--mean_loops=3", f"--max_loops={R_MAX}", "--bptt_k=4"])
    model, _ = load_checkpoint(str(root / "out" / "ckpt.pt"))
    return root, model


@pytest.fixture
def indir(trained, monkeypatch):
    monkeypatch.chdir(trained[0])
    return trained[0]


def scorer(harness, trained, policy, batch_size=4):
    """downstream's LoopedLM over the tiny model, traced to R_MAX, reading under policy."""
    root, model = trained
    encode, _ = load_tokenizer(root / "data" / "tiny")
    lm = harness.LoopedLM(model, encode, 0, R_MAX, batch_size)
    lm.policy = policy
    return lm


def requests(*args):
    return [SimpleNamespace(args=a) for a in args]


def traced_tail(model, ids, n_scored):
    """evaluate.trace of one sequence of ids: each loop's loss, exit scores and argmax at its last n_scored tokens."""
    traced = evaluate.trace(model, torch.tensor([ids[:-1]]), torch.tensor([ids[1:]]), R_MAX)
    return {key: values[:, 0, -n_scored:] for key, values in traced.items()}


POLICIES = [(None, uniform_depth(1)), (None, uniform_depth(3)), ("kl", DepthPolicy(EXIT_TESTS["kl"], 0.05, R_MAX)),
            ("state", DepthPolicy(EXIT_TESTS["state"], 0.05, R_MAX))]


@pytest.mark.parametrize("policy", POLICIES, ids=["r=1", "r=3", "kl exit", "state exit"])
def test_loglikelihood_is_the_traces_loss_at_each_tokens_depth_batched_or_alone(harness, trained, policy):
    """A continuation's log-probability is minus the trace's losses of its tokens at the loop where the policy stops
    each (uniform depth: r; an exit: model.exit_depth on the same trace), in a batch of three and alone."""
    _, model = trained
    asked = [("The quick brown fox", " jumps over"), ("Copyright ", "(c) 2001"), ("", "Python Software")]
    batched = scorer(harness, trained, policy).loglikelihood(requests(*asked))
    exit_name, depth_policy = policy
    for (context, continuation), (logprob, greedy) in zip(asked, batched):
        alone = scorer(harness, trained, policy, batch_size=1).loglikelihood(requests((context, continuation)))[0]
        assert alone[0] == pytest.approx(logprob, abs=1e-4) and alone[1] == greedy
        # lm-eval's way: the context's trailing space opens the continuation; EOT (0) stands for no context
        stripped = context.rstrip()
        context_ids = list(stripped.encode()) or [0]
        continuation_ids = list((context[len(stripped):] + continuation).encode())
        traced = traced_tail(model, context_ids + continuation_ids, len(continuation_ids))
        depth = torch.full((len(continuation_ids),), depth_policy.r_max)
        if exit_name is not None:
            depth = exit_depth(traced[exit_name], depth_policy)
            assert 2 <= depth.min() and depth.double().mean() < R_MAX  # the exit really stops tokens early
        loss = traced["loss"].gather(0, depth[None] - 1)[0]
        assert logprob == pytest.approx(-loss.double().sum().item(), abs=1e-4)
        argmax = traced["argmax"].gather(0, depth[None] - 1)[0]
        assert greedy == bool((argmax == torch.tensor(continuation_ids)).all())


def test_loglikelihood_rolling_is_the_sum_over_windows_of_block_size(harness, trained):
    _, model = trained
    document = Path(sysconfig.get_paths()["stdlib"], "LICENSE.txt").read_text()[:100]  # 100 tokens, block 32
    total = scorer(harness, trained, (None, uniform_depth(3))).loglikelihood_rolling(requests((document,)))[0]
    ids = [0] + list(document.encode())  # EOT, then every token scored once
    by_hand = 0.0
    for start in range(0, 100, 32):  # windows of 32 predicted tokens, each after the 32 tokens before it
        n_scored = min(32, 100 - start)
        window = ids[max(0, start + n_scored - 32):start + n_scored + 1]
        by_hand -= traced_tail(model, window, n_scored)["loss"][2].double().sum().item()
    assert total == pytest.approx(by_hand, abs=1e-3)


# ---- tasks through lm-eval ----------------------------------------------------------------------------------------
def write_local_task(folder, name, items, output_type="multiple_choice"):
    """A two-choice task as lm-eval reads one from --include_path: a JSONL and a YAML."""
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    (folder / f"{name}.yaml").write_text(f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / name}.jsonl
  cache_dir: {folder / "cache"}
test_split: test
output_type: {output_type}
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")


ITEMS = [{"context": "The Python Software", "choices": ["Foundation", "zqxjv"], "label": 0},
         {"context": "Permission is hereby", "choices": ["qqqq", "granted"], "label": 1},
         {"context": "the standard", "choices": ["library", "xkcd"], "label": 1},
         {"context": "Copyright", "choices": ["(c)", "wwww"], "label": 0}]
FAST = ["--out_dir=out", "--device=cpu", "--loops=1,2,4", "--batch_size=4", "--n_grid=12", "--bootstrap=50"]


@pytest.fixture
def task_folders(harness, monkeypatch):
    """harness's lm-eval indexes --include_path and the folders of lm-eval's own tasks that a test appends to the list
    this returns, never all of lm-eval's (which takes ~15 s)."""
    from lm_eval.tasks import TaskManager
    builtin_folders = []

    def manager(include_path=None):
        folders = list(builtin_folders)
        if include_path:
            folders.append(include_path)
        return TaskManager(include_path=folders, include_defaults=False)
    monkeypatch.setattr(harness, "TaskManager", manager)
    return builtin_folders


def test_main_writes_a_row_per_policy_with_its_loops_flops_and_paired_difference(harness, trained, indir,
                                                                                 task_folders):
    _, model = trained
    write_local_task(indir / "tasks", "tiny_mc", ITEMS * 3)
    res = harness.main([*FAST, "--tasks=tiny_mc", "--include_path=tasks"])
    assert json.loads((indir / "out" / "tasks.json").read_text()) == res
    rows = res["rows"]
    keys = {"task", "metric", "policy", "loops", "mean_loops", "flops_per_token", "value", "stderr"}
    uniform = {row["loops"]: row for row in rows if row["policy"] == "uniform"}
    assert sorted(uniform) == [1, 2, 4] and res["r_max"] == 4
    assert res["traced"]["tiny_mc"]["requests"] == 8  # each item's two choices, once though asked thrice
    assert set(uniform[1]) == keys
    for r, row in uniform.items():
        assert row["mean_loops"] == r and row["metric"] == "acc"
        assert row["flops_per_token"] == model.inference_flops(r, model.config.block_size)
        if r > 1:  # its difference from r=1, paired over the items
            assert set(row) == keys | {"versus_r1"}
            versus = row["versus_r1"]
            assert versus["value"] == pytest.approx(row["value"] - uniform[1]["value"])
            low, high = versus["interval"]
            assert low <= versus["value"] <= high
    exits = [row for row in rows if row["policy"] != "uniform"]
    tests = EXIT_TESTS  # every registered exit test, matched to r=2 and 4
    assert sorted((row["policy"], row["loops"]) for row in exits) == sorted((name, r) for name in tests for r in (2, 4))
    for row in exits:
        assert set(row) == keys | {"threshold", "versus_uniform"}
        flops = model.inference_flops(row["mean_loops"], model.config.block_size, tests[row["policy"]])
        assert row["flops_per_token"] == pytest.approx(flops)
        versus = row["versus_uniform"]
        assert versus["value"] == pytest.approx(row["value"] - uniform[row["loops"]]["value"])
        low, high = versus["interval"]
        assert low <= versus["value"] <= high


def test_two_items_give_no_interval(harness, trained, indir, task_folders, capsys):
    """--limit=2: too few items for a 95% interval to mean anything (evaluate.MIN_ITEMS_FOR_INTERVAL)."""
    write_local_task(indir / "tasks", "tiny_mc", ITEMS * 3)
    res = harness.main([*FAST, "--tasks=tiny_mc", "--include_path=tasks", "--limit=2"])
    differences = [row[key] for row in res["rows"] for key in ("versus_r1", "versus_uniform") if key in row]
    assert differences and all(difference["interval"] is None for difference in differences)
    table_rows = capsys.readouterr().out.split("| --- |")[-1]
    assert "[" not in table_rows and "+0.0000" in table_rows


def test_a_local_tasks_accuracy_is_the_one_computed_by_hand(harness, trained, indir, task_folders):
    write_local_task(indir / "tasks", "tiny_mc", ITEMS)
    task = harness.load_tasks("tiny_mc", "tasks")["tiny_mc"]
    lm = scorer(harness, trained, (None, uniform_depth(3)))
    options = SimpleNamespace(limit=0, bootstrap=50, device="cpu", dtype="float32")
    result, mean_loops = harness.run_policy(lm, "tiny_mc", task, (None, uniform_depth(3)), options)
    by_hand = scorer(harness, trained, (None, uniform_depth(3)))
    correct = []
    for item in ITEMS:  # lm-eval puts its target delimiter, a space, before each choice
        asked = requests(*[(item["context"], " " + choice) for choice in item["choices"]])
        scores = [logprob for logprob, _ in by_hand.loglikelihood(asked)]
        correct.append(int(np.argmax(scores)) == item["label"])
    assert result["results"]["tiny_mc"]["acc,none"] == pytest.approx(np.mean(correct)) and mean_loops == 3


SCIQ = [{"question": "What gas do plants take in?", "distractor1": "oxygen", "distractor2": "helium",
         "distractor3": "argon", "correct_answer": "carbon dioxide", "support": "Plants use light to make sugar."},
        {"question": "What is the hardest natural material?", "distractor1": "gold", "distractor2": "quartz",
         "distractor3": "talc", "correct_answer": "diamond", "support": ""},
        {"question": "Which organ pumps blood?", "distractor1": "liver", "distractor2": "lung",
         "distractor3": "kidney", "correct_answer": "heart", "support": " The heart is a muscle."}]
LAMBADA = [{"text": "Permission is hereby granted"}, {"text": "The Python Software Foundation"},
           {"text": "the standard library"}]


def hub_as_local_files(folder, monkeypatch, harness):
    """datasets.load_dataset, as lm-eval calls it, reads sciq's and lambada_openai's rows from local JSONL files
    instead of the hub: everything else is the path a user's --tasks=sciq,lambada_openai takes."""
    import datasets
    hub_load_dataset = datasets.load_dataset
    rows = {"allenai/sciq": SCIQ, "EleutherAI/lambada_openai": LAMBADA}

    def load_dataset(path, name=None, **kwargs):
        local = folder / f"{path.replace('/', '_')}.jsonl"
        local.write_text("".join(json.dumps(row) + "\n" for row in rows[path]))
        # sciq's configuration names three splits; lambada_openai's one
        data_files = {split: str(local) for split in ("train", "validation", "test")}
        return hub_load_dataset("json", data_files=data_files, cache_dir=str(folder / "cache"))
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    # the hub answers
    monkeypatch.setattr(harness, "check_hub", lambda: None)


def test_lm_evals_own_sciq_and_lambada_openai_on_local_rows_score_as_by_hand(harness, trained, indir, task_folders,
                                                                              monkeypatch):
    """The built-in tasks' own configurations (their prompts, choices, targets, metrics and aggregations) through
    main, their rows from local files: sciq's accuracy, lambada_openai's perplexity (exp of minus the mean
    log-likelihood, never a mean of per-item values) and each exit's difference in the task's own aggregation."""
    import lm_eval.tasks
    task_folders.extend(str(Path(lm_eval.tasks.__file__).parent / name) for name in ("sciq", "lambada"))
    hub_as_local_files(indir, monkeypatch, harness)
    monkeypatch.setenv("DISABLE_MULTIPROC", "1")  # lm-eval's bootstrap of a perplexity's stderr, in this process
    task_lms = []

    class KeptLM(harness.LoopedLM):  # main makes one for each task: the second is sciq's, its requests traced
        def __init__(self, *args):
            super().__init__(*args)
            task_lms.append(self)
    monkeypatch.setattr(harness, "LoopedLM", KeptLM)
    res = harness.main([*FAST, "--tasks=lambada_openai,sciq"])
    value = {(row["task"], row["metric"], row["policy"], row["loops"]): row["value"] for row in res["rows"]}
    by_hand = scorer(harness, trained, (None, uniform_depth(2)))
    asked, correct = [], []
    for row in SCIQ:  # sciq's prompt: the support, the question; its choices, the answer last
        context = f"{row['support'].lstrip()}\nQuestion: {row['question']}\nAnswer:"
        choices = [row["distractor1"], row["distractor2"], row["distractor3"], row["correct_answer"]]
        for choice in choices:  # bytes: the context's ids, then the continuation's (a space and the choice)
            asked.append((tuple(context.encode()), tuple(f" {choice}".encode())))
        scores = [logprob for logprob, _ in by_hand.loglikelihood(requests(*[(context, " " + c) for c in choices]))]
        correct.append(np.argmax(scores) == 3)
    assert set(task_lms[1].traced) == set(asked)  # lm-eval's requests for sciq are the ones written out here
    assert value["sciq", "acc", "uniform", 2] == pytest.approx(np.mean(correct))
    log_likelihoods = []
    for row in LAMBADA:  # lambada's: the text without its last word, then that word
        context, _, last_word = row["text"].rpartition(" ")
        log_likelihoods.append(by_hand.loglikelihood(requests((context, " " + last_word)))[0][0])
    assert value["lambada_openai", "perplexity", "uniform", 2] == pytest.approx(math.exp(-np.mean(log_likelihoods)))
    moved = []
    for row in res["rows"]:
        if row["policy"] != "uniform":
            uniform = value[row["task"], row["metric"], "uniform", row["loops"]]
            assert row["versus_uniform"]["value"] == pytest.approx(row["value"] - uniform)
            moved.append(row["metric"] == "perplexity" and abs(row["value"] - uniform) > 1e-3)
    assert any(moved)  # a perplexity that an exit changed: a mean of log-likelihoods would differ from it


# ---- refusals, each one line before any work ----------------------------------------------------------------------
def one_line_error(capsys, main, argv):
    """main must refuse argv: exit 2 and one line on stderr, through configurator.run."""
    stderr = stderr_of_a_refusal(capsys, main, argv)
    assert stderr.startswith("error: ") and stderr.count("\n") == 1, stderr
    return stderr


def refusal(capsys, main, argv):
    """main must refuse argv: exit 2, its last line on stderr an error, no traceback -> that line. The tasks that
    lm-eval built before the one refused may have printed datasets' progress bars before it."""
    stderr = stderr_of_a_refusal(capsys, main, argv)
    last_line = stderr.strip().rpartition("\n")[2]
    assert last_line.startswith("error: ") and "Traceback" not in stderr, stderr
    return last_line


def test_an_unknown_or_generative_task_is_refused_in_one_line_before_any_work(harness, indir, task_folders,
                                                                              monkeypatch, capsys):
    def no_work(*args, **kwargs):
        raise AssertionError("traced a request before refusing")
    monkeypatch.setattr(harness, "trace", no_work)
    (indir / "out" / "tasks.json").unlink(missing_ok=True)  # an earlier test's
    write_local_task(indir / "tasks", "tiny_mc", ITEMS)
    write_local_task(indir / "tasks", "tiny_gen", ITEMS, output_type="generate_until")
    args = [*FAST, "--include_path=tasks"]
    assert "no_such_task" in refusal(capsys, harness.main, [*args, "--tasks=tiny_mc,no_such_task"])
    assert "tiny_gen generate" in refusal(capsys, harness.main, [*args, "--tasks=tiny_mc,tiny_gen"])
    assert "--tasks" in one_line_error(capsys, harness.main, FAST)
    assert not (indir / "out" / "tasks.json").exists()


def test_a_hub_task_with_the_hub_not_answering_is_one_line_within_seconds(harness, indir, monkeypatch,
                                                                           capsys):
    """--tasks=sciq reads the hub: not answering, one line before any work (datasets alone retries
    for half a minute, printing a dozen lines); a local task never asks the hub."""
    import time
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    start = time.monotonic()
    assert "does not answer" in one_line_error(capsys, harness.main, [*FAST, "--tasks=sciq"])
    assert time.monotonic() - start < 15
    write_local_task(indir / "tasks", "tiny_mc", ITEMS)
    index = harness.TaskManager(include_path=str(indir / "tasks")).task_index
    assert harness.needs_hub(index["sciq"]) and not harness.needs_hub(index["tiny_mc"])


# ---- the laptop tasks' builder ------------------------------------------------------------------------------------
def write_verse_dataset(root):
    """data/verse/: a val split of two made-up plays (speakers, verse, stage directions) as bytes, each ended by EOT."""
    from test_allocate import byte_tokenizer
    words = "my lord the king doth speak of love and war to thee this night".split()
    rng = np.random.default_rng(0)
    works = []
    for play in range(2):
        lines = [f"THE PLAY OF {play}", ""]
        for speech in range(40):
            lines += ["", "KING." if speech % 2 else "QUEEN.", "[Enter a messenger.]"]
            for _ in range(4):
                line = " ".join(rng.choice(words, 7))
                lines.append(line.capitalize() + ",")
        works.append("\n".join(lines))
    ids = []
    for work in works:
        ids += list(work.encode()) + [0]
    folder = root / "data" / "verse"
    folder.mkdir(parents=True)
    np.array(ids, dtype=np.uint16).tofile(folder / "val.bin")
    meta = {"vocab_size": 256, "eot_id": 0, "dtype": "uint16", "val_tokens": len(ids)}
    (folder / "meta.json").write_text(json.dumps(meta))
    byte_tokenizer().save(str(folder / "tokenizer.json"))
    return works


def test_the_shakespeare_task_is_built_deterministically_with_two_neighbouring_words_swapped(tmp_path, monkeypatch):
    from downstream import build_shakespeare_swap
    monkeypatch.chdir(tmp_path)
    works = write_verse_dataset(tmp_path)
    items = build_shakespeare_swap.main(["--dataset=verse", "--out=first", "--items=40"])
    build_shakespeare_swap.main(["--dataset=verse", "--out=again", "--items=40"])
    first = (tmp_path / "first" / "shakespeare_swap.jsonl").read_bytes()
    assert first == (tmp_path / "again" / "shakespeare_swap.jsonl").read_bytes()
    assert 10 <= sum(item["label"] for item in items) <= 30  # the true line on either side
    for item in items:
        true_line = item["choices"][item["label"]]
        swapped = item["choices"][1 - item["label"]].split(" ")
        words = true_line.split(" ")
        moved = [i for i, (a, b) in enumerate(zip(words, swapped)) if a != b]
        assert len(moved) == 2 and moved[1] == moved[0] + 1 and moved[0] >= 1  # two neighbours, past the first word
        assert swapped[moved[0]] == words[moved[1]] and swapped[moved[1]] == words[moved[0]]
        # the passage: the lines of its own play just before the true line, from a line's start
        work = next(work for work in works if item["context"] + true_line in work)
        assert work[work.index(item["context"] + true_line) - 1] == "\n" and item["context"].endswith("\n")
