"""
Train a depth-recurrent transformer with randomized depth and truncated backprop.

    python train.py                                   # CPU default: Shakespeare, ~10 min on 2 cores
    python train.py config/s1.py --max_iters=100 --batch_size 8
    torchrun --standalone --nproc_per_node=8 train.py config/s1.py

One recursion count r ~ round(LogNormal(log mean_loops, 0.5)), clamped to [1, max_loops],
is drawn per optimizer step from the seed and the step number alone, so every DDP rank
and every resumed run draws the same r. The first r - bptt_k loops run without grad.
"""
import math
import os
import time
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
import torch.distributed as dist

from configurator import (check_device, check_model, configure, default_device, die, inherit, require_package,
                          require_positive, run)
from model import CKPT_FORMAT, GPT, GPTConfig, read_checkpoint
import prepare

# ---- defaults: the CPU run that `python train.py` does ----------------------------------
out_dir = "out-shakespeare"
eval_interval = 100
log_interval = 10
eval_iters = 10
always_save_checkpoint = True
init_from = "scratch"  # 'scratch' or 'resume' (from out_dir/ckpt.pt)
overwrite_checkpoint = False  # a scratch run in an out_dir that holds a ckpt.pt replaces it (else an error)
wandb_log = False
wandb_project = "nanoloop"
wandb_run_name = "run"
dataset = "shakespeare"  # data/<dataset>/{train,val}.bin and meta.json from prepare.py
gradient_accumulation_steps = 1
batch_size = 8
block_size = 512
# model (vocab_size comes from the dataset's meta.json)
n_embd = 192
n_head = 3
n_kv_head = 1
ffn_hidden = 512
n_prelude = 1
n_core = 1
n_coda = 1
mean_loops = 8
max_loops = 32
bptt_k = 8
rope_theta = 10000.0
norm_eps = 1e-5
state_std = math.sqrt(2 / 5)
loop_dist = "lognormal"  # 'lognormal' (randomized depth) or 'fixed' (r = mean_loops always)
# optimizer and schedule
learning_rate = 2e-3
max_iters = 400
lr_decay_iters = 0  # 0: decay over max_iters (set it to stop early on the same schedule)
warmup_iters = -1  # -1: 1% of lr_decay_iters
min_lr = 2e-4
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
# system
device, dtype = default_device()  # cuda + bfloat16 when a GPU is there, else cpu + float32
compile = torch.cuda.is_available()
seed = 1337
peak_flops = 0.0  # FLOP/s that MFU is measured against; 0: measure a matmul at start-up
guard_grace_iters = 100  # the 0.1% skip budget applies from this step on
DEFAULTS = {k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, str, bool))}
MODEL_KEYS = [f for f in GPTConfig.__dataclass_fields__ if f != "vocab_size"]


def sample_loops(step, seed, mean_loops, max_loops, dist="lognormal"):
    """The recursion count for one optimizer step: a pure function of (seed, step)."""
    if dist == "fixed":
        return mean_loops
    if dist != "lognormal":
        die(f"loop_dist must be 'lognormal' or 'fixed', got {dist!r}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    z = torch.randn((), generator=g, dtype=torch.float64).item()
    return int(min(max(round(math.exp(math.log(mean_loops) + 0.5 * z)), 1), max_loops))


def get_lr(it, C):
    decay_iters = C.lr_decay_iters or C.max_iters
    warmup = C.warmup_iters if C.warmup_iters >= 0 else max(1, round(0.01 * decay_iters))
    if it < warmup:
        return C.learning_rate * (it + 1) / warmup
    ratio = min(1.0, (it - warmup) / max(1, decay_iters - warmup))
    return C.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (C.learning_rate - C.min_lr)


def get_batch(path, dtype, batch, block, generator, device):
    data = np.memmap(path, dtype=dtype, mode="r")  # reopened per batch: avoids a memmap leak
    if len(data) <= block + 1:
        die(f"{path} has {len(data)} tokens, fewer than block_size + 2 = {block + 2}")
    ix = torch.randint(len(data) - block - 1, (batch,), generator=generator).tolist()
    x = torch.stack([torch.from_numpy(data[i:i + block].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block].astype(np.int64)) for i in ix])
    if device.startswith("cuda"):
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def nonfinite_guard(finite, it, skipped, consecutive, grace):
    """Skip bookkeeping for a non-finite loss or grad norm. A healthy run never fires this;
    a firing is a bug signal, so the budget is tiny: 3 in a row, or > 0.1% after `grace`."""
    if finite:
        return 0
    skipped.append(it)
    consecutive += 1
    print(f"iter {it}: non-finite loss or grad norm, optimizer step skipped ({len(skipped)} so far)", flush=True)
    if consecutive >= 3:
        die(f"iter {it}: {consecutive} consecutive non-finite steps (skipped: {skipped}); aborting")
    if it >= grace and len(skipped) > 0.001 * (it + 1):
        die(f"iter {it}: {len(skipped)} non-finite steps exceed 0.1% of {it + 1} (skipped: {skipped}); aborting")
    return consecutive


