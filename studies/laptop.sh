#!/usr/bin/env bash
# The laptop study on CPU, in one command (RESULTS.md): prepare Shakespeare (once), train the CPU default,
# its fixed-depth control, the study model (config/study.py) and its
# dense twin (config/study_dense.py); evaluate them; allocate (with A2) on the default and the study model,
# with the exit depth by token class; time the default at batch 1 by depth; then studies/laptop.py
# (parity from the two runs' metrics.jsonl; generation speed and the three-point bracket, each timed by
# python -m engine --report) and the default's figures. allocate.py runs through studies.probe (A2 among
# the exits), then studies.matched writes the paper's matched-loops table.
#   ./studies/laptop.sh                            (on 2 idle cores; its last timed run, as ./study.sh on
#                                                   2026-11-25: 1 h 41 min, RESULTS.md)
#   ./studies/laptop.sh out-mine config/mine.py    another first run: its out_dir, then train.py's arguments
# A run whose out_dir already holds a checkpoint is kept. Each step's wall-clock: <run>_times.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
source studies/steps.sh
[ -f data/shakespeare/meta.json ] || python prepare.py  # the default corpus, prepared once
out=${1:-out-shakespeare}
shift || true
times="${out}_times.txt"
: > "$times"
train "$out" "$@"
train "$out-fixed" "$@" --loop_dist=fixed
train out-study config/study.py
train out-study_dense config/study_dense.py
for run in "$out-fixed" "$out" out-study; do  # the fixed-depth control first: compare its eval.json
    step python evaluate.py --out_dir="$run" --loops=1,2,3,4,6,8,12,16,32
done
step python evaluate.py --out_dir=out-study_dense --loops=1
for run in "$out" out-study; do
    # allocate.py's run with A2's probe among the exits, then the paper's matched-loops table
    step python -m studies.probe --out_dir="$run"
    step python -m studies.matched --out_dir="$run"
    step python -m studies.token_classes --out_dir="$run"
done
step python -m studies.timing --out_dir="$out"
step python -m studies.laptop --out_dir="$out"
# the figures need matplotlib (studies/requirements.txt): without it, one line says so and the study is done
python -m studies.figures --out_dir="$out" || true
