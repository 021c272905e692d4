"""A checkpoint on its validation split: how its loss and its tokens depend on the depth.

One pass over the windows, loop by loop from training's initial noise (`trace`), gives the sweep (the loss at
each loop count), the saturation depth and the convergence table; tokens/s at batch 1 are timed apart.

    python evaluate.py --out_dir=out-shakespeare --loops=1,2,4,8  # every number: out_dir/eval.json
"""
import math
import os
import time
from collections import defaultdict

import numpy as np
import torch
from tqdm import tqdm

from configurator import UserError, configure, run
from model import (DEVICES, EXIT_TESTS, autocast, checkpoint_id, clock, load_checkpoint, save_atomic, state_change,
                   token_loss)
from prepare import bits_per_byte, open_dataset

out_dir = "out-shakespeare"  # reads ckpt.pt, writes eval.json
loops = ""  # the sweep, e.g. "1,2,4,8" (1 and mean_loops always in it); "": 1, 2, mean/2, mean, 2x, 4x mean
windows = 64  # validation windows of block_size + 1 tokens
batch_size = 8  # windows per forward
timing_windows = 4  # batch-1 forwards timed per loop count
seed = 1337  # picks the windows and the initial noise
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu, cuda or cuda:N
dtype = "float32"  # even on a GPU: bf16 autocast puts a floor under the KL tail (~1e-5), where it is read
RULES = {"windows": (1, math.inf), "batch_size": (1, math.inf), "timing_windows": (1, math.inf),
         "seed": (0, 2 ** 63 - 1), "dtype": ("float32", "bfloat16"), "device": DEVICES}  # a seed torch.Generator takes
MOVING_KL = 1e-3  # the paper's "still moving" line, fixed so that runs compare
SATURATION_TOL = 0.002  # nats: the smallest loss gap the paper reports as an effect (fixed before issue 31's runs)


