"""
Timing only: training throughput of the recurrent model against its dense twin (the same blocks,
as many as give its forward FLOPs per token at mean_loops), and adaptive depth against uniform
depth r = 1..r_max, timed back to back (A B A B rounds, medians):

    python bench.py                        # training, train.py's settings (config/s1.py ... too)
    python bench.py --frontier=scoring     # allocate.json's A1/A1s thresholds, teacher-forced
    python bench.py --frontier=generation  # the same in greedy decoding at batch 1, 8 and 32

A threshold's speed is read against uniform depth at its loss (iso-loss speedup, with the paired
bootstrap interval) and at its FLOPs per token (realization: the share of the skipped work the
engine turns into speed). Writes bench.json, or out_dir/<frontier>_bench.json.
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
from model import (GPT, GPTConfig, autocast, check_device, checkpoint_id, config_or_die, load_checkpoint,
                   token_loss, training_memory, write_json)
from prepare import open_dataset
from sample import generate, greedy, initial_states

warmup_steps = 2  # untimed steps per model at the deepest depth (compiles happen here)
bench_steps = 4  # timed steps per model per round, the same depths and batches each round
rounds = 3  # timed rounds; every configuration keeps its median
vocab_size = 1024  # training: random tokens from this vocabulary (S0/S1: 49152)
frontier = "none"  # 'scoring' or 'generation': time allocate.json's policies, not training
timing_windows = 16  # scoring: windows timed per configuration (allocate's first ones)
bench_tokens = 128  # generation: prompt length and new tokens per sequence
cache = "exact"  # generation: sample.py's core cache ('exact' per loop, 'latest' one slot)
BENCH_RULES = dict(warmup_steps=(1, 1000), bench_steps=(1, 10 ** 5), rounds=(1, 1000),
                   vocab_size=(2, 2 ** 20), frontier=("none", "scoring", "generation"),
                   timing_windows=(1, 10 ** 5), bench_tokens=(1, 10 ** 5), cache=("exact", "latest"))
GENERATION_BATCHES = (1, 8, 32)


def fwd_flops(model, loops, T):
    """Forward FLOPs per token: the training count with every loop under grad is exactly 3x it."""
    return model.flops_per_token(loops, loops, T) / 3


def dense_twin(rec, C):
    """A GPT of L plain blocks (n_core = n_coda = 0), run as readout(prelude(x)), L chosen so its
    forward FLOPs per token are nearest the recurrent model's at mean_loops."""
    shape = {k: getattr(rec.config, k) for k in train.MODEL_KEYS} | {"vocab_size": C.vocab_size}

    def build(L, device):
        with torch.device(device):
            return GPT(GPTConfig(**shape | dict(n_prelude=L, n_core=0, n_coda=0, mean_loops=1)))
    f1 = fwd_flops(build(1, "meta"), 0, C.block_size)  # linear in L; meta: no memory
    f2 = fwd_flops(build(2, "meta"), 0, C.block_size)
    L = max(1, 1 + round((fwd_flops(rec, C.mean_loops, C.block_size) - f1) / (f2 - f1)))
    return build(L, C.device)


def train_step(model, optimizer, x, y, loops, C):
    """What one train.py micro-step and optimizer step do; loops=0 runs the dense twin."""
    with autocast(C.device, C.dtype):
        if loops:
            loss = model(x, y, loops=loops)[1]
        else:
            loss = model.chunked_loss(model.norm(model.prelude(x)).flatten(0, 1), y.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), C.grad_clip or float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def median_seconds(configs, rounds, device, decode_only=False):
    """configs {name: fn}: each once untimed, then once per round. decode_only: fn is generate(),
    which reports the seconds after its prefill. -> ({name: median s}, {name: last result})."""
    times = {name: [] for name in configs}
    results = {}
    for fn in configs.values():
        fn()
    for _ in range(rounds):
        for name, fn in configs.items():
            if device.startswith("cuda"):  # a timing waits for the GPU work queued before it
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            results[name] = fn()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times[name].append(results[name][2] if decode_only else time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}, results


