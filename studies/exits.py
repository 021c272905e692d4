"""Cheaper exits: does any exit test reach the bar with fewer FLOPs than uniform depth?

The KL exit (A1) saves loops but runs the readout after every loop, so it spends more FLOPs than
uniform depth; the state exit (A1s) costs next to nothing and saves next to nothing. This registers
the candidates of studies/exit_candidates.py in model.EXIT_TESTS at run time and runs allocate.py
once (its settings, its windows, its one trace), so that every candidate is a policy read off the
trace beside kl and state, in allocate.json too. For each exit: its loops and FLOPs at the bar with
paired intervals against uniform depth, its operating threshold, what it adds to each loop it tests
in core loops, and its verdict; with --time=True also its tokens/s in sample.py's generation.

The goal, fixed before any run: an exit WINS on a corpus if it reaches the bar (uniform depth's
loss at mean_loops) with at least 15% fewer FLOPs than uniform depth reaching it, its paired 95%
interval excluding 0, and, when timed, generates at batch 1 at least as fast as uniform depth at
the bar's loops (rounded up).

    python -m studies.exits --out_dir=out-shakespeare              # allocate.json; exits.json
    python -m studies.exits --out_dir=out-shakespeare --time=True  # and tokens/s on this machine
"""
import math
import os
import statistics
from contextlib import contextmanager
from functools import partial

import allocate
from configurator import configure, read_settings, run
from engine import clock
from evaluate import markdown, show
from model import EXIT_TESTS, DepthPolicy, autocast, checkpoint_id, save_atomic, uniform_depth
from prepare import open_run, sha256_of
from sample import generate, sample_next
from studies.exit_candidates import CANDIDATES, build_candidates, loop_flops, tokens_by_frequency

time = False  # also time sample.py's generation of each exit against uniform depth (minutes)
GOAL = ("an exit wins on a corpus if it reaches the bar with at least 15% fewer FLOPs than "
        "uniform depth reaching it, its paired 95% interval excluding 0, and, when timed, "
        "generates at batch 1 at least as fast as uniform depth at the bar's loops (rounded up)")
GOAL_SAVING = 0.15
# The timing, fixed before any run: greedy generation (sample.generate) of TIMED_NEW_TOKENS after
# the first TIMED_PROMPT tokens of allocate.py's evaluation windows (one a sequence), at each of
# TIMED_BATCHES; a warm-up run of each side, then TIMED_PAIRS runs of each, alternated (uniform,
# exit, uniform, exit ...) so that a machine's drift falls on both; the medians.
TIMED_BATCHES = (1, 8)
TIMED_PROMPT = 32
TIMED_NEW_TOKENS = 64
TIMED_PAIRS = 5
GREEDY = partial(sample_next, temperature=0.0, top_k=0, generators=())


def split_argv(argv):
    """-> (the arguments of the study's own setting, allocate.py's)."""
    own = []
    others = []
    args = list(argv)
    while args:
        arg = args.pop(0)
        key, has_value, _ = arg.removeprefix("--").partition("=")
        if not (arg.startswith("--") and key == "time"):
            others.append(arg)
            continue
        own.append(arg)
        # `--time True`: the value is the next argument
        if not has_value and args and not args[0].startswith("--"):
            own.append(args.pop(0))
    return own, others


@contextmanager
def registered(tests):
    """tests {name: ExitTest} in model.EXIT_TESTS for the block, removed after it, even after an
    error; ValueError for a name already there (removing it after would drop another's test)."""
    taken = sorted(set(tests) & set(EXIT_TESTS))
    if taken:
        raise ValueError(f"exit tests already registered: {', '.join(taken)}")
    EXIT_TESTS.update(tests)
    try:
        yield
    finally:
        for name in tests:
            del EXIT_TESTS[name]


def per_loop_cost(model, test):
    """What an exit adds to each loop it tests, in core loops: its test, and where it needs
    logits the readout too (the ledger's count, attention over a full block)."""
    _, loop, readout = model.flop_terms(model.config.block_size)
    added = test.flops(model.config)
    if test.needs_logits:
        added += readout
    return added / loop


def idea_of(name, test):
    """An exit's idea, in one line: the docstring of a candidate's builder, else of its score."""
    described = CANDIDATES.get(name, test.score)
    return " ".join(described.__doc__.split())


