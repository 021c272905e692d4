#!/usr/bin/env bash
# The laptop study, end to end on CPU, in one command: train the CPU default (randomized depth;
# train.py prepares Shakespeare itself the first time), its fixed-depth control, the study model
# (config/study.py: the default trained 2.5x longer) and its dense twin (config/study_dense.py);
# evaluate them, run the allocation study on the default and the study model, compare the study
# model's training FLOP rate with its twin's (parity), time generation with sample.py, and print the
# paper's three-point bracket for A1 (its FLOP proxy, best-case and realized speedups).
#   ./study.sh                              (on 2 idle cores: see BENCHMARKS.md for its time)
#   ./study.sh out-mine config/mine.py      another first run: its out_dir, then train.py arguments
# A run whose out_dir already holds a checkpoint is kept, not retrained. Wall-clock per step:
# <run>_times.txt, with the parity line.
set -euo pipefail
step() {  # step COMMAND...: run it, and append its wall-clock seconds to $times
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
[[ "${BASH_SOURCE[0]}" != "$0" ]] && return  # sourced (saturation.sh): the two functions only
cd "$(dirname "$0")"
out=${1:-out-shakespeare}
shift || true
times="${out}_times.txt"
: > "$times"
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
# The paper's three-point bracket for A1: its loops at the bar against uniform mean_loops (the FLOP
# proxy); uniform round(A1's loops) against uniform mean_loops (the best case a perfect packing of the
# exited tokens could reach); sample.py's KL exit at A1's operating threshold against uniform mean_loops
# (realized), in greedy generation at batch 1 and 8.
read -r mean a1 threshold < <(python -c "
import json
a = json.load(open('$out/allocate.json'))
print(a['mean_loops'], a['at_bar']['A1']['loops']['value'], a['token_classes']['threshold'])")
rate() {  # rate ARGS...: sample.py's tokens/s, from its report on stderr (the text itself is dropped)
    local report
    report=$(python sample.py --out_dir="$out" --temperature=0 --max_new_tokens=128 "$@" 2>&1 >/dev/null) ||
        { echo "$report" >&2; exit 1; }
    echo "$report" | grep -o '^[0-9.]* tokens/s' | cut -d' ' -f1
}
if [ "$a1" = None ]; then
    echo "A1 never reaches the bar: no bracket" | tee -a "$times"
    exit 0
fi
for batch in 1 8; do
    uniform=$(rate --num_samples=$batch --loops="$mean")
    matched=$(rate --num_samples=$batch --loops="$(python -c "print(round($a1))")")
    realized=$(rate --num_samples=$batch --exit=kl --exit_threshold="$threshold")
    python -c "print(f'bracket, batch $batch: A1 reaches the bar at {$a1:.2f} loops, {1 - $a1 / $mean:.0%} fewer than r=$mean; '
                     f'best case {$matched / $uniform:.2f}x; realized {$realized / $uniform:.2f}x')" | tee -a "$times"
done
