"""
Measure what the recurrence computes, on a checkpoint and its validation split:

    python evaluate.py --out_dir=out-shakespeare --loops=1,2,4,8 --plot
    python evaluate.py --hf_model=HuggingFaceTB/SmolLM2-135M  # a ceiling
    python evaluate.py --versus=out-shakespeare-fixed  # beside the control

1. Elasticity / cost curve: per uniform loop count r, the loss through model.forward
   with noise init (the training path) and tokens/s at batch 1.
2. Convergence: one loop-by-loop pass (the per-loop API); per loop i >= 2 the mean
   KL(p_i || p_{i-1}), mean ||s_i - s_{i-1}|| and the tokens with KL > 1e-3.
3. Depth by token class under the convergence exit (A1), from that pass.
4. Optionally a Hugging Face causal LM on the same text, as a ceiling.
Tables on stdout, every number in out_dir/eval.json, figures with --plot.
"""
import importlib
import json
import math
import os
import time
import unicodedata

import numpy as np
import torch
from tqdm import tqdm

from configurator import configure, die, run
from model import autocast, checkpoint_id, load_checkpoint, state_change, token_kl, token_loss, write_json
from prepare import load_tokenizer, open_dataset

# ---- settings ------------------------------------------------------------------------
out_dir = "out-shakespeare"  # reads ckpt.pt, writes eval.json and figures
loops = ""  # loop counts, e.g. "1,2,4,8"; "": 1, 2, mean/2, mean, 2x, 4x mean
windows = 64  # validation windows of block_size + 1 tokens
batch_size = 8  # windows per forward
diag_loops = 0  # loops of the convergence pass; 0: 2 x mean_loops
diag_init = "noise"  # its initial state: 'noise' (as in training) or 'zero'
exit_threshold = 1e-3  # the convergence exit: KL(p_i || p_{i-1}) below this
timing_windows = 4  # batch-1 forwards timed per loop count
seed = 1337  # picks the windows and the noise
hf_model = ""  # a ceiling, e.g. HuggingFaceTB/SmolLM2-135M (needs transformers)
versus = ""  # a fixed-depth control's out_dir: its eval.json's curve beside ours
plot = False  # draw the figures (needs matplotlib)
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu, cuda or cuda:N
dtype = "bfloat16" if torch.cuda.is_available() else "float32"  # autocast dtype of the matmuls
RULES = dict(
    out_dir=str, loops=str, windows=(1, 2 ** 20), batch_size=(1, 2 ** 16),
    diag_loops=(0, 4096), diag_init=("noise", "zero"), exit_threshold=(1e-12, 100.0),
    timing_windows=(1, 4096), seed=(0, 2 ** 63 - 1), hf_model=str, versus=str,
    plot=bool, device=str, dtype=("float32", "bfloat16"))
MOVING_KL = 1e-3  # the paper's "still moving" line, fixed to compare runs
CLASSES = ("space", "numeral", "punctuation", "word")


