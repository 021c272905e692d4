"""
Per-token depth allocation on a frozen checkpoint (the paper's post-hoc policies), measured against
the uniform-depth frontier.

    python allocate.py --out_dir=out-shakespeare [--windows 128] [--plot] [--realized]

Zero state init (reproducible exits); no policy runs deeper than r_max (2 x mean_loops unless given)
and none stops a token before loop 2. A0: uniform r = 1..r_max. A1: stop a token once
KL(p_i || p_{i-1}) < eps and carry p_i. A1s: the same with the relative state change. A2: a
logistic probe on s_i, fit on training windows, predicts "the argmax still changes after loop i";
stop once P(change) < tau. Each threshold gives an (average depth, loss) point.

The sweeps run on the realized engine: at every loop one core call carries the still-active tokens
of a batch of windows, so a frozen token costs nothing (--harness masked: the paper's masking
harness instead, every token to r_max). --realized also times, at batch 1 and batch_size, uniform
r = 1..r_max and every A1/A1s threshold back to back on the same windows, and reads each threshold's
speed against the frontier at its loss. Loss differences carry paired bootstrap 95% intervals over
the windows. Prints markdown; writes out_dir/allocate.json (and allocate.png with --plot).
"""
import os
import sys
import time
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from configurator import check_device, configure, default_device, die, require_positive, run, write_json
from evaluate import load_windows, markdown, token_loss, trace
from model import MIN_EXIT_LOOP, default_r_max, exit_score, load_checkpoint
from prepare import open_dataset

# ---- defaults --------------------------------------------------------------------------
out_dir = "out-shakespeare"  # reads out_dir/ckpt.pt, writes out_dir/allocate.json (+ .png)
windows = 128  # evaluation windows of block_size + 1 tokens from val.bin
train_windows = 32  # A2's label-harvest windows from train.bin (never the evaluation windows)
r_max = 0  # the deepest loop any policy may run; 0: 2 x mean_loops
batch_size = 8  # windows per call: the B of depth-wise batching
n_grid = 6  # thresholds per swept policy
probe_steps = 300  # full-batch Adam steps for A2's logistic probe
harness = "realized"  # 'realized' (frozen tokens skip their work) or 'masked' (the paper's reference)
realized = False  # also time the frontier and the A1/A1s thresholds at batch 1 and batch_size
timing_windows = 16  # windows timed per configuration (the first ones of the evaluation set)
timing_reps = 3  # timed rounds; each configuration keeps its median
bootstrap = 1000  # resamples of the windows for every interval
seed = 1337
plot = False
device, dtype = default_device()  # cuda + bfloat16 when a GPU is there, else cpu + float32
DEFAULTS = {k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, str, bool))}
POLICIES = {"A0": "A0 uniform", "A1": "A1 KL exit", "A1s": "A1s state exit", "A2": "A2 router"}
CRITERION = {"A1": "kl", "A1s": "state", "A2": "probe"}


# ---- the engines ---------------------------------------------------------------------------
def score_after_loop(criterion, probe, s_new, s_old, logits_new, logits_old):
    if criterion == "probe":
        return probe(s_new)
    return exit_score(criterion, s_new, s_old, logits_new, logits_old)


@torch.no_grad()
def masked_exit(model, x, y, r_max, criterion, threshold, probe=None):
    """The paper's teacher-forced masking harness: every token runs every loop and a frozen token's
    state is held by torch.where, so it keeps serving as key/value to the others, recomputed from its
    frozen state (the K/V of one loop further than it ran). It saves no work, it only counts it.
    Returns per-token loss and loops run, (B, T) each."""
    e = model.prelude(x)
    s = model.init_state(e, "zero")
    active = torch.ones_like(y, dtype=torch.bool)
    depth = torch.zeros_like(y)
    logits = model.readout(s) if criterion == "kl" else None
    for loop in range(1, r_max + 1):
        s_new = torch.where(active[..., None], model.core_step(e, s), s)
        depth += active
        new_logits = model.readout(s_new) if criterion == "kl" else None
        if criterion == "kl":  # a frozen token carries the distribution it stopped with
            new_logits = torch.where(active[..., None], new_logits, logits)
        if loop >= MIN_EXIT_LOOP:
            active &= score_after_loop(criterion, probe, s_new, s, new_logits, logits) >= threshold
        s, logits = s_new, new_logits
    if criterion != "kl":
        logits = model.readout(s)
    return token_loss(logits, y), depth


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
    """argmax (r_max, ...) -> label (r_max, ...): True where the argmax at loop i differs at any later loop."""
    return torch.stack([(argmax[i + 1:] != argmax[i]).any(0) for i in range(len(argmax))])


