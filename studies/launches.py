"""Kernel launches counted on the CPU as a GPU would make them: each graph torch.compile makes is
scheduled by inductor for a GPU (its triton backend: code generated and read, never run), and each
op run eagerly outside the graphs counts as one launch (autograd's gradient sums, a pick, a copy).

    python -m studies.launches                      # S0's decode graphs, S1's training micro-step
    python -m studies.launches --report=launches.json --gpu_cat=False

One line `NAME: N launches` a graph or step: S0's decode steps (batch 1, bf16, greedy, random
weights: launches do not depend on them), a whole new token, and a forward and backward of S1's
training micro-step as train.py runs it. A custom op written in Python (torch's chunked loss)
counts the ops its body runs, and a cat is lowered as inductor lowers it for a GPU tensor (for a
CPU one it copies each input in a kernel of its own; --gpu_cat=False counts that). Where the
count may still differ from a GPU's: attention is the CPU's flash kernel, with its layouts.
count_launches(fn, *args) is the counter the tests and the other studies import. Needs triton
(studies/requirements.txt) for inductor's GPU code.
"""
import copy
import re
from contextlib import ExitStack
from functools import partial
from typing import NamedTuple
from unittest import mock

import torch
import torch._functorch.config
import torch._inductor.compile_fx
import torch._inductor.config
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor.async_compile import AsyncCompile
from torch._inductor.graph import GraphLowering
from torch.utils._python_dispatch import TorchDispatchMode

import sample
from configurator import configure, run
from engine.decoder import Decoder, generate
from model import EXIT_TESTS, GPT, DepthPolicy, GPTConfig, autocast, save_atomic, uniform_depth

report = ""  # a JSON file for the counts; "": none
gpu_cat = True  # inductor's cat lowered as for a GPU tensor; False: as for a CPU one (a copy each)
# The graphs' kernels were the same at T = 64 and 2048; the loss's chunks grow with B x T
train_tokens = 2048  # the micro-step's sequence length (S1's)
micro_step = True  # count S1's micro-step too (4 minutes and 14 GB on a 2-core machine)
RULES = {"train_tokens": (1, 2048)}

ATEN = torch.ops.aten
# Ops that launch nothing on a GPU: allocations, and reading a value the host holds (the engine
# copies a device flag to the host, counted as that copy, and reads it there).
NO_KERNEL = {ATEN.empty.memory_format, ATEN.empty_strided.default, ATEN.empty_like.default,
             ATEN.new_empty.default, ATEN.new_empty_strided.default, ATEN.lift_fresh.default,
             ATEN._local_scalar_dense.default, ATEN.item.default}
# The lines of inductor's generated code that launch: a fused kernel of its own (triton), or an
# extern one, a library's matmul or an aten op it falls back to (attention)
FUSED = re.compile(r"^\s*triton_\w+\.run\(")
EXTERN = re.compile(r"^\s*(\w+ = )?(extern_kernels\.\w+|torch\.ops\.\w+\.\w+(\.\w+)?)\(")


def launches_in(code):
    """-> (fused kernels, extern kernels) of one run of inductor's generated wrapper code: the
    launching lines of its call()."""
    body = code[code.index("def call("):]
    lines = body.splitlines()
    return (sum(1 for line in lines if FUSED.match(line)),
            sum(1 for line in lines if EXTERN.match(line)))


class _Unbuilt:
    """A triton kernel left uncompiled: the CPU has no triton driver, and nothing runs it."""

    def run(self, *args, **kwargs):
        raise RuntimeError("a kernel counted for a GPU cannot run on the CPU")

    def precompile(self, *args, **kwargs):
        pass


