"""
Timing only, medians of rounds that alternate the configurations:
training against the dense twin (the same blocks, as many as match the
forward FLOPs at mean_loops), or allocate.json's exits against uniform depth,
at equal loss (iso-loss speedup) and equal FLOPs per token (realization).

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
from model import config_or_die, load_checkpoint, token_loss, write_json
from prepare import open_dataset
from sample import generate, greedy, initial_states

warmup_steps = 2  # untimed steps per model (compiles happen here)
bench_steps = 4  # timed training steps per model per round
rounds = 3  # timed rounds; every configuration keeps its median
vocab_size = 1024  # training: random tokens of this vocabulary (S0/S1: 49152)
frontier = "none"  # 'scoring' or 'generation': time allocate.json's policies
timing_windows = 16  # scoring: windows timed (allocate.py's first ones)
bench_tokens = 128  # generation: prompt length and new tokens per sequence
cache = "exact"  # generation: sample.py's core cache, 'exact' or 'latest'
BENCH_RULES = dict(warmup_steps=(1, 1000), bench_steps=(1, 10 ** 5), rounds=(1, 1000),
                   vocab_size=(2, 2 ** 20), frontier=("none", "scoring", "generation"),
                   timing_windows=(1, 10 ** 5), bench_tokens=(1, 10 ** 5),
                   cache=("exact", "latest"))
GENERATION_BATCHES = (1, 8, 32)


def fwd_flops(model, loops, T):
    """Forward FLOPs per token: a third of training with every loop under grad."""
    return model.flops_per_token(loops, loops, T) / 3


def dense_twin(rec, C):
    """L plain blocks, L nearest the recurrent forward FLOPs at mean_loops."""
    shape = {k: getattr(rec.config, k) for k in train.MODEL_KEYS}
    shape |= dict(vocab_size=C.vocab_size, n_core=0, n_coda=0, mean_loops=1)

    def build(L, device):
        with torch.device(device):
            return GPT(GPTConfig(**shape | dict(n_prelude=L)))
    f1 = fwd_flops(build(1, "meta"), 0, C.block_size)  # linear in L
    f2 = fwd_flops(build(2, "meta"), 0, C.block_size)
    target = fwd_flops(rec, C.mean_loops, C.block_size)
    return build(max(1, 1 + round((target - f1) / (f2 - f1))), C.device)


def train_step(model, optimizer, x, y, loops, C):
    """One train.py micro-step and optimizer step; loops=0: the dense twin."""
    with autocast(C.device, C.dtype):
        if loops:
            loss = model(x, y, loops=loops)[1]
        else:
            hidden = model.norm(model.prelude(x))
            loss = model.chunked_loss(hidden.flatten(0, 1), y.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), C.grad_clip or float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def median_seconds(configs, rounds, device, decode_only=False):
    """Each fn of configs once untimed, then once per round (decode_only: the
    seconds generate() reports after its prefill). -> (medians, results)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times = {name: [] for name in configs}
    results = {}
    for fn in configs.values():
        fn()
    for _ in range(rounds):
        for name, fn in configs.items():
            sync()  # a timing waits for the work queued before it
            t0 = time.perf_counter()
            results[name] = fn()
            sync()
            seconds = time.perf_counter() - t0
            times[name].append(results[name][2] if decode_only else seconds)
    return {name: statistics.median(t) for name, t in times.items()}, results


