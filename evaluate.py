"""A checkpoint on its validation split: elasticity, cost curve, convergence,
depth by token class. Tables, out_dir/eval.json, --plot figures.

    python evaluate.py --out_dir=out-shakespeare --loops=1,2,4,8 --plot
    python evaluate.py --versus=out-shakespeare-fixed  # the control beside it
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
from model import autocast, checkpoint_id, load_checkpoint, state_change, token_kl, token_loss, save_atomic
from prepare import load_tokenizer, open_dataset

out_dir = "out-shakespeare"  # reads ckpt.pt, writes eval.json and figures
loops = ""  # loop counts, e.g. "1,2,4,8"; "": 1, 2, mean/2, mean, 2x, 4x mean
windows = 64  # validation windows of block_size + 1 tokens
batch_size = 8  # windows per forward
diag_loops = 0  # loops of the convergence pass; 0: 2 x mean_loops
diag_init = "noise"  # its initial state: 'noise' (as in training) or 'zero'
exit_threshold = 1e-3  # the convergence exit: KL(p_i || p_{i-1}) below this
timing_windows = 4  # batch-1 forwards timed per loop count
seed = 1337  # picks the windows and the noise
versus = ""  # a fixed-depth control's out_dir: its curve beside ours
plot = False  # draw the figures (needs matplotlib)
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu, cuda or cuda:N
dtype = "bfloat16" if torch.cuda.is_available() else "float32"  # autocast
RULES = dict(
    out_dir=str, loops=str, windows=(1, 2 ** 20), batch_size=(1, 2 ** 16), diag_loops=(0, 4096),
    diag_init=("noise", "zero"), exit_threshold=(1e-12, 100.0), timing_windows=(1, 4096),
    seed=(0, 2 ** 63 - 1), versus=str, plot=bool, device=str, dtype=("float32", "bfloat16"))
MOVING_KL = 1e-3  # the paper's "still moving" line, fixed to compare runs
CLASSES = ("space", "numeral", "punctuation", "word")


def loop_counts(text, mean):
    """The sweep, sorted, always with mean_loops (the throughput reference)."""
    if not text:
        return sorted({1, 2, max(1, mean // 2), mean, 2 * mean, 4 * mean})
    parts = text.split(",")
    if not all(p.strip().isdecimal() and 1 <= int(p) <= 1024 for p in parts):
        die(f"--loops {text!r}: expected counts in [1, 1024], e.g. 1,2,4,8")
    return sorted({int(p) for p in parts} | {mean})


def load_windows(path, bin_dtype, n, length, seed):
    """n windows of `length` tokens at seeded offsets -> (n, length) int64."""
    data = np.memmap(path, dtype=bin_dtype, mode="r")
    slots = len(data) // length
    if not 1 <= n <= slots:
        die(f"{n} windows of {length} tokens asked for: {path} holds 1 to {slots}")
    order = torch.randperm(slots, generator=torch.Generator().manual_seed(seed))
    starts = order[:n].sort().values * length
    rows = np.stack([data[i:i + length] for i in starts.tolist()])
    return torch.from_numpy(rows.astype(np.int64))


def token_class(text):
    """Byte-level BPE glues spaces on (' ('); part of a character (U+FFFD): a word."""
    if text.isspace():
        return "space"
    if any(ch.isdigit() for ch in text):
        return "numeral"
    kinds = {unicodedata.category(ch)[0] for ch in text.strip()}
    if kinds and "\ufffd" not in text and kinds <= {"P", "S"}:
        return "punctuation"
    return "word"


def batches(wins, size, desc):
    for i in tqdm(range(0, len(wins), size), desc=desc, leave=False):
        yield wins[i:i + size, :-1], wins[i:i + size, 1:].contiguous()


@torch.no_grad()
def sweep_point(model, wins, r, C):
    """Loss at r loops as train.py has it (noise init); tokens/s at batch 1."""
    gen = torch.Generator(device=C.device).manual_seed(C.seed)
    sync = torch.cuda.synchronize if C.device.startswith("cuda") else lambda: None
    timed = wins[:C.timing_windows, :-1]
    with autocast(C.device, C.dtype):
        total = sum(model(x, y, loops=r, generator=gen)[1].item() * y.numel()
                    for x, y in batches(wins, C.batch_size, f"loss r={r}"))
        model(timed[:1], loops=r)  # warm-up
        sync()
        t0 = time.perf_counter()
        for x in timed:
            model(x[None], loops=r)
        sync()
    speed = timed.numel() / (time.perf_counter() - t0)
    loss = total / wins[:, 1:].numel()
    return dict(loops=r, loss=loss, ppl=math.exp(loss), tokens_per_s=speed)


@torch.no_grad()
def trace(model, x, y, n_loops, state_init="zero", generator=None, keep_states=False):
    """x (B, T) -> per loop (n_loops, B, T): loss, kl = KL(p_i || p_{i-1}) (loop 1: inf),
    dstate = ||s_i - s_{i-1}||, dstate_rel (over ||s_i||), argmax, state = s_i if kept."""
    e = model.prelude(x)
    s = model.init_state(e, state_init, generator)
    logits = None
    rows = dict(loss=[], kl=[], dstate=[], dstate_rel=[], argmax=[], state=[])
    first = torch.full(y.shape, math.inf, device=y.device)
    for _ in range(n_loops):
        s_old, s = s, model.core_step(e, s)
        prev, logits = logits, model.readout(s)
        rows["loss"].append(token_loss(logits, y))
        rows["kl"].append(first if prev is None else token_kl(logits, prev))
        rows["dstate"].append(state_change(s, s_old))
        rows["dstate_rel"].append(state_change(s, s_old, relative=True))
        rows["argmax"].append(logits.argmax(-1))
        if keep_states:
            rows["state"].append(s)
    return {k: torch.stack(v) for k, v in rows.items() if v}


def convergence_depth(kl, threshold=MOVING_KL):
    """Per token (kl row j: loop j + 2): the loop after which KL <= threshold."""
    n_loops = kl.size(0) + 1
    last_moving = torch.where(kl > threshold, torch.arange(2, n_loops + 1)[:, None], 0).amax(0)
    return torch.where(last_moving == n_loops, n_loops + 1, last_moving.clamp_min(1))


def exit_depth(kl, threshold):
    """The convergence exit: the first loop with KL < threshold, else the last."""
    below = kl < threshold
    return torch.where(below.any(0), below.int().argmax(0) + 2, kl.size(0) + 1)


def markdown(headers, rows):
    lines = [f"| {' | '.join(str(v) for v in row)} |" for row in [headers, *rows]]
    return "\n".join([lines[0], "|" + "---|" * len(headers)] + lines[1:])


def table(title, rows, columns):
    """columns: "key:format ..." (eval.json's names); None prints nan."""
    specs = [column.partition(":")[::2] for column in columns.split()]
    cells = [[format(math.nan if row.get(k) is None else row[k], f) for k, f in specs] for row in rows]
    print(f"\n## {title}\n\n{markdown([k for k, _ in specs], cells)}")


def elasticity(model, wins, meta, control, C):
    """The sweep; loss per byte is comparable across tokenizers."""
    mean = model.config.mean_loops
    el = [sweep_point(model, wins, r, C) for r in loop_counts(C.loops, mean)]
    ref = next(row["tokens_per_s"] for row in el if row["loops"] == mean)
    for row in el:
        row["relative_throughput"] = row["tokens_per_s"] / ref
        if meta.get("val_bytes"):
            row["loss_per_byte"] = row["loss"] * meta["val_tokens"] / meta["val_bytes"]
            row["bits_per_byte"] = row["loss_per_byte"] / math.log(2)
        if control:
            row["control_loss"] = control.get(row["loops"])
    columns = "loops loss:.4f loss_per_byte:.4f bits_per_byte:.4f ppl:.1f tokens_per_s:.0f"
    columns += " relative_throughput:.2f" + (" control_loss:.4f" if control else "")
    size = f"{len(wins)} windows of {wins.size(1) - 1} tokens"
    table(f"Elasticity / cost curve (noise init, {size})", el, columns)
    return el


def convergence(model, wins, decode, n_diag, C):
    """The loop-by-loop pass -> (the convergence record, depth by token class)."""
    gen = torch.Generator(device=C.device).manual_seed(C.seed)
    with autocast(C.device, C.dtype):
        parts = [trace(model, x, y, n_diag, C.diag_init, gen)
                 for x, y in batches(wins, C.batch_size, f"to {n_diag} loops")]
    kl, change, nll = [torch.cat([p[k][1:].flatten(1) for p in parts], 1).cpu()
                       for k in ("kl", "dstate", "loss")]
    moving = 100 * (kl > MOVING_KL).float().mean(1)
    rows = [dict(loop=i + 2, mean_kl=kl[i].mean().item(), mean_state_change=change[i].mean().item(),
                 percent_moving=moving[i].item(), loss=nll[i].mean().item()) for i in range(n_diag - 1)]
    table(f"Convergence ({C.diag_init} init, to {n_diag} loops)", rows,
          "loop mean_kl:.1e mean_state_change:.3g percent_moving:.1f loss:.3f")
    depth = convergence_depth(kl)
    median = float(np.median(depth.numpy()))
    mean = model.config.mean_loops
    at_mean = moving[mean - 2].item() if mean >= 2 else None
    late = 100 * (depth > n_diag).float().mean().item()
    at_text = "n/a" if at_mean is None else f"{at_mean:.1f}%"
    print(f"\nconvergence depth (KL <= {MOVING_KL:g} after): median {median:g}; {at_text}"
          f" still moving at loop {mean} (mean_loops), {late:.1f}% at loop {n_diag}")
    cv = dict(init=C.diag_init, diag_loops=n_diag, moving_kl=MOVING_KL, rows=rows,
              median_depth=median, percent_moving_at_mean=at_mean, percent_unconverged=late)
    exits = exit_depth(kl, C.exit_threshold).float().numpy()
    targets = wins[:, 1:].flatten().tolist()
    class_of_id = {i: token_class(decode([i])) for i in set(targets)}
    classes = np.array([class_of_id[t] for t in targets])
    picked = {name: exits[classes == name] for name in CLASSES} | {"all": exits}
    rows = [{"class": name, "count": p.size, "mean_exit_depth": float(p.mean()) if p.size else None}
            for name, p in picked.items()]
    table(f"Depth by token class (exit at KL < {C.exit_threshold:g}, {C.diag_init} init)",
          rows, "class count mean_exit_depth:.2f")
    return cv, dict(exit_threshold=C.exit_threshold, mean_exit_depth=float(exits.mean()), rows=rows[:-1])


def pyplot():
    try:
        importlib.import_module("matplotlib").use("Agg")  # files only, no display
    except ImportError:
        die("--plot needs `matplotlib`: pip install matplotlib")
    return importlib.import_module("matplotlib.pyplot")


def save(fig, out_dir, name):
    for ax in fig.axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, name), dpi=120)
    pyplot().close(fig)


