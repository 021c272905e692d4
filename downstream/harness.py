"""lm-evaluation-harness's tasks on a checkpoint, at every depth and under every exit test.

Each request (a context and the continuation it scores) is traced once from a zero state to the deepest of --loops
(evaluate.trace: each token's loss and exit scores after every loop), and every policy is read off that trace, as
allocate.py reads its windows: uniform depth r scores a continuation token by its loss after loop r, an exit
test of model.EXIT_TESTS (kl, state, ...) by its loss after the loop where the stop rule stops it (at the deepest of
--loops at the latest). Each exit runs at the threshold whose mean loops over the task's own scored tokens is
nearest each uniform depth from 2: the cost is matched on the task's tokens, never on its labels. Each uniform
depth's difference from r=1 (does the score move with depth?) and each exit's from the uniform depth it is matched
to come with a paired bootstrap interval over the task's items, each side aggregated by the task's own function
(accuracy: a mean; lambada's perplexity: exp(-mean log-likelihood)), so that a difference is the difference of the
table's values.

Tokenization is lm-eval's TemplateLM's, the way its Hugging Face models do it (the context's trailing spaces moved
into the continuation, the pair encoded whole and then split, EOT for an empty context), so that scores compare
with published ones. Generative tasks (generate_until) are refused before any work: only likelihoods are read.

    python -m downstream --out_dir=out-shakespeare --tasks=shakespeare_swap --include_path=downstream/tasks
    python -m downstream --out_dir=out-s1 --tasks=sciq,arc_easy,piqa,lambada_openai
"""
import os
import time

import numpy as np
import torch
from lm_eval.api.metrics import mean
from lm_eval.api.model import TemplateLM
from lm_eval.evaluator import evaluate as lm_evaluate
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from allocate import log_grid
from configurator import UserError, configure
from corpora import check_hub
from evaluate import loop_counts, markdown, paired_bootstrap, show, trace
from engine import clock
from model import (DEVICES, EXIT_TESTS, MIN_EXIT_LOOP, DepthPolicy, autocast, checkpoint_id, exit_depth,
                   save_atomic, uniform_depth)
from prepare import load_tokenizer, open_run

out_dir = "out-shakespeare"  # reads ckpt.pt, writes tasks.json
tasks = ""  # lm-eval's task names, comma-separated: its own (sciq, arc_easy, ...) or from --include_path
include_path = ""  # a folder of task YAMLs besides lm-eval's own (downstream/tasks: the Shakespeare tasks)
loops = "1,2,4,8,16"  # the uniform depths (r=1 always); the trace runs to the deepest, the exits are matched to each
limit = 0  # items per task at most (0: all); for a quick look, not for numbers to report
batch_size = 16  # requests per forward
n_grid = 64  # thresholds per exit test, geometric over the range of its scores on the task's tokens
bootstrap = 1000  # resamples of the items for each interval (and for lm-eval's stderr of a metric that is no mean)
seed = 1337  # picks the bootstrap's resamples
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu, cuda or cuda:N
dtype = "float32"  # even on a GPU: bf16 autocast puts a floor under the small KLs the exits test
RULES = {"limit": (0, 2 ** 31), "batch_size": (1, 2 ** 16), "n_grid": (2, 10 ** 4), "bootstrap": (10, 10 ** 7),
         "seed": (0, 2 ** 32 - 1), "dtype": ("float32", "bfloat16"), "device": DEVICES}


