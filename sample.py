"""Generate text from a checkpoint with KV caches, at a fixed depth or a per-token exit.

    python sample.py --loops 4                          # every token runs 4 loops
    python sample.py --exit kl --start="$(cat prompt.txt)"  # each new token stops when its output settles

The sequences of a batch advance in lockstep, a token each per step; within a step every loop
computes every row, and a row that has stopped keeps what it had (masked, not gathered: a step never
waits for the host). Past block_size the context keeps its last half, prefilled again at --loops.
With one sample the text is printed as it is chosen; with several, each whole at the end.
"""
import json
import os
import sys
from math import inf

import torch
import torch.nn.functional as F

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
seed = 1337  # sequence i draws with seed + i
loops = 0  # loops per token at fixed depth, and the prompt's with an exit; 0: mean_loops
exit = "none"  # per-token exit: a test of model.EXIT_TESTS, 'kl' (output settles) or 'state' (state settles)
exit_threshold = -1.0  # a token stops once its exit score is below this; -1: allocate.py's, or the test's own
r_max = 0  # with an exit, the most loops a token may run; 0: the model's max_loops
state_init = "zero"  # s_0: 'zero' (as allocate.py calibrates the exits) or 'noise' (as in training)
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu, cuda or cuda:N
dtype = "bfloat16" if torch.cuda.is_available() else "float32"  # autocast dtype of the matmuls
compile = torch.cuda.is_available()  # torch.compile the decode loop (on CUDA a CUDA graph: one launch a loop)
RULES = dict(num_samples=(1, inf), max_new_tokens=(1, inf), seed=(0, 2 ** 62), exit_threshold=(-1, inf),
             state_init=("zero", "noise"), dtype=("float32", "bfloat16"), device=DEVICES)


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


def initial_states(model, n_seqs, length, mode, seed, device):
    """s_0 of every position (n_seqs, length, d), sequence i's from generator seed + i."""
    # a generator per sequence: a sequence's text does not depend on what else is in its batch
    e = torch.empty(1, length, model.config.n_embd, device=device)
    generators = [torch.Generator(device).manual_seed(seed + i) for i in range(n_seqs)]
    return torch.cat([model.init_state(e, mode, g) for g in generators])


def sample_next(logits, temperature, top_k, generators):
    """logits (B, V) -> next token ids (B,), row i drawn with generators[i]."""
    if temperature < 1e-6:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k:  # only the k likeliest tokens may be drawn
        kth_largest = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    # row by row, each with its sequence's generator (see initial_states)
    draws = [p.multinomial(1, generator=g) for p, g in zip(probs, generators)]
    return torch.cat(draws)


def prefill(model, caches, tokens, s, loops):
    """Tokens (B, T) at positions 0.. from s_0 (B, T, d), `loops` loops, K/V into the caches -> last logits (B, V)."""
    e = model.prelude(tokens, CacheView(caches["prelude"]))
    for _ in range(loops):
        s = model.core_step(e, s, CacheView(caches["core"]))
    return model.readout(s, CacheView(caches["coda"]))[:, -1]


def decode_loop(model, caches, e, s, logits, looping, loops, pos, depth):
    """One more loop of a new token per row, e (B, 1, d) at pos ((1,) long): from MIN_EXIT_LOOP a row stops once its
    exit score is below the threshold (at r_max at the latest). Every row runs; a stopped one keeps its s, logits
    (float32: the KL exit), loops and cache slots, in place, with no host sync. -> "no row is looping" (0-dim bool)"""
    active = looping.clone()  # the rows this loop runs: their cache slots take its K/V
    s_new = model.core_step(e, s, CacheView(caches["core"], pos, active))
    loops.add_(active)
    logits_new = None
    if depth.test is not None and depth.test.needs_logits:
        logits_new = model.readout(s_new, CacheView(caches["coda"], pos, active)).float()
    score = None  # uniform depth: the stop rule reads loops alone
    if depth.test is not None:
        score = depth.test.score(s_new, s, logits_new, logits)[:, 0]
    go_on = keeps_looping(loops, score, depth)
    # written in place: the buffers keep their addresses, which a CUDA graph's replays read and write
    s.copy_(torch.where(active[:, None, None], s_new, s))
    if logits_new is not None:
        logits.copy_(torch.where(active[:, None, None], logits_new, logits))
    looping.copy_(active & go_on)
    return ~looping.any()


DECODE_LOOP = decode_loop  # what generate calls: main puts it here compiled (--compile)
# A GPU runs behind the host: reading loop i-1's flag once loop i is queued, the host never keeps it waiting
# (at most one extra loop runs, every row masked: it changes nothing). A CPU runs ops as they come: no lag.
LOOPS_AHEAD = {"cpu": 0, "cuda": 1}


class HostFlag:
    """A device bool copied to the host without waiting; read() waits only for the work queued before it."""

    def __init__(self, flag):
        self.value = flag.to("cpu", non_blocking=True, copy=True)  # into pinned memory from a GPU
        self.copied = torch.cuda.current_stream().record_event() if flag.is_cuda else None  # a CPU: at once

    def read(self):
        # on a GPU this waits for the copy alone, never for the loops queued after it
        if self.copied is not None:
            self.copied.synchronize()
        return self.value.item()


