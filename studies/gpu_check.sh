#!/usr/bin/env bash
# The numbers a GPU run reports, on one GPU in about 7 minutes (the Python: studies/gpu_check.py):
#
#   ./studies/gpu_check.sh --dataset=shakespeare_smollm2
#
# 1) S0 (config/s0.py) trained for a few hundred steps: its checkpoint, and S0's training MFU and peak
#    memory at the paper's micro-batch (32); then a few steps of S0 at 16 and of S1 (config/s1.py) at 4
#    and at 16. MFU is flops_per_s in metrics.jsonl (the median over the steps after the first two,
#    which compile) over PEAK_FLOPS; the peak is torch.cuda.max_memory_allocated.
# 2) allocate.py on S0 (the exits' operating thresholds); S0's decode tokens/s at batch 1 and 32: uniform
#    r = 4, 8, 16, and the kl and state exits at those thresholds, all in one process (studies/gpu_check.py):
#    python -m engine's report (tokens/s, loops) and what torch.compile did (graphs, breaks, recompilations,
#    CUDA-graph skips), each row then timed again with sample.py's own generate in the same harness.
# 3) The launch counts (python -m studies.launches) and whether this torch has CUDA-graph conditional nodes.
# 4) The test suite's failures, if any, and its summary line.
# On a torch older than the pinned 2.13, studies/older_torch/ supplies 2.13's F.linear_cross_entropy (a line says so).
#
# The dataset: any data/NAME prepared with the SmolLM2 tokenizer, for example
#   python -m corpora --source=input.txt --tokenizer=smollm2 --name=shakespeare_smollm2   # any text file
#   python prepare.py --source=input.txt --tokenizer=PATH/tokenizer.json --name=...   # offline: a copy of SmolLM2's
# Everything it writes goes to a temporary directory (removed at the end; GPU_CHECK_KEEP=1 keeps it):
# checkpoints, logs, the compilers' caches, pytest's files. data/ is only read.
#
# Settings, from the environment:
#   PEAK_FLOPS=989e12   the card's dense bf16 peak (H100 and H200; A100 312e12, L40S 362e12, RTX 4090 165e12)
#   SAMPLE_FLAGS=...    more flags for every python -m engine run (sample.py's settings; --compile=False: eager)
#   GPU_CHECK_TINY=1    narrow models, a few steps, 16 new tokens: a dry run of this script on a CPU
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository: its scripts, config/ and data/

dataset=shakespeare_smollm2
for arg in "$@"; do
    case "$arg" in
        --dataset=*) dataset="${arg#--dataset=}" ;;
        *) echo "usage: ./studies/gpu_check.sh [--dataset=NAME]   (got '$arg')" >&2; exit 2 ;;
    esac
done
if [[ ! -f "data/$dataset/meta.json" ]]; then
    echo "error: no data/$dataset (prepare one with the SmolLM2 tokenizer: see the top of $0)" >&2
    exit 2
fi
if ! grep -q '"vocab_size": 49152,' "data/$dataset/meta.json"; then  # S0 and S1 take the dataset's vocabulary
    echo "error: data/$dataset was not prepared with the SmolLM2 tokenizer (vocab_size 49152)" >&2
    exit 2
fi
peak_flops="${PEAK_FLOPS:-989e12}"
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
# a torch older than the pinned 2.13 (a GPU image may hold 2.11) lacks the function training's loss calls
if ! python -c "import torch.nn.functional as F; F.linear_cross_entropy" 2> /dev/null; then
    echo "this torch predates 2.13: studies/older_torch/sitecustomize.py defines F.linear_cross_entropy"
    export PYTHONPATH="$PWD/studies/older_torch${PYTHONPATH:+:$PYTHONPATH}"
fi

# the paper's shapes and micro-batches; the tiny dry run keeps their structure at width 64 and 64 tokens
checkpoint_steps=300
short_steps=8
new_tokens=128
allocate_windows=64
narrow=()
if [[ "${GPU_CHECK_TINY:-0}" == 1 ]]; then
    checkpoint_steps=12
    short_steps=4
    new_tokens=16
    allocate_windows=16
    narrow=(--n_embd=64 --n_head=2 --n_kv_head=1 --ffn_hidden=128 --block_size=64)
