"""
Measure what the recurrence computes, on a checkpoint and its dataset's validation split:

    python evaluate.py --out_dir=out-shakespeare [--loops 1,2,4,8,16,32] [--windows 64] [--plot]
    python evaluate.py --out_dir=out-s1 --hf_model HuggingFaceTB/SmolLM2-135M

1. Elasticity / cost curve: loss, ppl, tokens/s at batch 1 and throughput relative to mean_loops per
   uniform loop count r, through model.forward with noise init (exactly the training path).
2. Convergence diagnostic: one loop-by-loop pass (the per-loop API) to diag_loops; per loop i >= 2
   mean KL(p_i || p_{i-1}), mean ||s_i - s_{i-1}||, percent of tokens with KL > 1e-3.
3. Depth by token class under the training-free convergence exit (A1), from that same pass.
4. Optionally a Hugging Face causal LM on the same text as a ceiling reference (per token and per byte).
Tables on stdout, every number in out_dir/eval.json, figures with --plot; windows and noise are seeded.
"""
import math
import os
import time
import unicodedata
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from configurator import (check_device, configure, default_device, die, require_package, require_positive,
                          run, write_json)
from model import load_checkpoint, state_change, token_kl

# ---- defaults --------------------------------------------------------------------------
out_dir = "out-shakespeare"  # reads out_dir/ckpt.pt, writes out_dir/eval.json and figures
loops = ""  # comma-separated loop counts, e.g. "1,2,4,8"; "" = 1, 2, mean/2, mean, 2x mean, 4x mean
windows = 64
batch_size = 8
diag_loops = 0  # 0: 2x mean_loops
diag_init = "noise"  # 'noise' (the training path) or 'zero'
exit_threshold = 1e-3  # KL(p_i || p_{i-1}) under which the convergence exit stops a token
timing_windows = 4  # batch-1 forwards timed per loop count, after one warm-up
seed = 1337
hf_model = ""  # e.g. HuggingFaceTB/SmolLM2-135M; needs `transformers`
plot = False
device, dtype = default_device()  # cuda + bfloat16 when a GPU is there, else cpu + float32
DEFAULTS = {k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, str, bool))}
MOVING_KL = 1e-3  # the paper's "still moving" line, fixed so tables compare across runs
CLASSES = ("space", "numeral", "punctuation", "word")