def fit_probe(x_fit, y_fit, x_held, y_held, steps):
    """Logistic regression on standardised features, full-batch Adam from zeros (deterministic).
    Returns (P(label | x) as a function, held-out accuracy, held-out majority-class accuracy)."""
    mu, sd = x_fit.mean(0), x_fit.std(0).clamp_min(1e-6)
    w, b = torch.zeros(x_fit.size(1), requires_grad=True), torch.zeros((), requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=0.05)
    z_fit, target = (x_fit - mu) / sd, y_fit.float()
    with torch.enable_grad():
        for _ in range(steps):
            opt.zero_grad()
            F.binary_cross_entropy_with_logits(z_fit @ w + b, target).backward()
            opt.step()
    w, b = w.detach(), b.detach()

    def prob(s):
        return torch.sigmoid(((s.float() - mu.to(s.device)) / sd.to(s.device)) @ w.to(s.device) + b)

    rate = y_held.float().mean().item()
    return prob, ((prob(x_held) > 0.5) == y_held).float().mean().item(), max(rate, 1 - rate)


def log_grid(values, n):
    """n thresholds spaced geometrically between the 2nd and 98th percentiles of positive finite values."""
    v = values[torch.isfinite(values) & (values > 0)].double().cpu().numpy()
    return np.geomspace(*np.quantile(v, [0.02, 0.98]), n).tolist()


def fit_router(model, twins, C, r_max):
    """A2 from training windows only: harvest labels, fit the probe, hold out the last 20% of windows
    (whole windows: tokens of one window are correlated). Every threshold grid comes from here too,
    so nothing about the evaluation windows places the sweeps. -> (probe, its report, grids)."""
    parts = []
    for i in range(0, len(twins), C.batch_size):
        batch = twins[i:i + C.batch_size]
        parts.append(trace(model, batch[:, :-1], batch[:, 1:], r_max, keep_states=True))
    harvest = {k: torch.cat([part[k] for part in parts], 1) for k in parts[0]}
    labels = harvest_labels(harvest["argmax"])[:-1].cpu()  # loop r_max has no later loop: nothing to predict
    states = harvest["state"][:-1].float().cpu()
    n_fit = round(0.8 * len(twins))
    prob, accuracy, majority = fit_probe(states[:, :n_fit].flatten(0, 2), labels[:, :n_fit].flatten(),
                                         states[:, n_fit:].flatten(0, 2), labels[:, n_fit:].flatten(), C.probe_steps)
    grids = {"A1": log_grid(harvest["kl"][1:], C.n_grid), "A1s": log_grid(harvest["dstate_rel"][1:], C.n_grid),
             "A2": log_grid(prob(states[:, n_fit:]).flatten(), C.n_grid)}
    info = {"accuracy": accuracy, "majority": majority, "positive_rate": labels.float().mean().item()}
    return prob, info, grids


# ---- curves, the frontier and intervals --------------------------------------------------------
# Every statistic below is a function of `pw`, per-window results {policy: (loss, depth)}, two arrays of
# shape (points, windows): A0's points are r = 1..r_max, the others' their thresholds. A paired bootstrap
# resamples the windows of every array with the same indices and recomputes the statistic.
def curve(pw, key):
    """(average depth, loss) of each of the policy's points."""
    loss, depth = pw[key]
    return list(zip(depth.mean(1), loss.mean(1)))


def depth_at_loss(points, loss):
    """The smallest average depth at which the piecewise-linear (depth, loss) curve reaches `loss`; None if never."""
    pts = sorted(points)
    if pts[0][1] <= loss:
        return pts[0][0]
    for (d0, l0), (d1, l1) in zip(pts, pts[1:]):  # l0 > loss here, or we would have returned
        if l1 <= loss:
            return d0 + (l0 - loss) / (l0 - l1) * (d1 - d0)
    return None


def interp_loss(points, depth):
    """Loss at an average depth, interpolated along (depth, loss) points; None outside their range."""
    d, loss = zip(*sorted(points))
    return float(np.interp(depth, d, loss)) if d[0] <= depth <= d[-1] else None


def bar_loss(pw, mean):
    return pw["A0"][0][mean - 1].mean()


