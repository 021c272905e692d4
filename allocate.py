"""
Per-token depth allocation on a frozen checkpoint (the paper's post-hoc policies), and a realized speedup.

    python allocate.py --out_dir=out-shakespeare [--windows 128] [--plot] [--realized]

Zero state init (reproducible exits), r_max = 2 x mean_loops unless given. A0: uniform r = 1..r_max.
A1: after loop i >= 2 freeze a token once KL(p_i || p_{i-1}) < eps, carry p_i. A1s: the same with the
nearly free relative state change. A2: a logistic probe on s_i, fit on training windows, predicts "the
argmax still changes after loop i"; a token stops once P(change) < tau. Each threshold sweep gives an
(average depth, loss) curve, read at matched depths and at the bar (A0 at r = mean_loops). --realized
runs A1/A1s so that frozen tokens cost nothing. Prints markdown; writes out_dir/allocate.json (+ .png).
"""
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from configurator import configure, die
from evaluate import load_windows, markdown
from model import load_checkpoint, state_change, token_kl

# ---- defaults --------------------------------------------------------------------------
out_dir = "out-shakespeare"  # reads out_dir/ckpt.pt, writes out_dir/allocate.json (+ .png)
windows = 128  # evaluation windows of block_size + 1 tokens from val.bin
train_windows = 32  # A2's label-harvest windows from train.bin (never the evaluation windows)
r_max = None  # the deepest loop any policy may run; None: 2 x mean_loops
batch_size = 16
n_grid = 8  # thresholds per swept policy (each costs one masked pass to r_max)
probe_steps = 300  # full-batch Adam steps for A2's logistic probe
timing_reps = 5  # timed repeats (after a warm-up) per wall-clock measurement; the median is kept
tolerance = 0.005  # nats: "equal loss" for the realized speedup
seed = 1337
realized = False
plot = False
device = "cpu"
DEFAULTS = {k: v for k, v in globals().items() if not k.startswith("_") and (v is None or isinstance(v, (int, float, str, bool)))}
POLICIES = {"A0": "A0 uniform", "A1": "A1 KL exit", "A1s": "A1s state exit", "A2": "A2 router"}
CRITERION = {"A1": "kl", "A1s": "state", "A2": "probe"}


def token_loss(logits, y):
    return F.cross_entropy(logits.float().flatten(0, -2), y.flatten(), reduction="none").view_as(y)


sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # timings wait for queued GPU work


@torch.no_grad()
def trace(model, x, y, r_max, keep_states=False):
    """One unfrozen pass to r_max. Per loop i (dim 0) and token: loss, KL(p_i || p_{i-1}) (inf at
    loop 1), relative state change (1 at loop 1 from the zero state), argmax, and optionally s_i."""
    e = model.prelude(x)
    s, prev = model.init_state(e, "zero"), None
    rows = {"loss": [], "kl": [], "dstate": [], "argmax": [], "state": []}
    for _ in range(r_max):
        s_new = model.core_step(e, s)
        logits = model.readout(s_new)
        rows["loss"].append(token_loss(logits, y))
        rows["kl"].append(torch.full(y.shape, float("inf"), device=y.device) if prev is None else token_kl(logits, prev))
        rows["dstate"].append(state_change(s_new, s, relative=True))
        rows["argmax"].append(logits.argmax(-1))
        if keep_states:
            rows["state"].append(s_new)
        s, prev = s_new, logits
    return {k: torch.stack(v) for k, v in rows.items() if v}


@torch.no_grad()
def masked_exit(model, x, y, r_max, criterion, threshold, probe=None):
    """The paper's teacher-forced masking harness, exact. Every token runs every loop (stopping once all
    are frozen changes nothing) and a frozen token's state is held by torch.where, so it keeps serving as
    key/value to the others, recomputed from its frozen state. Cost: r_max full core passes (plus a full
    readout per loop for 'kl') whatever the threshold: it saves no work, it only counts the saving.
    'kl' (A1): stop after loop i >= 2 when KL(p_i || p_{i-1}) < threshold, carry p_i forward.
    'state' (A1s): stop when the relative state change < threshold; 'probe' (A2): when P(change | s_i)
    < threshold. These two need no readout per loop: the held states are read out once at the end,
    as the realized run does. Returns per-token loss, per-token loops run, and the final states."""
    e = model.prelude(x)
    s = model.init_state(e, "zero")
    active, depth, logits = torch.ones_like(y, dtype=torch.bool), torch.zeros_like(y), None
    for i in range(1, r_max + 1):
        s_new = torch.where(active[..., None], model.core_step(e, s), s)
        depth += active
        score = torch.full(y.shape, float("inf"), device=y.device)  # inf: no exit test at this loop
        if criterion == "kl":
            new = model.readout(s_new)
            if i > 1:  # the KL only where the token ran (it is the costly part); frozen ones carry theirs
                score[active] = token_kl(new[active], logits[active])
                new[~active] = logits[~active]
            logits = new
        elif criterion == "state" and i > 1:
            score = state_change(s_new, s, relative=True)
        elif criterion == "probe":
            score = probe(s_new)
        active &= score >= threshold
        s = s_new
        if not active.any():
            break
    if criterion != "kl":
        logits = model.readout(s)
    return token_loss(logits, y), depth, s


