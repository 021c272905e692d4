#!/usr/bin/env bash
# The laptop study, end to end on CPU, in one command: train the CPU default (randomized depth;
# train.py prepares Shakespeare itself the first time) and its fixed-depth control, evaluate both,
# run the allocation study, time the exits against uniform depth (scoring and generation), and
# collect the figures as figures/<run>_*.png, so two studies never overwrite each other's.
#   ./study.sh                              out-shakespeare and out-shakespeare-fixed (~50 min on 2 cores)
#   ./study.sh out-mine config/mine.py      another run: its out_dir, then any train.py arguments
# A run whose out_dir already holds a checkpoint is kept, not retrained. Wall-clock per step:
# <run>_times.txt.
set -euo pipefail
cd "$(dirname "$0")"
out=${1:-out-shakespeare}
shift || true
times="${out}_times.txt"
: > "$times"
step() {
    local t0=$SECONDS
    echo "+ $*"
    "$@"
    echo "$(( SECONDS - t0 ))s  $*" | tee -a "$times"
}
train() {  # train OUT_DIR ARGS...: skipped when OUT_DIR/ckpt.pt exists
    if [ -f "$1/ckpt.pt" ]; then
        echo "$1/ckpt.pt exists: kept (remove it, or train with --overwrite_checkpoint=True, to retrain)"
    else
        step python train.py "${@:2}" --out_dir="$1"
    fi
}
train "$out" "$@"
train "$out-fixed" "$@" --loop_dist=fixed
loops=1,2,3,4,6,8,12,16,32
step python evaluate.py --out_dir="$out-fixed" --loops=$loops
step python evaluate.py --out_dir="$out" --loops=$loops --plot --versus="$out-fixed"
step python allocate.py --out_dir="$out" --plot
step python bench.py --out_dir="$out" --frontier=scoring
step python bench.py --out_dir="$out" --frontier=generation
mkdir -p figures
name=$(basename "$out")
for figure in "$out"/*.png; do
    cp "$figure" "figures/${name}_$(basename "$figure")"
done
