"""A depth-recurrent transformer: prelude -> weight-tied core applied r times -> coda.

    e   = prelude(idx)                      unique blocks, computed once
    s_0 ~ N(0, state_std) (or zeros)        the state, not initialised from e
    s_i = core(adapter([e, s_{i-1}]))       input re-injection, Linear(2d -> d)
    p   = softmax(head(norm(coda(s_r))))    unique blocks, tied embedding head

Llama-style blocks; the core's add sandwich norms, so that the state neither
collapses nor blows up over many loops.
"""
import json
import math
import os
import pickle
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from configurator import die

CKPT_FORMAT = "nanoloop-1"  # marks the checkpoints train.py writes
LOGITS_CHUNK = 2 ** 27  # logits per loss chunk: 512 MB in float32
CKPT_KEYS = {"model_args": dict, "model": dict, "optimizer": dict, "iter_num": int,
             "best_val_loss": float, "config": dict, "rng": dict}  # what train.py saves
MIN_EXIT_LOOP = 2  # an exit compares two loops: none before loop 2
R_MAX_PER_MEAN = 2  # unless told, exits stop by loop 2 x mean_loops


@dataclass
class GPTConfig:
    vocab_size: int = 49152
    block_size: int = 512
    n_embd: int = 384
    n_head: int = 6
    n_kv_head: int = 2
    ffn_hidden: int = 1024
    n_prelude: int = 2
    n_core: int = 4
    n_coda: int = 2
    mean_loops: int = 4
    max_loops: int = 16
    bptt_k: int = 4
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    state_std: float = math.sqrt(2 / 5)

    def __post_init__(self):
        """Rules for any model, from a script or a checkpoint: ValueError."""
        zero_ok = ("n_prelude", "n_core", "n_coda", "state_std")  # bench's dense twin
        for f in fields(self):
            v = getattr(self, f.name)
            ok = isinstance(v, f.type) and not isinstance(v, bool) and math.isfinite(v)
            if not ok or v < 0 or (v == 0 and f.name not in zero_ok):
                raise ValueError(f"{f.name}={v!r}: must be a positive {f.type.__name__}")
        if self.n_embd % self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} must divide n_embd={self.n_embd}, "
                             f"n_kv_head={self.n_kv_head} must divide n_head")
        head = self.n_embd // self.n_head
        if head % 2:  # RoPE rotates pairs of channels
            raise ValueError(f"the head size n_embd / n_head = {head} must be even")
        if self.mean_loops > self.max_loops:
            raise ValueError(f"mean_loops={self.mean_loops} > max_loops={self.max_loops}")


def config_or_die(**args):
    """GPTConfig(**args), or the rule it breaks as one line and exit 2."""
    try:
        return GPTConfig(**args)
    except ValueError as err:
        die(str(err))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # float32: bf16 is too coarse for a mean of squares
        return F.rms_norm(x.float(), (x.size(-1),), self.weight.float(), self.eps).type_as(x)


class KVCache:
    """One layer's keys and values. Query row b uses slot rows[b]: rows is None
    (slot b), a slice (read without a copy) or a tensor of slot indices."""

    def __init__(self, slots, n_kv_head, length, head_dim, device, dtype):
        self.k = torch.zeros(slots, n_kv_head, length, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    def write(self, k, v, pos, rows=None):  # k, v: (B, n_kv, Tq, hd); pos: (B, Tq)
        if pos is None:  # positions 0..Tq-1
            pos = torch.arange(k.size(2), device=k.device).expand(len(k), -1)
        if not torch.is_tensor(rows):  # None: slots 0..B-1; a slice: its B slots
            rows = torch.arange(k.size(0), device=k.device) + (rows.start if rows else 0)
        self.k[rows[:, None], :, pos] = k.transpose(1, 2).to(self.k.dtype)
        self.v[rows[:, None], :, pos] = v.transpose(1, 2).to(self.v.dtype)


def apply_rope(x, cos, sin):
    # x's dtype: an fp32 table silently promoted bf16 q and k (the paper's notes)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = hd = cfg.n_embd // cfg.n_head
        self.wq = nn.Linear(cfg.n_embd, cfg.n_head * hd, bias=False)
        self.wk = nn.Linear(cfg.n_embd, cfg.n_kv_head * hd, bias=False)
        self.wv = nn.Linear(cfg.n_embd, cfg.n_kv_head * hd, bias=False)
        self.wo = nn.Linear(cfg.n_head * hd, cfg.n_embd, bias=False)
        self.seen_dtypes = None  # (q, k, v) dtypes, logged by train.py

    def forward(self, x, cos, sin, cache=None, pos=None, rows=None):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if not torch.compiler.is_compiling():  # no side effect in a graph
            self.seen_dtypes = (q.dtype, k.dtype, v.dtype)
        if cache is not None:
            cache.write(k, v, pos, rows)
        if pos is None:  # a causal window: training, a prefill
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:  # queries at any positions, keys from their slots
            n_keys = int(pos.max()) + 1  # keys 0..n_keys-1 of the rows' slots
            k, v = cache.k[:, :, :n_keys], cache.v[:, :, :n_keys]  # views
            if torch.is_tensor(rows):  # 5-10x faster than k[rows] on a CPU
                k, v = k.index_select(0, rows), v.index_select(0, rows)
            k, v = (k[rows], v[rows]) if isinstance(rows, slice) else (k, v)
            mask = torch.arange(n_keys, device=x.device) <= pos[:, None, :, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):  # SwiGLU
    def __init__(self, cfg):
        super().__init__()
        self.w_gate = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.w_up = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.w_down = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg, sandwich):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn, self.mlp = Attention(cfg), MLP(cfg)
        post = (lambda: RMSNorm(cfg.n_embd, cfg.norm_eps)) if sandwich else nn.Identity
        self.attn_post, self.mlp_post = post(), post()

    def forward(self, x, cos, sin, cache=None, pos=None, rows=None):
        x = x + self.attn_post(self.attn(self.attn_norm(x), cos, sin, cache, pos, rows))
        return x + self.mlp_post(self.mlp(self.mlp_norm(x)))


