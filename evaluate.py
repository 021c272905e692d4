"""A checkpoint on its validation split: how its loss and its tokens depend on the depth.

One pass over the windows, loop by loop from training's initial noise (`trace`), gives a row per
loop count (the loss, and how the tokens converge: the successive KL, the state change, the share
still moving) and the median convergence depth. studies/ builds on it (saturation, figures).

    python evaluate.py --out_dir=out-shakespeare --loops=1,2,4,8  # every number: out_dir/eval.json
"""
import math
import os
import time
from collections import defaultdict

import numpy as np
import torch

from configurator import UserError, configure, run
from model import (DEVICES, EXIT_TESTS, MAX_LOOPS, MIN_EXIT_LOOP, autocast, checkpoint_id,
                   save_atomic, state_change, token_loss)
from prepare import bits_per_byte, open_run

out_dir = "out-shakespeare"  # reads ckpt.pt, writes eval.json
loops = ""  # the loop counts, e.g. "1,2,4,8" (1 and mean_loops always); "": 1 .. 2x mean, 4x mean
windows = 64  # validation windows of block_size + 1 tokens
batch_size = 8  # windows per forward
seed = 1337  # picks the windows and the initial noise
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu, cuda or cuda:N
dtype = "float32"  # even on a GPU: bf16 autocast puts a floor under the KL tail (~1e-5)
# the most torch.Generator takes
RULES = {"windows": (1, math.inf), "batch_size": (1, math.inf), "seed": (0, 2 ** 63 - 1),
         "dtype": ("float32", "bfloat16"), "device": DEVICES}
# the paper's "still moving" line, fixed so that runs compare
MOVING_KL = 1e-3
# fewer items (windows, a task's items) resample to too few sets for a 95% interval to mean much
MIN_ITEMS_FOR_INTERVAL = 10


def loop_counts(text, mean):
    """The loop counts, sorted, 1 and mean_loops always; by default every loop to 2 x mean_loops
    (the paper's table reads to 16 at mean 8) and 4 x mean_loops, to see the curve flatten."""
    if not text:
        return sorted({*range(1, 2 * mean + 1), 4 * mean})
    counts = {1, mean}
    for part in text.split(","):
        if not (part.strip().isdecimal() and 1 <= int(part) <= MAX_LOOPS):
            raise UserError(f"--loops {text!r}: expected counts in [1, {MAX_LOOPS}], e.g. 1,2,4,8")
        counts.add(int(part))
    return sorted(counts)


def load_windows(path, bin_dtype, n, length, seed):
    """n of the split's whole slots of `length` tokens (no token in two windows: the bootstrap's
    units), picked by seed and read alone -> (n, length) int64."""
    data = np.memmap(path, dtype=bin_dtype, mode="r")
    slots = len(data) // length
    if not 1 <= n <= slots:
        raise UserError(f"{n} windows of {length} tokens asked for: {path} holds {slots}")
    order = torch.randperm(slots, generator=torch.Generator().manual_seed(seed))
    picked = order[:n].sort().values.numpy()
    grid = data[:slots * length].reshape(slots, length)
    return torch.from_numpy(grid[picked].astype(np.int64))


@torch.no_grad()
def trace(model, x, y, n_loops, state_init="zero", generator=None):
    """x, y (B, T) -> per loop, each (n_loops, B, T): loss, the score of every exit test in
    EXIT_TESTS under its name, dstate = ||s_i - s_{i-1}|| and argmax: every depth for the cost of
    the deepest and its readouts."""
    e = model.prelude(x)
    s = model.init_state(e, state_init, generator)
    logits = None
    out = defaultdict(list)
    for loop in range(1, n_loops + 1):
        s_old = s
        s = model.core_step(e, s)
        previous = logits
        logits = model.readout(s)
        out["loss"].append(token_loss(logits, y))
        for name, test in EXIT_TESTS.items():
            # before MIN_EXIT_LOOP there is nothing to compare with: never settled
            if loop < MIN_EXIT_LOOP:
                out[name].append(torch.full_like(y, math.inf, dtype=torch.float))
            else:
                out[name].append(test.score(s, s_old, logits, previous).float())
        out["dstate"].append(state_change(s, s_old))
        out["argmax"].append(logits.argmax(-1))
    return {key: torch.stack(values) for key, values in out.items()}


def trace_windows(model, wins, n_loops, batch_size, keys, state_init="zero", generator=None):
    """trace over windows (n, T + 1), batch by batch -> {key: (n_loops, n, T)} on the CPU for
    each of keys."""
    parts = defaultdict(list)
    for batch in wins.split(batch_size):
        traced = trace(model, batch[:, :-1], batch[:, 1:], n_loops, state_init, generator)
        for key in keys:
            parts[key].append(traced[key].cpu())
    return {key: torch.cat(values, 1) for key, values in parts.items()}


def by_loop(traced, loops, meta):
    """A row per loop count r, from traced (n_loops, n, T): the loss (nats per token, bits per byte,
    each window's) and from loop 2 the means of KL(p_r || p_{r-1}) and of the state change, and the
    % of tokens still moving (KL > MOVING_KL); means over every token, in float64."""
    window_losses = traced["loss"].double().mean(2)
    rows = []
    for r in loops:
        loss = window_losses[r - 1].mean().item()
        row = {"loops": r, "loss": loss, "bits_per_byte": bits_per_byte(loss, meta),
               "window_losses": window_losses[r - 1].tolist()}
        if r >= 2:
            kl = traced["kl"][r - 1].double()
            row["mean_kl"] = kl.mean().item()
            row["mean_state_change"] = traced["dstate"][r - 1].double().mean().item()
            row["percent_moving"] = 100 * (kl > MOVING_KL).double().mean().item()
        rows.append(row)
    return rows


