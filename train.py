"""Train a depth-recurrent transformer with randomized depth and truncated backprop.

    python prepare.py && python train.py   # the CPU default: Shakespeare, ~11 min on 2 cores
    python train.py config/s0.py           # a config file, then --key=value, override the settings
    torchrun --standalone --nproc_per_node=8 train.py config/s1.py
    python train.py --init_from=out-a/ckpt.pt --dataset=mine --out_dir=out-b  # fine-tune out-a

Each step draws its depth r (model.sample_loops), the same on every rank, and runs r - bptt_k
loops without gradients, then bptt_k with them. Writes out_dir/ckpt.pt and out_dir/metrics.jsonl."""
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import prepare
from configurator import UserError, configure, hold_lock, run
from model import (CKPT_FORMAT, DEVICES, GPT, MAX_LOOPS, GPTConfig, autocast, load_checkpoint,
                   sample_loops, save_atomic)

# I/O
out_dir = "out-shakespeare"  # ckpt.pt and metrics.jsonl are written here
eval_interval = 100  # steps between evaluations and saves
log_interval = 10  # steps between log lines
eval_iters = 10  # batches per evaluation
init_from = "scratch"  # 'scratch', 'resume' (out_dir/ckpt.pt), or a ckpt.pt to fine-tune
overwrite_checkpoint = False  # let a scratch run replace ckpt.pt and metrics.jsonl
# data
dataset = "shakespeare"  # data/<dataset>/ from prepare.py
gradient_accumulation_steps = 1  # micro-steps per step, over all ranks
batch_size = 8  # sequences per micro-step
block_size = 512  # tokens per sequence
# model (its vocab_size is the dataset's)
n_embd = 192  # model width
n_head = 3  # attention heads
n_kv_head = 1  # key/value heads (grouped-query attention)
ffn_hidden = 512  # SwiGLU hidden width
n_prelude = 1  # unique blocks before the core
n_core = 1  # blocks in the weight-tied core
n_coda = 1  # unique blocks after the core
state_std = math.sqrt(2 / 5)  # std of the noise initial state
# the loop distribution (model.sample_loops)
mean_loops = 8  # median of the loop distribution
loop_spread = 0.5  # sigma of the LogNormal over loops (the paper's 0.5)
max_loops = 32  # loops are clamped to this
loop_dist = "lognormal"  # 'lognormal' (randomized) or 'fixed' (mean_loops)
bptt_k = 8  # loops that get gradients (the last ones)
# optimizer
learning_rate = 2e-3  # peak learning rate
max_iters = 400  # optimizer steps (a resumed run: up to this step)
lr_decay_iters = 0  # cosine decay length; 0: max_iters
warmup_iters = -1  # linear warm-up steps; -1: 1% of lr_decay_iters
min_lr = 2e-4  # learning rate at the end of the decay
weight_decay = 0.1  # AdamW weight decay on matrices
beta1 = 0.9  # AdamW beta1
beta2 = 0.95  # AdamW beta2
grad_clip = 1.0  # gradient norm clip; 0: none
guard_grace_iters = 100  # steps before the 0.1% budget of skipped steps applies
# system
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu, cuda or cuda:N
dtype = "bfloat16" if torch.cuda.is_available() else "float32"  # autocast dtype
compile = torch.cuda.is_available()  # torch.compile each part
seed = 1337  # seeds the depths, data order and noise

# the choices, and the bounds a default's type does not say (at beta 1, AdamW divides by zero)
RULES = {"loop_dist": ("lognormal", "fixed"), "dtype": ("float32", "bfloat16"),
         "device": DEVICES, "beta1": (0, 0.9999), "beta2": (0, 0.9999),
         "warmup_iters": (-1, math.inf), "seed": (0, 2**32 - 1)}
# n_prelude, n_coda and state_std may be 0
RULES |= dict.fromkeys(["max_iters", "eval_interval", "log_interval", "eval_iters",
                        "gradient_accumulation_steps", "batch_size", "block_size", "n_embd",
                        "n_head", "n_kv_head", "ffn_hidden", "n_core"], (1, math.inf))
RULES |= dict.fromkeys(["mean_loops", "max_loops", "bptt_k"], (1, MAX_LOOPS))
# the model's shape and loop distribution (its vocab_size is the dataset's)
MODEL_KEYS = [name for name in GPTConfig.__dataclass_fields__ if name in globals()]


