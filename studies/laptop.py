"""The laptop study's last three measurements, after studies/laptop.sh has trained, evaluated and
allocated:

    parity      the study model's training FLOP/s over its dense twin's (config/study_dense.py):
                the medians of what train.py logged for their steps (metrics.jsonl)
    generation  the tokens/s of sample.py's greedy generation (python -m engine: the same tokens,
                timed), at fixed depths and at the state exit
    bracket     the paper's three-point bracket for A1, the KL exit, at batch 1 and 8: A1's loops
                at the bar against uniform mean_loops (the FLOP proxy, from allocate.json); uniform
                round(A1's loops) against uniform mean_loops (the best case, which a perfect packing
                of the exited tokens could reach); sample.py --exit=kl at A1's operating threshold
                against uniform mean_loops (realized)

    python -m studies.laptop --out_dir=out-shakespeare    # prints them; writes out_dir/laptop.json
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

from allocate import read_allocation
from configurator import UserError, configure, run
from evaluate import markdown
from model import load_checkpoint, save_atomic

out_dir = "out-shakespeare"  # its ckpt.pt is timed; its allocate.json gives the kl exit's point
recurrent_dir = "out-study"  # parity: this run's training FLOP/s ...
dense_dir = "out-study_dense"  # ... over this one's, its dense twin
max_new_tokens = 128  # new tokens per generation (the engine times all but the first three)
GENERATIONS = [  # (batch, sample.py's arguments), timed besides the bracket's
    (8, ("--loops=2",)),
    (8, ("--loops=4",)),
    (8, ("--loops=6",)),
    (8, ("--loops=8",)),
    (8, ("--exit=state", "--exit_threshold=0.01")),
    (8, ("--exit=state", "--exit_threshold=0.03")),
    (8, ("--exit=state", "--exit_threshold=0.1")),
]
BRACKET_BATCHES = (1, 8)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def median_flop_rate(run_dir):
    """The median FLOP/s train.py logged for a run's steps (its metrics.jsonl)."""
    # the median, not the mean: a step slowed by another process on the machine moves it little
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise UserError(f"no {path}: train the run with `python train.py` first")
    rates = []
    with open(path) as f:
        for line in f:
            logged = json.loads(line)
            if "flops_per_s" in logged:  # a step's line; an evaluation's has none
                rates.append(logged["flops_per_s"])
    if not rates:
        raise UserError(f"{path} logs no step's FLOP/s")
    return statistics.median(rates)


def generation_rate(out_dir, batch, args, max_new_tokens):
    """The tokens/s of greedy generation of `batch` sequences with sample.py's args (a tuple of
    --key=value arguments), as python -m engine measures it in its JSON report."""
    # a process of its own, as a user runs it: nothing this process has loaded or compiled helps it
    with tempfile.TemporaryDirectory() as folder:
        report = os.path.join(folder, "report.json")
        command = [sys.executable, "-m", "engine", f"--out_dir={out_dir}", f"--num_samples={batch}",
                   "--temperature=0", f"--max_new_tokens={max_new_tokens}", *args, f"--report={report}"]
        # out_dir is the caller's path; the engine is this repository's
        paths = [ROOT, os.environ.get("PYTHONPATH", "")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, paths)))
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            last_lines = done.stderr.strip().splitlines()[-1:] or ["no message"]
            raise UserError(f"python -m engine {' '.join(args)} failed: {last_lines[0]}")
        with open(report) as f:
            return json.load(f)["tokens_per_s"]


def bracket_settings(mean, a1_loops, threshold):
    """The bracket's three generations, as sample.py arguments: uniform mean_loops, uniform
    round(A1's loops at the bar), the KL exit at its operating threshold."""
    return {"uniform": (f"--loops={mean}",),
            "matched": (f"--loops={round(a1_loops)}",),
            "realized": ("--exit=kl", f"--exit_threshold={threshold}")}


def bracket(mean, a1_loops, rates):
    """The three points: the share of loops A1 saves at the bar (the FLOP proxy); the speedups over
    uniform mean_loops of uniform round(A1's loops) (the best case) and of the KL exit (realized).
    rates {"uniform" | "matched" | "realized": tokens/s}."""
    return {"loops_saved": 1 - a1_loops / mean,
            "best_case": rates["matched"] / rates["uniform"],
            "realized": rates["realized"] / rates["uniform"]}


def main(argv=()):
    C, _ = configure(globals(), argv)
    # 1) parity, from the training logs
    parity = median_flop_rate(C.recurrent_dir) / median_flop_rate(C.dense_dir)
    print(f"parity: {C.recurrent_dir} / {C.dense_dir} training FLOP/s (medians over the logged steps) "
          f"= {parity:.3f}")
    # 2) the settings to time: the table's and the bracket's; every refusal comes before the first run
    _, ckpt = load_checkpoint(os.path.join(C.out_dir, "ckpt.pt"))
    allocated = read_allocation(C.out_dir, ckpt)
    mean = allocated["mean_loops"]
    # None: the kl exit never reaches the bar
    a1_loops = allocated["at_bar"]["kl"]["loops"]["value"]
    threshold = allocated["operating_thresholds"]["kl"]
    timed = list(GENERATIONS)
    if a1_loops is not None:
        for batch in BRACKET_BATCHES:
            for args in bracket_settings(mean, a1_loops, threshold).values():
                timed.append((batch, args))
    # 3) each setting timed once: one may be both the table's and the bracket's (the CPU default's r=8
    # at batch 8)
    rates = {}
    for batch, args in dict.fromkeys(timed):
        rates[batch, args] = generation_rate(C.out_dir, batch, args, C.max_new_tokens)
    rows = [[batch, " ".join(args), f"{rate:.1f}"] for (batch, args), rate in rates.items()]
    print(f"\n## Greedy generation from {C.out_dir}, {C.max_new_tokens} new tokens\n")
    print(markdown(["batch", "sample.py", "tokens/s"], rows))
    generation = [{"batch": batch, "args": args, "tokens_per_s": rate} for (batch, args), rate in rates.items()]
    result = {"checkpoint": allocated["checkpoint"], "parity": parity, "generation": generation, "bracket": {}}
    # 4) the bracket, read off those rates
    print()
    if a1_loops is None:
        print("A1 never reaches the bar: no bracket")
    else:
        settings = bracket_settings(mean, a1_loops, threshold)
        for batch in BRACKET_BATCHES:
            points = bracket(mean, a1_loops, {name: rates[batch, args] for name, args in settings.items()})
            print(f"bracket, batch {batch}: A1 reaches the bar at {a1_loops:.2f} loops, "
                  f"{points['loops_saved']:.0%} fewer than r={mean}; best case {points['best_case']:.2f}x; "
                  f"realized {points['realized']:.2f}x")
            result["bracket"][batch] = points
    save_atomic(os.path.join(C.out_dir, "laptop.json"), result)
    return result


if __name__ == "__main__":
    run(main)
