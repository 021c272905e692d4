"""Generate text from a checkpoint with KV caches, at a fixed depth or with a per-token exit.

    python sample.py --loops 4                            # every token runs 4 loops
    python sample.py --exit kl --start="$(cat p.txt)"     # each new token stops once it settles

The sequences of a batch advance in lockstep; within a step every loop computes every row, and a
row that has stopped keeps what it had (masked, not gathered). Past block_size the context keeps
its last half, prefilled again. The same tokens at a GPU's speed, timed: python -m engine.
"""
import sys
from functools import partial
from math import inf

import torch
import torch.nn.functional as F

from allocate import read_allocation
from configurator import UserError, configure, run
from model import (DEVICES, EXIT_TESTS, MAX_LOOPS, MIN_EXIT_LOOP, CacheView, DepthPolicy,
                   autocast, keeps_looping, uniform_depth)
from prepare import load_tokenizer, open_run

out_dir = "out-shakespeare"  # holds ckpt.pt
start = "\n"  # the prompt (a file's: --start="$(cat prompt.txt)")
num_samples = 3  # sequences, generated as one batch
max_new_tokens = 200  # new tokens per sequence
temperature = 0.8  # below 1e-6: greedy (argmax)
top_k = 200  # sample among the k likeliest tokens; 0: all
seed = 1337  # sequence i draws with the generator seed + i
loops = 0  # loops per token at fixed depth, and the prompt's with an exit; 0: mean_loops
exit = "none"  # a per-token exit test of model.EXIT_TESTS: kl (output settles), state, ...
exit_threshold = -1.0  # a token stops once its exit score is below this; -1: allocate.py's
r_max = 0  # with an exit, the most loops a token may run; 0: the model's max_loops
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu, cuda or cuda:N
dtype = "bfloat16" if torch.cuda.is_available() else "float32"  # autocast dtype of the matmuls
RULES = dict(num_samples=(1, 2 ** 16), max_new_tokens=(1, 2 ** 24), loops=(0, MAX_LOOPS),
             r_max=(0, MAX_LOOPS), seed=(0, 2 ** 32 - 1), exit_threshold=(-1, inf),
             dtype=("float32", "bfloat16"), device=DEVICES)


def exit_threshold_for(C, ckpt, r_max):
    """-> (the threshold --exit runs at, where it comes from): --exit_threshold; else the one
    allocate.py calibrated for this checkpoint at this r_max and dtype; else the test's default."""
    if C.exit_threshold >= 0:
        return C.exit_threshold, "--exit_threshold"
    default = EXIT_TESTS[C.exit].threshold
    try:
        allocated = read_allocation(C.out_dir, ckpt)
    except UserError as missing:
        return default, f"the test's default: {missing}"
    calibrated_at = (allocated["r_max"], allocated["args"]["dtype"])
    if calibrated_at != (r_max, C.dtype):
        return default, (f"the test's default: allocate.py calibrated r_max={calibrated_at[0]} "
                         f"and {calibrated_at[1]}, not r_max={r_max} and {C.dtype}")
    if C.exit not in allocated["operating_thresholds"]:
        return default, f"the test's default: allocate.json has no threshold for {C.exit}"
    return allocated["operating_thresholds"][C.exit], "allocate.py's for this checkpoint"


def sample_next(logits, temperature, top_k, generators):
    """logits (B, V) -> next token ids (B,), row i drawn with generators[i]: a sequence's text does
    not depend on its batch."""
    if temperature < 1e-6:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k:
        kth_largest = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    draws = [p.multinomial(1, generator=g) for p, g in zip(probs, generators)]
    return torch.cat(draws)


def prefill(model, caches, tokens, loops):
    """Tokens (B, T) at positions 0..T-1, `loops` loops from the zero state, K/V into the caches
    -> the last token's logits (B, V)."""
    e = model.prelude(tokens, CacheView(caches["prelude"]))
    s = model.init_state(e, "zero")
    for _ in range(loops):
        s = model.core_step(e, s, CacheView(caches["core"]))
    return model.readout(s, CacheView(caches["coda"]))[:, -1]


def decode(model, caches, token, pos, depth):
    """One new token per row (B,) at position pos, looped under depth (a DepthPolicy) -> (its
    logits (B, V), the loops each row ran (B,)). A row that has stopped keeps its state, its last
    readout and its cache slots (the K/V of the last loop it ran) while the others loop on."""
    B = token.size(0)
    at = torch.tensor([pos], device=token.device)
    e = model.prelude(token[:, None], CacheView(caches["prelude"], at))
    s = model.init_state(e, "zero")
    looping = torch.ones(B, dtype=torch.bool, device=token.device)
    loops_run = torch.zeros(B, dtype=torch.long, device=token.device)
    test = depth.test
    # the KL exit's readout, carried from loop to loop
    logits = None
    for loop in range(1, depth.r_max + 1):
        s_new = model.core_step(e, s, CacheView(caches["core"], at, looping))
        loops_run += looping
        logits_new = None
        if test is not None and test.needs_logits:
            logits_new = model.readout(s_new, CacheView(caches["coda"], at, looping))
        # loop 1 has no earlier loop to compare with: no score, no stop
        score = None
        if test is not None and loop > 1:
            score = test.score(s_new, s, logits_new, logits)[:, 0]
        ran = looping[:, None, None]
        s = torch.where(ran, s_new, s)
        if logits_new is not None:
            logits = logits_new if logits is None else torch.where(ran, logits_new, logits)
        looping = looping & keeps_looping(loop, score, depth)
        # the host waits for this answer after every loop (python -m engine does not)
        if test is not None and not looping.any():
            break
    # without the KL exit, one readout of every row's final state
    if logits is None:
        logits = model.readout(s, CacheView(caches["coda"], at))
    return logits[:, -1], loops_run


