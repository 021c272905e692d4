# The CPU-default search (README, "The search"), run c2:
# A 512-entry BPE, the old default's model, 400 steps.
# First: python prepare.py --tokenizer bpe:512 --name shakespeare_bpe512
# Then:  python train.py config/search/c2.py
out_dir = "out-c2"
dataset = "shakespeare_bpe512"
n_embd = 192
n_head = 3
n_kv_head = 1
ffn_hidden = 512
n_prelude = 1
n_core = 2
n_coda = 1
mean_loops = 4
max_loops = 16
bptt_k = 4
block_size = 512
batch_size = 8
learning_rate = 0.002
min_lr = 0.0002
max_iters = 400
eval_interval = 100