def depth_at_bar(pw, key, mean):
    return depth_at_loss(curve(pw, key), bar_loss(pw, mean))


def saving_at_bar(pw, key, mean):
    """1 - the policy's depth at the bar / uniform depth's (A0 may reach the bar below mean_loops)."""
    depth, uniform = depth_at_bar(pw, key, mean), depth_at_bar(pw, "A0", mean)
    return None if depth is None or uniform is None else 1 - depth / uniform


def loss_delta(pw, key, depth):
    """The policy's loss minus A0's at a matched average depth."""
    a0, other = interp_loss(curve(pw, "A0"), depth), interp_loss(curve(pw, key), depth)
    return None if a0 is None or other is None else other - a0


def estimate(stat, pw, n_resamples, seed, **kwargs):
    """{'value': stat(pw, **kwargs), 'interval': its paired bootstrap 95% interval, or None where the
    statistic is undefined (None) in more than 5% of the resamples}."""
    value = stat(pw, **kwargs)
    g = np.random.default_rng(seed)
    n = pw["A0"][0].shape[1]
    values = []
    for _ in range(n_resamples):
        pick = g.integers(0, n, n)
        resampled = {k: (loss[:, pick], depth[:, pick]) for k, (loss, depth) in pw.items()}
        v = stat(resampled, **kwargs)
        if v is not None:
            values.append(v)
    interval = None
    if value is not None and len(values) >= 0.95 * n_resamples:
        interval = [float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))]
    return {"value": None if value is None else float(value), "interval": interval}


# ---- the measurements ---------------------------------------------------------------------------
def sweep(model, X, Y, C, r_max, grids, probe):
    """Per-window loss and average depth for A0 (one trace to r_max) and every A1/A1s/A2 threshold."""
    batches = range(0, len(X), C.batch_size)
    uniform = torch.cat([trace(model, X[i:i + C.batch_size], Y[i:i + C.batch_size], r_max)["loss"].mean(2)
                         for i in batches], 1)
    pw = {"A0": (uniform.cpu().double().numpy(), np.repeat(np.arange(1.0, r_max + 1)[:, None], len(X), 1))}
    engine = realized_exit if C.harness == "realized" else masked_exit
    for key in ("A1", "A1s", "A2"):
        losses, depths = [], []
        for t in tqdm(grids[key], desc=f"{key} sweep", file=sys.stderr):
            runs = [engine(model, X[i:i + C.batch_size], Y[i:i + C.batch_size], r_max, CRITERION[key], t, probe)
                    for i in batches]
            losses.append(torch.cat([run[0].mean(1) for run in runs]))
            depths.append(torch.cat([run[1].float().mean(1) for run in runs]))
        pw[key] = (torch.stack(losses).cpu().double().numpy(), torch.stack(depths).cpu().double().numpy())
    return pw


# ---- the report ------------------------------------------------------------------------------------
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
    print(f"\n## Allocation at matched average depth ({res['harness']} harness, zero init, {res['windows']} windows, "
          f"r_max {res['r_max']}); uniform r={res['mean_loops']} quality bar = {res['bar']:.4f}\n")
    print("Each policy's loss minus A0's at the same average depth, paired bootstrap 95% interval over the windows; "
          "a difference whose interval contains 0 is no difference.\n")
    rows = []
    for row in res["table"]:
        cells = [f"{row['avg_depth']:g}", "-" if row["A0"] is None else f"{row['A0']:.4f}"]
        for key in ("A1", "A1s", "A2"):
            cells.append("-" if row[key]["value"] is None else show(row[key]))
        rows.append(cells)
    rows.append(["reaches the bar at", ""] + [show(res["depth_at_bar"][k], 2, "") for k in ("A1", "A1s", "A2")])
    rows.append(["loops saved at the bar", ""] + [show(res["saving_at_bar"][k], 3) for k in ("A1", "A1s", "A2")])
    print(markdown(["avg depth", "A0 loss"] + [f"{POLICIES[k]} - A0" for k in ("A1", "A1s", "A2")], rows))
    print(f"\nA0 itself reaches the bar at {show(res['depth_at_bar']['A0'], 2, '')} loops: the savings above (the FLOP "
          f"proxy) count against that, not against mean_loops. A2 probe: held-out accuracy "
          f"{res['probe']['accuracy']:.3f} (majority class {res['probe']['majority']:.3f}).")


