"""The paper's per-token depth policies on a frozen checkpoint, against uniform depth.

    A0   uniform depth r = 1..r_max
    A1   a token stops once KL(p_i || p_{i-1}) < threshold
    A1s  a token stops once its relative state change ||s_i - s_{i-1}|| / ||s_i|| < threshold
    A2   a token stops once a probe on s_i, fit on train windows, says its argmax will not change

Every policy is read off one trace of the windows to r_max from a zero state (evaluate.trace: each
token's loss and exit scores after every loop): a token stops after the first loop from 2 whose
score is below the threshold, or at r_max, and scores the loss it had there. This reads each token
as if alone: in a real run a stopped token would show the others its held state, not its next one
(the paper's masking harness; README gives the measured difference). The policies are compared at
matched average loops, and by the loops and FLOPs per token at which each reaches the bar (uniform
depth at mean_loops), with paired bootstrap 95% intervals; then A1's mean exit depth by token class.

    python allocate.py --out_dir=out-shakespeare
    python allocate.py --tasks=shakespeare_cloze --include_path=tasks  # lm-eval tasks at each depth and exit
"""
import os
import re
import time
import unicodedata
from functools import partial
from math import inf

import numpy as np
import torch

from configurator import UserError, configure, run
from evaluate import exit_depth, load_windows, loop_counts, markdown, paired_bootstrap, show, table, trace, trace_windows
from model import (DEVICES, EXIT_TESTS, MIN_EXIT_LOOP, DepthPolicy, ExitTest, autocast, checkpoint_id, load_checkpoint,
                   save_atomic, uniform_depth)
from prepare import load_tokenizer, open_dataset
from sample import generate, sample_next

out_dir = "out-shakespeare"  # reads ckpt.pt, writes allocate.json
windows = 128  # evaluation windows of block_size + 1 tokens from val.bin
train_windows = 32  # windows from train.bin for A2's probe and the threshold grids (never evaluated)
r_max = 0  # the deepest loop any policy may run; 0: the model's max_loops (the paper's r_max)
batch_size = 8  # windows per forward
n_grid = 48  # thresholds per exit, geometric over the range of its scores on the train windows
bootstrap = 1000  # resamples of the windows for every interval
seed = 1337  # picks the windows and the bootstrap resamples
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu, cuda or cuda:N
dtype = "float32"  # even on a GPU: bf16 autocast puts a floor under the small KLs the exits test
tasks = ""  # lm-eval tasks (e.g. hellaswag,arc_easy): scored at each of --loops and under A1 and A1s, not the windows
include_path = ""  # with --tasks: a folder of local lm-eval task YAML files, e.g. tasks
loops = "1,2,4,8,16"  # with --tasks: the uniform depths; the exits are matched to each from 2 on
limit = 0  # with --tasks: items per task; 0: all
RULES = dict(windows=(1, inf), train_windows=(2, inf), batch_size=(1, inf), n_grid=(2, inf),
             bootstrap=(10, inf), seed=(0, 2 ** 32 - 1), dtype=("float32", "bfloat16"), device=DEVICES)
POLICIES = {"A0": "A0 uniform", "A1": "A1 KL exit", "A1s": "A1s state", "A2": "A2 router"}
SCORES = {"A1": "kl", "A1s": "dstate_rel", "A2": "probe"}  # each exit's score in the trace
TRACED = ("loss", "kl", "dstate_rel", "argmax")  # what the policies read off the trace
TABLE_ROWS = [f / 8 for f in range(3, 8)]  # the matched table's rows, in units of mean_loops
CLASSES = ("space", "numeral", "punctuation", "word")
EXITS = {"A1": "kl", "A1s": "state"}  # the exits of model.EXIT_TESTS, by their policy's name
GREEDY = partial(sample_next, temperature=0.0, top_k=0, generators=None)  # logits (B, V) -> the argmax (B,)


# ---- A2: the oracle-labelled router
def harvest_labels(argmax):
    """argmax (r_max, ...) -> (r_max, ...) bool: does the argmax after loop i change at a later loop?"""
    later = [(argmax[i + 1:] != argmax[i]).any(0) for i in range(len(argmax))]
    return torch.stack(later)