def gpu_kernels(gm, example_inputs, compile_fx_kwargs, gpu_cat=True):
    """-> [(fused, extern) kernels of its forward, of its backward ((0, 0) without)] of dynamo's
    graph gm as inductor would schedule it for a GPU: its triton backend on the CPU, the code
    generated and read, never run; gpu_cat False: each cat lowered as for the CPU."""
    codes = []
    backward = []

    def inner_compile(graph, inputs, **kwargs):
        backward.append(kwargs.get("is_backward", False))
        return torch._inductor.compile_fx.compile_fx_inner(graph, inputs, **kwargs)

    def uncompiled(self, kernel_name, source_code, device_str="cuda"):
        return _Unbuilt()

    with ExitStack() as stack:
        stack.enter_context(torch._inductor.config.patch(
            cpu_backend="triton", fx_graph_cache=False, compile_threads=1))
        # the backward graph now, not at the first backward call (which never comes here)
        stack.enter_context(torch._functorch.config.patch(
            force_non_lazy_backward_lowering=True, enable_autograd_cache=False))
        stack.enter_context(mock.patch.object(GraphLowering, "save_output_code", codes.append))
        stack.enter_context(mock.patch.object(AsyncCompile, "triton", uncompiled))
        if gpu_cat:
            lowered_as_on_a_gpu(stack)
        # triton's own hash asks a GPU driver for its target
        stack.enter_context(mock.patch("torch.utils._triton.triton_hash_with_backend",
                                       lambda: "counted"))
        # compile_fx may change the graph it is given
        REAL_COMPILE_FX(copy.deepcopy(gm), example_inputs, inner_compile=inner_compile,
                        **compile_fx_kwargs)
    halves = []
    for is_backward in (False, True):
        kernels = [launches_in(code) for code, bw in zip(codes, backward) if bw == is_backward]
        halves.append((sum(fused for fused, _ in kernels), sum(extern for _, extern in kernels)))
    return halves


REAL_COMPILE_FX = torch._inductor.compile_fx.compile_fx


def lowered_as_on_a_gpu(stack):
    """Within stack: inductor lowers a cat as for a GPU tensor. For a CPU tensor it copies each
    input in a kernel of its own; for a GPU one it reads the inputs in the kernels that use the
    cat, or writes them where they are made, where it can (its test of the device made false)."""
    lowering = torch._inductor.lowering.cat.__wrapped__
    code = lowering.__code__
    if "cpu" not in code.co_consts:
        raise RuntimeError("this torch's cat lowering has no CPU test to turn off")
    stack.callback(setattr, lowering, "__code__", code)
    lowering.__code__ = code.replace(co_consts=tuple("not-a-device" if const == "cpu" else const
                                                     for const in code.co_consts))


class Launches(NamedTuple):
    """One call's launches: the compiled graphs' fused kernels (inductor's own) and extern ones
    (matmuls, attention), and the ops run eagerly outside the graphs."""
    fused: int = 0
    extern: int = 0
    eager: int = 0

    @property
    def compiled(self):
        return self.fused + self.extern

    @property
    def total(self):
        return self.fused + self.extern + self.eager

    # counts, added and subtracted field by field (a tuple's + would join them)
    def __add__(self, other):
        return Launches(*(mine + theirs for mine, theirs in zip(self, other)))

    def __sub__(self, other):
        return Launches(*(mine - theirs for mine, theirs in zip(self, other)))