def get_lr(it, C):
    """Linear warm-up (-1: over 1% of the decay), a cosine decay to min_lr at lr_decay_iters."""
    decay_iters = C.lr_decay_iters or C.max_iters
    warmup = C.warmup_iters
    if warmup < 0:
        warmup = max(1, round(0.01 * decay_iters))
    if it < warmup:
        return C.learning_rate * (it + 1) / warmup
    progress = min(1.0, (it - warmup) / max(1, decay_iters - warmup))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return C.min_lr + cosine * (C.learning_rate - C.min_lr)


def get_batch(path, meta, shape, generator, device):
    """Random windows of a token file: x and y (batch_size, block_size) = shape, y shifted by
    one (the file opened for each batch: a memmap kept open leaks memory)."""
    data = np.memmap(path, dtype=meta["dtype"], mode="r")
    batch_size, block_size = shape
    if len(data) < block_size + 2:
        raise UserError(f"{path} has {len(data)} tokens, fewer than block_size + 2")
    starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator)
    windows = [data[i:i + block_size + 1].astype(np.int64) for i in starts.tolist()]
    xy = torch.from_numpy(np.stack(windows))
    # pinned: the copy to a GPU runs beside its work
    if "cuda" in device:
        xy = xy.pin_memory()
    xy = xy.to(device, non_blocking=True)
    return xy[:, :-1], xy[:, 1:]


def train_step(model, optimizer, batches, loops, generator, C, world=1):
    """One optimizer step on this rank's micro-batches [(x, y)] at depth `loops` (initial states
    drawn with generator), averaged over them and `world` ranks -> (mean loss, stepped or not)."""
    loss_sum = 0.0
    # each micro-batch's loss over their number: the gradients add up to the step's mean loss's
    for x, y in batches:
        with autocast(x.device.type, C.dtype):
            loss = model(x, y, loops=loops, generator=generator) / len(batches)
        loss.backward()
        loss_sum += loss.detach()
    # the ranks' gradients summed, then divided: gloo has no average
    if world > 1:
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), C.grad_clip or math.inf)
    finite = torch.isfinite(loss_sum + grad_norm).float()
    # one rank's overflow skips the step on every rank, or their weights would part
    if world > 1:
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    stepped = bool(finite.item())
    if stepped:
        optimizer.step()
    optimizer.zero_grad()
    return float(loss_sum), stepped


def check_skips(skipped, it, grace):
    """UserError once the skipped steps (the last one `it`) say the run is lost: the paper aborts
    "if skips exceed 0.1 percent of steps or three consecutive occurrences", here 0.1% of the steps
    so far from step `grace` on, so that a burst stops the run when it comes."""
    if skipped[-3:] == [it - 2, it - 1, it]:
        raise UserError(f"iter {it}: 3 consecutive non-finite steps")
    steps_so_far = it + 1
    if it >= grace and 1000 * len(skipped) > steps_so_far:
        raise UserError(f"iter {it}: {len(skipped)} non-finite steps exceed 0.1% of {steps_so_far}")


@torch.no_grad()
def estimate_loss(model, data_dir, meta, shape, C, device):
    """{split: mean loss at mean_loops}, on the same batches and noise at every evaluation."""
    losses = {}
    for split in ("train", "val"):
        g_batch = torch.Generator().manual_seed(C.seed + 1)
        g_noise = torch.Generator(device=device).manual_seed(C.seed + 2)
        total = 0.0
        for _ in range(C.eval_iters):
            x, y = get_batch(f"{data_dir}/{split}.bin", meta, shape, g_batch, device)
            with autocast(device, C.dtype):
                loss = model(x, y, loops=model.config.mean_loops, generator=g_noise)
            total += loss.item()
        losses[split] = total / C.eval_iters
    return losses


