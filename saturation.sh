#!/usr/bin/env bash
# Issue 31: is the depth a model uses set by its training loop distribution? The paper's hypothesis:
# "a recursive model uses depth up to its training mean and no further". Trains the CPU default's
# shape, data, steps and tokens under six loop distributions (training means 2, 4, 8, 16 at spread 0.5;
# spreads 0.25 and 1.0 at mean 8; config/sat_*.py, the default itself being mean 8, spread 0.5), a second
# seed of the two ends of the range of means, and mean 16 for as many training FLOPs as mean 8 (222 steps
# instead of 400: fewer tokens), evaluates each at loops 1 to max(16, 4 x mean), and prints one table
# (saturation depth as evaluate.py defines it, with intervals) and figures/saturation.png.
#   ./saturation.sh          (on 2 idle cores: see BENCHMARKS.md for its time; needs matplotlib for the figure)
# A run whose out_dir already holds a checkpoint is kept, not retrained; every run's eval.json is
# written again (out-shakespeare's too, with this sweep).
set -euo pipefail
cd "$(dirname "$0")"
source ./study.sh  # its step and train
times=out-saturation_times.txt
: > "$times"
train out-sat-mean2 config/sat_mean2.py
train out-sat-mean4 config/sat_mean4.py
train out-shakespeare  # mean 8, spread 0.5
train out-sat-spread025 config/sat_spread025.py
train out-sat-spread1 config/sat_spread1.py
train out-sat-mean16 config/sat_mean16.py
train out-sat-mean2-seed2 config/sat_mean2.py --seed=2
train out-sat-mean16-seed2 config/sat_mean16.py --seed=2
train out-sat-mean16-matched config/sat_mean16.py --max_iters=222  # the FLOPs of mean 8's 400 steps
runs="out-sat-mean2 out-sat-mean2-seed2 out-sat-mean4 out-shakespeare out-sat-spread025 out-sat-spread1
      out-sat-mean16 out-sat-mean16-seed2 out-sat-mean16-matched"
for run in $runs; do
    mean=$(python -c "import torch; print(torch.load('$run/ckpt.pt', weights_only=True)['model_args']['mean_loops'])")
    loops=$(python -c "print(','.join(str(r) for r in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64) if r <= max(16, 4 * $mean)))")
    step python evaluate.py --out_dir="$run" --loops="$loops"
done
# the table: each run's training distribution and FLOPs beside what evaluate.py measured
python - $runs <<'PY' | tee out-saturation.md
import json, sys
from math import nan
import torch
from evaluate import markdown
from model import GPT, GPTConfig
from train import sample_loops
rows, curves = [], {}
for run in sys.argv[1:]:
    ckpt = torch.load(f"{run}/ckpt.pt", weights_only=True)
    c, model_args = ckpt["config"], ckpt["model_args"]
    model = GPT(GPTConfig(**model_args))
    tokens = c["batch_size"] * c["block_size"] * c["gradient_accumulation_steps"]
    flops = 0  # the run's training FLOPs, step by step, from the same depth draws as train.py's
    for step in range(c["max_iters"]):
        loops = sample_loops(step, c["seed"], c["mean_loops"], c["max_loops"], c["loop_dist"], c["loop_spread"])
        flops += model.flops_per_token(loops, min(loops, c["bptt_k"]), c["block_size"]) * tokens
    ev = json.load(open(f"{run}/eval.json"))
    sat, cv = ev["saturation"], ev["convergence"]
    loss = {row["loops"]: row["loss"] for row in ev["elasticity"]}
    curves[run] = loss
    interval = "[{:g}, {:g}]".format(*sat["depth"]["interval"])
    gain = "{:.4f} [{:.4f}, {:.4f}]".format(sat["useful_range"]["value"], *sat["useful_range"]["interval"])
    rows.append([run, c["mean_loops"], c["loop_spread"], c["seed"], c["max_iters"], f"{flops / 1e15:.3f}",
                 f"{sat['depth']['value']:g} {interval}", gain, f"{loss[int(sat['depth']['value'])]:.4f}",
                 f"{min(loss.values()):.4f}", f"{cv['median_depth']:g}", f"{cv.get('percent_moving_at_mean', nan):.1f}"])
print(markdown(["run", "mean", "spread", "seed", "steps", "train PFLOP", "saturation depth [95%]", "useful range, nats [95%]",
                "loss at it", "best loss", "median convergence", "% moving at mean"], rows))
try:
    import matplotlib.pyplot as plt
except ImportError:
    print("no matplotlib: no figure", file=sys.stderr)
    sys.exit(0)
for run, loss in curves.items():
    plt.plot(list(loss), list(loss.values()), marker="o", label=run)
plt.xscale("log", base=2)
plt.xlabel("loops at evaluation")
plt.ylabel("validation loss, nats/token (noise init)")
plt.legend(fontsize=7)
plt.savefig("figures/saturation.png", dpi=120, bbox_inches="tight")
print("wrote figures/saturation.png")
PY
