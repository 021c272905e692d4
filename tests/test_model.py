import math
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import model as model_lib
from configurator import UserError
from model import (CKPT_FORMAT, EXIT_TESTS, GPT, CacheView, DepthPolicy, GPTConfig, autocast, checkpoint_id,
                   exit_depth, load_checkpoint, state_change, token_kl, uniform_depth)

TINY = dict(vocab_size=50, block_size=16, n_embd=32, n_head=4, n_kv_head=2, ffn_hidden=48,
            n_prelude=1, n_core=2, n_coda=1, mean_loops=3, max_loops=6, bptt_k=2)
S0 = dict(n_embd=384, n_head=6, n_kv_head=2, ffn_hidden=1024, mean_loops=4, max_loops=16, bptt_k=4)
S1 = dict(n_embd=576, n_head=9, n_kv_head=3, ffn_hidden=1536, block_size=2048, mean_loops=8, max_loops=32, bptt_k=8)


def tiny(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(**(TINY | kw)))


@pytest.mark.parametrize("shape, unique, total", [(S0, 12.9e6, 31.8e6), (S1, 29.0e6, 57.3e6)])
def test_param_counts_match_the_paper(shape, unique, total):
    with torch.device("meta"):
        model = GPT(GPTConfig(**shape))
    total_params = sum(p.numel() for p in model.parameters())  # the tied head counted once
    unique_params = total_params - model.wte.weight.numel()  # the paper's "unique non-embedding"
    assert round(unique_params, -5) == unique and round(total_params, -5) == total


def test_no_biases_and_tied_head():
    model = tiny()
    assert model.lm_head.weight is model.wte.weight
    assert not [n for n, _ in model.named_parameters() if n.endswith("bias")]
    assert model.core.adapter.weight.shape == (32, 64)


@pytest.mark.parametrize("mode", ["noise", "zero"])
def test_forward_shapes_every_depth(mode):
    model = tiny()
    idx = torch.randint(0, 50, (2, 16))
    for loops in range(1, model.config.max_loops + 1):
        loss = model(idx, idx, loops=loops, state_init=mode)  # training: the loss only, in chunks
        assert loss.dim() == 0 and torch.isfinite(loss)
        logits = model(idx, loops=loops, state_init=mode)
        assert logits.shape == (2, 16, 50)
        if mode == "zero":  # the same computation
            ref = F.cross_entropy(logits.flatten(0, 1), idx.flatten())
            torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    s0 = torch.zeros(2, 16, model.config.n_embd)  # 0 loops: the coda reads s_0
    torch.testing.assert_close(model(idx, loops=0, state_init="zero"), model.readout(s0))
    with pytest.raises(ValueError):
        model(idx, state_init="ones")


def test_noise_init_statistics_and_generator():
    model = tiny()
    e = torch.zeros(4, 16, 32)
    s = model.init_state(e, "noise", torch.Generator().manual_seed(1))
    assert abs(s.std().item() - math.sqrt(2 / 5)) < 0.03
    assert torch.equal(s, model.init_state(e, "noise", torch.Generator().manual_seed(1)))
    assert torch.count_nonzero(model.init_state(e, "zero")) == 0


def unrolled_loss(model, idx, loops, n_grad):
    """A hand-written reference: the loop body spelled out, state detached before the last n_grad."""
    cfg = model.config
    e = model.wte(idx)
    for block in model.prelude_blocks.blocks:
        e = block(e, model.rope_cos[:16], model.rope_sin[:16])
    s = torch.zeros_like(e)
    for i in range(loops):
        if i == loops - n_grad:
            s = s.detach()
        e_in = e if i >= loops - n_grad else e.detach()
        x = model.core.adapter(torch.cat([e_in, s], -1))
        for block in model.core.blocks:
            x = block(x, model.rope_cos[:16], model.rope_sin[:16])
        s = x
    for block in model.coda_blocks.blocks:
        s = block(s, model.rope_cos[:16], model.rope_sin[:16])
    logits = model.lm_head(model.norm(s))
    return F.cross_entropy(logits.view(-1, cfg.vocab_size), idx.view(-1))


def grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loops", [1, 2, 5])
def test_gradients_flow_only_through_last_bptt_k_loops(loops):
    model = tiny()
    idx = torch.randint(0, 50, (2, 16))
    got = grads(model, model(idx, idx, loops=loops, state_init="zero"))
    ref = grads(model, unrolled_loss(model, idx, loops, min(loops, model.config.bptt_k)))
    full = grads(model, unrolled_loss(model, idx, loops, loops))  # full backprop
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-6)
    differs = any(not torch.allclose(got[n], full[n], rtol=1e-4, atol=1e-6) for n in full)
    assert differs == (loops > model.config.bptt_k)  # truncation changes grads only when r > k


def test_kv_cache_path_matches_full_forward_for_any_subset_of_sequences():
    model = tiny().eval()
    idx = torch.randint(0, 50, (3, 16))
    with torch.no_grad():
        e = model.prelude(idx)
        s = model.core_step(e, model.init_state(e, "zero"))
        full = model.readout(s)
        # one token at a time through caches, each at its position (a (1,) tensor, as sample.py decodes)
        caches = model.new_caches(3)
        prelude, core, coda = caches["prelude"], caches["core"], caches["coda"]
        outs = []
        for t in range(16):
            pos = torch.tensor([t])
            e1 = model.prelude(idx[:, t:t + 1], CacheView(prelude, pos))
            s1 = model.core_step(e1, torch.zeros_like(e1), CacheView(core, pos))
            outs.append(model.readout(s1, CacheView(coda, pos)))
        torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-4, atol=1e-5)
        # a prefill of 12 tokens, then the 13th with sequences 0 and 2 active only: sequence 1's slot is left alone
        cache = model.new_caches(3)["core"]
        model.core_step(e[:, :12], torch.zeros_like(e[:, :12]), CacheView(cache))
        before = cache.k[0][1].clone()
        active = torch.tensor([True, False, True])
        next_s = model.core_step(e[:, 12:13], torch.zeros(3, 1, 32), CacheView(cache, torch.tensor([12]), active))
        torch.testing.assert_close(next_s[active], s[active, 12:13], rtol=1e-4, atol=1e-5)
        assert torch.equal(cache.k[0][1], before)


def test_kv_cache_write_places_each_token_at_its_row_and_position():
    model = tiny()
    cache = model.new_caches(3)["prelude"]
    k = torch.randn(3, 2, 2, 8)  # (3 rows, 2 kv heads, 2 tokens, head_dim 8)
    CacheView(cache).write(0, k, -k)  # a prefill: positions 0 and 1 of every row
    assert torch.equal(cache.k[0][:, :, :2], k) and torch.equal(cache.v[0][:, :, :2], -k)
    one = torch.randn(3, 2, 1, 8)  # one new token per row at position 4, written in row 2 only
    CacheView(cache, torch.tensor([4]), torch.tensor([False, False, True])).write(0, one, -one)
    assert torch.equal(cache.k[0][2, :, 4], one[2, :, 0]) and torch.equal(cache.v[0][2, :, 4], -one[2, :, 0])
    written = cache.k[0].abs().sum(dim=(1, 3)) > 0  # (rows, positions)
    assert written.nonzero().tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [2, 0], [2, 1], [2, 4]]


