"""
Sample from a depth-recurrent checkpoint, fast: the prompt is prefilled once, then one token at a
time against KV caches (one for the prelude, one for the coda, one per loop for the core, since each
loop's keys and values differ), at a fixed depth or at a per-token adaptive depth.

    python sample.py --loops 4 --start "ROMEO:" --num_samples 3     # --start FILE:prompt.txt reads a file
    python sample.py --exit kl --exit_threshold 1e-4 --max_loops 32  # adaptive depth (A1); --exit state: nearly free
    python sample.py --bench [--exit state --exit_threshold 0.45]    # tokens/s: no cache, cache, adaptive
"""
import copy
import os
import platform
import sys
import time
from collections import Counter
from functools import partial
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from configurator import configure, die
from model import load_checkpoint, state_change, token_kl
from prepare import load_tokenizer

# ---- defaults ------------------------------------------------------------------------------
out_dir = "out-shakespeare"
start = "\n"  # the prompt, or FILE:path to read it from a file
num_samples = 3
max_new_tokens = 200
temperature = 0.8  # 0: greedy (argmax)
top_k = 200  # 0: no top-k cut
seed = 1337
loops = None  # loops per token at fixed depth, and for the prompt in adaptive mode; None: the checkpoint's mean_loops
exit = "none"  # 'none' (fixed depth), 'kl' (KL(p_i || p_{i-1}) < threshold) or 'state' (relative state change)
exit_threshold = 1e-4
max_loops = None  # adaptive mode's cap; None: the checkpoint's max_loops
state_init = "noise"  # 'noise' (the training path) or 'zero'
device = "cuda" if torch.cuda.is_available() else "cpu"
compile = False
bench = False  # benchmark tokens/s instead of sampling
DEFAULTS = {k: v for k, v in globals().items() if not k.startswith("_") and (v is None or isinstance(v, (int, float, str, bool)))}


# ---- caches and the "latest" sharing rule ----------------------------------------------------
# A token that stopped at loop n has no keys/values of its own at deeper loops j > n. Later tokens
# that run loop j attend to its keys/values from its last computed loop instead (the "latest" rule
# Huginn uses), so no token is ever recomputed. Two places keep every loop's cache that way:
#  1. share_latest: when a token stops at loop n, its entries at its position in loop n's caches
#     are copied into the caches of every deeper loop that already exists;
#  2. core_caches: a loop's caches, created when a token first needs that loop, start as a copy of
#     the deepest existing loop's, which (by 1.) holds every earlier token's latest keys/values.
def core_caches(caches, loop):
    """Loop `loop`'s core caches (0-based), made on first use as a copy of the deepest (rule 2)."""
    if loop == len(caches["core"]):
        caches["core"].append(copy.deepcopy(caches["core"][-1]))
    return caches["core"][loop]


def share_latest(caches, n_loops, t):
    """Rule 1: position t stopped after n_loops loops; deeper loops get its last keys/values."""
    for deeper in caches["core"][n_loops:]:
        for dst, src in zip(deeper, caches["core"][n_loops - 1]):
            dst.k[:, :, t], dst.v[:, :, t] = src.k[:, :, t], src.v[:, :, t]


def initial_states(model, batch, length, mode, seed, device):
    """s_0 (batch, length, d) for every position, from one seeded generator: the cached and the
    recomputing paths both take each position's s_0 from this table, so both see the same noise."""
    g = torch.Generator(device=device).manual_seed(seed)
    return model.init_state(torch.empty(batch, length, model.config.n_embd, device=device), mode, g)


