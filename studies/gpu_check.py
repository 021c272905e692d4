"""The measurements ./studies/gpu_check.sh reports on one GPU: a training run's MFU and peak memory, and decoding's
tokens/s at every batch and depth, each decode row in this one process so that a step's graphs compile
once per shape and policy (sample.py run again per row would compile them all again).

    python -m studies.gpu_check training LABEL PEAK_FLOPS TRAIN_ARGS...   # one run: MFU, peak memory
    python -m studies.gpu_check decoding OUT_DIR NEW_TOKENS [SAMPLE_FLAGS...]   # every decode row
    python -m studies.gpu_check launches     # the launch counts; conditional nodes or not
"""
import contextlib
import io
import json
import itertools
import resource
import statistics
import sys

import torch
from torch._inductor import cudagraph_trees

import train
from engine.cli import main as engine_main
from engine.decoder import conditional_nodes_available
from studies import launches
from configurator import UserError

BATCHES = (1, 32)
DEPTHS = (["--loops=4"], ["--loops=8"], ["--loops=16"], ["--exit=kl"], ["--exit=state"])  # exits: allocate's
# each row by the engine, then by sample.py's own generate (eager, a host read a loop with an exit)
HARNESSES = {"engine": [], "sample.py": ["--baseline=True"]}


def training(label, peak_flops, train_args):
    """train.py in this process -> one line: MFU (the median FLOP rate of the steps after the first two, which
    compile) and the peak memory."""
    train.main(train_args)
    out_dir = train.configure(vars(train), train_args)[0].out_dir
    with open(f"{out_dir}/metrics.jsonl") as f:
        steps = [json.loads(line) for line in f if '"flops_per_s"' in line]
    rate = statistics.median(step["flops_per_s"] for step in steps if step["iter"] >= 2)
    if torch.cuda.is_available():
        peak = f"peak memory {torch.cuda.max_memory_allocated() / 2 ** 30:.2f} GiB (max_memory_allocated)"
    else:  # the dry run: no GPU
        peak = f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20:.2f} GiB (no GPU)"
    print(f"{label:8s} MFU {100 * rate / peak_flops:.3g}% ({rate:.3g} FLOP/s over {peak_flops:.3g}), {peak}")


def cuda_graphs_recorded():
    """-> how many CUDA graphs torch.compile's CUDA-graph trees have recorded in this process (every node of
    every tree; 0 without a GPU). A decode row that holds its graphs records three: begin, loop and end."""
    if not torch.cuda.is_available():
        return 0
    manager = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
    nodes = [node for roots in manager.roots.values() for node in roots] if manager is not None else []
    count = 0
    while nodes:
        node = nodes.pop()
        count += 1
        nodes.extend(child for children in node.children.values() for child in children)
    return count


def decoding(out_dir, new_tokens, sample_flags):
    """python -m engine's report for each batch and depth, greedy, and sample.py's own generate
    timed in the same harness (--baseline): tokens/s, loops, what torch.compile did, and the CUDA
    graphs the row recorded (a row's caches are new buffers: its graphs are recorded anew)."""
    print("(in one process: a row's recompilations are its new batch size or exit test, compiled once)")
    for batch, depth, (harness, flags) in itertools.product(BATCHES, DEPTHS, HARNESSES.items()):
        argv = [f"--out_dir={out_dir}", f"--num_samples={batch}", "--temperature=0",
                f"--max_new_tokens={new_tokens}", *depth, *sample_flags, *flags]
        row = f"batch {batch:2d}  {' '.join(depth):14s} {harness:9s}"
        recorded_before = cuda_graphs_recorded()
        try:
            # the samples' text and the engine's own lines are not this table's
            with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                report = engine_main(argv)
        except (UserError, RuntimeError, OSError) as err:  # one row failed: say so, and go on
            print(f"{row} failed: {type(err).__name__}: {err}")
            continue
        recorded = cuda_graphs_recorded() - recorded_before
        line = (f"{report['tokens_per_s']:.1f} tokens/s, {report['mean_loops']:.2f} loops "
                f"(deepest {report['deepest_loops']:.2f}), {report['dtype']}")
        if report["compiled"]:
            line += (f" | compiled: {report['graphs']} graphs, {report['graph_breaks']} breaks, "
                     f"{report['recompilations']} recompilations, {report['cudagraph_skips']} "
                     f"CUDA-graph skips, device loops {report['device_loops']}")
        print(f"{row} {line} | {recorded} CUDA graphs recorded")


def launches_and_conditional_nodes():
    """The decode's launch counts (python -m studies.launches; S1's micro-step, minutes on the CPU
    and the same on any machine, is left to it), and whether this torch's CUDA graphs have the
    conditional nodes an exit's loops need to stay on the device."""
    print(f"conditional nodes: {conditional_nodes_available('cuda')} (torch {torch.__version__})")
    launches.main(["--micro_step=False"])

if __name__ == "__main__":
    part, *args = sys.argv[1:]
    if part == "training":
        training(args[0], float(args[1]), args[2:])
    elif part == "launches":
        launches_and_conditional_nodes()
    else:
        decoding(args[0], int(args[1]), args[2:])