def bench_training(C):
    config = config_or_die(vocab_size=C.vocab_size, **{k: getattr(C, k) for k in train.MODEL_KEYS})
    model = GPT(config)
    models = {"recurrent": model.to(C.device), "dense": dense_twin(model, C)}
    depths = [train.sample_loops(i, C.seed, C.mean_loops, C.max_loops, C.loop_dist)
              for i in range(C.bench_steps)]
    g = torch.Generator().manual_seed(C.seed)
    batches = [torch.randint(C.vocab_size, (2, C.batch_size, C.block_size), generator=g).to(C.device)
               for _ in depths]
    configs = {}
    for name, m in models.items():
        opt = m.configure_optimizers(C.weight_decay, C.learning_rate, (C.beta1, C.beta2), "cpu")
        if C.compile:  # per part, as train.py: the loop over depth stays outside the graphs
            for part in (m.prelude_blocks, m.core, m.coda_blocks):
                part.compile(backend=C.compile_backend)
        for _ in range(C.warmup_steps):
            train_step(m, opt, *batches[0], max(depths) if name == "recurrent" else 0, C)
        steps = [(b, r if name == "recurrent" else 0) for b, r in zip(batches, depths)]
        configs[name] = partial(lambda m, opt, steps: [train_step(m, opt, *b, r, C) for b, r in steps],
                                m, opt, steps)
    frames = torch._dynamo.utils.counters["frames"]["total"]
    seconds, _ = median_seconds(configs, C.rounds, C.device)
    tokens = C.bench_steps * C.batch_size * C.block_size
    out = {"command": "python bench.py " + " ".join(C.argv), "date": time.strftime("%Y-%m-%d"),
           "depths": depths, "recompiles": torch._dynamo.utils.counters["frames"]["total"] - frames,
           "memory_bytes": training_memory(model.config, C.batch_size, C.dtype)["total"]}
    rows = []
    for name, m in models.items():
        fwd = fwd_flops(m, C.mean_loops if name == "recurrent" else 0, C.block_size)
        flops = sum(m.flops_per_token(r, min(r, C.bptt_k), C.block_size) if name == "recurrent"
                    else 3 * fwd for r in depths) * C.batch_size * C.block_size
        out[name] = {"layers": m.config.n_prelude, "tokens_per_s": tokens / seconds[name],
                     "fwd_flops_per_token": fwd, "flops_per_s": flops / seconds[name]}
        rows.append([name, m.config.n_prelude, f"{fwd / 1e6:.2f}", f"{tokens / seconds[name]:,.0f}",
                     f"{flops / seconds[name] / 1e12:.4g}"])
    out["ratio_flops_per_s"] = out["recurrent"]["flops_per_s"] / out["dense"]["flops_per_s"]
    print(markdown(["model", "layers", "fwd MFLOP/token", "tokens/s", "achieved TFLOP/s"], rows))
    print(f"\nrecurrent / dense achieved FLOP/s: {out['ratio_flops_per_s']:.3f}; depths {depths}; "
          f"recompiles while timing: {out['recompiles']}; predicted memory per micro-step "
          f"{out['memory_bytes'] / 1e9:.2f} GB")
    write_json("bench.json", out)
    return out
# ---- the uniform frontier (bench.py times it) ---------------------------------------------
def uniform_frontier(points):
    """Of (loss, tokens/s) points, those no other point beats on both, by loss."""
    best = []
    for loss, speed in sorted(points, key=lambda p: (p[0], -p[1])):
        if not best or speed > best[-1][1]:
            best.append((loss, speed))
    return best


def iso_loss_speedup(front, loss, speed):
    """speed / the frontier's tokens/s at `loss` (linear between uniform depths), and where
    `loss` lies: 'inside', 'below' every uniform loss (compared with the slowest uniform
    depth: a lower bound, never reported as a speedup) or 'above' (worse than the fastest)."""
    losses, speeds = zip(*front)
    where = "below" if loss < losses[0] else "above" if loss > losses[-1] else "inside"
    return speed / float(np.interp(loss, losses, speeds)), where


def realization(costs, speeds, cost, speed):
    """speed / the uniform frontier's tokens/s at the same FLOPs per token (interpolated):
    how much of what the exits save the engine turns into speed. None outside the frontier."""
    if not min(costs) <= cost <= max(costs):
        return None
    order = np.argsort(costs)
    return speed / float(np.interp(cost, np.array(costs)[order], np.array(speeds)[order]))


def speedup_at(pw, key, point, uniform_speeds, speed):
    """The iso-loss speedup of one point, as a statistic of pw (speeds measured once)."""
    front = uniform_frontier(zip(pw["A0"][0].mean(1), uniform_speeds))
    return iso_loss_speedup(front, pw[key][0][point].mean(), speed)[0]


def read_allocation(C, ckpt):
    """allocate.py's results for this very checkpoint (its run and step), else one line."""
    path = os.path.join(C.out_dir, "allocate.json")
    if not os.path.isfile(path):
        die(f"no {path}: run `python allocate.py --out_dir={C.out_dir}` first (the losses come from it)")
    with open(path) as f:
        alloc = json.load(f)
    if alloc["checkpoint"].get("id") != checkpoint_id(ckpt):
        die(f"{path} is from checkpoint {alloc['checkpoint'].get('id')}, not {checkpoint_id(ckpt)}: "
            f"rerun allocate.py")
    pw = {key: tuple(np.array(a) for a in arrays) for key, arrays in alloc["per_window"].items()}
    return alloc, pw


