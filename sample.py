"""
Sample from a depth-recurrent checkpoint, fast: the prompt is prefilled once, then one token at a
time against KV caches (one for the prelude, one for the coda, one per loop for the core, since each
loop's keys and values differ), at a fixed depth or at a per-token adaptive depth.

    python sample.py --loops 4 --start "ROMEO:" --num_samples 3     # --start FILE:prompt.txt reads a file
    python sample.py --exit kl --exit_threshold 1e-3 --num_samples 8  # adaptive depth (A1); --exit state: A1s
    python sample.py --bench [--plot]   # tokens/s against the uniform frontier at batch 1, 8 and 32

Adaptive depth batches continuously: every core call carries whichever sequences' current tokens are
still looping, each at its own loop; a sequence whose token stops reads out, samples, and its next
token joins the following call at loop 1, so no sequence waits for the slowest. Generation runs past
block_size: when a sequence's context is full, its last block_size // 2 tokens are prefilled again at
`loops` (a cost of block_size // 2 tokens x `loops` core loops every block_size // 2 new tokens).
"""
import os
import sys
import time
from collections import Counter
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from configurator import check_device, configure, default_device, die, require_positive, run
from model import MIN_EXIT_LOOP, default_r_max, exit_score, load_checkpoint
from prepare import load_tokenizer, open_dataset

# ---- defaults ------------------------------------------------------------------------------
out_dir = "out-shakespeare"
start = "\n"  # the prompt, or FILE:path to read it from a file
num_samples = 3
max_new_tokens = 200
temperature = 0.8  # 0: greedy (argmax)
top_k = 200  # 0: no top-k cut
seed = 1337  # sequence i samples, and draws its noise, from seed + i: the same text in any batch
loops = 0  # loops per token at fixed depth, and the prompt's depth in adaptive mode; 0: mean_loops
exit = "none"  # 'none' (fixed depth), 'kl' (KL(p_i || p_{i-1}) < threshold) or 'state' (relative state change)
exit_threshold = 1e-3
r_max = 0  # adaptive mode's deepest loop; 0: 2 x mean_loops (allocate.py's default too)
state_init = "noise"  # 'noise' (the training path) or 'zero' (allocate.py's, for the bench)
device = default_device()[0]  # cuda when a GPU is there, else cpu (float32 either way)
compile = False
bench = False  # tokens/s against the uniform frontier instead of sampling
bench_tokens = 128  # bench: prompt length and new tokens per sequence
plot = False  # bench: also write out_dir/sample_bench.png
DEFAULTS = {k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, str, bool))}


# ---- caches and the "latest" rule ------------------------------------------------------------
# The core cache of a batch of B sequences has one slot per (loop, sequence): slot loop * B + b. A token
# that stopped after n loops has no keys/values of its own at deeper loops; later tokens that run those
# loops attend to the K/V of its last loop instead (the "latest" rule, as Huginn does): share_latest
# copies them into the deeper loops' slots when the token stops. The KL exit reads out after every
# loop, so its coda cache has a slot per loop too, under the same rule. This is exactly what
# allocate.py's teacher-forced exit sees, so the thresholds it calibrates mean the same thing here.
def new_caches(model, batch, n_loops, coda_per_loop):
    c = model.config
    return {"prelude": model.new_caches(c.n_prelude, batch, c.block_size),
            "core": model.new_caches(c.n_core, n_loops * batch, c.block_size),
            "coda": model.new_caches(c.n_coda, (n_loops if coda_per_loop else 1) * batch, c.block_size)}


def share_latest(caches, seqs, pos, loops_run, batch):
    """Sequences seqs (n,) stopped their tokens at positions pos (n, T) after loops_run (n,) loops:
    in every per-loop cache, each deeper loop's slot gets the keys/values of the last loop each ran."""
    for cache in caches:
        n_loops = len(cache.k) // batch
        last = ((loops_run - 1) * batch + seqs)[:, None]
        for deeper in range(1, n_loops):
            copy = loops_run <= deeper
            if copy.any():
                dst = (deeper * batch + seqs[copy])[:, None]
                cache.k[dst, :, pos[copy]] = cache.k[last[copy], :, pos[copy]]
                cache.v[dst, :, pos[copy]] = cache.v[last[copy], :, pos[copy]]