def loop_counts(text, mean):
    """The sweep's loop counts, sorted; mean_loops is always in it (the throughput reference)."""
    if not text:
        return sorted({1, 2, max(1, mean // 2), mean, 2 * mean, 4 * mean})
    try:
        counts = {int(part) for part in text.split(",")}
    except ValueError:
        die(f"--loops {text!r}: expected comma-separated integers, e.g. 1,2,4,8")
    if min(counts) < 1:
        die(f"--loops {text!r}: every loop count must be >= 1")
    return sorted(counts | {mean})


def load_windows(path, bin_dtype, n, length, seed):
    """n non-overlapping stretches of `length` tokens at seeded, sorted offsets -> (n, length) int64."""
    data = np.memmap(path, dtype=bin_dtype, mode="r")
    slots = len(data) // length
    if not 1 <= n <= slots:
        die(f"--windows {n}: {path} ({len(data):,} tokens) holds 1 to {slots} windows of {length} tokens")
    picked = torch.randperm(slots, generator=torch.Generator().manual_seed(seed))[:n].sort().values
    return torch.stack([torch.from_numpy(data[i * length:(i + 1) * length].astype(np.int64)) for i in picked.tolist()])


def token_class(text):
    """space / numeral / punctuation / word from a token's decoded text. Spaces around a symbol do not
    count against punctuation (byte-level BPE glues them on: ' (', ' --'); a piece of a multi-byte
    character decodes to U+FFFD, which is a symbol by category but a fragment of text: a word."""
    if text and text.isspace():
        return "space"
    if any(ch.isdigit() for ch in text):
        return "numeral"
    if text.strip() and "\ufffd" not in text and all(unicodedata.category(ch)[0] in "PS" for ch in text.strip()):
        return "punctuation"
    return "word"


def batches(wins, size, desc):
    for i in tqdm(range(0, len(wins), size), desc=desc, leave=False):
        yield wins[i:i + size, :-1], wins[i:i + size, 1:].contiguous()


@torch.no_grad()
def sweep_point(model, wins, r, C, ctx):
    """Loss at r loops through model.forward with noise init (the training path, as train.py evaluates),
    and teacher-forced tokens/s at batch 1 over timing_windows windows after a warm-up."""
    gen = torch.Generator(device=C.device).manual_seed(C.seed)
    sync = torch.cuda.synchronize if C.device.startswith("cuda") else (lambda: None)
    total, timed = 0.0, wins[:C.timing_windows, :-1]
    with ctx:
        for x, y in batches(wins, C.batch_size, f"loss r={r}"):
            total += model(x, y, loops=r, state_init="noise", generator=gen)[1].item() * y.numel()
        model(timed[:1], loops=r)  # warm-up at batch 1
        sync()
        t0 = time.perf_counter()
        for x in timed:
            model(x[None], loops=r)
        sync()
    loss = total / wins[:, 1:].numel()
    return {"loops": r, "loss": loss, "ppl": math.exp(loss), "tokens_per_s": timed.numel() / (time.perf_counter() - t0)}


def token_loss(logits, y):
    """Per-token cross-entropy in float32, shaped like y."""
    return F.cross_entropy(logits.float().flatten(0, -2), y.flatten(), reduction="none").view_as(y)


@torch.no_grad()
def trace(model, x, y, n_loops, state_init="zero", generator=None, keep_states=False):
    """Every token of x (B, T) through n_loops loops, nothing frozen, read out after each (the per-loop
    API). Per loop i (dim 0) and token: loss, KL(p_i || p_{i-1}) (inf at loop 1), state change
    ||s_i - s_{i-1}|| and its relative version (over ||s_i||), argmax, and optionally s_i."""
    e = model.prelude(x)
    s, prev = model.init_state(e, state_init, generator), None
    rows = {"loss": [], "kl": [], "dstate": [], "dstate_rel": [], "argmax": [], "state": []}
    for _ in range(n_loops):
        s_new = model.core_step(e, s)
        logits = model.readout(s_new)
        rows["loss"].append(token_loss(logits, y))
        no_previous = torch.full(y.shape, float("inf"), device=y.device)  # loop 1 has nothing to compare with
        rows["kl"].append(no_previous if prev is None else token_kl(logits, prev))
        rows["dstate"].append(state_change(s_new, s))
        rows["dstate_rel"].append(state_change(s_new, s, relative=True))
        rows["argmax"].append(logits.argmax(-1))
        if keep_states:
            rows["state"].append(s_new)
        s, prev = s_new, logits
    return {k: torch.stack(v) for k, v in rows.items() if v}


def loop_by_loop(model, wins, n_loops, C, ctx):
    """The trace of every window, as per-token tensors (loop, N): KL(p_i || p_{i-1}) and ||s_i - s_{i-1}||
    for loops i = 2..n_loops, and the loss for loops 1..n_loops."""
    gen = torch.Generator(device=C.device).manual_seed(C.seed)  # noise init: the diagnostic's own draws
    parts = []
    for x, y in batches(wins, C.batch_size, f"diagnostic to {n_loops} loops"):
        with ctx:
            parts.append(trace(model, x, y, n_loops, C.diag_init, gen))
    kl, change, loss = (torch.cat([part[k].flatten(1) for part in parts], 1).cpu() for k in ("kl", "dstate", "loss"))
    return kl[1:], change[1:], loss


def convergence_depth(kl, threshold=MOVING_KL):
    """Per token, the first loop after which KL stays <= threshold through the last loop (kl row j is
    loop j + 2). 1 if it never moves after loop 1; n_loops + 1 if it is still moving at the last loop."""
    n_loops = kl.size(0) + 1
    last_moving = torch.where(kl > threshold, torch.arange(2, n_loops + 1)[:, None], 0).amax(0)
    return torch.where(last_moving == n_loops, n_loops + 1, last_moving.clamp_min(1))


def exit_depth(kl, threshold):
    """The convergence exit (A1): the first loop i >= 2 with KL(p_i || p_{i-1}) < threshold, else the last."""
    below = kl < threshold
    return torch.where(below.any(0), below.int().argmax(0) + 2, kl.size(0) + 1)


@torch.no_grad()
def hf_reference(name, texts, device):
    """A Hugging Face causal LM on the same text, with its own tokenizer: nats per own token and per
    predicted byte (the bytes after its first token, which nothing predicts)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(name)
        lm = AutoModelForCausalLM.from_pretrained(name).to(device).eval()
    except OSError as err:  # unknown name, no network, no local cache
        die(f"--hf_model {name}: cannot load it: {str(err).splitlines()[0]}")
    nll, n_tokens, n_bytes = 0.0, 0, 0
    for text in tqdm(texts, desc=name, leave=False):
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids.to(device)
        logits = lm(ids).logits[0, :-1].float()
        nll += F.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        n_tokens += ids.size(1) - 1
        n_bytes += len(text.encode()) - len(tok.decode(ids[0, :1]).encode())
    return {"model": name, "loss_per_token": nll / n_tokens, "loss_per_byte": nll / n_bytes,
            "tokens": n_tokens, "bytes": n_bytes}


def markdown(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(str(v) for v in row) + " |" for row in rows])


def print_tables(res):
    mean, el, cv, tc = res["checkpoint"]["mean_loops"], res["elasticity"], res["convergence"], res["token_classes"]
    print(f"\n## Elasticity / cost curve (noise init, {res['windows']} windows of {res['block_size']} tokens)\n")
    rows = []
    for r in el:
        per_byte = f"{r['loss_per_byte']:.4f} / {r['bits_per_byte']:.4f}" if "loss_per_byte" in r else "n/a"
        speed = f"{r['relative_throughput']:.{1 if r['relative_throughput'] >= 1 else 2}f}x"
        rows.append([r["loops"], f"{r['loss']:.4f}", per_byte, f"{r['ppl']:.1f}", f"{r['tokens_per_s']:.0f}", speed])
    print(markdown(["loops r", "loss (nats/token)", "nats / bits per byte", "ppl", "tokens/s (batch 1)",
                    "relative throughput"], rows))
    print(f"\n## Convergence diagnostic ({cv['init']} init, run to {cv['diag_loops']} loops)\n")
    print(markdown(["loop i", "mean KL", "mean state change", "percent tokens moving", "loss (nats)"],
                   [[r["loop"], f"{r['mean_kl']:.1e}", f"{r['mean_state_change']:#.3g}".rstrip("."),
                     f"{r['percent_moving']:.1f}", f"{r['loss']:.3f}"] for r in cv["rows"]]))
    at_mean = "n/a" if cv["percent_moving_at_mean"] is None else f"{cv['percent_moving_at_mean']:.1f}%"
    print(f"\nper-token convergence depth (first loop after which KL stays <= {MOVING_KL:g}): median "
          f"{cv['median_depth']:g}; {at_mean} of tokens still moving at loop {mean} (mean_loops); "
          f"{cv['percent_unconverged']:.1f}% still moving at loop {cv['diag_loops']} (depth {cv['diag_loops'] + 1})")
    print(f"\n## Depth by token class (convergence exit, KL < {tc['exit_threshold']:g}, {cv['init']} init)\n")
    rows = []
    for r in tc["rows"]:
        rows.append([r["class"], r["count"], "-" if r["mean_exit_depth"] is None else f"{r['mean_exit_depth']:.2f}"])
    rows.append(["all", res["windows"] * res["block_size"], f"{tc['mean_exit_depth']:.2f}"])
    print(markdown(["class", "tokens", "mean exit depth"], rows))
    if c := res["ceiling"]:
        print(f"\n## Ceiling reference (same {res['windows']} windows)\n")
        print(markdown(["model", "loss per own token", "loss per byte", "tokens"],
                       [[f"this model, r={mean}", f"{c['ours_loss_per_token']:.3f}", f"{c['ours_loss_per_byte']:.3f}",
                         c["ours_tokens"]],
                        [c["model"], f"{c['loss_per_token']:.3f}", f"{c['loss_per_byte']:.3f}", c["tokens"]]]))


def main(argv=()):
    t_start = time.perf_counter()
    C = SimpleNamespace(**configure(DEFAULTS, list(argv)))
    require_positive(C, "windows", "batch_size", "timing_windows", "exit_threshold")
    check_device(C.device, C.dtype)
    if C.diag_init not in ("noise", "zero"):
        die(f"--diag_init must be noise or zero, got {C.diag_init!r}")
    if C.hf_model:  # fail before the long part, not after it
        require_package("transformers", "--hf_model")
    model, ckpt = load_checkpoint(os.path.join(C.out_dir, "ckpt.pt"), C.device)
    mean, block = model.config.mean_loops, model.config.block_size
    sweep = loop_counts(C.loops, mean)
    n_diag = C.diag_loops or 2 * mean
    if n_diag < max(2, mean):
        die(f"--diag_loops {n_diag}: the diagnostic needs at least 2 loops and at least mean_loops ({mean})")
    from prepare import load_tokenizer, open_dataset
    ckpt_path = os.path.join(C.out_dir, "ckpt.pt")
    data_dir, meta = open_dataset(ckpt["config"]["dataset"], ckpt, ckpt_path, splits=("val",))
    _, decode = load_tokenizer(data_dir)
    wins = load_windows(os.path.join(data_dir, "val.bin"), meta["dtype"], C.windows, block + 1, C.seed).to(C.device)
    ctx = nullcontext() if C.dtype == "float32" else torch.autocast(C.device.split(":")[0], dtype=torch.bfloat16)
    print(f"{C.out_dir}/ckpt.pt: iter {ckpt['iter_num']}, {model.get_num_params() / 1e6:.2f}M non-embedding params, "
          f"mean_loops {mean}, dataset {ckpt['config']['dataset']}; {C.windows} val windows, {C.device} {C.dtype}")

    el = [sweep_point(model, wins, r, C, ctx) for r in sweep]
    ref = next(row["tokens_per_s"] for row in el if row["loops"] == mean)
    tokens_per_byte = meta["val_tokens"] / meta["val_bytes"] if meta.get("val_bytes") else None
    for row in el:
        row["relative_throughput"] = row["tokens_per_s"] / ref
        if tokens_per_byte:  # per byte of validation text: comparable across tokenizers
            row["loss_per_byte"] = row["loss"] * tokens_per_byte
            row["bits_per_byte"] = row["loss_per_byte"] / math.log(2)

    kl, change, nll = loop_by_loop(model, wins, n_diag, C, ctx)
    depth, moving = convergence_depth(kl), 100 * (kl > MOVING_KL).float().mean(1)  # moving[j]: loop j + 2
    rows = [{"loop": i, "mean_kl": kl[i - 2].mean().item(), "mean_state_change": change[i - 2].mean().item(),
             "percent_moving": moving[i - 2].item(), "loss": nll[i - 1].mean().item()} for i in range(2, n_diag + 1)]
    cv = {"init": C.diag_init, "diag_loops": n_diag, "moving_kl": MOVING_KL, "rows": rows,
          "median_depth": float(np.median(depth.numpy())),
          "percent_moving_at_mean": moving[mean - 2].item() if mean >= 2 else None,
          "percent_unconverged": 100 * (depth > n_diag).float().mean().item()}

    exits = exit_depth(kl, C.exit_threshold).float().numpy()
    targets = wins[:, 1:].flatten().tolist()
    class_of_id = {i: token_class(decode([i])) for i in set(targets)}  # the class of the predicted token
    classes = np.array([class_of_id[t] for t in targets])
    tc = {"exit_threshold": C.exit_threshold, "mean_exit_depth": float(exits.mean()), "rows": []}
    for name in CLASSES:
        picked = exits[classes == name]
        mean_exit = float(picked.mean()) if picked.size else None
        tc["rows"].append({"class": name, "count": picked.size, "mean_exit_depth": mean_exit})

    ceiling = None
    if C.hf_model:
        ours_bytes = sum(len(decode(w[1:].tolist()).encode()) for w in wins.cpu())
        ours_loss = next(row["loss"] for row in el if row["loops"] == mean)
        ceiling = hf_reference(C.hf_model, [decode(w.tolist()) for w in wins.cpu()], C.device) | {
            "ours_loss_per_token": ours_loss, "ours_tokens": len(targets),
            "ours_loss_per_byte": ours_loss * len(targets) / ours_bytes, "ours_bytes": ours_bytes}

    res = {"args": vars(C), "checkpoint": {
        "path": os.path.join(C.out_dir, "ckpt.pt"), "iter_num": ckpt["iter_num"], "dataset": ckpt["config"]["dataset"],
        "mean_loops": mean, "max_loops": model.config.max_loops}, "windows": C.windows, "block_size": block,
        "elasticity": el, "convergence": cv, "token_classes": tc, "ceiling": ceiling}
    print_tables(res)
    res["seconds"] = time.perf_counter() - t_start
    write_json(os.path.join(C.out_dir, "eval.json"), res)
    if C.plot:
        from plots import eval_figures
        eval_figures(res, C.out_dir)
    print(f"\nwrote {C.out_dir}/eval.json{' and eval_*.png' if C.plot else ''} in {time.perf_counter() - t_start:.1f}s")
    return res


if __name__ == "__main__":
    run(main)
