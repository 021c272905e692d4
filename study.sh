#!/usr/bin/env bash
# The laptop study, end to end on CPU: prepare, train the randomized-depth model and its
# fixed-depth control, evaluate both, run the allocation study, and collect the figures.
# Each step's wall-clock goes to study_times.txt.
#   ./study.sh        the 25-minute runs (config/shakespeare_long*.py), ~75 minutes in all on 2 cores
#   ./study.sh short  the 10-minute CPU default and its control, ~45 minutes in all
set -euo pipefail
cd "$(dirname "$0")"
: > study_times.txt
step() {
    local t0=$SECONDS
    echo "+ $*"
    "$@"
    echo "$(( SECONDS - t0 ))s  $*" | tee -a study_times.txt
}
if [ "${1:-long}" = short ]; then
    rand=(); fixed=config/shakespeare_fixed.py; out=out-shakespeare
else
    rand=(config/shakespeare_long.py); fixed=config/shakespeare_long_fixed.py; out=out-shakespeare-long
fi
step python prepare.py
step python train.py "${rand[@]}"      # randomized depth -> $out
step python train.py "$fixed"          # fixed depth      -> $out-fixed
step python evaluate.py --out_dir="$out" --plot
step python evaluate.py --out_dir="$out-fixed" --loops=1,2,3,4,5,6,8,16
step python allocate.py --out_dir="$out" --plot --realized
mkdir -p figures
OUT="$out" python - <<'PY'
import json, os
rand, fixed = (json.load(open(f"{os.environ['OUT']}{suffix}/eval.json")) for suffix in ("", "-fixed"))
loss = lambda ev: {row["loops"]: row["loss"] for row in ev["elasticity"]}
a, b = loss(rand), loss(fixed)
print("\n| loops r | randomized | fixed r=4 |\n|---|---|---|")
for r in sorted(set(a) | set(b)):
    print(f"| {r} | {a.get(r, float('nan')):.3f} | {b.get(r, float('nan')):.3f} |")
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
fig, ax = plt.subplots(figsize=(5.5, 4.2))
for curve, label in ((a, "randomized depth (LogNormal, mean 4)"), (b, "fixed depth r=4 (control)")):
    ax.plot(sorted(curve), [curve[r] for r in sorted(curve)], "o-", label=label)
ax.set_xscale("log", base=2)
ax.set_xticks(sorted(b), [str(r) for r in sorted(b)])
ax.set(xlabel="inference loops r", ylabel="validation loss (nats)", title="Randomized vs fixed-depth training")
ax.grid(alpha=0.3)
ax.legend(loc="upper right")
fig.tight_layout()
fig.savefig("figures/elasticity_vs_fixed.png", dpi=120)
PY
cp "$out"/*.png figures/
