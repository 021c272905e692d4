#!/usr/bin/env bash
# The laptop study, end to end on CPU: prepare, train the randomized-depth model and its
# fixed-depth control, evaluate both, run the allocation study, and collect the figures.
# Each step's wall-clock goes to study_times.txt. About 45 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")"
: > study_times.txt
step() {
    local t0=$SECONDS
    echo "+ $*"
    "$@"
    echo "$(( SECONDS - t0 ))s  $*" | tee -a study_times.txt
}
step python prepare.py
step python train.py                               # randomized depth -> out-shakespeare
step python train.py config/shakespeare_fixed.py   # fixed depth      -> out-shakespeare-fixed
step python evaluate.py --out_dir=out-shakespeare --plot
step python evaluate.py --out_dir=out-shakespeare-fixed --loops=1,2,3,4,5,6,8,16
step python allocate.py --out_dir=out-shakespeare --plot --realized
python - <<'PY'
import json
rand, fixed = (json.load(open(f"{d}/eval.json")) for d in ("out-shakespeare", "out-shakespeare-fixed"))
loss = lambda ev: {row["loops"]: row["loss"] for row in ev["elasticity"]}
a, b = loss(rand), loss(fixed)
print("\n| loops r | randomized | fixed r=4 |\n|---|---|---|")
for r in sorted(set(a) | set(b)):
    print(f"| {r} | {a.get(r, float('nan')):.3f} | {b.get(r, float('nan')):.3f} |")
PY
mkdir -p figures
cp out-shakespeare/*.png figures/
