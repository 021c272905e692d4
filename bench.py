"""
Training throughput against the machine's measured ceiling and a dense baseline; and, for
`python sample.py --bench`, generation throughput against the uniform-depth frontier.

    python bench.py                                   # the CPU default model (train.py's defaults)
    python bench.py config/s1.py --compile=True --dtype=bfloat16 --bench_steps=100

The ceiling (a square matmul in the training dtype; a copy's bandwidth), then rounds of A B: the
recurrent training step over a fixed seeded sequence of depths, and a dense Llama stack of the
same blocks with the same forward FLOPs per token at mean_loops. Random tokens: this measures
compute, not data loading. Medians over rounds; a markdown table, and everything in bench.json.
"""
import json
import os
import platform
from functools import partial
import statistics
import time
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import torch
import torch._dynamo.utils
import torch.nn.functional as F

import train
from allocate import estimate, realized_exit, show
from configurator import check_device, check_model, configure, die, require_positive, run, write_json
from evaluate import markdown, token_loss
from model import GPT, GPTConfig
from sample import generate, initial_states

# ---- bench-only defaults (train.py's defaults and config files apply as well) -----------
warmup_steps = 2  # untimed steps per model at the sequence's deepest depth (compiles happen here)
bench_steps = 4  # timed steps per model per round; every round replays the same depths and batches
rounds = 3  # A B A B...: the recurrent and dense models alternate, so machine noise hits both
vocab_size = 0  # 0: data/<dataset>/meta.json if prepared, else that dataset's tokenizer size
matmul_n = 0  # side of the ceiling's square matmul; 0: 2048 on CPU, 8192 on CUDA
compile_backend = "inductor"  # for compile=True ('eager' checks the recompile count in seconds)
profile_rows = 12  # top ops by self time of one profiled recurrent step; 0: no profile
bench_json = "bench.json"
GENERATION_BATCHES = (1, 8, 32)  # sample.py --bench
BENCH_DEFAULTS = {k: globals()[k] for k in ("warmup_steps", "bench_steps", "rounds", "vocab_size", "matmul_n",
                                            "compile_backend", "profile_rows", "bench_json")}


def resolve_vocab(C):
    if C.vocab_size:
        return C.vocab_size, "--vocab_size"
    meta = os.path.join("data", C.dataset, "meta.json")
    if os.path.isfile(meta):
        with open(meta) as f:
            return json.load(f)["vocab_size"], meta
    # prepare.py's default Shakespeare BPE has 1024 entries; the hub datasets use SmolLM2's 49152
    return {"shakespeare": 1024}.get(C.dataset, 49152), f"{C.dataset}'s tokenizer, no {meta}"


def fwd_flops(model, loops, T):
    """Forward FLOPs per token: the training count with every loop under grad is exactly 3x it."""
    return model.flops_per_token(loops, loops, T) / 3


def dense_twin(rec, C, vocab):
    """A plain stack of L blocks of the same width (no loop, adapter or sandwich norms), L chosen
    so its forward FLOPs per token are nearest the recurrent model's at mean_loops. It is a GPT
    with n_prelude=L, n_core=n_coda=0, run as readout(prelude(x)): the same block code, and the
    adapter its empty Core still owns is never called (nor counted: flops_per_token skips core)."""
    shape = {k: getattr(rec.config, k) for k in ("block_size", "n_embd", "n_head", "n_kv_head", "ffn_hidden",
                                                 "rope_theta", "norm_eps")}

    def build(L, device):
        with torch.device(device):
            return GPT(GPTConfig(vocab_size=vocab, n_prelude=L, n_core=0, n_coda=0, mean_loops=1, max_loops=1,
                                 bptt_k=1, **shape))
    f1, f2 = (fwd_flops(build(L, "meta"), 0, C.block_size) for L in (1, 2))  # linear in L; meta: no memory
    L = max(1, 1 + round((fwd_flops(rec, C.mean_loops, C.block_size) - f1) / (f2 - f1)))
    return build(L, C.device), f2 - f1


def flop_formula(model, loops, k, T):
    c = model.config
    core = sum(p.numel() for p in model.core.parameters())
    outer, attn = model.get_num_params() - core + model.wte.weight.numel(), 4 * T * c.n_embd
    one_loop = f"(2*{core:,} + {attn:,}*{c.n_core})"
    return (f"3*(2*{outer:,} + {attn:,}*{c.n_prelude + c.n_coda}) + 3*{k}*{one_loop} + {loops - k}*{one_loop} = "
            f"{model.flops_per_token(loops, k, T):,.0f}  [N_outer: prelude, coda, norm, head; N_core: core blocks "
            f"+ adapter; attention 2*2*T*d per layer; r={loops}, k={k}]")


