# The CPU-default search (README, "The search"), run b1:
# Raw bytes (bpe:257: the 256 bytes and the end-of-text token), the old default's model.
# First: python prepare.py --tokenizer bpe:257 --name shakespeare_bytes
# Then:  python train.py config/search/b1.py
out_dir = "out-b1"
dataset = "shakespeare_bytes"
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
max_iters = 350
eval_interval = 50
