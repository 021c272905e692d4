# The CPU-default search (RESULTS.md, "The search for the CPU default"), run b1:
# Raw bytes (bpe:257: the 256 bytes and the end-of-text token), the old default's model.
# First: python prepare.py --tokenizer bpe:257 --name shakespeare_bytes
# Then:  python train.py config/search/b1.py
# every other setting is train.py's default (the CPU default, which is c5)
out_dir = 'out-b1'
dataset = 'shakespeare_bytes'
n_core = 2
mean_loops = 4
max_loops = 16
bptt_k = 4
max_iters = 350
eval_interval = 50
