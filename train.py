"""
Train a depth-recurrent transformer with randomized depth and truncated backprop.

    python train.py                                   # CPU default: Shakespeare, ~10 min on 2 cores
    python train.py config/s1.py --max_iters=100
    torchrun --standalone --nproc_per_node=8 train.py config/s1.py

One recursion count r ~ round(LogNormal(log mean_loops, 0.5)), clamped to [1, max_loops], is
drawn per optimizer step from the seed and the step alone, so every DDP rank and every resumed
run draws the same r. The first r - bptt_k loops run without grad. Before the first step the
run's memory per micro-step is counted (model.training_memory) and a run that would not fit the
device is refused. A step whose loss or gradient is not finite is skipped and logged; the run
aborts at 3 in a row, or once skips exceed 0.1% of the steps taken so far (after a grace).
"""
import math
import os
import secrets
import time

import numpy as np
import torch
import torch.distributed as dist

import prepare
from configurator import configure, die, run
from model import (CKPT_FORMAT, GPT, GPTConfig, autocast, check_device, config_or_die, read_checkpoint,
                   training_memory)

# ---- settings: the CPU run that `python train.py` does -----------------------------------
out_dir = "out-shakespeare"  # ckpt.pt is written here
eval_interval = 100  # steps between evaluations (and checkpoints)
log_interval = 10  # steps between log lines
eval_iters = 10  # batches per evaluation
always_save_checkpoint = True  # save at every evaluation, not only on a better val loss
init_from = "scratch"  # 'scratch' or 'resume' (from out_dir/ckpt.pt)
overwrite_checkpoint = False  # let a scratch run replace out_dir/ckpt.pt
wandb_log = False  # log to Weights & Biases (needs `wandb`)
wandb_project = "nanoloop"  # wandb project
wandb_run_name = "run"  # wandb run name
dataset = "shakespeare"  # data/<dataset>/ from prepare.py
gradient_accumulation_steps = 1  # micro-steps per optimizer step (split across DDP ranks)
batch_size = 8  # sequences per micro-step
block_size = 512  # tokens per sequence
n_embd = 192  # model width (vocab_size comes from the dataset)
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
loop_dist = "lognormal"  # 'lognormal' (randomized depth) or 'fixed' (r = mean_loops)
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
dtype = "bfloat16" if torch.cuda.is_available() else "float32"  # autocast dtype of the matmuls
compile = torch.cuda.is_available()  # torch.compile prelude, core and coda separately
compile_backend = "inductor"  # torch.compile backend (aot_eager: no C++ toolchain needed)
seed = 1337  # seeds the depths, data order and noise
peak_flops = 0.0  # FLOP/s for MFU; 0: the card's datasheet bf16 peak (no MFU on a CPU)
guard_grace_iters = 100  # steps before the 0.1% skip budget applies
memory_limit_gb = 0.0  # refuse a run predicted above this; 0: the device's memory
INT = (0, 2 ** 31)
RULES = dict(
    out_dir=str, eval_interval=(1, 2 ** 31), log_interval=(1, 2 ** 31), eval_iters=(1, 2 ** 31),
    always_save_checkpoint=bool, init_from=("scratch", "resume"), overwrite_checkpoint=bool,
    wandb_log=bool, wandb_project=str, wandb_run_name=str, dataset=str,
    gradient_accumulation_steps=(1, 2 ** 20), batch_size=(1, 2 ** 20), block_size=(2, 2 ** 20),
    n_embd=(2, 2 ** 16), n_head=(1, 1024), n_kv_head=(1, 1024), ffn_hidden=(1, 2 ** 18),
    n_prelude=(0, 256), n_core=(1, 256), n_coda=(0, 256), mean_loops=(1, 256), max_loops=(1, 1024),
    bptt_k=(1, 1024), rope_theta=(1.0, 1e9), norm_eps=(1e-12, 1.0), state_std=(0.0, 100.0),
    loop_dist=("lognormal", "fixed"), learning_rate=(1e-12, 10.0), max_iters=INT, lr_decay_iters=INT,
    warmup_iters=(-1, 2 ** 31), min_lr=(0.0, 10.0), weight_decay=(0.0, 10.0), beta1=(0.0, 0.9999),
    beta2=(0.0, 0.9999), grad_clip=(0.0, 1e9), device=str, dtype=("float32", "bfloat16"),
    compile=bool, compile_backend=str, seed=(0, 2 ** 32 - 1), peak_flops=(0.0, 1e20),
    guard_grace_iters=INT, memory_limit_gb=(0.0, 1e6))
