# The CPU-default search (README, "The search"), run c5:
# A 1024-entry BPE, one core block looped 8 times on average (max 32, bptt_k 8), 400 steps:
# the configuration that became train.py's defaults (and data/shakespeare's tokenizer).
# First: python prepare.py --tokenizer bpe:1024 --name shakespeare_bpe1024
# Then:  python train.py config/search/c5.py
out_dir = "out-c5"
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
bptt_k = 8
block_size = 512
batch_size = 8
learning_rate = 0.002
min_lr = 0.0002
max_iters = 400
eval_interval = 100