class Stack(nn.Module):
    """Blocks, a module so that train.py can torch.compile each part once."""

    def __init__(self, cfg, n, sandwich=False):
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg, sandwich) for _ in range(n))

    def forward(self, x, cos, sin, caches=None, pos=None, rows=None):
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, None if caches is None else caches[i], pos, rows)
        return x


class Core(Stack):
    def __init__(self, cfg):
        super().__init__(cfg, cfg.n_core, sandwich=True)
        self.adapter = nn.Linear(2 * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, e, s, cos, sin, caches=None, pos=None, rows=None):
        # the stream stays float32 under autocast (bf16 matmuls): the
        # convergence tail (KL ~1e-5) is below bf16's resolution; one dtype, one graph
        x = self.adapter(torch.cat([e, s], dim=-1)).to(e.dtype)
        return super().forward(x, cos, sin, caches, pos, rows)


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = c = config
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.prelude_blocks = Stack(c, c.n_prelude)
        self.core = Core(c)
        self.coda_blocks = Stack(c, c.n_coda)
        self.norm = RMSNorm(c.n_embd, c.norm_eps)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied input/output embeddings
        hd = c.n_embd // c.n_head
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, hd, 2).float() / hd)
        angles = torch.outer(torch.arange(c.block_size).float(), inv_freq)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        # wo, w_down shrink with the depth at mean_loops: no variance growth
        std = math.sqrt(2 / (5 * c.n_embd))
        depth = c.n_prelude + c.n_coda + c.n_core * c.mean_loops
        scale = 1 / math.sqrt(2 * depth)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                out = name.endswith(("wo.weight", "w_down.weight"))
                nn.init.normal_(p, std=std * scale if out else std)

    def get_num_params(self, non_embedding=True):
        n = sum(p.numel() for p in self.parameters())  # the tied head once
        return n - self.wte.weight.numel() if non_embedding else n

    def rope(self, T, pos=None):
        if pos is None:  # positions 0..T-1 for every row
            return self.rope_cos[:T], self.rope_sin[:T]
        return self.rope_cos[pos][:, None], self.rope_sin[pos][:, None]  # (B, 1, Tq, hd/2)

    def prelude(self, idx, caches=None, pos=None, rows=None):
        """Token ids (B, T) -> e (B, T, d), computed once per sequence."""
        return self.prelude_blocks(self.wte(idx), *self.rope(idx.size(1), pos), caches, pos, rows)

    def init_state(self, e, mode="noise", generator=None):
        """s_0: N(0, state_std) (training) or zeros (reproducible exits)."""
        if mode == "zero":
            return torch.zeros_like(e)
        if mode != "noise":
            raise ValueError(f"state_init must be 'noise' or 'zero', got {mode!r}")
        noise = torch.randn(e.shape, generator=generator, device=e.device)
        return (noise * self.config.state_std).to(e.dtype)

    def core_step(self, e, s, caches=None, pos=None, rows=None):
        """One loop, for any tokens at positions pos (B, Tq) given caches."""
        return self.core(e, s, *self.rope(s.size(1), pos), caches, pos, rows)

    def readout(self, s, caches=None, pos=None, rows=None):
        """State -> logits (B, T, vocab): coda, final norm, tied head."""
        x = self.coda_blocks(s, *self.rope(s.size(1), pos), caches, pos, rows)
        return self.lm_head(self.norm(x))

    def new_caches(self, n_layers, slots, length, dtype=None):
        c, w = self.config, self.wte.weight  # K/V in attention's dtype
        auto = torch.is_autocast_enabled(w.device.type)
        dtype = dtype or (torch.get_autocast_dtype(w.device.type) if auto else w.dtype)
        args = (slots, c.n_kv_head, length, c.n_embd // c.n_head, w.device, dtype)
        return [KVCache(*args) for _ in range(n_layers)]

    def forward(self, idx, targets=None, loops=None, state_init="noise", generator=None):
        """Backprop through the last bptt_k loops -> (None, loss) or (logits, None)."""
        loops = self.config.mean_loops if loops is None else loops
        e = self.prelude(idx)
        s = self.init_state(e, state_init, generator)
        n_grad = min(loops, self.config.bptt_k)
        with torch.no_grad():
            for _ in range(loops - n_grad):
                s = self.core_step(e, s)
        for _ in range(n_grad):
            s = self.core_step(e, s)
        if targets is None:
            return self.readout(s), None
        x = self.norm(self.coda_blocks(s, *self.rope(s.size(1))))
        return None, self.chunked_loss(x.flatten(0, 1), targets.flatten())

    def chunked_loss(self, x, targets):
        """Mean cross-entropy of x (N, d) by chunks, each recomputed in backward."""
        def loss_sum(x, y):  # a float32 softmax under any autocast
            return F.cross_entropy(self.lm_head(x).float(), y, ignore_index=-1, reduction="sum")
        chunk = max(1, LOGITS_CHUNK // self.config.vocab_size)
        pairs = zip(x.split(chunk), targets.split(chunk))
        total = sum(checkpoint(loss_sum, xs, ys, use_reentrant=False) for xs, ys in pairs)
        return total / (targets != -1).sum().clamp_min(1)

    def flop_terms(self, T):
        """Forward FLOPs/token (prelude, loop, readout): 2 per weight, 4Td a layer."""
        def matmuls(module):
            return 2 * sum(p.numel() for p in module.parameters() if p.dim() == 2)
        c = self.config
        attn = 4 * T * c.n_embd
        prelude = matmuls(self.prelude_blocks) + attn * c.n_prelude  # wte: a lookup
        core = matmuls(self.core) + attn * c.n_core
        readout = matmuls(self.coda_blocks) + 2 * self.lm_head.weight.numel() + attn * c.n_coda
        return prelude, core, readout

    def flops_per_token(self, loops, n_grad, T):
        """Training FLOPs per token: 3x forward with gradients, 1x without."""
        prelude, core, readout = self.flop_terms(T)
        return 3 * (prelude + readout) + (3 * n_grad + loops - n_grad) * core

    def inference_flops(self, loops, T, criterion="none"):
        """Forward FLOPs per token of a policy (KL: a readout a loop)."""
        prelude, core, readout = self.flop_terms(T)
        c = self.config
        cost = {"kl": 8 * c.vocab_size, "state": 6 * c.n_embd, "probe": 4 * c.n_embd}
        readouts = loops if criterion == "kl" else 1
        return prelude + loops * core + readouts * readout + (loops - 1) * cost.get(criterion, 0)

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        matrices = [p for p in self.parameters() if p.dim() >= 2]  # not the gains
        gains = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": matrices, "weight_decay": weight_decay},
                  {"params": gains, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")


def exit_score(criterion, s_new, s_old, logits_new=None, logits_old=None):
    """Per token: 'kl' KL(p_i || p_{i-1}), 'state' ||s_i - s_{i-1}|| / ||s_i||."""
    if criterion == "kl":
        return token_kl(logits_new, logits_old)
    return state_change(s_new, s_old, relative=True)


def by_chunks(fn, logits, other):
    """fn(float32 rows of logits, rows of other): (..., V) -> (...), by chunks."""
    rows = max(1, LOGITS_CHUNK // logits.size(-1))
    mine = logits.reshape(-1, logits.size(-1)).split(rows)  # (V,) is one row
    theirs = other.reshape(-1, *other.shape[logits.dim() - 1:]).split(rows)
    return torch.cat([fn(a.float(), b) for a, b in zip(mine, theirs)]).view(logits.shape[:-1])


def token_kl(logits_p, logits_q):
    """Per-token KL(p || q) in float32; exactly 0 where p == q."""
    def kl(p, q):
        logq = F.log_softmax(q.float(), -1)
        return F.kl_div(logq, F.log_softmax(p, -1), log_target=True, reduction="none").sum(-1)
    return by_chunks(kl, logits_p, logits_q).clamp_min(0.0)


def token_loss(logits, y):
    """Per-token cross-entropy, shaped like y, in float32."""
    return by_chunks(lambda a, b: F.cross_entropy(a, b, reduction="none"), logits, y)


def state_change(s_new, s_old, relative=False):
    """Per-token ||s_new - s_old||, or over ||s_new|| (a nearly free exit test)."""
    delta = (s_new.float() - s_old.float()).norm(dim=-1)
    return delta / s_new.float().norm(dim=-1).clamp_min(1e-12) if relative else delta


def check_device(device):
    """One line and exit 2 for a device this machine lacks."""
    n_gpus = torch.cuda.device_count()
    if device not in ["cpu"] + ["cuda"] * (n_gpus > 0) + [f"cuda:{i}" for i in range(n_gpus)]:
        die(f"--device={device}: this machine has {n_gpus} CUDA GPU(s) (cpu, cuda or cuda:N)")


def autocast(device, dtype):
    """bf16 autocast for the matmuls, on CUDA or (for tests) the CPU."""
    return torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=dtype != "float32")


def training_memory(config, batch_size, dtype):
    """Peak bytes of a training micro-step by part, counted on fake tensors."""
    with FakeTensorMode():
        model = GPT(config)
        idx = torch.zeros(batch_size, config.block_size, dtype=torch.long)
        weights = {StorageWeakRef(p.untyped_storage()) for p in model.parameters()}
        saved = {}

        def pack(t):
            key = StorageWeakRef(t.untyped_storage())
            if key not in weights:
                saved[key] = t.untyped_storage().nbytes()
            return t
        with autocast("cpu", dtype), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(idx, idx, loops=min(config.bptt_k, config.max_loops))
    n = sum(p.numel() for p in model.parameters())
    logits = min(LOGITS_CHUNK, batch_size * config.block_size * config.vocab_size)
    parts = {"activations": sum(saved.values()), "weights": 4 * n, "gradients": 4 * n,
             "adamw": 8 * n, "logits": 2 * 4 * logits}
    return parts | {"total": sum(parts.values())}


def save_atomic(path, obj):
    """Whole or not at all (synced, then renamed); .pt by torch.save, else JSON."""
    with open(f"{path}.tmp", "wb") as f:
        if path.endswith(".pt"):
            torch.save(obj, f)
        else:
            f.write(json.dumps(obj, indent=2).encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(f"{path}.tmp", path)


def read_checkpoint(path, device="cpu", advice=""):
    """The checkpoint dict at path, or one line (ending with advice) and exit 2."""
    check_device(device)  # a missing GPU: the machine's fault, not the file's
    if not os.path.isfile(path):
        die(f"no checkpoint at {path} (train one with `python train.py`)")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as err:
        # never repeat torch's advice (weights_only=False runs the file's code)
        reason = (str(err).splitlines() or [type(err).__name__])[0]
        if "Weights only" in reason:
            reason = "it holds objects a safe load refuses"
        die(f"{path} ({os.path.getsize(path)} bytes) is not a readable checkpoint: {reason}{advice}")
    if not isinstance(ckpt, dict) or ckpt.get("format") != CKPT_FORMAT:
        die(f"{path} is not a nanoloop checkpoint (no format marker {CKPT_FORMAT!r}){advice}")
    for key, kind in CKPT_KEYS.items():
        if not isinstance(ckpt.get(key), kind):
            die(f"{path}: its {key!r} is missing or not a {kind.__name__}{advice}")
    return ckpt


def checkpoint_id(ckpt):
    """The run and step an output came from (a retrained run differs)."""
    return f"{ckpt['config'].get('run_id', 'unnamed')}@{ckpt['iter_num']}"


def load_checkpoint(path, device="cpu"):
    """-> (model in eval mode, checkpoint dict), or one line and exit 2."""
    ckpt = read_checkpoint(path, device)
    args = ckpt["model_args"]
    missing = sorted({f.name for f in fields(GPTConfig) if f.type is int} - args.keys())
    if missing:
        die(f"{path}: its model_args lack {', '.join(missing)}")
    names = {f.name for f in fields(GPTConfig)}
    try:
        model = GPT(GPTConfig(**{k: v for k, v in args.items() if k in names}))
    except (TypeError, ValueError) as err:
        die(f"{path}: its model_args are malformed: {err}")
    bad = [k for k, t in ckpt["model"].items() if t.is_floating_point() and not t.isfinite().all()]
    if bad:  # train.py never saves one, but an older run could have
        die(f"{path} has non-finite weights ({bad[0]}, {len(bad) - 1} more): its run diverged")
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as err:  # missing, unexpected or misshapen
        detail = str(err).splitlines()[1:2] or [str(err)]
        die(f"{path}: its weights do not fit its model_args: {detail[0].strip()}")
    return model.to(device).eval(), ckpt
