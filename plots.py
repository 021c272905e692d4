"""
The figures, one function per script that draws them (all files, no display):

    evaluate.py --plot   eval_figures: loss vs loops, convergence, depth by token class
    allocate.py --plot   allocation_figure (loss vs average depth), frontier_figure (realized.png)
    sample.py --bench --plot   frontier_figure (sample_bench.png)
    study.sh             python plots.py RANDOMIZED_DIR FIXED_DIR FIGURE: the fixed-depth control's curve
"""
import json
import os
import sys

from allocate import POLICIES
from configurator import die


def pyplot():
    try:
        import matplotlib
    except ImportError:
        die("--plot needs the optional `matplotlib` package: pip install matplotlib")
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def save(fig, path):
    for ax in fig.axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def eval_figures(res, out_dir):
    """evaluate.py's three figures, out_dir/eval_{loss_vs_loops,convergence,token_classes}.png."""
    plt = pyplot()
    mean, el, cv, tc = res["checkpoint"]["mean_loops"], res["elasticity"], res["convergence"], res["token_classes"]
    loops = [row["loops"] for row in el]
    losses = [row["loss"] for row in el]
    speed = [row["tokens_per_s"] for row in el]

    fig, (ax_loss, ax_cost) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax_loss.plot(loops, losses, "o-")
    ax_loss.set_xscale("log", base=2)
    ax_loss.set_xticks(loops, [str(r) for r in loops])
    ax_loss.set(xlabel="inference loops r", ylabel="validation loss (nats)", title="Loss vs loops (noise init)")
    ax_loss.axvline(mean, color="gray", linestyle="--", label=f"training mean ({mean})")
    ax_loss.legend()
    ax_cost.plot(speed, losses, "o-")
    for r, x, y in zip(loops, speed, losses):
        ax_cost.annotate(f"r={r}", (x, y), textcoords="offset points", xytext=(5, 5))
    ax_cost.set_xscale("log")
    ax_cost.margins(x=0.15, y=0.1)
    ax_cost.set(xlabel="tokens/s at batch 1 (log)", ylabel="validation loss (nats)", title="Per-request cost curve")
    save(fig, os.path.join(out_dir, "eval_loss_vs_loops.png"))

    fig, (ax_kl, ax_moving) = plt.subplots(1, 2, figsize=(11, 4.2))
    loop = [row["loop"] for row in cv["rows"]]
    ax_kl.semilogy(loop, [row["mean_kl"] for row in cv["rows"]], "o-")
    ax_kl.set(xlabel="loop i", ylabel=r"mean KL($p_i \,\|\, p_{i-1}$) (log)",
              title=f"Successive-output KL ({cv['init']} init)")
    ax_moving.plot(loop, [row["percent_moving"] for row in cv["rows"]], "o-")
    ax_moving.set(xlabel="loop i", ylabel=f"percent of tokens with KL > {cv['moving_kl']:g}", ylim=(0, 101),
                  title=f"Tokens still moving (median convergence depth {cv['median_depth']:g})")
    for ax in (ax_kl, ax_moving):
        ax.axvline(mean, color="gray", linestyle="--", label=f"training mean ({mean})")
        ax.legend()
    save(fig, os.path.join(out_dir, "eval_convergence.png"))

    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    rows = [row for row in tc["rows"] if row["mean_exit_depth"] is not None]
    bars = ax.bar([f"{row['class']}\n(n={row['count']})" for row in rows], [row["mean_exit_depth"] for row in rows])
    ax.bar_label(bars, fmt="%.2f")
    ax.margins(y=0.15)
    ax.set(ylabel="mean exit depth (loops)", title=f"Depth by token class (exit at KL < {tc['exit_threshold']:g})")
    save(fig, os.path.join(out_dir, "eval_token_classes.png"))
    plt.close("all")


def allocation_figure(res, path):
    """allocate.py: every policy's (average depth, loss) curve and the uniform-mean bar."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.4))
    for key, points in res["curves"].items():
        depth, loss = zip(*sorted((p["avg_depth"], p["loss"]) for p in points))
        ax.plot(depth, loss, "o-" if key == "A0" else ".-", label=POLICIES[key])
    ax.axhline(res["bar"], color="k", linestyle=":", label=f"uniform r={res['mean_loops']} quality")
    ax.set(xlabel="average loops per token", ylabel="loss (nats)", title=f"Allocation ({res['harness']} harness)")
    ax.legend()
    save(fig, path)
    plt.close(fig)


def frontier_figure(by_batch, what, path):
    """Loss against tokens/s per batch size: the uniform frontier as a line, A1 and A1s as curves."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(by_batch), figsize=(5.5 * len(by_batch), 4.2), squeeze=False)
    for ax, (batch, rows) in zip(axes[0], by_batch.items()):
        for key in ("A0", "A1", "A1s"):
            speed, loss = zip(*sorted((r["tokens_per_s"], r["loss"]) for r in rows if r["policy"] == key))
            label = "uniform frontier, r = 1..r_max" if key == "A0" else POLICIES[key]
            ax.plot(speed, loss, "o-" if key == "A0" else ".--", label=label)
        ax.set_xscale("log")
        ax.set(xlabel="tokens/s (log)", ylabel="teacher-forced loss (nats)", title=f"{what}, batch {batch}")
        ax.legend()
    save(fig, path)
    plt.close(fig)


def versus_fixed(randomized_dir, fixed_dir, path):
    """The randomized model's and its fixed-depth control's loss per loop count (their eval.json files):
    a markdown table on stdout and one figure."""
    curves = []
    for out_dir in (randomized_dir, fixed_dir):
        with open(os.path.join(out_dir, "eval.json")) as f:
            ev = json.load(f)
        curves.append({row["loops"]: row["loss"] for row in ev["elasticity"]})
    mean = ev["checkpoint"]["mean_loops"]
    print(f"\n| loops r | {randomized_dir} (randomized) | {fixed_dir} (fixed r={mean}) |\n|---|---|---|")
    for r in sorted(set(curves[0]) | set(curves[1])):
        print(f"| {r} | {curves[0].get(r, float('nan')):.4f} | {curves[1].get(r, float('nan')):.4f} |")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    labels = (f"randomized depth (LogNormal, mean {mean})", f"fixed depth r={mean} (control)")
    for curve, label in zip(curves, labels):
        ax.plot(sorted(curve), [curve[r] for r in sorted(curve)], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(curves[1]), [str(r) for r in sorted(curves[1])])
    ax.set(xlabel="inference loops r", ylabel="validation loss (nats)", title="Randomized vs fixed-depth training")
    ax.legend(loc="upper right")
    save(fig, path)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        die("usage: python plots.py RANDOMIZED_OUT_DIR FIXED_OUT_DIR FIGURE.png")
    versus_fixed(*sys.argv[1:])