def curve(ax, x, y, mean=None, **labels):
    ax.plot(x, y, "o-", label=labels.pop("label", None))
    ax.set(**labels)
    if mean:
        ax.axvline(mean, color="gray", linestyle="--", label=f"training mean ({mean})")
        ax.legend()


def figures(el, cv, tc, mean, out_dir, control):
    loss = {row["loops"]: row["loss"] for row in el}
    speed = [row["tokens_per_s"] for row in el]
    fig, (ax_loss, ax_cost) = pyplot().subplots(1, 2, figsize=(11, 4.2))
    curves = {f"randomized depth (mean {mean})": loss}
    if control:  # --versus: the fixed-depth run beside it
        curves[f"fixed depth r={mean} (control)"] = control
    for label, points in curves.items():
        x = sorted(points)
        curve(ax_loss, x, [points[r] for r in x], mean, label=label, title="Loss vs loops (noise init)",
              xlabel="inference loops r", ylabel="validation loss (nats)")
    loops = sorted(set().union(*curves.values()))
    ax_loss.set_xscale("log", base=2)
    ax_loss.set_xticks(loops, [str(r) for r in loops])
    curve(ax_cost, speed, list(loss.values()), xscale="log", xmargin=0.15, ymargin=0.1,
          xlabel="tokens/s at batch 1", ylabel="validation loss (nats)", title="Per-request cost")
    for r, x in zip(loss, speed):
        ax_cost.annotate(f"r={r}", (x, loss[r]), textcoords="offset points", xytext=(5, 5))
    save(fig, out_dir, "eval_loss_vs_loops.png")
    fig, (ax_kl, ax_moving) = pyplot().subplots(1, 2, figsize=(11, 4.2))
    loop = [row["loop"] for row in cv["rows"]]
    curve(ax_kl, loop, [row["mean_kl"] for row in cv["rows"]], mean, yscale="log", xlabel="loop i",
          ylabel=r"mean KL($p_i \,\|\, p_{i-1}$) (log)", title=f"Successive-output KL ({cv['init']} init)")
    curve(ax_moving, loop, [row["percent_moving"] for row in cv["rows"]], mean, xlabel="loop i",
          ylim=(0, 101), ylabel=f"percent of tokens with KL > {cv['moving_kl']:g}",
          title=f"Tokens still moving (median depth {cv['median_depth']:g})")
    save(fig, out_dir, "eval_convergence.png")
    fig, ax = pyplot().subplots(figsize=(5.5, 4.2))
    rows = [row for row in tc["rows"] if row["mean_exit_depth"] is not None]
    names = [f"{row['class']}\n(n={row['count']})" for row in rows]
    ax.bar_label(ax.bar(names, [row["mean_exit_depth"] for row in rows]), fmt="%.2f")
    ax.set(ymargin=0.15, ylabel="mean exit depth (loops)",
           title=f"Depth by token class (exit at KL < {tc['exit_threshold']:g})")
    save(fig, out_dir, "eval_token_classes.png")


