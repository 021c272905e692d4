# S1 (the paper's main scale): 29.0M unique non-embedding / 57.3M total parameters, a
# SmolLM2-135M shape with the middle layers replaced by a weight-tied core, FineWeb-Edu,
# 12.9B tokens, mean 8 loops. First: python -m corpora --source=fineweb-edu --max_tokens=13000000000
# 262,144-token optimizer steps as in the paper (4 x 32 x 2048); 49,210 steps = 12.9B tokens.
# Micro-batches of 4 sequences fit the paper's 24 GB card: a micro-step takes about 14.0 GB
# under bf16 (activations 12.0, weights + grads + AdamW 0.9, one loss chunk's logits 1.1; predicted
# on fake tensors, 2026-11-24); 16 sequences would need ~50 GB.
out_dir = "out-s1"
dataset = "fineweb-edu"
block_size = 2048
batch_size = 4
gradient_accumulation_steps = 32
max_iters = 49210
eval_interval = 1000
eval_iters = 40
log_interval = 10
n_embd = 576
n_head = 9
n_kv_head = 3
ffn_hidden = 1536
n_prelude = 2
n_core = 4
n_coda = 2
mean_loops = 8
max_loops = 32
bptt_k = 8
learning_rate = 1e-4
min_lr = 1e-5
warmup_iters = -1  # 1% of the schedule