def saving(saved):
    """A FLOP saving against uniform depth in words: what it saves, or what it spends more."""
    if saved < 0:
        return f"spends {-saved:.1%} more FLOPs than uniform depth"
    return f"saves {saved:.1%} of uniform depth's FLOPs"


def verdict(flops_saved, speedup=None):
    """An exit against the goal: its FLOPs saved at the bar {"value", "interval"} (allocate.py's,
    against uniform depth) and, when timed, its batch-1 tokens/s over uniform depth's -> {"wins":
    bool, "why": a sentence}."""
    saved = flops_saved["value"]
    if saved is None:
        return {"wins": False, "why": "never reaches the bar"}
    interval = flops_saved["interval"]
    if saved < GOAL_SAVING:
        return {"wins": False, "why": f"{saving(saved)}, not {GOAL_SAVING:.0%} fewer"}
    if interval is None:
        return {"wins": False, "why": f"{saving(saved)}, without an interval (too few windows)"}
    shown = f"[{interval[0]:.1%}, {interval[1]:.1%}]"
    if interval[0] <= 0:
        return {"wins": False, "why": f"{saving(saved)}, but its interval {shown} holds 0"}
    if speedup is not None and speedup < 1:
        return {"wins": False, "why": f"{saving(saved)} {shown}, but generates at batch 1 at "
                                      f"{speedup:.2f}x uniform depth's speed"}
    if speedup is None:
        return {"wins": True, "why": f"{saving(saved)} {shown} (not timed)"}
    return {"wins": True, "why": f"{saving(saved)} {shown} and generates at batch 1 at "
                                 f"{speedup:.2f}x uniform depth's speed"}


def generation_rate(model, prompts, prompt_loops, depth, new_tokens, device):
    """sample.py's greedy generation of new_tokens after prompts (B, T0) under depth -> tokens per
    second of its decode steps (the first token, read off the prefill, is not timed)."""
    steps = generate(model, prompts, new_tokens, GREEDY, prompt_loops, depth)
    next(steps)
    started = clock(device)
    for _ in steps:
        pass
    return prompts.size(0) * (new_tokens - 1) / (clock(device) - started)


def time_against_uniform(model, prompts, uniform, depth, C, new_tokens, pairs):
    """Tokens/s of generation under depth and at uniform depth (the prompt at uniform's loops for
    both), a warm-up run each, then `pairs` runs each, alternated -> {"uniform": median, "exit":
    median, "speedup": exit's median / uniform's}."""
    sides = {"uniform": uniform, "exit": depth}
    rates = {"uniform": [], "exit": []}
    with autocast(C.device, C.dtype):
        for run_number in range(pairs + 1):
            for side, policy in sides.items():
                rate = generation_rate(model, prompts, uniform.r_max, policy, new_tokens, C.device)
                # run 0 warms up: the allocator's first requests are not timed
                if run_number:
                    rates[side].append(rate)
    medians = {side: statistics.median(values) for side, values in rates.items()}
    return medians | {"speedup": medians["exit"] / medians["uniform"]}


def timings(model, windows, tests, allocated, C):
    """{exit: {"batch_B": time_against_uniform's} for each of TIMED_BATCHES}, each exit at its
    operating threshold and r_max against uniform depth at the bar's loops, rounded up."""
    # the bar's loops are mean_loops give or take the interpolation's rounding
    bar_loops = math.ceil(allocated["at_bar"]["uniform"]["loops"]["value"] - 1e-9)
    uniform = uniform_depth(bar_loops)
    timed = {}
    for name, test in tests.items():
        depth = DepthPolicy(test, allocated["operating_thresholds"][name], allocated["r_max"])
        timed[name] = {}
        for batch in TIMED_BATCHES:
            # one window a sequence, the first ones again where there are fewer than the batch
            rows = [i % len(windows) for i in range(batch)]
            prompts = windows[rows, :TIMED_PROMPT].to(C.device)
            timed[name][f"batch_{batch}"] = time_against_uniform(
                model, prompts, uniform, depth, C, TIMED_NEW_TOKENS, TIMED_PAIRS)
        print(f"timed {name}: batch 1 at {timed[name]['batch_1']['speedup']:.2f}x uniform depth")
    return timed


