"""The model as decoding runs it: the checkpoint's weights rearranged once at load, never saved.

Under bf16 autocast, a float32 matrix is cast to bf16 in every matmul, and a CUDA graph replays
that cast at every step (29 of a loop's 106 launches at S0). Here each matrix is stored in the
dtype the matmuls compute in, and each attention's q, k and v matrices and each MLP's gate and up
ones are stacked once (model.py stacks them at every call, for one matmul). The embedding, the
norms and the state stay as they are, so that every value the decode computes is sample.py's
(tests/test_engine.py holds the tokens equal).
"""
import copy
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import CacheView, KVCache, apply_rope, autocast_input


class DecodeView(NamedTuple):
    """model.CacheView for one new token per row at pos (1,), with the attention mask (1, block)
    computed once per token ("the positions up to pos"), not once per layer; `active` (B,) None:
    every row writes its K/V (uniform depth: no mask on the writes)."""
    cache: KVCache
    pos: torch.Tensor
    visible: torch.Tensor
    active: torch.Tensor | None = None

    def write(self, layer, k, v):
        CacheView(self.cache, self.pos, self.active).write(layer, k, v)


def frozen(weight):
    """A weight the decode reads and never trains: a parameter, so that a CUDA graph takes its
    address as fixed."""
    return nn.Parameter(weight.detach().clone(), requires_grad=False)


class FusedAttention(nn.Module):
    """model.Attention for one new token per row (a DecodeView), with q, k and v from one matmul;
    the rest is Attention.forward's."""

    def __init__(self, attention, dtype):
        super().__init__()
        self.n_head = attention.n_head
        self.n_kv_head = attention.n_kv_head
        self.head_dim = attention.head_dim
        stacked = torch.cat([attention.wq.weight, attention.wk.weight, attention.wv.weight])
        self.wqkv = frozen(stacked.to(dtype))
        self.wo = frozen(attention.wo.weight.to(dtype))

    def forward(self, x, cos, sin, view, layer=0):
        """x (B, 1, d) at view.pos -> (B, 1, d); this layer's K/V written into view's cache."""
        B, T, _ = x.shape
        kv_width = self.n_kv_head * self.head_dim
        qkv = F.linear(autocast_input(x), self.wqkv)
        q, k, v = qkv.split([self.n_head * self.head_dim, kv_width, kv_width], dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        view.write(layer, k, v)
        keys, values = view.cache.k[layer], view.cache.v[layer]
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=view.visible,
                                           enable_gqa=True)
        return F.linear(y.transpose(1, 2).reshape(B, T, -1), self.wo)


class FusedMLP(nn.Module):
    """model.MLP with the gate and up projections as one matmul."""

    def __init__(self, mlp, dtype):
        super().__init__()
        stacked = torch.cat([mlp.w_gate.weight, mlp.w_up.weight])
        self.w_gate_up = frozen(stacked.to(dtype))
        self.w_down = frozen(mlp.w_down.weight.to(dtype))

    def forward(self, x):
        gate, up = F.linear(autocast_input(x), self.w_gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w_down)


def for_decoding(model, dtype):
    """-> a copy of model (a GPT) for decode steps: its matrices in dtype (autocast's, else the
    weights'), q/k/v and gate/up fused; the output head a copy of the embedding's matrix in dtype
    (the embedding itself stays in its dtype: a lookup, not a matmul). The prefill keeps model."""
    net = copy.deepcopy(model)
    for stack in (net.prelude_blocks, net.core, net.coda_blocks):
        for block in stack.blocks:
            block.attn = FusedAttention(block.attn, dtype)
            block.mlp = FusedMLP(block.mlp, dtype)
    net.core.adapter.weight = frozen(net.core.adapter.weight.to(dtype))
    # a parameter of its own: the embedding keeps the tied one
    net.lm_head.weight = frozen(model.lm_head.weight.to(dtype))
    for p in net.parameters():
        p.requires_grad_(False)
    return net.eval()