def main(argv=()):
    C = SimpleNamespace(**configure(DEFAULTS, list(argv)))
    check_device(C.device, C.dtype)
    require_positive(C, "windows", "batch_size", "timing_windows", "timing_reps", "probe_steps", "bootstrap")
    if C.train_windows < 2:
        die(f"--train_windows must be >= 2 (20% are held out), got {C.train_windows}")
    if C.n_grid < 2:
        die(f"--n_grid must be >= 2, got {C.n_grid}")
    if C.harness not in ("realized", "masked"):
        die(f"--harness must be realized or masked, got {C.harness!r}")
    ckpt_path = os.path.join(C.out_dir, "ckpt.pt")
    model, ckpt = load_checkpoint(ckpt_path, C.device)
    mean = model.config.mean_loops
    r_max = C.r_max or default_r_max(model.config)
    if r_max < max(MIN_EXIT_LOOP, mean):
        die(f"--r_max {r_max}: need at least {MIN_EXIT_LOOP} and mean_loops ({mean}), the bar's depth")
    data_dir, meta = open_dataset(ckpt["config"]["dataset"], ckpt, ckpt_path)
    block = model.config.block_size
    wins = load_windows(os.path.join(data_dir, "val.bin"), meta["dtype"], C.windows, block + 1, C.seed).to(C.device)
    X, Y = wins[:, :-1], wins[:, 1:].contiguous()
    twins = load_windows(os.path.join(data_dir, "train.bin"), meta["dtype"], C.train_windows, block + 1, C.seed + 1)
    ctx = nullcontext() if C.dtype == "float32" else torch.autocast(C.device.split(":")[0], dtype=torch.bfloat16)
    print(f"{C.out_dir}/ckpt.pt: iter {ckpt['iter_num']}, mean_loops {mean}, r_max {r_max}; {C.windows} val windows "
          f"of {block} tokens, {C.train_windows} train windows for A2; {C.device} {C.dtype}")
    t_start = time.perf_counter()

    with ctx:
        probe, probe_info, grids = fit_router(model, twins.to(C.device), C, r_max)
        pw = sweep(model, X, Y, C, r_max, grids, probe)
    thresholds = {"A0": list(range(1, r_max + 1)), **grids}
    curves = {}
    for key, points in thresholds.items():
        curves[key] = [{"threshold": t, "avg_depth": d, "loss": loss} for t, (d, loss) in zip(points, curve(pw, key))]
    res = {"args": vars(C), "checkpoint": {"path": os.path.join(C.out_dir, "ckpt.pt"), "iter_num": ckpt["iter_num"],
                                           "dataset": ckpt["config"]["dataset"]},
           "mean_loops": mean, "r_max": r_max, "harness": C.harness, "windows": C.windows, "block_size": block,
           "bar": bar_loss(pw, mean), "probe": probe_info, "curves": curves, "depth_at_bar": {}, "saving_at_bar": {},
           "table": []}
    for key in curves:
        res["depth_at_bar"][key] = estimate(depth_at_bar, pw, C.bootstrap, C.seed, key=key, mean=mean)
        res["saving_at_bar"][key] = estimate(saving_at_bar, pw, C.bootstrap, C.seed, key=key, mean=mean)
    for depth in (mean * f / 8 for f in range(3, 8)):
        row = {"avg_depth": depth, "A0": interp_loss(curve(pw, "A0"), depth)}
        for key in ("A1", "A1s", "A2"):
            row[key] = estimate(loss_delta, pw, C.bootstrap, C.seed, key=key, depth=depth)
        res["table"].append(row)
    print_report(res)
    if C.realized:  # the timed part lives with the other benchmarks
        from bench import scoring_frontier
        with ctx:
            res["realized"] = scoring_frontier(model, X, Y, C, res, pw)
    res["per_window"] = {key: [loss.tolist(), depth.tolist()] for key, (loss, depth) in pw.items()}
    res["seconds"] = time.perf_counter() - t_start
    os.makedirs(C.out_dir, exist_ok=True)
    write_json(os.path.join(C.out_dir, "allocate.json"), res)
    if C.plot:
        from plots import allocation_figure, frontier_figure
        allocation_figure(res, os.path.join(C.out_dir, "allocate.png"))
        if C.realized:
            frontier_figure(res["realized"], "Realized teacher-forced scoring", os.path.join(C.out_dir, "realized.png"))
    print(f"\nwrote {C.out_dir}/allocate.json{' and figures' if C.plot else ''} in {res['seconds']:.0f}s")
    return res


if __name__ == "__main__":
    run(main)