def fit_probe(x, y):
    """A linear probe, least squares on standardised features (closed form: no steps to tune).
    x (N, d), y (N,) bool -> the probe: states (..., d) -> its score, ~P(label)."""
    # The paper's A2 is "a linear probe on s_i"; least squares is one, and its score is near
    # P(the argmax still changes), so a token stops once the probe is confident enough that it won't.
    mu = x.mean(0)
    sd = x.std(0).clamp_min(1e-6)
    with_bias = torch.cat([(x - mu) / sd, torch.ones(len(x), 1)], dim=1)
    w = torch.linalg.lstsq(with_bias.double(), y.double()[:, None]).solution[:, 0].float()

    def probe(s):  # float32, whatever the autocast
        z = (s.float() - mu.to(s.device)) / sd.to(s.device)
        return z @ w[:-1].to(s.device) + w[-1].item()
    return probe


def probe_accuracy(traced):
    """The probe's accuracy on the evaluation windows' labels (it never saw them), and the accuracy
    of always guessing the commoner label: the paper's diagnosis of A2."""
    labels = harvest_labels(traced["argmax"])[:-1]  # after r_max there is no later loop
    rate = labels.float().mean().item()
    accuracy = ((traced["probe"][:-1] > 0.5) == labels).float().mean().item()
    return {"accuracy": accuracy, "majority": max(rate, 1 - rate)}


def probe_exit_test(probe):
    """A2 as an exit test: its score is the probe's P(this token's argmax changes later)."""
    def score(s_new, s_old, logits_new, logits_old):
        return probe(s_new)
    # a standardisation and a dot product per state channel
    return ExitTest(score, lambda config: 4 * config.n_embd, needs_logits=False)


def log_grid(scores, n):
    """n thresholds, geometric between the 1st and 99th percentiles of the positive scores."""
    # the scores span decades (KL 1e-1 at loop 2, 1e-5 in the tail): a geometric grid over their
    # range gives every depth a threshold near it, and reading the trace makes thresholds free
    positive = scores[torch.isfinite(scores) & (scores > 0)].double().numpy()
    low, high = np.quantile(positive, [0.01, 0.99])
    return np.geomspace(low, high, n).tolist()


def fit_router(model, train_wins, C, r_max):
    """A2's probe, and every exit's threshold grid, from training windows only: tuned on the
    evaluation windows, they would flatter the exits. -> (the probe: states -> P(argmax changes
    later), grids {policy: thresholds})"""
    traced = trace_windows(model, train_wins, r_max, C.batch_size, TRACED, states_as=("state", torch.Tensor.float))
    labels = harvest_labels(traced["argmax"])[:-1]  # after r_max there is no later loop
    states = traced["state"][:-1]
    probe = fit_probe(states.flatten(0, 2), labels.flatten())
    grids = {"A1": log_grid(traced["kl"][1:], C.n_grid),
             "A1s": log_grid(traced["dstate_rel"][1:], C.n_grid),
             "A2": log_grid(probe(states).flatten(), C.n_grid)}
    return probe, grids


def read_policies(model, traced, tests, grids):
    """Every policy's points read off the trace -> per_window {(policy, "loss" | "loops" | "flops"):
    (points, windows) array}: each window's mean loss, loops and FLOPs per token at each of A0's
    depths r = 1..r_max and at each of an exit's thresholds."""
    r_max, n, T = traced["loss"].shape
    uniform_loops = np.repeat(np.arange(1.0, r_max + 1)[:, None], n, 1)
    per_window = {("A0", "loss"): traced["loss"].double().mean(2).numpy(),
                  ("A0", "loops"): uniform_loops,
                  ("A0", "flops"): model.inference_flops(uniform_loops, T)}
    # An exit at a threshold: each token's depth is its first loop (from 2) whose score is below it,
    # and its loss is the trace's after that loop; a window's figures are its tokens' means.
    for policy, test in tests.items():
        scores = traced[SCORES[policy]][MIN_EXIT_LOOP - 1:]  # no exit before loop 2
        losses, loops = [], []
        for threshold in grids[policy]:
            depth = exit_depth(scores, threshold)  # (n, T): loops each token runs
            loss = traced["loss"].gather(0, depth[None] - 1)[0]  # each token's after its last loop
            losses.append(loss.double().mean(1).numpy())
            loops.append(depth.double().mean(1).numpy())
        per_window[policy, "loss"] = np.stack(losses)
        per_window[policy, "loops"] = np.stack(loops)
        per_window[policy, "flops"] = model.inference_flops(per_window[policy, "loops"], T, test)
    return per_window