MODEL_KEYS = [f for f in GPTConfig.__dataclass_fields__ if f != "vocab_size"]
# dense bf16 datasheet peaks (FLOP/s), so MFU does not depend on how busy the card was at start-up
DATASHEET = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "RTX 4090": 165e12, "L40S": 362e12,
             "A10": 125e12, "RTX 3090": 71e12}


def sample_loops(step, seed, mean_loops, max_loops, dist="lognormal"):
    """The recursion count for one optimizer step: a pure function of (seed, step)."""
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


def get_batch(path, dtype, batch, block, generator, device):
    data = np.memmap(path, dtype=dtype, mode="r")  # reopened per batch: avoids a memmap leak
    if len(data) <= block + 1:
        die(f"{path} has {len(data)} tokens, fewer than block_size + 2 = {block + 2}")
    ix = torch.randint(len(data) - block - 1, (batch,), generator=generator).tolist()
    x = torch.stack([torch.from_numpy(data[i:i + block].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block].astype(np.int64)) for i in ix])
    if device.startswith("cuda"):
        x = x.pin_memory().to(device, non_blocking=True)
        y = y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def nonfinite_guard(finite, it, skipped, consecutive, grace, log=print):
    """Skip bookkeeping for a non-finite loss or grad norm. A healthy run never fires this; a
    firing is a bug signal, so the budget is tiny: 3 in a row, or more than 0.1% of the it + 1
    steps taken so far once `grace` steps have passed. Returns the consecutive count."""
    if finite:
        return 0
    skipped.append(it)
    log(f"iter {it}: non-finite loss or grad norm, optimizer step skipped ({len(skipped)} so far)")
    if consecutive + 1 >= 3:
        die(f"iter {it}: {consecutive + 1} consecutive non-finite steps (skipped: {skipped}); aborting")
    if it >= grace and len(skipped) > 0.001 * (it + 1):
        die(f"iter {it}: {len(skipped)} non-finite steps exceed 0.1% of {it + 1} "
            f"(skipped: {skipped}); aborting")
    return consecutive + 1


