"""A2, the paper's oracle-labelled router: an exit test registered at run time, and its diagnosis.

A linear probe on the state s_i, fit by least squares on training windows, scores P(this token's
argmax changes at a later loop); A2 stops a token once that score is below a threshold. Registered
in model.EXIT_TESTS as "probe", it is a policy of allocate.py like any exit test: this runs
allocate.py with it (allocate.py's settings, its windows), so that allocate.json holds A2 beside
uniform depth and the other exits. Then the probe's diagnosis: its accuracy on the evaluation
windows' own labels (it never saw them) against always guessing the commoner answer. A probe no
better than that majority guess cannot route tokens better than a fixed depth.

    python -m studies.probe --out_dir=out-shakespeare    # allocate.json with A2; probe.json
"""
import os

import torch

import allocate
from configurator import configure, run
from model import EXIT_TESTS, ExitTest, autocast, checkpoint_id, save_atomic
from prepare import open_run


def harvest_labels(argmax):
    """argmax (r_max, ...) -> (r_max, ...) bool: does the argmax after loop i change later?"""
    later = [(argmax[i + 1:] != argmax[i]).any(0) for i in range(len(argmax))]
    return torch.stack(later)


def fit_probe(x, y):
    """A linear probe, least squares on standardised features (closed form: no steps to tune).
    x (N, d), y (N,) bool -> the probe: states (..., d) -> its score, ~P(label)."""
    # The paper's A2 is "a linear probe on s_i"; least squares is one, and its score is near
    # P(the argmax still changes), so a token stops once the probe is confident enough it won't.
    mu = x.mean(0)
    sd = x.std(0).clamp_min(1e-6)
    with_bias = torch.cat([(x - mu) / sd, torch.ones(len(x), 1)], dim=1)
    fit = torch.linalg.lstsq(with_bias.double(), y.double()[:, None])
    w = fit.solution[:, 0].float()

    def probe(s):
        # in float32, whatever the autocast
        z = (s.float() - mu.to(s.device)) / sd.to(s.device)
        return z @ w[:-1].to(s.device) + w[-1].item()
    return probe


def probe_exit_test(probe):
    """A2 as an exit test: its score is the probe's P(this token's argmax changes later)."""
    def score(s_new, s_old, logits_new, logits_old):
        return probe(s_new)
    # a standardisation and a dot product per state channel
    return ExitTest(score, lambda config: 4 * config.n_embd, label="A2")


def trace_windows_with(model, windows, r_max, batch_size, read_states):
    """Windows (n, T + 1) traced from a zero state, batch by batch, with the model's four verbs ->
    (argmax (r_max, n, T), read_states(states (r_max, B, T, d)) of each batch joined along the
    windows)."""
    argmax = []
    read = []
    with torch.no_grad():
        for batch in windows.split(batch_size):
            e = model.prelude(batch[:, :-1])
            s = model.init_state(e, "zero")
            states = []
            for _ in range(r_max):
                s = model.core_step(e, s)
                states.append(s)
            states = torch.stack(states)
            argmax.append(torch.stack([model.readout(s).argmax(-1) for s in states]).cpu())
            read.append(read_states(states).cpu())
    return torch.cat(argmax, 1), torch.cat(read, 1)


def fit(model, train_windows, r_max, batch_size):
    """The probe, fit on the training windows' states after loops 1..r_max - 1 (after r_max
    there is no later loop to label)."""
    argmax, states = trace_windows_with(model, train_windows, r_max, batch_size, torch.Tensor.float)
    labels = harvest_labels(argmax)[:-1]
    return fit_probe(states[:-1].flatten(0, 2), labels.flatten())


def probe_accuracy(argmax, scores):
    """argmax and the probe's scores (r_max, ...) of windows it never saw -> its accuracy on their
    labels (does the argmax after loop i change later?) and always guessing the commoner's."""
    labels = harvest_labels(argmax)[:-1]
    rate = labels.float().mean().item()
    accuracy = ((scores[:-1] > 0.5) == labels).float().mean().item()
    return {"accuracy": accuracy, "majority": max(rate, 1 - rate)}


def main(argv=()):
    C, _ = configure(vars(allocate), argv)
    model, ckpt, data_dir, meta = open_run(C.out_dir, C.device, writes=True)
    r_max = C.r_max or model.config.max_loops
    length = model.config.block_size + 1
    windows, train_windows = allocate.allocation_windows(data_dir, meta, length, C)
    with autocast(C.device, C.dtype):
        probe = fit(model, train_windows.to(C.device), r_max, C.batch_size)
        argmax, scores = trace_windows_with(model, windows.to(C.device), r_max, C.batch_size, probe)
    # A2 among the exit tests while allocate.py reads every registered one
    EXIT_TESTS["probe"] = probe_exit_test(probe)
    try:
        allocated = allocate.main(argv)
    finally:
        del EXIT_TESTS["probe"]
    result = probe_accuracy(argmax, scores)
    print(f"A2 probe: held-out accuracy {result['accuracy']:.3f} "
          f"(majority class {result['majority']:.3f})")
    result |= {"checkpoint": checkpoint_id(ckpt), "at_bar": allocated["at_bar"]["probe"]}
    save_atomic(os.path.join(C.out_dir, "probe.json"), result)
    return result


if __name__ == "__main__":
    run(main)
