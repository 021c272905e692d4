# The CPU-default search (RESULTS.md, "The search for the CPU default"), run c3:
# A 512-entry BPE, a narrower model (d128) on shorter windows and larger batches, 650 steps.
# First: python prepare.py --tokenizer bpe:512 --name shakespeare_bpe512
# Then:  python train.py config/search/c3.py
# every other setting is train.py's default (the CPU default, which is c5)
out_dir = 'out-c3'
dataset = 'shakespeare_bpe512'
n_embd = 128
n_head = 4
ffn_hidden = 384
n_core = 2
mean_loops = 4
max_loops = 16
bptt_k = 4
block_size = 256
batch_size = 16
learning_rate = 0.003
min_lr = 0.0003
max_iters = 650
eval_interval = 130