def save_checkpoint(obj, path):
    """Atomic: write a temporary file, flush it to disk, then rename over the old one."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def measure_matmul_flops(device, dtype, n=None, reps=5):
    """The machine's ceiling as measured, not a datasheet number: a square matmul's FLOP/s (on a CPU, sized
    by a 256^2 probe to ~0.2 s a matmul, at most 2048^2: bfloat16 there can be 50x slower than float32)."""
    if n is None and not device.startswith("cuda"):
        n = int(min(2048, (0.1 * measure_matmul_flops(device, dtype, 256, 1)) ** (1 / 3)))
    n = n or 8192
    g = torch.Generator(device=device).manual_seed(0)  # leaves the training run's streams alone
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    a @ b
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


@torch.no_grad()
def estimate_loss(model, C, data_dir, bin_dtype, ctx):
    """Train and val loss at mean_loops, noise init, over the same eval_iters batches every time
    (own generators: evaluating never moves the training run's random streams)."""
    model.eval()
    out = {}
    for split in ("train", "val"):
        g_data = torch.Generator().manual_seed(C.seed + 1)
        g_noise = torch.Generator(device=C.device).manual_seed(C.seed + 2)
        losses = []
        path = os.path.join(data_dir, f"{split}.bin")
        for _ in range(C.eval_iters):
            x, y = get_batch(path, bin_dtype, C.batch_size, C.block_size, g_data, C.device)
            with ctx:
                losses.append(model(x, y, loops=C.mean_loops, generator=g_noise)[1].item())
        out[split] = sum(losses) / len(losses)
    model.train()
    return out


def main(argv=()):
    """Run training; returns the list of (iter, loops, loss) for every optimizer step taken."""
    given = set()  # the keys a config file or the command line set: a resumed run checks them
    C = SimpleNamespace(**configure(DEFAULTS, list(argv), given))
    check_device(C.device, C.dtype)
    require_positive(C, "batch_size", "gradient_accumulation_steps", "learning_rate", "eval_iters",
                     "eval_interval", "log_interval")
    check_model(C)
    if C.init_from not in ("scratch", "resume"):
        die(f"init_from must be 'scratch' or 'resume', got {C.init_from!r}")
    sample_loops(0, C.seed, C.mean_loops, C.max_loops, C.loop_dist)  # validates loop_dist
    wandb = require_package("wandb", "--wandb_log=True") if C.wandb_log else None
    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        dist.init_process_group(backend="nccl" if C.device.startswith("cuda") else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        if C.device.startswith("cuda"):
            C.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
            torch.cuda.set_device(C.device)
        if C.gradient_accumulation_steps % world:
            die(f"gradient_accumulation_steps={C.gradient_accumulation_steps} must be divisible by {world} ranks")
        C.gradient_accumulation_steps //= world
    else:
        rank, world = 0, 1
    master = rank == 0
    log = (lambda *a: print(*a, flush=True)) if master else (lambda *a: None)
    device_type = "cuda" if C.device.startswith("cuda") else "cpu"
    torch.manual_seed(C.seed + rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[C.dtype]
    ctx = nullcontext() if C.dtype == "float32" else torch.autocast(device_type, dtype=ptdtype)

    ckpt_path = os.path.join(C.out_dir, "ckpt.pt")
    ckpt = None
    if C.init_from == "resume":
        ckpt = read_checkpoint(ckpt_path, C.device)
        inherit(C, {k: ckpt["model_args"][k] for k in MODEL_KEYS}, given, ckpt_path)  # its shape and loops
        C.dataset = C.dataset if "dataset" in given else ckpt["config"]["dataset"]
    elif os.path.exists(ckpt_path) and not C.overwrite_checkpoint:
        die(f"{ckpt_path} holds a run at step {read_checkpoint(ckpt_path)['iter_num']}: continue it with "
            f"--init_from=resume, or replace it with --overwrite_checkpoint=True")
    if C.dataset == DEFAULTS["dataset"] and not os.path.isfile(os.path.join("data", C.dataset, "meta.json")):
        if master:  # the quick start is two commands: the default corpus prepares itself on first use
            log(f"data/{C.dataset}/ is not prepared yet: running `python prepare.py` first")
            prepare.main([])
        if ddp:
            dist.barrier()
    data_dir, meta = prepare.open_dataset(C.dataset, ckpt, ckpt_path)
    model_args = {k: getattr(C, k) for k in MODEL_KEYS} | {"vocab_size": meta["vocab_size"]}
    model = GPT(GPTConfig(**model_args)).to(C.device)
    optimizer = model.configure_optimizers(C.weight_decay, C.learning_rate, (C.beta1, C.beta2), device_type)
    g_data = torch.Generator().manual_seed(C.seed + 1000 + rank)
    iter_num, best_val_loss = 0, float("inf")
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        iter_num, best_val_loss = ckpt["iter_num"], ckpt["best_val_loss"]
        rng = ckpt["rng"]
        if len(rng["data"]) != world:  # each rank continues its own streams, so the count must match
            die(f"{ckpt_path} was saved by {len(rng['data'])} rank(s); resume it with as many, not {world}")
        g_data.set_state(rng["data"][rank].cpu())  # map_location moved them; RNG states live on the CPU
        torch.set_rng_state(rng["torch"][rank].cpu())
        if device_type == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"][rank].cpu())
        ckpt = None
    log(f"model: {model.get_num_params() / 1e6:.2f}M unique non-embedding params, "
        f"{model.get_num_params(False) / 1e6:.2f}M total; loops {C.loop_dist} mean {C.mean_loops} "
        f"max {C.max_loops}, bptt_k {C.bptt_k}; {C.device} {C.dtype}")

    # the paper's mixed-dtype bug hid for a whole run: record what attention really sees, once,
    # from one eager forward before anything is compiled
    x, _ = get_batch(os.path.join(data_dir, "train.bin"), meta["dtype"], 1, C.block_size, torch.Generator(), C.device)
    with torch.no_grad(), ctx:
        model(x, loops=1, state_init="zero")
    log("attention input dtypes (q, k, v): " + ", ".join(
        f"{name.split('.')[0]} {[str(d).replace('torch.', '') for d in m.seen_dtypes]}"
        for name, m in model.named_modules() if name.endswith("0.attn")))
    if C.compile:  # per part, so the python loop over a varying depth never recompiles
        log("compiling prelude, core and coda...")
        for part in (model.prelude_blocks, model.core, model.coda_blocks):
            part.compile()
    raw_model = model
    if ddp:
        model = DDP(model, device_ids=[torch.cuda.current_device()] if device_type == "cuda" else None)
    if C.wandb_log and master:
        wandb.init(project=C.wandb_project, name=C.wandb_run_name, config=vars(C))
    peak = C.peak_flops or measure_matmul_flops(C.device, ptdtype)
    log(f"MFU is against {peak / 1e12:.3f} TFLOP/s ({'given' if C.peak_flops else 'measured matmul'}, {C.dtype})")
    if master:
        os.makedirs(C.out_dir, exist_ok=True)

    history, skipped, consecutive, flops_since_log = [], [], 0, 0.0
    train_path = os.path.join(data_dir, "train.bin")
    tokens_per_iter = C.gradient_accumulation_steps * world * C.batch_size * C.block_size
    t0, steps_since_log = time.perf_counter(), 0
    while True:
        lr = get_lr(iter_num, C)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if iter_num % C.eval_interval == 0 or iter_num == C.max_iters:
            losses = estimate_loss(raw_model, C, data_dir, meta["dtype"], ctx)
            bpb = ""
            if "val_bytes" in meta:  # bits per byte: comparable across tokenizers
                bpb = f", val {losses['val'] * meta['val_tokens'] / meta['val_bytes'] / math.log(2):.4f} bits/byte"
            log(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}{bpb} "
                f"(loops={C.mean_loops})")
            if C.wandb_log and master:
                wandb.log({"iter": iter_num, "train/loss": losses["train"], "val/loss": losses["val"], "lr": lr})
            if not (math.isfinite(losses["val"]) and all(p.isfinite().all() for p in raw_model.parameters())):
                log(f"step {iter_num}: non-finite val loss or weights, not saved (the last checkpoint stays)")
            elif losses["val"] < best_val_loss or C.always_save_checkpoint:
                best_val_loss = min(best_val_loss, losses["val"])
                rng = {"data": [g_data.get_state()], "torch": [torch.get_rng_state()]}
                if device_type == "cuda":
                    rng["cuda"] = [torch.cuda.get_rng_state()]
                if ddp:  # every rank's streams, so a resumed DDP run continues each of them
                    for key, states in rng.items():
                        gathered = [None] * world
                        dist.all_gather_object(gathered, states[0].cpu())
                        rng[key] = gathered
                if master and iter_num > 0:
                    save_checkpoint({"format": CKPT_FORMAT, "model_args": model_args, "model": raw_model.state_dict(),
                                     "optimizer": optimizer.state_dict(), "iter_num": iter_num,
                                     "best_val_loss": best_val_loss, "config": vars(C) | {"dataset_meta": meta},
                                     "rng": rng}, ckpt_path)
                    log(f"saved checkpoint to {ckpt_path}")
            t0, flops_since_log, steps_since_log = time.perf_counter(), 0.0, 0  # evals are not training time
        if iter_num >= C.max_iters:
            break

        loops = sample_loops(iter_num, C.seed, C.mean_loops, C.max_loops, C.loop_dist)
        loss_sum = 0.0
        for micro in range(C.gradient_accumulation_steps):
            x, y = get_batch(train_path, meta["dtype"], C.batch_size, C.block_size, g_data, C.device)
            if ddp:  # all-reduce gradients on the last micro-step only
                model.require_backward_grad_sync = micro == C.gradient_accumulation_steps - 1
            with ctx:
                _, loss = model(x, y, loops=loops)
                loss = loss / C.gradient_accumulation_steps
            loss.backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), C.grad_clip if C.grad_clip > 0 else float("inf"))
        finite = torch.isfinite(loss_sum + grad_norm).float()
        if ddp:  # every rank must take the same decision
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        finite = bool(finite.item())
        if finite:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        consecutive = nonfinite_guard(finite, iter_num, skipped, consecutive, C.guard_grace_iters)
        loss_val = float(loss_sum)
        history.append((iter_num, loops, loss_val))
        flops_since_log += raw_model.flops_per_token(loops, min(loops, C.bptt_k), C.block_size) * tokens_per_iter
        steps_since_log += 1
        if iter_num % C.log_interval == 0 and master:
            dt = time.perf_counter() - t0  # the steps since the last log line (or eval), each at its own depth
            tokens_per_s = tokens_per_iter * steps_since_log / dt
            mfu = flops_since_log / dt / peak / world
            log(f"iter {iter_num}: loss {loss_val:.4f}, loops {loops:2d}, lr {lr:.2e}, "
                f"{1000 * dt / steps_since_log:.0f} ms/iter, {tokens_per_s:,.0f} tok/s, mfu {100 * mfu:.1f}%")
            if C.wandb_log:
                wandb.log({"iter": iter_num, "train/step_loss": loss_val, "loops": loops, "tok_per_s": tokens_per_s})
            t0, flops_since_log, steps_since_log = time.perf_counter(), 0.0, 0
        iter_num += 1
    if ddp:
        dist.destroy_process_group()
    return history


if __name__ == "__main__":
    run(main)
