"""python -m engine: sample.py's generation at a GPU's speed, with its measurements.

    python -m engine --out_dir=out-shakespeare --loops=4 --num_samples=32 --temperature=0
    python -m engine --exit=kl --report=decode.json     # tokens/s, loops, FLOPs: decode.json

Takes sample.py's settings (python sample.py --help) and prints exactly what sample.py prints;
then, on stderr, the tokens/s of the decode steps after two warm-up steps (compiling, then
recording CUDA graphs), the loops and FLOPs per new token and, compiled, what torch.compile did.
Its own settings: --compile (True on CUDA: each decode step one compiled graph, a CUDA graph on a
GPU), --device_loops (with an exit on a GPU whose CUDA graphs have conditional nodes: a whole new
token one CUDA graph, no host read a loop), --baseline (time sample.py's own generate in the same
harness instead) and --report=FILE (the measurements as JSON, which the studies read).
"""
import sys
from functools import partial

import torch
from torch._dynamo.utils import counters, guard_failures

import sample
from configurator import configure
from engine.decoder import conditional_nodes_available, generate
from engine import clock
from model import autocast, save_atomic

report = ""  # a JSON file for the measurements (the studies read it); "": none
compile = torch.cuda.is_available()  # each decode step one compiled graph (CUDA: a CUDA graph)
# with an exit, where CUDA graphs have conditional nodes: a new token's loops decided on the GPU
device_loops = True
# time sample.py's own generate instead (eager, a host read a loop with an exit): the baseline
# the engine is measured against, in this same harness
baseline = False
# decode steps not timed: the first compiles, the second records the CUDA graphs
WARM_UP_STEPS = 2


def split_argv(argv):
    """-> (the arguments of the engine's own settings, sample.py's)."""
    own = []
    others = []
    for arg in argv:
        key = arg.removeprefix("--").partition("=")[0]
        if key in ("report", "compile", "device_loops", "baseline"):
            own.append(arg)
        else:
            others.append(arg)
    return own, others


def compile_statistics():
    """What torch.compile did in this process: graphs, graph breaks, recompilations (a guard
    failed: compiled again) and CUDA-graph skips."""
    return {"graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "recompilations": sum(len(reasons) for reasons in guard_failures.values()),
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}


def main(argv=()):
    """-> the report: sample.main's {"new_ids", "loops"} and the measurements."""
    own, sample_argv = split_argv(argv)
    if "--help" in argv:
        print(__doc__)
        configure(vars(sample), ["--help"])
    E, _ = configure(globals(), own)
    C, _ = configure(vars(sample), sample_argv)
    model, _, ids, decode_ids, prompt_loops, depth, pick = sample.setup(C)
    # the baseline neither compiles nor decides loops on the device
    compiled = E.compile and not E.baseline
    device_loops = (E.device_loops and not E.baseline and depth.test is not None
                    and conditional_nodes_available(C.device))
    compiler = None
    # the engine captures a token's CUDA graph itself with device loops: none of torch.compile's
    if compiled and device_loops:
        compiler = partial(torch.compile, fullgraph=True)
    elif compiled:
        compiler = partial(torch.compile, mode="reduce-overhead", fullgraph=True)
    # greedy: an argmax, picked in the decode step's graph (sampling draws from a generator per row)
    pick_in_step = C.temperature < 1e-6
    prompts = torch.tensor([ids] * C.num_samples, device=C.device)
    # the new tokens stay on the device, read once at the end: no wait a step
    new_tokens = []
    loops_run = []
    started = clock(C.device)
    with autocast(C.device, C.dtype):
        if E.baseline:
            steps = sample.generate(model, prompts, C.max_new_tokens, pick, prompt_loops, depth)
        else:
            steps = generate(model, prompts, C.max_new_tokens, pick, prompt_loops, depth,
                             compiler, pick_in_step, device_loops)
        for next_token, loops in steps:
            new_tokens.append(next_token)
            loops_run.append(loops)
            # the prefill's token and the warm-up steps' are not timed
            if len(new_tokens) == 1 + WARM_UP_STEPS:
                started = clock(C.device)
    seconds = clock(C.device) - started
    new_ids = torch.stack(new_tokens, 1).tolist()
    loops_run = torch.stack(loops_run, 1)
    for row in new_ids:
        print(decode_ids(ids + row), end="\n---------------\n")
    timed = C.num_samples * max(0, C.max_new_tokens - 1 - WARM_UP_STEPS)
    mean_loops = loops_run.float().mean().item()
    # a lockstep step waits for its deepest token
    deepest = loops_run.amax(0).float().mean().item()
    flops = model.inference_flops(mean_loops, model.config.block_size, depth.test)
    measured = {"new_ids": new_ids, "loops": loops_run.tolist(), "tokens_per_s": timed / seconds,
                "timed_tokens": timed, "mean_loops": mean_loops, "deepest_loops": deepest,
                "flops_per_token": flops, "dtype": C.dtype, "compiled": compiled,
                "device_loops": device_loops, "baseline": E.baseline}
    print(f"{timed / seconds:.1f} tokens/s ({timed} timed), {mean_loops:.2f} loops (a step's "
          f"deepest {deepest:.2f}), {flops / 1e6:.3g} MFLOP per token (attention over a full "
          f"block), {C.dtype}", file=sys.stderr)
    if compiled:
        measured |= compile_statistics()
        print(f"compiled: {measured['graphs']} graphs, {measured['graph_breaks']} graph breaks, "
              f"{measured['recompilations']} recompilations, {measured['cudagraph_skips']} "
              f"CUDA-graph skips", file=sys.stderr)
    if E.report:
        save_atomic(E.report, measured)
    return measured