@torch.no_grad()
def generate(model, idx, max_new_tokens, s0, pick, prompt_loops, depth):
    """Yields, step by step, the next token of every sequence after prompts idx (B, T0) and the
    loops run by the token it was read from: (B,), (B,). s0 (B, T0 + max_new_tokens, d) holds the
    initial state of every position; pick(logits (B, V)) -> (B,) chooses. The prompt runs
    prompt_loops loops a token; each new token runs `depth` (a DepthPolicy, see decode_loop)."""
    B, T0 = idx.shape
    c = model.config
    block = c.block_size
    caches = {"prelude": model.new_cache(c.n_prelude, B), "core": model.new_cache(c.n_core, B),
              "coda": model.new_cache(c.n_coda, B)}
    # a new token's loops, in place at fixed addresses (a CUDA graph writes them): see decode_loop
    buffers = (s0.new_zeros(B, 1, c.n_embd), s0.new_zeros(B, 1, c.vocab_size, dtype=torch.float32),
               idx.new_zeros(B, dtype=torch.bool), idx.new_zeros(B))
    for buffer in buffers:
        torch._dynamo.mark_static_address(buffer, guard=False)
    s, carried, looping, loops_ran = buffers
    tokens = idx  # the prompts and every token chosen so far
    # 1) prefill: the prompt's last block_size tokens, at positions 0..
    first = max(0, T0 - block)
    logits = prefill(model, caches, tokens[:, first:], s0[:, first:T0], prompt_loops)
    loops = torch.full((B,), prompt_loops, device=idx.device)
    n_cached = T0 - first
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
            prefill(model, caches, tokens[:, first:t], s0[:, first:t], prompt_loops)
            n_cached = block // 2
        # 4) the new token at the next position (a tensor: every step has the same shapes), looped
        pos = torch.full((1,), n_cached, device=idx.device)
        e = model.prelude(next_token[:, None], CacheView(caches["prelude"], pos))
        # every row starts the token afresh: its s_0, looping, no loops run
        s.copy_(s0[:, t:t + 1])
        looping.fill_(True)
        loops_ran.zero_()
        ahead = LOOPS_AHEAD[idx.device.type]
        flags = []  # "no row is looping" after each loop from MIN_EXIT_LOOP, read `ahead` loops later
        for loop in range(1, depth.r_max + 1):
            no_row_looping = DECODE_LOOP(model, caches, e, *buffers, pos, depth)
            if depth.test is not None and loop >= MIN_EXIT_LOOP:
                flags.append(HostFlag(no_row_looping))
            if len(flags) > ahead and flags[-1 - ahead].read():
                break
        if depth.test is not None and depth.test.needs_logits:  # the KL exit carried each row's last readout
            logits = carried[:, -1].clone()
        else:  # one readout of every token's final state
            logits = model.readout(s, CacheView(caches["coda"], pos))[:, -1]
        loops = loops_ran.clone()
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
    if C.exit != "none" and C.state_init != "zero":  # the thresholds would be used under another start
        print("warning: allocate.py calibrates the exits' thresholds from a zero state, not noise", file=sys.stderr)
    n = C.num_samples
    s0 = initial_states(model, n, len(ids) + C.max_new_tokens, C.state_init, C.seed, C.device)
    generators = [torch.Generator(C.device).manual_seed(C.seed + i) for i in range(n)]

    def pick(logits):
        return sample_next(logits, C.temperature, C.top_k, generators)
    global DECODE_LOOP  # compiled: one graph a loop, on CUDA a CUDA graph (inductor alone on the CPU)
    DECODE_LOOP = torch.compile(decode_loop, mode="reduce-overhead", fullgraph=True) if C.compile else decode_loop
    new_tokens, loops_run = [], []  # on the device, read once at the end: no wait a step
    unprinted = []  # one sample is printed as it comes; a character may span tokens
    if n == 1:
        print(decode(ids), end="")
    started = clock(C.device)
    with autocast(C.device, C.dtype):
        idx = torch.tensor([ids] * n, device=C.device)
        for next_token, loops in generate(model, idx, C.max_new_tokens, s0, pick, prompt_loops, depth):
            new_tokens.append(next_token)
            loops_run.append(loops)
            if n == 1:  # the one wait on the device a step
                unprinted.append(next_token.item())
                text = decode(unprinted)
                if not text.endswith("\ufffd"):  # else: wait for the rest of the character
                    print(text, end="", flush=True)
                    unprinted = []
            if len(new_tokens) == 2:  # the first decode step (and its compilation) is the warm-up: time the others
                started = clock(C.device)
    seconds = clock(C.device) - started
    new_ids = torch.stack(new_tokens, 1).tolist()
    loops_run = torch.stack(loops_run, 1)  # (n, max_new_tokens)
    if n == 1:
        print(decode(unprinted))
    else:  # several samples: each whole
        for row in new_ids:
            print(decode(ids + row), end="\n---------------\n")
    mean_loops = loops_run.float().mean().item()
    deepest = loops_run.amax(0).float().mean().item()  # a lockstep step waits for its deepest token
    timed = n * max(0, C.max_new_tokens - 2)  # the prefill's token and the warm-up step's are not timed
    flops = model.inference_flops(mean_loops, model.config.block_size, depth.test)
    print(f"{timed / seconds:.1f} tokens/s ({timed} timed), {mean_loops:.2f} loops (a step's deepest {deepest:.2f}), "
          f"{flops / 1e6:.3g} MFLOP per token (attention over a full block), {C.dtype}", file=sys.stderr)
    loops_run = loops_run.flatten().tolist()
    histogram = [f"{k}:{loops_run.count(k)}" for k in sorted(set(loops_run))]
    print("loops per new token (loops:tokens):", *histogram, file=sys.stderr)
    return new_ids


if __name__ == "__main__":
    run(main)
