"""A depth-recurrent transformer: prelude -> weight-tied core applied r times -> coda.

    e   = prelude(idx)                      unique blocks, computed once
    s_0 ~ N(0, state_std) (or zeros)        the state, not initialised from e
    s_i = core(adapter([e, s_{i-1}]))       input re-injection, Linear(2d -> d)
    p   = softmax(head(norm(coda(s_r))))    unique blocks, tied embedding head

Llama-style blocks (RMSNorm, RoPE, grouped-query attention, SwiGLU, no biases); the core's
blocks add sandwich norms, so that the state neither collapses nor blows up over many loops.
Every loop in the project is built from four verbs: prelude, init_state, core_step, readout;
a token's depth from sample_loops in training, and an exit test and keeps_looping at inference.
"""
import io
import json
import math
import os
from dataclasses import dataclass
from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from configurator import UserError

CKPT_FORMAT = "nanoloop-1"  # marks the checkpoints train.py writes
LOGITS_CHUNK = 2 ** 27  # logits per chunk of the per-token KL and loss: 512 MiB in float32
MIN_EXIT_LOOP = 2  # an exit test compares two loops, so no token stops before loop 2
MAX_LOOPS = 1024  # the most loops a setting may ask of a token: more is hours a token, a typo


@dataclass
class GPTConfig:
    """A model's shape and loop distribution; defaults: the paper's S0 (train.py's differ)."""
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
    loop_spread: float = 0.5
    loop_dist: str = "lognormal"
    bptt_k: int = 4
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    state_std: float = math.sqrt(2 / 5)

    def __post_init__(self):
        """UserError for a shape no model can have (the sizes' ranges are train.py's RULES)."""
        if self.n_embd % self.n_head or self.n_head % self.n_kv_head:
            raise UserError(f"n_head={self.n_head} must divide n_embd={self.n_embd}, "
                            f"and n_kv_head={self.n_kv_head} must divide n_head")
        # RoPE rotates pairs of channels
        if self.n_embd // self.n_head % 2:
            raise UserError(f"the head size n_embd / n_head = {self.n_embd // self.n_head} "
                            f"must be even")
        if self.mean_loops > self.max_loops:
            raise UserError(f"mean_loops={self.mean_loops} > max_loops={self.max_loops}")


def sample_loops(config, step, seed):
    """One training step's depth, from (seed, step) alone so that every rank draws the same:
    round(exp(N(log mean_loops, loop_spread))) in [1, max_loops] (the paper's), or 'fixed'."""
    if config.loop_dist == "fixed":
        return config.mean_loops
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    z = torch.randn((), generator=generator, dtype=torch.float64).item()
    # clamped before exp, which a wide spread would overflow
    log_loops = math.log(config.mean_loops) + config.loop_spread * z
    log_loops = min(log_loops, math.log(config.max_loops))
    return max(round(math.exp(log_loops)), 1)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # in float32 whatever the autocast: bf16 is too coarse for a mean of squares
        return F.rms_norm(x.float(), (x.size(-1),), self.weight.float(), self.eps).type_as(x)


