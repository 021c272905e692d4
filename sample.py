"""Sampling with KV caches at a fixed or per-token adaptive depth, batched
continuously (each core call runs every token still looping, at its loop),
past block_size (README.md, "Generation past block_size"):
    python sample.py --exit kl --start FILE:prompt.txt
"""
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from configurator import configure, die, run
from model import MIN_EXIT_LOOP, R_MAX_PER_MEAN, autocast, exit_score, load_checkpoint
from prepare import load_tokenizer, open_dataset

out_dir = "out-shakespeare"  # holds ckpt.pt
start = "\n"  # the prompt, or FILE:path to read it
num_samples = 3  # sequences, in one batch
max_new_tokens = 200  # per sequence
temperature = 0.8  # below 1e-6: greedy (argmax)
top_k = 200  # 0: no top-k cut
seed = 1337  # sequence i uses seed + i
loops = 0  # per token (adaptive: prefills'); 0: mean_loops
exit = "none"  # 'none' (fixed depth), 'kl' or 'state'
exit_threshold = 1e-3  # a token stops below it
r_max = 0  # adaptive: the deepest loop; 0: 2 x mean_loops
cache = "latest"  # Huginn's, a slot a sequence (README); 'exact': a slot a loop
state_init = "noise"  # 'noise' (as trained) or 'zero'
device = "cuda" if torch.cuda.is_available() else "cpu"  # or cuda:N
dtype = "bfloat16" if torch.cuda.is_available() else "float32"  # autocast
RULES = dict(out_dir=str, start=str, num_samples=(1, 4096), max_new_tokens=(1, 10**6),
             temperature=(0.0, 100.0), top_k=(0, 10**9), seed=(0, 2**62), loops=(0, 1024),
             exit=("none", "kl", "state"), exit_threshold=(0.0, float("inf")), r_max=(0, 1024),
             cache=("exact", "latest"), state_init=("noise", "zero"), device=str,
             dtype=("float32", "bfloat16"))


def new_caches(model, B, n_loops, kl, layout):
    """Per layer: slot b, or loop * B + b (exact core; its coda if kl)."""
    c = model.config
    core = n_loops * B if layout == "exact" else B
    make = partial(model.new_caches, length=c.block_size)
    return {"prelude": make(c.n_prelude, B), "core": make(c.n_core, core),
            "coda": make(c.n_coda, core if kl else B)}


def slots(caches, B, seqs, loop):
    """KVCache rows of sorted seqs (n,) at loop index `loop`: int or (n,)."""
    if len(caches[0].k) == B:  # one slot per sequence
        loop = 0
    if len(seqs) == B and isinstance(loop, int):  # a view, not a gather
        return slice(loop * B, (loop + 1) * B)
    return loop * B + seqs


