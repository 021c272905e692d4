# The CPU-default search (RESULTS.md, "The search for the CPU default"), run c5:
# A 1024-entry BPE, one core block looped 8 times on average (max 32, bptt_k 8), 400 steps:
# the configuration that became train.py's defaults (and data/shakespeare's tokenizer).
# First: python prepare.py --tokenizer bpe:1024 --name shakespeare_bpe1024
# Then:  python train.py config/search/c5.py
# every other setting is train.py's default (the CPU default, which is c5)
out_dir = 'out-c5'
dataset = 'shakespeare_bpe1024'