class KVCache:
    """Keys and values of one stack of blocks: k and v are lists of a tensor (batch, n_kv_head,
    block_size, head_dim) per layer. For the core, a token's slot holds the K/V of the last loop
    it ran (Huginn's rule): later tokens see a token that stopped early as it was then."""

    def __init__(self, config, n_layers, batch, device, dtype):
        shape = (batch, config.n_kv_head, config.block_size, config.n_embd // config.n_head)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]


class CacheView(NamedTuple):
    """Where one call's tokens go in a KVCache: a prefill's T at positions 0..T-1 (pos None), or a
    decoded token per row at pos (a (1,) tensor), in the rows where `active` (B,) is True."""
    cache: KVCache
    pos: torch.Tensor | None = None
    active: torch.Tensor | None = None

    def write(self, layer, k, v):
        """Store k, v (B, n_kv_head, T, head_dim) at positions 0..T-1, or (T = 1) at pos; a row
        that has stopped looping keeps the K/V of the last loop it ran."""
        keys, values = self.cache.k[layer], self.cache.v[layer]
        positions = torch.arange(k.size(2), device=k.device) if self.pos is None else self.pos
        if self.active is not None:
            ran = self.active.view(-1, 1, 1, 1)
            k = torch.where(ran, k, keys.index_select(2, positions))
            v = torch.where(ran, v, values.index_select(2, positions))
        keys.index_copy_(2, positions, k)
        values.index_copy_(2, positions, v)


def autocast_input(x):
    """x in autocast's dtype (x itself without autocast): cast once, not in each matmul it feeds."""
    if torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x


def apply_rope(x, cos, sin):
    """Rotate x (..., T, [heads,] head_dim) by tables (T, [1,] head_dim / 2) in x's dtype: float32
    ones would silently promote bf16 q and k (a bug the paper reports)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.n_kv_head = cfg.n_kv_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.wq = nn.Linear(cfg.n_embd, cfg.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * self.head_dim, cfg.n_embd, bias=False)

    def forward(self, x, cos, sin, cache=None, layer=0):
        """x (B, T, d) -> (B, T, d); with a CacheView, this layer's K/V are stored in the cache."""
        B, T, _ = x.shape
        # q, k and v from one matmul over their stacked matrices: one kernel, not three
        qkv_weight = torch.cat([self.wq.weight, self.wk.weight, self.wv.weight])
        qkv = F.linear(x, qkv_weight).view(B, T, self.n_head + 2 * self.n_kv_head, self.head_dim)
        qk, v = qkv.split([self.n_head + self.n_kv_head, self.n_kv_head], dim=2)
        # q and k rotated in one kernel as the matmul laid them out, (B, T, heads, head_dim)
        qk = apply_rope(qk, cos[:, None], sin[:, None]).transpose(1, 2)
        q, k = qk.split([self.n_head, self.n_kv_head], dim=1)
        v = v.transpose(1, 2)
        if cache is not None:
            cache.write(layer, k, v)
        if cache is None or cache.pos is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            # a new token per row reads the whole cache, masked past its position
            k, v = cache.cache.k[layer], cache.cache.v[layer]
            visible = torch.arange(k.size(2), device=k.device) <= cache.pos[:, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU: w_down(silu(w_gate x) * w_up x), (B, T, d) -> (B, T, d); gate and up: one matmul."""

    def __init__(self, cfg):
        super().__init__()
        self.w_gate = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.w_up = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.w_down = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=False)

    def forward(self, x):
        gate_up_weight = torch.cat([self.w_gate.weight, self.w_up.weight])
        gate, up = F.linear(x, gate_up_weight).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm attention and MLP, each added to the stream; (B, T, d) -> (B, T, d)."""

    def __init__(self, cfg, sandwich):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)
        # the core's sandwich: a norm after each sublayer too, before it joins the stream
        self.attn_post = RMSNorm(cfg.n_embd, cfg.norm_eps) if sandwich else nn.Identity()
        self.mlp_post = RMSNorm(cfg.n_embd, cfg.norm_eps) if sandwich else nn.Identity()

    def forward(self, x, cos, sin, cache=None, layer=0):
        x = x + self.attn_post(self.attn(self.attn_norm(x), cos, sin, cache, layer))
        return x + self.mlp_post(self.mlp(self.mlp_norm(x)))


class Stack(nn.Module):
    def __init__(self, cfg, n, sandwich=False):
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg, sandwich) for _ in range(n))

    def forward(self, x, cos, sin, cache=None):
        for layer, block in enumerate(self.blocks):
            x = block(x, cos, sin, cache, layer)
        return x