# ---- generation ------------------------------------------------------------------------------
def sample_next(logits, temperature, top_k, generator):
    """(B, vocab) logits -> (B, 1) next tokens; temperature 0 is greedy."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)


def feed(model, idx, pos, s, caches, loops, exit="none", threshold=0.0):
    """Tokens idx at positions pos (B, T) from states s -> (logits of the last token, loops run).
    exit 'none': `loops` loops. 'kl' or 'state' (one token, batch 1): at most `loops`, fewer once the
    exit test falls below threshold, KL(p_i || p_{i-1}) or the relative change of the state."""
    e = model.prelude(idx, caches["prelude"], pos)
    logits = None
    for loop in range(loops):
        s_new = model.core_step(e, s, core_caches(caches, loop), pos)
        if exit == "kl":  # each readout writes the coda cache at pos: the last write, from the final state, wins
            new_logits = model.readout(s_new, caches["coda"], pos)[:, -1]
            done = logits is not None and token_kl(new_logits, logits).item() < threshold
            logits = new_logits
        else:
            done = exit == "state" and state_change(s_new, s, relative=True).item() < threshold
        s = s_new
        if done:
            break
    if exit != "kl":
        logits = model.readout(s, caches["coda"], pos)[:, -1]
    if exit != "none":  # at fixed depth every token fills every loop's cache itself
        share_latest(caches, loop + 1, int(pos[0, 0]))
    return logits, loop + 1


@torch.no_grad()
def generate(model, idx, n_new, loops, s0, pick, exit="none", threshold=0.0, max_loops=1, on_token=lambda idx: None):
    """Prefill idx (B, T0) at `loops`, then n_new tokens one at a time against the caches.
    -> (idx with the new tokens, loops run by each new token that was fed back, caches)."""
    (B, T0), c, L = idx.shape, model.config, idx.size(1) + n_new
    caches = {"prelude": model.new_caches(c.n_prelude, B, L), "coda": model.new_caches(c.n_coda, B, L),
              "core": [model.new_caches(c.n_core, B, L)]}  # one list of n_core caches per loop, made on first use
    logits, _ = feed(model, idx, torch.arange(T0, device=idx.device).expand(B, T0), s0[:, :T0], caches, loops)
    depths = []
    for t in range(T0, T0 + n_new):
        idx = torch.cat([idx, pick(logits)], dim=1)
        on_token(idx)
        if t == T0 + n_new - 1:  # the last token is never fed back
            break
        pos = torch.full((B, 1), t, device=idx.device)
        logits, n = feed(model, idx[:, t:], pos, s0[:, t:t + 1], caches, max_loops if exit != "none" else loops, exit, threshold)
        depths.append(n)
    return idx, depths, caches


@torch.no_grad()
def generate_nocache(model, idx, n_new, loops, s0, pick):
    """nanoGPT's generate: the whole context recomputed for every new token (reference, bench (a))."""
    for _ in range(n_new):
        e, s = model.prelude(idx), s0[:, :idx.size(1)]
        for _ in range(loops):
            s = model.core_step(e, s)
        idx = torch.cat([idx, pick(model.readout(s)[:, -1])], dim=1)
    return idx


# ---- the command line --------------------------------------------------------------------------
def prompt_ids(text, encode, decode, block_size, n_new):
    if text.startswith("FILE:"):
        if not os.path.isfile(text[5:]):
            die(f"--start {text}: no such file")
        with open(text[5:], encoding="utf-8") as f:
            text = f.read()
    if not text:
        die("--start: the prompt is empty (the default is a newline)")
    ids = encode(text)
    if decode(ids) != text:
        die("--start: the tokenizer cannot encode the prompt exactly (characters it does not know?)")
    if len(ids) + n_new > block_size:
        die(f"prompt of {len(ids)} tokens + {n_new} new tokens exceeds the model's block_size {block_size}: shorten one")
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
    for name, least in (("loops", 1), ("max_loops", 2 if C.exit == "kl" else 1)):  # kl compares two loops' outputs
        value = getattr(C, name)
        if value is not None and (type(value) is not int or value < least):
            die(f"--{name} must be an integer >= {least}, got {value!r}")
    if C.exit not in ("none", "kl", "state") or C.state_init not in ("noise", "zero"):
        die(f"--exit must be none, kl or state and --state_init noise or zero (got {C.exit!r}, {C.state_init!r})")
    if C.num_samples < 1 or C.max_new_tokens < 1 or C.temperature < 0 or C.top_k < 0 or C.exit_threshold < 0:
        die("need --num_samples >= 1, --max_new_tokens >= 1, --temperature >= 0, --top_k >= 0, --exit_threshold >= 0")
    return C.loops or cfg.mean_loops, C.max_loops or cfg.max_loops


