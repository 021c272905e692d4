"""The paper's per-token depth policies on a frozen checkpoint, against uniform depth.

    uniform (A0)  every token runs r loops, r = 1..r_max
    kl (A1)       a token stops once KL(p_i || p_{i-1}) < threshold
    state (A1s)   a token stops once ||s_i - s_{i-1}|| / ||s_i|| < threshold

Every exit test of model.EXIT_TESTS is a policy (A2 too: python -m studies.probe), read off one
trace of the windows to r_max from a zero state: a token stops after the first loop from 2 whose
score is below the threshold, or at r_max, with the loss it had there, as if alone (the paper's
masking harness shows the others its held state; the tests bound the difference). Reported: each
policy's loops and FLOPs per token at the bar (uniform depth's loss at mean_loops), with paired
bootstrap intervals; to allocate.json also each exit's operating threshold (the fewest loops that
reach the bar: sample.py --exit runs it) and every point of every curve (studies.matched).

    python allocate.py --out_dir=out-shakespeare
"""
import json
import os
import time
from functools import partial
from math import inf

import numpy as np
import torch

from configurator import UserError, configure, run
from evaluate import load_windows, markdown, paired_bootstrap, show, trace_windows
from model import (DEVICES, EXIT_TESTS, MAX_LOOPS, MIN_EXIT_LOOP, DepthPolicy, autocast,
                   checkpoint_id, exit_depth, save_atomic)
from prepare import open_run

out_dir = "out-shakespeare"  # reads ckpt.pt, writes allocate.json
windows = 128  # evaluation windows of block_size + 1 tokens from val.bin
train_windows = 32  # windows from train.bin for the threshold grids
r_max = 0  # the deepest loop any policy may run; 0: the model's max_loops (the paper's r_max)
batch_size = 8  # windows per forward
n_grid = 48  # thresholds per exit, geometric over the range of its scores on the train windows
bootstrap = 1000  # resamples of the windows for every interval
seed = 1337  # picks the windows and the bootstrap resamples
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu, cuda or cuda:N
dtype = "float32"  # even on a GPU: bf16 autocast puts a floor under the small KLs the exits test
RULES = dict(windows=(1, inf), train_windows=(2, inf), r_max=(0, MAX_LOOPS), batch_size=(1, inf),
             n_grid=(2, inf), bootstrap=(10, inf), seed=(0, 2 ** 32 - 1),
             dtype=("float32", "bfloat16"), device=DEVICES)


def allocation_windows(data_dir, meta, length, args):
    """The windows allocate.py reads with settings `args` (its own, or allocate.json's "args"):
    -> (evaluation windows from val.bin, training windows from train.bin), (n, length) each."""
    val = load_windows(f"{data_dir}/val.bin", meta["dtype"], args.windows, length, args.seed)
    train = load_windows(f"{data_dir}/train.bin", meta["dtype"], args.train_windows, length,
                         args.seed + 1)
    return val, train


def read_allocation(out_dir, ckpt):
    """out_dir/allocate.json, checked to be of ckpt (the checkpoint dict) -> its dict, or UserError:
    a retrained run's thresholds are not this one's."""
    path = os.path.join(out_dir, "allocate.json")
    if not os.path.isfile(path):
        raise UserError(f"no {path}: run `python allocate.py --out_dir={out_dir}` first")
    with open(path) as f:
        allocated = json.load(f)
    if allocated["checkpoint"] != checkpoint_id(ckpt):
        raise UserError(f"{path} is of {allocated['checkpoint']}, "
                        f"not of ckpt.pt ({checkpoint_id(ckpt)})")
    return allocated


def log_grid(scores, n):
    """n thresholds, geometric between the 1st and 99th percentiles of the positive scores: they
    span decades (KL 1e-1 at loop 2, 1e-5 in the tail), and every depth gets one near it."""
    positive = scores[torch.isfinite(scores) & (scores > 0)].double().numpy()
    # every score 0 (a model whose output never changes): any threshold stops every token at once
    if not positive.size:
        return [1.0] * n
    low, high = np.quantile(positive, [0.01, 0.99])
    return np.geomspace(low, high, n).tolist()


