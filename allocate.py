"""The paper's per-token depth policies on a frozen checkpoint, against uniform
depth at matched loops and at matched FLOPs per token (zero init, r_max, no
stop before loop 2): A0 uniform r; A1 stops once KL(p_i || p_{i-1}) < eps;
A1s once the relative state change is; A2 once a probe on s_i, fit on train
windows, says the argmax will not change. Measured on the realized engine,
with paired bootstrap 95% intervals over the windows.

    python allocate.py --out_dir=out-shakespeare [--windows=128] [--plot]
"""
import math
import os
import sys
import time
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from configurator import configure, die, run
from evaluate import load_windows, markdown, pyplot, save, trace
from model import MIN_EXIT_LOOP, R_MAX_PER_MEAN, autocast, checkpoint_id
from model import exit_score, load_checkpoint, token_loss, save_atomic
from prepare import open_dataset

out_dir = "out-shakespeare"  # reads ckpt.pt, writes allocate.json (.png)
windows = 128  # evaluation windows of block_size + 1 tokens from val.bin
train_windows = 32  # A2's label windows from train.bin (never evaluated)
r_max = 0  # the deepest loop any policy may run; 0: 2 x mean_loops
batch_size = 8  # windows per call: the B of depth-wise batching
n_grid = 4  # starting thresholds per policy (then placed by bisection)
tolerance = 0.05  # loops: each table row within it of a measurement
probe_steps = 300  # full-batch Adam steps for A2's logistic probe
bootstrap = 1000  # resamples of the windows for every interval
seed = 1337  # picks the windows and the bootstrap resamples
plot = False  # also write allocate.png
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu, cuda, cuda:N
dtype = "bfloat16" if torch.cuda.is_available() else "float32"  # autocast
RULES = dict(out_dir=str, windows=(1, 2 ** 20), train_windows=(2, 2 ** 20), r_max=(0, 1024),
             batch_size=(1, 4096), n_grid=(2, 100), tolerance=(1e-3, 10.0), probe_steps=(1, 10 ** 6),
             bootstrap=(10, 10 ** 6), seed=(0, 2 ** 32 - 1), plot=bool, device=str,
             dtype=("float32", "bfloat16"))
POLICIES = {"A0": "A0 uniform", "A1": "A1 KL exit", "A1s": "A1s state", "A2": "A2 router"}
CRITERION = {"A1": "kl", "A1s": "state", "A2": "probe"}
ROWS = [f / 8 for f in range(3, 8)]  # the matched tables' rows, times mean_loops


# ---- the realized engine
def active_positions(active):
    """Active tokens as one padded block: rows (B',), pos and real (B', A).
    Padding repeats a window's last active token; its results are dropped."""
    counts = active.sum(1)
    rows = counts.nonzero()[:, 0]
    counts = counts[rows]
    width = int(counts.max()) if len(rows) else 0
    # a stable sort of "inactive" flags puts each window's active tokens first
    order = torch.sort((~active[rows]).byte(), dim=1, stable=True).indices[:, :width]
    real = torch.arange(width, device=active.device) < counts[:, None]
    pos = torch.where(real, order, order.gather(1, counts[:, None] - 1))
    return rows, pos, real


