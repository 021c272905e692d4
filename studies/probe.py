"""A2's diagnosis: how well its probe predicts, on the evaluation windows' own labels (it never saw them),
whether a token's argmax still changes after a loop, against always guessing the commoner answer. A probe
no better than that majority guess cannot route tokens better than a fixed depth.

The probe is allocate.py's (fit on the same training windows, with its settings from allocate.json), read
on the same evaluation windows.

    python allocate.py --out_dir=out-shakespeare
    python -m studies.probe --out_dir=out-shakespeare     # writes out_dir/probe.json
"""
import os
from types import SimpleNamespace

import torch

from allocate import fit_router, harvest_labels
from configurator import configure, run
from evaluate import load_windows, trace_windows
from model import DEVICES, autocast, checkpoint_id, save_atomic
from prepare import open_run
from studies.allocation import read_allocation

out_dir = "out-shakespeare"  # reads ckpt.pt and allocate.json, writes probe.json
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu, cuda or cuda:N
RULES = {"device": DEVICES}


def probe_accuracy(traced):
    """traced["argmax"] and traced["probe"] (r_max, ...) -> the probe's accuracy on the labels of these
    windows (does the argmax after loop i change later?), and the accuracy of always guessing the commoner."""
    labels = harvest_labels(traced["argmax"])[:-1]  # after r_max there is no later loop
    rate = labels.float().mean().item()
    accuracy = ((traced["probe"][:-1] > 0.5) == labels).float().mean().item()
    return {"accuracy": accuracy, "majority": max(rate, 1 - rate)}


def main(argv=()):
    C, _ = configure(globals(), argv)
    model, ckpt, data_dir, meta = open_run(C.out_dir, C.device)
    allocated = read_allocation(C.out_dir, ckpt)
    args = SimpleNamespace(**allocated["args"])  # allocate.py's windows, seeds, grid and dtype
    length = model.config.block_size + 1
    windows = load_windows(f"{data_dir}/val.bin", meta["dtype"], args.windows, length, args.seed)
    train_windows = load_windows(f"{data_dir}/train.bin", meta["dtype"], args.train_windows, length, args.seed + 1)
    with autocast(C.device, args.dtype):
        probe, _ = fit_router(model, train_windows.to(C.device), args, allocated["r_max"])
        traced = trace_windows(model, windows.to(C.device), allocated["r_max"], args.batch_size, ("argmax",),
                               states_as=("probe", probe))
    result = probe_accuracy(traced) | {"checkpoint": checkpoint_id(ckpt)}
    print(f"A2 probe: held-out accuracy {result['accuracy']:.3f} (majority class {result['majority']:.3f})")
    save_atomic(os.path.join(C.out_dir, "probe.json"), result)
    return result


if __name__ == "__main__":
    run(main)