@torch.no_grad()
def generate(model, prompts, max_new_tokens, pick, prompt_loops, depth):
    """Yields each step's next token of every sequence after the prompts (B, T0) and the loops of
    the token it was read from, (B,) each: a prompt token runs prompt_loops loops, a new one
    `depth` (a DepthPolicy); pick(logits (B, V)) -> (B,) chooses."""
    B, T0 = prompts.shape
    block = model.config.block_size
    caches = model.new_caches(B)
    # 1) prefill: the prompt's last block_size tokens, at positions 0..
    logits = prefill(model, caches, prompts[:, -block:], prompt_loops)
    loops = torch.full((B,), prompt_loops, device=prompts.device)
    n_cached = min(T0, block)
    tokens = prompts
    for step in range(max_new_tokens):
        # 2) every sequence picks its next token from its last readout
        next_token = pick(logits)
        yield next_token, loops
        # the last token is never fed
        if step == max_new_tokens - 1:
            return
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        # 3) the context is full: keep its last half before the new token, prefilled again
        if n_cached == block:
            n_cached = block // 2
            prefill(model, caches, tokens[:, -1 - n_cached:-1], prompt_loops)
        # 4) the new token at the next position, looped under depth
        logits, loops = decode(model, caches, next_token, n_cached, depth)
        n_cached += 1


def setup(C):
    """What sample.py's settings C ask for -> (the model, its checkpoint dict, the prompt's ids,
    the tokenizer's decode, the prompt's loops, the new tokens' DepthPolicy, the pick)."""
    model, ckpt, data_dir, _ = open_run(C.out_dir, C.device, splits=())
    encode, decode_ids = load_tokenizer(data_dir)
    ids = encode(C.start)
    # a tokenizer that drops what it cannot encode would continue a prompt no one wrote
    if not ids or decode_ids(ids) != C.start:
        raise UserError("--start: the prompt is empty or the tokenizer cannot encode it exactly")
    prompt_loops = C.loops or model.config.mean_loops
    depth = uniform_depth(prompt_loops)
    # not in RULES: a test registered in model.py is a choice at once
    if C.exit != "none":
        if C.exit not in EXIT_TESTS:
            choices = ", ".join(EXIT_TESTS)
            raise UserError(f"--exit must be none or one of {choices}, got {C.exit!r}")
        r_max = C.r_max or model.config.max_loops
        if r_max < MIN_EXIT_LOOP:
            raise UserError(f"--r_max={r_max}: an exit needs r_max >= {MIN_EXIT_LOOP}")
        threshold, source = exit_threshold_for(C, ckpt, r_max)
        print(f"--exit={C.exit} at threshold {threshold:.3g}: {source}", file=sys.stderr)
        depth = DepthPolicy(EXIT_TESTS[C.exit], threshold, r_max)
    generators = [torch.Generator(C.device).manual_seed(C.seed + i) for i in range(C.num_samples)]
    pick = partial(sample_next, temperature=C.temperature, top_k=C.top_k, generators=generators)
    return model, ckpt, ids, decode_ids, prompt_loops, depth, pick


def main(argv=()):
    """-> {"new_ids": each sample's new token ids, "loops": the loops each new token ran}."""
    C, _ = configure(globals(), argv)
    model, _, ids, decode_ids, prompt_loops, depth, pick = setup(C)
    prompts = torch.tensor([ids] * C.num_samples, device=C.device)
    with autocast(C.device, C.dtype):
        steps = list(generate(model, prompts, C.max_new_tokens, pick, prompt_loops, depth))
    new_ids = torch.stack([token for token, _ in steps], 1).tolist()
    loops_run = torch.stack([loops for _, loops in steps], 1).tolist()
    # each sample whole: decoded together, no character is cut between two tokens
    for row in new_ids:
        print(decode_ids(ids + row), end="\n---------------\n")
    every_token = [loops for row in loops_run for loops in row]
    histogram = " ".join(f"{k}:{every_token.count(k)}" for k in sorted(set(every_token)))
    mean = sum(every_token) / len(every_token)
    print(f"{mean:.2f} loops per new token (loops:tokens {histogram})", file=sys.stderr)
    return {"new_ids": new_ids, "loops": loops_run}


if __name__ == "__main__":
    run(main)
