"""
Per-token depth allocation on a frozen checkpoint (the paper's post-hoc policies) against
uniform depth, at matched average loops and at matched forward FLOPs per token.

    python allocate.py --out_dir=out-shakespeare [--windows=128] [--plot]

Zero state init (reproducible exits); no policy runs deeper than r_max (2 x mean_loops unless
given) and none stops a token before loop 2. A0: uniform r = 1..r_max. A1: stop a token once
KL(p_i || p_{i-1}) < eps and carry p_i. A1s: the same with the relative state change. A2: a
logistic probe on s_i, fit on training windows, predicts "the argmax still changes after loop
i"; stop once P(change) < tau. Each threshold gives a (loops, FLOPs, loss) point, measured on the
realized engine: each loop's core call carries only the still-active tokens of a batch of
windows. Differences carry paired bootstrap 95% intervals over the windows. Writes
out_dir/allocate.json, which `python bench.py --frontier=scoring` times against uniform depth.
"""
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from configurator import configure, die, run
from evaluate import load_windows, markdown, trace
from model import (MIN_EXIT_LOOP, autocast, checkpoint_id, default_r_max, exit_score, load_checkpoint,
                   token_loss, write_json)
from prepare import open_dataset

# ---- settings ------------------------------------------------------------------------
out_dir = "out-shakespeare"  # reads ckpt.pt, writes allocate.json (and allocate.png)
windows = 128  # evaluation windows of block_size + 1 tokens from val.bin
train_windows = 32  # A2's label-harvest windows from train.bin (never evaluated on)
r_max = 0  # the deepest loop any policy may run; 0: 2 x mean_loops
batch_size = 8  # windows per call: the B of depth-wise batching
n_grid = 6  # thresholds per swept policy
probe_steps = 300  # full-batch Adam steps for A2's logistic probe
bootstrap = 1000  # resamples of the windows for every interval
seed = 1337  # picks the windows and the bootstrap resamples
plot = False  # also write allocate.png
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu, cuda or cuda:N
dtype = "bfloat16" if torch.cuda.is_available() else "float32"  # autocast dtype of the matmuls
RULES = dict(out_dir=str, windows=(1, 2 ** 20), train_windows=(2, 2 ** 20), r_max=(0, 1024),
             batch_size=(1, 4096), n_grid=(2, 100), probe_steps=(1, 10 ** 6), bootstrap=(10, 10 ** 6),
             seed=(0, 2 ** 63 - 1), plot=bool, device=str, dtype=("float32", "bfloat16"))
POLICIES = {"A0": "A0 uniform", "A1": "A1 KL exit", "A1s": "A1s state exit", "A2": "A2 router"}
CRITERION = {"A1": "kl", "A1s": "state", "A2": "probe"}


# ---- the engines ---------------------------------------------------------------------------
def score_after_loop(criterion, probe, s_new, s_old, logits_new, logits_old):
    if criterion == "probe":
        return probe(s_new)
    return exit_score(criterion, s_new, s_old, logits_new, logits_old)


def active_positions(active):
    """The still-active tokens of every window that has any, in one padded block: rows (B',),
    pos (B', A) and real (B', A), where A is the largest count. Padding repeats a window's last active
    token: it recomputes exactly that token's keys/values and its results are dropped."""
    counts = active.sum(1)
    rows = counts.nonzero()[:, 0]
    counts = counts[rows]
    width = int(counts.max()) if len(rows) else 0
    # a stable sort of "inactive" flags lists each window's active positions first, in order
    order = torch.sort((~active[rows]).to(torch.uint8), dim=1, stable=True).indices[:, :width]
    real = torch.arange(width, device=active.device) < counts[:, None]
    pos = torch.where(real, order, order.gather(1, counts[:, None] - 1))
    return rows, pos, real