def exit_rows(model, tests, allocated, timed):
    """{exit: what exits.json says of it}: its idea, per-loop cost, threshold, loops and FLOPs at
    the bar (each with its paired interval against uniform depth), timing, verdict."""
    rows = {}
    for name, test in tests.items():
        at_bar = allocated["at_bar"][name]
        row = {"label": test.label, "idea": idea_of(name, test),
               "per_loop_cost": per_loop_cost(model, test),
               "threshold": allocated["operating_thresholds"][name]} | at_bar
        speedup = None
        if timed:
            row["timing"] = timed[name]
            speedup = timed[name]["batch_1"]["speedup"]
        row["verdict"] = verdict(at_bar["flops_saved"], speedup)
        rows[name] = row
    return rows


def print_table(rows, allocated, timed):
    """Each exit's row against the goal, below the bar and what uniform depth spends to reach it;
    then each verdict in words."""
    headers = ["exit", "cost / loop", "threshold", "loops at the bar", "loops saved",
               "MFLOP/token at the bar", "FLOPs saved"]
    if timed:
        headers += [f"tokens/s at batch {batch}, x uniform" for batch in TIMED_BATCHES]
    headers.append("verdict")
    cells = []
    for name, row in rows.items():
        named = f"{name} ({row['label']})" if row["label"] else name
        cell = [named, f"{row['per_loop_cost']:.3f}", f"{row['threshold']:.3g}",
                show(row["loops"], ".2f"), show(row["loops_saved"], "+.3f"),
                show(row["flops"], ".3g", 1e6), show(row["flops_saved"], "+.3f")]
        for batch in TIMED_BATCHES if timed else ():
            rates = row["timing"][f"batch_{batch}"]
            cell.append(f"{rates['exit']:.0f}, {rates['speedup']:.2f}x")
        cell.append("WINS" if row["verdict"]["wins"] else "no")
        cells.append(cell)
    uniform = allocated["at_bar"]["uniform"]
    uniform_loops = show(uniform["loops"], ".2f")
    uniform_flops = show(uniform["flops"], ".3g", 1e6)
    print(f"\n## Exits against the goal\n\nThe goal: {GOAL}.\n\nThe bar: uniform depth's loss at "
          f"r = {allocated['mean_loops']}, {allocated['bar']:.4f}, which uniform depth reaches at "
          f"{uniform_loops} loops and {uniform_flops} MFLOP a token. An exit's cost a loop: the "
          f"FLOPs it adds to each loop it tests (its test, and the readout where it needs logits) "
          f"over one core loop's.\n")
    print(markdown(headers, cells))
    print()
    for name, row in rows.items():
        print(f"{name}: {'WINS' if row['verdict']['wins'] else 'no'}, {row['verdict']['why']}")


def main(argv=()):
    own, allocate_argv = split_argv(argv)
    if "--help" in argv:
        print(__doc__.strip() + "\n\nits own settings (the others: allocate.py's):")
        for key, (default, comment) in read_settings(globals()).items():
            print(f"  {f'--{key}={default!r}':<32} {comment}")
        print()
        configure(vars(allocate), ["--help"])
    S, _ = configure(globals(), own)
    C, _ = configure(vars(allocate), allocate_argv)
    # 1) the candidates, built once from the checkpoint's weights and its training data
    model, ckpt, data_dir, meta = open_run(C.out_dir, C.device, writes=True)
    by_frequency = tokens_by_frequency(f"{data_dir}/train.bin", meta["dtype"],
                                       model.config.vocab_size)
    candidates = build_candidates(model, by_frequency)
    # 2) allocate.py with them registered: one trace, every exit read off it
    with registered(candidates):
        tests = dict(EXIT_TESTS)
        allocated = allocate.main(allocate_argv)
    # 3) optionally, each exit's generation timed against uniform depth's; the verdicts
    timed = None
    if S.time:
        windows, _ = allocate.allocation_windows(data_dir, meta, model.config.block_size + 1, C)
        timed = timings(model, windows, tests, allocated, C)
    rows = exit_rows(model, tests, allocated, timed)
    print_table(rows, allocated, timed)
    result = {"goal": GOAL, "checkpoint": checkpoint_id(ckpt),
              "allocate_sha256": sha256_of(os.path.join(C.out_dir, "allocate.json")),
              "bar": allocated["bar"], "mean_loops": allocated["mean_loops"],
              "r_max": allocated["r_max"], "windows": allocated["windows"],
              "uniform": allocated["at_bar"]["uniform"], "loop_flops": loop_flops(model),
              "timed": bool(S.time), "exits": rows}
    save_atomic(os.path.join(C.out_dir, "exits.json"), result)
    print(f"\nwrote {C.out_dir}/exits.json")
    return result


if __name__ == "__main__":
    run(main)
