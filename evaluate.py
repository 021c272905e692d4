"""A checkpoint on its validation split: how its loss and its tokens depend on the depth.

One pass over the windows, loop by loop from training's initial noise (`trace`), gives the sweep (the loss at
each loop count), the convergence table and depth by token class; tokens/s at batch 1 are timed apart.

    python evaluate.py --out_dir=out-shakespeare --loops=1,2,4,8  # every number: out_dir/eval.json
"""
import math
import os
import time
import unicodedata
from collections import defaultdict

import numpy as np
import torch
from tqdm import tqdm

from configurator import UserError, configure, run
from model import DEVICES, autocast, checkpoint_id, load_checkpoint, save_atomic, state_change, token_kl, token_loss
from prepare import bits_per_byte, load_tokenizer, open_dataset

out_dir = "out-shakespeare"  # reads ckpt.pt, writes eval.json
loops = ""  # the sweep, e.g. "1,2,4,8" (1 and mean_loops always in it); "": 1, 2, mean/2, mean, 2x, 4x mean
diag_loops = 0  # loops of the convergence table and the token classes; 0: 2 x mean_loops
windows = 64  # validation windows of block_size + 1 tokens
batch_size = 8  # windows per forward
timing_windows = 4  # batch-1 forwards timed per loop count
seed = 1337  # picks the windows and the initial noise
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu, cuda or cuda:N
dtype = "float32"  # even on a GPU: bf16 autocast puts a floor under the KL tail (~1e-5), where it is read
RULES = {"windows": (1, math.inf), "batch_size": (1, math.inf), "timing_windows": (1, math.inf),
         "seed": (0, 2 ** 63 - 1), "dtype": ("float32", "bfloat16"), "device": DEVICES}  # a seed torch.Generator takes
MOVING_KL = 1e-3  # the paper's "still moving" line and its token classes' exit, fixed so that runs compare
SATURATION_TOL = 0.002  # nats: the smallest loss gap the paper reports as an effect (fixed before issue 31's runs)
CLASSES = ("space", "numeral", "punctuation", "word")


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


@torch.no_grad()
def trace(model, x, y, n_loops, state_init="zero", generator=None, keep_states=False):
    """x, y (B, T) -> per loop, each (n_loops, B, T): loss, kl = KL(p_i || p_{i-1}) (loop 1: inf),
    dstate = ||s_i - s_{i-1}||, dstate_rel (over ||s_i||), argmax, and state = s_i if kept."""
    # one pass with a readout after every loop: the loss at every depth and every exit score
    # for the cost of the deepest (plus its readouts)
    e = model.prelude(x)
    s = model.init_state(e, state_init, generator)
    logits = None
    out = defaultdict(list)
    for _ in range(n_loops):
        s_old = s
        s = model.core_step(e, s)
        previous = logits
        logits = model.readout(s)
        out["loss"].append(token_loss(logits, y))
        if previous is None:  # loop 1 has nothing to compare with: never "converged"
            out["kl"].append(torch.full_like(y, math.inf, dtype=torch.float))
        else:  # the new distribution first, as the exit test reads it
            out["kl"].append(token_kl(logits, previous))
        out["dstate"].append(state_change(s, s_old))
        out["dstate_rel"].append(state_change(s, s_old, relative=True))
        out["argmax"].append(logits.argmax(-1))
        if keep_states:
            out["state"].append(s)
    return {key: torch.stack(values) for key, values in out.items()}


def trace_windows(model, wins, n_loops, C):
    """trace from noise over every window (n, T + 1) -> loss, kl, dstate, each (n_loops, n, T) on the CPU.
    Its loss at loop r is model.forward's at r loops: the same steps, the same noise from one generator."""
    generator = torch.Generator(device=C.device).manual_seed(C.seed)
    parts = defaultdict(list)
    for batch in tqdm(wins.split(C.batch_size), leave=False):
        with autocast(C.device, C.dtype):
            traced = trace(model, batch[:, :-1], batch[:, 1:], n_loops, "noise", generator)
        for key in ("loss", "kl", "dstate"):
            parts[key].append(traced[key].cpu())
    return {key: torch.cat(values, 1) for key, values in parts.items()}


@torch.no_grad()
def tokens_per_second(model, wins, r, C):
    """Forwards of one window at a time at r loops: the speed a single request sees."""
    # timed apart from the pass, whose readout at every loop a plain forward does not pay
    timed = wins[:C.timing_windows, :-1]
    cuda = C.device.startswith("cuda")
    with autocast(C.device, C.dtype):
        model(timed[:1], loops=r)  # a warm-up: allocations and kernel choices are not timed
        if cuda:  # a GPU runs queued work: wait for it before reading the clock
            torch.cuda.synchronize(C.device)
        started = time.perf_counter()
        for x in timed:
            model(x[None], loops=r)
        if cuda:
            torch.cuda.synchronize(C.device)
    return timed.numel() / (time.perf_counter() - started)


def sweep(losses, speed, meta):
    """The elasticity sweep / cost curve: losses (loops, n, T) per token, speed {r: tokens/s} -> a row per r."""
    loss_at = losses.double().mean((1, 2))  # in float64: a mean over every token of every window
    rows = []
    for r, tokens_per_s in speed.items():
        loss = loss_at[r - 1].item()
        row = {"loops": r, "loss": loss, "tokens_per_s": tokens_per_s}
        bits = bits_per_byte(loss, meta)
        if math.isfinite(bits):  # the split's bytes are known: per byte, losses compare across tokenizers
            row["bits_per_byte"] = bits
        rows.append(row)
    return rows


