"""Timing only, medians of rounds that alternate the configurations: training
against the dense twin (the same blocks, as many as match the forward FLOPs
at mean_loops), or allocate.json's exits against every uniform depth, at
equal loss (iso-loss speedup) and equal FLOPs per token (realization).

    python bench.py                        # training (train.py's settings)
    python bench.py --frontier=scoring     # teacher-forced, batch 1 and 8
    python bench.py --frontier=generation  # greedy, batch 1, 8 and 32
"""
import json
import os
import statistics
import time
from functools import partial

import numpy as np
import torch
import torch._dynamo.utils

import train
from allocate import estimate, realized_exit, show
from configurator import configure, die, run
from evaluate import load_windows, markdown
from model import GPT, GPTConfig, autocast, check_device, checkpoint_id
from model import config_or_die, load_checkpoint, token_loss, save_atomic
from prepare import open_dataset
from sample import generate, initial_states, sample_next

warmup_steps = 2  # untimed steps per model (compiles happen here)
bench_steps = 4  # timed training steps per model per round
rounds = 3  # timed rounds; every configuration keeps its median
vocab_size = 1024  # training: random tokens (S0/S1: 49152)
frontier = "none"  # 'scoring' or 'generation': time allocate.json's policies
timing_windows = 16  # scoring: windows timed (allocate.py's first ones)
bench_tokens = 128  # generation: prompt length and new tokens per sequence
cache = "latest"  # generation: sample.py's --cache
BENCH_RULES = dict(warmup_steps=(1, 1000), bench_steps=(1, 10 ** 5), rounds=(1, 1000),
                   vocab_size=(2, 2 ** 20), frontier=("none", "scoring", "generation"),
                   timing_windows=(1, 10 ** 5), bench_tokens=(2, 10 ** 5),
                   cache=("exact", "latest"))
EXITS = {"A0": "none", "A1": "kl", "A1s": "state"}  # policy: exit criterion
greedy = partial(sample_next, temperature=0.0, top_k=0, generators=None)


def dense_twin(rec, C):
    """L plain blocks run once (no core: s_0 = 0 through the adapter), L
    nearest the recurrent forward FLOPs at mean_loops: config/study_dense.py."""
    shape = {k: getattr(rec.config, k) for k in train.MODEL_KEYS} | dict(
        vocab_size=C.vocab_size, n_core=0, n_coda=0, mean_loops=1, max_loops=1, bptt_k=1, state_std=0.0)

    def build(L, device):
        with torch.device(device):
            return GPT(GPTConfig(**shape | dict(n_prelude=L)))
    f1 = build(1, "meta").inference_flops(1, C.block_size)  # linear in L
    f2 = build(2, "meta").inference_flops(1, C.block_size)
    target = rec.inference_flops(C.mean_loops, C.block_size)
    return build(max(1, 1 + round((target - f1) / (f2 - f1))), C.device)