@torch.no_grad()
def realized_exit(model, x, y, r_max, criterion, threshold, probe=None):
    """Depth-wise batched exit over windows x (B, T), one code path for any B. At each loop one core
    call carries the still-active tokens of all B windows, each attending to its own window's keys and
    values in a 'latest' cache (one slot per window, shared by all loops): a frozen token serves the
    K/V of the last loop it ran, where the masking harness recomputes it one loop further. 'kl' reads
    out the active tokens each loop against a coda cache; the others read out every token once at the
    end. Returns per-token loss and loops run, (B, T) each, and the core token-evaluations run
    (padding included)."""
    B, T = x.shape
    c = model.config
    e = model.prelude(x)
    s = model.init_state(e, "zero")
    latest = model.new_caches(c.n_core, B, T)
    coda = model.new_caches(c.n_coda, B, T) if criterion == "kl" else None
    logits = torch.zeros(B, T, c.vocab_size, device=x.device) if criterion == "kl" else None
    active = torch.ones(B, T, dtype=torch.bool, device=x.device)
    depth = torch.zeros(B, T, dtype=torch.long, device=x.device)
    core_evals = 0
    for loop in range(1, r_max + 1):
        rows, pos, real = active_positions(active)
        if len(rows) == 0:
            break
        where = (rows[:, None], pos)  # the active tokens' (window, position), padding included
        s_old = s[where]
        s_new = model.core_step(e[where], s_old, latest, pos, rows)
        new_logits = model.readout(s_new, coda, pos, rows) if criterion == "kl" else None
        score = None
        if loop >= MIN_EXIT_LOOP:
            old_logits = logits[where] if criterion == "kl" else None
            score = score_after_loop(criterion, probe, s_new, s_old, new_logits, old_logits)
        core_evals += pos.numel()
        depth += active
        real_where = (rows[:, None].expand_as(pos)[real], pos[real])  # write back real tokens only
        s[real_where] = s_new[real]
        if new_logits is not None:
            logits[real_where] = new_logits[real].float()
        if score is not None:
            active[real_where] = score[real] >= threshold
    if criterion != "kl":
        logits = model.readout(s)
    return token_loss(logits, y), depth, core_evals


# ---- A2: the oracle-labelled router ----------------------------------------------------------
def harvest_labels(argmax):
    """argmax (r_max, ...) -> label (r_max, ...): True where loop i's argmax changes later."""
    return torch.stack([(argmax[i + 1:] != argmax[i]).any(0) for i in range(len(argmax))])


def fit_probe(x_fit, y_fit, x_held, y_held, steps):
    """Logistic regression on standardised features, full-batch Adam from zeros (deterministic).
    Returns (P(label | x) as a function, held-out accuracy, held-out majority-class accuracy)."""
    mu = x_fit.mean(0)
    sd = x_fit.std(0).clamp_min(1e-6)
    w = torch.zeros(x_fit.size(1), requires_grad=True)
    b = torch.zeros((), requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=0.05)
    z_fit = (x_fit - mu) / sd
    with torch.enable_grad():
        for _ in range(steps):
            opt.zero_grad()
            F.binary_cross_entropy_with_logits(z_fit @ w + b, y_fit.float()).backward()
            opt.step()

    def prob(s):  # the probe's input in float32, whatever the autocast dtype
        z = (s.float() - mu.to(s.device)) / sd.to(s.device)
        return torch.sigmoid(z @ w.detach().to(s.device) + b.detach())

    rate = y_held.float().mean().item()
    accuracy = ((prob(x_held) > 0.5) == y_held).float().mean().item()
    return prob, accuracy, max(rate, 1 - rate)


def log_grid(values, n):
    """n thresholds, geometric between the 2nd and 98th percentiles of positive finite values."""
    v = values[torch.isfinite(values) & (values > 0)].double().cpu().numpy()
    return np.geomspace(*np.quantile(v, [0.02, 0.98]), n).tolist()