def bench_training(C):
    config = config_or_die(vocab_size=C.vocab_size, **{k: getattr(C, k) for k in train.MODEL_KEYS})
    model = GPT(config).to(C.device)
    models = {"recurrent": model, "dense": dense_twin(model, C)}
    depths = [train.sample_loops(i, C.seed, C.mean_loops, C.max_loops, C.loop_dist)
              for i in range(C.bench_steps)]
    g = torch.Generator().manual_seed(C.seed)
    shape = (2, C.batch_size, C.block_size)
    batches = [torch.randint(C.vocab_size, shape, generator=g).to(C.device) for _ in depths]
    configs, flops = {}, {}
    for name, m in models.items():
        opt = m.configure_optimizers(C.weight_decay, C.learning_rate, (C.beta1, C.beta2), "cpu")
        if C.compile:  # per part, as train.py: the depth loop stays outside the graphs
            for part in (m.prelude_blocks, m.core, m.coda_blocks):
                part.compile(backend=C.compile_backend)
        loops = depths if name == "recurrent" else [0] * len(depths)
        for _ in range(C.warmup_steps):
            train_step(m, opt, *batches[0], max(loops), C)
        steps = [partial(train_step, m, opt, *b, r, C) for b, r in zip(batches, loops)]
        configs[name] = partial(lambda steps: [step() for step in steps], steps)
        per_token = [m.flops_per_token(r, min(r, C.bptt_k), C.block_size) for r in loops]
        flops[name] = sum(per_token) * C.batch_size * C.block_size
    frames = torch._dynamo.utils.counters["frames"]["total"]
    seconds, _ = median_seconds(configs, C.rounds, C.device)
    tokens = C.bench_steps * C.batch_size * C.block_size
    recompiles = torch._dynamo.utils.counters["frames"]["total"] - frames
    out = {"command": "python bench.py " + " ".join(C.argv), "date": time.strftime("%Y-%m-%d"),
           "depths": depths, "recompiles": recompiles}
    rows = []
    for name, m in models.items():
        fwd = fwd_flops(m, C.mean_loops if name == "recurrent" else 0, C.block_size)
        speed = tokens / seconds[name]
        out[name] = {"layers": m.config.n_prelude, "fwd_flops_per_token": fwd,
                     "tokens_per_s": speed, "flops_per_s": flops[name] / seconds[name]}
        rows.append([name, m.config.n_prelude, f"{fwd / 1e6:.2f}", f"{speed:,.0f}",
                     f"{flops[name] / seconds[name]:.4g}"])
    out["ratio_flops_per_s"] = out["recurrent"]["flops_per_s"] / out["dense"]["flops_per_s"]
    print(markdown(["model", "layers", "fwd MFLOP/token", "tokens/s", "FLOP/s"], rows))
    print(f"\nrecurrent / dense FLOP/s: {out['ratio_flops_per_s']:.3f}; depths {depths}; "
          f"recompiles while timing: {recompiles}")
    write_json("bench.json", out)
    return out


# ---- the uniform frontier
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


def realization(costs, speeds, cost, speed):
    """speed / uniform depth's tokens/s at the same FLOPs per token."""
    if not costs[0] <= cost <= costs[-1]:  # uniform r = 1..r_max: rising costs
        return None
    return speed / float(np.interp(cost, costs, speeds))


def speedup_at(pw, key, point, uniform_speeds, speed):
    """One point's iso-loss speedup as a statistic of the per-window losses."""
    front = uniform_frontier(zip(pw["A0"][0].mean(1), uniform_speeds))
    return iso_loss_speedup(front, pw[key][0][point].mean(), speed)[0]


def read_allocation(C, ckpt):
    """allocate.json of this very checkpoint (run and step), else one line."""
    path = os.path.join(C.out_dir, "allocate.json")
    if not os.path.isfile(path):
        die(f"no {path}: run `python allocate.py --out_dir={C.out_dir}` first")
    alloc = json.loads(open(path).read())
    if alloc["checkpoint"].get("id") != checkpoint_id(ckpt):
        die(f"{path} is from another checkpoint than {checkpoint_id(ckpt)}: rerun allocate.py")
    pw = {k: tuple(np.array(a) for a in arrays) for k, arrays in alloc["per_window"].items()}
    return alloc, pw


