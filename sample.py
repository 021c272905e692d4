"""Generate text from a checkpoint with KV caches, at a fixed depth or a per-token exit.

    python sample.py --loops 4                          # every token runs 4 loops
    python sample.py --exit kl --start="$(cat prompt.txt)"  # each new token stops when its output settles

The sequences of a batch advance in lockstep, a token each per step; within a step every loop
computes every row, and a row that has stopped keeps what it had (masked, not gathered: a step never
waits for the host). Past block_size the context keeps its last half, prefilled again at --loops.
Each sample is printed whole at the end.
"""
import json
import os
import sys
from functools import partial
from math import inf

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters, guard_failures

from configurator import UserError, configure, run
from model import (DEVICES, EXIT_TESTS, MIN_EXIT_LOOP, CacheView, DepthPolicy, autocast, checkpoint_id, clock,
                   keeps_looping, uniform_depth)
from prepare import load_tokenizer, open_run

out_dir = "out-shakespeare"  # holds ckpt.pt
start = "\n"  # the prompt (a file's: --start="$(cat prompt.txt)")
num_samples = 3  # sequences, generated as one batch
max_new_tokens = 200  # new tokens per sequence
temperature = 0.8  # below 1e-6: greedy (argmax)
top_k = 200  # sample among the k likeliest tokens; 0: all
seed = 1337  # sequence i draws with the generator seed + i
loops = 0  # loops per token at fixed depth, and the prompt's with an exit; 0: mean_loops
exit = "none"  # per-token exit: a test of model.EXIT_TESTS, 'kl' (output settles) or 'state' (state settles)
exit_threshold = -1.0  # a token stops once its exit score is below this; -1: allocate.py's, or the test's own
r_max = 0  # with an exit, the most loops a token may run; 0: the model's max_loops
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu, cuda or cuda:N
dtype = "bfloat16" if torch.cuda.is_available() else "float32"  # autocast dtype of the matmuls
compile = torch.cuda.is_available()  # torch.compile a decode step's three parts (on CUDA, CUDA graphs)
RULES = dict(num_samples=(1, inf), max_new_tokens=(1, inf), seed=(0, 2 ** 62), exit_threshold=(-1, inf),
             dtype=("float32", "bfloat16"), device=DEVICES)


def exit_threshold_for(exit, out_dir, ckpt):
    """-> (the threshold of exit test `exit`, where it comes from): the one allocate.py calibrated for this
    checkpoint (its operating point, in out_dir/allocate.json), else the test's own default."""
    path = f"{out_dir}/allocate.json"
    if os.path.isfile(path):
        with open(path) as f:
            calibrated = json.load(f)
        thresholds = calibrated.get("operating_thresholds", {})
        if calibrated.get("checkpoint") == checkpoint_id(ckpt) and exit in thresholds:
            return thresholds[exit], f"calibrated for this checkpoint by allocate.py in {path}"
    return EXIT_TESTS[exit].threshold, "the exit test's default (no allocate.json for this checkpoint)"


def sample_next(logits, temperature, top_k, generators):
    """logits (B, V) -> next token ids (B,), row i drawn with generators[i]."""
    if temperature < 1e-6:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k:  # only the k likeliest tokens may be drawn
        kth_largest = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    # row by row, each with its sequence's generator: a sequence's text does not depend on what else is in its
    # batch (about ten launches a row: a large sampled batch pays for it on a GPU; greedy draws nothing)
    draws = [p.multinomial(1, generator=g) for p, g in zip(probs, generators)]
    return torch.cat(draws)


def prefill(model, caches, tokens, s, loops):
    """Tokens (B, T) at positions 0.. from s_0 (B, T, d), `loops` loops, K/V into the caches -> last logits (B, V)."""
    e = model.prelude(tokens, CacheView(caches["prelude"]))
    for _ in range(loops):
        s = model.core_step(e, s, CacheView(caches["core"]))
    return model.readout(s, CacheView(caches["coda"]))[:, -1]