def train_step(model, optimizer, x, y, loops, ctx, grad_clip):
    """What one train.py micro-step + optimizer step does; loops=0 runs the dense twin."""
    with ctx:
        if loops:
            loss = model(x, y, loops=loops)[1]
        else:
            logits = model.readout(model.prelude(x))
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    if torch.isfinite(loss.detach() + grad_norm).item():  # train.py's guard, and its per-step host sync
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def saved_activation_bytes(model, step):
    """Bytes autograd keeps for backward in one step, each storage once, parameters excluded: the
    activation memory that truncated backprop bounds (counted, not an allocator peak; eager only)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def measure_copy_bandwidth(device, nbytes=1 << 28, reps=10):
    """Bytes/s moved by a tensor copy (read + write): device-to-device on CUDA, DRAM on CPU."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    dst.copy_(src)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync()
    return 2 * nbytes * reps / (time.perf_counter() - t0)


def profile_step(step, rows, cuda):
    """Top ops by self time of one step (device time on CUDA, CPU time otherwise)."""
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        step()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in events)
    return [{"op": e.key, "self_ms": getattr(e, key) / 1e3, "pct": 100 * getattr(e, key) / total, "calls": e.count}
            for e in events[:rows]]


def machine_info(device):
    with open("/proc/cpuinfo") if os.path.isfile("/proc/cpuinfo") else nullcontext([]) as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"}