@torch.no_grad()
def realized_exit(model, x, y, r_max, criterion, threshold, probe=None):
    """Depth-wise batched exit over windows x (B, T), any B: each loop's core
    call carries every window's active tokens; a frozen token serves the K/V
    of its last loop (one cache slot per window). -> per-token loss, loops (B, T)."""
    B, T = x.shape
    c = model.config
    kl = criterion == "kl"
    probed = criterion == "probe"
    e = model.prelude(x)
    s = model.init_state(e, "zero")
    latest = model.new_caches(c.n_core, B, T)
    coda = model.new_caches(c.n_coda, B, T) if kl else None
    logits = torch.zeros(B, T, c.vocab_size, device=x.device) if kl else None
    active = torch.ones(B, T, dtype=torch.bool, device=x.device)
    depth = torch.zeros(B, T, dtype=torch.long, device=x.device)
    for loop in range(1, r_max + 1):
        rows, pos, real = active_positions(active)
        if len(rows) == 0:
            break
        where = (rows[:, None], pos)  # padding included
        at = () if active.all() else (pos, rows)  # all: causal
        s_old = s[where]
        s_new = model.core_step(e[where], s_old, latest, *at)
        new = model.readout(s_new, coda, *at) if kl else None
        depth += active
        real_where = (rows[:, None].expand_as(pos)[real], pos[real])
        if loop >= MIN_EXIT_LOOP:
            old = logits[where] if kl else None
            score = probe(s_new) if probed else exit_score(criterion, s_new, s_old, new, old)
            active[real_where] = score[real] >= threshold
        s[real_where] = s_new[real]
        if kl:
            logits[real_where] = new[real].float()
    if not kl:
        logits = model.readout(s)
    return token_loss(logits, y), depth


# ---- A2: the oracle-labelled router
def harvest_labels(argmax):
    """argmax (r_max, ...) -> (r_max, ...): does loop i's argmax change later?"""
    later = [(argmax[i + 1:] != argmax[i]).any(0) for i in range(len(argmax))]
    return torch.stack(later)


def fit_probe(x_fit, y_fit, x_held, y_held, steps):
    """Logistic regression on standardised features, full-batch Adam from
    zeros. -> (P(label | x), held-out accuracy, majority-class accuracy)."""
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

    def prob(s):  # float32 input, whatever the autocast
        z = (s.float() - mu.to(s.device)) / sd.to(s.device)
        return torch.sigmoid(z @ w.detach().to(s.device) + b.detach())

    rate = y_held.float().mean().item()
    accuracy = ((prob(x_held) > 0.5) == y_held).float().mean().item()
    return prob, accuracy, max(rate, 1 - rate)


def log_grid(values, n):
    """n thresholds, geometric between the 2nd and 98th percentiles."""
    v = values[torch.isfinite(values) & (values > 0)].double().cpu().numpy()
    return np.geomspace(*np.quantile(v, [0.02, 0.98]), n).tolist()


def fit_router(model, twins, C, r_max):
    """A2 from training windows only, the last 20% of windows held out. The
    threshold grids come from here too, never from the evaluation windows."""
    parts = [trace(model, b[:, :-1], b[:, 1:], r_max, keep_states=True)
             for b in twins.split(C.batch_size)]
    harvest = {k: torch.cat([part[k] for part in parts], 1) for k in parts[0]}
    labels = harvest_labels(harvest["argmax"])[:-1].cpu()  # r_max: no later loop
    states = harvest["state"][:-1].float().cpu()
    n_fit = min(round(0.8 * len(twins)), len(twins) - 1)
    fit = (states[:, :n_fit].flatten(0, 2), labels[:, :n_fit].flatten())
    held = (states[:, n_fit:].flatten(0, 2), labels[:, n_fit:].flatten())
    prob, accuracy, majority = fit_probe(*fit, *held, C.probe_steps)
    grids = {"A1": log_grid(harvest["kl"][1:], C.n_grid),
             "A1s": log_grid(harvest["dstate_rel"][1:], C.n_grid),
             "A2": log_grid(prob(states[:, n_fit:]).flatten(), C.n_grid)}
    info = {"accuracy": accuracy, "majority": majority}
    return prob, info, grids


# ---- curves and intervals
# pw: per-window results {policy: (loss, loops, flops)}, arrays (points,
# windows); x picks the cost axis (1 loops, 2 FLOPs per token). A paired
# bootstrap resamples every array's windows with the same indices.
def curve(pw, key, x=1):
    """(average cost, loss) of each of the policy's points."""
    return list(zip(pw[key][x].mean(1), pw[key][0].mean(1)))


def cost_at_loss(points, loss):
    """The least cost at which the (cost, loss) polyline reaches loss, or None."""
    pts = sorted(points)
    if pts[0][1] <= loss:
        return pts[0][0]
    for (c0, l0), (c1, l1) in zip(pts, pts[1:]):  # l0 > loss here
        if l1 <= loss:
            return c0 + (l0 - loss) / (l0 - l1) * (c1 - c0)
    return None


