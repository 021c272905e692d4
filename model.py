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
import math
import os
import pickle
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from configurator import check_device, die

CKPT_FORMAT = "nanoloop-1"  # marks checkpoints written by this project's train.py
CKPT_KEYS = ("model_args", "model", "optimizer", "iter_num", "best_val_loss", "config", "rng")  # all saved


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
        assert self.n_embd % self.n_head == 0 and self.n_head % self.n_kv_head == 0
        assert 1 <= self.mean_loops <= self.max_loops and self.bptt_k >= 1


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
        return super().forward(self.adapter(torch.cat([e, s], dim=-1)), cos, sin, caches, pos, rows)


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
        return [KVCache(slots, c.n_kv_head, length, head_dim, self.wte.weight.device, dtype) for _ in range(n_layers)]

    def forward(self, idx, targets=None, loops=None, state_init="noise", generator=None):
        """Training/eval path: r loops, gradients only through the last bptt_k of them
        (truncated backprop bounds activation memory to bptt_k core passes)."""
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
        logits = self.readout(s)
        loss = None
        if targets is not None:  # the loss in float32 whatever the autocast dtype
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    # ---- accounting and optimisation ---------------------------------------------------
    def flops_per_token(self, loops, n_grad, T):
        """Training FLOPs per token: 6N for what gets gradients (prelude, coda, head and the
        last n_grad loops), 2N for the no-grad loops, plus attention scores (PaLM convention,
        full T x T counted): 2*2*T*d per layer forward."""
        c = self.config
        core = sum(p.numel() for p in self.core.parameters())
        outer = self.get_num_params(non_embedding=True) - core + self.wte.weight.numel()  # + head
        attn = 4 * T * c.n_embd
        fwd_outer = 2 * outer + attn * (c.n_prelude + c.n_coda)
        fwd_core = 2 * core + attn * c.n_core
        return 3 * fwd_outer + 3 * n_grad * fwd_core + (loops - n_grad) * fwd_core

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


def token_kl(logits_p, logits_q):
    """Per-token KL(p || q) in float32 from log-softmax; exactly 0 where p == q."""
    logp, logq = F.log_softmax(logits_p.float(), -1), F.log_softmax(logits_q.float(), -1)
    return F.kl_div(logq, logp, log_target=True, reduction="none").sum(-1).clamp_min(0.0)


def state_change(s_new, s_old, relative=False):
    """Per-token ||s_new - s_old||, optionally divided by ||s_new|| (a nearly free exit test)."""
    delta = (s_new.float() - s_old.float()).norm(dim=-1)
    return delta / s_new.float().norm(dim=-1).clamp_min(1e-12) if relative else delta


def read_checkpoint(path, device="cpu"):
    """The checkpoint dict at path, or one line and exit 2 if missing, corrupt, foreign or incomplete."""
    check_device(device)  # a missing GPU is the machine's fault, not the checkpoint's
    if not os.path.isfile(path):
        die(f"no checkpoint at {path} (train one with `python train.py`)")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as err:  # corrupt, foreign
        reason = f"{type(err).__name__}: {err}".splitlines()[0]
        die(f"{path} ({os.path.getsize(path)} bytes) is not a readable checkpoint: {reason}")
    if not isinstance(ckpt, dict) or ckpt.get("format") != CKPT_FORMAT:
        die(f"{path} is not a nanoloop checkpoint (missing format marker {CKPT_FORMAT!r})")
    missing = [key for key in CKPT_KEYS if key not in ckpt]
    if missing:
        die(f"{path} has the format marker but no {', '.join(missing)}: an incomplete checkpoint")
    return ckpt


def load_checkpoint(path, device="cpu"):
    """-> (model in eval mode, checkpoint dict); one line and exit 2 for missing or non-finite weights."""
    ckpt = read_checkpoint(path, device)
    names = {f.name for f in fields(GPTConfig)}
    model = GPT(GPTConfig(**{k: v for k, v in ckpt["model_args"].items() if k in names}))
    bad = [name for name, t in ckpt["model"].items() if t.is_floating_point() and not t.isfinite().all()]
    if bad:  # train.py never saves such a model, but an older run could have
        die(f"{path} has non-finite weights ({bad[0]}, {len(bad) - 1} more): its run diverged before saving")
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as err:  # missing, unexpected or misshapen weights
        die(f"{path}: its weights do not fit its model_args: {err}".splitlines()[0])
    return model.to(device).eval(), ckpt