class Decoder:
    """A batch's KV caches and its new tokens' state, at fixed addresses, and the three steps each new token
    takes: begin (its prelude, at pos), loop (one more masked loop of every row), end (its next logits).
    Each step writes only these buffers, never waits for the host and has the same shapes at every token, so
    that under --compile each is one CUDA graph: a token costs its loops + 2 launches, whatever the model.
    No step returns a tensor: a CUDA graph's output lives until its next replay, and one kept alive across
    calls makes torch record the next call as a new graph (CUDA-graph trees), a token at a time."""

    def __init__(self, model, s0, depth, compiler=None):
        c = model.config
        B = s0.size(0)
        self.model = model
        # the depth policy (uniform, or an exit test: keeps_looping) with its numbers as tensors, so that a graph
        # compiled for one threshold or r_max serves every other, uncompiled again
        threshold = torch.full((), depth.threshold, device=s0.device)  # filled on the device: no wait for a copy
        r_max = torch.full((), depth.r_max, device=s0.device)
        self.depth = DepthPolicy(depth.test, threshold, r_max)
        self.caches = {"prelude": model.new_cache(c.n_prelude, B), "core": model.new_cache(c.n_core, B),
                       "coda": model.new_cache(c.n_coda, B)}
        self.pos = torch.zeros(1, dtype=torch.long, device=s0.device)  # the new tokens' position in the caches
        self.e = s0.new_zeros(B, 1, c.n_embd)  # the new token's prelude output and state, in s0's dtype
        self.s = s0.new_zeros(B, 1, c.n_embd)
        # each row's last readout, in float32 or finer (the KL exit's softmaxes; float64 in the tests' references)
        self.carried = s0.new_zeros(B, 1, c.vocab_size, dtype=torch.promote_types(s0.dtype, torch.float32))
        self.looping = torch.zeros(B, dtype=torch.bool, device=s0.device)
        self.loops_ran = torch.zeros(B, dtype=torch.long, device=s0.device)
        self.stopped = torch.zeros((), dtype=torch.bool, device=s0.device)  # no row is looping
        for buffer in (self.pos, self.e, self.s, self.carried, self.looping, self.loops_ran, self.stopped):
            torch._dynamo.mark_static_address(buffer, guard=False)  # a CUDA graph writes them in place
        if compiler is not None:  # each step its own compiled graph (torch.compile in main)
            self.begin, self.loop, self.end = compiler(self.begin), compiler(self.loop), compiler(self.end)

    def begin(self, token, s_init):
        """Every row's new token (B,) at pos: its prelude into e; its loops start afresh from s_init (B, 1, d)."""
        self.e.copy_(self.model.prelude(token[:, None], CacheView(self.caches["prelude"], self.pos)))
        self.s.copy_(s_init)
        self.looping.fill_(True)
        self.loops_ran.zero_()

    def loop(self):
        """One more loop of every row's new token: every row runs, and one that has stopped keeps its s, carried
        logits (float32 at least), loop count and cache slots (keeps_looping: at most r_max loops). Then `stopped` says
        whether no row is looping (a 0-dim bool on the device: reading it is the caller's one host wait)."""
        model, test = self.model, self.depth.test
        active = self.looping.clone()  # the rows this loop runs: their cache slots take its K/V
        s_new = model.core_step(self.e, self.s, CacheView(self.caches["core"], self.pos, active))
        self.loops_ran.add_(active)
        logits_new = None
        if test is not None and test.needs_logits:
            logits_new = model.readout(s_new, CacheView(self.caches["coda"], self.pos, active)).to(self.carried.dtype)
        score = None  # uniform depth: the stop rule reads the loop count alone
        if test is not None:
            score = test.score(s_new, self.s, logits_new, self.carried)[:, 0]
        go_on = keeps_looping(self.loops_ran, score, self.depth)
        self.s.copy_(torch.where(active[:, None, None], s_new, self.s))
        if logits_new is not None:
            self.carried.copy_(torch.where(active[:, None, None], logits_new, self.carried))
        self.looping.copy_(active & go_on)
        self.stopped.copy_(~self.looping.any())

    def end(self):
        """Every row's next logits in carried (B, 1, V), valid until the next step: the KL exit carried each row's
        last readout, else one readout of every row's final state. The next token goes to the next position."""
        if self.depth.test is None or not self.depth.test.needs_logits:
            self.carried.copy_(self.model.readout(self.s, CacheView(self.caches["coda"], self.pos)))
        self.pos.add_(1)


