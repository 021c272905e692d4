"""nanoloop's depth-recurrent transformer in transformers: a prelude of unique blocks reads the
tokens once, one weight-tied core is applied num_loops times (the input re-injected at every
loop), and a coda reads the result out:

    e   = prelude(ids)
    s_0 = 0
    s_i = core(adapter([e, s_{i-1}]))
    p   = softmax(head(norm(coda(s_r))))    the head tied to the embedding

`model(ids, num_loops=r)` gives nanoloop's GPT.forward(ids, loops=r, state_init="zero") logits.
In `generate` the prompt runs num_loops loops, and each new token num_loops too, or with
`exit="kl"` or `"state"` until its exit score is below `exit_threshold` (at `r_max` loops at the
latest), as nanoloop's sample.py runs them. The cache is a DynamicCache with one layer per block:
a core layer holds, for each token, the K/V of the last loop that token ran (Huginn's rule), so a
new token loops over the cached past and its own current loop, and only its last loop's K/V are
appended.

`python -m hf.export` copies this file beside the weights; it imports torch and transformers alone.
"""
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_nanoloop import NanoloopConfig

# an exit test compares two loops, so no token stops before loop 2
MIN_EXIT_LOOP = 2
# transformers 5.24 renamed the cache argument and output field past_key_values to cache
CACHE_FIELD = "past_key_values"
if "cache" in CausalLMOutputWithPast.__dataclass_fields__:
    CACHE_FIELD = "cache"


# ---- the exit tests, as nanoloop's model.EXIT_TESTS scores them (tests/test_hf.py compares them)
def token_kl(logits_p, logits_q):
    """KL(p || q) per token of the softmaxes of logits (..., V) -> (...), in float32."""
    log_p = F.log_softmax(logits_p.float(), -1)
    log_q = F.log_softmax(logits_q.float(), -1)
    # KL >= 0, but rounding can leave a tiny negative where p and q nearly agree
    return (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)


def kl_score(s_new, s_old, logits_new, logits_old):
    """The paper's A1: KL(p_i || p_{i-1}) of the readouts after the last two loops."""
    return token_kl(logits_new, logits_old)


def state_score(s_new, s_old, logits_new, logits_old):
    """A1s: the relative change of the state, ||s_i - s_{i-1}|| / ||s_i||; no readout."""
    delta = (s_new.float() - s_old.float()).norm(dim=-1)
    return delta / s_new.float().norm(dim=-1).clamp_min(1e-12)


class ExitTest(NamedTuple):
    score: Callable  # (s_new, s_old, logits_new, logits_old) -> a score per token
    needs_logits: bool  # a readout after every loop, carried to the next
    threshold: float  # its default, where none was calibrated for the model


EXIT_TESTS = {"kl": ExitTest(kl_score, needs_logits=True, threshold=1e-3),
              "state": ExitTest(state_score, needs_logits=False, threshold=0.05)}


class DepthPolicy(NamedTuple):
    """How deep each new token runs: r_max loops, or with an exit test until its score is below
    the threshold."""
    test: ExitTest | None
    threshold: float
    r_max: int


@dataclass
class NanoloopCausalLMOutput(CausalLMOutputWithPast):
    """transformers' causal LM output, and `loops` (B, T): the loops each position ran."""
    loops: torch.LongTensor | None = None


# ---- the blocks, as nanoloop's model.py computes them (its names: the weights load as they are)
class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # in float32 whatever the dtype: bf16 is too coarse for a mean of squares
        return F.rms_norm(x.float(), (x.size(-1),), self.weight.float(), self.eps).type_as(x)


