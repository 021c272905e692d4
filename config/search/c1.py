# The CPU-default search (RESULTS.md, "The search for the CPU default"), run c1:
# A 1024-entry BPE, the old default's model, 400 steps.
# First: python prepare.py --tokenizer bpe:1024 --name shakespeare_bpe1024
# Then:  python train.py config/search/c1.py
# every other setting is train.py's default (the CPU default, which is c5)
out_dir = 'out-c1'
dataset = 'shakespeare_bpe1024'
n_core = 2
mean_loops = 4
max_loops = 16
bptt_k = 4
