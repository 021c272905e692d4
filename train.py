"""Train a depth-recurrent transformer with randomized depth and truncated backprop.

    python train.py        # the CPU default: Shakespeare, ~10 min on 2 cores
    torchrun --standalone --nproc_per_node=8 train.py config/s1.py
"""
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist

import prepare
from configurator import configure, die, run
from model import (CKPT_FORMAT, GPT, GPTConfig, autocast, check_device, config_or_die, read_checkpoint,
                   save_atomic, training_memory)

out_dir = "out-shakespeare"  # ckpt.pt is written here
eval_interval = 100  # steps between evaluations and saves
log_interval = 10  # steps between log lines
eval_iters = 10  # batches per evaluation
always_save_checkpoint = True  # save at every evaluation, not only the best
init_from = "scratch"  # 'scratch' or 'resume' (from out_dir/ckpt.pt)
overwrite_checkpoint = False  # let a scratch run replace ckpt.pt
dataset = "shakespeare"  # data/<dataset>/ from prepare.py
gradient_accumulation_steps = 1  # micro-steps per step, over all ranks
batch_size = 8  # sequences per micro-step
block_size = 512  # tokens per sequence
n_embd = 192  # model width (vocab_size: the dataset's)
n_head = 3  # attention heads
n_kv_head = 1  # key/value heads (grouped-query attention)
ffn_hidden = 512  # SwiGLU hidden width
n_prelude = 1  # unique blocks before the core
n_core = 1  # blocks in the weight-tied core
n_coda = 1  # unique blocks after the core
mean_loops = 8  # median of the loop distribution
max_loops = 32  # loops are clamped to this
bptt_k = 8  # loops that get gradients (the last ones)
rope_theta = 10000.0  # rotary embedding base
norm_eps = 1e-5  # RMSNorm epsilon
state_std = math.sqrt(2 / 5)  # std of the noise initial state
loop_dist = "lognormal"  # 'lognormal' (randomized) or 'fixed' (mean_loops)
learning_rate = 2e-3  # peak learning rate
max_iters = 400  # optimizer steps
lr_decay_iters = 0  # cosine decay length; 0: max_iters
warmup_iters = -1  # linear warm-up steps; -1: 1% of lr_decay_iters
min_lr = 2e-4  # learning rate at the end of the decay
weight_decay = 0.1  # AdamW weight decay on matrices
beta1 = 0.9  # AdamW beta1
beta2 = 0.95  # AdamW beta2
grad_clip = 1.0  # gradient norm clip; 0: none
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu, cuda or cuda:N
dtype = "bfloat16" if torch.cuda.is_available() else "float32"  # autocast dtype
compile = torch.cuda.is_available()  # torch.compile each part
compile_backend = "inductor"  # (aot_eager needs no C++ compiler)
seed = 1337  # seeds the depths, data order and noise
peak_flops = 0.0  # MFU's FLOP/s; 0: the card's datasheet bf16 peak
guard_grace_iters = 100  # steps before the 0.1% skip budget
memory_limit_gb = 0.0  # refuse a run predicted above it; 0: the device's memory
INT = (0, 2**31)
POS = (1, 2**31)
RULES = dict(
    out_dir=str, eval_interval=POS, log_interval=POS, eval_iters=POS,
    always_save_checkpoint=bool, init_from=("scratch", "resume"), overwrite_checkpoint=bool, dataset=str,
    gradient_accumulation_steps=(1, 2**20), batch_size=(1, 2**20), block_size=(2, 2**20),
    n_embd=(2, 2**16), n_head=(1, 1024), n_kv_head=(1, 1024), ffn_hidden=(1, 2**18),
    n_prelude=(0, 256), n_core=(0, 256), n_coda=(0, 256), mean_loops=(1, 256), max_loops=(1, 1024),
    bptt_k=(1, 1024), rope_theta=(1.0, 1e9), norm_eps=(1e-12, 1.0), state_std=(0.0, 100.0),
    loop_dist=("lognormal", "fixed"), learning_rate=(1e-12, 10.0), max_iters=INT, lr_decay_iters=INT,
    warmup_iters=(-1, 2**31), min_lr=(0.0, 10.0), weight_decay=(0.0, 10.0), beta1=(0.0, 0.9999),
    beta2=(0.0, 0.9999), grad_clip=(0.0, 1e9), device=str, dtype=("float32", "bfloat16"),
    compile=bool, compile_backend=str, seed=(0, 2**32 - 1), peak_flops=(0.0, 1e20),
    guard_grace_iters=INT, memory_limit_gb=(0.0, 1e6))