def per_loop_caches(caches):
    """The caches that hold one slot per loop: the core's, and the coda's under the KL exit."""
    coda_per_loop = len(caches["coda"][0].k) > len(caches["prelude"][0].k)
    return caches["core"] + (caches["coda"] if coda_per_loop else [])


def initial_states(model, n_seqs, length, mode, seed, device):
    """s_0 (n_seqs, length, d): sequence i's from its own generator (seed + i), so a sequence gets the
    same noise alone or in any batch; token j of a sequence always starts from row j."""
    rows = []
    for i in range(n_seqs):
        g = torch.Generator(device=device).manual_seed(seed + i)
        rows.append(model.init_state(torch.empty(1, length, model.config.n_embd, device=device), mode, g))
    return torch.cat(rows)


# ---- generation ------------------------------------------------------------------------------
def sample_next(logits, temperature, top_k, generators):
    """(n, vocab) logits -> (n,) next tokens, row i drawn with generators[i]; temperature 0 is greedy."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])


def prefill(model, caches, ids, seqs, s0, loops, batch):
    """Tokens ids (n, T) of sequences seqs (n,) at positions 0..T-1, every one at `loops` loops, in
    lockstep. Returns the logits after the last token, (n, vocab)."""
    n, T = ids.shape
    pos = torch.arange(T, device=ids.device).expand(n, T)
    whole = n == batch  # the whole batch: every cache read is a plain slice, no gather
    rows = None if whole else seqs
    coda_per_loop = len(caches["coda"][0].k) > batch
    e = model.prelude(ids, caches["prelude"], pos, rows)
    s = s0
    for loop in range(loops):
        loop_rows = slice(loop * batch, (loop + 1) * batch) if whole else loop * batch + seqs
        s = model.core_step(e, s, caches["core"], pos, loop_rows)
        if coda_per_loop:  # the KL exit's later tokens read these tokens' coda K/V at every loop
            logits = model.readout(s, caches["coda"], pos, loop_rows)
    if not coda_per_loop:
        logits = model.readout(s, caches["coda"], pos, rows)
    share_latest(per_loop_caches(caches), seqs, pos, torch.full_like(seqs, loops), batch)
    return logits[:, -1]


def start_tokens(model, g, seqs, logits):
    """Sample the next token of sequences seqs (n,), then put it in flight: its prelude now, its state
    at s_0 and its loop count at 0. A sequence whose context is full first prefills its last
    block_size // 2 tokens again (the just-sampled one included) and samples from that instead."""
    tokens = g.pick(logits, seqs)
    g.out[seqs, g.T0 + g.n_made[seqs]] = tokens
    g.n_made[seqs] += 1
    if g.on_token is not None:
        g.on_token(g.out, g.n_made, seqs)
    seqs = seqs[g.n_made[seqs] < g.n_new]  # the last new token is never fed back
    full = seqs[g.pos[seqs] + 1 == model.config.block_size]
    if len(full):  # full sequences are all at the same place: their token counts are equal
        keep = model.config.block_size // 2
        j = int(g.T0 + g.n_made[full[0]])
        logits = prefill(model, g.caches, g.out[full, j - keep:j], full, g.s0[full, j - keep:j], g.loops, g.B)
        g.pos[full] = keep - 1
        start_tokens(model, g, full, logits)
        seqs = seqs[g.pos[seqs] + 1 < model.config.block_size]
    if len(seqs) == 0:
        return
    j = g.T0 + g.n_made[seqs] - 1  # each fed token's index in out (and in s0)
    g.pos[seqs] += 1
    g.loop[seqs] = 0
    rows = None if len(seqs) == g.B else seqs
    g.e[seqs] = model.prelude(g.out[seqs, j][:, None], g.caches["prelude"], g.pos[seqs, None], rows)
    g.s[seqs] = g.s0[seqs, j][:, None]