def frontier_rows(alloc, pw, speeds, seed):
    """One row per A0/A1/A1s point: loss, loops, FLOPs, tokens/s; for A1/A1s the iso-loss
    speedup with its interval (None where the loss lies below every uniform loss) and the
    realization at its FLOPs per token."""
    uniform = [speeds[("A0", r)] for r in range(alloc["r_max"])]
    flops = [p["flops"] for p in alloc["curves"]["A0"]]
    rows = []
    for key in ("A0", "A1", "A1s"):
        for i, point in enumerate(alloc["curves"][key]):
            row = point | {"policy": key, "tokens_per_s": speeds[(key, i)]}
            if key != "A0":
                front = uniform_frontier(zip([p["loss"] for p in alloc["curves"]["A0"]], uniform))
                row["where"] = iso_loss_speedup(front, point["loss"], row["tokens_per_s"])[1]
                row["speedup"] = estimate(speedup_at, pw, 1000, seed, key=key, point=i,
                                          uniform_speeds=uniform, speed=row["tokens_per_s"])
                row["realization"] = realization(flops, uniform, point["flops"], row["tokens_per_s"])
            rows.append(row)
    table = []
    for r in rows:
        speedup = "" if r["policy"] == "A0" else show(r["speedup"], 2, "", "x")
        speedup = "below the frontier" if r.get("where") == "below" else speedup
        real = "" if r.get("realization") is None else f"{r['realization']:.2f}"
        table.append([r["policy"], f"{r['threshold']:.3g}", f"{r['avg_depth']:.2f}",
                      f"{r['flops'] / 1e6:.3g}", f"{r['loss']:.4f}", f"{r['tokens_per_s']:,.0f}",
                      speedup, real])
    print(markdown(["policy", "r / threshold", "loops/token", "MFLOP/token", "loss", "tokens/s",
                    "iso-loss speedup [95% CI]", "realization"], table))
    return rows


def bench_frontier(C):
    model, ckpt = load_checkpoint(os.path.join(C.out_dir, "ckpt.pt"), C.device)
    alloc, pw = read_allocation(C, ckpt)
    data_dir, meta = open_dataset(ckpt["config"]["dataset"], ckpt, C.out_dir, splits=("val",))
    val = os.path.join(data_dir, "val.bin")
    length = model.config.block_size + 1
    n = max(C.timing_windows, max(GENERATION_BATCHES)) if C.frontier == "generation" else C.timing_windows
    wins = load_windows(val, meta["dtype"], alloc["windows"], length, alloc["args"]["seed"])
    wins = wins[:n].to(C.device)
    out = {"command": "python bench.py " + " ".join(C.argv), "date": time.strftime("%Y-%m-%d")}
    batches = GENERATION_BATCHES if C.frontier == "generation" else (1, alloc["args"]["batch_size"])
    for batch in sorted({min(b, len(wins)) for b in batches}):
        configs = {}
        for key, criterion in (("A0", "none"), ("A1", "kl"), ("A1s", "state")):
            for i, point in enumerate(alloc["curves"][key]):
                configs[(key, i)] = partial(policy_run, C, model, wins, batch, criterion,
                                            point["threshold"], alloc)
        with autocast(C.device, C.dtype):
            seconds, _ = median_seconds(configs, C.rounds, C.device, C.frontier == "generation")
        n_tokens = batch * (C.bench_tokens - 1) if C.frontier == "generation" else wins[:, 1:].numel()
        speeds = {name: n_tokens / s for name, s in seconds.items()}
        print(f"\n## {C.frontier}, batch {batch}: tokens/s, median of {C.rounds} rounds\n")
        out[batch] = frontier_rows(alloc, pw, speeds, alloc["args"]["seed"])
    write_json(os.path.join(C.out_dir, f"{C.frontier}_bench.json"), out)
    return out


def policy_run(C, model, wins, batch, criterion, setting, alloc):
    """One timed configuration over the windows: uniform depth (criterion 'none', setting = r)
    or an exit at threshold `setting`; in generation, prompts of bench_tokens and as many new."""
    uniform = criterion == "none"
    if C.frontier == "generation":
        s0 = initial_states(model, batch, 2 * C.bench_tokens, "zero", C.seed, C.device)
        loops = setting if uniform else alloc["mean_loops"]  # the prompt's depth
        return generate(model, wins[:batch, :C.bench_tokens], C.bench_tokens, loops, s0, greedy,
                        criterion, 0.0 if uniform else setting, alloc["r_max"], cache=C.cache)
    runs = []
    for x, y in zip(wins[:, :-1].split(batch), wins[:, 1:].split(batch)):
        if uniform:  # the same work as a threshold's run: the forward and every token's loss
            runs.append(token_loss(model(x, loops=setting, state_init="zero")[0], y))
        else:
            runs.append(realized_exit(model, x, y, alloc["r_max"], criterion, setting))
    return runs


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