class LaunchCounter(TorchDispatchMode):
    """While entered, every torch.compile (inductor) graph compiled is counted as inductor would
    schedule it for a GPU and runs eagerly (aot_autograd's graphs, so that its backward is one
    graph too); an op dispatched outside the graphs counts as one launch unless it is a view or
    an allocation, and a custom op as the ops its body runs. gpu_cat False: each cat lowered as
    for a CPU tensor. Entering resets dynamo: graphs compiled before would run uncounted."""

    @classmethod
    def ignore_compile_internals(cls):
        # dynamo compiles and runs its graphs under this mode
        return True

    def __init__(self, gpu_cat=True):
        super().__init__()
        self.gpu_cat = gpu_cat
        self.inside_graphs = 0
        self.reset()

    def reset(self):
        """Counts from zero (compiled graphs stay compiled)."""
        self.launches = Launches()
        self.eager_ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # a custom op written in Python (torch's chunked loss) launches what its body runs:
        # counted there, with this mode entered again (it is off while it handles an op)
        custom = torch._library.custom_ops._maybe_get_opdef(func)
        if custom is not None and not self.inside_graphs:
            TorchDispatchMode.__enter__(self)
            try:
                return custom._init_fn(*args, **(kwargs or {}))
            finally:
                TorchDispatchMode.__exit__(self, None, None, None)
        if not self.inside_graphs and not func.is_view and func not in NO_KERNEL:
            self.launches += Launches(eager=1)
            self.eager_ops.append(func.__name__)
        return func(*args, **(kwargs or {}))

    def running(self, kernels, graph):
        """aot_autograd's forward or backward graph run eagerly (boxed): each run adds the
        (fused, extern) kernels its GPU code launches; the ops it runs are not counted again."""
        def run(*args):
            self.launches += Launches(*kernels)
            self.inside_graphs += 1
            try:
                return graph(*args)
            finally:
                self.inside_graphs -= 1
        return make_boxed_func(run)

    def compile_fx(self, gm, example_inputs, **kwargs):
        """inductor's entry point while counting: the GPU's kernels, then an eager graph."""
        # compile_fx calls itself again under its config patches (mode="reduce-overhead")
        if "inner_compile" in kwargs:
            return REAL_COMPILE_FX(gm, example_inputs, **kwargs)
        forward, backward = gpu_kernels(gm, example_inputs, kwargs, self.gpu_cat)
        # mutated inputs written in the graph, as inductor does, not copied back after it
        runtime = aot_autograd(fw_compiler=lambda graph, _: self.running(forward, graph),
                               bw_compiler=lambda graph, _: self.running(backward, graph),
                               keep_inference_input_mutations=True)
        return runtime(gm, example_inputs)

    def __enter__(self):
        torch._dynamo.reset()
        self.patch = mock.patch.object(torch._inductor.compile_fx, "compile_fx", self.compile_fx)
        self.patch.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.patch.__exit__(*exc)
        # its graphs run eagerly: none is left for code run after it
        torch._dynamo.reset()


def count_launches(fn, *args, warm_up=1, gpu_cat=True):
    """-> Launches of one call of fn(*args) after warm_up calls (the first compiles its graphs):
    each torch.compile graph's kernels as inductor would schedule them for a GPU, and one launch
    for each op run outside the graphs that is not a view or an allocation."""
    with LaunchCounter(gpu_cat) as counter:
        for _ in range(warm_up):
            fn(*args)
        counter.reset()
        fn(*args)
        return counter.launches


# ---- the study: S0's decode, S1's training micro-step
S0 = GPTConfig()
S1 = GPTConfig(block_size=2048, n_embd=576, n_head=9, n_kv_head=3, ffn_hidden=1536, mean_loops=8,
               max_loops=32, bptt_k=8)
S1_BATCH = 4
S1_MICRO_STEPS = 32
PROMPT = 16  # the tokens cached before a decoded one
LOOPS = 4  # S0's mean depth
# an exit whose test never fires: every token runs r_max = LOOPS loops, as at uniform depth
EXITS = {name: DepthPolicy(EXIT_TESTS[name], 0.0, LOOPS) for name in ("kl", "state")}


def greedy():
    """sample.py's pick at temperature 0 (an argmax, which a decode step's graph holds)."""
    return partial(sample.sample_next, temperature=0.0, top_k=0, generators=[])


def decode_parts(model, depth, gpu_cat=True):
    """-> {part: Launches of one call} of a Decoder's compiled steps at S0's shape, batch 1:
    uniform depth's whole step, or an exit's begin, loop and end."""
    compiler = partial(torch.compile, mode="reduce-overhead", fullgraph=True)
    decoder = Decoder(model, 1, depth, "cpu", compiler, greedy())
    decoder.pos.fill_(PROMPT)
    parts = ["step"] if depth.test is None else ["begin", "loop", "end"]
    return {part: count_launches(getattr(decoder, part), gpu_cat=gpu_cat) for part in parts}