def fit_router(model, twins, C, r_max):
    """A2 from training windows only: harvest labels, fit the probe, hold out the last 20% of
    windows (whole windows: a window's tokens are correlated). The threshold grids come from
    here too, so nothing about the evaluation windows places the sweeps."""
    parts = []
    for i in range(0, len(twins), C.batch_size):
        batch = twins[i:i + C.batch_size]
        parts.append(trace(model, batch[:, :-1], batch[:, 1:], r_max, keep_states=True))
    harvest = {k: torch.cat([part[k] for part in parts], 1) for k in parts[0]}
    labels = harvest_labels(harvest["argmax"])[:-1].cpu()  # loop r_max has no later loop
    states = harvest["state"][:-1].float().cpu()
    n_fit = min(round(0.8 * len(twins)), len(twins) - 1)  # at least one window held out
    fit = (states[:, :n_fit].flatten(0, 2), labels[:, :n_fit].flatten())
    held = (states[:, n_fit:].flatten(0, 2), labels[:, n_fit:].flatten())
    prob, accuracy, majority = fit_probe(*fit, *held, C.probe_steps)
    grids = {"A1": log_grid(harvest["kl"][1:], C.n_grid),
             "A1s": log_grid(harvest["dstate_rel"][1:], C.n_grid),
             "A2": log_grid(prob(states[:, n_fit:]).flatten(), C.n_grid)}
    info = {"accuracy": accuracy, "majority": majority, "positive_rate": labels.float().mean().item()}
    return prob, info, grids


# ---- curves and intervals --------------------------------------------------------------
# Every statistic below is a function of `pw`, per-window results {policy: (loss, loops, flops)},
# arrays of shape (points, windows): A0's points are r = 1..r_max, the others' their thresholds.
# `x` picks the cost axis: 1 average loops per token, 2 forward FLOPs per token. A paired bootstrap
# resamples the windows of every array with the same indices and recomputes the statistic.
def curve(pw, key, x=1):
    """(average cost, loss) of each of the policy's points."""
    return list(zip(pw[key][x].mean(1), pw[key][0].mean(1)))


def cost_at_loss(points, loss):
    """The least cost at which the piecewise-linear (cost, loss) curve reaches `loss`, or None."""
    pts = sorted(points)
    if pts[0][1] <= loss:
        return pts[0][0]
    for (c0, l0), (c1, l1) in zip(pts, pts[1:]):  # l0 > loss here
        if l1 <= loss:
            return c0 + (l0 - loss) / (l0 - l1) * (c1 - c0)
    return None


def interp_loss(points, cost):
    """Loss at an average cost, interpolated along (cost, loss) points; None outside them."""
    costs, losses = zip(*sorted(points))
    if not costs[0] <= cost <= costs[-1]:
        return None
    return float(np.interp(cost, costs, losses))


def bar_loss(pw, mean):
    return pw["A0"][0][mean - 1].mean()


def cost_at_bar(pw, key, mean, x=1):
    return cost_at_loss(curve(pw, key, x), bar_loss(pw, mean))


def saving_at_bar(pw, key, mean, x=1):
    """1 - the policy's cost at the bar / uniform depth's (A0 may reach it below mean_loops)."""
    cost = cost_at_bar(pw, key, mean, x)
    uniform = cost_at_bar(pw, "A0", mean, x)
    if cost is None or uniform is None:
        return None
    return 1 - cost / uniform


def loss_delta(pw, key, cost, x=1):
    """The policy's loss minus A0's at a matched average cost."""
    a0 = interp_loss(curve(pw, "A0", x), cost)
    other = interp_loss(curve(pw, key, x), cost)
    return None if a0 is None or other is None else other - a0


def estimate(stat, pw, n_resamples, seed, **kwargs):
    """{'value': stat(pw, **kwargs), 'interval': its paired bootstrap 95% interval, or None
    where the statistic is undefined (None) in more than 5% of the resamples}."""
    value = stat(pw, **kwargs)
    g = np.random.default_rng(seed)
    n = pw["A0"][0].shape[1]
    values = []
    for _ in range(n_resamples):
        pick = g.integers(0, n, n)
        v = stat({k: tuple(a[:, pick] for a in arrays) for k, arrays in pw.items()}, **kwargs)
        if v is not None:
            values.append(v)
    interval = None
    if value is not None and len(values) >= 0.95 * n_resamples:
        interval = [float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))]
    return {"value": None if value is None else float(value), "interval": interval}