def threshold_grids(model, train_wins, C, r_max):
    """{exit test's name: its thresholds}, from the scores where tokens may stop on training
    windows: tuned on the evaluation windows, they would flatter the exits."""
    traced = trace_windows(model, train_wins, r_max, C.batch_size, tuple(EXIT_TESTS))
    return {name: log_grid(traced[name][MIN_EXIT_LOOP - 1:], C.n_grid) for name in EXIT_TESTS}


def read_policies(model, traced, tests, grids):
    """Every policy's points read off the trace -> per_window {(policy, "loss" | "loops" |
    "flops"): (points, windows)}: each window's mean loss, loops and FLOPs per token at uniform
    depth r = 1..r_max, and for each exit test {policy: ExitTest} at each of grids[policy]."""
    r_max, n, T = traced["loss"].shape
    uniform_loops = np.repeat(np.arange(1.0, r_max + 1)[:, None], n, 1)
    per_window = {("uniform", "loss"): traced["loss"].double().mean(2).numpy(),
                  ("uniform", "loops"): uniform_loops,
                  ("uniform", "flops"): model.inference_flops(uniform_loops, T)}
    # under an exit, a token has the trace's loss after the last loop the stop rule gives it
    for name, test in tests.items():
        losses = []
        loops = []
        for threshold in grids[name]:
            depth = exit_depth(traced[name], DepthPolicy(test, threshold, r_max))
            loss = traced["loss"].gather(0, depth[None] - 1)[0]
            losses.append(loss.double().mean(1).numpy())
            loops.append(depth.double().mean(1).numpy())
        per_window[name, "loss"] = np.stack(losses)
        per_window[name, "loops"] = np.stack(loops)
        per_window[name, "flops"] = model.inference_flops(per_window[name, "loops"], T, test)
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
    for (c0, l0), (c1, l1) in zip(points, points[1:]):
        if l1 <= loss:
            return c0 + (l0 - loss) / (l0 - l1) * (c1 - c0)
    return None


def bar_loss(per_window, mean):
    """The bar: uniform depth's loss at r = mean_loops, the quality every policy is held to."""
    return per_window["uniform", "loss"][mean - 1].mean()


def operating_threshold(per_window, policy, grid, bar):
    """An exit's operating point: the largest threshold on its grid whose loss reaches the bar
    (the fewest loops that do), or the smallest if none does. sample.py --exit runs it."""
    losses = per_window[policy, "loss"].mean(1)
    reaching = [threshold for threshold, loss in zip(grid, losses) if loss <= bar]
    return max(reaching, default=min(grid))


def cost_at_bar(per_window, policy, mean, cost):
    return cost_at_loss(curve(per_window, policy, cost), bar_loss(per_window, mean))


def saving_at_bar(per_window, policy, mean, cost):
    """1 - the policy's cost at the bar / uniform depth's."""
    spent = cost_at_bar(per_window, policy, mean, cost)
    uniform = cost_at_bar(per_window, "uniform", mean, cost)
    if spent is None or uniform is None:
        return None
    return 1 - spent / uniform


def summarize(per_window, C, mean):
    """Each policy's cost at the bar in loops and FLOPs and what it saves against uniform depth,
    with paired intervals (every array resampled with the same windows) -> {"bar": loss, "at_bar":
    {policy: {"loops", "loops_saved", "flops", "flops_saved"}}}."""
    result = {"bar": bar_loss(per_window, mean), "at_bar": {}}
    for policy in dict.fromkeys(policy for policy, _ in per_window):
        at_bar = {}
        for cost in ("loops", "flops"):
            spent = partial(cost_at_bar, policy=policy, mean=mean, cost=cost)
            saved = partial(saving_at_bar, policy=policy, mean=mean, cost=cost)
            at_bar[cost] = paired_bootstrap(spent, per_window, C.bootstrap, C.seed)
            at_bar[f"{cost}_saved"] = paired_bootstrap(saved, per_window, C.bootstrap, C.seed)
        result["at_bar"][policy] = at_bar
    return result