@torch.no_grad()
def generate(model, idx, n_new, loops, s0, pick, exit="none", threshold=0.0, r_max=0, on_token=None):
    """Prefill idx (B, T0) at `loops`, then n_new tokens per sequence, one core call per step.
    exit 'none': every token runs `loops` loops, all sequences in lockstep. 'kl' / 'state': a token
    stops after loop i >= 2 once its exit score is below threshold, or at r_max, and the sequences
    batch continuously. pick(logits, seqs) -> next tokens; s0 (B, T0 + n_new, d) the initial states.
    Returns (tokens (B, T0 + n_new), per sequence the loops each fed-back new token ran, seconds spent
    after the prefill)."""
    B, T0 = idx.shape
    block, adaptive = model.config.block_size, exit != "none"
    g = SimpleNamespace(B=B, T0=T0, n_new=n_new, loops=loops, pick=pick, on_token=on_token, s0=s0,
                        caches=new_caches(model, B, max(loops, r_max) if adaptive else loops, exit == "kl"),
                        out=torch.cat([idx, idx.new_zeros(B, n_new)], 1),
                        n_made=torch.zeros(B, dtype=torch.long, device=idx.device),  # new tokens so far
                        pos=torch.full((B,), min(T0, block) - 1, device=idx.device),  # cache position in flight
                        loop=torch.zeros(B, dtype=torch.long, device=idx.device),  # loops run by it
                        e=s0.new_zeros(B, 1, s0.size(-1)), s=s0.new_zeros(B, 1, s0.size(-1)),
                        logits=torch.zeros(B, model.config.vocab_size, device=idx.device))  # kl: the last loop's
    every = torch.arange(B, device=idx.device)
    logits = prefill(model, g.caches, idx[:, -block:], every, s0[:, max(0, T0 - block):T0], loops, B)
    t0 = time.perf_counter()
    depths = [[] for _ in range(B)]
    start_tokens(model, g, every, logits)
    while (g.n_made < n_new).any():
        run = (g.n_made < n_new).nonzero()[:, 0]  # every sequence with a token in flight
        if adaptive:
            rows = g.loop[run] * B + run
        else:  # lockstep: one block of slots, read without a gather
            rows = slice(int(g.loop[0]) * B, (int(g.loop[0]) + 1) * B)
        s_new = model.core_step(g.e[run], g.s[run], g.caches["core"], g.pos[run, None], rows)
        g.loop[run] += 1
        logits = None
        if exit == "kl":
            coda_rows = (g.loop[run] - 1) * B + run
            logits = model.readout(s_new, g.caches["coda"], g.pos[run, None], coda_rows)[:, -1].float()
        if not adaptive:
            done = g.loop[run] == loops
        else:
            old_logits = None if logits is None else g.logits[run]
            score = exit_score(exit, s_new, g.s[run], logits, old_logits).view(-1)
            done = (g.loop[run] == r_max) | ((g.loop[run] >= MIN_EXIT_LOOP) & (score < threshold))
        g.s[run] = s_new
        if logits is not None:
            g.logits[run] = logits
        stopped = run[done]
        if len(stopped) == 0:
            continue
        for b, n in zip(stopped.tolist(), g.loop[stopped].tolist()):
            depths[b].append(n)
        if adaptive:
            share_latest(per_loop_caches(g.caches), stopped, g.pos[stopped, None], g.loop[stopped], B)
        if exit == "kl":
            logits = g.logits[stopped]
        else:
            rows = None if len(stopped) == B else stopped
            logits = model.readout(g.s[stopped], g.caches["coda"], g.pos[stopped, None], rows)[:, -1]
        start_tokens(model, g, stopped, logits)
    return g.out, depths, time.perf_counter() - t0