class Core(Stack):
    """One loop: the adapter re-injects e into the state, then the weight-tied blocks."""

    def __init__(self, cfg):
        super().__init__(cfg, cfg.n_core, sandwich=True)
        self.adapter = nn.Linear(2 * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, e, s, cos, sin, cache=None):
        # The state stays float32 under autocast: the convergence tail (KL ~1e-5) is below bf16's
        # resolution. The adapter's output takes e's dtype: one dtype (one graph) every loop.
        x = self.adapter(torch.cat([e, s], dim=-1)).to(e.dtype)
        return super().forward(x, cos, sin, cache)


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
        self.lm_head.weight = self.wte.weight  # tied input and output embeddings
        # RoPE: a head's channel pair j turns by position x rope_theta^(-2j / head_dim)
        head_dim = c.n_embd // c.n_head
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(c.block_size).float(), inv_freq)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        # "Small init" (Nguyen & Salazar), std sqrt(2 / (5 d)); the output projections shrink with
        # the depth unrolled at mean_loops, so that the stream's variance does not grow with it.
        std = math.sqrt(2 / (5 * c.n_embd))
        out_std = std / math.sqrt(2 * (c.n_prelude + c.n_coda + c.n_core * c.mean_loops))
        for name, p in self.named_parameters():
            if p.dim() == 2:
                is_output = name.endswith(("wo.weight", "w_down.weight"))
                nn.init.normal_(p, std=out_std if is_output else std)

    def rope(self, T, cache=None):
        """The rotary tables (T, head_dim / 2) from position 0 or at cache.pos, in q's dtype."""
        positions = slice(T) if cache is None or cache.pos is None else cache.pos
        return autocast_input(self.rope_cos[positions]), autocast_input(self.rope_sin[positions])

    # ---- the per-loop API
    def prelude(self, idx, cache=None):
        """Token ids (B, T) -> e (B, T, d), computed once per token."""
        return self.prelude_blocks(self.wte(idx), *self.rope(idx.size(1), cache), cache)

    def init_state(self, e, mode="noise", generator=None):
        """s_0 shaped like e: N(0, state_std) as in training, or zeros (reproducible exits)."""
        if mode == "zero":
            return torch.zeros_like(e)
        if mode != "noise":
            raise ValueError(f"state_init must be 'noise' or 'zero', got {mode!r}")
        noise = torch.randn(e.shape, generator=generator, device=e.device)
        return (noise * self.config.state_std).to(e.dtype)

    def core_step(self, e, s, cache=None):
        """One loop: (e, s_{i-1}) (B, T, d) -> s_i (B, T, d)."""
        return self.core(e, s, *self.rope(s.size(1), cache), cache)

    def readout(self, s, cache=None, targets=None):
        """State (B, T, d) -> logits (B, T, vocab): the coda, the norm, the tied head; with targets
        (B, T), their mean cross-entropy (-1: not scored): training and inference, one readout."""
        normed = self.norm(self.coda_blocks(s, *self.rope(s.size(1), cache), cache))
        if targets is None:
            return self.lm_head(normed)
        # the head in float32, about LOGITS_CHUNK logits at a time: none kept for backward
        rows = math.ceil(LOGITS_CHUNK / self.config.vocab_size)
        chunks = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=rows)
        return F.linear_cross_entropy(normed.float().flatten(0, 1), self.lm_head.weight,
                                      targets.flatten(), ignore_index=-1, options=chunks)

    def new_caches(self, batch):
        """{"prelude", "core", "coda"}: an empty KVCache for each stack of blocks, for `batch`
        sequences, in the dtype attention computes in."""
        c = self.config
        weight = autocast_input(self.wte.weight[:1])
        layers = {"prelude": c.n_prelude, "core": c.n_core, "coda": c.n_coda}
        return {part: KVCache(c, n, batch, weight.device, weight.dtype)
                for part, n in layers.items()}

    def forward(self, idx, targets=None, loops=None, state_init="noise", generator=None):
        """idx (B, T) -> logits (B, T, vocab) after `loops` loops (None: mean_loops), or with
        targets the mean loss; truncated backprop: loops - bptt_k loops without gradients first."""
        loops = self.config.mean_loops if loops is None else loops
        e = self.prelude(idx)
        s = self.init_state(e, state_init, generator)
        n_grad = min(loops, self.config.bptt_k)
        with torch.no_grad():
            for _ in range(loops - n_grad):
                s = self.core_step(e, s)
        return self.readout(self.grad_loops(e, s, n_grad), targets=targets)

    def grad_loops(self, e, s, n):
        """The n loops backprop reaches: (e, s) (B, T, d) -> s (B, T, d). train.py compiles them as
        one graph, in which the tied core's n gradients are summed, not one launch a loop."""
        for _ in range(n):
            s = self.core_step(e, s)
        return s

    # ---- the FLOP ledger: one count for train.py's FLOP rate (MFU) and for allocate.py
    def flop_terms(self, T):
        """Forward FLOPs per token of (the prelude, one loop, the readout) in a window of T:
        2 per matmul weight, and 4 * T * d per attention layer (scores and values)."""
        def matmuls(module):
            return 2 * sum(p.numel() for p in module.parameters() if p.dim() == 2)
        c = self.config
        attention = 4 * T * c.n_embd
        prelude = matmuls(self.prelude_blocks) + attention * c.n_prelude
        loop = matmuls(self.core) + attention * c.n_core
        readout = matmuls(self.coda_blocks) + matmuls(self.lm_head) + attention * c.n_coda
        return prelude, loop, readout

    def flops_per_token(self, loops, n_grad, T):
        """Training FLOPs per token: 3x the forward where gradients flow, 1x in no-grad loops."""
        prelude, loop, readout = self.flop_terms(T)
        return 3 * (prelude + readout) + (3 * n_grad + loops - n_grad) * loop

    def inference_flops(self, loops, T, exit_test=None):
        """Forward FLOPs per token of `loops` loops (a number or an array): uniform, or with an
        ExitTest its readouts (KL: one a loop) and tests (from MIN_EXIT_LOOP)."""
        prelude, loop, readout = self.flop_terms(T)
        if exit_test is None:
            return prelude + loops * loop + readout
        readouts = loops if exit_test.needs_logits else 1
        tests = (loops - (MIN_EXIT_LOOP - 1)) * exit_test.flops(self.config)
        return prelude + loops * loop + readouts * readout + tests

    def configure_optimizers(self, weight_decay, learning_rate, betas, device):
        """AdamW with weight decay on the matrices only (not the norms' gains), fused on CUDA."""
        matrices = [p for p in self.parameters() if p.dim() >= 2]
        gains = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": matrices, "weight_decay": weight_decay},
                  {"params": gains, "weight_decay": 0.0}]
        fused = device.startswith("cuda")
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)


