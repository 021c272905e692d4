"""The paper's figures for one run, from what evaluate.py, allocate.py and studies/token_classes.py
wrote in its out_dir:

    loss_by_depth   the validation loss at each depth: eval.json's from noise (as in training),
                    allocate.json's uniform depth A0 from a zero state (as the exits start)
    convergence     eval.json's rows from loop 2: the successive KL (and the state change), and the
                    share of tokens still moving
    allocation      allocate.json's policies (uniform depth, each exit test, A2 if studies.probe
                    ran): the loss against mean loops and against FLOPs per token, with the bar
                    (uniform depth at mean_loops)
    token_classes   token_classes.json's mean exit depth by class of the exiting token

Each figure whose input is there is drawn, to figures_dir/<run>_<figure>.png (run: out_dir's name).

    python evaluate.py --out_dir=out-shakespeare --loops=1,2,3,4,6,8,12,16,32
    python allocate.py --out_dir=out-shakespeare
    python -m studies.token_classes --out_dir=out-shakespeare
    python -m studies.figures --out_dir=out-shakespeare    # figures/out-shakespeare_*.png
"""
import json
import os

import numpy as np

from configurator import UserError, configure, run
from evaluate import MOVING_KL
from studies.outputs import check_source, save_figure

out_dir = "out-shakespeare"  # reads eval.json, allocate.json and token_classes.json, those there
figures_dir = "figures"  # writes <run>_<figure>.png here
INPUTS = ("eval.json", "allocate.json", "token_classes.json")
REQUIREMENTS = "pip install -r studies/requirements.txt"


def pyplot():
    """matplotlib.pyplot drawing to files only; UserError if matplotlib is not installed."""
    # matplotlib is studies/' own requirement, not the core's: a missing one is a line that says so
    try:
        import matplotlib
    except ImportError:
        raise UserError(f"the figures need matplotlib: {REQUIREMENTS}") from None
    matplotlib.use("Agg")  # no display: a server, a CI runner or a terminal over ssh draws too
    import matplotlib.pyplot as plt
    return plt


def read_inputs(out_dir):
    """{file name: its JSON} of the INPUTS in out_dir, None for a missing one. UserError if none is
    there, or if two are of different checkpoints."""
    found = {}
    for name in INPUTS:
        path = os.path.join(out_dir, name)
        found[name] = None
        if os.path.isfile(path):
            with open(path) as f:
                found[name] = json.load(f)
    checkpoints = {name: read["checkpoint"] for name, read in found.items() if read is not None}
    if not checkpoints:
        raise UserError(f"none of {', '.join(INPUTS)} in {out_dir}: run `python evaluate.py "
                        f"--out_dir={out_dir}` (and allocate.py, studies.token_classes) first")
    # a file left from an earlier training of the run: one figure (loss by depth) would join two models
    if len(set(checkpoints.values())) > 1:
        of_which = ", ".join(f"{name} of {checkpoint}" for name, checkpoint in checkpoints.items())
        raise UserError(f"{out_dir} holds files of different checkpoints ({of_which}): run them again")
    # token classes are read at allocate.json's threshold: the one there, not an earlier run's
    if found["token_classes.json"] is not None and found["allocate.json"] is not None:
        check_source(found["token_classes.json"], os.path.join(out_dir, "token_classes.json"),
                     os.path.join(out_dir, "allocate.json"), "allocate_sha256")
    return found


def log2_axis(ax):
    """A log2 x axis, its ticks (powers of two) labelled as plain numbers."""
    # loops double from one swept depth to the next: on a linear axis r=1..8, where the curves bend,
    # would take a quarter of a figure that runs to 32
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter("{x:g}")
    ax.xaxis.set_minor_formatter("")