def test_a_decoded_tokens_attention_by_k_v_group_is_the_grouped_query_attention_with_its_mask():
    """A new token's query heads laid out per K/V group (no repeated cache, no math-kernel fallback) give,
    in float64, what grouped-query SDPA with the mask up to its position gives (the layout before)."""
    model = tiny().double()
    attn = model.core.blocks[0].attn  # 4 query heads, 2 K/V heads
    cache = model.new_caches(3)["prelude"]
    cache.k[0].normal_()
    cache.v[0].normal_()
    x = torch.randn(3, 1, 32, dtype=torch.float64)
    pos = torch.tensor([9])
    cos, sin = model.rope(1, CacheView(cache, pos))
    with torch.no_grad():
        y = attn(x, cos, sin, CacheView(cache, pos), 0)
        q = attn.wq(x).view(3, 1, 4, 8).transpose(1, 2)
        q = model_lib.apply_rope(q, cos, sin)
        visible = torch.arange(16) <= pos[:, None]
        expected = F.scaled_dot_product_attention(q, cache.k[0], cache.v[0], attn_mask=visible, enable_gqa=True)
        expected = attn.wo(expected.transpose(1, 2).reshape(3, 1, -1))
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.cuda  # skipped without a GPU (tests/conftest.py)
def test_on_cuda_a_prefill_and_a_decoded_token_run_on_fused_kernels():
    """Neither a prefill (causal, no mask) nor a decoded token (a mask, its heads laid out per K/V group) may
    fall to the math kernel: with only the fused backends allowed, both run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    model = tiny().cuda().eval()
    idx = torch.randint(0, 50, (2, 16), device="cuda")
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16), sdpa_kernel(fused):
        cache = model.new_caches(2)["core"]
        e = model.prelude(idx)
        model.core_step(e[:, :15], torch.zeros_like(e[:, :15]), CacheView(cache))
        model.core_step(e[:, 15:], torch.zeros_like(e[:, 15:]), CacheView(cache, torch.tensor([15], device="cuda")))


def test_token_kl_and_state_change_against_float64_by_hand():
    logits = torch.randn(3, 7, 11) * 5
    assert torch.equal(token_kl(logits, logits), torch.zeros(3, 7))
    other = torch.randn(3, 7, 11)
    p, q = logits.double().softmax(-1), other.double().softmax(-1)
    by_hand = (p * (p.log() - q.log())).sum(-1)  # KL(p || q): weighted by p, the first argument
    reversed_ = (q * (q.log() - p.log())).sum(-1)
    assert (by_hand - reversed_).abs().min() > 1e-3  # the two directions are told apart here
    torch.testing.assert_close(token_kl(logits, other).double(), by_hand, rtol=1e-4, atol=1e-6)
    assert token_kl(logits.bfloat16(), other.bfloat16()).dtype == torch.float32
    a, b = torch.ones(2, 4), torch.zeros(2, 4)
    assert state_change(a, b).tolist() == [2.0, 2.0] and state_change(a, b, relative=True).tolist() == [1.0, 1.0]


def test_exit_scores():
    s_old, s_new = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    old, new = torch.randn(2, 5, 50), torch.randn(2, 5, 50)
    torch.testing.assert_close(EXIT_TESTS["kl"].score(s_new, s_old, new, old), token_kl(new, old))
    relative = (s_new - s_old).norm(dim=-1) / s_new.norm(dim=-1)
    torch.testing.assert_close(EXIT_TESTS["state"].score(s_new, s_old, None, None), relative)
    assert EXIT_TESTS["kl"].needs_logits and not EXIT_TESTS["state"].needs_logits


# a trace's KL scores: rows are loops 1..5 (loop 1 has nothing to compare with), columns four tokens
HAND_BUILT_SCORES = torch.tensor([[math.inf] * 4,
                                  [1e-1, 1e-4, 1e-1, 1e-1],
                                  [1e-4, 1e-4, 1e-2, 1e-1],
                                  [1e-2, 1e-5, 1e-4, 1e-1],
                                  [1e-5, 0.0, 1e-5, 1e-1]])


def kl_exit(threshold, r_max=5):
    return DepthPolicy(EXIT_TESTS["kl"], threshold, r_max)


def test_the_stop_rule_on_hand_built_scores():
    """The first loop from MIN_EXIT_LOOP (2) whose score is below the threshold, else r_max."""
    assert exit_depth(HAND_BUILT_SCORES, kl_exit(1e-3)).tolist() == [3, 2, 4, 5]
    assert exit_depth(HAND_BUILT_SCORES, kl_exit(1e-9)).tolist() == [5, 5, 5, 5]
    assert exit_depth(HAND_BUILT_SCORES, kl_exit(1e-3, r_max=3)).tolist() == [3, 2, 3, 3]
    assert exit_depth(HAND_BUILT_SCORES, uniform_depth(4)).tolist() == [4, 4, 4, 4]
    by_window = exit_depth(HAND_BUILT_SCORES.view(5, 2, 2), kl_exit(1e-3))  # allocate's (loops, n, T)
    assert by_window.tolist() == [[3, 2], [4, 5]]
    with pytest.raises(ValueError):
        exit_depth(HAND_BUILT_SCORES, kl_exit(1e-3, r_max=6))  # deeper than the trace
    diverging = HAND_BUILT_SCORES.clone()
    diverging[1:3, 1] = math.nan  # a NaN score is below no threshold: the token goes on, to loop 4 here
    assert exit_depth(diverging, kl_exit(1e-3)).tolist() == [3, 4, 4, 5]


def test_every_exit_depth_moves_with_min_exit_loop(monkeypatch):
    """MIN_EXIT_LOOP is the one place that says when tests start: at 3, no token stops before loop 3, the
    rest as before; and the FLOP ledger counts one test fewer. (sample.py's decode: test_sample.py.)"""
    monkeypatch.setattr(model_lib, "MIN_EXIT_LOOP", 3)
    assert exit_depth(HAND_BUILT_SCORES, kl_exit(1e-3)).tolist() == [3, 3, 4, 5]
    model = tiny()
    test = EXIT_TESTS["state"]
    with_tests_from_3 = model.inference_flops(5, 16, test)
    monkeypatch.setattr(model_lib, "MIN_EXIT_LOOP", 2)
    assert model.inference_flops(5, 16, test) - with_tests_from_3 == test.flops(model.config)


def test_the_training_loss_is_the_readouts_whatever_the_readout(monkeypatch):
    """One readout for training and inference: a change to GPT.readout (here, its input doubled)
    changes the training loss exactly as it changes the logits inference reads."""
    model = tiny()
    idx = torch.randint(0, 50, (2, 16))
    targets = torch.randint(0, 50, (2, 16))
    readout = GPT.readout

    def doubled(self, s, cache=None, targets=None):
        return readout(self, 2 * s, cache, targets)
    monkeypatch.setattr(GPT, "readout", doubled)
    loss = model(idx, targets, loops=2, state_init="zero")
    logits = model(idx, loops=2, state_init="zero")
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    monkeypatch.undo()
    assert not torch.allclose(loss, model(idx, targets, loops=2, state_init="zero"))  # the change showed


def test_bad_shapes_are_refused_naming_the_field():
    for bad, message in (({"n_embd": 30, "n_head": 4}, "n_head=4 must divide n_embd=30"),
                         ({"n_kv_head": 3}, "n_kv_head=3 must divide n_head"),
                         ({"n_embd": 24, "n_head": 8, "n_kv_head": 1}, "head size n_embd / n_head = 3 must be even"),
                         ({"mean_loops": 7}, "mean_loops=7 > max_loops=6")):
        with pytest.raises(UserError) as err:
            GPTConfig(**(TINY | bad))
        assert message in str(err.value)
    GPTConfig(**(TINY | {"n_prelude": 0, "n_coda": 0, "state_std": 0.0}))  # no prelude or coda, a zero state
    GPTConfig(**(TINY | {"n_embd": 24, "n_head": 4}))  # head size 6 is even


def briefly_trained(steps=40):
    """A tiny model trained on a learnable pattern under bf16 autocast, as train.py does on a GPU."""
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        seq = (torch.randint(0, 7, (8, 1), generator=g) + torch.arange(17)) % 7
        seq = seq + 7 * torch.randint(0, 2, (8, 17), generator=g)
        with autocast("cpu", "bfloat16"):
            loss = model(seq[:, :16], seq[:, 1:], loops=int(torch.randint(1, 6, (), generator=g)))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def test_bf16_autocast_keeps_the_recurrent_state_float32():
    """Issue 17: under bf16 autocast only the matmuls run in bf16. The state s_i stays float32 at every loop, so
    the convergence tail (state changes and KLs far below bf16's 2^-8 relative step) is not rounded away."""
    model = briefly_trained()
    idx = torch.randint(0, 14, (4, 16), generator=torch.Generator().manual_seed(1))
    states, kls = [], []
    seen = []
    model.core.blocks[0].attn.wo.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    with torch.no_grad(), autocast("cpu", "bfloat16"):
        e = model.prelude(idx)
        assert e.dtype == torch.float32
        s = model.init_state(e, "zero")
        prev = model.readout(s)
        for _ in range(24):
            s = model.core_step(e, s)
            assert s.dtype == torch.float32
            logits = model.readout(s)
            kls.append(token_kl(logits, prev))
            states.append(s)
            prev = logits
        assert set(seen) == {torch.bfloat16}  # the matmuls did run in bf16
    deep, before = states[-1], states[-2]
    assert (deep.bfloat16().float() != deep).float().mean() > 0.5  # not values of bf16 numbers
    delta = (deep - before).abs()
    ulp = torch.exp2(torch.floor(torch.log2(deep.abs().clamp_min(1e-30))) - 7)  # bf16's step at each value
    # a bf16 state could move by whole steps only; this one moves by less than half a step, and not by 0
    assert ((delta > 0) & (delta < ulp / 2)).float().mean() > 0.25
    assert state_change(deep, before, relative=True).mean() < state_change(states[3], states[2], True).mean() / 4
    tail = torch.cat([kl.flatten() for kl in kls[-8:]])
    assert tail.dtype == torch.float32 and tail.unique().numel() > tail.numel() // 2  # many distinct values
    assert tail.median() < 1e-4 * kls[0].median() and (tail > 0).float().mean() > 0.5


def test_rope_follows_query_dtype_under_bf16():
    """A float32 rotary table would silently promote bf16 queries and keys (the paper's hidden dtype bug)."""
    model = tiny()
    seen = []
    real_sdpa = F.scaled_dot_product_attention

    def recording_sdpa(q, k, v, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return real_sdpa(q, k, v, **kwargs)
    idx = torch.randint(0, 50, (1, 16))
    with pytest.MonkeyPatch.context() as mp, torch.autocast("cpu", dtype=torch.bfloat16):
        mp.setattr(F, "scaled_dot_product_attention", recording_sdpa)
        model(idx, loops=1)
    assert seen and set(seen) == {(torch.bfloat16,) * 3}


def test_training_loss_is_a_float32_cross_entropy_of_the_readout_under_bf16():
    model = tiny()
    idx = torch.randint(0, 50, (2, 16))
    targets = torch.randint(0, 50, (2, 16))
    targets[0, 3] = -1  # ignored, and not counted in the mean
    with autocast("cpu", "bfloat16"):
        loss = model(idx, targets, loops=2, state_init="zero")
        logits = model(idx, loops=2, state_init="zero")
    assert loss.dtype == torch.float32 and logits.dtype == torch.bfloat16
    # the loss applies the head in float32; these logits left it in bf16: the two agree to bf16's rounding
    per_token = F.cross_entropy(logits.double().flatten(0, 1), targets.flatten(), ignore_index=-1, reduction="none")
    torch.testing.assert_close(loss.double(), per_token.sum() / 31, rtol=2 ** -8, atol=0)  # 31 targets counted


def loss_and_gradients(model, idx, targets, dtype, whole_logits=False):
    """The training loss (float64) at 2 loops from a zero state and each parameter's gradient, under dtype's
    autocast: GPT.forward's, or (whole_logits) the loss before issue 39 written out, from the readout's whole
    logits in float32."""
    model.zero_grad()
    with autocast("cpu", dtype):
        if whole_logits:
            logits = model(idx, loops=2, state_init="zero").float()
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
        else:
            loss = model(idx, targets, loops=2, state_init="zero")
    loss.backward()
    return loss.double().detach(), {name: p.grad.double() for name, p in model.named_parameters()}


def a_loss_case():
    """A tiny model, its inputs and targets, one target ignored (-1) -> (model, idx, targets)."""
    idx = torch.randint(0, 50, (2, 16))
    targets = torch.randint(0, 50, (2, 16))
    targets[0, 3] = -1
    return tiny(), idx, targets


def test_in_float32_the_training_loss_and_gradients_are_the_whole_logits_to_float_precision():
    """Issue 39: F.linear_cross_entropy by chunks computes the loss the whole logits gave, in float32."""
    model, idx, targets = a_loss_case()
    loss, grads = loss_and_gradients(model, idx, targets, "float32")
    whole_loss, whole_grads = loss_and_gradients(model, idx, targets, "float32", whole_logits=True)
    torch.testing.assert_close(loss, whole_loss, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        scale = whole_grads[name].abs().max().item()
        torch.testing.assert_close(grad, whole_grads[name], rtol=0, atol=1e-5 * scale, msg=name)


def test_under_bf16_the_training_loss_and_gradients_move_less_than_bf16s_own_rounding():
    """Under bf16 autocast the loss from the whole logits took them in bf16; the chunked one applies the head
    in float32. The loss and every gradient move from the whole logits' by less than those carry in rounding
    error (their distance to the same step in float64): the change is within the rounding bf16 brings."""
    model, idx, targets = a_loss_case()
    loss, grads = loss_and_gradients(model, idx, targets, "bfloat16")
    whole_loss, whole_grads = loss_and_gradients(model, idx, targets, "bfloat16", whole_logits=True)
    exact_loss, exact_grads = loss_and_gradients(model.double(), idx, targets, "float32", whole_logits=True)
    assert abs(loss - whole_loss) < abs(whole_loss - exact_loss) < 0.01
    for name, grad in grads.items():
        change = (grad - whole_grads[name]).norm()
        whole_error = (whole_grads[name] - exact_grads[name]).norm()
        assert change < whole_error < 0.1 * exact_grads[name].norm(), name


def test_the_training_loss_keeps_no_logits_for_backward():
    """The head's (B, T, vocab) logits are made and dropped a chunk at a time: none is saved for backward."""
    model = tiny()  # vocab 50
    idx = torch.randint(0, 50, (2, 16))
    saved_shapes = []

    def pack(t):
        saved_shapes.append(tuple(t.shape))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx, loops=2)
    assert saved_shapes and not [shape for shape in saved_shapes if shape[-1] == 50]


def test_flops_per_token_counts_grad_loops_three_times():
    model = tiny()
    cfg = model.config
    core = sum(p.numel() for p in model.core.parameters() if p.dim() == 2)  # matmul weights: norms are not counted
    per_loop_fwd = 2 * core + 4 * 16 * cfg.n_embd * cfg.n_core
    assert model.flops_per_token(5, 2, 16) - model.flops_per_token(4, 2, 16) == per_loop_fwd
    assert model.flops_per_token(4, 3, 16) - model.flops_per_token(4, 2, 16) == 2 * per_loop_fwd
    prelude, core_loop, readout = model.flop_terms(16)
    assert core_loop == per_loop_fwd and prelude > 0 and readout > 2 * 50 * 32  # the head is in the readout
    assert model.flops_per_token(4, 2, 16) == 3 * (prelude + readout) + (3 * 2 + 2) * core_loop
    # inference: each loop and readout once, and the exit tests' own cost
    assert model.inference_flops(4, 16) == prelude + 4 * core_loop + readout
    kl, state = EXIT_TESTS["kl"], EXIT_TESTS["state"]  # their own costs: test_exit_test_costs_are_the_ops_they_run
    assert model.inference_flops(4, 16, kl) == prelude + 4 * core_loop + 4 * readout + 3 * kl.flops(cfg)  # tests 2-4
    assert model.inference_flops(4, 16, state) - model.inference_flops(4, 16) == 3 * state.flops(cfg)  # no readout


def math_attention(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    """Attention as two matmuls, which torch's FLOP counter counts (it does not count the CPU's fused kernel)."""
    k = k.repeat_interleave(q.size(1) // k.size(1), 1)
    v = v.repeat_interleave(q.size(1) // v.size(1), 1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if is_causal:
        T = q.size(-2)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    return scores.softmax(-1) @ v


def test_flop_terms_are_what_torchs_flop_counter_counts(monkeypatch):
    """The ledger's prelude, loop and readout against torch.utils.flop_counter on the real forward: every
    matmul, attention's two included (over all T x T scores, as the ledger counts them)."""
    model = tiny()
    monkeypatch.setattr(F, "scaled_dot_product_attention", math_attention)
    B, T = 3, 16
    idx = torch.randint(0, 50, (B, T))
    counted = []
    with torch.no_grad():
        e = model.prelude(idx)
        s = model.init_state(e, "zero")
        for part in (lambda: model.prelude(idx), lambda: model.core_step(e, s), lambda: model.readout(s)):
            with FlopCounterMode(display=False) as counter:
                part()
            counted.append(counter.get_total_flops() / (B * T))
    assert tuple(counted) == model.flop_terms(T)


def saved_bytes(model, idx, loops):
    """Bytes of the tensors autograd saves for backward in one training forward (the weights aside)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx, loops=loops)
    return sum(saved.values())


def test_loops_without_gradients_save_nothing_for_backward():
    """Truncated backprop's memory: a step at any depth keeps the activations of bptt_k loops only."""
    model = tiny()  # bptt_k 2
    idx = torch.randint(0, 50, (2, 16))
    at_k = saved_bytes(model, idx, 2)
    assert saved_bytes(model, idx, 6) == at_k  # 4 more loops, without gradients: nothing more kept
    assert saved_bytes(model, idx, 1) < at_k  # a loop with gradients keeps its activations


def a_checkpoint(**changes):
    """What train.py saves, for a tiny untrained model; `changes` replace or (None) remove keys."""
    model = tiny()
    ckpt = {"format": CKPT_FORMAT, "model_args": dict(TINY), "model": model.state_dict(), "optimizer": {},
            "iter_num": 7, "best_val_loss": 3.0, "config": {"dataset": "tiny"}, "rng": {}}
    ckpt.update(changes)
    return {k: v for k, v in ckpt.items() if v is not None}


class RunsCode:
    """An object whose unpickling would run code: it writes `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "code ran"))


def test_a_missing_or_foreign_checkpoint_is_one_line(tmp_path):
    torch.save({"model": tiny().state_dict()}, tmp_path / "foreign.pt")  # no format marker: not train.py's
    for path, message in ((tmp_path / "none.pt", "no checkpoint at"), (tmp_path, "no checkpoint at"),
                          (tmp_path / "foreign.pt", "is not a nanoloop checkpoint")):
        with pytest.raises(UserError) as err:
            load_checkpoint(str(path))
        assert message in str(err.value) and "\n" not in str(err.value)


def test_a_corrupt_checkpoint_raises_torchs_own_error_and_never_runs_its_code(tmp_path):
    """The policy: a file that exists but is corrupt or hand-edited may raise the library's own exception;
    whatever it holds, a safe load never runs its code."""
    path = tmp_path / "ckpt.pt"
    torch.save(a_checkpoint(config={"dataset": "tiny", "hook": RunsCode(tmp_path / "ran")}), path)
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(str(path))
    assert not (tmp_path / "ran").exists()
    whole = path.read_bytes()
    torch.save(a_checkpoint(), path)
    path.write_bytes(path.read_bytes()[:len(whole) // 2])  # truncated
    with pytest.raises(RuntimeError):
        load_checkpoint(str(path))


def test_a_good_checkpoint_loads_and_only_this_machines_devices_are_named(tmp_path, capsys):
    torch.save(a_checkpoint(), tmp_path / "ckpt.pt")
    model, ckpt = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert ckpt["iter_num"] == 7 and not model.training
    assert checkpoint_id(ckpt) == "unnamed@7"
    assert checkpoint_id(ckpt | {"config": {"run_id": "abc"}}) == "abc@7"
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert model_lib.DEVICES == ("cpu",)  # what every script's --device may name here: cuda is refused


def test_loss_and_kl_per_token_by_chunks_equal_the_whole(monkeypatch):
    """token_loss and token_kl go a few tokens at a time (S1's logits do not fit whole)."""
    logits, prev = torch.randn(2, 2, 7, 300)
    y = torch.randint(300, (2, 7))
    whole_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
    whole_kl = model_lib.token_kl(logits, prev)
    monkeypatch.setattr(model_lib, "LOGITS_CHUNK", 3 * 300)  # 3 tokens per chunk: 5 chunks, the last short
    assert torch.allclose(model_lib.token_loss(logits, y), whole_loss.view(2, 7))
    assert torch.equal(model_lib.token_kl(logits, prev), whole_kl)
    half = logits.bfloat16()  # bf16 logits: the softmax still in float32
    assert model_lib.token_loss(half, y).dtype == torch.float32


def test_the_training_loss_runs_in_a_few_chunks(monkeypatch):
    """readout's loss: the head's logits about LOGITS_CHUNK at a time, 3 chunks at S1 (torch's default for a
    float32 input, "aspect_ratio:2", makes 128 of 64 rows, of 19 kernels each), equal to the whole's mean."""
    model = tiny()
    s = torch.randn(2, 7, TINY["n_embd"])
    y = torch.randint(TINY["vocab_size"], (2, 7))
    y[0, 0] = -1  # not scored
    whole = F.cross_entropy(model.readout(s).flatten(0, 1), y.flatten(), ignore_index=-1)
    rows = []
    options = torch.nn.LinearCrossEntropyOptions
    monkeypatch.setattr(torch.nn, "LinearCrossEntropyOptions",
                        lambda **kw: rows.append(kw["batch_chunk_size"]) or options(**kw))
    monkeypatch.setattr(model_lib, "LOGITS_CHUNK", 5 * TINY["vocab_size"])  # 14 tokens: 3 chunks of 5, 5, 4
    loss = model.readout(s, targets=y)
    assert rows == [5]
    assert torch.allclose(loss, whole, atol=1e-6)


def test_the_stacked_projections_are_wq_wk_wv_and_w_gate_w_up_each_on_its_own():
    """Attention and MLP stack their matrices for one matmul: the same function as each matrix applied on its
    own (q, k, v in that order; gate, up), so that a checkpoint means what it meant."""
    model = tiny().double()
    block = model.core.blocks[0]
    attn, mlp = block.attn, block.mlp
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    cos, sin = model.rope(5)
    with torch.no_grad():
        q = model_lib.apply_rope(attn.wq(x).view(2, 5, 4, 8).transpose(1, 2), cos, sin)
        k = model_lib.apply_rope(attn.wk(x).view(2, 5, 2, 8).transpose(1, 2), cos, sin)
        v = attn.wv(x).view(2, 5, 2, 8).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(attn(x, cos, sin), attn.wo(y.transpose(1, 2).reshape(2, 5, -1)))
        torch.testing.assert_close(mlp(x), mlp.w_down(F.silu(mlp.w_gate(x)) * mlp.w_up(x)))