@torch.no_grad()
def realized_exit(model, x, y, r_max, criterion, eps):
    """A1 ('kl') or A1s ('state') that skips frozen tokens' work, one window (batch 1) at a time.
    One 'latest' cache per core layer, shared by all loops, holds each token's most recently computed
    keys/values: active tokens at loop i attend to frozen ones through the K/V those computed at their
    last loop. The masking harness instead recomputes a frozen token's K/V from its frozen state at every
    later loop (i.e. the K/V of one loop further), so the two differ slightly; both are causal.
    'kl' reads out only the active tokens each loop against their own coda cache; 'state' reads out
    all tokens once at the end. Returns loss (T,), loops per token (T,), core- and readout-token evals."""
    c, T = model.config, x.size(1)
    pos = torch.arange(T, device=x.device)[None]
    e = model.prelude(x)
    latest = model.new_caches(c.n_core, 1, T)
    s = model.core_step(e, model.init_state(e, "zero"), latest, pos)  # loop 1: every token
    kl = criterion == "kl"
    coda = model.new_caches(c.n_coda, 1, T) if kl else None
    logits = model.readout(s, coda, pos) if kl else None
    depth, active = torch.ones(T, dtype=torch.long, device=x.device), torch.ones(T, dtype=torch.bool, device=x.device)
    n_core, n_read = T, T if kl else 0
    for _ in range(2, r_max + 1):
        idx = active.nonzero()[:, 0]
        if len(idx) == 0:
            break
        s_old = s[:, idx]
        s_new = model.core_step(e[:, idx], s_old, latest, idx[None])
        s[:, idx] = s_new
        depth[idx] += 1
        n_core += len(idx)
        if kl:
            new = model.readout(s_new, coda, idx[None])
            score = token_kl(new, logits[:, idx])[0]
            logits[:, idx] = new
            n_read += len(idx)
        else:
            score = state_change(s_new, s_old, relative=True)[0]
        active[idx[score < eps]] = False
    if not kl:
        logits = model.readout(s)
        n_read += T
    return token_loss(logits, y)[0], depth, n_core, n_read


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


def interp_loss(curve, depth):
    """Loss at an average depth by piecewise-linear interpolation along (depth, loss) points; None outside."""
    d, loss = zip(*sorted(curve))
    return float(np.interp(depth, d, loss)) if d[0] <= depth <= d[-1] else None


def depth_at_bar(curve, bar):
    """The smallest average depth at which the interpolated curve reaches loss <= bar; None if never."""
    pts = sorted(curve)
    if pts[0][1] <= bar:
        return pts[0][0]
    for (d0, l0), (d1, l1) in zip(pts, pts[1:]):  # l0 > bar here, or we would have returned
        if l1 <= bar:
            return d0 + (l0 - bar) / (l0 - l1) * (d1 - d0)
    return None


def median_time(fn, reps):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def over_batches(fn, X, Y, size):
    return [fn(X[i:i + size], Y[i:i + size]) for i in range(0, len(X), size)]


def sweep(model, X, Y, C, r_max, name, thresholds, probe=None):
    """One masked pass over all windows per threshold -> [{threshold, avg_depth, loss}]."""
    points = []
    for t in tqdm(thresholds, desc=f"{name} sweep", file=sys.stderr):
        out = over_batches(lambda x, y: masked_exit(model, x, y, r_max, CRITERION[name], t, probe)[:2], X, Y, C.batch_size)
        loss, depth = (torch.cat(parts) for parts in zip(*out))
        points.append({"threshold": t, "avg_depth": depth.float().mean().item(), "loss": loss.mean().item()})
    return points


