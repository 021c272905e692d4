# The CPU-default search (RESULTS.md, "The search for the CPU default"), run old_default:
# The CPU default before this search (train.py's defaults until 2026-11-23): a 4096-entry BPE,
# two core blocks looped 4 times on average.
# First: python prepare.py --tokenizer bpe:4096 --name shakespeare_bpe4096
# Then:  python train.py config/search/old_default.py
# every other setting is train.py's default (the CPU default, which is c5)
out_dir = 'out-old_default'
dataset = 'shakespeare_bpe4096'
n_core = 2
mean_loops = 4
max_loops = 16
bptt_k = 4
max_iters = 300
eval_interval = 50
