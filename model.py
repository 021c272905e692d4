"""
A depth-recurrent transformer: prelude -> weight-tied core applied r times -> coda.

    e   = prelude(idx)                       unique blocks, computed once
    s_0 ~ N(0, state_std) (or zeros)         the recurrent state, not initialised from e
    s_i = core(adapter([e, s_{i-1}]))        input re-injection through a Linear(2d -> d)
    p   = softmax(head(norm(coda(s_r))))     unique blocks, tied embedding head

Blocks are Llama-style: RMSNorm, SwiGLU, rotary embeddings, grouped-query attention, no
biases. Core blocks add sandwich norms (a post-norm inside each residual branch), which
keeps the state from collapsing or blowing up when the core is iterated many times.

The per-loop API (prelude / init_state / core_step / readout) is the only place the
recurrence exists: train.py uses forward(), while evaluate.py, allocate.py and sample.py
drive the loop themselves, read logits after any loop, freeze tokens, or run a subset of
tokens at given positions against a KV cache.
"""
import json
import math
import os
import pickle
import re
from contextlib import nullcontext
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from configurator import die

CKPT_FORMAT = "nanoloop-1"  # marks checkpoints written by this project's train.py
LOGITS_CHUNK = 2 ** 27  # logits per loss chunk: 512 MB in float32
CKPT_KEYS = {"model_args": dict, "model": dict, "optimizer": dict, "iter_num": int, "best_val_loss": float,
             "config": dict, "rng": dict}  # all train.py saves, and their types


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
        """The rules a model must keep, whoever builds it (a script, a checkpoint): ValueError."""
        may_be_zero = ("n_prelude", "n_core", "n_coda", "state_std")  # 0 cores: bench's dense twin
        for f in fields(self):
            value = getattr(self, f.name)
            number = isinstance(value, f.type) and not isinstance(value, bool)
            positive = value > 0 or (value == 0 and f.name in may_be_zero)
            if not number or not math.isfinite(value) or not positive:
                raise ValueError(f"{f.name}={value!r}: must be a positive {f.type.__name__}")
        if self.n_embd % self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} must divide n_embd={self.n_embd}, "
                             f"n_kv_head={self.n_kv_head} must divide n_head")
        if self.n_embd // self.n_head % 2:  # rotary embeddings rotate pairs of channels
            raise ValueError(f"the head size n_embd / n_head = {self.n_embd // self.n_head} must be even")
        if self.mean_loops > self.max_loops:
            raise ValueError(f"mean_loops={self.mean_loops} must be <= max_loops={self.max_loops}")


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

    def forward(self, x):
        # normalise in float32: bf16 has too few mantissa bits for a mean of squares
        return F.rms_norm(x.float(), (x.size(-1),), self.weight.float(), self.eps).type_as(x)


class KVCache:
    """Keys and values of one attention layer: `slots` rows of `length` positions, written in place.
    Query row b of a call reads and writes slot rows[b], where rows is None (slot b), a slice (a block
    of slots, read without a copy) or a tensor of slot indices. Callers decide what a slot is:
    allocate.py gives each window one slot that all loops share (every token's latest K/V), sample.py
    one slot per (loop, sequence). The model itself needs no notion of a cache policy."""

    def __init__(self, slots, n_kv_head, length, head_dim, device, dtype):
        self.k = torch.zeros(slots, n_kv_head, length, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    def write(self, k, v, pos, rows=None):  # k, v: (B, n_kv, Tq, hd); pos: (B, Tq) position of each query
        if rows is None:
            rows = slice(0, k.size(0))
        if isinstance(rows, slice):
            rows = torch.arange(rows.start, rows.stop, device=k.device)
        self.k[rows[:, None], :, pos] = k.transpose(1, 2).to(self.k.dtype)
        self.v[rows[:, None], :, pos] = v.transpose(1, 2).to(self.v.dtype)

    def read(self, n_keys, rows=None):
        """Keys and values at positions 0..n_keys-1 of the query rows' slots: (B, n_kv, n_keys, hd) each."""
        if rows is None:
            rows = slice(0, None)
        return self.k[rows, :, :n_keys], self.v[rows, :, :n_keys]


def apply_rope(x, cos, sin):
    # rotate the two halves of each head; cos/sin are cast to x's dtype so that under bf16
    # autocast q and k stay bf16 (an fp32 table silently promoted them, see the paper's notes)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.wq = nn.Linear(cfg.n_embd, cfg.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * self.head_dim, cfg.n_embd, bias=False)
        self.seen_dtypes = None  # (q, k, v) dtypes of the last eager call; train.py logs them once

    def forward(self, x, cos, sin, cache=None, pos=None, rows=None):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if not torch.compiler.is_compiling():  # an eager-only record, no side effect in a graph
            self.seen_dtypes = (q.dtype, k.dtype, v.dtype)
        if cache is None:  # the training path: a full causal window
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:  # queries at arbitrary positions against everything their slot holds before them
            cache.write(k, v, pos, rows)
            n_keys = int(pos.max()) + 1
            keys, values = cache.read(n_keys, rows)
            key_pos = torch.arange(n_keys, device=x.device)
            mask = key_pos[None, None, None, :] <= pos[:, None, :, None]
            y = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask,
                                               enable_gqa=True)
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
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps), RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn, self.mlp = Attention(cfg), MLP(cfg)
        post = (lambda: RMSNorm(cfg.n_embd, cfg.norm_eps)) if sandwich else nn.Identity
        self.attn_post, self.mlp_post = post(), post()

    def forward(self, x, cos, sin, cache=None, pos=None, rows=None):
        x = x + self.attn_post(self.attn(self.attn_norm(x), cos, sin, cache, pos, rows))
        return x + self.mlp_post(self.mlp(self.mlp_norm(x)))