def draw_loss_by_depth(plt, evaluated, allocated):
    """The loss at each depth from noise (eval.json's sweep) and from a zero state (allocate.json's
    A0), either of them None if its file is missing; the training mean dashed."""
    fig, ax = plt.subplots(figsize=(6, 4), layout="constrained")
    if evaluated is not None:
        depths = [row["loops"] for row in evaluated["rows"]]
        losses = [row["loss"] for row in evaluated["rows"]]
        ax.plot(depths, losses, marker="o", label="from noise, as in training (eval.json)")
        mean = evaluated["mean_loops"]
    if allocated is not None:
        depths = allocated["settings"]["uniform"]
        # (depths, windows) -> (depths,)
        losses = np.mean(allocated["per_window"]["uniform"]["loss"], axis=1)
        ax.plot(depths, losses, marker=".", label="from a zero state, as the exits start (allocate.json)")
        mean = allocated["mean_loops"]
    ax.axvline(mean, color="gray", linestyle="--", label=f"training mean ({mean})")
    log2_axis(ax)
    ax.set_xlabel("loops at evaluation")
    ax.set_ylabel("validation loss (nats per token)")
    ax.set_title("Loss by depth")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def draw_convergence(plt, evaluated):
    """Left: the mean successive KL, and the mean state change on an axis of its own, log scale.
    Right: the share of tokens still moving (KL > MOVING_KL). The training mean dashed on both."""
    # from loop 2: loop 1 has nothing to compare with
    rows = [row for row in evaluated["rows"] if row["loops"] >= 2]
    loops = [row["loops"] for row in rows]
    mean = evaluated["mean_loops"]
    fig, (ax_kl, ax_moving) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    kl = [row["mean_kl"] for row in rows]
    ax_kl.plot(loops, kl, marker="o", color="C0", label="mean KL(p_i || p_i-1)")
    ax_kl.axhline(MOVING_KL, color="C0", linestyle=":", label=f"moving above {MOVING_KL:g}")
    ax_kl.set_yscale("log")
    ax_kl.set_ylabel("mean successive KL (nats)", color="C0")
    # The state change is in the state's units, not nats: on an axis of its own, to show that the two
    # decay together (the state reaches a fixed point; the loop does not merely stop changing the output).
    ax_state = ax_kl.twinx()
    state_change = [row["mean_state_change"] for row in rows]
    ax_state.plot(loops, state_change, marker=".", color="C1", label="mean ||s_i - s_i-1||")
    ax_state.set_yscale("log")
    ax_state.set_ylabel("mean state change", color="C1")
    kl_lines, kl_labels = ax_kl.get_legend_handles_labels()
    state_lines, state_labels = ax_state.get_legend_handles_labels()
    ax_kl.legend(kl_lines + state_lines, kl_labels + state_labels)  # one legend for the two axes
    ax_kl.set_title("Successive KL and state change")
    ax_moving.plot(loops, [row["percent_moving"] for row in rows], marker="o")
    ax_moving.set_ylim(0, 100)
    ax_moving.set_ylabel(f"% of tokens still moving (KL > {MOVING_KL:g})")
    median = evaluated["median_convergence_depth"]
    ax_moving.set_title(f"Still moving (the median token settles after loop {median:g})")
    for ax in (ax_kl, ax_moving):
        ax.axvline(mean, color="gray", linestyle="--")
        ax.set_xlabel("loop")
        ax.grid(alpha=0.3)
    return fig


def policy_curve(allocated, policy, cost):
    """A policy's points, sorted by cost -> (costs, losses): each point's means over the windows."""
    # (points, windows) -> (points,)
    costs = np.mean(allocated["per_window"][policy][cost], axis=1)
    losses = np.mean(allocated["per_window"][policy]["loss"], axis=1)
    order = np.argsort(costs)
    return costs[order], losses[order]