def loop_counts(text, mean):
    """The sweep, sorted; always r=1 (the shallowest) and mean_loops (the speed reference)."""
    if not text:  # out to 4 x mean_loops: far enough past training's depth to see the curve flatten
        return sorted({1, 2, max(1, mean // 2), mean, 2 * mean, 4 * mean})
    counts = {1, mean}
    for part in text.split(","):
        if not (part.strip().isdecimal() and 1 <= int(part) <= 1024):
            raise UserError(f"--loops {text!r}: expected counts in [1, 1024], e.g. 1,2,4,8")
        counts.add(int(part))
    return sorted(counts)


def load_windows(path, bin_dtype, n, length, seed):
    """n of the split's non-overlapping windows of `length` tokens, picked by seed -> (n, length) int64."""
    data = np.memmap(path, dtype=bin_dtype, mode="r")
    slots = len(data) // length
    if not 1 <= n <= slots:
        raise UserError(f"{n} windows of {length} tokens asked for: {path} holds 1 to {slots}")
    # whole slots of the split, so that no token is in two windows (the bootstrap's units)
    order = torch.randperm(slots, generator=torch.Generator().manual_seed(seed))
    picked = order[:n].sort().values.numpy()
    grid = data[:slots * length].reshape(slots, length)  # a view: only the picked rows are read
    return torch.from_numpy(grid[picked].astype(np.int64))


@torch.no_grad()
def trace(model, x, y, n_loops, state_init="zero", generator=None, keep_states=False):
    """x, y (B, T) -> per loop, each (n_loops, B, T): loss, the score of every exit test in EXIT_TESTS under its
    name (loop 1: inf, nothing to compare with), dstate = ||s_i - s_{i-1}||, argmax, and states = s_i if kept."""
    # one pass with a readout after every loop: the loss at every depth and every exit score
    # for the cost of the deepest (plus its readouts)
    e = model.prelude(x)
    s = model.init_state(e, state_init, generator)
    logits = None  # no readout before loop 1
    out = defaultdict(list)
    for _ in range(n_loops):
        s_old = s
        s = model.core_step(e, s)
        previous = logits
        logits = model.readout(s)
        out["loss"].append(token_loss(logits, y))
        for name, test in EXIT_TESTS.items():
            if previous is None:  # loop 1 has no earlier readout to compare with: never "converged"
                out[name].append(torch.full_like(y, math.inf, dtype=torch.float))
            else:
                out[name].append(test.score(s, s_old, logits, previous).float())
        out["dstate"].append(state_change(s, s_old))
        out["argmax"].append(logits.argmax(-1))
        if keep_states:
            out["states"].append(s)
    return {key: torch.stack(values) for key, values in out.items()}


def trace_windows(model, wins, n_loops, batch_size, keys, state_init="zero", generator=None, states_as=None):
    """trace over windows (n, T + 1), batch by batch -> {key: (n_loops, n, T)} on the CPU for each of keys; with
    states_as = (name, fn), also {name: fn(each batch's states (n_loops, B, T, d)), joined along the windows}."""
    parts = defaultdict(list)
    for batch in tqdm(wins.split(batch_size), leave=False):
        keep_states = states_as is not None
        traced = trace(model, batch[:, :-1], batch[:, 1:], n_loops, state_init, generator, keep_states)
        for key in keys:
            parts[key].append(traced[key].cpu())
        if states_as:
            name, fn = states_as
            parts[name].append(fn(traced["states"]).cpu())
    return {key: torch.cat(values, 1) for key, values in parts.items()}


@torch.no_grad()
def tokens_per_second(model, wins, r, C):
    """Forwards of one window at a time at r loops: the speed a single request sees."""
    # timed apart from the pass, whose readout at every loop a plain forward does not pay
    timed = wins[:C.timing_windows, :-1]
    with autocast(C.device, C.dtype):
        model(timed[:1], loops=r)  # a warm-up: allocations and kernel choices are not timed
        started = clock(C.device)  # a GPU runs queued work: the clock waits for it
        for x in timed:
            model(x[None], loops=r)
    return timed.numel() / (clock(C.device) - started)


def sweep(losses, speed, meta):
    """The elasticity sweep / cost curve: losses (loops, n, T) per token, speed {r: tokens/s} -> a row per r."""
    loss_at = losses.double().mean((1, 2))  # in float64: a mean over every token of every window
    rows = []
    for r, tokens_per_s in speed.items():
        loss = loss_at[r - 1].item()
        bits = bits_per_byte(loss, meta)  # per byte, losses compare across tokenizers
        rows.append({"loops": r, "loss": loss, "bits_per_byte": bits, "tokens_per_s": tokens_per_s})
    return rows


def paired_bootstrap(stat, per_window, n_resamples, seed):
    """stat({name: array (..., windows)}) -> float or None, and its 95% interval over paired resamples
    of the windows -> {"value": float | None, "interval": [low, high] | None}."""
    value = stat(per_window)
    if value is None:
        return {"value": None, "interval": None}
    n_windows = next(iter(per_window.values())).shape[-1]
    if n_windows < 2:  # one window resamples to itself: a zero-width interval would read as certainty
        return {"value": float(value), "interval": None}
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(n_resamples):
        # the same windows for every array: what two depths (or policies) share cancels out
        pick = rng.integers(0, n_windows, n_windows)
        resampled = {name: array[..., pick] for name, array in per_window.items()}
        values.append(stat(resampled))
    defined = [v for v in values if v is not None]
    interval = None  # unless enough resamples are defined: percentiles of a few would mislead
    if len(defined) >= 0.95 * n_resamples:
        # percentiles interpolate between resampled values: a depth's interval may end between depths
        interval = np.percentile(defined, [2.5, 97.5]).tolist()
    return {"value": float(value), "interval": interval}


def show(estimate, spec="+.4f", scale=1):
    """'value [low, high]' of an estimate (divided by scale, formatted by spec), or '-' without a value."""
    if estimate["value"] is None:
        return "-"
    text = format(estimate["value"] / scale, spec)
    if estimate["interval"] is not None:
        low, high = (format(v / scale, spec) for v in estimate["interval"])
        text += f" [{low}, {high}]"
    return text


def saturation(losses, swept, mean):
    """losses (loops, n, T) -> the saturation depth, the smallest swept r whose loss is within SATURATION_TOL
    of the best swept depth's up to 4 x mean_loops, and the useful range, loss(1) - loss(saturation depth),
    each with its 95% interval over paired resamples of the windows."""
    # Issue 31's test of the paper's "a recursive model uses depth up to its training mean and no further".
    # Past its best depth a curve is flat and noise picks the minimum: the tolerance keeps that noise out
    # of the depth, and the interval says how far the windows move it (between swept depths: interpolated).
    depths = [r for r in swept if r <= 4 * mean]  # swept always holds 1
    at_depths = losses[[r - 1 for r in depths]]  # (depths, windows, T)
    per_window = {"loss": at_depths.double().mean(2).numpy()}  # (depths, windows)

    def depth_index(resampled):
        loss = resampled["loss"].mean(1)
        return int(np.argmax(loss <= loss.min() + SATURATION_TOL))  # argmax finds the first True

    def useful_range(resampled):
        loss = resampled["loss"].mean(1)
        return loss[0] - loss[depth_index(resampled)]
    return {"depth": paired_bootstrap(lambda resampled: depths[depth_index(resampled)], per_window, 1000, 0),
            "useful_range": paired_bootstrap(useful_range, per_window, 1000, 0)}


def convergence_depth(kl):
    """kl (loops 2..n, tokens) -> per token the loop after which its KL stays <= MOVING_KL:
    1 if it never moved, n + 1 if it still moves at loop n."""
    n_loops = kl.size(0) + 1
    loop = torch.arange(2, n_loops + 1)[:, None]
    # the last loop that moved, not the first that did not: a token may settle, then move again
    last_moving = torch.where(kl > MOVING_KL, loop, 0).amax(0)
    return torch.where(last_moving == n_loops, n_loops + 1, last_moving.clamp_min(1))


def convergence(kl, dstate, loss, mean):
    """kl, dstate, loss (loops 2..n, tokens) -> a row per loop of the means over the tokens of the KL,
    the state change, the loss and the % still moving; the median convergence depth, the % at mean_loops."""
    moving = 100 * (kl > MOVING_KL).double()
    means_of = {"mean_kl": kl, "mean_state_change": dstate, "percent_moving": moving, "loss": loss}
    rows = []
    for i in range(len(kl)):
        row = {"loop": i + 2}
        for name, values in means_of.items():
            row[name] = values[i].mean().item()
        rows.append(row)
    cv = {"rows": rows, "median_depth": np.median(convergence_depth(kl))}
    if mean >= 2:  # at loop 1 there is no KL yet, nothing to call moving
        cv["percent_moving_at_mean"] = rows[mean - 2]["percent_moving"]
    return cv


def markdown(headers, rows):
    """A markdown table of headers and rows of cells."""
    lines = []
    for row in [headers, ["---"] * len(headers), *rows]:
        cells = " | ".join(map(str, row))
        lines.append(f"| {cells} |")
    return "\n".join(lines)


def table(title, rows, columns):
    """Print rows under a title; columns "key:format ..." name eval.json's keys (a missing one: nan)."""
    formats = dict(column.split(":") for column in columns.split())  # {key: format}
    cells = []
    for row in rows:
        cells.append([format(row.get(key, math.nan), spec) for key, spec in formats.items()])
    print(f"\n## {title}\n\n{markdown(list(formats), cells)}")


def main(argv=()):
    started = time.perf_counter()
    C, _ = configure(globals(), argv)
    # 1) the checkpoint and its windows; every refusal comes before the work
    path = os.path.join(C.out_dir, "ckpt.pt")
    model, ckpt = load_checkpoint(path, C.device)
    result = os.path.join(C.out_dir, "eval.json")
    if not os.access(C.out_dir, os.W_OK):  # before minutes of tracing
        raise UserError(f"--out_dir={C.out_dir} is not writable")
    mean = model.config.mean_loops
    swept = loop_counts(C.loops, mean)
    n_diag = 2 * mean  # the convergence table's loops: the paper's reads to loop 16 at mean 8
    data_dir, meta = open_dataset(ckpt["config"]["dataset"], ckpt, path, splits=("val",))
    length = model.config.block_size + 1
    wins = load_windows(f"{data_dir}/val.bin", meta["dtype"], C.windows, length, C.seed).to(C.device)
    # 2) one pass, as deep as the sweep and the convergence table both need
    # from training's noise, one generator for all windows: the loss at loop r is model.forward's at r loops
    generator = torch.Generator(device=C.device).manual_seed(C.seed)
    with autocast(C.device, C.dtype):
        n_loops = max(*swept, n_diag)
        # "kl", KL(p_i || p_{i-1}), is the kl exit test's score: the convergence table's measure too
        traced = trace_windows(model, wins, n_loops, C.batch_size, ("loss", "kl", "dstate"), "noise", generator)
    # 3) the sweep: the loss at each swept r, and its speed
    speed = {r: tokens_per_second(model, wins, r, C) for r in swept}
    el = sweep(traced["loss"], speed, meta)
    columns = "loops:d loss:.4f bits_per_byte:.4f tokens_per_s:.0f"
    table(f"Elasticity / cost curve of {checkpoint_id(ckpt)} (noise init, {len(wins)} windows)", el, columns)
    # 4) the saturation depth: the first swept depth past which more loops buy less than SATURATION_TOL
    sat = saturation(traced["loss"], swept, mean)
    print(f"\nsaturation depth {show(sat['depth'], 'g')} (95% interval): the first swept r within {SATURATION_TOL} "
          f"nats of the best r <= {4 * mean}; useful range {show(sat['useful_range'], '.4f')} nats, gained from r=1")
    # 5) the convergence table, from loop 2 (loop 1 has no successive KL)
    diag = {key: values[1:n_diag].flatten(1) for key, values in traced.items()}  # each (loops, windows x T)
    cv = convergence(diag["kl"], diag["dstate"], diag["loss"], mean)
    columns = "loop:d mean_kl:.1e mean_state_change:.3g percent_moving:.1f loss:.3f"
    table(f"Convergence (a token moves while its KL > {MOVING_KL})", cv["rows"], columns)
    print(f"\nmedian convergence depth (the loop after which a token stays still): {cv['median_depth']}")
    # 6) every number above, in eval.json
    res = {"args": vars(C), "checkpoint": checkpoint_id(ckpt), "dataset": ckpt["config"]["dataset"], "mean_loops": mean,
           "elasticity": el, "saturation": sat, "convergence": cv, "seconds": time.perf_counter() - started}
    save_atomic(result, res)
    print(f"\nwrote {result}")
    return res


if __name__ == "__main__":
    run(main)
