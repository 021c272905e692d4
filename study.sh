#!/usr/bin/env bash
# The laptop study, end to end on CPU, in one command: train the CPU default (randomized depth;
# train.py prepares Shakespeare itself the first time), its fixed-depth control, the study model
# (config/study.py: the default trained 2.5x longer) and its dense twin (config/study_dense.py);
# evaluate them, run the allocation study on the default and the study model, compare the study
# model's training FLOP rate with its twin's (parity), and time generation with sample.py.
#   ./study.sh                              (on 2 idle cores: see BENCHMARKS.md for its time)
#   ./study.sh out-mine config/mine.py      another first run: its out_dir, then train.py arguments
# A run whose out_dir already holds a checkpoint is kept, not retrained. Wall-clock per step:
# <run>_times.txt, with the parity line.
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
step python evaluate.py --out_dir="$out-fixed" --loops=$loops   # the control: compare its eval.json
step python evaluate.py --out_dir="$out" --loops=$loops
step python evaluate.py --out_dir=out-study --loops=$loops
step python evaluate.py --out_dir=out-study_dense --loops=1
step python allocate.py --out_dir="$out"
step python allocate.py --out_dir=out-study
# parity: the median FLOP/s train.py logged for each step (metrics.jsonl), recurrent over dense
python -c "
import json, statistics
def rate(run):
    return statistics.median(json.loads(line)['flops_per_s'] for line in open(run + '/metrics.jsonl') if 'flops_per_s' in line)
print(f'parity: recurrent / dense training FLOP/s = {rate(\"out-study\") / rate(\"out-study_dense\"):.3f}')" | tee -a "$times"
# generation, greedy from a zero state: tokens/s, mean loops and FLOPs per token at each depth and exit
for r in 2 4 6 8; do
    step python sample.py --out_dir="$out" --loops=$r --num_samples=8 --temperature=0 --max_new_tokens=128
done
for threshold in 0.01 0.03 0.1; do
    step python sample.py --out_dir="$out" --exit=state --exit_threshold=$threshold --num_samples=8 \
        --temperature=0 --max_new_tokens=128
done