def paired_bootstrap(stat, per_window, n_resamples, seed):
    """stat({name: array (..., windows)}) -> float or None, and its 95% interval over paired resamples
    of the windows -> {"value": float | None, "interval": [low, high] | None}."""
    value = stat(per_window)
    if value is None:
        return {"value": None, "interval": None}
    n_windows = next(iter(per_window.values())).shape[-1]
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


def saturation(losses, swept, mean):
    """losses (loops, n, T) -> the saturation depth, the smallest swept r whose loss is within SATURATION_TOL
    of the best swept depth's up to 4 x mean_loops, and the useful range, loss(1) - loss(saturation depth),
    each with its 95% interval over paired resamples of the windows."""
    depths = [r for r in swept if r <= 4 * mean]  # swept always holds 1
    per_window = {"loss": losses[[r - 1 for r in depths]].double().mean(2).numpy()}  # (depths, windows)

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


def exit_depth(kl, threshold):
    """kl (loops 2..n, ...) -> (...) the first loop with KL < threshold, else n (a forced exit)."""
    below = kl < threshold
    first_below = below.int().argmax(0) + 2  # argmax finds the first True
    return torch.where(below.any(0), first_below, kl.size(0) + 1)


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


def token_classes(kl, targets, decode):
    """kl (loops 2..n, n x T), targets (n, T) -> a row per class of target token (the one the model predicts,
    not the one it reads: issue 32 asks which matters): its mean exit depth, the first loop with KL < MOVING_KL."""
    exits = exit_depth(kl, MOVING_KL).double().numpy()
    classes = np.array([token_class(decode([i])) for i in targets.flatten().tolist()])
    rows = []
    for name in CLASSES:
        picked = exits[classes == name]
        row = {"class": name, "count": picked.size}
        if picked.size:  # a class these windows lack has no mean
            row["mean_exit_depth"] = picked.mean()
        rows.append(row)
    rows.append({"class": "all", "count": exits.size, "mean_exit_depth": exits.mean()})
    return rows


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
    C, _ = configure([globals()], argv)
    # 1) the checkpoint and its windows; every refusal comes before the work
    path = os.path.join(C.out_dir, "ckpt.pt")
    model, ckpt = load_checkpoint(path, C.device)
    result = os.path.join(C.out_dir, "eval.json")
    # save_atomic writes eval.json.tmp in out_dir, then renames it over eval.json
    if os.path.isdir(result) or os.path.isdir(f"{result}.tmp") or not os.access(C.out_dir, os.W_OK):
        raise UserError(f"cannot write {result}")
    mean = model.config.mean_loops
    swept = loop_counts(C.loops, mean)
    n_diag = C.diag_loops or 2 * mean
    if n_diag < max(2, mean):
        raise UserError(f"--diag_loops {n_diag}: needs at least 2 and mean_loops ({mean})")
    data_dir, meta = open_dataset(ckpt["config"]["dataset"], ckpt, path, splits=("val",))
    _, decode = load_tokenizer(data_dir)
    length = model.config.block_size + 1
    wins = load_windows(f"{data_dir}/val.bin", meta["dtype"], C.windows, length, C.seed).to(C.device)
    print(f"{path}: {checkpoint_id(ckpt)}, mean_loops {mean}")
    # 2) one pass, as deep as the sweep and the convergence table both need
    traced = trace_windows(model, wins, max(*swept, n_diag), C)
    # 3) the sweep: the loss at each swept r, and its speed
    speed = {r: tokens_per_second(model, wins, r, C) for r in swept}
    el = sweep(traced["loss"], speed, meta)
    columns = "loops:d loss:.4f bits_per_byte:.4f tokens_per_s:.0f"
    table(f"Elasticity / cost curve (noise init, {len(wins)} windows)", el, columns)
    sat = saturation(traced["loss"], swept, mean)
    depth, gain = sat["depth"], sat["useful_range"]
    print(f"\nsaturation depth {depth['value']:g} {np.round(depth['interval'], 2).tolist()} (within {SATURATION_TOL} "
          f"nats of the best r <= {4 * mean}), useful range from r=1 {gain['value']:.4f} "
          f"{np.round(gain['interval'], 4).tolist()} nats")
    # 4) the convergence table and depth by token class, from loop 2 (loop 1 has no successive KL)
    diag = {key: values[1:n_diag].flatten(1) for key, values in traced.items()}  # each (loops, windows x T)
    cv = convergence(diag["kl"], diag["dstate"], diag["loss"], mean)
    columns = "loop:d mean_kl:.1e mean_state_change:.3g percent_moving:.1f loss:.3f"
    table(f"Convergence (a token moves while its KL > {MOVING_KL})", cv["rows"], columns)
    print(f"\nmedian convergence depth (the loop after which a token stays still): {cv['median_depth']}")
    tc = token_classes(diag["kl"], wins[:, 1:], decode)
    table(f"Depth by token class (exit at KL < {MOVING_KL})", tc, "class:s count:d mean_exit_depth:.2f")
    # 5) every number above, in eval.json
    res = {"args": vars(C), "checkpoint": checkpoint_id(ckpt), "dataset": ckpt["config"]["dataset"], "mean_loops": mean,
           "elasticity": el, "saturation": sat, "convergence": cv, "token_classes": tc, "seconds": time.perf_counter() - started}
    save_atomic(result, res)
    print(f"\nwrote {result}")
    return res


if __name__ == "__main__":
    run(main)
