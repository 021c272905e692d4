"""A checkpoint on its validation split: how its loss and its tokens depend on the depth.

One pass over the windows, loop by loop from training's initial noise (`trace`), gives the sweep (the loss at
each loop count, and each window's) and the convergence table. Built on it in studies/: the saturation depth,
the speed at each depth, and the paper's figures.

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
from model import DEVICES, EXIT_TESTS, autocast, checkpoint_id, save_atomic, state_change, token_loss
from prepare import bits_per_byte, open_run

out_dir = "out-shakespeare"  # reads ckpt.pt, writes eval.json
loops = ""  # the sweep, e.g. "1,2,4,8" (1 and mean_loops always in it); "": 1, 2, mean/2, mean, 2x, 4x mean
windows = 64  # validation windows of block_size + 1 tokens
batch_size = 8  # windows per forward
seed = 1337  # picks the windows and the initial noise
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu, cuda or cuda:N
dtype = "float32"  # even on a GPU: bf16 autocast puts a floor under the KL tail (~1e-5), where it is read
RULES = {"windows": (1, math.inf), "batch_size": (1, math.inf), "seed": (0, 2 ** 63 - 1),  # what torch.Generator takes
         "dtype": ("float32", "bfloat16"), "device": DEVICES}
MOVING_KL = 1e-3  # the paper's "still moving" line, fixed so that runs compare


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
        raise UserError(f"{n} windows of {length} tokens asked for: {path} holds {slots}")
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


def sweep(losses, swept, meta):
    """The elasticity sweep: losses (loops, n, T) per token -> a row per swept r: the loss (nats per token, and
    bits per byte) and each window's, the unit a bootstrap resamples (studies/saturation.py)."""
    window_losses = losses.double().mean(2)  # in float64: means over every token
    rows = []
    for r in swept:
        loss = window_losses[r - 1].mean().item()
        bits = bits_per_byte(loss, meta)  # per byte, losses compare across tokenizers
        rows.append({"loops": r, "loss": loss, "bits_per_byte": bits, "window_losses": window_losses[r - 1].tolist()})
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
    model, ckpt, data_dir, meta = open_run(C.out_dir, C.device, splits=("val",), writes=True)
    result = os.path.join(C.out_dir, "eval.json")
    mean = model.config.mean_loops
    swept = loop_counts(C.loops, mean)
    n_diag = 2 * mean  # the convergence table's loops: the paper's reads to loop 16 at mean 8
    length = model.config.block_size + 1
    wins = load_windows(f"{data_dir}/val.bin", meta["dtype"], C.windows, length, C.seed).to(C.device)
    # 2) one pass, as deep as the sweep and the convergence table both need
    # from training's noise, one generator for all windows: the loss at loop r is model.forward's at r loops
    generator = torch.Generator(device=C.device).manual_seed(C.seed)
    with autocast(C.device, C.dtype):
        n_loops = max(*swept, n_diag)
        # "kl", KL(p_i || p_{i-1}), is the kl exit test's score: the convergence table's measure too
        traced = trace_windows(model, wins, n_loops, C.batch_size, ("loss", "kl", "dstate"), "noise", generator)
    # 3) the sweep: the loss at each swept r
    elasticity = sweep(traced["loss"], swept, meta)
    title = f"Elasticity of {checkpoint_id(ckpt)} (noise init, {len(wins)} windows)"
    table(title, elasticity, "loops:d loss:.4f bits_per_byte:.4f")
    # 4) the convergence table, from loop 2 (loop 1 has no successive KL)
    from_loop_2 = {key: values[1:n_diag].flatten(1) for key, values in traced.items()}  # each (loops, windows x T)
    by_loop = convergence(from_loop_2["kl"], from_loop_2["dstate"], from_loop_2["loss"], mean)
    columns = "loop:d mean_kl:.1e mean_state_change:.3g percent_moving:.1f loss:.3f"
    table(f"Convergence (a token moves while its KL > {MOVING_KL})", by_loop["rows"], columns)
    print(f"\nmedian convergence depth (the loop after which a token stays still): {by_loop['median_depth']}")
    # 5) every number above, in eval.json
    res = {"args": vars(C), "checkpoint": checkpoint_id(ckpt), "dataset": ckpt["config"]["dataset"], "mean_loops": mean,
           "elasticity": elasticity, "convergence": by_loop, "seconds": time.perf_counter() - started}
    save_atomic(result, res)
    print(f"\nwrote {result}")
    return res


if __name__ == "__main__":
    run(main)