def main(argv=()):
    """Run the benchmark; returns the dict written to bench_json."""
    argv = list(argv)
    C = SimpleNamespace(**configure(train.DEFAULTS | BENCH_DEFAULTS, argv))
    check_device(C.device, C.dtype)
    require_positive(C, "warmup_steps", "bench_steps", "rounds", "batch_size")
    for key in ("vocab_size", "matmul_n", "profile_rows"):
        if getattr(C, key) < 0:
            die(f"--{key} must be >= 0, got {getattr(C, key)}")
    check_model(C)
    # checked before the benchmark runs, not when its results are written minutes later
    if C.compile_backend not in torch._dynamo.list_backends(exclude_tags=()):
        die(f"--compile_backend={C.compile_backend!r} is not a torch.compile backend (e.g. inductor, eager)")
    if not os.path.isdir(os.path.dirname(C.bench_json) or "."):
        die(f"--bench_json={C.bench_json}: the directory {os.path.dirname(C.bench_json)} does not exist")
    cuda = C.device.startswith("cuda")
    torch.manual_seed(C.seed)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # as train.py
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[C.dtype]
    ctx = nullcontext() if C.dtype == "float32" else torch.autocast("cuda" if cuda else "cpu", dtype=ptdtype)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    vocab, vocab_from = resolve_vocab(C)
    depths = [train.sample_loops(i, C.seed, C.mean_loops, C.max_loops, C.loop_dist) for i in range(C.bench_steps)]
    T, tokens, matmul_n = C.block_size, C.batch_size * C.block_size, C.matmul_n or (8192 if cuda else 2048)
    g = torch.Generator().manual_seed(C.seed + 1)
    batches = [torch.randint(vocab, (2, C.batch_size, T), generator=g).to(C.device) for _ in depths]  # x, y

    rec = GPT(GPTConfig(vocab_size=vocab, **{k: getattr(C, k) for k in train.MODEL_KEYS})).to(C.device)
    dense, block_fwd = dense_twin(rec, C, vocab)
    runs = {}
    for name, model, run_depths in (("recurrent", rec, depths), ("dense", dense, [0] * len(depths))):
        opt = model.configure_optimizers(C.weight_decay, C.learning_rate, (C.beta1, C.beta2), "cuda" if cuda else "cpu")

        def step(i, r, model=model, opt=opt):  # step i of the sequence: its batch, at depth r
            train_step(model, opt, *batches[i], r, ctx, C.grad_clip)
        runs[name] = SimpleNamespace(model=model, step=step, depths=run_depths, times=[], peaks=[],
                                     flops=[model.flops_per_token(r, min(r, C.bptt_k), T) * tokens for r in run_depths],
                                     activation_bytes=saved_activation_bytes(model, lambda: step(0, max(run_depths))))
        parts = (model.prelude_blocks, model.core, model.coda_blocks) if model is rec else (model.prelude_blocks,)
        for part in parts if C.compile else ():  # per part, as train.py: the depth loop stays outside the graphs
            part.compile(backend=C.compile_backend)
    counters = torch._dynamo.utils.counters
    for model_run in runs.values():  # warm-up at the deepest depth: the core's grad and no-grad graphs both
        graphs0, t0 = counters["stats"]["unique_graphs"], time.perf_counter()
        model_run.step(0, max(model_run.depths))
        sync()
        model_run.first_step_s = time.perf_counter() - t0  # with compile=True: mostly compile time
        for _ in range(C.warmup_steps - 1):
            model_run.step(0, max(model_run.depths))
        model_run.graphs = counters["stats"]["unique_graphs"] - graphs0
    frames0, ceilings = counters["frames"]["total"], []  # dynamo compiles a frame once per (re)compile
    for _ in range(C.rounds):
        ceilings.append(train.measure_matmul_flops(C.device, ptdtype, matmul_n))
        for model_run in runs.values():
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            resident, t0 = torch.cuda.memory_allocated() if cuda else 0, time.perf_counter()
            for i, r in enumerate(model_run.depths):
                model_run.step(i, r)
            sync()
            model_run.times.append(time.perf_counter() - t0)
            model_run.peaks.append(torch.cuda.max_memory_allocated() - resident if cuda else None)

    ceiling = statistics.median(ceilings)
    out = {"command": " ".join(["python bench.py", *argv]), "date": time.strftime("%Y-%m-%d"),
           "machine": machine_info(C.device), "config": vars(C), "vocab_size": vocab, "vocab_from": vocab_from,
           "depths": depths, "mean_depth": sum(depths) / len(depths), "ceiling_flops": ceiling, "ceilings": ceilings,
           "ceiling_matmul_n": matmul_n, "copy_bandwidth_bytes_per_s": measure_copy_bandwidth(C.device),
           "dense_layers": dense.config.n_prelude, "dense_block_fwd_flops": block_fwd,
           "flop_formula": flop_formula(rec, C.mean_loops, min(C.mean_loops, C.bptt_k), T),
           "recompiles_during_timed_steps": counters["frames"]["total"] - frames0 if C.compile else None}
    for name, model_run in runs.items():
        rates = [sum(model_run.flops) / t for t in model_run.times]
        unused = model_run.model.core.adapter.weight.numel() if name == "dense" else 0  # the twin's idle adapter
        out[name] = {"params": model_run.model.get_num_params(False) - unused,
                     "fwd_flops_per_token": fwd_flops(model_run.model, C.mean_loops if name == "recurrent" else 0, T),
                     "train_flops_per_token": sum(model_run.flops) / tokens / len(model_run.flops),
                     "tokens_per_s": statistics.median(tokens * len(model_run.flops) / t for t in model_run.times),
                     "flops_per_s": statistics.median(rates), "mfu": statistics.median(rates) / ceiling,
                     "round_flops_per_s": rates, "first_step_s": model_run.first_step_s, "graphs_compiled": model_run.graphs,
                     "step_s": statistics.median(model_run.times) / len(model_run.flops), "activation_bytes": model_run.activation_bytes,
                     "peak_step_bytes": max(model_run.peaks) if cuda else None}
    out["ratio_flops_per_s"] = statistics.median(a / b for a, b in zip(out["recurrent"]["round_flops_per_s"],
                                                                       out["dense"]["round_flops_per_s"]))
    if C.profile_rows:
        out["profile"] = profile_step(lambda: (runs["recurrent"].step(0, C.mean_loops), sync()), C.profile_rows, cuda)
    write_json(C.bench_json, out)
    print_report(out, C)
    return out