def main(argv=()):
    t_start = time.perf_counter()
    C, _ = configure(globals(), RULES, list(argv))
    control = None
    if C.versus:
        theirs = os.path.join(C.versus, "eval.json")
        try:
            with open(theirs) as f:
                control = {row["loops"]: float(row["loss"]) for row in json.load(f)["elasticity"]}
        except (OSError, ValueError, KeyError, TypeError) as err:
            die(f"--versus: cannot read {theirs} ({type(err).__name__})")
    if C.plot:
        pyplot()
    path = os.path.join(C.out_dir, "ckpt.pt")
    model, ckpt = load_checkpoint(path, C.device)
    result = os.path.join(C.out_dir, "eval.json")
    if os.path.isdir(result) or not os.access(C.out_dir, os.W_OK):
        die(f"cannot write {result}")
    mean = model.config.mean_loops
    n_diag = C.diag_loops or 2 * mean
    if n_diag < max(2, mean):
        die(f"--diag_loops {n_diag}: needs at least 2 and mean_loops ({mean})")
    data_dir, meta = open_dataset(ckpt["config"]["dataset"], ckpt, path, splits=("val",))
    val = os.path.join(data_dir, "val.bin")
    wins = load_windows(val, meta["dtype"], C.windows, model.config.block_size + 1, C.seed).to(C.device)
    _, decode = load_tokenizer(data_dir)
    print(f"{path}: {checkpoint_id(ckpt)}, {model.get_num_params() / 1e6:.2f}M non-embedding params,"
          f" mean_loops {mean}; {C.device} {C.dtype}")
    el = elasticity(model, wins, meta, control, C)
    cv, tc = convergence(model, wins, decode, n_diag, C)
    checkpoint = dict(path=path, id=checkpoint_id(ckpt), iter_num=ckpt["iter_num"],
                      dataset=ckpt["config"]["dataset"], mean_loops=mean, max_loops=model.config.max_loops)
    res = dict(args=vars(C), checkpoint=checkpoint, block_size=model.config.block_size,
               elasticity=el, convergence=cv, token_classes=tc, seconds=time.perf_counter() - t_start)
    save_atomic(result, res)
    if C.plot:
        figures(el, cv, tc, mean, C.out_dir, control)
    print(f"\nwrote {result} in {res['seconds']:.1f}s")
    return res


if __name__ == "__main__":
    run(main)