def share_latest(caches, B, seqs, pos, loops_run):
    """seqs (n,) ran loops_run (n,) at pos (n, T): slot i gets loop min(i, n)."""
    loop = torch.arange(len(caches[0].k) // B, device=seqs.device)
    src = torch.minimum(loop, loops_run[:, None] - 1)  # (n, n_loops)
    src = (src * B + seqs[:, None]).view(-1, 1)
    dst = (loop * B + seqs[:, None]).view(-1, 1)
    at = pos.repeat_interleave(len(loop), 0)  # (n * n_loops, T)
    for cache in caches:
        if len(cache.k) > B:  # per loop
            cache.k[dst, :, at] = cache.k[src, :, at]
            cache.v[dst, :, at] = cache.v[src, :, at]


def initial_states(model, n_seqs, length, mode, seed, device):
    """s_0 (n_seqs, length, d), row i from generator seed + i."""
    e = torch.empty(1, length, model.config.n_embd, device=device)
    gens = [torch.Generator(device).manual_seed(seed + i) for i in range(n_seqs)]
    return torch.cat([model.init_state(e, mode, g) for g in gens])


def sample_next(logits, seqs, temperature, top_k, generators):
    """(n, vocab) -> (n,), row i drawn with generators[seqs[i]]."""
    if temperature < 1e-6:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    draws = zip(F.softmax(logits, dim=-1), seqs.tolist())
    return torch.cat([p.multinomial(1, generator=generators[i]) for p, i in draws])


def prefill(model, caches, out, s0, seqs, cols, loops):
    """out[seqs, cols] (n, T) at 0..T-1, causal, `loops` each -> logits."""
    B, core, coda = len(caches["prelude"][0].k), caches["core"], caches["coda"]
    rows = slots(caches["prelude"], B, seqs, 0)
    e = model.prelude(out[seqs[:, None], cols], caches["prelude"], None, rows)
    s = s0[seqs[:, None], cols]
    for loop in range(loops):
        s = model.core_step(e, s, core, None, slots(core, B, seqs, loop))
        if loop == loops - 1 or len(coda[0].k) > B:  # exact KL: read at every loop
            logits = model.readout(s, coda, None, slots(coda, B, seqs, loop))
    if len(core[0].k) > loops * B:  # exact: deeper loops to share
        pos = torch.arange(cols.size(1), device=cols.device).expand_as(cols)
        share_latest(core + coda, B, seqs, pos, torch.full_like(seqs, loops))
    return logits[:, -1]


def step(model, caches, seqs, e, s, pos, loop, kl, exit, threshold, r_max):
    """One loop of seqs' (n,) tokens in flight, in place: -> the seqs that stopped."""
    B, core, coda = len(e), caches["core"], caches["coda"]
    at = pos[seqs, None]
    now = loop[seqs] if exit != "none" else int(loop[seqs[0]])  # all at one
    rows = slots(core, B, seqs, now)
    s_new = model.core_step(e[seqs], s[seqs], core, at, rows)
    loop[seqs] += 1
    done = loop[seqs] == r_max
    old = kl[seqs]
    if exit == "kl":
        kl[seqs] = model.readout(s_new, coda, at, rows)[:, -1].to(kl.dtype)
    if exit != "none":
        score = exit_score(exit, s_new, s[seqs], kl[seqs], old).view(-1)
        done |= (loop[seqs] >= MIN_EXIT_LOOP) & (score < threshold)
    s[seqs] = s_new
    seqs, at = seqs[done], at[done]
    if exit != "none" and len(core[0].k) > B:  # 'exact'
        share_latest(core + coda, B, seqs, at, loop[seqs])
    return seqs


@torch.no_grad()
def generate(model, idx, n_new, loops, s0, pick, exit="none", threshold=0.0, r_max=0, cache="exact"):
    """n_new tokens after idx (B, T0) from s0 (B, T0 + n_new, d); pick(logits, seqs) -> ids.
    -> (out, each row's loops per fed token, seconds after prefill)."""
    B, T0 = idx.shape
    block, half = model.config.block_size, model.config.block_size // 2
    r_max = loops if exit == "none" else r_max  # the deepest loop
    caches = new_caches(model, B, max(loops, r_max), exit == "kl", cache)
    out = torch.cat([idx, idx.new_zeros(B, n_new)], 1)
    n_made = idx.new_zeros(B)  # new tokens so far
    loop = idx.new_zeros(B)  # loops of each token in flight
    e = s0.new_zeros(B, 1, s0.size(-1))  # its prelude output
    s = torch.zeros_like(e)  # its state
    kl = s0.new_zeros(B, model.config.vocab_size if exit == "kl" else 0)  # last logits
    depths = idx.new_zeros(B, n_new - 1)  # loops each fed token ran
    stopped = torch.zeros_like(loop, dtype=torch.bool)  # waiting to be read out
    seqs = torch.arange(B, device=idx.device)
    cols = torch.arange(max(0, T0 - block), T0, device=idx.device)
    logits = prefill(model, caches, out, s0, seqs, cols.expand(B, -1), loops)
    pos = idx.new_full((B,), len(cols) - 1)  # each one's last position
    if idx.is_cuda:  # the prefill's queued work is not decoding time
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    while True:
        if len(seqs):  # the stopped ones pick
            out[seqs, T0 + n_made[seqs]] = pick(logits, seqs)
            n_made[seqs] += 1
            seqs = seqs[n_made[seqs] < n_new]  # the last one is never fed
        full = seqs[pos[seqs] + 1 == block]
        if len(full):  # prefill their last `half` tokens again
            cols = T0 + n_made[full, None] - 1 - half + torch.arange(half, device=idx.device)
            prefill(model, caches, out, s0, full, cols, loops)
            pos[full] = half - 1
        if len(seqs):  # feed the new tokens
            j = T0 + n_made[seqs] - 1  # its index in out and s0
            pos[seqs] += 1
            loop[seqs] = 0
            rows = slots(caches["prelude"], B, seqs, 0)
            e[seqs] = model.prelude(out[seqs, j, None], caches["prelude"], pos[seqs, None], rows)
            s[seqs] = s0[seqs, j, None]
        flying = ((n_made < n_new) & ~stopped).nonzero()[:, 0]
        if len(flying):
            done = step(model, caches, flying, e, s, pos, loop, kl, exit, threshold, r_max)
            depths[done, n_made[done] - 1] = loop[done]
            stopped[done] = True
        seqs = stopped.nonzero()[:, 0]
        if len(flying) + len(seqs) == 0:
            return out, depths.tolist(), time.perf_counter() - t0
        if 2 * len(seqs) < B and not stopped[flying].all():  # fewer, larger calls: read
            seqs = seqs[:0]  # out once half the batch waits or none loops
            continue
        stopped[seqs] = False
        coda = caches["coda"]  # all B: read as a view
        at, rows = pos[seqs, None], slots(coda, B, seqs, 0)
        logits = kl[seqs] if exit == "kl" else model.readout(s[seqs], coda, at, rows)[:, -1]


def main(argv=()):
    C, _ = configure(globals(), RULES, list(argv))
    path = Path(C.out_dir) / "ckpt.pt"
    model, ckpt = load_checkpoint(path, C.device)
    loops = C.loops or model.config.mean_loops
    r_max = C.r_max or R_MAX_PER_MEAN * model.config.mean_loops
    if C.exit != "none" and r_max < MIN_EXIT_LOOP:  # it compares two loops
        die(f"--r_max {r_max}: an exit needs r_max >= {MIN_EXIT_LOOP}")
    encode, decode = load_tokenizer(open_dataset(ckpt["config"]["dataset"], ckpt, path, ())[0])
    text = C.start
    if text.startswith("FILE:"):
        try:
            text = Path(text[5:]).read_text(encoding="utf-8")
        except (OSError, UnicodeError) as err:
            die(f"--start {text}: {err}")
    ids = encode(text)
    if not ids or decode(ids) != text:
        die("--start: the prompt is empty or the tokenizer cannot encode it exactly")
    n, n_new = C.num_samples, C.max_new_tokens
    s0 = initial_states(model, n, len(ids) + n_new, C.state_init, C.seed, C.device)
    gens = [torch.Generator(C.device).manual_seed(C.seed + i) for i in range(n)]
    pick = partial(sample_next, temperature=C.temperature, top_k=C.top_k, generators=gens)
    with autocast(C.device, C.dtype):
        idx = torch.tensor([ids] * n, device=C.device)
        out, depths, seconds = generate(model, idx, n_new, loops, s0, pick, C.exit,
                                        C.exit_threshold, r_max, C.cache)
    for row in out.tolist():
        print(decode(row), end="\n---------------\n")
    print(f"{n * n_new / seconds:.1f} tokens/s, {C.cache} cache, {C.dtype}", file=sys.stderr)
    fed = [d for row in depths for d in row]
    hist = [f"{k}:{fed.count(k)}" for k in sorted(set(fed))]
    print("loops per new token (loops:tokens):", *hist, file=sys.stderr)
    return out


if __name__ == "__main__":
    run(main)
