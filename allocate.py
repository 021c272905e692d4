"""The paper's per-token depth policies on a frozen checkpoint, against uniform depth.

    A0   uniform depth r = 1..r_max
    A1   a token stops once KL(p_i || p_{i-1}) < threshold
    A1s  a token stops once its relative state change ||s_i - s_{i-1}|| / ||s_i|| < threshold
    A2   a token stops once a probe on s_i, fit on train windows, says its argmax will not change

A1 and A1s are the exit tests of model.EXIT_TESTS: a test registered there is a policy here too.

Every policy is read off one trace of the windows to r_max from a zero state (evaluate.trace: each
token's loss and exit scores after every loop): a token stops after the first loop from 2 whose
score is below the threshold, or at r_max, and scores the loss it had there. This reads each token
as if alone: in a real run a stopped token would show the others its held state, not its next one
(the paper's masking harness; BENCHMARKS.md gives the measured difference). The policies are compared at
matched average loops, and by the loops and FLOPs per token at which each reaches the bar (uniform
depth at mean_loops), with paired bootstrap 95% intervals. Each exit test's operating threshold (the fewest
loops that reach the bar) goes to allocate.json, where sample.py --exit finds it.

    python allocate.py --out_dir=out-shakespeare
"""
import os
import time
from math import inf

import numpy as np
import torch

from configurator import UserError, configure, run
from evaluate import load_windows, markdown, paired_bootstrap, show, trace_windows
from model import (DEVICES, EXIT_TESTS, MIN_EXIT_LOOP, DepthPolicy, ExitTest, autocast, checkpoint_id, exit_depth,
                   save_atomic)
from prepare import open_run

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
RULES = dict(windows=(1, inf), train_windows=(2, inf), batch_size=(1, inf), n_grid=(2, inf),
             bootstrap=(10, inf), seed=(0, 2 ** 32 - 1), dtype=("float32", "bfloat16"), device=DEVICES)
TABLE_ROWS = [f / 8 for f in range(3, 8)]  # the matched table's rows, in units of mean_loops


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
    fit = torch.linalg.lstsq(with_bias.double(), y.double()[:, None])
    w = fit.solution[:, 0].float()

    def probe(s):  # float32, whatever the autocast
        z = (s.float() - mu.to(s.device)) / sd.to(s.device)
        return z @ w[:-1].to(s.device) + w[-1].item()
    return probe