def decode_token(model, depth, gpu_cat=True):
    """-> Launches of one new token as python -m engine decodes it (greedy, compiled): its
    steps, and what runs outside them (copies of the token and of an exit's flags)."""
    compiler = partial(torch.compile, mode="reduce-overhead", fullgraph=True)
    prompts = torch.randint(S0.vocab_size, (1, PROMPT))
    steps = generate(model, prompts, 8, greedy(), LOOPS, depth, compiler, pick_in_step=True)
    # the prefill's token, then two decoded ones (the first compiles) before the one counted
    launches = count_launches(lambda: next(steps), warm_up=3, gpu_cat=gpu_cat)
    steps.close()
    return launches


def train_micro_step(T, gpu_cat=True):
    """-> Launches of a forward and backward of S1's micro-step at depth mean_loops (all loops
    with gradients: bptt_k = 8) as train.train_step runs it, each part compiled as train.py
    compiles it, its gradients added to those of the micro-step before (S1 accumulates 32)."""
    torch.manual_seed(0)
    model = GPT(S1).train()
    model.core.compile()
    model.prelude = torch.compile(model.prelude)
    model.readout = torch.compile(model.readout)
    model.grad_loops = torch.compile(model.grad_loops)
    x = torch.randint(S1.vocab_size, (S1_BATCH, T))
    y = torch.randint(S1.vocab_size, (S1_BATCH, T))
    noise = torch.Generator().manual_seed(0)

    def micro_step():
        with autocast("cpu", "bfloat16"):
            loss = model(x, y, loops=S1.mean_loops, generator=noise) / S1_MICRO_STEPS
        loss.backward()
    return count_launches(micro_step, gpu_cat=gpu_cat)


def main(argv=()):
    """-> {name: {"launches", "fused", "extern", "eager"}}, each printed as a line."""
    C, _ = configure(globals(), argv)
    torch.manual_seed(0)
    s0 = GPT(S0).eval()
    counts = {}
    notes = {}
    with torch.no_grad(), autocast("cpu", "bfloat16"):
        for r in (LOOPS, LOOPS - 1):
            counts[f"decode step r={r}"] = decode_parts(s0, uniform_depth(r), C.gpu_cat)["step"]
        # a loop in the uniform step's graph: what one more loop adds to it
        step, shorter = counts[f"decode step r={LOOPS}"], counts[f"decode step r={LOOPS - 1}"]
        counts["decode loop"] = step - shorter
        notes["decode loop"] = f"one more loop of the step: r={LOOPS}'s minus r={LOOPS - 1}'s"
        for name, depth in EXITS.items():
            for part, launches in decode_parts(s0, depth, C.gpu_cat).items():
                counts[f"decode {part} exit={name}"] = launches
        counts["decode token r=4"] = decode_token(s0, uniform_depth(LOOPS), C.gpu_cat)
        notes["decode token r=4"] = "the step, and the copy of the token it picked"
        for name, depth in EXITS.items():
            counts[f"decode token exit={name} r=4"] = decode_token(s0, depth, C.gpu_cat)
            notes[f"decode token exit={name} r=4"] = ("begin, 4 loops, end, the flags copied "
                                                      "from loop 2, the copies of token and loops")
    if C.micro_step:
        name = f"train micro-step S1 4x{C.train_tokens} r=8"
        counts[name] = train_micro_step(C.train_tokens, C.gpu_cat)
        notes[name] = "the gradients added into the micro-step before's, the loss's chunks"
    print("S0 decode: batch 1, bf16, greedy, 16 tokens cached; each graph's kernels as inductor "
          "schedules them for a GPU, and the ops run outside the graphs")
    for name, launches in counts.items():
        note = f"; {notes[name]}" if name in notes else ""
        print(f"{name}: {launches.total} launches ({launches.extern} matmuls and attention, "
              f"{launches.fused} fused, {launches.eager} eager{note})")
    table = {name: launches._asdict() | {"launches": launches.total}
             for name, launches in counts.items()}
    if C.report:
        save_atomic(C.report, table)
    return table


if __name__ == "__main__":
    run(main)