class LoopedLM(TemplateLM):
    """lm-eval's model over a checkpoint, one for each task. A request's continuation is scored by the trace of its
    window at the loop where `policy` stops each token; the trace of each (context, continuation) is kept, so that
    every run of the task after the first only reads."""

    def __init__(self, model, encode, eot_id, r_max, batch_size):
        super().__init__()  # lm-eval's LM sets rank 0 of 1: one process
        self.model = model
        self.encode = encode  # prepare.load_tokenizer's encoder, str -> token ids
        self.eot_id = eot_id  # the context of a request that has none
        self.r_max = r_max  # the loops traced
        self.batch_size = batch_size
        # set before each run: (the exit test's name in EXIT_TESTS, or None for uniform depth; its DepthPolicy)
        self.policy = (None, uniform_depth(r_max))
        self.loops_read = []  # each scored token's loops under the policy, request by request (the mean loops)
        self.traced = {}  # (context ids, continuation ids) -> the trace of its continuation's tokens, (r_max, n) each
        self.encoded = {}  # text -> its token ids
        self.tokens_traced = 0  # input tokens through the model, the padding's too, and the seconds they took
        self.seconds_tracing = 0.0

    @property
    def eot_token_id(self):
        return self.eot_id

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        # every run of a task tokenizes its requests again (a quarter of lm-eval's time per run): each string once
        if string not in self.encoded:
            self.encoded[string] = self.encode(string)
        return self.encoded[string]

    def loglikelihood(self, requests, disable_tqdm=True):
        # TemplateLM's tokenizing without its progress bar, which every run (a depth, an exit) would print again
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def trace_pairs(self, pairs):
        """Trace the (context ids, continuation ids) pairs not traced yet, each as its last block_size + 1 tokens
        (a long context loses its start, as lm-eval's Hugging Face models cut it), a batch at a time."""
        block = self.model.config.block_size
        new_pairs = [pair for pair in dict.fromkeys(pairs) if pair not in self.traced]
        if not new_pairs:  # every run after a task's first
            return
        # Longest first, so that a batch holds similar lengths (little padding) and memory runs out in the first
        # batch if it runs out at all.
        new_pairs.sort(key=lambda pair: len(pair[0]) + len(pair[1]), reverse=True)
        for start in tqdm(range(0, len(new_pairs), self.batch_size), desc="tracing", leave=False):
            batch = new_pairs[start:start + self.batch_size]
            windows = [(context + continuation)[-(block + 1):] for context, continuation in batch]
            # Right-padded, since causal attention keeps the padding out of every real token.
            padded = torch.zeros(len(windows), max(map(len, windows)), dtype=torch.long)
            for row, window in enumerate(windows):
                padded[row, :len(window)] = torch.tensor(window)
            padded = padded.to(self.model.wte.weight.device)
            started = clock(str(padded.device))
            traced = trace(self.model, padded[:, :-1], padded[:, 1:], self.r_max, state_init="zero")
            self.seconds_tracing += clock(str(padded.device)) - started
            self.tokens_traced += padded[:, :-1].numel()
            for row, (window, pair) in enumerate(zip(windows, batch)):
                n_scored = len(pair[1])
                if n_scored >= len(window):  # its first tokens would be scored with nothing before them
                    raise UserError(f"a continuation of {n_scored} tokens does not fit block_size {block}")
                scored = slice(len(window) - 1 - n_scored, len(window) - 1)  # the inputs that predict it
                kept = {key: traced[key][:, row, scored].cpu() for key in ("loss", "argmax", *EXIT_TESTS)}
                kept["target"] = padded[row, 1:][scored].cpu()
                self.traced[pair] = kept

    def read(self, pair):
        """(the continuation's log-probability, whether each of its tokens is the argmax) under the policy."""
        traced = self.traced[pair]
        exit_name, depth_policy = self.policy
        if exit_name is None:  # uniform depth runs every token r_max loops
            loops_run = torch.full_like(traced["target"], depth_policy.r_max)
        else:
            loops_run = exit_depth(traced[exit_name], depth_policy)
        self.loops_read.append(loops_run)
        at_depth = loops_run[None] - 1  # row i of the trace is after loop i + 1
        loss = traced["loss"].gather(0, at_depth)[0]
        argmax = traced["argmax"].gather(0, at_depth)[0]
        return -loss.double().sum().item(), bool((argmax == traced["target"]).all())

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        """TemplateLM's tokenized requests [((context, continuation), context ids, continuation ids)] -> scores."""
        pairs = [(tuple(context_ids), tuple(continuation_ids)) for _, context_ids, continuation_ids in requests]
        self.trace_pairs(pairs)
        return [self.read(pair) for pair in pairs]

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        """Each document's log-likelihood in windows of block_size, each token scored once after as many of the
        tokens before it as fit (lm-eval's own windows, as its Hugging Face models score them)."""
        documents = []
        for (text,) in (request.args for request in requests):
            windows = get_rolling_token_windows(self.tok_encode(text), self.eot_id, self.model.config.block_size, 1)
            pairs = []
            for window in windows:
                context_ids, continuation_ids = make_disjoint_window(window)
                pairs.append((tuple(context_ids), tuple(continuation_ids)))
            documents.append(pairs)
        self.trace_pairs([pair for pairs in documents for pair in pairs])
        return [sum(self.read(pair)[0] for pair in pairs) for pairs in documents]

    def generate_until(self, requests, disable_tqdm=False):
        # main refuses a generative task before any work, so only a caller of its own gets here
        raise NotImplementedError("downstream scores likelihoods only: a generative task is refused")


# datasets' builders that read local files (a task of the Shakespeare folder's kind); any other
# dataset_path names a repository on the hub
LOCAL_BUILDERS = {"json", "csv", "text", "parquet", "arrow"}