def fit_router(model, twins, C, r_max):
    """A2 from training windows only: harvest labels, fit the probe, hold out the last 20% of windows
    (whole windows: tokens of one window are correlated). Every threshold grid comes from here too,
    so nothing about the evaluation windows places the sweeps. -> (probe, its report, grids)."""
    harvest = over_batches(lambda x, y: trace(model, x, y, r_max, keep_states=True), twins[:, :-1], twins[:, 1:], C.batch_size)
    train = {k: torch.cat([h[k] for h in harvest], 1) for k in harvest[0]}
    labels = harvest_labels(train["argmax"])[:-1].cpu()  # loop r_max has no later loop: nothing to predict
    states = train["state"][:-1].cpu()
    n_fit = round(0.8 * C.train_windows)
    prob, accuracy, majority = fit_probe(states[:, :n_fit].flatten(0, 2), labels[:, :n_fit].flatten(),
                                         states[:, n_fit:].flatten(0, 2), labels[:, n_fit:].flatten(), C.probe_steps)
    grids = {"A1": log_grid(train["kl"][1:], C.n_grid), "A1s": log_grid(train["dstate"][1:], C.n_grid),
             "A2": log_grid(prob(states[:, n_fit:]).flatten(), C.n_grid)}
    info = {"accuracy": accuracy, "majority": majority, "positive_rate": labels.float().mean().item(), "samples": labels.numel()}
    return prob, info, grids


@torch.no_grad()
def wall_clock_bracket(model, X, Y, C, r_max, curves, at_bar, bar):
    """(1) the FLOP proxy at the bar, (2) the best case: uniform mean_loops against uniform at A1's depth
    at the bar, timed, and (3) the masking harness (A1 at the largest grid eps reaching the bar) timed."""
    mean = model.config.mean_loops
    reached = {k: d for k, d in at_bar.items() if k != "A0" and d is not None}
    best = min(reached, key=reached.get) if reached else None
    out = {"flop_proxy": {"policy": best, "avg_depth": reached[best], "saving": 1 - reached[best] / mean} if best else None,
           "best_case": [], "masked": None}
    small = round(at_bar["A1"]) if at_bar["A1"] is not None else None
    for b in (1, 2, 4, 8) if small else ():
        t_full = median_time(lambda: model(X[:b], loops=mean, state_init="zero"), C.timing_reps)
        t_small = median_time(lambda: model(X[:b], loops=small, state_init="zero"), C.timing_reps)
        out["best_case"].append({"batch": b, "small_loops": small, "seconds_full": t_full, "seconds_small": t_small,
                                 "speedup": t_full / t_small})
    under = [p for p in curves["A1"] if p["loss"] <= bar]
    eps = max(under, key=lambda p: p["threshold"]) if under else min(curves["A1"], key=lambda p: p["threshold"])
    xb, yb = X[:C.batch_size], Y[:C.batch_size]
    t_uni = median_time(lambda: model(xb, loops=mean, state_init="zero"), C.timing_reps)
    t_mask = median_time(lambda: masked_exit(model, xb, yb, r_max, "kl", eps["threshold"]), C.timing_reps)
    out["masked"] = {"eps": eps["threshold"], "batch": len(xb), "seconds_uniform": t_uni, "seconds_masked": t_mask,
                     "speedup": t_uni / t_mask}
    return out


def realized_run(model, X, Y, r_max, mean_loops, criterion, eps):
    """Realized exit against uniform mean_loops, window by window at batch 1. Each window times the uniform
    forward and the realized exit back to back, so load on a shared machine hits both alike."""
    t_uni = t_real = loss_uni = loss_real = n_core = n_read = loops = 0.0
    realized_exit(model, X[:1], Y[:1], r_max, criterion, eps)  # warm-up
    for x, y in zip(X.split(1), Y.split(1)):
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            logits, _ = model(x, loops=mean_loops, state_init="zero")
        sync()
        t1 = time.perf_counter()
        loss, depth, core, read = realized_exit(model, x, y, r_max, criterion, eps)
        sync()
        t_uni, t_real = t_uni + t1 - t0, t_real + time.perf_counter() - t1
        loss_uni += token_loss(logits, y).sum().item()
        loss_real, loops, n_core, n_read = loss_real + loss.sum().item(), loops + depth.sum().item(), n_core + core, n_read + read
    n = Y.numel()
    return {"eps": eps, "loss": loss_real / n, "uniform_loss": loss_uni / n, "avg_depth": loops / n,
            "core_token_evals": int(n_core), "readout_token_evals": int(n_read),
            "uniform_core_token_evals": n * mean_loops, "uniform_readout_token_evals": n,
            "tokens_per_s": n / t_real, "uniform_tokens_per_s": n / t_uni, "speedup": t_uni / t_real}