def start_processes(C):
    """torchrun's ranks, or one process -> (rank, world size, this rank's device)."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if C.gradient_accumulation_steps % world:
        raise UserError(f"gradient_accumulation_steps must be a multiple of the {world} ranks")
    device = C.device
    if world > 1:
        dist.init_process_group(backend="nccl" if "cuda" in device else "gloo")
    if world > 1 and "cuda" in device:
        device = f"cuda:{os.environ['LOCAL_RANK']}"
        torch.cuda.set_device(device)
    # rank 0 speaks for all; float32 matmuls in TF32, as nanoGPT does
    if rank > 0:
        sys.stdout = open(os.devnull, "w")
    if "cuda" in device:
        torch.backends.cuda.matmul.allow_tf32 = True
    return rank, world, device


def open_checkpoint(C, given, ckpt_path, metrics_path):
    """The checkpoint a run starts from -> (its model or None, its dict or None, the settings it
    fixes): a resumed run's model and dataset, a fine-tuned one's model. A new run never replaces
    a checkpoint or a log unasked."""
    if C.init_from == "scratch":
        model = source = None
        fixed = {}
    elif C.init_from == "resume":
        model, source = load_checkpoint(ckpt_path)
        # one made from another format (hf/) has no optimizer to go on with
        if not source.get("optimizer"):
            raise UserError(f"{ckpt_path} has no optimizer state: fine-tune from it "
                            f"(--init_from={ckpt_path} --out_dir=NEW), not resume")
        fixed = source["model_args"] | {"dataset": source["config"]["dataset"]}
        if C.max_iters <= source["iter_num"]:
            raise UserError(f"{ckpt_path} is at step {source['iter_num']}: "
                            f"--max_iters={C.max_iters} trains nothing")
    else:
        model, source = load_checkpoint(C.init_from)
        fixed = source["model_args"]
    for path in (ckpt_path, metrics_path):
        # an empty log is a run's that failed before its first line
        in_use = os.path.exists(path) and os.path.getsize(path) > 0
        if C.init_from != "resume" and in_use and not C.overwrite_checkpoint:
            raise UserError(f"{path} exists: --init_from=resume to go on, "
                            f"or --overwrite_checkpoint=True to replace it")
    # another model or dataset than the checkpoint's: refused, never ignored
    for key in sorted(given & fixed.keys()):
        asked = getattr(C, key)
        if asked != fixed[key]:
            raise UserError(f"--{key}={asked}, but {C.init_from} has {key}={fixed[key]}")
    return model, source, fixed


def restore(ckpt, optimizer):
    """A resumed run's AdamW moments, under today's hyperparameters, as its config will say."""
    state = ckpt["optimizer"]
    state["param_groups"] = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict(state)


def step_generators(seed, step, rank, device):
    """-> generators of one rank's batches and noise at a step, from (seed, step, rank) alone: a
    resumed run draws what an uninterrupted one does, and no generator's state is saved."""
    stream = (seed * 1_000_003 + step) * 1024 + rank
    data = torch.Generator().manual_seed(2 * stream)
    noise = torch.Generator(device).manual_seed(2 * stream + 1)
    return data, noise