def needs_hub(entry):
    """Does lm-eval's index entry of a task (None: a name it does not know) read the hub? A group
    or a tag, its tasks not read here, counts as one that does."""
    if entry is None:
        return False
    path = (entry.cfg or {}).get("dataset_path")
    return path not in LOCAL_BUILDERS and not (path and os.path.isdir(path))


def load_tasks(names, include_path):
    """{name: lm-eval's Task} of the comma-separated names, a group's or a tag's tasks each by itself; UserError for
    a name lm-eval does not know, and for a generative task (refused before any work: only likelihoods are read)."""
    manager = TaskManager(include_path=include_path or None)
    # datasets retries an unreachable hub for half a minute, a dozen lines: ask it once, at once
    if any(needs_hub(manager.task_index.get(name)) for name in names.split(",")):
        check_hub()
    try:
        loaded = manager.load(names.split(","))["tasks"]
    except KeyError as err:  # lm-eval's word for a name it does not know
        raise UserError(f"--tasks: {err.args[0]}") from None
    generative = [name for name, task in loaded.items() if task.OUTPUT_TYPE == "generate_until"]
    if generative:
        raise UserError(f"--tasks: {', '.join(generative)} generate text; downstream scores only loglikelihood, "
                        f"loglikelihood_rolling and multiple_choice tasks")
    return loaded


def run_policy(lm, name, task, policy, C):
    """One lm-eval run of a task under a policy (exit test's name or None, DepthPolicy) -> (lm-eval's result, the
    mean loops of the task's scored tokens)."""
    lm.policy = policy
    lm.loops_read = []
    with autocast(C.device, C.dtype):
        result = lm_evaluate(lm, {"tasks": {name: task}}, limit=C.limit or None, bootstrap_iters=C.bootstrap,
                             log_samples=True)
    mean_loops = torch.cat([loops.flatten() for loops in lm.loops_read]).double().mean().item()
    return result, mean_loops


def matched_thresholds(lm, exit_depths, n_grid):
    """{(exit test's name, r): the threshold on its grid whose mean loops over the task's scored tokens (the traced
    continuations) is nearest r} for each r of exit_depths."""
    matched = {}
    for exit_name, test in EXIT_TESTS.items():
        scores = torch.cat([traced[exit_name] for traced in lm.traced.values()], dim=1)  # (r_max, scored tokens)
        grid = log_grid(scores, n_grid)
        mean_loops = []
        for threshold in grid:
            loops_run = exit_depth(scores, DepthPolicy(test, threshold, lm.r_max))
            mean_loops.append(loops_run.double().mean().item())
        for r in exit_depths:
            nearest = np.abs(np.array(mean_loops) - r).argmin()
            matched[exit_name, r] = grid[nearest]
    return matched


def item_values(result, name, metric, kept_by):
    """The metric's value for each item of a run, in item order -> array (items, ...) (a pair per item for a
    perplexity per word)."""
    samples = [sample for sample in result["samples"][name] if sample["filter"] == kept_by]
    samples.sort(key=lambda sample: sample["doc_id"])
    return np.asarray([sample[metric] for sample in samples])


def paired_difference(result, reference, task, name, key, C):
    """A run's value of a metric minus a reference run's, each aggregated over the items by the task's own function,
    with its paired bootstrap 95% interval over the items -> {"value", "interval"}."""
    metric, _, kept_by = key.partition(",")
    aggregate = task.aggregation().get(metric, mean)  # lm-eval's own fallback is the mean too
    items = item_values(result, name, metric, kept_by)
    reference_items = item_values(reference, name, metric, kept_by)

    def difference(resampled):
        # The same items on both sides, so that what makes an item hard for every policy cancels out.
        picked = resampled["item"]
        return aggregate(items[picked].tolist()) - aggregate(reference_items[picked].tolist())
    return paired_bootstrap(difference, {"item": np.arange(len(items))}, C.bootstrap, C.seed)


def score_task(lm, name, task, depths, C):
    """One task at each uniform depth, then under each exit test matched to each depth from 2, by a LoopedLM of its
    own -> (its rows, what its trace cost: {"requests", "tokens", "seconds", "tokens_per_s"})."""
    runs = {}  # (policy, r) -> (lm-eval's result, mean loops, the exit test or None, its threshold or None)
    for r in depths:  # the first run traces every request, the others read the traces
        result, mean_loops = run_policy(lm, name, task, (None, uniform_depth(r)), C)
        runs["uniform", r] = (result, mean_loops, None, None)
    exit_depths = [r for r in depths if r >= MIN_EXIT_LOOP]  # an exit test compares two loops
    if exit_depths:
        for (exit_name, r), threshold in matched_thresholds(lm, exit_depths, C.n_grid).items():
            test = EXIT_TESTS[exit_name]
            policy = (exit_name, DepthPolicy(test, threshold, lm.r_max))
            result, mean_loops = run_policy(lm, name, task, policy, C)
            runs[exit_name, r] = (result, mean_loops, test, threshold)
    cost = {"requests": len(lm.traced), "tokens": lm.tokens_traced, "seconds": lm.seconds_tracing,
            "tokens_per_s": lm.tokens_traced / lm.seconds_tracing}
    print(f"{name}: {cost['requests']} requests, {cost['tokens']} tokens traced to r={lm.r_max} in "
          f"{cost['seconds']:.1f}s ({cost['tokens_per_s']:.0f} tokens/s)")
    return task_rows(lm.model, name, task, runs, C), cost


