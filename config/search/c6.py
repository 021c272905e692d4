# The CPU-default search (RESULTS.md, "The search for the CPU default"), run c6:
# c5 with truncated backprop through 4 loops instead of 8: cheaper steps, so 560 of them fit in the
# same time (more training was the lever that gave the old default an early-exit saving).
# First: python prepare.py --tokenizer bpe:1024 --name shakespeare_bpe1024
# Then:  python train.py config/search/c6.py
# every other setting is train.py's default (the CPU default, which is c5)
out_dir = 'out-c6'
dataset = 'shakespeare_bpe1024'
bptt_k = 4
max_iters = 560
