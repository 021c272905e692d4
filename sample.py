"""Generate text from a checkpoint with KV caches, at a fixed depth or a per-token exit.

    python sample.py --loops 4                          # every token runs 4 loops
    python sample.py --exit kl --start="$(cat prompt.txt)"  # each new token stops when its output settles

The sequences of a batch advance in lockstep, a token each per step; within a step, each loop's
core call carries only the tokens still looping. Past block_size the context keeps its last
half, prefilled again at --loops.
With one sample the text is printed as it is chosen; with several, each whole at the end.
"""
import sys
import time
from math import inf

import torch
import torch.nn.functional as F

from configurator import UserError, configure, run
from model import DEVICES, EXIT_TESTS, MIN_EXIT_LOOP, DepthPolicy, autocast, load_checkpoint, uniform_depth
from prepare import load_tokenizer, open_dataset

out_dir = "out-shakespeare"  # holds ckpt.pt
start = "\n"  # the prompt (a file's: --start="$(cat prompt.txt)")
num_samples = 3  # sequences, generated as one batch
max_new_tokens = 200  # new tokens per sequence
temperature = 0.8  # below 1e-6: greedy (argmax)
top_k = 200  # sample among the k likeliest tokens; 0: all
seed = 1337  # sequence i draws with seed + i
loops = 0  # loops per token at fixed depth, and the prompt's with an exit; 0: mean_loops
exit = "none"  # per-token exit: 'kl' (output distribution settles), 'state' (state settles) or 'none'
exit_threshold = 1e-3  # a token stops once its exit score is below this (from loop 2)
r_max = 0  # with an exit, the most loops a token may run; 0: the model's max_loops
state_init = "zero"  # s_0: 'zero' (as allocate.py calibrates the exits) or 'noise' (as in training)
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu, cuda or cuda:N
dtype = "bfloat16" if torch.cuda.is_available() else "float32"  # autocast dtype of the matmuls
RULES = dict(num_samples=(1, inf), max_new_tokens=(1, inf), seed=(0, 2 ** 62), exit=("none", "kl", "state"),
             state_init=("zero", "noise"), dtype=("float32", "bfloat16"), device=DEVICES)


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


def feed(model, caches, tokens, s, pos, depth):
    """Tokens (B, T) of every sequence, initial states s (B, T, d), from position pos, through the
    prelude, their loops and the readout, their K/V stored in the caches: a prefill (pos 0, uniform
    depth), or one new token each (T = 1), looped to its depth: after each loop from MIN_EXIT_LOOP a
    token whose exit score is below the threshold stops, and its cache slot keeps the K/V of that
    loop; the others go on, at most to r_max. -> the last token's logits (B, V), its loops (B,)."""
    B = len(tokens)
    every_row = torch.arange(B, device=tokens.device)
    e = model.prelude(tokens, caches["prelude"].at(every_row, pos))
    s = s.clone()  # updated row by row below
    test = depth.test
    needs_logits = test is not None and test.needs_logits
    if needs_logits:  # each token's readout after its latest loop, for the next test
        logits = torch.zeros(B, 1, model.config.vocab_size, device=tokens.device)
    looping = torch.ones(B, dtype=torch.bool, device=tokens.device)
    loops = torch.zeros(B, dtype=torch.long, device=tokens.device)
    # The sequences stop at different loops: each core call carries only the rows still looping,
    # and a stopped row's cache slot is left as its last loop wrote it.
    for loop in range(1, depth.r_max + 1):
        rows = looping.nonzero()[:, 0]
        if len(rows) == 0:
            break
        s_new = model.core_step(e[rows], s[rows], caches["core"].at(rows, pos))
        loops[rows] += 1
        logits_new = None
        if needs_logits:
            logits_new = model.readout(s_new, caches["coda"].at(rows, pos))
        if test is not None and loop >= MIN_EXIT_LOOP:
            logits_old = logits[rows] if needs_logits else None
            score = test.score(s_new, s[rows], logits_new, logits_old)[:, 0]
            looping[rows] = score >= depth.threshold
        s[rows] = s_new
        if needs_logits:
            logits[rows] = logits_new.float()
    if not needs_logits:  # one readout of every token's final state
        logits = model.readout(s, caches["coda"].at(every_row, pos))
    return logits[:, -1], loops