def draw_allocation(plt, allocated):
    """Every policy's loss against its mean loops (left) and its FLOPs per token (right); the bar dotted."""
    # uniform depth, then each exit; the paper's labels (A0, A1, ...) beside their names
    labels = allocated["labels"]
    mean = allocated["mean_loops"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True, layout="constrained")
    lowest = allocated["bar"]
    for ax, cost, scale, unit in ((axes[0], "loops", 1, "mean loops per token"),
                                  (axes[1], "flops", 1e6, "forward MFLOP per token")):
        for policy in allocated["per_window"]:
            costs, losses = policy_curve(allocated, policy, cost)
            lowest = min(lowest, losses.min())
            if policy == "uniform":
                ax.plot(costs / scale, losses, marker="o", label="uniform depth (A0)")
            else:
                label = f"{policy} exit ({labels[policy]})" if labels.get(policy) else f"{policy} exit"
                ax.plot(costs / scale, losses, marker=".", label=label)
        ax.axhline(allocated["bar"], color="black", linestyle=":", label=f"the bar: uniform r={mean}")
        log2_axis(ax)
        ax.set_xlabel(unit)
        ax.grid(alpha=0.3)
    # r=1's loss sits far above the rest: the axis tops at r=2's, so that the gaps near the bar show
    top = np.mean(allocated["per_window"]["uniform"]["loss"][1])
    margin = 0.05 * (top - lowest)
    axes[0].set_ylim(lowest - margin, top + margin)
    axes[0].set_ylabel("validation loss (nats per token, zero state)")
    axes[0].set_title("Loss against mean loops")
    axes[1].set_title("Loss against FLOPs per token")
    axes[0].legend()
    return fig


def draw_token_classes(plt, classes):
    """A bar per token class: its mean exit depth, and its count; the mean over all tokens dashed."""
    rows = [row for row in classes["rows"] if row["class"] != "all" and "mean_exit_depth" in row]
    every = classes["rows"][-1]  # studies/token_classes.py's last row is "all"
    fig, ax = plt.subplots(figsize=(6, 4), layout="constrained")
    bars = ax.bar([row["class"] for row in rows], [row["mean_exit_depth"] for row in rows])
    ax.bar_label(bars, labels=[f"{row['mean_exit_depth']:.2f} (n={row['count']})" for row in rows])
    all_tokens = every["mean_exit_depth"]
    ax.axhline(all_tokens, color="gray", linestyle="--", label=f"all tokens: {all_tokens:.2f}")
    ax.margins(y=0.12)  # room above the tallest bar for its label
    ax.set_ylabel("mean exit depth (loops)")
    ax.set_title(f"A1's exit depth by token class (KL threshold {classes['threshold']:.3g})")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="lower right")
    return fig


def main(argv=()):
    C, _ = configure(globals(), argv)
    plt = pyplot()  # first: without matplotlib there is nothing to draw
    found = read_inputs(C.out_dir)
    missing = [name for name, read in found.items() if read is None]
    if missing:
        print(f"not in {C.out_dir}: {', '.join(missing)}; the figures drawn from them are left out")
    evaluated = found["eval.json"]
    allocated = found["allocate.json"]
    figures = {}
    if evaluated is not None or allocated is not None:
        figures["loss_by_depth"] = draw_loss_by_depth(plt, evaluated, allocated)
    if evaluated is not None:
        figures["convergence"] = draw_convergence(plt, evaluated)
    if allocated is not None:
        figures["allocation"] = draw_allocation(plt, allocated)
    if found["token_classes.json"] is not None:
        figures["token_classes"] = draw_token_classes(plt, found["token_classes.json"])
    run_name = os.path.basename(os.path.normpath(C.out_dir))
    checkpoint = next(read["checkpoint"] for read in found.values() if read is not None)
    os.makedirs(C.figures_dir, exist_ok=True)
    paths = []
    for name, fig in figures.items():
        # a name is no formula: matplotlib would read "$x^$" as one
        fig.suptitle(f"{run_name} ({checkpoint})", fontsize=9, x=0.99, ha="right", parse_math=False)
        path = os.path.join(C.figures_dir, f"{run_name}_{name}.png")
        save_figure(fig, path)
        plt.close(fig)  # pyplot holds every figure it made until closed
        print(f"wrote {path}")
        paths.append(path)
    return paths


if __name__ == "__main__":
    run(main)
