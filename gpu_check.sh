#!/usr/bin/env bash
# The numbers a GPU run reports (issue 39), on one GPU in about 5 minutes:
#
#   ./gpu_check.sh --dataset=shakespeare_smollm2
#
# 1) S0 (config/s0.py) trained for a few hundred steps: its checkpoint, and S0's training MFU and peak
#    memory at the paper's micro-batch (32); then a few steps of S0 at 16 and of S1 (config/s1.py) at 4
#    and at 16. MFU is flops_per_s in metrics.jsonl (the median over the steps after the first two,
#    which compile) over PEAK_FLOPS; the peak is torch.cuda.max_memory_allocated.
# 2) S0's decode tokens/s at batch 1 and 32: uniform r = 4, 8, 16, and the kl and state exits
#    (sample.py's stderr line, as it prints it).
# 3) The test suite's summary line.
#
# The dataset: any data/NAME prepared with the SmolLM2 tokenizer, for example
#   python prepare.py --source=input.txt --tokenizer=smollm2 --name=shakespeare_smollm2   # any text file
#   python prepare.py --source=input.txt --tokenizer=../shared/tokenizers/smollm2.json --name=...   # offline
# Everything it writes goes to a temporary directory (removed at the end; GPU_CHECK_KEEP=1 keeps it):
# checkpoints, logs, the compilers' caches, pytest's files. data/ is only read.
#
# Settings, from the environment:
#   PEAK_FLOPS=989e12   the card's dense bf16 peak (H100 and H200; A100 312e12, L40S 362e12, RTX 4090 165e12)
#   SAMPLE_FLAGS=...    more flags for every sample.py run (--compile=False: eager decoding)
#   GPU_CHECK_TINY=1    narrow models, a few steps, 16 new tokens: a dry run of this script on a CPU
set -euo pipefail
cd "$(dirname "$0")"  # the repository: its scripts, config/ and data/

dataset=shakespeare_smollm2
for arg in "$@"; do
    case "$arg" in
        --dataset=*) dataset="${arg#--dataset=}" ;;
        *) echo "usage: ./gpu_check.sh [--dataset=NAME]   (got '$arg')" >&2; exit 2 ;;
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

# the paper's shapes and micro-batches; the tiny dry run keeps their structure at width 64 and 64 tokens
checkpoint_steps=300
short_steps=8
new_tokens=128
narrow=()
if [[ "${GPU_CHECK_TINY:-0}" == 1 ]]; then
    checkpoint_steps=12
    short_steps=4
    new_tokens=16
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

# train.py in this process, then one line: MFU (median FLOP/s of the steps after the first two) and peak memory
measure_training() {  # label, out_dir, then train.py's arguments
    local label=$1 out_dir=$2
    shift 2
    if ! python - "$label" "$out_dir" "$peak_flops" "$@" --out_dir="$out_dir" > "$work/$label.log" 2>&1 <<'EOF'
import json
import resource
import statistics
import sys

import torch

import train

label, out_dir, peak_flops = sys.argv[1], sys.argv[2], float(sys.argv[3])
train.main(sys.argv[4:])
with open(f"{out_dir}/metrics.jsonl") as f:
    steps = [json.loads(line) for line in f if '"flops_per_s"' in line]
rate = statistics.median(step["flops_per_s"] for step in steps if step["iter"] >= 2)
if torch.cuda.is_available():
    peak = f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB (max_memory_allocated)"
else:  # the dry run: no GPU
    peak = f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB (no GPU)"
print(f"{label:8s} MFU {100 * rate / peak_flops:.3g}% ({rate:.3g} FLOP/s over {peak_flops:.3g}), {peak}")
EOF
    then
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
measure_training "S0 b32" "$s0" config/s0.py "${common[@]}" --batch_size=32 --gradient_accumulation_steps=1 \
    --max_iters="$checkpoint_steps" --eval_interval="$checkpoint_steps"
measure_training "S0 b16" "$work/s0_b16" config/s0.py "${common[@]}" "${short[@]}" --batch_size=16 || true
measure_training "S1 b4" "$work/s1_b4" config/s1.py "${common[@]}" "${short[@]}" --batch_size=4 || true
measure_training "S1 b16" "$work/s1_b16" config/s1.py "${common[@]}" "${short[@]}" --batch_size=16 || true
echo "(training: $((SECONDS - started)) s)"

echo "== decoding S0 ($new_tokens new tokens, greedy; sample.py's line)"
decode_started=$SECONDS
depths=(--loops=4 --loops=8 --loops=16 "--exit=kl --exit_threshold=0.001" "--exit=state --exit_threshold=0.05")
for batch in 1 32; do
    for depth in "${depths[@]}"; do
        # shellcheck disable=SC2086  # $depth is one or two flags, $SAMPLE_FLAGS none or more
        if python sample.py --out_dir="$s0" --num_samples="$batch" --temperature=0 --max_new_tokens="$new_tokens" \
            $depth ${SAMPLE_FLAGS:-} > "$work/sample.out" 2> "$work/sample.err"; then
            printf "batch %2d  %-36s %s\n" "$batch" "$depth" "$(grep -m 1 'tokens/s' "$work/sample.err")"
        else
            printf "batch %2d  %-36s failed: %s\n" "$batch" "$depth" "$(tail -n 1 "$work/sample.err")"
        fi
    done
done
echo "(decoding: $((SECONDS - decode_started)) s)"

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
tail -n 1 "$work/pytest.log"
echo "(tests: $((SECONDS - tests_started)) s; all: $((SECONDS - started)) s)"