MODEL_KEYS = [f for f in GPTConfig.__dataclass_fields__ if f != "vocab_size"]
DATASHEET = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "RTX 4090": 165e12, "L40S": 362e12,
             "A10": 125e12, "RTX 3090": 71e12}  # dense bf16 peaks, FLOP/s


def sample_loops(step, seed, mean_loops, max_loops, dist="lognormal"):
    """One step's depth, from (seed, step) alone: the same on every rank."""
    if dist == "fixed":
        return mean_loops
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    z = torch.randn((), generator=g, dtype=torch.float64).item()
    r = round(math.exp(math.log(mean_loops) + 0.5 * z))
    return int(min(max(r, 1), max_loops))


def get_lr(it, C):
    decay_iters = C.lr_decay_iters or C.max_iters
    warmup = C.warmup_iters if C.warmup_iters >= 0 else max(1, round(0.01 * decay_iters))
    if it < warmup:
        return C.learning_rate * (it + 1) / warmup
    ratio = min(1.0, (it - warmup) / max(1, decay_iters - warmup))
    return C.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (C.learning_rate - C.min_lr)


def get_batch(C, meta, split, generator):
    """(x, y) token ids, each (batch_size, block_size)."""
    path = os.path.join("data", C.dataset, f"{split}.bin")
    data = np.memmap(path, dtype=meta["dtype"], mode="r")  # reopened: no memmap leak
    if len(data) < C.block_size + 2:
        die(f"{path} has {len(data)} tokens, fewer than block_size + 2")
    ix = torch.randint(len(data) - C.block_size - 1, (C.batch_size,), generator=generator).tolist()
    xy = torch.stack([torch.from_numpy(data[i:i + C.block_size + 1].astype(np.int64)) for i in ix])
    if "cuda" in C.device:
        xy = xy.pin_memory()
    xy = xy.to(C.device, non_blocking=True)
    return xy[:, :-1], xy[:, 1:]


def nonfinite_guard(it, skipped, grace, log=print):
    """Note skipped step `it`; 3 in a row, or over 0.1% after `grace`, abort."""
    skipped.append(it)
    log(f"iter {it}: non-finite loss or grad norm, optimizer step skipped ({len(skipped)} so far)")
    if skipped[-3:] == [it - 2, it - 1, it]:
        die(f"iter {it}: 3 consecutive non-finite steps: {skipped}")
    if it >= grace and len(skipped) > 0.001 * (it + 1):
        die(f"iter {it}: {len(skipped)} non-finite steps exceed 0.1% of {it + 1}: {skipped}")


def mfu_ceiling(C):
    """(MFU's FLOP/s ceiling, its source), or (0, why there is none)."""
    if C.peak_flops:
        return C.peak_flops, "--peak_flops"
    if "cuda" not in C.device:
        return 0.0, "no MFU on a CPU: its peak moves with load"
    name = torch.cuda.get_device_name(C.device)
    for card, peak in DATASHEET.items():
        if card in name and C.dtype == "bfloat16":
            return peak, f"{card} datasheet bf16 peak"
    return 0.0, f"no MFU: no bf16 peak for {name} {C.dtype} (--peak_flops)"