def main(argv=()):
    """-> [(iter, loops, loss)] of every step, the skipped ones too."""
    C, given = configure(globals(), argv)
    if C.learning_rate == 0 and C.min_lr == 0:
        raise UserError("--learning_rate=0 and --min_lr=0: no step would change the weights")
    # 1) the processes: torchrun's ranks share each step's micro-batches, rank 0 speaks and saves
    rank, world, device = start_processes(C)
    micro_steps = C.gradient_accumulation_steps // world
    # 2) the checkpoint the run starts from, if any, and its dataset, checked before any work
    ckpt_path = f"{C.out_dir}/ckpt.pt"
    metrics_path = f"{C.out_dir}/metrics.jsonl"
    model, source, fixed = open_checkpoint(C, given, ckpt_path, metrics_path)
    resuming = C.init_from == "resume"
    settings = vars(C) | fixed
    # out_dir must take our files (found now, not at the first save), from one run at a time
    os.makedirs(C.out_dir, exist_ok=True)
    if rank == 0:
        busy = f"another train.py is writing {C.out_dir} now: wait, or use another --out_dir"
        lock = hold_lock(f"{C.out_dir}/.lock", busy)
    # a resumed run reads its very dataset; a fine-tuned model, another with its tokenizer
    same = None if resuming else ("vocab_size", "tokenizer_sha256")
    source_path = ckpt_path if resuming else C.init_from
    data_dir, meta = prepare.open_dataset(settings["dataset"], source, source_path, same=same)
    # 3) the model (from scratch: the seed's, rank 0's for every rank) and its optimizer
    if model is None:
        shape = {key: getattr(C, key) for key in MODEL_KEYS}
        torch.manual_seed(C.seed)
        model = GPT(GPTConfig(vocab_size=meta["vocab_size"], **shape))
    config = model.config
    model.to(device).train()
    # each part compiled on its own: a new depth never recompiles (grad_loops: a graph per count)
    if C.compile:
        print("compiling prelude, core and readout")
        model.core.compile()
        model.prelude = torch.compile(model.prelude)
        model.readout = torch.compile(model.readout)
        model.grad_loops = torch.compile(model.grad_loops)
    optimizer = model.configure_optimizers(C.weight_decay, C.learning_rate, (C.beta1, C.beta2),
                                           device)
    # every rank starts from rank 0's weights; past the barrier all passed the checks above
    if world > 1:
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
        dist.barrier()
    # 4) the log (rank 0's; a resumed run appends) and the run's name in its checkpoints, new at
    # every start: two copies resumed from one checkpoint are two runs
    metrics = open(metrics_path if rank == 0 else os.devnull, "a" if resuming else "w", buffering=1)
    start = 0
    if resuming:
        restore(source, optimizer)
        start = source["iter_num"]
    settings |= {"dataset_meta": meta, "run_id": os.urandom(8).hex()}
    shape = (C.batch_size, config.block_size)
    # 5) train, evaluating every eval_interval steps and at the end
    history = []
    skipped = []
    end = C.max_iters
    for it in range(start, end + 1):
        # evaluate; save if the val loss, which every weight feeds, is finite
        if it % C.eval_interval == 0 or it == end:
            losses = estimate_loss(model, data_dir, meta, shape, C, device)
            val = losses["val"]
            bits = prepare.bits_per_byte(val, meta)
            print(f"step {it}: train loss {losses['train']:.4f}, val loss {val:.4f}, "
                  f"val {bits:.4f} bits/byte")
            figures = {"iter": it, "train_loss": losses["train"], "val_loss": val,
                       "val_bits_per_byte": bits}
            print(json.dumps(figures), file=metrics)
            if not math.isfinite(val):
                print(f"step {it}: non-finite val loss or weights, not saved")
            elif it > start and rank == 0:
                save_atomic(ckpt_path, {"format": CKPT_FORMAT, "model_args": vars(config),
                                        "config": settings, "model": model.state_dict(),
                                        "optimizer": optimizer.state_dict(), "iter_num": it})
                print(f"saved checkpoint to {ckpt_path}")
        if it == end:
            break
        # one optimizer step at the depth drawn for it, on this rank's micro-batches
        t0 = time.perf_counter()
        lr = get_lr(it, C)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loops = sample_loops(config, it, C.seed)
        g_data, g_noise = step_generators(C.seed, it, rank, device)
        path = f"{data_dir}/train.bin"
        batches = [get_batch(path, meta, shape, g_data, device) for _ in range(micro_steps)]
        loss, stepped = train_step(model, optimizer, batches, loops, g_noise, C, world)
        history.append((it, loops, loss))
        # bf16 overflows now and then: skip such a step, but not too often
        if not stepped:
            skipped.append(it)
            print(f"iter {it}: non-finite loss or grad norm, optimizer step skipped")
            check_skips(skipped, it, C.guard_grace_iters)
        if it % C.log_interval == 0:
            dt = time.perf_counter() - t0
            # this rank's FLOP/s (3x the forward where gradients flow), as for config/study_dense.py
            tokens = micro_steps * math.prod(shape)
            n_grad = min(loops, config.bptt_k)
            flops = model.flops_per_token(loops, n_grad, config.block_size) * tokens
            figures = {"iter": it, "loss": loss, "loops": loops, "lr": lr,
                       "flops_per_s": flops / dt}
            print(f"iter {it}: loss {loss:.4f}, loops {loops:2d}, {1000 * dt:.0f} ms, "
                  f"{flops / dt:.3g} FLOP/s")
            print(json.dumps(figures), file=metrics)
    metrics.close()
    if rank == 0:
        lock.close()
    # together: a rank that left early aborted gloo
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return history


if __name__ == "__main__":
    run(main)