# ---- curves and statistics: per_window[policy, measure] is (points, windows); a statistic
# reads it, and paired_bootstrap resamples its windows
def curve(per_window, policy, cost):
    """[(average cost, average loss)] of each of the policy's points; cost "loops" or "flops"."""
    costs = per_window[policy, cost].mean(1)
    losses = per_window[policy, "loss"].mean(1)
    return list(zip(costs, losses))


def cost_at_loss(points, loss):
    """The least cost at which the (cost, loss) polyline first reaches `loss`, or None."""
    # the first crossing, not the last: past its best depth a curve is flat and noise moves it
    points = sorted(points)
    if points[0][1] <= loss:
        return points[0][0]
    for (c0, l0), (c1, l1) in zip(points, points[1:]):  # l0 > loss here
        if l1 <= loss:
            return c0 + (l0 - loss) / (l0 - l1) * (c1 - c0)
    return None


def interp_loss(points, cost):
    """The loss at an average cost along (cost, loss) points; None outside them."""
    costs, losses = zip(*sorted(points))
    if not costs[0] <= cost <= costs[-1]:
        return None
    return float(np.interp(cost, costs, losses))


def bar_loss(per_window, mean):
    """The bar: uniform depth's loss at r = mean_loops, the quality the paper holds every policy to."""
    return per_window["A0", "loss"][mean - 1].mean()


def cost_at_bar(per_window, policy, mean, cost):
    return cost_at_loss(curve(per_window, policy, cost), bar_loss(per_window, mean))


def saving_at_bar(per_window, policy, mean, cost):
    """1 - the policy's cost at the bar / uniform depth's."""
    spent = cost_at_bar(per_window, policy, mean, cost)
    uniform = cost_at_bar(per_window, "A0", mean, cost)
    if spent is None or uniform is None:
        return None
    return 1 - spent / uniform


def loss_delta(per_window, policy, at, cost):
    """The policy's loss minus A0's at a matched average cost `at`."""
    uniform = interp_loss(curve(per_window, "A0", cost), at)
    other = interp_loss(curve(per_window, policy, cost), at)
    if uniform is None or other is None:
        return None
    return other - uniform


def summarize(per_window, C, mean):
    """The matched table (a row per average depth: each exit's loss minus A0's at equal loops) and
    each policy's cost at the bar in loops and in FLOPs, each with its paired bootstrap interval."""
    def interval(stat, **kwargs):
        # every policy's arrays resampled with the same windows: the windows' own difficulty,
        # which all policies share, cancels out of each difference
        return paired_bootstrap(lambda resampled: stat(resampled, **kwargs), per_window, C.bootstrap, C.seed)
    res = {"bar": bar_loss(per_window, mean), "at_bar": {}, "table": []}
    for policy in POLICIES:
        res["at_bar"][policy] = {}
        for cost in ("loops", "flops"):
            res["at_bar"][policy][cost] = interval(cost_at_bar, policy=policy, mean=mean, cost=cost)
            res["at_bar"][policy][f"{cost}_saved"] = interval(saving_at_bar, policy=policy, mean=mean, cost=cost)
    for depth in (mean * f for f in TABLE_ROWS):
        row = {"loops": depth, "A0": interp_loss(curve(per_window, "A0", "loops"), depth)}
        for policy in ("A1", "A1s", "A2"):
            row[policy] = interval(loss_delta, policy=policy, at=depth, cost="loops")
        res["table"].append(row)
    return res


# ---- which tokens run deep
def token_class(text):
    """One of CLASSES for a token: ' (' (a space carried) is punctuation, a partial character (U+FFFD) a word."""
    if text.isspace():
        return "space"
    if any(ch.isdigit() for ch in text):
        return "numeral"
    kinds = {unicodedata.category(ch)[0] for ch in text.strip()}
    if kinds and "\ufffd" not in text and kinds <= {"P", "S"}:
        return "punctuation"
    return "word"