def interp_loss(points, cost):
    """Loss at an average cost along (cost, loss) points; None outside."""
    costs, losses = zip(*sorted(points))
    inside = costs[0] <= cost <= costs[-1]
    return float(np.interp(cost, costs, losses)) if inside else None


def bar_loss(pw, mean):
    return pw["A0"][0][mean - 1].mean()


def cost_at_bar(pw, key, mean, x=1):
    return cost_at_loss(curve(pw, key, x), bar_loss(pw, mean))


def saving_at_bar(pw, key, mean, x=1):
    """1 - the policy's cost at the bar / uniform depth's."""
    cost = cost_at_bar(pw, key, mean, x)
    uniform = cost_at_bar(pw, "A0", mean, x)
    return None if cost is None or uniform is None else 1 - cost / uniform


def loss_delta(pw, key, cost, x=1):
    """The policy's loss minus A0's at a matched average cost."""
    a0 = interp_loss(curve(pw, "A0", x), cost)
    other = interp_loss(curve(pw, key, x), cost)
    return None if a0 is None or other is None else other - a0


def estimate(stat, pw, n_resamples, seed, **kwargs):
    """{'value': stat(pw), 'interval': its paired bootstrap 95% interval, or
    None where stat is undefined in more than 5% of the resamples}."""
    value = stat(pw, **kwargs)
    g = np.random.default_rng(seed)
    n = pw["A0"][0].shape[1]
    values = []
    for _ in range(n_resamples):
        pick = g.integers(0, n, n)
        picked = {k: tuple(a[:, pick] for a in arrays) for k, arrays in pw.items()}
        v = stat(picked, **kwargs)
        if v is not None:
            values.append(v)
    interval = None
    if value is not None and len(values) >= 0.95 * n_resamples:
        interval = [float(np.percentile(values, q)) for q in (2.5, 97.5)]
    return {"value": None if value is None else float(value), "interval": interval}


# ---- the measurements
def measure(model, batches, r_max, key, threshold, probe):
    """One threshold on the realized engine -> per-window (loss, loops, FLOPs)."""
    runs = [realized_exit(model, x, y, r_max, CRITERION[key], threshold, probe) for x, y in batches]
    loss = torch.cat([run[0].mean(1) for run in runs]).double().cpu().numpy()
    depth = torch.cat([run[1].float().mean(1) for run in runs]).double().cpu().numpy()
    T = batches[0][0].size(1)
    return loss, depth, model.inference_flops(depth, T, CRITERION[key])


def place(measure_at, points, axis, target, tol, tries=10):
    """Measure thresholds until a row read at target along axis (0 loss, 1
    loops, 2 FLOPs) lies within tol loops of a measurement: false position on
    log(threshold), bisection when one end sticks. A target the grid does not
    bracket stays unmeasured. points: {threshold: per-window (loss, loops,
    flops)}, filled in place."""
    sides = []
    for _ in range(tries):
        ts = sorted(points)
        above = [points[t][axis].mean() >= target for t in ts]
        cross = [i for i in range(len(ts) - 1) if above[i] != above[i + 1]]
        if not cross:
            return
        t0, t1 = ts[cross[-1]:cross[-1] + 2]  # the shallowest crossing
        v0, v1 = (points[t][axis].mean() for t in (t0, t1))
        d0, d1 = (points[t][1].mean() for t in (t0, t1))
        w = (target - v0) / (v1 - v0)  # the row's place between them
        if min(w, 1 - w) * abs(d1 - d0) <= tol:
            return
        stuck = len(sides) > 1 and sides[-1] == sides[-2]
        t = math.sqrt(t0 * t1) if stuck else t0 * (t1 / t0) ** w
        points[t] = measure_at(t)
        sides.append(points[t][axis].mean() >= target)