def apply_rope(x, cos, sin):
    """Rotate x (B, heads, T, head_dim) by the tables (B or 1, 1, T, head_dim / 2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Window(NamedTuple):
    """Where a forward's T new tokens sit: the rotary tables at their positions, (B or 1, 1, T,
    head_dim / 2) each; the keys each may see, (B, 1, T, n_past + T) bool, or None for plain
    causal attention from position 0; the cache (or None) and the n_past tokens it holds."""
    cos: torch.Tensor
    sin: torch.Tensor
    visible: torch.Tensor | None
    cache: DynamicCache | None
    n_past: int

    def past(self, first_layer, n_layers):
        """The cached (keys, values) of the tokens before, a pair per layer; Nones if none."""
        if self.n_past == 0:
            return [None] * n_layers
        layers = self.cache.layers[first_layer:first_layer + n_layers]
        return [(layer.keys, layer.values) for layer in layers]

    def store(self, first_layer, kv):
        """Append the new tokens' K/V, a (k, v) per layer, to the cache from layer first_layer."""
        if self.cache is not None:
            for layer, (k, v) in enumerate(kv, first_layer):
                self.cache.update(k, v, layer)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.wq = nn.Linear(config.n_embd, config.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(config.n_embd, config.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(config.n_embd, config.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_head * self.head_dim, config.n_embd, bias=False)

    def forward(self, x, window, past):
        """x (B, T, d) -> (B, T, d), and the T tokens' (k, v), each (B, n_kv_head, T, head_dim).
        past: the (keys, values) of the tokens before, or None."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q = apply_rope(q, window.cos, window.sin)
        k = apply_rope(k, window.cos, window.sin)
        keys, values = k, v
        if past is not None:
            keys = torch.cat([past[0], k], dim=2)
            values = torch.cat([past[1], v], dim=2)
        if window.visible is None:
            y = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
        else:
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=window.visible,
                                               enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1)), (k, v)


class MLP(nn.Module):
    """SwiGLU: w_down(silu(w_gate x) * w_up x), (B, T, d) -> (B, T, d)."""

    def __init__(self, config):
        super().__init__()
        self.w_gate = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.w_up = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.w_down = nn.Linear(config.ffn_hidden, config.n_embd, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    """Pre-norm attention and MLP, each added to the stream; the core's add a norm after each."""

    def __init__(self, config, sandwich):
        super().__init__()
        self.attn_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = Attention(config)
        self.mlp = MLP(config)
        self.attn_post = RMSNorm(config.n_embd, config.norm_eps) if sandwich else nn.Identity()
        self.mlp_post = RMSNorm(config.n_embd, config.norm_eps) if sandwich else nn.Identity()

    def forward(self, x, window, past):
        """x (B, T, d) -> (B, T, d), and the T tokens' (k, v) of this block."""
        attended, kv = self.attn(self.attn_norm(x), window, past)
        x = x + self.attn_post(attended)
        return x + self.mlp_post(self.mlp(self.mlp_norm(x))), kv


class Stack(nn.Module):
    def __init__(self, config, n_blocks, sandwich=False):
        super().__init__()
        self.blocks = nn.ModuleList(Block(config, sandwich) for _ in range(n_blocks))

    def forward(self, x, window, past):
        """x (B, T, d) -> (B, T, d), and a (k, v) per block; past: (keys, values) or None each."""
        kv = []
        for block, block_past in zip(self.blocks, past):
            x, block_kv = block(x, window, block_past)
            kv.append(block_kv)
        return x, kv


class Core(Stack):
    """One loop: the adapter re-injects e into the state, then the weight-tied blocks."""

    def __init__(self, config):
        super().__init__(config, config.n_core, sandwich=True)
        self.adapter = nn.Linear(2 * config.n_embd, config.n_embd, bias=False)

    def forward(self, e, s, window, past):
        x = self.adapter(torch.cat([e, s], dim=-1)).to(e.dtype)
        return super().forward(x, window, past)


class NanoloopPreTrainedModel(PreTrainedModel):
    config_class = NanoloopConfig
    base_model_prefix = "model"


class NanoloopModel(NanoloopPreTrainedModel):
    """The embedding and the three stacks, with the verbs every loop is built from: prelude,
    core_step, coda. The prelude stores its K/V in the window's cache at once; a core step's and
    the coda's are returned, to be stored once a token's last loop is known."""

    def __init__(self, config):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.prelude_blocks = Stack(config, config.n_prelude)
        self.core = Core(config)
        self.coda_blocks = Stack(config, config.n_coda)
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        # the cache's layers: the prelude's blocks, then the core's, then the coda's
        self.core_layer = config.n_prelude
        self.coda_layer = config.n_prelude + config.n_core
        self.post_init()

    def get_input_embeddings(self):
        return self.wte

    def set_input_embeddings(self, embedding):
        self.wte = embedding

    def window(self, input_ids, attention_mask, position_ids, cache):
        """The Window of input_ids (B, T) after the cache's tokens, with their padding
        (attention_mask (B, n_past + T), 0 for padding) and positions (B, T); None: counted from
        each row's first token that is not padding, so that a left-padded row is positioned as it
        would be alone."""
        B, T = input_ids.shape
        device = input_ids.device
        n_past = cache.get_seq_length() if cache is not None else 0
        padded = attention_mask is not None and not bool(attention_mask.all())
        if position_ids is None and padded:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -T:]
        elif position_ids is None:
            position_ids = torch.arange(n_past, n_past + T, device=device)[None]
        last_position = int(position_ids.max())
        if last_position >= self.config.block_size:
            raise ValueError(f"position {last_position} is past the model's context: nanoloop "
                             f"models read block_size = max_position_embeddings = "
                             f"{self.config.block_size} tokens at most")
        # RoPE: channel pair j of a head turns by position x rope_theta^(-2j / head_dim)
        head_dim = self.config.n_embd // self.config.n_head
        pairs = torch.arange(0, head_dim, 2, device=device).float()
        inv_freq = 1.0 / self.config.rope_theta ** (pairs / head_dim)
        angles = position_ids.float()[..., None] * inv_freq
        dtype = self.wte.weight.dtype
        cos = angles.cos().to(dtype)[:, None]
        sin = angles.sin().to(dtype)[:, None]
        visible = None
        if n_past or padded:
            # each query sees the keys up to its own, not padding, and always its own key, so
            # that a padding query attends to something (its output is never read)
            keys = torch.arange(n_past + T, device=device)
            queries = torch.arange(n_past, n_past + T, device=device)
            visible = keys[None, :] <= queries[:, None]
            if padded:
                visible = visible & attention_mask.bool()[:, None, :]
            visible = (visible | (keys[None, :] == queries[:, None]))[:, None]
            visible = visible.expand(B, 1, T, n_past + T)
        return Window(cos, sin, visible, cache, n_past)

    def prelude(self, input_ids, window):
        """Token ids (B, T) -> e (B, T, d); the prelude's K/V are stored at once."""
        past = window.past(0, self.config.n_prelude)
        e, kv = self.prelude_blocks(self.wte(input_ids), window, past)
        window.store(0, kv)
        return e

    def core_step(self, e, s, window):
        """One loop: (e, s_{i-1}) (B, T, d) -> s_i (B, T, d), and the core's K/V of this loop."""
        return self.core(e, s, window, window.past(self.core_layer, self.config.n_core))

    def coda(self, s, window):
        """State (B, T, d) -> what the head reads (B, T, d), and the coda's K/V."""
        x, kv = self.coda_blocks(s, window, window.past(self.coda_layer, self.config.n_coda))
        return self.norm(x), kv


def keep_rows(rows, new_kv, old_kv):
    """Per layer, (k, v) of new_kv in the rows (B,) bool, of old_kv in the others."""
    where = rows.view(-1, 1, 1, 1)
    return [(torch.where(where, k, old_k), torch.where(where, v, old_v))
            for (k, v), (old_k, old_v) in zip(new_kv, old_kv)]


def generate_setting(name, kwargs, settings, default):
    """An argument of generate: as given, else as its GenerationConfig has it, else default."""
    for value in (kwargs.get(name), getattr(settings, name, None)):
        if value is not None:
            return value
    return default


class NanoloopForCausalLM(NanoloopPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.wte.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = NanoloopModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # each forward's last loops (B,), while generate runs; then the loops of its new tokens
        self.loops_of_steps = None
        self.generation_loops = None
        self.post_init()

    def get_input_embeddings(self):
        return self.model.wte

    def set_input_embeddings(self, embedding):
        self.model.wte = embedding

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, head):
        self.lm_head = head

    def depth(self, num_loops=None, exit=None, exit_threshold=None, r_max=None):
        """The loops a forward runs, from its arguments or else the config's -> (the prompt's
        loops, the new tokens' DepthPolicy: uniform at num_loops, or the exit test's). ValueError
        for an unknown exit or a depth no model runs."""
        config = self.config
        num_loops = num_loops or config.num_loops
        exit = exit or config.exit
        if num_loops < 1:
            raise ValueError(f"num_loops must be at least 1, got {num_loops}")
        if exit == "none":
            return num_loops, DepthPolicy(None, 0.0, num_loops)
        if exit not in EXIT_TESTS:
            choices = ", ".join(EXIT_TESTS)
            raise ValueError(f"exit must be 'none' or one of {choices}, got {exit!r}")
        r_max = r_max or config.r_max or config.max_loops
        if r_max < MIN_EXIT_LOOP:
            raise ValueError(f"an exit compares two loops: r_max must be at least "
                             f"{MIN_EXIT_LOOP}, got {r_max}")
        threshold = exit_threshold
        if threshold is None:
            threshold = config.exit_threshold
        if threshold is None:
            threshold = EXIT_TESTS[exit].threshold
            # allocate.py's operating threshold holds at the r_max and dtype it was found at
            dtype = str(self.dtype).removeprefix("torch.")
            calibrated_at = (config.calibrated_r_max, config.calibrated_dtype)
            if calibrated_at == (r_max, dtype) and exit in config.operating_thresholds:
                threshold = config.operating_thresholds[exit]
        return num_loops, DepthPolicy(EXIT_TESTS[exit], threshold, r_max)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                past_key_values=None, cache=None, labels=None, use_cache=None, logits_to_keep=0,
                num_loops=None, exit=None, exit_threshold=None, r_max=None, return_dict=None,
                **kwargs):
        """input_ids (B, T) -> NanoloopCausalLMOutput: logits (B, T, V) (of the last
        logits_to_keep positions; 0: all), loops (B, T), the cache, and with labels (B, T) the
        mean cross-entropy of each position's logits for the next label (-100: not scored).

        Tokens with nothing cached before them (a prompt, or a whole sequence without a cache) run
        num_loops loops together, each loop attending to the others' K/V of the same loop, as in
        training. Tokens after a cache attend to the cached K/V (each token's last loop) and to
        each other's current loop, num_loops loops; with an exit, one token per row loops until
        its exit test stops it. The cache argument is transformers 5.24's name for
        past_key_values: either is taken."""
        if cache is None:
            cache = past_key_values
        if use_cache is None:
            use_cache = self.config.use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        if cache is not None and not isinstance(cache, DynamicCache):
            raise ValueError(f"nanoloop models decode with a DynamicCache, not "
                             f"{type(cache).__name__}")
        prompt_loops, depth = self.depth(num_loops, exit, exit_threshold, r_max)
        window = self.model.window(input_ids, attention_mask, position_ids, cache)
        e = self.model.prelude(input_ids, window)
        if window.n_past and depth.test is not None:
            logits, loops = self.loop_until_exit(e, window, depth)
        else:
            logits, loops = self.loop_uniform(e, window, prompt_loops, logits_to_keep)
        if self.loops_of_steps is not None:
            self.loops_of_steps.append(loops[:, -1])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels,
                                      vocab_size=self.config.vocab_size, **kwargs)
        returned_cache = {CACHE_FIELD: cache if use_cache else None}
        output = NanoloopCausalLMOutput(loss=loss, logits=logits, loops=loops, **returned_cache)
        if return_dict is False:
            return output.to_tuple()
        return output

    def loop_uniform(self, e, window, loops, logits_to_keep=0):
        """Every token of e (B, T, d) `loops` loops from the zero state -> (the logits of the last
        logits_to_keep positions (0: all), loops (B, T)); each block's K/V of the last loop
        stored."""
        s = torch.zeros_like(e)
        for _ in range(loops):
            s, core_kv = self.model.core_step(e, s, window)
        window.store(self.model.core_layer, core_kv)
        normed, coda_kv = self.model.coda(s, window)
        window.store(self.model.coda_layer, coda_kv)
        logits = self.lm_head(normed[:, -logits_to_keep:])
        return logits, torch.full(e.shape[:2], loops, dtype=torch.long, device=e.device)

    def loop_until_exit(self, e, window, depth):
        """One new token per row, e (B, 1, d), looped under depth's exit test -> (its logits
        (B, 1, V), the loops each row ran (B, 1)). A row that has stopped keeps its state, its
        last readout and its K/V (its last loop's, stored once every row has stopped) while the
        others loop on."""
        if e.size(1) != 1:
            raise ValueError(f"per-token exits decode one token per row at a time, got "
                             f"{e.size(1)} after a cache of {window.n_past}")
        test = depth.test
        s = torch.zeros_like(e)
        looping = torch.ones(e.size(0), dtype=torch.bool, device=e.device)
        loops_ran = torch.zeros(e.size(0), dtype=torch.long, device=e.device)
        # each row's K/V of its last loop, and the KL exit's readout (float32) carried with it
        core_kv = coda_kv = carried = None
        for loop in range(1, depth.r_max + 1):
            s_new, new_core_kv = self.model.core_step(e, s, window)
            loops_ran += looping
            if core_kv is None:
                core_kv = new_core_kv
            core_kv = keep_rows(looping, new_core_kv, core_kv)
            logits_new = None
            if test.needs_logits:
                normed, new_coda_kv = self.model.coda(s_new, window)
                logits_new = self.lm_head(normed).float()
                if carried is None:
                    carried, coda_kv = logits_new, new_coda_kv
                coda_kv = keep_rows(looping, new_coda_kv, coda_kv)
            # The stop rule: never past r_max; from MIN_EXIT_LOOP on, once the score is below
            # the threshold (a NaN score, never below anything, stops no token).
            go_on = torch.full_like(looping, loop < depth.r_max)
            if loop >= MIN_EXIT_LOOP:
                score = test.score(s_new, s, logits_new, carried)[:, 0]
                go_on &= ~(score < depth.threshold)
            ran = looping[:, None, None]
            s = torch.where(ran, s_new, s)
            if logits_new is not None:
                carried = torch.where(ran, logits_new, carried)
            looping = looping & go_on
            if not looping.any():
                break
        window.store(self.model.core_layer, core_kv)
        if carried is None:
            # the state exit: one readout of each row's final state
            normed, coda_kv = self.model.coda(s, window)
            carried = self.lm_head(normed)
        window.store(self.model.coda_layer, coda_kv)
        return carried, loops_ran[:, None]

    def generate(self, inputs=None, **kwargs):
        """transformers' generate, which also records the loops each new token was read after:
        the prompt's last token's (num_loops) for the first, then each fed token's. They are left
        in `model.generation_loops` (batch, new tokens) and, with return_dict_in_generate=True,
        in the output's `loops` (None under beam search, whose rows are reordered). An exit needs
        the cache: use_cache=False would run every position again at num_loops at every step."""
        settings = kwargs.get("generation_config") or self.generation_config
        if (kwargs.get("exit") or self.config.exit) != "none":
            if generate_setting("use_cache", kwargs, settings, default=True) is False:
                raise ValueError("per-token exits need the cache: use_cache=False runs every "
                                 "position again at num_loops at every step")
        self.loops_of_steps = []
        try:
            output = super().generate(inputs, **kwargs)
        finally:
            steps, self.loops_of_steps = self.loops_of_steps, None
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        prompt = inputs if inputs is not None else kwargs.get("input_ids")
        self.generation_loops = None
        beams = generate_setting("num_beams", kwargs, settings, default=1)
        if beams == 1 and prompt is not None and steps:
            n_new = sequences.size(1) - prompt.size(1)
            self.generation_loops = torch.stack(steps, dim=1)[:, :n_new]
        if not isinstance(output, torch.Tensor):
            output["loops"] = self.generation_loops
        return output
