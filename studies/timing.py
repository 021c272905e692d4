"""The cost curve's time axis: a checkpoint's tokens/s at batch 1 at each depth, the speed a single request sees.

Forwards of one validation window at a time (evaluate.py's windows, picked by the same seed) at r loops,
after a warm-up, on a clock that waits for the device. Timed apart from evaluate.py's pass, whose readout
after every loop a plain forward does not pay.

    python -m studies.timing --out_dir=out-shakespeare --loops=1,2,4,8    # writes out_dir/timing.json
"""
import os

import torch

from configurator import configure, run
from evaluate import load_windows, loop_counts, table
from engine import clock
from model import DEVICES, autocast, checkpoint_id, save_atomic
from prepare import open_run

out_dir = "out-shakespeare"  # reads ckpt.pt, writes timing.json
loops = ""  # the depths, e.g. "1,2,4,8"; "": evaluate.py's default sweep
timing_windows = 4  # batch-1 forwards timed per loop count
seed = 1337  # picks the windows, as evaluate.py's seed does
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu, cuda or cuda:N
dtype = "float32"  # the autocast dtype of the matmuls, as in evaluate.py
RULES = {"timing_windows": (1, 10 ** 6), "seed": (0, 2 ** 63 - 1), "dtype": ("float32", "bfloat16"), "device": DEVICES}


@torch.no_grad()
def tokens_per_second(model, windows, r, device, dtype):
    """windows (n, T): forwards of one window at a time at r loops -> tokens per second."""
    with autocast(device, dtype):
        model(windows[:1], loops=r)  # a warm-up: allocations and kernel choices are not timed
        started = clock(device)  # a GPU runs queued work: the clock waits for it
        for window in windows:
            model(window[None], loops=r)
    return windows.numel() / (clock(device) - started)


def main(argv=()):
    C, _ = configure(globals(), argv)
    model, ckpt, data_dir, meta = open_run(C.out_dir, C.device, splits=("val",))
    length = model.config.block_size + 1
    windows = load_windows(f"{data_dir}/val.bin", meta["dtype"], C.timing_windows, length, C.seed)
    windows = windows[:, :-1].to(C.device)
    rows = []
    for r in loop_counts(C.loops, model.config.mean_loops):
        rows.append({"loops": r, "tokens_per_s": tokens_per_second(model, windows, r, C.device, C.dtype)})
    table(f"Tokens/s at batch 1 of {checkpoint_id(ckpt)} ({C.device}, {C.dtype})", rows, "loops:d tokens_per_s:.0f")
    result = {"args": vars(C), "checkpoint": checkpoint_id(ckpt), "rows": rows}
    save_atomic(os.path.join(C.out_dir, "timing.json"), result)
    return result


if __name__ == "__main__":
    run(main)