class Stack(nn.Module):
    """A list of blocks; its own module so train.py can torch.compile each part once."""

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
        # the residual stream stays float32 under autocast (only the matmuls run in bf16): the state's
        # convergence tail (KL ~1e-5) lies below bf16's resolution, and one dtype means one graph
        x = self.adapter(torch.cat([e, s], dim=-1)).to(e.dtype)  # e: float32 (or the model's)
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
        head_dim = c.n_embd // c.n_head
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(c.block_size).float(), inv_freq)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        # small init (std sqrt(2/5d)); output projections shrink with the effective depth at
        # the training mean, so the residual stream's variance does not grow with the loops
        std = math.sqrt(2 / (5 * c.n_embd))
        depth = c.n_prelude + c.n_coda + c.n_core * c.mean_loops
        for name, p in self.named_parameters():
            if p.dim() == 2:
                scale = 1 / math.sqrt(2 * depth) if name.endswith(("wo.weight", "w_down.weight")) else 1.0
                nn.init.normal_(p, mean=0.0, std=std * scale)

    def get_num_params(self, non_embedding=True):
        n = sum(p.numel() for p in self.parameters())  # the tied head is counted once
        return n - self.wte.weight.numel() if non_embedding else n

    # ---- the per-loop API ------------------------------------------------------------
    def rope(self, T, pos=None):
        if pos is None:  # positions 0..T-1 for every row
            return self.rope_cos[:T], self.rope_sin[:T]
        return self.rope_cos[pos][:, None], self.rope_sin[pos][:, None]  # (B, 1, Tq, hd/2)

    def prelude(self, idx, caches=None, pos=None, rows=None):
        """Token ids (B, T) -> e (B, T, d), computed once per sequence."""
        return self.prelude_blocks(self.wte(idx), *self.rope(idx.size(1), pos), caches, pos, rows)

    def init_state(self, e, mode="noise", generator=None):
        """s_0: N(0, state_std) per element (the training path) or zeros (reproducible exits)."""
        if mode == "zero":
            return torch.zeros_like(e)
        if mode != "noise":
            raise ValueError(f"state_init must be 'noise' or 'zero', got {mode!r}")
        noise = torch.randn(e.shape, generator=generator, device=e.device, dtype=torch.float32)
        return (noise * self.config.state_std).to(e.dtype)

    def core_step(self, e, s, caches=None, pos=None, rows=None):
        """One loop, s -> core(adapter([e, s])). e and s may be any subset of tokens as long as `pos`
        (B, Tq) gives their positions and `caches` (one KVCache per core layer) holds, in the slots
        `rows` (B,), keys/values for everything they attend to."""
        return self.core(e, s, *self.rope(s.size(1), pos), caches, pos, rows)

    def readout(self, s, caches=None, pos=None, rows=None):
        """State -> logits (B, T, vocab) through the coda, final norm and tied head."""
        x = self.coda_blocks(s, *self.rope(s.size(1), pos), caches, pos, rows)
        return self.lm_head(self.norm(x))

    def new_caches(self, n_layers, slots, length, dtype=torch.float32):
        c = self.config
        head_dim = c.n_embd // c.n_head
        device = self.wte.weight.device
        return [KVCache(slots, c.n_kv_head, length, head_dim, device, dtype) for _ in range(n_layers)]

    def forward(self, idx, targets=None, loops=None, state_init="noise", generator=None):
        """Training/eval path: r loops, gradients only through the last bptt_k of them
        (truncated backprop bounds activation memory to bptt_k core passes). With targets:
        (None, loss); without: (logits, None)."""
        loops = self.config.mean_loops if loops is None else loops
        if loops < 1:
            raise ValueError(f"loops must be >= 1, got {loops}")
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
        """Mean cross-entropy of hidden states x (N, d) in float32, a chunk of tokens at a time,
        each chunk recomputed in backward: S1's (32k tokens x 49,152 classes) float32 logits
        would be 6.4 GB, and saved for backward again as the log-softmax."""
        chunk = max(1, LOGITS_CHUNK // self.config.vocab_size)
        total = x.new_zeros((), dtype=torch.float32)
        for xs, ys in zip(x.split(chunk), targets.split(chunk)):
            total = total + checkpoint(self.loss_sum, xs, ys, use_reentrant=False)
        return total / (targets != -1).sum().clamp_min(1)

    def loss_sum(self, x, targets):
        logits = self.lm_head(x).float()  # the softmax in float32 whatever the autocast dtype
        return F.cross_entropy(logits, targets, ignore_index=-1, reduction="sum")

    # ---- accounting and optimisation ---------------------------------------------------
    def flop_terms(self, T):
        """Forward FLOPs per token of (prelude, one core loop, one readout): 2 per weight used,
        plus attention scores 2*2*T*d per layer (PaLM's convention, the full T x T counted)."""
        c = self.config
        attn = 4 * T * c.n_embd

        def matmuls(module):
            return 2 * sum(p.numel() for p in module.parameters() if p.dim() == 2)
        prelude = matmuls(self.prelude_blocks) + attn * c.n_prelude  # the embedding is a lookup
        core = matmuls(self.core) + attn * c.n_core
        readout = matmuls(self.coda_blocks) + 2 * self.lm_head.weight.numel() + attn * c.n_coda
        return prelude, core, readout

    def flops_per_token(self, loops, n_grad, T):
        """Training FLOPs per token: 3x forward for what gets gradients (prelude, readout and the
        last n_grad loops), 1x for the no-grad loops."""
        prelude, core, readout = self.flop_terms(T)
        return 3 * (prelude + readout) + (3 * n_grad + loops - n_grad) * core

    def inference_flops(self, loops, readouts, T, tests=0, criterion="none"):
        """Forward FLOPs per token of a policy (all arguments per-token averages): the prelude,
        its loops and readouts, and its exit tests (a KL: ~8 per vocabulary entry for two
        log-softmaxes and the sum; a state change: 6 per dimension; the probe: 4 per dimension)."""
        prelude, core, readout = self.flop_terms(T)
        c = self.config
        test = {"kl": 8 * c.vocab_size, "state": 6 * c.n_embd, "probe": 4 * c.n_embd}.get(criterion, 0)
        return prelude + loops * core + readouts * readout + tests * test

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        # decay matrices only (projections, embedding); norms' gains are not decayed
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")


# ---- helpers the measuring scripts share ----------------------------------------------
# The convergence exits (allocate.py calibrates them, sample.py runs them) compare two loops, so no
# token stops before loop 2, and no policy runs deeper than r_max, twice the training mean unless told.
MIN_EXIT_LOOP = 2


def default_r_max(config):
    return 2 * config.mean_loops


def exit_score(criterion, s_new, s_old, logits_new=None, logits_old=None):
    """The convergence test after a loop, per token; a token stops once it falls below a threshold.
    'kl': KL(p_i || p_{i-1}) of the two loops' outputs; 'state': ||s_i - s_{i-1}|| / ||s_i||."""
    if criterion == "kl":
        return token_kl(logits_new, logits_old)
    return state_change(s_new, s_old, relative=True)


def by_chunks(fn, logits, other):
    """fn(float32 rows of logits, rows of other), LOGITS_CHUNK logits at a time: (..., V) ->
    (...). S1's (8, 2048, 49152) float32 logits are 3.2 GB a copy; a softmax holds several."""
    rows = max(1, LOGITS_CHUNK // logits.size(-1))
    mine = logits.flatten(0, -2).split(rows)
    theirs = other.flatten(0, logits.dim() - 2).split(rows)
    return torch.cat([fn(a.float(), b) for a, b in zip(mine, theirs)]).view(logits.shape[:-1])


def kl_rows(logp_logits, logq_logits):
    logp = F.log_softmax(logp_logits, -1)
    logq = F.log_softmax(logq_logits.float(), -1)
    return F.kl_div(logq, logp, log_target=True, reduction="none").sum(-1)


def token_kl(logits_p, logits_q):
    """Per-token KL(p || q) in float32 from log-softmax; exactly 0 where p == q."""
    return by_chunks(kl_rows, logits_p, logits_q).clamp_min(0.0)


def token_loss(logits, y):
    """Per-token cross-entropy, shaped like y, in float32 whatever the autocast dtype."""
    return by_chunks(lambda rows, targets: F.cross_entropy(rows, targets, reduction="none"), logits, y)


def state_change(s_new, s_old, relative=False):
    """Per-token ||s_new - s_old||, optionally divided by ||s_new|| (a nearly free exit test)."""
    delta = (s_new.float() - s_old.float()).norm(dim=-1)
    return delta / s_new.float().norm(dim=-1).clamp_min(1e-12) if relative else delta


# ---- devices, memory and files ------------------------------------------------------
def check_device(device):
    """One line and exit 2 for a device this machine lacks, before a checkpoint could be blamed."""
    if device != "cpu" and device != "cuda" and not re.fullmatch(r"cuda:\d+", device):
        die(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    index = int(device[5:] or 0) if device.startswith("cuda") else 0
    if device.startswith("cuda") and index >= torch.cuda.device_count():
        die(f"--device={device}: this machine has {torch.cuda.device_count()} CUDA GPU(s) (use --device=cpu)")


def autocast(device, dtype):
    """bf16 autocast for the matmuls, on CUDA or (the same casts, for tests) on the CPU."""
    if dtype == "float32":
        return nullcontext()
    return torch.autocast(device.split(":")[0], dtype=torch.bfloat16)


def training_memory(config, batch_size, dtype):
    """Bytes one training micro-step keeps at its peak, counted on fake tensors (no memory, no
    compute, the same autograd graph): what autograd saves for backward at the deepest bptt_k
    loops, plus float32 weights, gradients and AdamW's two moments, plus one loss chunk's logits
    (float32, with their gradient). SDPA saves O(T) per layer on the CPU as flash attention does
    on CUDA; the allocator's fragmentation and CUDA's workspaces come on top."""
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
    n_params = sum(p.numel() for p in model.parameters())
    logits = min(LOGITS_CHUNK, batch_size * config.block_size * config.vocab_size)
    parts = {"activations": sum(saved.values()), "weights": 4 * n_params, "gradients": 4 * n_params,
             "adamw": 8 * n_params, "logits": 2 * 4 * logits}
    return parts | {"total": sum(parts.values())}


def write_json(path, obj):
    """Whole or not at all: a temporary file renamed over the old one."""
    with open(f"{path}.tmp", "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(f"{path}.tmp", path)


def read_checkpoint(path, device="cpu"):
    """The checkpoint dict at path, or one line and exit 2 if missing, corrupt, foreign or incomplete."""
    check_device(device)  # a missing GPU is the machine's fault, not the checkpoint's
    if not os.path.isfile(path):
        die(f"no checkpoint at {path} (train one with `python train.py`)")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as err:
        # never repeat torch's advice to retry with weights_only=False: it runs a file's code
        reason = (str(err).splitlines() or [type(err).__name__])[0]
        if "Weights only" in reason:
            reason = "it holds objects a safe load refuses"
        die(f"{path} ({os.path.getsize(path)} bytes) is not a readable checkpoint: {reason}")
    if not isinstance(ckpt, dict) or ckpt.get("format") != CKPT_FORMAT:
        die(f"{path} is not a nanoloop checkpoint (missing format marker {CKPT_FORMAT!r})")
    for key, kind in CKPT_KEYS.items():
        if not isinstance(ckpt.get(key), kind):
            die(f"{path}: its {key!r} is missing or not a {kind.__name__}: a malformed checkpoint")
    return ckpt


def checkpoint_id(ckpt):
    """Names the checkpoint an output came from: its run and step (a retrained run differs)."""
    return f"{ckpt['config'].get('run_id', 'unnamed')}@{ckpt['iter_num']}"


def load_checkpoint(path, device="cpu"):
    """-> (model in eval mode, checkpoint dict); one line and exit 2 for malformed model_args or
    missing, misshapen or non-finite weights."""
    ckpt = read_checkpoint(path, device)
    names = {f.name for f in fields(GPTConfig)}
    missing = sorted({f.name for f in fields(GPTConfig) if f.type is int} - ckpt["model_args"].keys())
    if missing:
        die(f"{path}: its model_args lack {', '.join(missing)}: a malformed checkpoint")
    try:
        model = GPT(GPTConfig(**{k: v for k, v in ckpt["model_args"].items() if k in names}))
    except (TypeError, ValueError) as err:
        die(f"{path}: its model_args are malformed: {err}")
    bad = [name for name, t in ckpt["model"].items() if t.is_floating_point() and not t.isfinite().all()]
    if bad:  # train.py never saves such a model, but an older run could have
        die(f"{path} has non-finite weights ({bad[0]}, {len(bad) - 1} more): its run diverged before saving")
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as err:  # missing, unexpected or misshapen weights: the first detail line
        detail = str(err).splitlines()[1:2] or [str(err)]
        die(f"{path}: its weights do not fit its model_args: {detail[0].strip()}")
    return model.to(device).eval(), ckpt