def print_report(result):
    """A row per policy: the loops and FLOPs at which it reaches the bar, what it saves there."""
    print(f"\n## Allocation against uniform depth: {result['windows']} windows, r_max "
          f"{result['r_max']}; the bar is uniform r={result['mean_loops']}'s loss, "
          f"{result['bar']:.4f}\n")
    print("The loops and FLOPs per token at which each policy first reaches the bar (-: never), "
          "and what it saves there (an interval holding 0: no difference).\n")
    rows = []
    for policy, at_bar in result["at_bar"].items():
        label = result["labels"][policy]
        named = f"{policy} ({label})" if label else policy
        rows.append([named, show(at_bar["loops"], ".2f"), show(at_bar["loops_saved"], "+.3f"),
                     show(at_bar["flops"], ".3g", 1e6), show(at_bar["flops_saved"], "+.3f")])
    headers = ["policy", "loops at the bar", "loops saved", "MFLOP/token at the bar", "FLOPs saved"]
    print(markdown(headers, rows))
    thresholds = [f"{name} {value:.3g}" for name, value in result["operating_thresholds"].items()]
    print(f"\nOperating thresholds (the fewest loops that reach the bar, else the grid's deepest; "
          f"sample.py --exit runs them): {', '.join(thresholds)}")


def main(argv=()):
    C, _ = configure(globals(), argv)
    # 1) the checkpoint, its data and the windows; every refusal before the work
    model, ckpt, data_dir, meta = open_run(C.out_dir, C.device, writes=True)
    mean = model.config.mean_loops
    r_max = C.r_max or model.config.max_loops
    # the bar is uniform depth at mean_loops, and an exit compares two loops: r_max reaches both
    if r_max < max(MIN_EXIT_LOOP, mean):
        raise UserError(f"--r_max={r_max}: needs at least {MIN_EXIT_LOOP} and mean_loops ({mean})")
    length = model.config.block_size + 1
    wins, train_wins = allocation_windows(data_dir, meta, length, C)
    print(f"{C.out_dir}/ckpt.pt: {checkpoint_id(ckpt)}; {C.device} {C.dtype}")
    # 2) the grids from training windows; the trace of the evaluation windows, from a zero state
    # as sample.py's exits start: the thresholds calibrated here are the ones it runs
    started = time.perf_counter()
    with autocast(C.device, C.dtype):
        grids = threshold_grids(model, train_wins.to(C.device), C, r_max)
        traced = trace_windows(model, wins.to(C.device), r_max, C.batch_size,
                               ("loss", *EXIT_TESTS))
    # 3) every policy read off it, compared with uniform depth, reported; then saved
    per_window = read_policies(model, traced, EXIT_TESTS, grids)
    result = {"args": vars(C), "checkpoint": checkpoint_id(ckpt), "mean_loops": mean,
              "r_max": r_max, "windows": C.windows}
    result |= summarize(per_window, C, mean)
    result["labels"] = {"uniform": "A0"} | {name: test.label for name, test in EXIT_TESTS.items()}
    bar = result["bar"]
    result["operating_thresholds"] = {name: operating_threshold(per_window, name, grids[name], bar)
                                      for name in EXIT_TESTS}
    print_report(result)
    # every point of every curve, window by window
    result["settings"] = {"uniform": list(range(1, r_max + 1))} | grids
    result["per_window"] = {}
    for (policy, measure), array in per_window.items():
        result["per_window"].setdefault(policy, {})[measure] = array.tolist()
    save_atomic(os.path.join(C.out_dir, "allocate.json"), result)
    print(f"\nwrote {C.out_dir}/allocate.json in {time.perf_counter() - started:.0f}s")
    return result


if __name__ == "__main__":
    run(main)
