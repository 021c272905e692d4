"""The saturation study's table and figure (RESULTS.md, "The saturation study"): does a model use depth up to its
training mean and no further? Each run's training loop distribution and FLOPs beside the depth it uses.

For each run: its training FLOPs, counted step by step from the depths train.py drew (its
checkpoint's settings); its saturation depth and useful range (saturation.json, which
studies/saturation.py writes); its loss there and its best; its convergence (eval.json). Prints one
markdown table and draws the runs' loss curves on one figure.

    ./studies/saturation.sh    # trains, evaluates and measures each run, then this
    python -m studies.saturation_table --runs=out-sat-mean2,out-shakespeare    # figures/saturation.png
"""
import json
import math
import os
import sys

from configurator import UserError, configure, run
from evaluate import markdown, show
from model import checkpoint_id, load_checkpoint, sample_loops
from studies.figures import log2_axis, pyplot
from studies.outputs import check_source, save_figure

runs = "out-shakespeare"  # the runs' out_dirs, comma-separated (each: ckpt.pt, eval.json, saturation.json)
figure = "figures/saturation.png"  # the runs' validation loss against loops
HEADERS = ["run", "mean", "spread", "seed", "steps", "train PFLOP", "saturation depth [95%]",
           "useful range, nats [95%]", "loss at it", "best loss", "median convergence", "% moving at mean"]


def training_flops(model, ckpt):
    """A checkpoint's training FLOPs: over the steps it took, each step's FLOPs per token at the depth
    model.sample_loops drew for it, times the tokens a step reads."""
    # The same draws as train.py's, from (seed, step) alone: the FLOPs a distribution spent, not its
    # mean's, which a long tail (spread 1.0) would understate.
    settings = ckpt["config"]
    config = model.config
    tokens_per_step = settings["batch_size"] * config.block_size * settings["gradient_accumulation_steps"]
    flops = 0
    for step in range(ckpt["iter_num"]):
        loops = sample_loops(config, step, settings["seed"])
        n_grad = min(loops, config.bptt_k)
        flops += model.flops_per_token(loops, n_grad, config.block_size) * tokens_per_step
    return flops


def read_run(out_dir):
    """-> (the model, the checkpoint dict, eval.json, saturation.json) of one run; UserError if one
    is missing or if they are not of one checkpoint."""
    model, ckpt = load_checkpoint(os.path.join(out_dir, "ckpt.pt"))
    found = {}
    for name, writer in (("eval.json", "python evaluate.py"), ("saturation.json", "python -m studies.saturation")):
        path = os.path.join(out_dir, name)
        if not os.path.isfile(path):
            raise UserError(f"no {path}: run `{writer} --out_dir={out_dir}` first")
        with open(path) as f:
            found[name] = json.load(f)
        if found[name]["checkpoint"] != checkpoint_id(ckpt):
            raise UserError(f"{path} is of {found[name]['checkpoint']}, not of ckpt.pt ({checkpoint_id(ckpt)})")
    # evaluated again since: its depths and losses are not the ones the saturation depth was read off
    check_source(found["saturation.json"], os.path.join(out_dir, "saturation.json"),
                 os.path.join(out_dir, "eval.json"), "eval_sha256")
    return model, ckpt, found["eval.json"], found["saturation.json"]


def table_row(out_dir, model, ckpt, evaluated, saturated):
    """One run's cells, as HEADERS name them."""
    settings = ckpt["config"]
    loss_at = {row["loops"]: row["loss"] for row in evaluated["rows"]}
    depth = saturated["depth"]["value"]  # a swept depth, read from this eval.json
    mean = model.config.mean_loops
    # none at mean 1: loop 1 has no KL, nothing to call moving
    moving = {row["loops"]: row.get("percent_moving", math.nan) for row in evaluated["rows"]}
    moving_at_mean = moving.get(mean, math.nan)
    return [out_dir, model.config.mean_loops, model.config.loop_spread, settings["seed"], ckpt["iter_num"],
            f"{training_flops(model, ckpt) / 1e15:.3f}", show(saturated["depth"], "g"),
            show(saturated["useful_range"], ".4f"), f"{loss_at[int(depth)]:.4f}",
            f"{min(loss_at.values()):.4f}", f"{evaluated['median_convergence_depth']:g}",
            f"{moving_at_mean:.1f}"]


def draw_curves(plt, curves):
    """curves {run: (depths, losses)}: each run's validation loss against loops, on one figure."""
    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    for name, (depths, losses) in curves.items():
        ax.plot(depths, losses, marker="o", label=name)
    log2_axis(ax)
    ax.set_xlabel("loops at evaluation")
    ax.set_ylabel("validation loss, nats per token (noise init)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def main(argv=()):
    C, _ = configure(globals(), argv)
    rows = []
    curves = {}
    for out_dir in C.runs.split(","):
        model, ckpt, evaluated, saturated = read_run(out_dir)
        rows.append(table_row(out_dir, model, ckpt, evaluated, saturated))
        depths = [row["loops"] for row in evaluated["rows"]]
        curves[out_dir] = (depths, [row["loss"] for row in evaluated["rows"]])
    print(markdown(HEADERS, rows))
    # the table is the study's result, and needs nothing beyond the core; the figure needs matplotlib
    try:
        plt = pyplot()
    except UserError as err:
        print(f"{err}: {C.figure} not drawn", file=sys.stderr)
        return rows
    fig = draw_curves(plt, curves)
    save_figure(fig, C.figure)
    plt.close(fig)
    print(f"wrote {C.figure}")
    return rows


if __name__ == "__main__":
    run(main)
