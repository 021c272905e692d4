# The CPU-default search (README, "The search"), run c6:
# c5 with truncated backprop through 4 loops instead of 8: cheaper steps, so 560 of them fit in the
# same time (more training was the lever that gave the old default an early-exit saving).
# First: python prepare.py --tokenizer bpe:1024 --name shakespeare_bpe1024
# Then:  python train.py config/search/c6.py
out_dir = "out-c6"
dataset = "shakespeare_bpe1024"
n_embd = 192
n_head = 3
n_kv_head = 1
ffn_hidden = 512
n_prelude = 1
n_core = 1
n_coda = 1
mean_loops = 8
max_loops = 32
bptt_k = 4
block_size = 512
batch_size = 8
learning_rate = 0.002
min_lr = 0.0002
max_iters = 560
eval_interval = 100