def paired_bootstrap(stat, per_window, n_resamples, seed):
    """stat({name: array (..., windows)}) -> float or None, and its 95% interval over paired
    resamples of the windows -> {"value": float | None, "interval": [low, high] | None}."""
    value = stat(per_window)
    if value is None:
        return {"value": None, "interval": None}
    n_windows = next(iter(per_window.values())).shape[-1]
    if n_windows < MIN_ITEMS_FOR_INTERVAL:
        return {"value": float(value), "interval": None}
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(n_resamples):
        # the same windows for every array: what two depths (or policies) share cancels out
        pick = rng.integers(0, n_windows, n_windows)
        resampled = {name: array[..., pick] for name, array in per_window.items()}
        values.append(stat(resampled))
    defined = [v for v in values if v is not None]
    # no interval unless nearly all resamples are defined (percentiles of a few would mislead);
    # they interpolate, so a depth's interval may end between depths
    interval = None
    if len(defined) >= 0.95 * n_resamples:
        interval = np.percentile(defined, [2.5, 97.5]).tolist()
    return {"value": float(value), "interval": interval}


def show(estimate, spec="+.4f", scale=1):
    """'value [low, high]' of an estimate (divided by scale, formatted by spec), '-' without one."""
    if estimate["value"] is None:
        return "-"
    text = format(estimate["value"] / scale, spec)
    if estimate["interval"] is not None:
        low, high = (format(v / scale, spec) for v in estimate["interval"])
        text += f" [{low}, {high}]"
    return text


def convergence_depth(kl, first_loop):
    """kl (loops, tokens), row 0 after loop first_loop -> per token the loop after which its KL
    stays <= MOVING_KL: first_loop - 1 if it never moved, the last loop + 1 if it still moves."""
    depth = torch.full(kl.shape[1:], first_loop - 1)
    # the last loop that moved, not the first that did not: a token may settle, then move again
    for row, kl_after_loop in enumerate(kl):
        loop = first_loop + row
        depth = torch.where(kl_after_loop > MOVING_KL, loop, depth)
    last_loop = first_loop + len(kl) - 1
    return torch.where(depth == last_loop, last_loop + 1, depth)


def markdown(headers, rows):
    """A markdown table of headers and rows of cells."""
    table_rows = [headers, ["---"] * len(headers), *rows]
    return "\n".join("| " + " | ".join(map(str, row)) + " |" for row in table_rows)


def table(title, rows, columns):
    """Print rows under a title; columns "key:format ..." name the rows' keys (missing: nan)."""
    formats = dict(column.split(":") for column in columns.split())
    cells = []
    for row in rows:
        cells.append([format(row.get(key, math.nan), spec) for key, spec in formats.items()])
    print(f"\n## {title}\n\n{markdown(list(formats), cells)}")


def main(argv=()):
    started = time.perf_counter()
    C, _ = configure(globals(), argv)
    # 1) the checkpoint and its windows; every refusal comes before the work
    model, ckpt, data_dir, meta = open_run(C.out_dir, C.device, splits=("val",), writes=True)
    result_path = os.path.join(C.out_dir, "eval.json")
    mean = model.config.mean_loops
    loops_asked = loop_counts(C.loops, mean)
    length = model.config.block_size + 1
    wins = load_windows(f"{data_dir}/val.bin", meta["dtype"], C.windows, length, C.seed)
    # 2) one pass from training's noise (the loss at loop r is model.forward's at r loops), as
    # deep as the rows and the convergence depth (every loop to 2 x mean_loops) need
    generator = torch.Generator(device=C.device).manual_seed(C.seed)
    n_loops = max(*loops_asked, 2 * mean)
    with autocast(C.device, C.dtype):
        traced = trace_windows(model, wins.to(C.device), n_loops, C.batch_size,
                               ("loss", "kl", "dstate"), "noise", generator)
    # 3) a row per loop count, and the loop after which the median token stays still
    rows = by_loop(traced, loops_asked, meta)
    kl_from_loop_2 = traced["kl"][1:2 * mean].flatten(1)
    median_depth = np.median(convergence_depth(kl_from_loop_2, first_loop=2))
    title = (f"{checkpoint_id(ckpt)} by loop (noise init, {len(wins)} windows; a token moves "
             f"while its KL > {MOVING_KL})")
    columns = ("loops:d loss:.4f bits_per_byte:.4f mean_kl:.1e mean_state_change:.3g "
               "percent_moving:.1f")
    table(title, rows, columns)
    print(f"\nmedian convergence depth (the loop after which a token stays still): {median_depth}")
    # 4) every number above, in eval.json
    result = {"args": vars(C), "checkpoint": checkpoint_id(ckpt),
              "dataset": ckpt["config"]["dataset"], "mean_loops": mean, "rows": rows,
              "median_convergence_depth": median_depth, "seconds": time.perf_counter() - started}
    save_atomic(result_path, result)
    print(f"\nwrote {result_path}")
    return result


if __name__ == "__main__":
    run(main)