# ---- the measurements ------------------------------------------------------------------
def sweep(model, X, Y, C, r_max, grids, probe):
    """Per-window loss, loops and forward FLOPs per token for A0 (one trace to r_max) and every
    A1/A1s/A2 threshold on the realized engine."""
    T = X.size(1)
    parts = [trace(model, X[i:i + C.batch_size], Y[i:i + C.batch_size], r_max)["loss"].mean(2)
             for i in range(0, len(X), C.batch_size)]
    loops = np.repeat(np.arange(1.0, r_max + 1)[:, None], len(X), 1)
    pw = {"A0": (torch.cat(parts, 1).double().cpu().numpy(), loops, model.inference_flops(loops, 1, T))}
    for key in ("A1", "A1s", "A2"):
        losses = []
        depths = []
        for t in tqdm(grids[key], desc=f"{key} sweep", file=sys.stderr):
            runs = [realized_exit(model, X[i:i + C.batch_size], Y[i:i + C.batch_size], r_max,
                                  CRITERION[key], t, probe) for i in range(0, len(X), C.batch_size)]
            losses.append(torch.cat([run[0].mean(1) for run in runs]))
            depths.append(torch.cat([run[1].float().mean(1) for run in runs]))
        loss = torch.stack(losses).double().cpu().numpy()
        depth = torch.stack(depths).double().cpu().numpy()
        readouts = depth if key == "A1" else 1  # the KL exit reads out after every loop
        flops = model.inference_flops(depth, readouts, T, depth - 1, CRITERION[key])
        pw[key] = (loss, depth, flops)
    return pw


def summarize(pw, C, mean):
    """The matched tables (in loops and in FLOPs) and every policy's cost at the bar."""
    res = {"bar": bar_loss(pw, mean), "at_bar": {}, "table": [], "table_flops": []}
    for key in pw:
        res["at_bar"][key] = {}
        for x, axis in ((1, "loops"), (2, "flops")):
            res["at_bar"][key][axis] = estimate(cost_at_bar, pw, C.bootstrap, C.seed, key=key, mean=mean, x=x)
            res["at_bar"][key][f"{axis}_saved"] = estimate(saving_at_bar, pw, C.bootstrap, C.seed,
                                                           key=key, mean=mean, x=x)
    for depth in (mean * f / 8 for f in range(3, 8)):
        flops = float(np.interp(depth, pw["A0"][1][:, 0], pw["A0"][2][:, 0]))  # uniform at that depth
        for x, cost, table in ((1, depth, "table"), (2, flops, "table_flops")):
            row = {"avg_depth": depth, "cost": cost, "A0": interp_loss(curve(pw, "A0", x), cost)}
            for key in ("A1", "A1s", "A2"):
                row[key] = estimate(loss_delta, pw, C.bootstrap, C.seed, key=key, cost=cost, x=x)
            res[table].append(row)
    return res


# ---- the report --------------------------------------------------------------------------
def show(est, digits=4, sign="+", unit=""):
    """'value [low, high]' of an estimate; 'never' where it is undefined."""
    if est["value"] is None:
        return "never"
    text = f"{est['value']:{sign}.{digits}f}{unit}"
    if est["interval"] is not None:
        low, high = est["interval"]
        text += f" [{low:{sign}.{digits}f}, {high:{sign}.{digits}f}]"
    return text


def print_report(res):
    print(f"\n## Allocation at matched average cost (realized engine, zero init, {res['windows']} "
          f"windows, r_max {res['r_max']}); uniform r={res['mean_loops']} bar = {res['bar']:.4f}\n")
    print("Each policy's loss minus A0's at the same average loops (first table) or forward FLOPs per "
          "token (second: readouts and exit tests counted), paired bootstrap 95% intervals over the "
          "windows; an interval containing 0 is no difference.\n")
    keys = ("A1", "A1s", "A2")
    at_bar = res["at_bar"]
    for table, axis, unit in (("table", "loops", 1), ("table_flops", "flops", 1e6)):
        rows = []
        for row in res[table]:
            cells = [f"{row['cost'] / unit:.4g}", "-" if row["A0"] is None else f"{row['A0']:.4f}"]
            rows.append(cells + ["-" if row[k]["value"] is None else show(row[k]) for k in keys])
        bar = [show({"value": None if e["value"] is None else e["value"] / unit,
                     "interval": e["interval"] and [v / unit for v in e["interval"]]}, 2, "")
               for e in (at_bar[k][axis] for k in ("A0",) + keys)]
        rows.append(["reaches the bar at", bar[0]] + bar[1:])
        rows.append(["saved at the bar", ""] + [show(at_bar[k][f"{axis}_saved"], 3) for k in keys])
        header = "avg loops" if axis == "loops" else "MFLOP/token"
        print(markdown([header, "A0 loss"] + [f"{POLICIES[k]} - A0" for k in keys], rows) + "\n")
    print(f"A2 probe: held-out accuracy {res['probe']['accuracy']:.3f} (majority class "
          f"{res['probe']['majority']:.3f}).")