# ---- per-token measures, in float32 whatever the autocast, by chunks of LOGITS_CHUNK
def by_chunks(fn, logits, other):
    """fn(float32 rows of logits (N, V), rows of other: targets (N,) or logits (N, V)) -> (N,),
    over logits (..., V) -> (...), LOGITS_CHUNK at a time: S1's 8 x 2048 x 49,152 are 3.2 GB."""
    rows = max(1, LOGITS_CHUNK // logits.size(-1))
    mine = logits.reshape(-1, logits.size(-1)).split(rows)
    theirs = other.reshape(-1, *other.shape[logits.dim() - 1:]).split(rows)
    results = [fn(a.float(), b) for a, b in zip(mine, theirs)]
    return torch.cat(results).view(logits.shape[:-1])


def token_kl(logits_p, logits_q):
    """KL(p || q) per token, p and q the softmaxes of logits (..., V) -> (...); 0 where p == q."""
    def kl(p, q):
        log_p = F.log_softmax(p, -1)
        log_q = F.log_softmax(q.float(), -1)
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    # rounding can leave a tiny negative where p and q nearly agree
    return by_chunks(kl, logits_p, logits_q).clamp_min(0.0)


def token_loss(logits, targets):
    """Cross-entropy per token: logits (..., V), targets (...) -> (...)."""
    return by_chunks(partial(F.cross_entropy, reduction="none"), logits, targets)


def state_change(s_new, s_old, relative=False):
    """||s_new - s_old|| per token (..., d) -> (...), or divided by ||s_new||."""
    delta = (s_new.float() - s_old.float()).norm(dim=-1)
    if not relative:
        return delta
    return delta / s_new.float().norm(dim=-1).clamp_min(1e-12)


# ---- exit tests, in one registry that sample.py, evaluate.trace, allocate.py and the FLOP ledger
# read: a new test is one entry there. A token stops once its score is below a threshold.
class ExitTest(NamedTuple):
    """score(s_new, s_old, logits_new, logits_old) -> a score per token (the logits None without a
    readout); flops(config) -> FLOPs per token of one test; needs_logits: a readout after every
    loop, carried to the next (the KL exit); threshold: sample.py's unless allocate.py calibrated
    one; label: its name in the paper (A1, A1s), for tables."""
    score: Callable
    flops: Callable
    needs_logits: bool = False
    threshold: float = 1e-3
    label: str = ""


def kl_score(s_new, s_old, logits_new, logits_old):
    """The paper's A1: KL(p_i || p_{i-1}) of the readouts after the last two loops."""
    return token_kl(logits_new, logits_old)


def state_score(s_new, s_old, logits_new, logits_old):
    """A1s: the relative state change ||s_i - s_{i-1}|| / ||s_i||, with no readout."""
    return state_change(s_new, s_old, relative=True)


# FLOPs per vocabulary entry for KL: two log-softmaxes (4 each), an exp, a difference, a product,
# a sum; per channel for the state change: a difference and two norms (2 each).
EXIT_TESTS = {
    "kl": ExitTest(kl_score, lambda config: 12 * config.vocab_size, needs_logits=True,
                   threshold=1e-3, label="A1"),
    "state": ExitTest(state_score, lambda config: 5 * config.n_embd, threshold=0.05, label="A1s"),
}


class DepthPolicy(NamedTuple):
    """How deep each token runs: r_max loops, or with an exit test until its score is below
    threshold; test None is uniform depth."""
    test: ExitTest | None
    threshold: float
    r_max: int


def uniform_depth(loops):
    return DepthPolicy(None, 0.0, loops)


def keeps_looping(loop, score, depth):
    """The stop rule, written once: after loop number `loop` (a number, or each token's), does a
    token whose exit score is `score` (None: none yet) loop again? Never past depth.r_max; with an
    exit test, always to MIN_EXIT_LOOP (a test compares two loops), then while its score is not
    below the threshold (a NaN score, never below anything, stops no token)."""
    go_on = loop < depth.r_max
    if depth.test is None or score is None:
        return go_on
    settled = score < depth.threshold
    return go_on & ((loop < MIN_EXIT_LOOP) | ~settled)


def exit_depth(scores, depth):
    """A trace's exit scores (n_loops, ...), loop i's in row i - 1, -> (...) the loops each token
    runs under depth (r_max <= n_loops): the loop after which keeps_looping first says stop."""
    if depth.r_max > len(scores):
        raise ValueError(f"r_max {depth.r_max} is deeper than the {len(scores)} loops traced")
    loops_run = torch.zeros(scores.shape[1:], dtype=torch.long, device=scores.device)
    looping = torch.ones(scores.shape[1:], dtype=torch.bool, device=scores.device)
    for loop in range(1, depth.r_max + 1):
        loops_run += looping
        looping &= keeps_looping(loop, scores[loop - 1], depth)
    return loops_run


# ---- every --device this machine has (each script's RULES refuse others)
GPUS = tuple(f"cuda:{i}" for i in range(torch.cuda.device_count()))
DEVICES = (("cpu", "cuda") + GPUS) if GPUS else ("cpu",)


def autocast(device, dtype):
    """bf16 autocast for the matmuls, on CUDA or (for the tests) on the CPU."""
    return torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=dtype != "float32")