def build(C, given, log):
    """-> (model, optimizer, data generator, meta, step, best val loss)."""
    try:
        os.makedirs(C.out_dir, exist_ok=True)
    except OSError as err:
        die(f"--out_dir={C.out_dir}: {err.strerror}")
    if not os.access(C.out_dir, os.W_OK):
        die(f"--out_dir={C.out_dir} is not a writable folder")
    ckpt_path = os.path.join(C.out_dir, "ckpt.pt")
    ckpt = read_checkpoint(ckpt_path, C.device) if C.init_from == "resume" else None
    if ckpt:  # its model and dataset kept
        saved = {k: ckpt["model_args"].get(k) for k in MODEL_KEYS} | {"dataset": ckpt["config"]["dataset"]}
        for key, value in saved.items():
            if key in given and getattr(C, key) != value:
                die(f"--{key}={getattr(C, key)}, but {ckpt_path} has {key}={value}")
            setattr(C, key, value)
    elif os.path.exists(ckpt_path) and not C.overwrite_checkpoint:
        step = read_checkpoint(ckpt_path, advice="; --overwrite_checkpoint=True replaces it")["iter_num"]
        die(f"{ckpt_path} is at step {step}: --init_from=resume or --overwrite_checkpoint=True")
    if C.dataset == "shakespeare" and not os.path.isfile("data/shakespeare/meta.json"):
        if C.rank == 0:  # the default corpus prepares itself
            log("no data/shakespeare/ yet: running `python prepare.py` first")
            prepare.main([])
        if C.world > 1:
            dist.barrier()
    meta = prepare.open_dataset(C.dataset, ckpt, ckpt_path)[1]
    config = config_or_die(vocab_size=meta["vocab_size"], **{k: getattr(C, k) for k in MODEL_KEYS})
    need = training_memory(config, C.batch_size, C.dtype)
    have = C.memory_limit_gb * 1e9 or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if "cuda" in C.device and not C.memory_limit_gb:
        have = torch.cuda.get_device_properties(C.device).total_memory
    parts = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in need.items() if k != "total")
    total = need["total"] / 1e9
    log(f"memory per micro-step: {total:.3g} GB ({parts}); {have / 1e9:.1f} GB available")
    if need["total"] > have:
        per_row = need["activations"] / C.batch_size
        fits = int((have - need["total"] + need["activations"]) // per_row)
        advice = f"--batch_size={fits}, more --gradient_accumulation_steps" if fits > 0 else "no batch fits"
        die(f"{total:.1f} GB per micro-step exceeds {have / 1e9:.1f} GB: {advice}")
    model = GPT(config).to(C.device)
    betas = (C.beta1, C.beta2)
    optimizer = model.configure_optimizers(C.weight_decay, C.learning_rate, betas, C.device.split(":")[0])
    g_data = torch.Generator().manual_seed(C.seed + 1000 + C.rank)
    C.run_id = os.urandom(8).hex()
    if ckpt is None:
        return model, optimizer, g_data, meta, 0, math.inf
    model.load_state_dict(ckpt["model"])
    for old, new in zip(ckpt["optimizer"]["param_groups"], optimizer.param_groups):
        old.update(weight_decay=new["weight_decay"], betas=new["betas"])  # today's
    optimizer.load_state_dict(ckpt["optimizer"])
    rng = ckpt["rng"]
    if len(rng["data"]) != C.world:
        die(f"{ckpt_path} was saved by {len(rng['data'])} ranks, not {C.world}")
    g_data.set_state(rng["data"][C.rank].cpu())  # RNG states live on the CPU
    torch.set_rng_state(rng["torch"][C.rank].cpu())
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"][C.rank].cpu())
    C.run_id = ckpt["config"].get("run_id", C.run_id)
    return model, optimizer, g_data, meta, ckpt["iter_num"], ckpt["best_val_loss"]


def evaluate_and_save(model, optimizer, g_data, C, meta, it, best_val, log):
    """Losses on fixed batches; a checkpoint if finite. -> best val loss."""
    losses = {}
    for split in ("train", "val"):
        g_batch = torch.Generator().manual_seed(C.seed + 1)  # not the run's streams
        g_noise = torch.Generator(device=C.device).manual_seed(C.seed + 2)
        total = 0.0
        for _ in range(C.eval_iters):
            x, y = get_batch(C, meta, split, g_batch)
            with torch.no_grad(), autocast(C.device, C.dtype):
                total += model(x, y, loops=C.mean_loops, generator=g_noise)[1].item()
        losses[split] = total / C.eval_iters
    bits = losses["val"] * meta.get("val_tokens", 0) / meta.get("val_bytes", math.nan) / math.log(2)
    log(f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}, "
        f"val {bits:.4f} bits/byte (loops={C.mean_loops})")
    if not all(p.isfinite().all() for p in model.parameters()) or not math.isfinite(losses["val"]):
        log(f"step {it}: non-finite val loss or weights, not saved")
    elif losses["val"] < best_val or C.always_save_checkpoint:
        best_val = min(best_val, losses["val"])
        rng = {"data": g_data.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        ranks = [rng] * C.world
        if C.world > 1:  # every rank takes part
            dist.all_gather_object(ranks, rng)
        if it > 0 and C.rank == 0:
            config = {k: getattr(C, k) for k in RULES} | {"dataset_meta": meta, "run_id": C.run_id}
            ckpt = {"format": CKPT_FORMAT, "model_args": dict(vars(model.config)), "config": config,
                    "model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": it,
                    "best_val_loss": best_val, "rng": {k: [r[k] for r in ranks] for k in rng}}
            save_atomic(os.path.join(C.out_dir, "ckpt.pt"), ckpt)
            log(f"saved checkpoint to {C.out_dir}/ckpt.pt")
    return best_val


def train_step(model, optimizer, g_data, C, meta, it, log, skipped):
    """-> (it, loops, loss); a non-finite step is skipped."""
    t0 = time.perf_counter()
    lr = get_lr(it, C)
    for group in optimizer.param_groups:
        group["lr"] = lr
    loops = sample_loops(it, C.seed, C.mean_loops, C.max_loops, C.loop_dist)
    loss_sum = torch.zeros((), device=C.device)
    for _ in range(C.gradient_accumulation_steps):
        x, y = get_batch(C, meta, "train", g_data)
        with autocast(C.device, C.dtype):
            loss = model(x, y, loops=loops)[1] / C.gradient_accumulation_steps
        loss.backward()
        loss_sum += loss.detach()
    if C.world > 1:  # one all-reduce per step
        for p in model.parameters():
            dist.all_reduce(p.grad)  # gloo has no AVG: sum, then divide
            p.grad /= C.world
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), C.grad_clip or math.inf)
    finite = torch.isfinite(loss_sum + grad_norm).float()
    if C.world > 1:  # the same decision on every rank
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    if finite.item():
        optimizer.step()
    else:
        nonfinite_guard(it, skipped, C.guard_grace_iters, log)
    optimizer.zero_grad(set_to_none=True)
    loss = loss_sum.item()
    if it % C.log_interval == 0:
        dt = time.perf_counter() - t0
        tokens = C.gradient_accumulation_steps * C.world * C.batch_size * C.block_size
        flops = model.flops_per_token(loops, min(loops, C.bptt_k), C.block_size) * tokens
        mfu = f", mfu {100 * flops / dt / C.peak / C.world:.1f}%" if C.peak else ""
        log(f"iter {it}: loss {loss:.4f}, loops {loops:2d}, lr {lr:.2e}, "
            f"{1000 * dt:.0f} ms/iter, {tokens / dt:,.0f} tok/s{mfu}")
    return it, loops, loss