def token_classes(traced, per_window, grids, bar, inputs, decode):
    """The paper's "mean exit depth" by token class, read as A1's at its operating point: the loops each token
    runs at the largest threshold on the grid whose loss reaches the bar (the smallest if none does), by the
    class of the token at its position (the one that exits). traced["kl"] (r_max, n, T), inputs (n, T)."""
    # Not the first loop with KL < 1e-3 (evaluate.py's "still moving" line): at S1, 96% of tokens still
    # move at loop 4, so the paper's 3.58-4.25 loops are most likely an exit's at a looser threshold.
    losses = per_window["A1", "loss"].mean(1)
    reaching = [threshold for threshold, loss in zip(grids["A1"], losses) if loss <= bar]
    threshold = max(reaching, default=min(grids["A1"]))
    exits = exit_depth(traced["kl"][MIN_EXIT_LOOP - 1:], threshold).flatten().numpy()
    classes = np.array([token_class(decode([i])) for i in inputs.flatten().tolist()])
    rows = []
    for name in CLASSES:
        picked = exits[classes == name]
        row = {"class": name, "count": picked.size}
        if picked.size:  # a class these windows lack has no mean
            row["mean_exit_depth"] = picked.mean()
        rows.append(row)
    rows.append({"class": "all", "count": exits.size, "mean_exit_depth": exits.mean()})
    return {"threshold": threshold, "rows": rows}


# ---- the report
def print_report(res):
    print(f"\n## Allocation against uniform depth: {res['windows']} windows, r_max {res['r_max']}; the bar is "
          f"uniform r={res['mean_loops']}'s loss, {res['bar']:.4f}\n")
    print("Each exit's loss minus A0's at equal average loops (an interval holding 0 is no difference); "
          "the cost at which each reaches the bar (-: never), and what it saves there.\n")
    exits = ["A1", "A1s", "A2"]
    rows = []
    for row in res["table"]:
        uniform = "-" if row["A0"] is None else f"{row['A0']:.4f}"  # no A0 below 1 loop
        deltas = [show(row[policy]) for policy in exits]
        rows.append([f"{row['loops']:.3g}", uniform] + deltas)
    at_bar = res["at_bar"]
    for cost, unit, scale in (("loops", "loops", 1), ("flops", "MFLOP/token", 1e6)):
        reaches = [show(at_bar[policy][cost], ".2f", scale) for policy in POLICIES]
        saves = [show(at_bar[policy][f"{cost}_saved"], "+.3f") for policy in exits]
        rows.append([f"reaches the bar, {unit}"] + reaches)
        rows.append([f"saves, in {cost}", ""] + saves)
    headers = ["avg loops", "A0 loss"] + [f"{POLICIES[policy]} - A0" for policy in exits]
    print(markdown(headers, rows))
    probe = res["probe"]
    print(f"\nA2 probe: held-out accuracy {probe['accuracy']:.3f} (majority class {probe['majority']:.3f}).")
    classes = res["token_classes"]
    table(f"A1's exit depth by class of the exiting token, at its threshold {classes['threshold']:.3g}",
          classes["rows"], "class:s count:d mean_exit_depth:.2f")