# ---- files
def save_atomic(path, obj):
    """The one writer of a result, whole or not at all (synced, renamed over path): bytes as they
    are, a .pt by torch.save, else JSON."""
    if isinstance(obj, bytes):
        data = obj
    elif path.endswith(".pt"):
        # through memory: a write the disk refuses is then an OSError, not "unexpected pos"
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = buffer.getvalue()
    else:
        data = json.dumps(obj, indent=2).encode()
    with open(f"{path}.tmp", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f"{path}.tmp", path)


def checkpoint_id(ckpt):
    """The run and step an output came from (a retrained run differs)."""
    return f"{ckpt['config'].get('run_id', 'unnamed')}@{ckpt['iter_num']}"


def load_checkpoint(path, device="cpu"):
    """-> (the GPT train.py saved at path, in eval mode on device; the checkpoint dict), or
    UserError. weights_only: a pickle never runs code (a corrupt file raises torch's error)."""
    if not os.path.isfile(path):
        raise UserError(f"no checkpoint at {path} (train one with `python train.py`)")
    ckpt = torch.load(path, map_location=device, weights_only=True)
    if not isinstance(ckpt, dict) or ckpt.get("format") != CKPT_FORMAT:
        raise UserError(f"{path} is not a nanoloop checkpoint (no format marker {CKPT_FORMAT!r})")
    # a checkpoint from before the loop distribution joined GPTConfig kept two of it in config
    config = ckpt["config"]
    older = {key: config[key] for key in ("loop_spread", "loop_dist") if key in config}
    model = GPT(GPTConfig(**(older | ckpt["model_args"])))
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval(), ckpt
