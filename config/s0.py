# S0 (the paper's toy scale): 12.9M unique non-embedding / 31.8M total parameters,
# TinyStories, ~0.4B tokens, mean 4 loops. First: python -m corpora --source=tinystories
# Tokens per step are our choice (the paper gives S1's only): 32 x 4 x 512 = 65,536,
# so 6,104 steps = 0.4B tokens. On 8 GPUs gradient_accumulation_steps is split across ranks.
# A micro-step takes about 10.3 GB under bf16 (activations 8.7; predicted on fake tensors, 2026-11-24): fits 24 GB.
out_dir = "out-s0"
dataset = "tinystories"
block_size = 512
batch_size = 32
gradient_accumulation_steps = 4
max_iters = 6104
eval_interval = 500
eval_iters = 40
log_interval = 10
n_embd = 384
n_head = 6
n_kv_head = 2
ffn_hidden = 1024
n_prelude = 2
n_core = 4
n_coda = 2
mean_loops = 4
max_loops = 16
bptt_k = 4
learning_rate = 1e-4
min_lr = 1e-5
warmup_iters = -1  # 1% of the schedule