def task_rows(model, name, task, runs, C):
    """A row per metric of each run of one task; a uniform depth's row also holds its difference from r=1, an exit's
    its difference from the uniform depth it is matched to, each with its paired interval over the task's items."""
    rows = []
    for (policy, r), (result, mean_loops, test, threshold) in runs.items():
        flops = model.inference_flops(mean_loops, model.config.block_size, test)
        for key, value in result["results"][name].items():
            metric, _, kept_by = key.partition(",")  # lm-eval's "acc,none" is a metric and the filter before it
            if not kept_by or metric.endswith("_stderr"):  # the "alias" is no value; a stderr goes with its metric
                continue
            stderr = result["results"][name].get(f"{metric}_stderr,{kept_by}")
            if not isinstance(stderr, float):  # lm-eval writes "N/A" for a metric it has no stderr for
                stderr = None
            row = {"task": name, "metric": metric, "policy": policy, "loops": r, "mean_loops": mean_loops,
                   "flops_per_token": flops, "value": float(value), "stderr": stderr}
            if kept_by != "none":  # a metric read after a filter keeps the filter's name
                row["metric"] = key
            if test is None and r > 1:  # does the score move with depth?
                row["versus_r1"] = paired_difference(result, runs["uniform", 1][0], task, name, key, C)
            if test is not None:
                row["threshold"] = threshold
                row["versus_uniform"] = paired_difference(result, runs["uniform", r][0], task, name, key, C)
            rows.append(row)
    return rows


def print_rows(rows):
    cells = []
    for row in rows:
        stderr = "-" if row["stderr"] is None else f"{row['stderr']:.4f}"
        versus_r1 = show(row["versus_r1"]) if "versus_r1" in row else ""
        versus_uniform = show(row["versus_uniform"]) if "versus_uniform" in row else ""
        cells.append([row["task"], row["metric"], row["policy"], row["loops"], f"{row['mean_loops']:.2f}",
                      f"{row['flops_per_token'] / 1e6:.3g}", f"{row['value']:.4f}", stderr,
                      versus_r1, versus_uniform])
    headers = ["task", "metric", "policy", "r", "mean loops", "MFLOP/token", "value", "stderr",
               "uniform - uniform at r=1 [95%]", "exit - uniform at r [95%]"]
    print(markdown(headers, cells))


def main(argv=()):
    C, _ = configure(globals(), argv)
    # 1) the checkpoint, its tokenizer and the tasks; every refusal before the work
    if not C.tasks:
        raise UserError("--tasks: name one or more of lm-eval's tasks, e.g. --tasks=sciq,arc_easy")
    depths = loop_counts(C.loops, 1)
    model, ckpt, data_dir, meta = open_run(C.out_dir, C.device, splits=())
    if not os.access(C.out_dir, os.W_OK):  # before minutes of tracing
        raise UserError(f"--out_dir={C.out_dir} is not writable")
    encode, _ = load_tokenizer(data_dir)
    loaded = load_tasks(C.tasks, C.include_path)
    print(f"{C.out_dir}/ckpt.pt: {checkpoint_id(ckpt)}; {C.device} {C.dtype}; traced to r={depths[-1]}")
    # 2) each task at each depth and under each exit, every run read off one trace of its requests
    started = time.perf_counter()
    rows = []
    traced = {}  # what each task's trace cost, the tokens/s from which downstream/README.md estimates other runs
    for name, task in loaded.items():
        lm = LoopedLM(model, encode, meta["eot_id"], depths[-1], C.batch_size)
        rows_of_task, traced[name] = score_task(lm, name, task, depths, C)
        rows += rows_of_task
    # 3) the table, then every row in tasks.json
    print_rows(rows)
    res = {"args": vars(C), "checkpoint": checkpoint_id(ckpt), "r_max": depths[-1], "rows": rows, "traced": traced,
           "seconds": time.perf_counter() - started}
    save_atomic(os.path.join(C.out_dir, "tasks.json"), res)
    print(f"\nwrote {C.out_dir}/tasks.json in {res['seconds']:.0f}s")
    return res
