#!/usr/bin/env bash
# The laptop study, end to end on CPU, in one command: train the CPU default (randomized depth;
# train.py prepares Shakespeare itself the first time), its fixed-depth control, the study model
# (config/study.py: the default trained 2.5x longer) and its dense twin (config/study_dense.py);
# evaluate them, run the allocation study on the default and the study model, time the exits
# against uniform depth (scoring and generation) and training against the dense twin, and
# collect the figures as figures/<run>_*.png, so two studies never overwrite each other's.
#   ./study.sh                              (1 h 41 min on 2 idle cores, 2026-11-25: 69 min of it training)
#   ./study.sh out-mine config/mine.py      another first run: its out_dir, then train.py arguments
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
train out-study config/study.py
train out-study_dense config/study_dense.py
loops=1,2,3,4,6,8,12,16,32
step python evaluate.py --out_dir="$out-fixed" --loops=$loops
step python evaluate.py --out_dir="$out" --loops=$loops --plot --versus="$out-fixed"
step python evaluate.py --out_dir=out-study --loops=$loops --plot
step python evaluate.py --out_dir=out-study_dense --loops=1
step python allocate.py --out_dir="$out" --plot
step python allocate.py --out_dir=out-study --plot
step python bench.py  # training: the recurrent model against its dense twin (FLOP/s)
step python bench.py --out_dir="$out" --frontier=scoring
step python bench.py --out_dir="$out" --frontier=generation
mkdir -p figures
for run in "$out" out-study; do
    for figure in "$run"/*.png; do
        cp "$figure" "figures/$(basename "$run")_$(basename "$figure")"
    done
done
