"""The paper's allocation table: each exit's loss minus uniform depth's at matched average loops.

Read off allocate.json's curves (every point of every policy, window by window), at average depths
of 3/8 to 7/8 of mean_loops, each difference with its paired bootstrap 95% interval over the
windows (an interval holding 0 is no difference).

    python allocate.py --out_dir=out-shakespeare
    python -m studies.matched --out_dir=out-shakespeare    # writes out_dir/matched.json
"""
import os

import numpy as np

from allocate import curve, read_allocation
from configurator import configure, run
from evaluate import markdown, paired_bootstrap, show
from model import load_checkpoint, save_atomic

out_dir = "out-shakespeare"  # reads ckpt.pt and allocate.json, writes matched.json
bootstrap = 1000  # resamples of the windows for each interval
seed = 1337  # picks the resamples
RULES = {"bootstrap": (10, 10 ** 6), "seed": (0, 2 ** 32 - 1)}
# the table's rows, in units of mean_loops
TABLE_ROWS = [f / 8 for f in range(3, 8)]


def interp_loss(points, cost):
    """The loss at an average cost along (cost, loss) points; None outside them."""
    costs, losses = zip(*sorted(points))
    if not costs[0] <= cost <= costs[-1]:
        return None
    return float(np.interp(cost, costs, losses))


def loss_delta(per_window, policy, at):
    """The policy's loss minus uniform depth's at a matched average depth `at` (loops)."""
    uniform = interp_loss(curve(per_window, "uniform", "loops"), at)
    other = interp_loss(curve(per_window, policy, "loops"), at)
    if uniform is None or other is None:
        return None
    return other - uniform


def matched_table(per_window, mean, n_resamples, seed):
    """per_window {(policy, measure): (points, windows)} -> a row per average depth: uniform depth's
    loss there and each exit's difference from it, with its interval."""
    exits = dict.fromkeys(policy for policy, _ in per_window if policy != "uniform")
    rows = []
    for depth in (mean * fraction for fraction in TABLE_ROWS):
        row = {"loops": depth, "uniform": interp_loss(curve(per_window, "uniform", "loops"), depth)}
        for policy in exits:
            def delta(resampled, policy=policy, depth=depth):
                return loss_delta(resampled, policy, depth)
            row[policy] = paired_bootstrap(delta, per_window, n_resamples, seed)
        rows.append(row)
    return rows


def main(argv=()):
    C, _ = configure(globals(), argv)
    _, ckpt = load_checkpoint(os.path.join(C.out_dir, "ckpt.pt"))
    allocated = read_allocation(C.out_dir, ckpt)
    per_window = {}
    for policy, measures in allocated["per_window"].items():
        for measure, values in measures.items():
            per_window[policy, measure] = np.asarray(values)
    rows = matched_table(per_window, allocated["mean_loops"], C.bootstrap, C.seed)
    exits = [policy for policy in rows[0] if policy not in ("loops", "uniform")]
    labels = allocated["labels"]
    headers = ["avg loops", "uniform (A0) loss"]
    headers += [f"{p} ({labels[p] or p}) - uniform" for p in exits]
    cells = []
    for row in rows:
        # no uniform depth below 1 loop
        uniform = "-" if row["uniform"] is None else f"{row['uniform']:.4f}"
        cells.append([f"{row['loops']:.3g}", uniform] + [show(row[p]) for p in exits])
    print(f"## Loss at matched average loops: {allocated['checkpoint']}, "
          f"{allocated['windows']} windows\n")
    print(markdown(headers, cells))
    result = {"checkpoint": allocated["checkpoint"], "rows": rows}
    save_atomic(os.path.join(C.out_dir, "matched.json"), result)
    return result


if __name__ == "__main__":
    run(main)