def train_step(model, optimizer, x, y, loops, C):
    """One train.py micro-step and optimizer step."""
    with autocast(C.device, C.dtype):
        loss = model(x, y, loops=loops)[1]
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), C.grad_clip or float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def median_seconds(configs, rounds, device, decode_only=False):
    """Each fn of configs once untimed, then once per round (decode_only: the
    seconds generate() reports after its prefill). -> medians, last results."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times, last = {name: [] for name in configs}, {}
    for _ in range(rounds + 1):  # the first round untimed
        for name, fn in configs.items():
            sync()  # a timing waits for the work queued before it
            t0 = time.perf_counter()
            last[name] = fn()
            sync()
            times[name].append(last[name][0] if decode_only else time.perf_counter() - t0)
    return {name: statistics.median(t[1:]) for name, t in times.items()}, last


def bench_training(C, out):
    config = config_or_die(vocab_size=C.vocab_size, **{k: getattr(C, k) for k in train.MODEL_KEYS})
    model = GPT(config).to(C.device)
    models = {"recurrent": model, "dense": dense_twin(model, C)}
    depths = [train.sample_loops(i, C.seed, C.mean_loops, C.max_loops, C.loop_dist)
              for i in range(C.bench_steps)]
    g = torch.Generator().manual_seed(C.seed)
    shape = (len(depths), 2, C.batch_size, C.block_size)  # (x, y) per step
    batches = torch.randint(C.vocab_size, shape, generator=g).to(C.device)
    configs, flops = {}, {}
    for name, m in models.items():
        opt = m.configure_optimizers(C.weight_decay, C.learning_rate, (C.beta1, C.beta2), "cpu")
        if C.compile:  # per part, as train.py
            for part in (m.prelude_blocks, m.core, m.coda_blocks):
                part.compile(backend=C.compile_backend)
        loops = depths if name == "recurrent" else [1] * len(depths)
        for _ in range(C.warmup_steps):
            train_step(m, opt, *batches[0], max(loops), C)
        steps = [partial(train_step, m, opt, *b, r, C) for b, r in zip(batches, loops)]
        configs[name] = partial(lambda steps: [step() for step in steps], steps)
        per_token = [m.flops_per_token(r, min(r, C.bptt_k), C.block_size) for r in loops]
        flops[name] = sum(per_token) * C.batch_size * C.block_size
    frames = torch._dynamo.utils.counters["frames"]["total"]
    seconds = median_seconds(configs, C.rounds, C.device)[0]
    recompiles = torch._dynamo.utils.counters["frames"]["total"] - frames
    out |= {"depths": depths, "recompiles": recompiles}
    rows = []
    for name, m in models.items():
        fwd = m.inference_flops(C.mean_loops if name == "recurrent" else 1, C.block_size)
        speed = C.bench_steps * C.batch_size * C.block_size / seconds[name]
        out[name] = {"layers": m.config.n_prelude, "fwd_flops_per_token": fwd,
                     "tokens_per_s": speed, "flops_per_s": flops[name] / seconds[name]}
        rows.append([name, m.config.n_prelude, f"{fwd / 1e6:.2f}", f"{speed:,.0f}",
                     f"{flops[name] / seconds[name]:.4g}"])
    out["ratio_flops_per_s"] = out["recurrent"]["flops_per_s"] / out["dense"]["flops_per_s"]
    print(markdown(["model", "layers", "fwd MFLOP/token", "tokens/s", "FLOP/s"], rows))
    print(f"\nrecurrent / dense FLOP/s: {out['ratio_flops_per_s']:.3f}; depths {depths}; "
          f"recompiles while timing: {recompiles}")
    save_atomic("bench.json", out)
    return out


def uniform_frontier(points):
    """Of (loss, tokens/s) points, those no other beats on both, by loss."""
    best = []
    for loss, speed in sorted(points, key=lambda p: (p[0], -p[1])):
        if not best or speed > best[-1][1]:
            best.append((loss, speed))
    return best


def iso_loss_speedup(front, loss, speed):
    """speed / the frontier's tokens/s at loss, and where loss lies: 'inside',
    'above' or 'below' every uniform loss (a bound, not a speedup)."""
    losses, speeds = zip(*front)
    where = "below" if loss < losses[0] else "above" if loss > losses[-1] else "inside"
    return speed / float(np.interp(loss, losses, speeds)), where


def speedup_at(pw, key, point, uniform_speeds, speed):
    """One point's iso-loss speedup as a statistic of the per-window losses."""
    front = uniform_frontier(zip(pw["A0"][0].mean(1), uniform_speeds))
    return iso_loss_speedup(front, pw[key][0][point].mean(), speed)[0]


def timed_points(alloc, key):
    """Indices into alloc["curves"][key] to time: every uniform depth; of an
    exit's many placed thresholds, the (at most 5) nearest the table's loops."""
    depths = np.array([p["avg_depth"] for p in alloc["curves"][key]])
    if key == "A0":
        return list(range(len(depths)))
    near = {int(np.abs(depths - row["avg_depth"]).argmin()) for row in alloc["table"]}
    return sorted(near)[:5]


def frontier_rows(alloc, pw, speeds, spent):
    """A row per timed (policy, index), exits with their iso-loss speedup and
    realization (tokens/s over uniform depth's at the FLOPs it spent); printed."""
    a0 = alloc["curves"]["A0"]
    uniform = [speeds[("A0", r)] for r in range(len(a0))]
    front = uniform_frontier(zip([p["loss"] for p in a0], uniform))
    costs = [p["flops"] for p in a0]  # uniform r = 1..r_max: rising costs
    rows, table = [], []
    for (key, i), speed in speeds.items():
        point = alloc["curves"][key][i] | spent.get((key, i), {})
        row = point | {"policy": key, "tokens_per_s": speed}
        cells = ["", ""]
        if key != "A0":
            row["where"] = iso_loss_speedup(front, point["loss"], speed)[1]
            row["speedup"] = estimate(speedup_at, pw, 1000, alloc["args"]["seed"], key=key, point=i,
                                      uniform_speeds=uniform, speed=speed)
            at_cost = np.interp(point["flops"], costs, uniform, np.nan, np.nan)
            row["realization"] = None if np.isnan(at_cost) else speed / at_cost
            below = row["where"] == "below"
            cells[0] = "below uniform" if below else show(row["speedup"], 2, "", "x")
            cells[1] = f"{row['realization'] or float('nan'):.2f}"
        rows.append(row)
        table.append([key, f"{point['threshold']:.3g}", f"{point['avg_depth']:.2f}",
                      f"{point['flops'] / 1e6:.3g}", f"{point['loss']:.4f}",
                      f"{speed:,.0f}"] + cells)
    print(markdown(["policy", "r / threshold", "loops", "MFLOP/token", "loss", "tokens/s",
                    "iso-loss speedup [95% CI]", "realization"], table))
    return rows