fi

work="$(mktemp -d -t gpu_check.XXXXXX)"
if [[ "${GPU_CHECK_KEEP:-0}" == 1 ]]; then
    echo "keeping $work"
else
    trap 'rm -rf "$work"' EXIT
fi
# nothing outside $work: no .pyc in the repository, the compilers' caches here
export PYTHONDONTWRITEBYTECODE=1
export TORCHINDUCTOR_CACHE_DIR="$work/inductor" TRITON_CACHE_DIR="$work/triton" CUDA_CACHE_PATH="$work/cuda"
export TRITON_HOME="$work/triton" XDG_CACHE_HOME="$work/cache"
started=$SECONDS

measure_training() {  # label, then train.py's arguments: one line (studies/gpu_check.py), or the log's end
    local label=$1
    shift
    if ! python -m studies.gpu_check training "$label" "$peak_flops" "$@" > "$work/$label.log" 2>&1; then
        echo "$label: training failed; the end of its log:"
        tail -n 5 "$work/$label.log"
        return 1
    fi
    tail -n 1 "$work/$label.log"
}

echo "== training (dataset $dataset, peak $peak_flops FLOP/s)"
s0="$work/s0"
common=(--dataset="$dataset" --eval_iters=2 --log_interval=1 --overwrite_checkpoint=True "${narrow[@]}")
short=(--max_iters="$short_steps" --eval_interval=100000 --gradient_accumulation_steps=1)
measure_training "S0 b32" config/s0.py "${common[@]}" --out_dir="$s0" --batch_size=32 \
    --gradient_accumulation_steps=1 --max_iters="$checkpoint_steps" --eval_interval="$checkpoint_steps"
measure_training "S0 b16" config/s0.py "${common[@]}" "${short[@]}" --out_dir="$work/s0_b16" --batch_size=16 || true
measure_training "S1 b4" config/s1.py "${common[@]}" "${short[@]}" --out_dir="$work/s1_b4" --batch_size=4 || true
measure_training "S1 b16" config/s1.py "${common[@]}" "${short[@]}" --out_dir="$work/s1_b16" --batch_size=16 || true
echo "(training: $((SECONDS - started)) s)"

echo "== allocating S0 (the exits' operating thresholds, which decoding's --exit rows run)"
python allocate.py --out_dir="$s0" --windows="$allocate_windows" --train_windows=8 > "$work/allocate.log" 2>&1 ||
    tail -n 3 "$work/allocate.log"
grep -E "reaches the bar, loops|Operating thresholds" "$work/allocate.log" || true
echo "== decoding S0 ($new_tokens new tokens, greedy; python -m engine's reports)"
decode_started=$SECONDS
# shellcheck disable=SC2086  # $SAMPLE_FLAGS: none or more flags
python -m studies.gpu_check decoding "$s0" "$new_tokens" ${SAMPLE_FLAGS:-} 2>&1 | grep -v "^W[0-9]"
echo "(decoding: $((SECONDS - decode_started)) s)"

echo "== launch counts (the kernels inductor schedules for a GPU) and conditional nodes"
launches_started=$SECONDS
python -m studies.gpu_check launches 2>&1 | grep -v "^W[0-9]" || echo "launch counts failed"
echo "(launch counts: $((SECONDS - launches_started)) s)"

echo "== the test suite"
tests_started=$SECONDS
parallel=()
if python -c "import xdist" 2> /dev/null; then
    parallel=(-n auto)  # the tests are single-threaded: one process a core
fi
set +e
python -m pytest -q -m "not network" -p no:cacheprovider --basetemp="$work/pytest" "${parallel[@]}" tests \
    > "$work/pytest.log" 2>&1
set -e
grep -E "^(FAILED|ERROR) " "$work/pytest.log" || true
tail -n 1 "$work/pytest.log"
echo "(tests: $((SECONDS - tests_started)) s; all: $((SECONDS - started)) s)"