# With an exit, a GPU runs behind the host: reading loop i-1's "no row is looping" once loop i is queued, the
# host never keeps it waiting (at most one extra loop runs, every row masked: it changes nothing). A CPU runs ops
# as they come: no lag.
LOOPS_AHEAD = {"cpu": 0, "cuda": 1}


class HostFlag:
    """A device bool copied to the host without waiting; read() waits only for the work queued before it."""

    def __init__(self, flag):
        self.value = flag.to("cpu", non_blocking=True, copy=True)  # into pinned memory from a GPU
        self.copied = torch.cuda.current_stream(flag.device).record_event() if flag.is_cuda else None  # a CPU: at once

    def read(self):
        # on a GPU this waits for the copy alone, never for the loops queued after it
        if self.copied is not None:
            self.copied.synchronize()
        return self.value.item()


@torch.no_grad()
def generate(model, idx, max_new_tokens, s0, pick, prompt_loops, depth, compiler=None):
    """Yields, step by step, the next token of every sequence after prompts idx (B, T0) and the
    loops run by the token it was read from: (B,), (B,). s0 (B, T0 + max_new_tokens, d) holds the
    initial state of every position; pick(logits (B, V)) -> (B,) chooses, and keeps no logits (the
    next step overwrites them). The prompt runs prompt_loops loops a token; each new token runs
    `depth` (a DepthPolicy). compiler: wraps each of a decode step's three parts (see Decoder)."""
    B, T0 = idx.shape
    block = model.config.block_size
    decoder = Decoder(model, s0, depth, compiler)
    ahead = LOOPS_AHEAD[idx.device.type]
    tokens = idx  # the prompts and every token chosen so far
    # 1) prefill: the prompt's last block_size tokens, at positions 0..
    first = max(0, T0 - block)
    logits = prefill(model, decoder.caches, tokens[:, first:], s0[:, first:T0], prompt_loops)
    loops = torch.full((B,), prompt_loops, device=idx.device)
    n_cached = T0 - first
    decoder.pos.fill_(n_cached)
    for step in range(max_new_tokens):
        # 2) every sequence picks its next token from its last readout
        next_token = pick(logits)
        yield next_token, loops
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        if step == max_new_tokens - 1:
            return  # the last token is never fed
        t = tokens.size(1) - 1  # the new token's index in tokens and s0
        if n_cached == block:
            # 3) the context is full: keep the last half before the new token, prefilled again
            first = t - block // 2
            prefill(model, decoder.caches, tokens[:, first:t], s0[:, first:t], prompt_loops)
            n_cached = block // 2
            decoder.pos.fill_(n_cached)
        # 4) the new token at the next position, looped until every row has stopped (at r_max at the latest)
        decoder.begin(next_token, s0[:, t:t + 1])
        flags = []  # "no row is looping" after each loop from MIN_EXIT_LOOP, read `ahead` loops later
        for loop in range(1, depth.r_max + 1):
            decoder.loop()
            if depth.test is not None and loop >= MIN_EXIT_LOOP:
                flags.append(HostFlag(decoder.stopped))
            if len(flags) > ahead and flags[-1 - ahead].read():
                break
        decoder.end()
        logits = decoder.carried[:, 0]
        loops = decoder.loops_ran.clone()
        n_cached += 1