@torch.no_grad()
def generate(model, idx, max_new_tokens, s0, pick, prompt_loops, depth):
    """Yields, step by step, the next token of every sequence after prompts idx (B, T0) and the
    loops run by the token it was read from: (B,), (B,). s0 (B, T0 + max_new_tokens, d) holds the
    initial state of every position; pick(logits (B, V)) -> (B,) chooses. The prompt runs
    prompt_loops loops a token; each new token runs `depth` (a DepthPolicy)."""
    B, T0 = idx.shape
    c = model.config
    block = c.block_size
    caches = {"prelude": model.new_cache(c.n_prelude, B), "core": model.new_cache(c.n_core, B),
              "coda": model.new_cache(c.n_coda, B)}
    tokens = idx  # the prompts and every token chosen so far
    # 1) prefill: the prompt's last block_size tokens, at positions 0..
    first = max(0, T0 - block)
    prompt_depth = uniform_depth(prompt_loops)
    logits, loops = feed(model, caches, tokens[:, first:], s0[:, first:T0], 0, prompt_depth)
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
            feed(model, caches, tokens[:, first:t], s0[:, first:t], 0, prompt_depth)
            n_cached = block // 2
        # 4) feed the new token at the next position, at its own depth
        logits, loops = feed(model, caches, tokens[:, t:], s0[:, t:t + 1], n_cached, depth)
        n_cached += 1


def main(argv=()):
    C, _ = configure(globals(), argv)
    path = f"{C.out_dir}/ckpt.pt"
    model, ckpt = load_checkpoint(path, C.device)
    encode, decode = load_tokenizer(open_dataset(ckpt["config"]["dataset"], ckpt, path, splits=())[0])
    ids = encode(C.start)
    # the prompt must survive the round trip: a tokenizer that drops what it cannot encode would
    # otherwise continue a prompt the user did not write
    if not ids or decode(ids) != C.start:
        raise UserError("--start: the prompt is empty or the tokenizer cannot encode it exactly")
    prompt_loops = C.loops or model.config.mean_loops
    depth = uniform_depth(prompt_loops)
    if C.exit != "none":
        r_max = C.r_max or model.config.max_loops
        if r_max < MIN_EXIT_LOOP:  # an exit compares two loops
            raise UserError(f"--r_max={r_max}: an exit needs r_max >= {MIN_EXIT_LOOP}")
        depth = DepthPolicy(EXIT_TESTS[C.exit], C.exit_threshold, r_max)
    if C.exit != "none" and C.state_init != "zero":  # the thresholds would be used under another start
        print("warning: allocate.py calibrates the exits' thresholds from a zero state, not noise", file=sys.stderr)
    n = C.num_samples
    s0 = initial_states(model, n, len(ids) + C.max_new_tokens, C.state_init, C.seed, C.device)
    generators = [torch.Generator(C.device).manual_seed(C.seed + i) for i in range(n)]

    def pick(logits):
        return sample_next(logits, C.temperature, C.top_k, generators)
    new_ids = [[] for _ in range(n)]
    loops_run = []  # the loops of the token each new token was read from
    unprinted = []  # one sample is printed as it comes; a character may span tokens
    if n == 1:
        print(decode(ids), end="")
    started = time.perf_counter()
    with autocast(C.device, C.dtype):
        idx = torch.tensor([ids] * n, device=C.device)
        for next_token, loops in generate(model, idx, C.max_new_tokens, s0, pick, prompt_loops, depth):
            loops_run += loops.tolist()
            for row, token in zip(new_ids, next_token.tolist()):
                row.append(token)
            if n == 1:
                unprinted.append(new_ids[0][-1])
                text = decode(unprinted)
                if not text.endswith("\ufffd"):  # else: wait for the rest of the character
                    print(text, end="", flush=True)
                    unprinted = []
    seconds = time.perf_counter() - started
    if n == 1:
        print(decode(unprinted))
    else:  # several samples: each whole
        for row in new_ids:
            print(decode(ids + row), end="\n---------------\n")
    mean_loops = sum(loops_run) / len(loops_run)
    flops = model.inference_flops(mean_loops, model.config.block_size, depth.test)
    print(f"{len(loops_run) / seconds:.1f} tokens/s, {mean_loops:.2f} loops and {flops / 1e6:.3g} MFLOP per "
          f"token (attention over a full block), {C.dtype}", file=sys.stderr)
    histogram = [f"{k}:{loops_run.count(k)}" for k in sorted(set(loops_run))]
    print("loops per new token (loops:tokens):", *histogram, file=sys.stderr)
    return new_ids


if __name__ == "__main__":
    run(main)