def allocation_figure(res, path):
    """Every policy's (average loops, loss) curve and the uniform-mean bar."""
    from evaluate import pyplot
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.4))
    for key, points in res["curves"].items():
        depth, loss = zip(*sorted((p["avg_depth"], p["loss"]) for p in points))
        ax.plot(depth, loss, "o-" if key == "A0" else ".-", label=POLICIES[key])
    ax.axhline(res["bar"], color="k", linestyle=":", label=f"uniform r={res['mean_loops']} quality")
    ax.set(xlabel="average loops per token", ylabel="loss (nats)", title="Allocation (realized engine)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=()):
    C, _ = configure(globals(), RULES, list(argv))
    ckpt_path = os.path.join(C.out_dir, "ckpt.pt")
    model, ckpt = load_checkpoint(ckpt_path, C.device)
    if not os.access(C.out_dir, os.W_OK):  # fail now, not after minutes of sweeps
        die(f"--out_dir={C.out_dir} is not writable")
    mean = model.config.mean_loops
    r_max = C.r_max or default_r_max(model.config)
    if r_max < max(MIN_EXIT_LOOP, mean):
        die(f"--r_max {r_max}: need at least {MIN_EXIT_LOOP} and mean_loops ({mean}), the bar's depth")
    data_dir, meta = open_dataset(ckpt["config"]["dataset"], ckpt, ckpt_path)
    block = model.config.block_size
    val = os.path.join(data_dir, "val.bin")
    wins = load_windows(val, meta["dtype"], C.windows, block + 1, C.seed).to(C.device)
    train_bin = os.path.join(data_dir, "train.bin")
    twins = load_windows(train_bin, meta["dtype"], C.train_windows, block + 1, C.seed + 1).to(C.device)
    print(f"{ckpt_path}: iter {ckpt['iter_num']}, mean_loops {mean}, r_max {r_max}; {C.windows} val "
          f"windows of {block} tokens, {C.train_windows} train windows for A2; {C.device} {C.dtype}")
    t_start = time.perf_counter()
    with autocast(C.device, C.dtype):
        probe, probe_info, grids = fit_router(model, twins, C, r_max)
        pw = sweep(model, wins[:, :-1], wins[:, 1:].contiguous(), C, r_max, grids, probe)
    thresholds = {"A0": list(range(1, r_max + 1))} | grids
    curves = {}
    for key, points in thresholds.items():
        costs = zip(points, curve(pw, key), pw[key][2].mean(1))
        curves[key] = [{"threshold": t, "avg_depth": d, "flops": f, "loss": loss}
                       for t, (d, loss), f in costs]
    res = {"args": vars(C), "checkpoint": {"path": ckpt_path, "id": checkpoint_id(ckpt)},
           "mean_loops": mean, "r_max": r_max, "windows": C.windows, "block_size": block,
           "probe": probe_info, "curves": curves} | summarize(pw, C, mean)
    print_report(res)
    res["per_window"] = {key: [a.tolist() for a in arrays] for key, arrays in pw.items()}
    res["seconds"] = time.perf_counter() - t_start
    write_json(os.path.join(C.out_dir, "allocate.json"), res)
    if C.plot:
        allocation_figure(res, os.path.join(C.out_dir, "allocate.png"))
    print(f"\nwrote {C.out_dir}/allocate.json in {res['seconds']:.0f}s")
    return res


if __name__ == "__main__":
    run(main)