def print_report(out, C):
    m, r, d = out["machine"], out["recurrent"], out["dense"]
    print(f"machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), {m['device']}, "
          f"torch {m['torch']}; {out['date']}\ncommand: {out['command']}")
    print(f"batch {C.batch_size} x {C.block_size} tokens, {C.dtype}, compile={C.compile}, vocab {out['vocab_size']} "
          f"({out['vocab_from']}); depths {out['depths']} (mean {out['mean_depth']:.2f}); {C.rounds} rounds, medians")
    print(f"recurrent training FLOPs/token: {out['flop_formula']}")
    print(f"ceiling: {out['ceiling_flops'] / 1e12:.4g} TFLOP/s ({out['ceiling_matmul_n']}^2 matmul, {C.dtype}); "
          f"copy bandwidth {out['copy_bandwidth_bytes_per_s'] / 1e9:.4g} GB/s\n")
    print("| model | params (M) | fwd FLOP/token (M) | train FLOP/token (M) | tokens/s | achieved TFLOP/s | MFU "
          "| activations (MB) | peak step (MB) | first step (s) | step (s) |\n" + "|---" * 11 + "|")
    for name, x in (("recurrent", r), (f"dense ({out['dense_layers']} layers)", d)):
        peak = "n/a" if x["peak_step_bytes"] is None else f"{x['peak_step_bytes'] / 2**20:.0f}"
        print(f"| {name} | {x['params'] / 1e6:.2f} | {x['fwd_flops_per_token'] / 1e6:.2f} "
              f"| {x['train_flops_per_token'] / 1e6:.2f} | {x['tokens_per_s']:,.0f} | {x['flops_per_s'] / 1e12:.4g} "
              f"| {100 * x['mfu']:.1f}% | {x['activation_bytes'] / 2**20:.0f} | {peak} | {x['first_step_s']:.2f} "
              f"| {x['step_s']:.3f} |")
    print(f"\nrecurrent / dense achieved FLOP/s: {out['ratio_flops_per_s']:.3f} (median of per-round ratios)")
    if C.compile:
        print(f"compile ({C.compile_backend}): graphs in warm-up: recurrent {r['graphs_compiled']}, dense "
              f"{d['graphs_compiled']}; recompiles while the depth changed every step: "
              f"{out['recompiles_during_timed_steps']}")
    if "profile" in out:
        rows = [f"| {p['op']} | {p['self_ms']:.1f} | {p['pct']:.1f} | {p['calls']} |" for p in out["profile"]]
        print(f"\nwhere the time goes (one recurrent step at r={C.mean_loops}, self time):", "| op | ms | % | calls |",
              "|---|---|---|---|", *rows, sep="\n")
    print(f"\nwrote {C.bench_json}")



# ---- adaptive depth against the uniform-depth frontier -------------------------------------------------
# allocate.py --realized (teacher-forced scoring) and sample.py --bench (generation) time uniform
# r = 1..r_max and every A1/A1s threshold back to back on the same inputs, round after round, each keeping
# its median. A threshold's speed is read against the frontier at its loss; the losses are allocate.py's
# per-window results, so every speedup carries a paired bootstrap interval over the windows.
def frontier(points):
    """The uniform frontier: of (loss, tokens/s) points, those no other point beats on both, by loss."""
    best = []
    for loss, speed in sorted(points, key=lambda p: (p[0], -p[1])):
        if not best or speed > best[-1][1]:
            best.append((loss, speed))
    return best


def iso_loss_speedup(front, loss, speed):
    """speed / the frontier's tokens/s at `loss` (linear between the uniform depths around it), and
    where `loss` lies: 'inside' the frontier, 'below' it (better than every uniform depth: the frontier
    is read at its best point, so the speedup is a lower bound) or 'above' (worse than the fastest)."""
    losses, speeds = zip(*front)
    where = "below" if loss < losses[0] else "above" if loss > losses[-1] else "inside"
    return speed / float(np.interp(loss, losses, speeds)), where


def iso_speed_gain(front, loss, speed):
    """The frontier's loss at `speed` minus `loss` (> 0: better than uniform depth); None outside its speeds."""
    losses, speeds = zip(*front)
    if not speeds[0] <= speed <= speeds[-1]:
        return None
    return float(np.interp(speed, speeds, losses)) - loss


def speedup_at(pw, key, point, uniform_speeds, speed):
    """The iso-loss speedup of one point of a policy, as a statistic of allocate.py's per-window results
    pw: the speeds are measured once, the losses (its own and the frontier's) come from pw."""
    front = frontier(zip(pw["A0"][0].mean(1), uniform_speeds))
    return iso_loss_speedup(front, pw[key][0][point].mean(), speed)[0]


def synchronize(device):
    if device.startswith("cuda"):  # a timing waits for the GPU work queued before it
        torch.cuda.synchronize()