def realized_search(model, X, Y, r_max, mean_loops, criterion, curve, bar, tol, tries=3):
    """The largest grid eps whose realized loss is within tol of uniform mean_loops, trying the grid
    downward from the largest eps the masking harness puts within tol of the bar (at most `tries`)."""
    ok = [p for p in sorted(curve, key=lambda p: -p["threshold"]) if p["loss"] <= bar + tol]
    runs = []
    for p in tqdm((ok or [min(curve, key=lambda p: p["threshold"])])[:tries], desc=f"realized {criterion}", file=sys.stderr):
        runs.append(realized_run(model, X, Y, r_max, mean_loops, criterion, p["threshold"]) | {"masked_loss": p["loss"]})
        runs[-1]["matched"] = runs[-1]["loss"] <= runs[-1]["uniform_loss"] + tol
        if runs[-1]["matched"]:
            break
    return runs


def print_report(res):
    m, names = res["mean_loops"], [POLICIES[k] for k in res["curves"]]
    print(f"\n## Allocation: loss at matched average depth (zero init, {res['windows']} windows, "
          f"r_max {res['r_max']}); uniform r={m} quality bar = {res['bar']:.4f}\n")
    rows = []
    for row in res["table"]:
        vals = [row[k] for k in res["curves"]]
        best = min((v for v in vals if v is not None), default=None)
        rows.append([f"{row['avg_depth']:g}"] + ["-" if v is None else f"**{v:.4f}**" if v == best else f"{v:.4f}" for v in vals])
    rows.append(["reaches bar at"] + ["never" if res["depth_at_bar"][k] is None else f"{res['depth_at_bar'][k]:.2f}" for k in res["curves"]])
    print(markdown(["avg depth"] + names, rows))
    print(f"\nA2 probe: held-out accuracy {res['probe']['accuracy']:.3f} (majority class {res['probe']['majority']:.3f})")
    b = res["bracket"]
    print("\n## Wall-clock bracket\n\n1. FLOP proxy: " + (f"{b['flop_proxy']['saving']:.1%} fewer loops at the bar "
          f"({b['flop_proxy']['policy']})" if b["flop_proxy"] else "no policy reaches the bar"))
    if b["best_case"]:
        print(f"2. best case, uniform r={m} vs r={b['best_case'][0]['small_loops']}: " + ", ".join(
            f"batch {r['batch']} {r['speedup']:.2f}x" for r in b["best_case"]))
    if b["masked"]:
        print(f"3. masking harness (A1, eps {b['masked']['eps']:.2g}, batch {b['masked']['batch']}): "
              f"{b['masked']['speedup']:.2f}x the speed of uniform r={m}")
    for crit, runs in res.get("realized", {}).items():
        print(f"\n## Realized {crit} exit at batch 1 (vs uniform r={m})\n")
        print(markdown(["eps", "loss", "masked loss", "uniform loss", "avg depth", "core evals (uniform)",
                        "readout evals (uniform)", "tokens/s (uniform)", "speedup"],
                       [[f"{r['eps']:.3g}", f"{r['loss']:.4f}", f"{r['masked_loss']:.4f}", f"{r['uniform_loss']:.4f}",
                         f"{r['avg_depth']:.2f}", f"{r['core_token_evals']} ({r['uniform_core_token_evals']})",
                         f"{r['readout_token_evals']} ({r['uniform_readout_token_evals']})",
                         f"{r['tokens_per_s']:.0f} ({r['uniform_tokens_per_s']:.0f})",
                         f"{r['speedup']:.2f}x" + ("" if r["matched"] else " (loss not matched)")] for r in runs]))
    if res.get("realized"):
        won = {c: runs[-1]["speedup"] for c, runs in res["realized"].items() if runs[-1]["matched"]}
        print(f"\nlowest realized cost at equal loss: {max(won, key=won.get)} exit ({max(won.values()):.2f}x uniform r={m})"
              if won else f"\nneither exit matched uniform r={m} within {res['args']['tolerance']} nats on the grid tried")