def main(argv=()):
    C, _ = configure(globals(), argv)
    model, ckpt, data_dir, _ = open_run(C.out_dir, C.device, splits=())  # its tokenizer only
    encode, decode = load_tokenizer(data_dir)
    ids = encode(C.start)
    # the prompt must survive the round trip: a tokenizer that drops what it cannot encode would
    # otherwise continue a prompt the user did not write
    if not ids or decode(ids) != C.start:
        raise UserError("--start: the prompt is empty or the tokenizer cannot encode it exactly")
    prompt_loops = C.loops or model.config.mean_loops
    depth = uniform_depth(prompt_loops)
    if C.exit != "none":
        if C.exit not in EXIT_TESTS:  # not in RULES: a test registered in model.py is a choice at once
            raise UserError(f"--exit must be none or one of {', '.join(EXIT_TESTS)}, got {C.exit!r}")
        r_max = C.r_max or model.config.max_loops
        if r_max < MIN_EXIT_LOOP:  # an exit compares two loops
            raise UserError(f"--r_max={r_max}: an exit needs r_max >= {MIN_EXIT_LOOP}")
        threshold, source = C.exit_threshold, "--exit_threshold"
        if threshold < 0:
            threshold, source = exit_threshold_for(C.exit, C.out_dir, ckpt)
        print(f"--exit={C.exit} at threshold {threshold:.3g}: {source}", file=sys.stderr)
        depth = DepthPolicy(EXIT_TESTS[C.exit], threshold, r_max)
    n = C.num_samples
    generators = [torch.Generator(C.device).manual_seed(C.seed + i) for i in range(n)]
    # every token starts from a zero state, as allocate.py calibrates the exits (training's noise is for training)
    s0 = torch.zeros(n, len(ids) + C.max_new_tokens, model.config.n_embd, device=C.device)
    pick = partial(sample_next, temperature=C.temperature, top_k=C.top_k, generators=generators)
    compiler = None  # each decode step's part one graph, on CUDA a CUDA graph (inductor alone on the CPU)
    if C.compile:
        compiler = partial(torch.compile, mode="reduce-overhead", fullgraph=True)
    new_tokens, loops_run = [], []  # on the device, read once at the end: no wait a step
    started = clock(C.device)
    with autocast(C.device, C.dtype):
        idx = torch.tensor([ids] * n, device=C.device)
        for next_token, loops in generate(model, idx, C.max_new_tokens, s0, pick, prompt_loops, depth, compiler):
            new_tokens.append(next_token)
            loops_run.append(loops)
            if len(new_tokens) == 3:  # two decode steps warm up (compiling, then recording CUDA graphs): time the rest
                started = clock(C.device)
    seconds = clock(C.device) - started
    new_ids = torch.stack(new_tokens, 1).tolist()
    loops_run = torch.stack(loops_run, 1)  # (n, max_new_tokens)
    for row in new_ids:  # each sample whole (decoded together, so that no character is cut between tokens)
        print(decode(ids + row), end="\n---------------\n")
    mean_loops = loops_run.float().mean().item()
    deepest = loops_run.amax(0).float().mean().item()  # a lockstep step waits for its deepest token
    timed = n * max(0, C.max_new_tokens - 3)  # the prefill's token and the two warm-up steps' are not timed
    flops = model.inference_flops(mean_loops, model.config.block_size, depth.test)
    print(f"{timed / seconds:.1f} tokens/s ({timed} timed), {mean_loops:.2f} loops (a step's deepest {deepest:.2f}), "
          f"{flops / 1e6:.3g} MFLOP per token (attention over a full block), {C.dtype}", file=sys.stderr)
    loops_run = loops_run.flatten().tolist()
    histogram = [f"{k}:{loops_run.count(k)}" for k in sorted(set(loops_run))]
    print("loops per new token (loops:tokens):", *histogram, file=sys.stderr)
    if C.compile:  # proof that the graphs held: what torch.compile did in this process
        recompiled = sum(len(reasons) for reasons in guard_failures.values())  # a guard failed: compiled again
        print(f"compiled: {counters['stats']['unique_graphs']} graphs, {sum(counters['graph_break'].values())} graph "
              f"breaks, {recompiled} recompilations, {counters['inductor']['cudagraph_skips']} CUDA-graph skips",
              file=sys.stderr)
    return new_ids


if __name__ == "__main__":
    run(main)
