"""Decoding at a GPU's speed, built on sample.py: the same tokens and loops, a new token's steps at
fixed addresses (CUDA graphs under --compile) and no host wait a loop. The core never imports it."""
import time

import torch


def clock(device):
    """time.perf_counter() once the device has done the work queued (a GPU runs behind the host)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    return time.perf_counter()
