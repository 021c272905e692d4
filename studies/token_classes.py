"""Which tokens run deep: the paper's mean exit depth by token class, read as A1's (the KL exit's) at the
operating threshold allocate.py found for the checkpoint, on the same evaluation windows.

Each token's depth is the loops the KL exit runs it (model.exit_depth on a trace from a zero state to r_max,
as allocate.py reads it), counted for the token at its position: the one that exits.

    python allocate.py --out_dir=out-shakespeare
    python -m studies.token_classes --out_dir=out-shakespeare    # writes out_dir/token_classes.json
"""
import os
import unicodedata
from types import SimpleNamespace

import numpy as np
import torch

from allocate import allocation_windows, read_allocation
from configurator import configure, run
from evaluate import table, trace_windows
from model import DEVICES, EXIT_TESTS, DepthPolicy, autocast, checkpoint_id, exit_depth, save_atomic
from prepare import load_tokenizer, open_run, sha256_of

out_dir = "out-shakespeare"  # reads ckpt.pt and allocate.json, writes token_classes.json
batch_size = 8  # windows per forward
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu, cuda or cuda:N
dtype = "float32"  # as allocate.py's: bf16 autocast puts a floor under the small KLs the exit tests
RULES = {"batch_size": (1, 10 ** 6), "dtype": ("float32", "bfloat16"), "device": DEVICES}
CLASSES = ("space", "numeral", "punctuation", "word")


def token_class(text):
    """One of CLASSES for a token: ' (' (a space carried) is punctuation, a partial character (U+FFFD) a word."""
    if text.isspace():
        return "space"
    if any(ch.isdigit() for ch in text):
        return "numeral"
    kinds = {unicodedata.category(ch)[0] for ch in text.strip()}
    if kinds and "\ufffd" not in text and kinds <= {"P", "S"}:
        return "punctuation"
    return "word"


def token_classes(traced, threshold, inputs, decode):
    """The mean exit depth by class of the token at its position, at the KL exit's threshold.
    traced["kl"] (r_max, n, T), inputs (n, T) -> {"threshold", "rows": a row per class, then "all"}."""
    # Not the first loop with KL < 1e-3 (evaluate.py's "still moving" line): at S1, 96% of tokens still
    # move at loop 4, so the paper's 3.58-4.25 loops are most likely an exit's at a looser threshold.
    scores = traced["kl"]
    exits = exit_depth(scores, DepthPolicy(EXIT_TESTS["kl"], threshold, len(scores))).flatten().numpy()
    classes = np.array([token_class(decode([i])) for i in inputs.flatten().tolist()])
    rows = []
    for name in CLASSES:
        picked = exits[classes == name]
        row = {"class": name, "count": picked.size}
        if picked.size:  # a class these windows lack has no mean
            row["mean_exit_depth"] = picked.mean()
        rows.append(row)
    rows.append({"class": "all", "count": exits.size, "mean_exit_depth": exits.mean()})
    return {"threshold": threshold, "rows": rows}


def main(argv=()):
    C, _ = configure(globals(), argv)
    model, ckpt, data_dir, meta = open_run(C.out_dir, C.device)
    allocated = read_allocation(C.out_dir, ckpt)
    _, decode = load_tokenizer(data_dir)
    # allocate.py's windows (its count and seed) and depth
    length = model.config.block_size + 1
    windows, _ = allocation_windows(data_dir, meta, length, SimpleNamespace(**allocated["args"]))
    with autocast(C.device, C.dtype):
        traced = trace_windows(model, windows.to(C.device), allocated["r_max"], C.batch_size, ("kl",))
    result = token_classes(traced, allocated["operating_thresholds"]["kl"], windows[:, :-1], decode)
    table(f"A1's exit depth by class of the exiting token, at its threshold {result['threshold']:.3g}",
          result["rows"], "class:s count:d mean_exit_depth:.2f")
    result["checkpoint"] = checkpoint_id(ckpt)
    result["allocate_sha256"] = sha256_of(os.path.join(C.out_dir, "allocate.json"))
    save_atomic(os.path.join(C.out_dir, "token_classes.json"), result)
    return result


if __name__ == "__main__":
    run(main)