def main(argv=()):
    """-> [(iter, loops, loss)] of every optimizer step taken."""
    C, given = configure(globals(), RULES, list(argv))
    check_device(C.device)
    C.rank = int(os.environ.get("RANK", 0))  # set by torchrun
    C.world = int(os.environ.get("WORLD_SIZE", 1))
    if C.world > 1:
        dist.init_process_group(backend="nccl" if "cuda" in C.device else "gloo")
        if "cuda" in C.device:
            C.device = f"cuda:{os.environ['LOCAL_RANK']}"
            torch.cuda.set_device(C.device)
        if C.gradient_accumulation_steps % C.world:
            die(f"gradient_accumulation_steps must be a multiple of {C.world}")
        C.gradient_accumulation_steps //= C.world
    log = print if C.rank == 0 else (lambda *a: None)
    torch.manual_seed(C.seed + C.rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    model, optimizer, g_data, meta, start, best_val = build(C, given, log)
    log(f"model: {model.get_num_params() / 1e6:.2f}M unique non-embedding params, "
        f"{model.get_num_params(False) / 1e6:.2f}M total; loops {C.loop_dist} mean {C.mean_loops} "
        f"max {C.max_loops}, bptt_k {C.bptt_k}; {C.device} {C.dtype}")
    with torch.no_grad(), autocast(C.device, C.dtype):  # the paper's hidden dtype bug
        model(torch.zeros(1, 1, dtype=torch.long, device=C.device), loops=1, state_init="zero")
    seen = [f"{name.split('.')[0]} {[str(d).removeprefix('torch.') for d in module.seen_dtypes]}"
            for name, module in model.named_modules() if name.endswith(".0.attn")]
    log("attention input dtypes (q, k, v): " + ", ".join(seen))
    if C.compile:  # per part: no recompile per depth
        log(f"compiling prelude, core and coda ({C.compile_backend})")
        for part in (model.prelude_blocks, model.core, model.coda_blocks):
            part.compile(backend=C.compile_backend)
    C.peak, ceiling = mfu_ceiling(C)
    log(f"MFU against {C.peak:.3g} FLOP/s ({ceiling})" if C.peak else ceiling)
    history = []
    skipped = []
    for it in range(start, C.max_iters):
        if it % C.eval_interval == 0:
            best_val = evaluate_and_save(model, optimizer, g_data, C, meta, it, best_val, log)
        history.append(train_step(model, optimizer, g_data, C, meta, it, log, skipped))
    evaluate_and_save(model, optimizer, g_data, C, meta, max(start, C.max_iters), best_val, log)
    if C.world > 1:  # together: a rank leaving early aborted gloo
        dist.barrier()
        dist.destroy_process_group()
    return history


if __name__ == "__main__":
    run(main)