def median_seconds(configs, rounds, device, decode_only=False):
    """configs {name: fn}: every fn once per round (after one untimed warm-up round), for `rounds` rounds.
    decode_only: fn is generate(), which reports the seconds it spent after the prefill; time those.
    -> ({name: median seconds}, {name: the last result})."""
    times, results = {name: [] for name in configs}, {}
    for fn in configs.values():
        fn()
    for _ in range(rounds):
        for name, fn in configs.items():
            synchronize(device)
            t0 = time.perf_counter()
            results[name] = fn()
            synchronize(device)
            times[name].append(results[name][2] if decode_only else time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}, results


def frontier_rows(alloc, pw, speeds, seed):
    """One row per point of A0, A1 and A1s: its loss, loops per token and tokens/s, and for A1/A1s the
    iso-loss speedup (with its interval) and iso-throughput gain against the uniform points beside it."""
    uniform_speeds = [speeds[("A0", r)] for r in range(len(alloc["curves"]["A0"]))]
    front = frontier(zip([p["loss"] for p in alloc["curves"]["A0"]], uniform_speeds))
    rows = []
    for key in ("A0", "A1", "A1s"):
        for i, point in enumerate(alloc["curves"][key]):
            speed = speeds[(key, i)]
            row = {"policy": key, "point": i, "setting": point["threshold"], "loss": point["loss"],
                   "tokens_per_s": speed, "avg_depth": point["avg_depth"]}
            if key != "A0":
                row["speedup"] = estimate(speedup_at, pw, 1000, seed, key=key, point=i,
                                          uniform_speeds=uniform_speeds, speed=speed)
                row["where"] = iso_loss_speedup(front, point["loss"], speed)[1]
                row["gain"] = iso_speed_gain(front, point["loss"], speed)
            rows.append(row)
    return rows


def print_frontier(title, rows, extra=()):
    """A markdown table of frontier_rows; extra: (header, row key) columns."""
    print(f"\n## {title}\n")
    table = []
    for r in rows:
        setting = f"r={r['setting']}" if r["policy"] == "A0" else f"{r['setting']:.3g}"
        speedup = gain = ""
        if r["policy"] != "A0":
            speedup = ("≥ " if r["where"] == "below" else "") + show(r["speedup"], 2, "", "x")
            gain = "" if r["gain"] is None else f"{r['gain']:+.4f}"
        cells = [r["policy"], setting, f"{r['avg_depth']:.2f}", f"{r['loss']:.4f}", f"{r['tokens_per_s']:,.0f}",
                 speedup, gain]
        table.append(cells + [r[key] for _, key in extra])
    print(markdown(["policy", "r / threshold", "loops/token", "loss", "tokens/s", "iso-loss speedup [95% CI]",
                    "iso-throughput gain (nats)"] + [header for header, _ in extra], table))


@torch.no_grad()
def scoring_frontier(model, X, Y, C, alloc, pw):
    """allocate.py --realized: teacher-forced tokens/s at batch 1 and batch_size on the first timing_windows
    windows, uniform r through model.forward (the fastest uniform path), thresholds through realized_exit."""
    Xt, Yt = X[:C.timing_windows], Y[:C.timing_windows]
    r_max = alloc["r_max"]
    by_batch = {}
    for batch in (1, C.batch_size):
        def over_windows(fn):
            return lambda: [fn(Xt[i:i + batch], Yt[i:i + batch]) for i in range(0, len(Xt), batch)]
        configs = {}
        for r in range(1, r_max + 1):
            # the same work as a threshold's run: the forward and every token's loss
            configs[("A0", r - 1)] = over_windows(lambda x, y, r=r: token_loss(model(x, loops=r, state_init="zero")[0], y))
        for key, criterion in (("A1", "kl"), ("A1s", "state")):
            for i, point in enumerate(alloc["curves"][key]):
                exit_run = partial(realized_exit, r_max=r_max, criterion=criterion, threshold=point["threshold"])
                configs[(key, i)] = over_windows(lambda x, y, run_exit=exit_run: run_exit(model, x, y))
        seconds, _ = median_seconds(configs, C.timing_reps, C.device)
        by_batch[batch] = frontier_rows(alloc, pw, {k: Xt.numel() / s for k, s in seconds.items()}, C.seed)
        print_frontier(f"Realized teacher-forced scoring, batch {batch}: tokens/s on the first {len(Xt)} windows "
                       f"(median of {C.timing_reps} rounds), losses on all {len(X)}", by_batch[batch])
    return by_batch


