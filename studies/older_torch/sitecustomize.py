"""For a torch older than the pinned 2.13 (a GPU image may hold 2.11): 2.13's F.linear_cross_entropy, which
model.py's training loss calls, by its reference definition. Python imports this file at start-up when its
folder is on PYTHONPATH (gpu_check.sh puts it there on such a torch):

    PYTHONPATH=studies/older_torch python train.py

The definition makes the whole (rows, vocab) logits in float32 at once, where 2.13 goes a few rows at a time:
the loss is the same, the memory larger (a GPU run's peak memory under it is an upper bound). On PYTHONPATH this
file takes the place of any sitecustomize.py the Python installation has.
"""
import torch
import torch.nn.functional as F

if not hasattr(F, "linear_cross_entropy"):
    class LinearCrossEntropyOptions:
        """2.13's chunking options: nothing to choose here, the definition does not chunk."""

    def linear_cross_entropy(input, linear_weight, target, *, ignore_index=-100, options=None, **kwargs):
        """input (N, d), linear_weight (V, d), target (N,) -> the mean cross-entropy of input @ linear_weight.T."""
        with torch.autocast(input.device.type, enabled=False):  # float32, as model.py's comment says
            logits = F.linear(input.float(), linear_weight.float())
        return F.cross_entropy(logits, target, ignore_index=ignore_index, **kwargs)

    torch.nn.LinearCrossEntropyOptions = LinearCrossEntropyOptions
    F.linear_cross_entropy = linear_cross_entropy
