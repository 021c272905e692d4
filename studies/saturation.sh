#!/usr/bin/env bash
# The saturation study (RESULTS.md, "The saturation study"): is the depth a model uses set by its training loop
# distribution? Trains the CPU default's shape, data, steps and tokens under six loop distributions
# (config/sat_*.py: training means 2, 4, 8, 16 at spread 0.5; spreads 0.25 and 1.0 at mean 8; the
# default itself is mean 8, spread 0.5), a second seed of the two ends of the range of means, and
# mean 16 for as many training FLOPs as mean 8's 400 steps (222 steps: fewer tokens). Evaluates each
# at loops 1 to max(16, 4 x its mean), measures its saturation depth (studies/saturation.py), then
# prints one table and draws figures/saturation.png (studies/saturation_table.py).
#   ./studies/saturation.sh    (on 2 idle cores; its last run, as ./saturation.sh on 2026-11-25: 79 minutes,
#                              RESULTS.md; the figure needs matplotlib)
# A run whose out_dir already holds a checkpoint is kept; every run's eval.json is written again
# (out-shakespeare's too, with this sweep). Each step's wall-clock: out-saturation_times.txt; the
# table: out-saturation.md.
set -euo pipefail
cd "$(dirname "$0")/.."
source studies/steps.sh
[ -f data/shakespeare/meta.json ] || python prepare.py  # the default corpus, prepared once
times=out-saturation_times.txt
: > "$times"
runs=""
measure() {  # measure OUT_DIR LOOPS TRAIN_ARGS...: train it (unless trained), evaluate at LOOPS, saturation
    train "$1" "${@:3}"
    step python evaluate.py --out_dir="$1" --loops="$2"
    step python -m studies.saturation --out_dir="$1"
    runs="$runs,$1"
}
to16=1,2,3,4,6,8,12,16  # max(16, 4 x mean): to 16 for means 2 and 4, to 32 for mean 8, to 64 for mean 16
measure out-sat-mean2 $to16 config/sat_mean2.py
measure out-sat-mean2-seed2 $to16 config/sat_mean2.py --seed=2
measure out-sat-mean4 $to16 config/sat_mean4.py
measure out-shakespeare $to16,24,32  # mean 8, spread 0.5: the CPU default
measure out-sat-spread025 $to16,24,32 config/sat_spread025.py
measure out-sat-spread1 $to16,24,32 config/sat_spread1.py
measure out-sat-mean16 $to16,24,32,64 config/sat_mean16.py
measure out-sat-mean16-seed2 $to16,24,32,64 config/sat_mean16.py --seed=2
measure out-sat-mean16-matched $to16,24,32,64 config/sat_mean16.py --max_iters=222  # mean 8's FLOPs
python -m studies.saturation_table --runs="${runs#,}" | tee out-saturation.md