def generation_frontier(model, C, data_dir, meta, ckpt):
    """sample.py --bench: greedy decode tokens/s at batch 1, 8 and 32, zero init, prompts of bench_tokens
    tokens spread over val.bin and bench_tokens new tokens each; the prompt is prefilled outside the timing
    (at r for uniform r, at mean_loops for the thresholds). Losses are the teacher-forced ones from
    out_dir/allocate.json: the same policies (r_max, init, K/V rule) scored there."""
    path = os.path.join(C.out_dir, "allocate.json")
    if not os.path.isfile(path):
        die(f"no {path}: run `python allocate.py --out_dir={C.out_dir}` first (the bench reads the losses from it)")
    with open(path) as f:
        alloc = json.load(f)
    if alloc["checkpoint"]["iter_num"] != ckpt["iter_num"]:
        die(f"{path} is from iter {alloc['checkpoint']['iter_num']}, the checkpoint from {ckpt['iter_num']}: rerun it")
    P = N = C.bench_tokens
    if P + N > model.config.block_size:
        die(f"--bench_tokens {P}: a prompt and its new tokens must fit block_size {model.config.block_size}")
    val = np.memmap(os.path.join(data_dir, "val.bin"), dtype=meta["dtype"], mode="r")
    if len(val) < P:
        die(f"{data_dir}/val.bin has {len(val)} tokens, fewer than one {P}-token prompt")
    starts = np.linspace(0, len(val) - P, max(GENERATION_BATCHES)).astype(int)  # one per sequence
    prompts = torch.stack([torch.from_numpy(val[i:i + P].astype(np.int64)) for i in starts]).to(C.device)
    pw = {key: (np.array(loss), np.array(depth)) for key, (loss, depth) in alloc["per_window"].items()}
    print(f"greedy generation, zero init, {P}-token prompts + {N} new tokens per sequence, decode tokens/s "
          f"(median of 3 rounds); {platform.processor() or platform.machine()}, {C.device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    res = {"args": vars(C), "prompt_tokens": P, "new_tokens": N, "batches": {}}
    alone = {}  # the first sequence's tokens at batch 1, per configuration
    for batch in GENERATION_BATCHES:
        s0 = initial_states(model, batch, P + N, "zero", C.seed, C.device)
        configs = {}
        for r in range(1, alloc["r_max"] + 1):
            configs[("A0", r - 1)] = partial(generate, model, prompts[:batch], N, r, s0, greedy)
        for key, exit in (("A1", "kl"), ("A1s", "state")):
            for i, point in enumerate(alloc["curves"][key]):
                configs[(key, i)] = partial(generate, model, prompts[:batch], N, alloc["mean_loops"], s0, greedy,
                                            exit, point["threshold"], alloc["r_max"])
        seconds, results = median_seconds(configs, 3, C.device, decode_only=True)
        speeds = {name: batch * (N - 1) / s for name, s in seconds.items()}  # N - 1 new tokens are fed back
        rows = frontier_rows(alloc, pw, speeds, C.seed)
        reference = results[("A0", alloc["mean_loops"] - 1)][0][:, P:]
        for row in rows:
            name = (row["policy"], row["point"])
            tokens, depths, _ = results[name]
            alone.setdefault(name, tokens[0, P:])
            row["avg_depth"] = float(np.mean([d for seq in depths for d in seq]))  # as run, not teacher-forced
            row["equal_to_uniform_mean"] = int((tokens[:, P:] == reference).sum())
            row["first_equal_to_batch_1"] = int((tokens[0, P:] == alone[name]).sum())
        res["batches"][batch] = rows
        print_frontier(f"Generation, batch {batch} (equal: greedy tokens equal to uniform r={alloc['mean_loops']}'s, "
                       f"of {batch * N}; first: the first sequence's equal to its batch-1 run's, of {N})", rows,
                       [("equal", "equal_to_uniform_mean"), ("first", "first_equal_to_batch_1")])
    write_json(os.path.join(C.out_dir, "sample_bench.json"), res)
    if C.plot:
        from plots import frontier_figure
        frontier_figure(res["batches"], "Generation", os.path.join(C.out_dir, "sample_bench.png"))
    return res


def greedy(logits, seqs):
    return logits.argmax(-1)

if __name__ == "__main__":
    run(main)
