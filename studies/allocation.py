"""allocate.py's results, as the studies built on them read them: out_dir/allocate.json, of this checkpoint."""
import json
import os

from configurator import UserError
from model import checkpoint_id


def read_allocation(out_dir, ckpt):
    """out_dir/allocate.json, checked to be ckpt's (the checkpoint dict) -> its dict; UserError if there is none
    or it is another checkpoint's (a retrained run's thresholds and windows are not this one's)."""
    path = os.path.join(out_dir, "allocate.json")
    if not os.path.isfile(path):
        raise UserError(f"no {path}: run `python allocate.py --out_dir={out_dir}` first")
    with open(path) as f:
        allocated = json.load(f)
    if allocated["checkpoint"] != checkpoint_id(ckpt):
        raise UserError(f"{path} is of {allocated['checkpoint']}, not of ckpt.pt ({checkpoint_id(ckpt)})")
    return allocated