def loop_counts(text, mean):
    """The sweep, sorted, always with mean_loops (the throughput reference)."""
    if not text:
        return sorted({1, 2, max(1, mean // 2), mean, 2 * mean, 4 * mean})
    parts = text.split(",")
    if not all(p.strip().isdigit() and 1 <= int(p) <= 1024 for p in parts):
        die(f"--loops {text!r}: expected loop counts in [1, 1024], e.g. 1,2,4,8")
    return sorted({int(p) for p in parts} | {mean})


def load_windows(path, bin_dtype, n, length, seed):
    """n windows of `length` tokens at seeded offsets -> (n, length) int64."""
    data = np.memmap(path, dtype=bin_dtype, mode="r")
    slots = len(data) // length
    if not 1 <= n <= slots:
        die(f"{n} windows of {length} tokens asked for: {path} holds 1 to {slots}")
    order = torch.randperm(slots, generator=torch.Generator().manual_seed(seed))
    starts = order[:n].sort().values * length
    rows = [data[i:i + length] for i in starts.tolist()]
    return torch.from_numpy(np.stack(rows).astype(np.int64))


def token_class(text):
    """space / numeral / punctuation / word from a token's text. Spaces do not count
    against punctuation (byte-level BPE glues them on: ' (', ' --'); a piece of a
    multi-byte character decodes to U+FFFD: a symbol, but a piece of a word."""
    if text and text.isspace():
        return "space"
    if any(ch.isdigit() for ch in text):
        return "numeral"
    symbols = text.strip()
    kinds = {unicodedata.category(ch)[0] for ch in symbols}
    if symbols and "\ufffd" not in text and kinds <= {"P", "S"}:
        return "punctuation"
    return "word"


def optional(package, flag):
    """Imported before the work, so that a missing one is one line, at once."""
    try:
        return importlib.import_module(package)
    except ImportError:
        die(f"{flag} needs `{package}`: pip install {package}")


def batches(wins, size, desc):
    for i in tqdm(range(0, len(wins), size), desc=desc, leave=False):
        yield wins[i:i + size, :-1], wins[i:i + size, 1:].contiguous()


@torch.no_grad()
def sweep_point(model, wins, r, C, ctx):
    """Loss at r loops through model.forward with noise init (as train.py
    evaluates), and tokens/s at batch 1 over timing_windows windows."""
    gen = torch.Generator(device=C.device).manual_seed(C.seed)
    cuda = C.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else lambda: None
    timed = wins[:C.timing_windows, :-1]
    total = 0.0
    with ctx:
        for x, y in batches(wins, C.batch_size, f"loss r={r}"):
            loss = model(x, y, loops=r, generator=gen)[1]
            total += loss.item() * y.numel()
        model(timed[:1], loops=r)  # warm-up
        sync()
        t0 = time.perf_counter()
        for x in timed:
            model(x[None], loops=r)
        sync()
    speed = timed.numel() / (time.perf_counter() - t0)
    loss = total / wins[:, 1:].numel()
    ppl = math.exp(loss)
    return dict(loops=r, loss=loss, ppl=ppl, tokens_per_s=speed)


@torch.no_grad()
def trace(model, x, y, n_loops, state_init="zero", generator=None, keep_states=False):
    """Every token of x (B, T) through n_loops loops (the per-loop API). Per loop
    (dim 0) and token: loss, KL(p_i || p_{i-1}) (inf at loop 1), the state change
    ||s_i - s_{i-1}||, absolute and over ||s_i||, argmax, and optionally s_i.
    Alive at once: two loops' logits (B, T, V), one chunk's float32 softmaxes."""
    e = model.prelude(x)
    s = model.init_state(e, state_init, generator)
    prev = None
    rows = dict(loss=[], kl=[], dstate=[], dstate_rel=[], argmax=[], state=[])
    first = torch.full(y.shape, math.inf, device=y.device)
    for _ in range(n_loops):
        s_new = model.core_step(e, s)
        logits = model.readout(s_new)
        rows["loss"].append(token_loss(logits, y))
        kl = first if prev is None else token_kl(logits, prev)
        rows["kl"].append(kl)
        rows["dstate"].append(state_change(s_new, s))
        rows["dstate_rel"].append(state_change(s_new, s, relative=True))
        rows["argmax"].append(logits.argmax(-1))
        if keep_states:
            rows["state"].append(s_new)
        s = s_new
        prev = logits
    return {k: torch.stack(v) for k, v in rows.items() if v}


def convergence_depth(kl, threshold=MOVING_KL):
    """Per token, the first loop after which KL stays <= threshold (kl row j is
    loop j + 2): 1 if it never moves, n_loops + 1 if it moves at the last loop."""
    n_loops = kl.size(0) + 1
    loop = torch.arange(2, n_loops + 1)[:, None]
    last_moving = torch.where(kl > threshold, loop, 0).amax(0)
    unconverged = last_moving == n_loops
    return torch.where(unconverged, n_loops + 1, last_moving.clamp_min(1))


def exit_depth(kl, threshold):
    """The convergence exit: the first loop with KL < threshold, else the last."""
    below = kl < threshold
    first = below.int().argmax(0) + 2
    return torch.where(below.any(0), first, kl.size(0) + 1)


def markdown(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    cells = [" | ".join(str(v) for v in row) for row in rows]
    return "\n".join(lines + [f"| {line} |" for line in cells])


def table(title, rows, columns):
    """Records as a markdown table under their eval.json names; columns is
    "key:format key ...", and a missing or None value prints nan."""
    specs = [column.partition(":")[::2] for column in columns.split()]
    cells = []
    for row in rows:
        values = [row.get(key) for key, _ in specs]
        values = [math.nan if v is None else v for v in values]
        cells.append([format(v, f) for v, (_, f) in zip(values, specs)])
    print(f"\n## {title}\n\n{markdown([key for key, _ in specs], cells)}")


def elasticity(model, wins, sweep, meta, control, C, ctx):
    """The sweep, each row with its speed relative to mean_loops', its loss per
    byte of text (comparable across tokenizers) where the split's bytes are
    known, and the fixed-depth control's loss at r if there is one."""
    el = [sweep_point(model, wins, r, C, ctx) for r in sweep]
    mean = model.config.mean_loops
    ref = next(row["tokens_per_s"] for row in el if row["loops"] == mean)
    for row in el:
        row["relative_throughput"] = row["tokens_per_s"] / ref
        if meta.get("val_bytes"):
            per_byte = row["loss"] * meta["val_tokens"] / meta["val_bytes"]
            row["loss_per_byte"] = per_byte
            row["bits_per_byte"] = per_byte / math.log(2)
        if control:
            row["control_loss"] = control.get(row["loops"])
    columns = "loops loss:.4f loss_per_byte:.4f bits_per_byte:.4f ppl:.1f"
    columns += " tokens_per_s:.0f relative_throughput:.2f"
    if control:
        columns += " control_loss:.4f"
    size = f"{len(wins)} windows of {wins.size(1) - 1} tokens"
    table(f"Elasticity / cost curve (noise init, {size})", el, columns)
    return el


def read_control(out_dir):
    """A fixed-depth control's loss per loop count, from its eval.json."""
    path = os.path.join(out_dir, "eval.json")
    try:
        with open(path) as f:
            rows = json.load(f)["elasticity"]
        return {row["loops"]: row["loss"] for row in rows}
    except (OSError, ValueError, KeyError, TypeError) as err:
        die(f"--versus: cannot read {path} ({type(err).__name__})")


def convergence(kl, change, nll, init, mean):
    """Per loop i >= 2 (row i - 2 of kl and change) the mean KL, state change,
    tokens still moving and loss; over tokens, the convergence depth."""
    n_diag = kl.size(0) + 1
    moving = 100 * (kl > MOVING_KL).float().mean(1)
    keys = ("loop", "mean_kl", "mean_state_change", "percent_moving", "loss")
    columns = zip(range(2, n_diag + 1), kl.mean(1).tolist(), change.mean(1).tolist(),
                  moving.tolist(), nll[1:].mean(1).tolist())
    rows = [dict(zip(keys, column)) for column in columns]
    depth = convergence_depth(kl)
    median = float(np.median(depth.numpy()))
    at_mean = moving[mean - 2].item() if mean >= 2 else None
    late = 100 * (depth > n_diag).float().mean().item()
    table(f"Convergence ({init} init, to {n_diag} loops)", rows,
          "loop mean_kl:.1e mean_state_change:.3g percent_moving:.1f loss:.3f")
    at_mean_text = "n/a" if at_mean is None else f"{at_mean:.1f}%"
    print(f"\nconvergence depth (KL <= {MOVING_KL:g} from then on): median {median:g}; "
          f"{at_mean_text} still moving at loop {mean} (mean_loops), {late:.1f}% "
          f"at loop {n_diag}")
    return dict(init=init, diag_loops=n_diag, moving_kl=MOVING_KL, rows=rows,
                median_depth=median, percent_moving_at_mean=at_mean,
                percent_unconverged=late)


def token_classes(kl, targets, decode, threshold, init):
    """Mean depth under the convergence exit per class of the target token."""
    exits = exit_depth(kl, threshold).float().numpy()
    class_of_id = {i: token_class(decode([i])) for i in set(targets)}
    classes = np.array([class_of_id[t] for t in targets])
    rows = []
    for name in CLASSES:
        picked = exits[classes == name]
        depth = float(picked.mean()) if picked.size else None
        rows.append({"class": name, "count": picked.size, "mean_exit_depth": depth})
    depth = float(exits.mean())
    every = {"class": "all", "count": len(targets), "mean_exit_depth": depth}
    table(f"Depth by token class (exit at KL < {threshold:g}, {init} init)",
          rows + [every], "class count mean_exit_depth:.2f")
    return dict(exit_threshold=threshold, mean_exit_depth=depth, rows=rows)


@torch.no_grad()
def ceiling(wins, decode, ours_loss, C):
    """--hf_model on the same text with its own tokenizer, per own token and per
    byte it predicts (those after its first token), beside ours at mean_loops."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(C.hf_model)
        lm = AutoModelForCausalLM.from_pretrained(C.hf_model).to(C.device)
    except OSError as err:  # unknown name, no network, no local cache
        die(f"--hf_model: cannot load it: {str(err).splitlines()[0]}")
    nll = 0.0
    tokens = 0
    n_bytes = 0
    for window in tqdm(wins.tolist(), desc=C.hf_model, leave=False):
        text = decode(window)
        ids = tok(text, add_special_tokens=False).input_ids
        ids = torch.tensor(ids, device=C.device)
        nll += token_loss(lm(ids[None]).logits[0, :-1], ids[1:]).sum().item()
        tokens += len(ids) - 1
        n_bytes += len(text.encode()) - len(tok.decode(ids[:1]).encode())
    per_token = nll / tokens
    per_byte = nll / n_bytes
    ref = dict(model=C.hf_model, loss_per_token=per_token, loss_per_byte=per_byte,
               tokens=tokens, bytes=n_bytes)
    ours_tokens = wins[:, 1:].numel()
    ours_bytes = sum(len(decode(w[1:]).encode()) for w in wins.tolist())
    ours_per_byte = ours_loss * ours_tokens / ours_bytes
    ours = dict(model="this model at mean_loops", loss_per_token=ours_loss,
                loss_per_byte=ours_per_byte, tokens=ours_tokens, bytes=ours_bytes)
    table(f"Ceiling reference (same {len(wins)} windows)", [ours, ref],
          "model loss_per_token:.3f loss_per_byte:.3f tokens bytes")
    return ref | {"ours": ours}


def pyplot():
    optional("matplotlib", "--plot").use("Agg")  # files only, no display
    return importlib.import_module("matplotlib.pyplot")


def save(fig, path):
    for ax in fig.axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def loss_vs_loops(ax, curves, title):
    """Loss per loop count on a log2 axis; curves: {label: {r: loss}}."""
    for label, curve in curves.items():
        ax.plot(sorted(curve), [curve[r] for r in sorted(curve)], "o-", label=label)
    loops = sorted(set().union(*curves.values()))
    ax.set_xscale("log", base=2)
    ax.set_xticks(loops, [str(r) for r in loops])
    ax.set(xlabel="inference loops r", ylabel="validation loss (nats)", title=title)


def mean_line(ax, mean):
    ax.axvline(mean, color="gray", linestyle="--", label=f"training mean ({mean})")
    ax.legend()


def curve_figures(el, mean, out_dir, control):
    """eval_loss_vs_loops.png, and vs_fixed.png beside a fixed-depth control."""
    plt = pyplot()
    curve = {row["loops"]: row["loss"] for row in el}
    speed = [row["tokens_per_s"] for row in el]
    fig, (ax_loss, ax_cost) = plt.subplots(1, 2, figsize=(11, 4.2))
    loss_vs_loops(ax_loss, {None: curve}, "Loss vs loops (noise init)")
    mean_line(ax_loss, mean)
    ax_cost.plot(speed, list(curve.values()), "o-")
    for r, x in zip(curve, speed):
        ax_cost.annotate(f"r={r}", (x, curve[r]), textcoords="offset points", xytext=(5, 5))
    ax_cost.set_xscale("log")
    ax_cost.margins(x=0.15, y=0.1)
    ax_cost.set(xlabel="tokens/s at batch 1 (log)", ylabel="validation loss (nats)",
                title="Per-request cost curve")
    save(fig, os.path.join(out_dir, "eval_loss_vs_loops.png"))
    if control:
        fig, ax = plt.subplots(figsize=(5.5, 4.2))
        randomized = f"randomized depth (LogNormal, mean {mean})"
        fixed = f"fixed depth r={mean} (control)"
        loss_vs_loops(ax, {randomized: curve, fixed: control},
                      "Randomized vs fixed-depth training")
        ax.legend(loc="upper right")
        save(fig, os.path.join(out_dir, "vs_fixed.png"))
    plt.close("all")


def diagnostic_figures(cv, tc, mean, out_dir):
    """eval_convergence.png and eval_token_classes.png."""
    plt = pyplot()
    fig, (ax_kl, ax_moving) = plt.subplots(1, 2, figsize=(11, 4.2))
    loop = [row["loop"] for row in cv["rows"]]
    ax_kl.semilogy(loop, [row["mean_kl"] for row in cv["rows"]], "o-")
    ax_kl.set(xlabel="loop i", ylabel=r"mean KL($p_i \,\|\, p_{i-1}$) (log)",
              title=f"Successive-output KL ({cv['init']} init)")
    ax_moving.plot(loop, [row["percent_moving"] for row in cv["rows"]], "o-")
    ax_moving.set(xlabel="loop i", ylim=(0, 101),
                  ylabel=f"percent of tokens with KL > {cv['moving_kl']:g}",
                  title=f"Tokens still moving (median depth {cv['median_depth']:g})")
    mean_line(ax_kl, mean)
    mean_line(ax_moving, mean)
    save(fig, os.path.join(out_dir, "eval_convergence.png"))
    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    rows = [row for row in tc["rows"] if row["mean_exit_depth"] is not None]
    names = [f"{row['class']}\n(n={row['count']})" for row in rows]
    bars = ax.bar(names, [row["mean_exit_depth"] for row in rows])
    ax.bar_label(bars, fmt="%.2f")
    ax.margins(y=0.15)
    ax.set(ylabel="mean exit depth (loops)",
           title=f"Depth by token class (exit at KL < {tc['exit_threshold']:g})")
    save(fig, os.path.join(out_dir, "eval_token_classes.png"))
    plt.close("all")


def loop_by_loop(model, wins, n_loops, C, ctx):
    """Every window's trace, (loop, token): KL(p_i || p_{i-1}) and the state
    change for loops i = 2..n_loops, and the loss for loops 1..n_loops."""
    gen = torch.Generator(device=C.device).manual_seed(C.seed)
    parts = []
    for x, y in batches(wins, C.batch_size, f"to {n_loops} loops"):
        with ctx:
            parts.append(trace(model, x, y, n_loops, C.diag_init, gen))
    kl = torch.cat([p["kl"][1:].flatten(1) for p in parts], 1)
    change = torch.cat([p["dstate"][1:].flatten(1) for p in parts], 1)
    loss = torch.cat([p["loss"].flatten(1) for p in parts], 1)
    return kl.cpu(), change.cpu(), loss.cpu()


def open_run(C):
    """The checkpoint and its validation windows. What can fail does so here,
    before the work: a missing package, an unwritable out_dir, missing data."""
    if C.hf_model:
        optional("transformers", "--hf_model")
    if C.plot:
        pyplot()
    path = os.path.join(C.out_dir, "ckpt.pt")
    model, ckpt = load_checkpoint(path, C.device)
    result = os.path.join(C.out_dir, "eval.json")
    if os.path.isdir(result) or not os.access(C.out_dir, os.W_OK):
        die(f"cannot write {result}")
    data_dir, meta = open_dataset(ckpt["config"]["dataset"], ckpt, path, splits=("val",))
    val = os.path.join(data_dir, "val.bin")
    length = model.config.block_size + 1
    wins = load_windows(val, meta["dtype"], C.windows, length, C.seed)
    _, decode = load_tokenizer(data_dir)
    return model, ckpt, wins.to(C.device), meta, decode


def main(argv=()):
    t_start = time.perf_counter()
    C, _ = configure(globals(), RULES, list(argv))
    control = read_control(C.versus) if C.versus else None
    model, ckpt, wins, meta, decode = open_run(C)
    mean = model.config.mean_loops
    sweep = loop_counts(C.loops, mean)
    n_diag = C.diag_loops or 2 * mean
    if n_diag < max(2, mean):
        die(f"--diag_loops {n_diag}: the pass needs at least 2 loops and mean_loops ({mean})")
    run_id = checkpoint_id(ckpt)
    params = model.get_num_params() / 1e6
    print(f"{C.out_dir}/ckpt.pt: {run_id}, {params:.2f}M non-embedding "
          f"params, mean_loops {mean}; {C.device} {C.dtype}")
    ctx = autocast(C.device, C.dtype)
    el = elasticity(model, wins, sweep, meta, control, C, ctx)
    kl, change, nll = loop_by_loop(model, wins, n_diag, C, ctx)
    cv = convergence(kl, change, nll, C.diag_init, mean)
    targets = wins[:, 1:].flatten().tolist()
    tc = token_classes(kl, targets, decode, C.exit_threshold, C.diag_init)
    ours = next(row["loss"] for row in el if row["loops"] == mean)
    reference = ceiling(wins, decode, ours, C) if C.hf_model else None
    checkpoint = dict(path=f"{C.out_dir}/ckpt.pt", id=run_id,
                      iter_num=ckpt["iter_num"], dataset=ckpt["config"]["dataset"],
                      mean_loops=mean, max_loops=model.config.max_loops)
    res = dict(args=vars(C), checkpoint=checkpoint, windows=C.windows,
               block_size=model.config.block_size, elasticity=el, convergence=cv,
               token_classes=tc, ceiling=reference)
    res["seconds"] = time.perf_counter() - t_start
    write_json(os.path.join(C.out_dir, "eval.json"), res)
    if C.plot:
        curve_figures(el, mean, C.out_dir, control)
        diagnostic_figures(cv, tc, mean, C.out_dir)
    print(f"\nwrote {C.out_dir}/eval.json in {res['seconds']:.1f}s")
    return res


if __name__ == "__main__":
    run(main)
