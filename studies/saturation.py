"""Does a model use depth up to its training mean and no further? The saturation depth of one checkpoint.

Its definition, fixed before the saturation study's runs: the saturation depth is the smallest swept depth r
whose validation loss is within SATURATION_TOL nats of the best swept depth's over r <= 4 x mean_loops; the
useful range is loss(r=1) - loss(saturation depth). Each comes with its 95% interval over paired bootstrap
resamples of the evaluation windows. Read off evaluate.py's eval.json (each window's loss at each swept r).

    python evaluate.py --out_dir=out-shakespeare --loops=1,2,3,4,6,8,12,16,32
    python -m studies.saturation --out_dir=out-shakespeare     # writes out_dir/saturation.json
"""
import json
import os

import numpy as np

from configurator import UserError, configure, run
from evaluate import paired_bootstrap, show
from model import save_atomic
from prepare import sha256_of

out_dir = "out-shakespeare"  # reads eval.json, writes saturation.json
SATURATION_TOL = 0.002  # nats: the smallest loss gap the paper reports as an effect


def saturation(window_losses, swept, mean):
    """window_losses (len(swept), windows): each window's mean loss at each swept depth -> the saturation depth
    and the useful range, {"depth": estimate, "useful_range": estimate}, each with its 95% interval."""
    # Past its best depth a curve is flat and noise picks the minimum: the tolerance keeps that noise out
    # of the depth, and the interval says how far the windows move it (between swept depths: interpolated).
    depths = [r for r in swept if r <= 4 * mean]  # swept is sorted and always holds 1
    per_window = {"loss": np.asarray(window_losses)[:len(depths)]}

    def first_within_tolerance(resampled):
        loss = resampled["loss"].mean(1)
        within = np.flatnonzero(loss <= loss.min() + SATURATION_TOL)
        return within[0]

    def useful_range(resampled):
        loss = resampled["loss"].mean(1)
        return loss[0] - loss[first_within_tolerance(resampled)]

    def depth(resampled):
        return depths[first_within_tolerance(resampled)]
    return {"depth": paired_bootstrap(depth, per_window, 1000, 0),
            "useful_range": paired_bootstrap(useful_range, per_window, 1000, 0)}


def main(argv=()):
    C, _ = configure(globals(), argv)
    path = os.path.join(C.out_dir, "eval.json")
    if not os.path.isfile(path):
        raise UserError(f"no {path}: run `python evaluate.py --out_dir={C.out_dir}` first")
    with open(path) as f:
        evaluated = json.load(f)
    if "rows" not in evaluated:
        raise UserError(f"{path} is from an older evaluate.py: run it again")
    rows = evaluated["rows"]
    swept = [row["loops"] for row in rows]
    mean = evaluated["mean_loops"]
    result = saturation([row["window_losses"] for row in rows], swept, mean)
    result |= {"checkpoint": evaluated["checkpoint"], "mean_loops": mean, "swept": swept, "tolerance": SATURATION_TOL,
               "eval_sha256": sha256_of(path)}
    print(f"saturation depth {show(result['depth'], 'g')} (95% interval): the first swept r within {SATURATION_TOL} "
          f"nats of the best r <= {4 * mean}; useful range {show(result['useful_range'], '.4f')} nats, gained from r=1")
    save_atomic(os.path.join(C.out_dir, "saturation.json"), result)
    return result


if __name__ == "__main__":
    run(main)