@torch.no_grad()  # a graph per forward once held 24 GB
def policy_run(C, model, wins, batch, criterion, setting, alloc):
    """Uniform depth (criterion 'none', setting r) or an exit at threshold
    `setting`: over the windows, or generating from bench_tokens prompts."""
    uniform = criterion == "none"
    if C.frontier == "generation":
        s0 = initial_states(model, batch, 2 * C.bench_tokens, "zero", C.seed, C.device)
        loops = setting if uniform else alloc["mean_loops"]  # the prompt's depth
        out = generate(model, wins[:batch, :C.bench_tokens], C.bench_tokens, loops, s0,
                       greedy, criterion, setting, alloc["r_max"], cache=C.cache)
        d = float(np.mean(out[1]))
        return out[2], dict(avg_depth=d, flops=model.inference_flops(d, len(wins[0]) - 1, criterion))
    for x, y in zip(wins[:, :-1].split(batch), wins[:, 1:].split(batch)):
        if uniform:  # the work of an exit's run: forward, per-token loss
            token_loss(model(x, loops=setting, state_init="zero")[0], y)
        else:
            realized_exit(model, x, y, alloc["r_max"], criterion, setting)


def bench_frontier(C, out):
    model, ckpt = load_checkpoint(os.path.join(C.out_dir, "ckpt.pt"), C.device)
    if not os.access(C.out_dir, os.W_OK):  # before minutes of timing
        die(f"--out_dir={C.out_dir} is not writable")
    path = os.path.join(C.out_dir, "allocate.json")  # of this very checkpoint
    if not os.path.isfile(path):
        die(f"no {path}: run `python allocate.py --out_dir={C.out_dir}` first")
    alloc = json.load(open(path))
    if alloc["checkpoint"].get("id") != checkpoint_id(ckpt):
        die(f"{path} is not from {checkpoint_id(ckpt)}: rerun allocate.py")
    pw = {k: tuple(np.array(a) for a in arrays) for k, arrays in alloc["per_window"].items()}
    data_dir, meta = open_dataset(ckpt["config"]["dataset"], ckpt, C.out_dir, splits=("val",))
    generation = C.frontier == "generation"
    batches = (1, 8, 32) if generation else (1, alloc["args"]["batch_size"])
    n = max(C.timing_windows, *batches) if generation else C.timing_windows
    wins = load_windows(os.path.join(data_dir, "val.bin"), meta["dtype"], alloc["windows"],
                        model.config.block_size + 1, alloc["args"]["seed"])[:n].to(C.device)
    for batch in sorted({min(b, len(wins)) for b in batches}):
        configs = {(key, i): partial(policy_run, C, model, wins, batch, criterion,
                                     alloc["curves"][key][i]["threshold"], alloc)
                   for key, criterion in EXITS.items() for i in timed_points(alloc, key)}
        with autocast(C.device, C.dtype):
            seconds, last = median_seconds(configs, C.rounds, C.device, generation)
        tokens = batch * (C.bench_tokens - 1) if generation else wins[:, 1:].numel()
        speeds = {name: tokens / s for name, s in seconds.items()}
        print(f"\n## {C.frontier}, batch {batch}: tokens/s, median of {C.rounds}\n")
        out[batch] = frontier_rows(alloc, pw, speeds, {k: r[1] for k, r in last.items() if r})
    save_atomic(os.path.join(C.out_dir, f"{C.frontier}_bench.json"), out)
    return out


def main(argv=()):
    C, _ = configure(vars(train) | globals(), train.RULES | BENCH_RULES, list(argv))
    check_device(C.device)
    torch.manual_seed(C.seed)
    out = {"command": "python bench.py " + " ".join(argv), "date": time.strftime("%Y-%m-%d")}
    bench = bench_training if C.frontier == "none" else bench_frontier
    return bench(C, out)


if __name__ == "__main__":
    run(main)