# ---- lm-evaluation-harness's tasks: every policy read off one trace of each request
class TaskScorer:
    """lm-eval's three requests over a checkpoint (score_tasks adds lm-eval's LM class as a base). A continuation
    token's log-probability is the one it has at the loop where `policy` stops it, read off a trace to r_max from
    a zero state as allocate's windows are: the task scores and allocate's A1/A1s agree by construction."""

    def __init__(self, model, tokenizer, eot, r_max, batch_size):
        super().__init__()  # lm-eval's LM: rank 0 of 1
        self.model = model
        self.encode, self.decode = tokenizer  # load_tokenizer's pair
        self.eot = eot  # the context of a request that has none
        self.r_max = r_max
        self.batch_size = batch_size
        self.policy = ("A0", r_max)  # (policy, its loops or exit threshold): set before each run
        self.depths = []  # each request's loops per scored or generated token
        self.traced = {}  # (context ids, continuation ids) -> its continuation's trace, (r_max, n) each

    def trace_requests(self, pairs):
        """Trace the (context, continuation) pairs not traced yet, each its last block_size + 1 tokens, right-padded
        to one length (causal attention keeps the padding out of every real token)."""
        block = self.model.config.block_size
        pairs = [pair for pair in dict.fromkeys(pairs) if pair not in self.traced]
        if not pairs:  # every policy after the first reads the trace again
            return
        windows = [(context + continuation)[-(block + 1):] for context, continuation in pairs]
        padded = torch.zeros(len(windows), max(map(len, windows)), dtype=torch.long)
        for row, window in enumerate(windows):
            padded[row, :len(window)] = torch.tensor(window)
        traced = trace_windows(self.model, padded.to(self.model.wte.weight.device), self.r_max, self.batch_size, TRACED)
        for row, (window, (_, continuation)) in enumerate(zip(windows, pairs)):
            if len(continuation) >= len(window):  # its first tokens would go unscored: a wrong number
                raise UserError(f"a continuation of {len(continuation)} tokens does not fit block_size {block}")
            scored = slice(len(window) - 1 - len(continuation), len(window) - 1)  # x's positions predicting it
            self.traced[pairs[row]] = {key: traced[key][:, row, scored] for key in TRACED}
            self.traced[pairs[row]]["target"] = padded[row, 1:][scored]

    def read(self, pair):
        """(the continuation's log-probability, whether each of its tokens is the argmax) under the policy."""
        traced = self.traced[pair]
        policy, setting = self.policy
        depth = torch.full_like(traced["target"], setting)
        if policy in EXITS:  # each token's first loop from 2 whose score is below the threshold
            depth = exit_depth(traced[SCORES[policy]][MIN_EXIT_LOOP - 1:], setting)
        self.depths.append(depth)
        loss, argmax = (traced[key].gather(0, depth[None] - 1)[0] for key in ("loss", "argmax"))
        return -loss.double().sum().item(), bool((argmax == traced["target"]).all())

    def loglikelihood(self, requests):
        """Each (context, continuation) tokenized apart, the context's trailing spaces opening the continuation as
        lm-eval's Hugging Face models do (" Paris" is one token, "Paris" after a space another)."""
        pairs = []
        for context, continuation in (request.args for request in requests):
            stripped = context.rstrip()
            context_ids = self.encode(stripped) or [self.eot]
            pairs.append((tuple(context_ids), tuple(self.encode(context[len(stripped):] + continuation))))
        self.trace_requests(pairs)
        return [self.read(pair) for pair in pairs]

    def loglikelihood_rolling(self, requests):
        """Each document in windows of block_size, each token scored once, after as many tokens as fit."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
        documents = []
        for (text,) in (request.args for request in requests):
            windows = get_rolling_token_windows(self.encode(text), self.eot, self.model.config.block_size, 1)
            documents.append([tuple(map(tuple, make_disjoint_window(window))) for window in windows])
        self.trace_requests([pair for pairs in documents for pair in pairs])
        return [sum(self.read(pair)[0] for pair in pairs) for pairs in documents]

    def generate_until(self, requests):
        """sample.generate's greedy text after each context, alone, from a zero state at the policy's depth or exit
        (the prompt at r_max loops, as the trace runs a context), cut at its first stop string."""
        policy, setting = self.policy
        depth = uniform_depth(setting)
        if policy in EXITS:
            depth = DepthPolicy(EXIT_TESTS[EXITS[policy]], setting, self.r_max)
        texts = []
        for context, options in (request.args for request in requests):
            stops = options.get("until", [])
            idx = torch.tensor([self.encode(context) or [self.eot]], device=self.model.wte.weight.device)
            max_new = options.get("max_gen_toks", 256)
            s0 = torch.zeros(1, idx.size(1) + max_new, self.model.config.n_embd, device=idx.device)
            new_ids = []
            for token, loops in generate(self.model, idx, max_new, s0, GREEDY, depth.r_max, depth):
                new_ids.append(token.item())
                self.depths.append(loops)
                if any(stop in self.decode(new_ids) for stop in stops):
                    break
            texts.append(re.split("|".join(map(re.escape, stops)) or "$^", self.decode(new_ids))[0])
        return texts


def load_tasks(C):
    """{name: lm-eval's task} of --tasks, built in or from --include_path; UserError for a task lm-eval lacks."""
    from lm_eval.tasks import TaskManager  # imported here: lm-eval is needed only with --tasks
    try:
        return TaskManager(include_path=C.include_path or None).load(C.tasks.split(","))["tasks"]
    except KeyError as err:  # lm-eval's word for a task it does not know
        raise UserError(f"--tasks: {err.args[0]}") from None


def score_tasks(model, scorer_args, task_dict, grids, C):
    """Each task at each uniform depth of --loops, then (a likelihood task) under A1 and A1s, each at the grid
    threshold whose mean loops over the task's scored tokens is nearest one depth's -> rows of tasks.json."""
    from lm_eval.api.model import LM
    from lm_eval.evaluator import evaluate as lm_evaluate
    lm = type("NanoloopLM", (TaskScorer, LM), {})(*scorer_args)  # lm-eval's LM with TaskScorer's methods
    depths = [r for r in loop_counts(C.loops, 1) if r <= lm.r_max]
    rows = []
    for name, task in task_dict.items():
        lm.traced = {}
        runs = {}  # (policy, depth) -> (lm-eval's result, the loops each scored token ran)
        policies = [("A0", r, r) for r in depths]
        for policy, depth, setting in policies:
            lm.policy = (policy, setting)
            lm.depths = []
            with autocast(C.device, C.dtype):  # as the windows are traced
                result = lm_evaluate(lm, {name: task}, limit=C.limit or None, bootstrap_iters=C.bootstrap,
                                     verbosity="WARNING")
            runs[policy, depth] = result, torch.cat([loops.flatten().float() for loops in lm.depths])
            if (policy, depth) == ("A0", depths[-1]) and lm.traced:  # a likelihood task, all A0 rows done: the exits
                policies += matched_exits(lm, grids, [r for r in depths if r >= MIN_EXIT_LOOP])
        rows += task_rows(model, name, runs, C)
    print_tasks(rows)
    return rows


def matched_exits(lm, grids, depths):
    """[(exit, depth, the grid threshold whose mean loops over the task's traced tokens is nearest depth)]: the
    cost is matched on the task's own tokens, never on its labels."""
    settings = []
    for policy in EXITS:
        scores = torch.cat([traced[SCORES[policy]] for traced in lm.traced.values()], dim=1)[MIN_EXIT_LOOP - 1:]
        mean_loops = np.array([exit_depth(scores, t).float().mean().item() for t in grids[policy]])
        settings += [(policy, r, grids[policy][np.abs(mean_loops - r).argmin()]) for r in depths]
    return settings


def task_rows(model, name, runs, C):
    """A row per metric of each run of one task; an exit's row also holds its difference from the uniform row of
    its depth, with a paired bootstrap interval over the task's items."""
    rows = []
    for (policy, depth), (result, loops) in runs.items():
        test = EXIT_TESTS[EXITS[policy]] if policy in EXITS else None
        mean_loops = loops.mean().item()
        for key, value in result["results"][name].items():
            metric, _, kept_by = key.partition(",")  # lm-eval's "acc,none": a metric and its filter
            if not kept_by or metric.endswith("_stderr"):  # its "alias"; a stderr is read with its metric
                continue
            stderr = result["results"][name].get(f"{metric}_stderr,{kept_by}")
            row = {"task": name, "metric": metric, "policy": policy, "loops": depth, "mean_loops": mean_loops,
                   "flops_per_token": model.inference_flops(mean_loops, model.config.block_size, test),
                   "value": value, "stderr": stderr if isinstance(stderr, float) else None}  # lm-eval's "N/A"
            if policy in EXITS:  # its depth is the one it is matched to, not its own
                row["loops"] = None
                row["versus_uniform"] = {"loops": depth} | paired_items(result, runs["A0", depth][0], name, key, C)
            rows.append(row)
    return rows


def paired_items(result, uniform, name, key, C):
    """An exit's mean of a per-item metric minus the uniform run's, with its paired bootstrap interval over the
    items -> {"value", "interval"}; none for a metric lm-eval aggregates from pairs (perplexity)."""
    metric, _, kept_by = key.partition(",")
    per_item = {}
    for label, run in (("exit", result), ("uniform", uniform)):
        samples = sorted((s for s in run["samples"][name] if s["filter"] == kept_by), key=lambda s: s["doc_id"])
        per_item[label] = np.array([sample[metric] for sample in samples], dtype=float)
    if per_item["exit"].ndim > 1:  # (log-likelihood, words) per item
        return {"value": None, "interval": None}

    def difference(resampled):
        return resampled["exit"].mean() - resampled["uniform"].mean()
    return paired_bootstrap(difference, per_item, C.bootstrap, C.seed)


def print_tasks(rows):
    cells = []
    for row in rows:
        policy = f"A0 r={row['loops']}"
        versus = "-"
        if row["policy"] in EXITS:
            policy = f"{row['policy']} ~{row['versus_uniform']['loops']}"
            versus = show(row["versus_uniform"])
        stderr = "-" if row["stderr"] is None else f"{row['stderr']:.4f}"
        cells.append([row["task"], row["metric"], policy, f"{row['mean_loops']:.2f}",
                      f"{row['flops_per_token'] / 1e6:.3g}", f"{row['value']:.4f}", stderr, versus])
    headers = ["task", "metric", "policy", "mean loops", "MFLOP/token", "value", "stderr", "exit - A0 at its r [95%]"]
    print(markdown(headers, cells))


def main(argv=()):
    C, _ = configure(globals(), argv)
    # 1) the checkpoint, its data and the windows; every refusal before the work
    ckpt_path = os.path.join(C.out_dir, "ckpt.pt")
    model, ckpt = load_checkpoint(ckpt_path, C.device)
    if not os.access(C.out_dir, os.W_OK):  # before minutes of tracing
        raise UserError(f"--out_dir={C.out_dir} is not writable")
    mean = model.config.mean_loops
    r_max = C.r_max or model.config.max_loops
    if r_max < max(MIN_EXIT_LOOP, mean):
        raise UserError(f"--r_max={r_max}: needs at least {MIN_EXIT_LOOP} and mean_loops ({mean})")
    data_dir, meta = open_dataset(ckpt["config"]["dataset"], ckpt, ckpt_path)
    encode, decode = load_tokenizer(data_dir)  # before the work: A1's token classes and the tasks need it
    length = model.config.block_size + 1
    train_wins = load_windows(f"{data_dir}/train.bin", meta["dtype"], C.train_windows, length, C.seed + 1)
    if C.tasks:  # lm-eval's tasks instead of the evaluation windows
        task_dict = load_tasks(C)
    else:
        wins = load_windows(f"{data_dir}/val.bin", meta["dtype"], C.windows, length, C.seed)
    print(f"{ckpt_path}: {checkpoint_id(ckpt)}; {C.device} {C.dtype}")
    # 2) the probe and the grids from training windows; the trace of the evaluation windows
    started = time.perf_counter()
    with autocast(C.device, C.dtype):
        probe, grids = fit_router(model, train_wins.to(C.device), C, r_max)
    if C.tasks:  # lm-eval's tasks instead of the windows, the exits' thresholds from the same grids
        rows = score_tasks(model, (model, (encode, decode), meta["eot_id"], r_max, C.batch_size), task_dict, grids, C)
        save_atomic(os.path.join(C.out_dir, "tasks.json"), rows)
        print(f"\nwrote {C.out_dir}/tasks.json in {time.perf_counter() - started:.0f}s")
        return rows
    with autocast(C.device, C.dtype):
        # from a zero state, as sample.py's exits start: the thresholds calibrated here are the ones it runs
        traced = trace_windows(model, wins.to(C.device), r_max, C.batch_size, TRACED, states_as=("probe", probe))
    # 3) every policy read off it, compared with uniform depth, reported; then saved, window by window
    tests = {policy: EXIT_TESTS[name] for policy, name in EXITS.items()} | {"A2": probe_exit_test(probe)}
    per_window = read_policies(model, traced, tests, grids)
    res = {"args": vars(C), "checkpoint": checkpoint_id(ckpt), "mean_loops": mean, "r_max": r_max,
           "windows": C.windows, "probe": probe_accuracy(traced)}
    res |= summarize(per_window, C, mean)
    res["token_classes"] = token_classes(traced, per_window, grids, res["bar"], wins[:, :-1], decode)
    print_report(res)
    # every point of every curve, window by window: A0's depths r, an exit's thresholds
    res["settings"] = {"A0": list(range(1, r_max + 1))} | grids
    res["per_window"] = {f"{policy} {measure}": array.tolist() for (policy, measure), array in per_window.items()}
    save_atomic(os.path.join(C.out_dir, "allocate.json"), res)
    print(f"\nwrote {C.out_dir}/allocate.json in {time.perf_counter() - started:.0f}s")
    return res


if __name__ == "__main__":
    run(main)