def plot_curves(res, path):
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for key, pts in res["curves"].items():
        d, loss = zip(*sorted((p["avg_depth"], p["loss"]) for p in pts))
        ax.plot(d, loss, "o-" if key == "A0" else ".-", label=POLICIES[key])
    ax.axhline(res["bar"], color="k", linestyle=":", label=f"uniform r={res['mean_loops']} quality")
    floor = min(p["loss"] for pts in res["curves"].values() for p in pts)
    ax.set_ylim(floor - 0.2 * (res["bar"] - floor) - 0.005, res["bar"] + 3 * (res["bar"] - floor) + 0.02)
    ax.set(xlabel="average loops per token", ylabel="loss (nats)", title="Per-token depth allocation (zero init)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=()):
    C = SimpleNamespace(**configure(DEFAULTS, list(argv)))  # bare --plot / --realized: the configurator's switches
    if C.windows < 1 or C.train_windows < 2 or C.batch_size < 1 or C.n_grid < 2 or C.timing_reps < 1 or C.probe_steps < 1:
        die("need windows, batch_size, timing_reps, probe_steps >= 1, train_windows >= 2 (20% are held out) and n_grid >= 2")
    model, ckpt = load_checkpoint(os.path.join(C.out_dir, "ckpt.pt"), C.device)
    mean = model.config.mean_loops
    r_max = 2 * mean if C.r_max is None else C.r_max
    if not isinstance(r_max, int) or isinstance(r_max, bool) or r_max < max(2, mean):
        die(f"--r_max {r_max!r}: need an integer >= 2 and >= mean_loops ({mean}): the bar is uniform r = mean_loops")
    data_dir = os.path.join("data", ckpt["config"]["dataset"])
    for name in ("meta.json", "val.bin", "train.bin"):
        if not os.path.isfile(os.path.join(data_dir, name)):
            die(f"{C.out_dir}/ckpt.pt was trained on {data_dir}/, which has no {name}: run prepare.py for it")
    with open(os.path.join(data_dir, "meta.json")) as f:
        meta = json.load(f)
    block = ckpt["config"]["block_size"]
    wins = load_windows(os.path.join(data_dir, "val.bin"), meta["dtype"], C.windows, block + 1, C.seed).to(C.device)
    X, Y = wins[:, :-1], wins[:, 1:].contiguous()
    twins = load_windows(os.path.join(data_dir, "train.bin"), meta["dtype"], C.train_windows, block + 1, C.seed + 1).to(C.device)
    print(f"{C.out_dir}/ckpt.pt: iter {ckpt['iter_num']}, mean_loops {mean}, r_max {r_max}; {C.windows} val windows "
          f"of {block} tokens, {C.train_windows} train windows for A2; {C.device}")

    prob, probe_info, grids = fit_router(model, twins, C, r_max)
    evals = over_batches(lambda x, y: trace(model, x, y, r_max), X, Y, C.batch_size)
    ev = {k: torch.cat([h[k] for h in evals], 1) for k in evals[0]}
    curves = {"A0": [{"threshold": r, "avg_depth": float(r), "loss": ev["loss"][r - 1].mean().item()} for r in range(1, r_max + 1)]}
    convergence = [{"loop": i, "mean_kl": ev["kl"][i - 1].mean().item(), "mean_state_change": ev["dstate"][i - 1].mean().item(),
                    "percent_kl_above_1e-3": 100 * (ev["kl"][i - 1] > 1e-3).float().mean().item()} for i in range(2, r_max + 1)]
    for key in ("A1", "A1s", "A2"):
        curves[key] = sweep(model, X, Y, C, r_max, key, grids[key], prob)
    bar = curves["A0"][mean - 1]["loss"]
    pairs = {k: [(p["avg_depth"], p["loss"]) for p in pts] for k, pts in curves.items()}
    table = [{"avg_depth": d} | {k: interp_loss(pairs[k], d) for k in curves} for d in (mean * f / 8 for f in range(3, 8))]
    at_bar = {k: depth_at_bar(pairs[k], bar) for k in curves}

    bracket = wall_clock_bracket(model, X, Y, C, r_max, curves, at_bar, bar)
    res = {"args": vars(C), "checkpoint": {"path": os.path.join(C.out_dir, "ckpt.pt"), "iter_num": ckpt["iter_num"],
                                           "dataset": ckpt["config"]["dataset"]}, "mean_loops": mean, "r_max": r_max,
           "windows": C.windows, "block_size": block, "bar": bar, "probe": probe_info, "curves": curves, "table": table,
           "depth_at_bar": at_bar, "convergence": convergence, "bracket": bracket}
    if C.realized:
        res["realized"] = {crit: realized_search(model, X, Y, r_max, mean, crit, curves[key], bar, C.tolerance)
                           for key, crit in (("A1", "kl"), ("A1s", "state"))}
    print_report(res)
    os.makedirs(C.out_dir, exist_ok=True)
    with open(os.path.join(C.out_dir, "allocate.json"), "w") as f:
        json.dump(res, f, indent=2)
    if C.plot:
        plot_curves(res, os.path.join(C.out_dir, "allocate.png"))
    print(f"\nwrote {C.out_dir}/allocate.json{' and allocate.png' if C.plot else ''}")
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
