"""Decoding at a GPU's speed, built on sample.py: the same tokens and loops, a new token's steps at
fixed addresses (CUDA graphs under --compile) and no host wait a loop. The core never imports it."""