def save_checkpoint(obj, path):
    """Atomic: write a temporary file, flush it to disk, then rename over the old one."""
    with open(f"{path}.tmp", "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f"{path}.tmp", path)


def device_memory(device):
    """Bytes of memory the device has: the card's, or this machine's RAM on a CPU."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(C, config, log):
    """Count the micro-step's memory, print it beside the device's, refuse what cannot fit."""
    need = training_memory(config, C.batch_size, C.dtype)
    have = C.memory_limit_gb * 1e9 or device_memory(C.device)
    parts = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in need.items() if k != "total")
    log(f"memory per micro-step: {need['total'] / 1e9:.3g} GB predicted ({parts}); "
        f"{have / 1e9:.1f} GB available")
    if need["total"] > have:
        per_row = need["activations"] / C.batch_size
        fits = int((have - need["total"] + need["activations"]) // per_row)
        advice = f"use --batch_size={fits} with more --gradient_accumulation_steps" if fits >= 1 else \
            "not even one sequence fits: a smaller model or block_size"
        die(f"predicted {need['total'] / 1e9:.1f} GB per micro-step exceeds {have / 1e9:.1f} GB: {advice}")


def mfu_ceiling(C):
    """(FLOP/s that MFU is measured against, what it is), or (0, why there is none)."""
    if C.peak_flops:
        return C.peak_flops, "--peak_flops"
    if not C.device.startswith("cuda"):
        return 0.0, "no MFU on a CPU: its ceiling moves with load (bench.py measures one)"
    name = torch.cuda.get_device_name(torch.device(C.device))
    card = next((card for card in DATASHEET if card in name), None)
    if card is None or C.dtype != "bfloat16":
        return 0.0, f"no MFU: no bf16 datasheet peak for {name} {C.dtype} (pass --peak_flops)"
    return DATASHEET[card], f"{card} datasheet bf16 peak"


@torch.no_grad()
def estimate_loss(model, C, data_dir, bin_dtype):
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
            with autocast(C.device, C.dtype):
                losses.append(model(x, y, loops=C.mean_loops, generator=g_noise)[1].item())
        out[split] = sum(losses) / len(losses)
    model.train()
    return out


def setup_ddp(C):
    """-> (rank, world size). Under torchrun each rank takes its share of the accumulation."""
    if int(os.environ.get("RANK", -1)) == -1:
        return 0, 1
    dist.init_process_group(backend="nccl" if C.device.startswith("cuda") else "gloo")
    rank = dist.get_rank()
    world = dist.get_world_size()
    if C.device.startswith("cuda"):
        C.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(C.device)
    if C.gradient_accumulation_steps % world:
        die(f"gradient_accumulation_steps={C.gradient_accumulation_steps} must be divisible "
            f"by {world} ranks")
    C.gradient_accumulation_steps //= world
    return rank, world


def open_checkpoint(C, given, ckpt_path):
    """The checkpoint to resume (None from scratch). A resumed run keeps its model and dataset:
    a value the user gave that differs is an error naming both, never silently dropped."""
    if C.init_from == "scratch":
        if os.path.exists(ckpt_path) and not C.overwrite_checkpoint:
            step = read_checkpoint(ckpt_path)["iter_num"]
            die(f"{ckpt_path} holds a run at step {step}: continue it with --init_from=resume, "
                f"or replace it with --overwrite_checkpoint=True")
        return None
    ckpt = read_checkpoint(ckpt_path, C.device)
    saved = {k: ckpt["model_args"].get(k) for k in MODEL_KEYS} | {"dataset": ckpt["config"]["dataset"]}
    for key, value in saved.items():
        if key in given and getattr(C, key) != value:
            die(f"--{key}={getattr(C, key)}, but {ckpt_path} has {key}={value}: "
                f"a resumed run keeps it (drop --{key})")
        setattr(C, key, value)
    return ckpt


def restore(ckpt, model, optimizer, g_data, rank, world, ckpt_path):
    """Weights, optimizer and every random stream of the run being resumed."""
    model.load_state_dict(ckpt["model"])
    decay = [group["weight_decay"] for group in optimizer.param_groups]  # as configured now
    optimizer.load_state_dict(ckpt["optimizer"])
    for group, weight_decay in zip(optimizer.param_groups, decay):  # the run's settings, not the old
        group.update(weight_decay=weight_decay, betas=optimizer.defaults["betas"])
    rng = ckpt["rng"]
    if len(rng["data"]) != world:  # each rank continues its own streams
        die(f"{ckpt_path} was saved by {len(rng['data'])} rank(s); resume it with as many, not {world}")
    g_data.set_state(rng["data"][rank].cpu())  # RNG states live on the CPU
    torch.set_rng_state(rng["torch"][rank].cpu())
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"][rank].cpu())


def random_states(g_data, world):
    """Every rank's random streams, so that a resumed run continues each of them."""
    rng = {"data": [g_data.get_state()], "torch": [torch.get_rng_state()]}
    if torch.cuda.is_available():
        rng["cuda"] = [torch.cuda.get_rng_state()]
    for key, states in rng.items():
        if world > 1:
            gathered = [None] * world
            dist.all_gather_object(gathered, states[0].cpu())
            rng[key] = gathered
    return rng


def log_attention_dtypes(model, x, C, log):
    """The paper's mixed-dtype bug hid for a whole run: record what attention really sees,
    once, from one eager forward before anything is compiled."""
    with torch.no_grad(), autocast(C.device, C.dtype):
        model(x, loops=1, state_init="zero")
    seen = []
    for name, module in model.named_modules():
        if name.endswith("0.attn"):
            dtypes = [str(d).replace("torch.", "") for d in module.seen_dtypes]
            seen.append(f"{name.split('.')[0]} {dtypes}")
    log("attention input dtypes (q, k, v): " + ", ".join(seen))


def build(C, given, log):
    """Dataset, model, optimizer, data stream and the run's state, fresh or resumed."""
    ckpt_path = os.path.join(C.out_dir, "ckpt.pt")
    ckpt = open_checkpoint(C, given, ckpt_path)
    meta_path = os.path.join("data", C.dataset, "meta.json")
    if C.dataset == "shakespeare" and not os.path.isfile(meta_path):
        if C.rank == 0:  # the quick start is two commands: the default corpus prepares itself
            log(f"data/{C.dataset}/ is not prepared yet: running `python prepare.py` first")
            prepare.main([])
        if C.world > 1:
            dist.barrier()
    data_dir, meta = prepare.open_dataset(C.dataset, ckpt, ckpt_path)
    model_args = {k: getattr(C, k) for k in MODEL_KEYS} | {"vocab_size": meta["vocab_size"]}
    config = config_or_die(**model_args)
    check_memory(C, config, log)
    model = GPT(config).to(C.device)
    device_type = C.device.split(":")[0]
    betas = (C.beta1, C.beta2)
    optimizer = model.configure_optimizers(C.weight_decay, C.learning_rate, betas, device_type)
    g_data = torch.Generator().manual_seed(C.seed + 1000 + C.rank)
    state = {"iter": 0, "best_val": float("inf"), "run_id": secrets.token_hex(8), "skipped": [],
             "consecutive": 0}
    if ckpt is not None:
        restore(ckpt, model, optimizer, g_data, C.rank, C.world, ckpt_path)
        state.update(iter=ckpt["iter_num"], best_val=ckpt["best_val_loss"],
                     run_id=ckpt["config"].get("run_id", state["run_id"]))
    return model, optimizer, g_data, data_dir, meta, model_args, state


def evaluate_and_save(model, optimizer, C, state, data_dir, meta, model_args, g_data, log):
    """Train/val loss at mean_loops; a checkpoint only if the weights are finite (a diverged
    model never replaces the last good one). Every rank takes part in gathering the streams."""
    losses = estimate_loss(model, C, data_dir, meta["dtype"])
    bits = losses["val"] * meta.get("val_tokens", 0) / meta.get("val_bytes", 1) / math.log(2)
    log(f"step {state['iter']}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}, "
        f"val {bits:.4f} bits/byte (loops={C.mean_loops})")
    finite = all(p.isfinite().all() for p in model.parameters())
    if not finite or not math.isfinite(losses["val"]):
        log(f"step {state['iter']}: non-finite val loss or weights, not saved (the last checkpoint stays)")
    elif losses["val"] < state["best_val"] or C.always_save_checkpoint:
        state["best_val"] = min(state["best_val"], losses["val"])
        rng = random_states(g_data, C.world)
        if state["iter"] > 0 and C.rank == 0:
            settings = {k: getattr(C, k) for k in RULES}  # not the run's objects (C.wandb)
            config = settings | {"dataset_meta": meta, "run_id": state["run_id"]}
            ckpt = {"format": CKPT_FORMAT, "model_args": model_args, "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(), "iter_num": state["iter"],
                    "best_val_loss": state["best_val"], "config": config, "rng": rng}
            save_checkpoint(ckpt, os.path.join(C.out_dir, "ckpt.pt"))
            log(f"saved checkpoint to {C.out_dir}/ckpt.pt")
    return losses


def main(argv=()):
    """Run training; returns the list of (iter, loops, loss) for every optimizer step taken."""
    C, given = configure(globals(), RULES, list(argv))
    check_device(C.device)
    wandb = None
    if C.wandb_log:
        try:
            import wandb
        except ImportError:
            die("--wandb_log=True needs the optional package wandb: pip install wandb")
    C.rank, C.world = setup_ddp(C)
    log = print if C.rank == 0 else (lambda *a: None)
    torch.manual_seed(C.seed + C.rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if os.path.exists(C.out_dir) and not os.path.isdir(C.out_dir):
        die(f"--out_dir={C.out_dir} is a file")
    os.makedirs(C.out_dir, exist_ok=True)
    if not os.access(C.out_dir, os.W_OK):  # fail now, not at the first save
        die(f"--out_dir={C.out_dir} is not writable")
    model, optimizer, g_data, data_dir, meta, model_args, state = build(C, given, log)
    log(f"model: {model.get_num_params() / 1e6:.2f}M unique non-embedding params, "
        f"{model.get_num_params(False) / 1e6:.2f}M total; loops {C.loop_dist} mean {C.mean_loops} "
        f"max {C.max_loops}, bptt_k {C.bptt_k}; {C.device} {C.dtype}")
    x, _ = get_batch(os.path.join(data_dir, "train.bin"), meta["dtype"], 1, C.block_size,
                     torch.Generator(), C.device)
    log_attention_dtypes(model, x, C, log)
    if C.compile:  # per part, so the python loop over a varying depth never recompiles
        log(f"compiling prelude, core and coda ({C.compile_backend})")
        for part in (model.prelude_blocks, model.core, model.coda_blocks):
            part.compile(backend=C.compile_backend)
    if wandb is not None and C.rank == 0:
        wandb.init(project=C.wandb_project, name=C.wandb_run_name, config={k: getattr(C, k) for k in RULES})
    C.wandb = wandb
    C.peak, ceiling = mfu_ceiling(C)
    log(f"MFU against {C.peak:.3g} FLOP/s ({ceiling})" if C.peak else ceiling)
    history = []
    while state["iter"] < C.max_iters:
        if state["iter"] % C.eval_interval == 0:
            losses = evaluate_and_save(model, optimizer, C, state, data_dir, meta, model_args, g_data, log)
            if wandb is not None and C.rank == 0:
                wandb.log({"iter": state["iter"], "train/loss": losses["train"], "val/loss": losses["val"],
                           "lr": get_lr(state["iter"], C)})
        history.append(train_step(model, optimizer, C, state, data_dir, meta, g_data, log))
    evaluate_and_save(model, optimizer, C, state, data_dir, meta, model_args, g_data, log)
    if C.world > 1:
        dist.destroy_process_group()
    return history


def train_step(model, optimizer, C, state, data_dir, meta, g_data, log):
    """One optimizer step at this step's depth, over gradient_accumulation_steps micro-steps.
    -> (iter, loops, loss)."""
    t0 = time.perf_counter()
    it = state["iter"]
    lr = get_lr(it, C)
    for group in optimizer.param_groups:
        group["lr"] = lr
    loops = sample_loops(it, C.seed, C.mean_loops, C.max_loops, C.loop_dist)
    loss_sum = torch.zeros((), device=C.device)
    for _ in range(C.gradient_accumulation_steps):
        x, y = get_batch(os.path.join(data_dir, "train.bin"), meta["dtype"], C.batch_size,
                         C.block_size, g_data, C.device)
        with autocast(C.device, C.dtype):
            loss = model(x, y, loops=loops)[1] / C.gradient_accumulation_steps
        loss.backward()
        loss_sum += loss.detach()
    if C.world > 1:  # one all-reduce per step, of the summed gradients of every micro-step
        for p in model.parameters():
            dist.all_reduce(p.grad)  # gloo has no AVG: sum, then divide
            p.grad /= C.world
    clip = C.grad_clip if C.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    finite = torch.isfinite(loss_sum + grad_norm).float()
    if C.world > 1:  # every rank takes the same decision
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    if finite.item():
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state["consecutive"] = nonfinite_guard(bool(finite.item()), it, state["skipped"],
                                           state["consecutive"], C.guard_grace_iters, log)
    if it % C.log_interval == 0:
        dt = time.perf_counter() - t0
        tokens = C.gradient_accumulation_steps * C.world * C.batch_size * C.block_size
        flops = model.flops_per_token(loops, min(loops, C.bptt_k), C.block_size) * tokens
        mfu = f", mfu {100 * flops / dt / C.peak / C.world:.1f}%" if C.peak else ""
        log(f"iter {it}: loss {loss_sum.item():.4f}, loops {loops:2d}, lr {lr:.2e}, "
            f"{1000 * dt:.0f} ms/iter, {tokens / dt:,.0f} tok/s{mfu}")
        if C.wandb is not None and C.rank == 0:
            C.wandb.log({"iter": it, "train/step_loss": loss_sum.item(), "loops": loops,
                         "tok_per_s": tokens / dt})
    state["iter"] += 1
    return it, loops, loss_sum.item()


if __name__ == "__main__":
    run(main)