def probe_exit_test(probe):
    """A2 as an exit test: its score is the probe's P(this token's argmax changes later)."""
    def score(s_new, s_old, logits_new, logits_old):
        return probe(s_new)
    # a standardisation and a dot product per state channel
    return ExitTest(score, lambda config: 4 * config.n_embd, policy="A2")


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
    later), grids {exit test's name: thresholds}, "probe" A2's)"""
    keys = ("argmax", *EXIT_TESTS)
    traced = trace_windows(model, train_wins, r_max, C.batch_size, keys, states_as=("states", torch.Tensor.float))
    labels = harvest_labels(traced["argmax"])[:-1]  # after r_max there is no later loop
    states = traced["states"][:-1]
    probe = fit_probe(states.flatten(0, 2), labels.flatten())
    grids = {name: log_grid(traced[name][MIN_EXIT_LOOP - 1:], C.n_grid) for name in EXIT_TESTS}  # where tokens stop
    grids["probe"] = log_grid(probe(states).flatten(), C.n_grid)
    return probe, grids


def read_policies(model, traced, tests, grids):
    """Every policy's points read off the trace -> per_window {(policy, "loss" | "loops" | "flops"): (points,
    windows) array}: each window's mean loss, loops and FLOPs per token at each of A0's depths r = 1..r_max
    and, for each exit test {name: ExitTest}, at each of its thresholds grids[name] (its policy: test.policy)."""
    r_max, n, T = traced["loss"].shape
    # A0 at depth r: every token of every window runs r loops
    uniform_loops = np.repeat(np.arange(1.0, r_max + 1)[:, None], n, 1)
    per_window = {("A0", "loss"): traced["loss"].double().mean(2).numpy(),
                  ("A0", "loops"): uniform_loops,
                  ("A0", "flops"): model.inference_flops(uniform_loops, T)}
    # An exit at a threshold: each token runs the loops the stop rule gives it (model.exit_depth), and
    # its loss is the trace's after its last loop; a window's figures are its tokens' means.
    for name, test in tests.items():
        losses, loops = [], []
        for threshold in grids[name]:
            depth = exit_depth(traced[name], DepthPolicy(test, threshold, r_max))  # (n, T): loops each token runs
            loss = traced["loss"].gather(0, depth[None] - 1)[0]  # each token's after its last loop
            losses.append(loss.double().mean(1).numpy())
            loops.append(depth.double().mean(1).numpy())
        per_window[test.policy, "loss"] = np.stack(losses)
        per_window[test.policy, "loops"] = np.stack(loops)
        per_window[test.policy, "flops"] = model.inference_flops(per_window[test.policy, "loops"], T, test)
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


def operating_threshold(per_window, policy, grid, bar):
    """An exit's operating point: the largest threshold on its grid whose loss reaches the bar (the fewest loops
    that do), or the smallest if none does. sample.py runs each exit test at its own for the checkpoint."""
    losses = per_window[policy, "loss"].mean(1)
    reaching = [threshold for threshold, loss in zip(grid, losses) if loss <= bar]
    return max(reaching, default=min(grid))


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
    def interval(stat, **kwargs):  # paired: every policy's arrays resampled with the same windows
        return paired_bootstrap(lambda resampled: stat(resampled, **kwargs), per_window, C.bootstrap, C.seed)
    res = {"bar": bar_loss(per_window, mean), "at_bar": {}, "table": []}
    policies = list(dict.fromkeys(policy for policy, _ in per_window))  # A0, then each exit's
    for policy in policies:
        res["at_bar"][policy] = {}
        for cost in ("loops", "flops"):
            res["at_bar"][policy][cost] = interval(cost_at_bar, policy=policy, mean=mean, cost=cost)
            res["at_bar"][policy][f"{cost}_saved"] = interval(saving_at_bar, policy=policy, mean=mean, cost=cost)
    for depth in (mean * f for f in TABLE_ROWS):
        row = {"loops": depth, "A0": interp_loss(curve(per_window, "A0", "loops"), depth)}
        for policy in policies[1:]:
            row[policy] = interval(loss_delta, policy=policy, at=depth, cost="loops")
        res["table"].append(row)
    return res


# ---- the report
def print_report(res):
    print(f"\n## Allocation against uniform depth: {res['windows']} windows, r_max {res['r_max']}; the bar is "
          f"uniform r={res['mean_loops']}'s loss, {res['bar']:.4f}\n")
    print("Each exit's loss minus A0's at equal average loops (an interval holding 0 is no difference); "
          "the cost at which each reaches the bar (-: never), and what it saves there.\n")
    exits = res["exits"]  # {policy: its scores' name}
    rows = []
    for row in res["table"]:
        uniform = "-" if row["A0"] is None else f"{row['A0']:.4f}"  # no A0 below 1 loop
        deltas = [show(row[policy]) for policy in exits]
        rows.append([f"{row['loops']:.3g}", uniform] + deltas)
    at_bar = res["at_bar"]
    for cost, unit, scale in (("loops", "loops", 1), ("flops", "MFLOP/token", 1e6)):
        reaches = [show(at_bar[policy][cost], ".2f", scale) for policy in at_bar]
        saves = [show(at_bar[policy][f"{cost}_saved"], "+.3f") for policy in exits]
        rows.append([f"reaches the bar, {unit}"] + reaches)
        rows.append([f"saves, in {cost}", ""] + saves)
    headers = ["avg loops", "A0 loss"] + [f"{policy} ({name}) - A0" for policy, name in exits.items()]
    print(markdown(headers, rows))
    thresholds = ", ".join(f"{name} {value:.3g}" for name, value in res["operating_thresholds"].items())
    print(f"\nOperating thresholds (the fewest loops that reach the bar, else the grid's deepest; sample.py --exit "
          f"runs them): {thresholds}")


def main(argv=()):
    C, _ = configure(globals(), argv)
    # 1) the checkpoint, its data and the windows; every refusal before the work
    model, ckpt, data_dir, meta = open_run(C.out_dir, C.device, writes=True)
    mean = model.config.mean_loops
    r_max = C.r_max or model.config.max_loops
    # the bar is uniform depth at mean_loops, and an exit compares two loops: r_max must reach both
    if r_max < max(MIN_EXIT_LOOP, mean):
        raise UserError(f"--r_max={r_max}: needs at least {MIN_EXIT_LOOP} and mean_loops ({mean})")
    length = model.config.block_size + 1
    wins = load_windows(f"{data_dir}/val.bin", meta["dtype"], C.windows, length, C.seed)
    train_wins = load_windows(f"{data_dir}/train.bin", meta["dtype"], C.train_windows, length, C.seed + 1)
    print(f"{C.out_dir}/ckpt.pt: {checkpoint_id(ckpt)}; {C.device} {C.dtype}")
    # 2) the probe and the grids from training windows; the trace of the evaluation windows
    started = time.perf_counter()
    with autocast(C.device, C.dtype):
        probe, grids = fit_router(model, train_wins.to(C.device), C, r_max)
        # from a zero state, as sample.py's exits start: the thresholds calibrated here are the ones it runs
        keys = ("loss", *EXIT_TESTS)
        traced = trace_windows(model, wins.to(C.device), r_max, C.batch_size, keys, states_as=("probe", probe))
    # 3) every policy read off it, compared with uniform depth, reported; then saved, window by window
    tests = EXIT_TESTS | {"probe": probe_exit_test(probe)}
    per_window = read_policies(model, traced, tests, grids)
    res = {"args": vars(C), "checkpoint": checkpoint_id(ckpt), "mean_loops": mean, "r_max": r_max,
           "windows": C.windows}
    res |= summarize(per_window, C, mean)
    res["exits"] = {test.policy: name for name, test in tests.items()}
    # each exit test's operating point: the threshold sample.py --exit runs for this checkpoint
    res["operating_thresholds"] = {name: operating_threshold(per_window, test.policy, grids[name], res["bar"])
                                   for name, test in EXIT_TESTS.items()}
    print_report(res)
    # every point of every curve, window by window: A0's depths r, an exit's thresholds
    res["settings"] = {"A0": list(range(1, r_max + 1))} | {tests[name].policy: grid for name, grid in grids.items()}
    res["per_window"] = {f"{policy} {measure}": array.tolist() for (policy, measure), array in per_window.items()}
    save_atomic(os.path.join(C.out_dir, "allocate.json"), res)
    print(f"\nwrote {C.out_dir}/allocate.json in {time.perf_counter() - started:.0f}s")
    return res


if __name__ == "__main__":
    run(main)