def frontier_rows(alloc, pw, speeds, seed):
    """A row per point, exits with their speedup and realization; printed."""
    a0 = alloc["curves"]["A0"]
    uniform = [speeds[("A0", r)] for r in range(len(a0))]
    front = uniform_frontier(zip([p["loss"] for p in a0], uniform))
    rows = []
    table = []
    for key in ("A0", "A1", "A1s"):
        for i, point in enumerate(alloc["curves"][key]):
            speed = speeds[(key, i)]
            row = point | {"policy": key, "tokens_per_s": speed}
            cells = ["", ""]
            if key != "A0":
                row["where"] = iso_loss_speedup(front, point["loss"], speed)[1]
                row["speedup"] = estimate(speedup_at, pw, 1000, seed, key=key, point=i,
                                          uniform_speeds=uniform, speed=speed)
                costs = [p["flops"] for p in a0]
                row["realization"] = realization(costs, uniform, point["flops"], speed)
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


@torch.no_grad()  # a graph per forward would hold its activations: 24 GB on the CPU default
def policy_run(C, model, wins, batch, criterion, setting, alloc):
    """Uniform depth (criterion 'none', setting r) or an exit at threshold
    `setting`: over the windows, or generating from bench_tokens prompts."""
    uniform = criterion == "none"
    if C.frontier == "generation":
        s0 = initial_states(model, batch, 2 * C.bench_tokens, "zero", C.seed, C.device)
        loops = setting if uniform else alloc["mean_loops"]  # the prompt's depth
        threshold = 0.0 if uniform else setting
        prompts = wins[:batch, :C.bench_tokens]
        return generate(model, prompts, C.bench_tokens, loops, s0, greedy, criterion,
                        threshold, alloc["r_max"], cache=C.cache)
    runs = []
    for x, y in zip(wins[:, :-1].split(batch), wins[:, 1:].split(batch)):
        if uniform:  # the same work as an exit's run: forward and per-token loss
            logits = model(x, loops=setting, state_init="zero")[0]
            runs.append(token_loss(logits, y))
        else:
            runs.append(realized_exit(model, x, y, alloc["r_max"], criterion, setting))
    return runs


def bench_frontier(C):
    model, ckpt = load_checkpoint(os.path.join(C.out_dir, "ckpt.pt"), C.device)
    if not os.access(C.out_dir, os.W_OK):  # now, not after minutes of timing
        die(f"--out_dir={C.out_dir} is not writable")
    alloc, pw = read_allocation(C, ckpt)
    data_dir, meta = open_dataset(ckpt["config"]["dataset"], ckpt, C.out_dir, splits=("val",))
    generation = C.frontier == "generation"
    n = max(C.timing_windows, *GENERATION_BATCHES) if generation else C.timing_windows
    wins = load_windows(os.path.join(data_dir, "val.bin"), meta["dtype"], alloc["windows"],
                        model.config.block_size + 1, alloc["args"]["seed"])[:n].to(C.device)
    out = {"command": "python bench.py " + " ".join(C.argv), "date": time.strftime("%Y-%m-%d")}
    batches = GENERATION_BATCHES if generation else (1, alloc["args"]["batch_size"])
    for batch in sorted({min(b, len(wins)) for b in batches}):
        configs = {}
        for key, criterion in (("A0", "none"), ("A1", "kl"), ("A1s", "state")):
            for i, point in enumerate(alloc["curves"][key]):
                configs[(key, i)] = partial(policy_run, C, model, wins, batch, criterion,
                                            point["threshold"], alloc)
        with autocast(C.device, C.dtype):
            seconds, _ = median_seconds(configs, C.rounds, C.device, generation)
        tokens = batch * (C.bench_tokens - 1) if generation else wins[:, 1:].numel()
        speeds = {name: tokens / s for name, s in seconds.items()}
        print(f"\n## {C.frontier}, batch {batch}: tokens/s, median of {C.rounds}\n")
        out[batch] = frontier_rows(alloc, pw, speeds, alloc["args"]["seed"])
    write_json(os.path.join(C.out_dir, f"{C.frontier}_bench.json"), out)
    return out


def main(argv=()):
    C, _ = configure(vars(train) | globals(), train.RULES | BENCH_RULES, list(argv))
    C.argv = list(argv)
    check_device(C.device)
    torch.manual_seed(C.seed)
    if C.frontier == "none":
        return bench_training(C)
    return bench_frontier(C)


if __name__ == "__main__":
    run(main)