# ---- the command line --------------------------------------------------------------------------
def prompt_ids(text, encode, decode):
    if text.startswith("FILE:"):
        if not os.path.isfile(text[5:]):
            die(f"--start {text}: no such file")
        try:
            with open(text[5:], encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as err:
            die(f"--start {text}: not UTF-8 text ({err.reason} at byte {err.start})")
    if not text:
        die("--start: the prompt is empty (the default is a newline)")
    ids = encode(text)
    if decode(ids) != text:
        die("--start: the tokenizer cannot encode the prompt exactly (characters it does not know?)")
    return ids


def stream(decode, ids, shown):
    """Print what decoding the whole sequence adds to `shown`; returns the text shown. A sequence
    ending inside a multi-byte character decodes to a trailing U+FFFD: wait for the next token."""
    text = decode(ids)
    if text.endswith("\ufffd") or not text.startswith(shown):
        return shown
    print(text[len(shown):], end="", flush=True)
    return text


def validate(C, cfg):
    """-> (loops, r_max) with the checkpoint's defaults filled in; one message per broken rule."""
    require_positive(C, "num_samples", "max_new_tokens", "bench_tokens")
    for key in ("loops", "r_max", "top_k", "temperature", "exit_threshold"):
        if getattr(C, key) < 0:
            die(f"--{key} must be >= 0, got {getattr(C, key)}")
    if C.exit not in ("none", "kl", "state"):
        die(f"--exit must be none, kl or state, got {C.exit!r}")
    if C.state_init not in ("noise", "zero"):
        die(f"--state_init must be noise or zero, got {C.state_init!r}")
    r_max = C.r_max or default_r_max(cfg)
    if C.exit != "none" and r_max < MIN_EXIT_LOOP:
        die(f"--r_max {r_max}: an exit compares two loops, so adaptive depth needs r_max >= {MIN_EXIT_LOOP}")
    return C.loops or cfg.mean_loops, r_max


def pickers(C, n):
    """pick(logits, seqs): sequence i samples with its own generator (seed + i), as alone."""
    gens = [torch.Generator(device=C.device).manual_seed(C.seed + i) for i in range(n)]
    return lambda logits, seqs: sample_next(logits, C.temperature, C.top_k, [gens[i] for i in seqs.tolist()])


def main(argv=()):
    C = SimpleNamespace(**configure(DEFAULTS, list(argv)))
    check_device(C.device)
    ckpt_path = os.path.join(C.out_dir, "ckpt.pt")
    model, ckpt = load_checkpoint(ckpt_path, C.device)
    loops, r_max = validate(C, model.config)
    data_dir, meta = open_dataset(ckpt["config"]["dataset"], ckpt, ckpt_path, splits=("val",) if C.bench else ())
    encode, decode = load_tokenizer(data_dir)
    if C.compile:  # per part, as train.py does; dynamic: the cached key length grows every token
        for part in (model.prelude_blocks, model.core, model.coda_blocks):
            part.compile(dynamic=True)
    if C.bench:  # the benchmark lives with the others, in bench.py
        from bench import generation_frontier
        return generation_frontier(model, C, data_dir, meta, ckpt)
    ids = prompt_ids(C.start, encode, decode)
    n = C.num_samples
    idx = torch.tensor([ids] * n, device=C.device)
    s0 = initial_states(model, n, len(ids) + C.max_new_tokens, C.state_init, C.seed, C.device)
    shown = stream(decode, ids, "")

    def on_token(out, n_made, seqs):  # streams the first sequence; the others are printed when done
        nonlocal shown
        if 0 in seqs.tolist():
            shown = stream(decode, out[0, :len(ids) + int(n_made[0])].tolist(), shown)

    t0 = time.perf_counter()
    out, depths, _ = generate(model, idx, C.max_new_tokens, loops, s0, pickers(C, n), C.exit, C.exit_threshold,
                              r_max, on_token)
    dt = time.perf_counter() - t0
    for row in range(n):
        text = decode(out[row].tolist())
        print(text[len(shown):] if row == 0 else text, end="\n---------------\n", flush=True)
    mode = f"loops {loops}" if C.exit == "none" else f"exit {C.exit} < {C.exit_threshold:g}, prompt at loops {loops}"
    print(f"{n * C.max_new_tokens} new tokens in {dt:.2f}s: {n * C.max_new_tokens / dt:.1f} tokens/s ({mode}, "
          f"batch {n})", file=sys.stderr)
    all_depths = [d for row in depths for d in row]
    if all_depths and C.exit != "none":
        hist = " ".join(f"{k}:{v}" for k, v in sorted(Counter(all_depths).items()))
        print(f"loops per new token: mean {sum(all_depths) / len(all_depths):.2f}, histogram (loops:tokens) {hist}",
              file=sys.stderr)
    return out


if __name__ == "__main__":
    run(main)