def run_bench(model, C, data_dir, meta, loops, max_loops):
    """Batch 1, greedy: a P-token prompt (the start of val.bin) then N new tokens, timed end to end."""
    P = N = min(256, model.config.block_size // 2)
    val = np.memmap(os.path.join(data_dir, "val.bin"), dtype=meta["dtype"], mode="r")
    if len(val) < P:
        die(f"{data_dir}/val.bin has {len(val)} tokens, fewer than the {P}-token benchmark prompt")
    idx = torch.from_numpy(val[:P].astype(np.int64))[None].to(C.device)
    s0 = initial_states(model, 1, P + N, C.state_init, C.seed, C.device)
    greedy = partial(sample_next, temperature=0.0, top_k=0, generator=None)
    sync = torch.cuda.synchronize if C.device.startswith("cuda") else (lambda: None)

    def timed(fn, *args):  # -> (fn's result, tokens/s)
        fn(model, idx, 8, *args)  # warm-up: allocator, kernels, compilation
        sync()
        t0 = time.perf_counter()
        out = fn(model, idx, N, *args)
        sync()
        return out, N / (time.perf_counter() - t0)

    print(f"benchmark: batch 1, greedy, state_init {C.state_init}, prompt P = {P} and N = {N} new tokens, end to end "
          f"({'as in the issue' if P == 256 else f'block_size {model.config.block_size} // 2: the issue asks 256'}); "
          f"{platform.processor() or platform.machine()}, {C.device}, torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    _, tps_a = timed(generate_nocache, loops, s0, greedy)
    (ref, _, _), tps_b = timed(generate, loops, s0, greedy)
    print(f"| mode | loops/new token | tokens/s | speedup | greedy tokens equal to (b) |\n|---|---|---|---|---|\n"
          f"| (a) no cache, loops {loops} | {loops} | {tps_a:.1f} | | |\n"
          f"| (b) cache, loops {loops} | {loops} | {tps_b:.1f} | {tps_b / tps_a:.2f}x (b)/(a) | {N}/{N} |")
    sweep = [("kl", x) for x in (1e-2, 1e-3, 1e-4)] + [("state", x) for x in (1e-1, 3e-2, 1e-2)]
    for exit, threshold in [(C.exit, C.exit_threshold)] if C.exit != "none" else sweep:  # --exit: that point only
        (out, depths, _), tps = timed(generate, loops, s0, greedy, exit, threshold, max_loops)
        print(f"| (c) {exit} < {threshold:g}, max {max_loops} | {sum(depths) / len(depths):.2f} | {tps:.1f} | "
              f"{tps / tps_b:.2f}x (c)/(b) | {int((out[0, P:] == ref[0, P:]).sum())}/{N} |")
    print(f"\nthe prompt is prefilled at loops {loops} in every mode; (c) at equal quality is the threshold whose "
          f"teacher-forced loss matches uniform loops {loops} (allocate.py measures it)")


def main(argv=()):
    C = SimpleNamespace(**configure(DEFAULTS, list(argv)))
    if C.device.startswith("cuda") and not torch.cuda.is_available():
        die(f"--device {C.device}: CUDA is not available here")
    model, ckpt = load_checkpoint(os.path.join(C.out_dir, "ckpt.pt"), C.device)
    loops, max_loops = validate(C, model.config)
    data_dir = os.path.join("data", ckpt["config"]["dataset"])
    encode, decode = load_tokenizer(data_dir)
    if C.compile:  # per part, as train.py does; dynamic: the cached key length grows every token
        for part in (model.prelude_blocks, model.core, model.coda_blocks):
            part.compile(dynamic=True)
    if C.bench:
        return run_bench(model, C, data_dir, ckpt["config"]["dataset_meta"], loops, max_loops)
    ids = prompt_ids(C.start, encode, decode, model.config.block_size, C.max_new_tokens)
    pick = partial(sample_next, temperature=C.temperature, top_k=C.top_k,
                   generator=torch.Generator(device=C.device).manual_seed(C.seed))
    # fixed depth: all samples as one batch; adaptive depth: one sequence at a time
    batch, runs = (C.num_samples, 1) if C.exit == "none" else (1, C.num_samples)
    all_depths, t0 = [], time.perf_counter()
    for run in range(runs):
        s0 = initial_states(model, batch, len(ids) + C.max_new_tokens, C.state_init, C.seed + run, C.device)
        shown = stream(decode, ids, "")

        def on_token(idx):  # streams the first sequence; the batch's others are printed when done
            nonlocal shown
            shown = stream(decode, idx[0].tolist(), shown)
        out, depths, _ = generate(model, torch.tensor([ids] * batch, device=C.device), C.max_new_tokens, loops, s0,
                                  pick, C.exit, C.exit_threshold, max_loops, on_token)
        for row in range(batch):
            text = decode(out[row].tolist())
            print(text[len(shown):] if row == 0 else text, end="\n---------------\n", flush=True)
        all_depths += depths
    n_tokens, dt = C.num_samples * C.max_new_tokens, time.perf_counter() - t0
    mode = f"loops {loops}" if C.exit == "none" else f"exit {C.exit} < {C.exit_threshold:g}, prompt at loops {loops}"
    print(f"{n_tokens} new tokens in {dt:.2f}s: {n_tokens / dt:.1f} tokens/s ({mode})", file=sys.stderr)
    if all_depths and C.exit != "none":
        hist = " ".join(f"{n}:{c}" for n, c in sorted(Counter(all_depths).items()))
        print(f"loops per new token: mean {sum(all_depths) / len(all_depths):.2f}, histogram (loops:tokens) {hist}",
              file=sys.stderr)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