def sweep(model, X, Y, C, r_max, grids, probe):
    """Per-window (loss, loops, FLOPs per token), each (points, windows): A0 by
    one trace to r_max; each exit from its grid, then thresholds placed at the
    matched table's loops and FLOPs and at the bar. -> (pw, thresholds)."""
    T = X.size(1)
    batches = list(zip(X.split(C.batch_size), Y.split(C.batch_size)))
    a0 = torch.cat([trace(model, x, y, r_max)["loss"].mean(2) for x, y in batches], 1)
    loops = np.repeat(np.arange(1.0, r_max + 1)[:, None], len(X), 1)
    pw = {"A0": (a0.double().cpu().numpy(), loops, model.inference_flops(loops, T))}
    rows = [model.config.mean_loops * f for f in ROWS]
    uniform_flops = np.interp(rows, loops[:, 0], pw["A0"][2][:, 0])
    targets = [(1, d) for d in rows] + [(2, f) for f in uniform_flops]
    targets.append((0, bar_loss(pw, model.config.mean_loops)))
    thresholds = {}
    for key in ("A1", "A1s", "A2"):
        measure_at = partial(measure, model, batches, r_max, key, probe=probe)
        points = {t: measure_at(t) for t in grids[key]}
        for axis, target in tqdm(targets, desc=f"{key} placing", file=sys.stderr):
            place(measure_at, points, axis, target, C.tolerance)
        thresholds[key] = sorted(points)
        pw[key] = tuple(np.stack([points[t][i] for t in thresholds[key]]) for i in range(3))
    return pw, thresholds


def summarize(pw, C, mean):
    """Matched tables (in loops and in FLOPs) and each policy's cost at the bar."""
    res = {"bar": bar_loss(pw, mean), "at_bar": {}, "table": [], "table_flops": []}
    stats = {"": cost_at_bar, "_saved": saving_at_bar}
    for key in pw:
        res["at_bar"][key] = {}
        for x, axis in ((1, "loops"), (2, "flops")):
            for suffix, stat in stats.items():
                est = estimate(stat, pw, C.bootstrap, C.seed, key=key, mean=mean, x=x)
                res["at_bar"][key][axis + suffix] = est
    for depth in (mean * f for f in ROWS):
        flops = float(np.interp(depth, pw["A0"][1][:, 0], pw["A0"][2][:, 0]))
        for x, cost, table in ((1, depth, "table"), (2, flops, "table_flops")):
            row = {"avg_depth": depth, "cost": cost, "A0": interp_loss(curve(pw, "A0", x), cost)}
            for key in ("A1", "A1s", "A2"):
                row[key] = estimate(loss_delta, pw, C.bootstrap, C.seed, key=key, cost=cost, x=x)
            res[table].append(row)
    return res


# ---- the report
def show(est, digits=4, sign="+", unit="", scale=1):
    """'value [low, high]' of an estimate (divided by scale), or 'never'."""
    if est["value"] is None:
        return "never"
    text = f"{est['value'] / scale:{sign}.{digits}f}{unit}"
    if est["interval"] is not None:
        low, high = (v / scale for v in est["interval"])
        text += f" [{low:{sign}.{digits}f}, {high:{sign}.{digits}f}]"
    return text


def print_report(res):
    print(f"\n## Allocation against uniform depth (realized engine, zero init, "
          f"{res['windows']} windows, r_max {res['r_max']}); uniform "
          f"r={res['mean_loops']} bar = {res['bar']:.4f}\n")
    print("Loss minus A0's at equal loops, then at equal FLOPs per token; an "
          "interval holding 0 is no difference.\n")
    keys = ("A1", "A1s", "A2")
    for table, axis, scale in (("table", "loops", 1), ("table_flops", "flops", 1e6)):
        rows = []
        for row in res[table]:
            a0 = "-" if row["A0"] is None else f"{row['A0']:.4f}"
            deltas = ["-" if row[k]["value"] is None else show(row[k]) for k in keys]
            rows.append([f"{row['cost'] / scale:.4g}", a0] + deltas)
        bar = [show(res["at_bar"][k][axis], 2, "", scale=scale) for k in ("A0",) + keys]
        rows.append(["reaches the bar at"] + bar)
        saved = [show(res["at_bar"][k][axis + "_saved"], 3) for k in keys]
        rows.append(["saved at the bar", ""] + saved)
        header = "avg loops" if axis == "loops" else "MFLOP/token"
        names = [f"{POLICIES[k]} - A0" for k in keys]
        print(markdown([header, "A0 loss"] + names, rows) + "\n")
    print(f"A2 probe: held-out accuracy {res['probe']['accuracy']:.3f} "
          f"(majority class {res['probe']['majority']:.3f}).")


def allocation_figure(res, out_dir):
    """Every policy's (average loops, loss) curve and the uniform-mean bar."""
    fig, ax = pyplot().subplots(figsize=(6.5, 4.4))
    for key, points in res["curves"].items():
        depth, loss = zip(*sorted((p["avg_depth"], p["loss"]) for p in points))
        ax.plot(depth, loss, "o-" if key == "A0" else ".-", label=POLICIES[key])
    ax.axhline(res["bar"], color="k", linestyle=":", label=f"uniform r={res['mean_loops']}")
    ax.set(xlabel="average loops per token", ylabel="loss (nats)", title="Allocation")
    ax.legend()
    save(fig, out_dir, "allocate.png")


def main(argv=()):
    C, _ = configure(globals(), RULES, list(argv))
    ckpt_path = os.path.join(C.out_dir, "ckpt.pt")
    model, ckpt = load_checkpoint(ckpt_path, C.device)
    if not os.access(C.out_dir, os.W_OK):  # before minutes of sweeps
        die(f"--out_dir={C.out_dir} is not writable")
    mean = model.config.mean_loops
    r_max = C.r_max or R_MAX_PER_MEAN * mean
    if r_max < max(MIN_EXIT_LOOP, mean):
        die(f"--r_max {r_max}: need at least {MIN_EXIT_LOOP} and mean_loops ({mean})")
    data_dir, meta = open_dataset(ckpt["config"]["dataset"], ckpt, ckpt_path)
    length = model.config.block_size + 1
    wins = load_windows(f"{data_dir}/val.bin", meta["dtype"], C.windows, length, C.seed).to(C.device)
    twins = load_windows(f"{data_dir}/train.bin", meta["dtype"], C.train_windows, length, C.seed + 1)
    print(f"{ckpt_path}: iter {ckpt['iter_num']}, mean_loops {mean}, r_max {r_max}; "
          f"{C.windows} val and {C.train_windows} train windows; {C.device} {C.dtype}")
    t_start = time.perf_counter()
    with autocast(C.device, C.dtype):
        probe, probe_info, grids = fit_router(model, twins.to(C.device), C, r_max)
        pw, thresholds = sweep(model, wins[:, :-1], wins[:, 1:].contiguous(), C, r_max, grids, probe)
    curves = {}
    for key, points in ({"A0": list(range(1, r_max + 1))} | thresholds).items():
        costs = zip(points, curve(pw, key), pw[key][2].mean(1))
        curves[key] = [{"threshold": t, "avg_depth": d, "flops": f, "loss": loss}
                       for t, (d, loss), f in costs]
    res = {"args": vars(C), "checkpoint": {"path": ckpt_path, "id": checkpoint_id(ckpt)},
           "mean_loops": mean, "r_max": r_max, "windows": C.windows,
           "probe": probe_info, "curves": curves} | summarize(pw, C, mean)
    print_report(res)
    res["per_window"] = {k: [a.tolist() for a in arrays] for k, arrays in pw.items()}
    res["seconds"] = time.perf_counter() - t_start
    save_atomic(os.path.join(C.out_dir, "allocate.json"), res)
    if C.plot:
        allocation_figure(res, C.out_dir)
    print(f"\nwrote {C.out_dir}/allocate.json in {res['seconds']:.0f}s")
    return res


if __name__ == "__main__":
    run(main)
