"""Tests for sample.py on a tiny model trained for a few steps on a tiny byte-level BPE dataset.
The checkpoint is written here (train.py's format), so these tests need only model.py, prepare.py and
allocate.py's engine. References: nanoGPT's uncached generate for fixed depth, and for per-token exits an
uncached depth-wise recomputation implementing the documented K/V rule (a stopped token is seen by later
loops as it was at its last loop)."""
import copy
import json
import os
import random
import re
import shutil
from functools import partial

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import configurator
import model as model_lib
import prepare
import sample
from configurator import UserError
from model import EXIT_TESTS, MIN_EXIT_LOOP, DepthPolicy, ExitTest, uniform_depth

SEP = "\n---------------\n"
MAX_LOOPS = 4
MODEL_ARGS = dict(vocab_size=300, block_size=64, n_embd=32, n_head=2, n_kv_head=1, ffn_hidden=64, n_prelude=1,
                  n_core=2, n_coda=1, mean_loops=2, max_loops=MAX_LOOPS, bptt_k=4)


def make_dataset(root):
    """data/tiny: a 300-entry byte-level BPE over text with multi-byte characters (café, 日本)."""
    rng = random.Random(0)
    words = "the king queen said to a of and my lord good night café 日本 sweet love thou art".split()
    docs = []
    for _ in range(60):
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))).capitalize() + "."
                 for _ in range(rng.randint(3, 8))]
        docs.append("\n".join(lines) + "\n")
    tok = prepare.train_bpe(300, docs)
    d = root / "data" / "tiny"
    d.mkdir(parents=True)
    tok.save(str(d / "tokenizer.json"))
    counts = {}
    for split, part in (("train", docs[:54]), ("val", docs[54:])):
        ids = [i for doc in part for i in tok.encode(doc, add_special_tokens=False).ids + [0]]
        np.asarray(ids, dtype=np.uint16).tofile(d / f"{split}.bin")
        counts[f"{split}_tokens"] = len(ids)
    meta = dict(source="tiny", tokenizer="bpe:300", vocab_size=300, eot_id=0, dtype="uint16", **counts)
    (d / "meta.json").write_text(json.dumps(meta))
    return meta


def make_checkpoint(root, meta):
    """out/ckpt.pt: the tiny model after 40 AdamW steps at depths cycling 1..MAX_LOOPS."""
    torch.manual_seed(0)
    model = model_lib.GPT(model_lib.GPTConfig(**MODEL_ARGS))
    data = torch.from_numpy(np.fromfile(root / "data/tiny/train.bin", dtype=np.uint16).astype(np.int64))
    opt = model.configure_optimizers(0.1, 3e-3, (0.9, 0.95), "cpu")
    g = torch.Generator().manual_seed(0)
    for step in range(40):
        starts = torch.randint(len(data) - 65, (8,), generator=g).tolist()
        x = torch.stack([data[i:i + 64] for i in starts])
        y = torch.stack([data[i + 1:i + 65] for i in starts])
        _, loss = model(x, y, loops=1 + step % MAX_LOOPS)
        opt.zero_grad()
        loss.backward()
        opt.step()
    (root / "out").mkdir()
    torch.save({"format": model_lib.CKPT_FORMAT, "model_args": MODEL_ARGS, "model": model.state_dict(),
                "optimizer": opt.state_dict(), "iter_num": 40, "best_val_loss": loss.item(),
                "config": {"dataset": "tiny", "dataset_meta": meta}, "rng": {}}, root / "out" / "ckpt.pt")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sample")
    make_checkpoint(root, make_dataset(root))
    yield root


@pytest.fixture
def tiny(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    model, _ = model_lib.load_checkpoint("out/ckpt.pt")
    encode, _ = prepare.load_tokenizer("data/tiny")
    return model, torch.tensor([encode("The king said to my lord")])


def initial_states(model, n_seqs, length, mode, seed, device="cpu"):
    """s_0 of every position (n_seqs, length, d), sequence i's from the generator seed + i: zeros (sample.py's
    start, allocate.py's) or training's noise. generate takes any s_0; its references hold for both."""
    e = torch.empty(1, length, model.config.n_embd, device=device)  # init_state's shape
    generators = [torch.Generator(device).manual_seed(seed + i) for i in range(n_seqs)]
    return torch.cat([model.init_state(e, mode, g) for g in generators])


def small_block(model, block_size=16):
    """The tiny model in float64 (batch shapes cannot flip a decision by rounding), its context cut
    to block_size: the crop rule then acts every block_size // 2 tokens."""
    model = copy.deepcopy(model).double()
    model.config.block_size = block_size
    return model


def GREEDY(logits):
    return logits.argmax(-1)


def sampler(seed, n):
    """Sampling at temperature 1, sequence i with the generator seed + i (as sample.main does)."""
    generators = [torch.Generator().manual_seed(seed + i) for i in range(n)]
    return partial(sample.sample_next, temperature=1.0, top_k=0, generators=generators)


def recording(pick, seen):
    """A pick that also keeps (a copy of) the logits it was given: the engine overwrites them the next step."""
    def pick_and_keep(logits):
        seen.append(logits.clone())
        return pick(logits)
    return pick_and_keep


def prompts(n, length=12):
    """n different prompts: windows of the tiny val text."""
    val = torch.from_numpy(np.fromfile("data/tiny/val.bin", dtype=np.uint16).astype(np.int64))
    return torch.stack([val[23 * i:23 * i + length] for i in range(n)])


def generate_all(model, idx, n_new, s0, pick, prompt_depth, new_depth=None, compiler=None):
    """sample.generate run to the end -> (prompts and new tokens (B, T0 + n_new), the loops run by the
    token each new token was read from (B, n_new): the prompt's last, then each fed new token)."""
    new_depth = new_depth or prompt_depth
    steps = list(sample.generate(model, idx, n_new, s0, pick, prompt_depth.r_max, new_depth, compiler))
    new_tokens = torch.stack([token for token, _ in steps], dim=1)
    loops = torch.stack([loops for _, loops in steps], dim=1)
    return torch.cat([idx, new_tokens], dim=1), loops


def counting_prefills(monkeypatch):
    """-> the number of tokens of every prefill (the prompt's, then each refill's), as they come."""
    calls = []
    prefill = sample.prefill

    def counted(model, caches, tokens, s, loops):
        calls.append(tokens.size(1))
        return prefill(model, caches, tokens, s, loops)
    monkeypatch.setattr(sample, "prefill", counted)
    return calls


# ---- the reference: Huginn's K/V rule written out by hand, without KVCache or sample.py --------
def run_stack(model, blocks, x, positions, past):
    """blocks over x (1, T, d) at positions (T,): each token attends to past[layer] (the K/V lists of
    the tokens before, as they last computed them) and causally to the T new ones.
    -> (x, [(k, v)] per layer of the T new tokens)."""
    new_kv = []
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]
    for layer, block in enumerate(blocks):
        attn = block.attn
        h = block.attn_norm(x)
        T = h.size(1)
        q = attn.wq(h).view(1, T, attn.n_head, attn.head_dim).transpose(1, 2)
        k = attn.wk(h).view(1, T, attn.n_kv_head, attn.head_dim).transpose(1, 2)
        v = attn.wv(h).view(1, T, attn.n_kv_head, attn.head_dim).transpose(1, 2)
        q, k = model_lib.apply_rope(q, cos, sin), model_lib.apply_rope(k, cos, sin)
        keys = torch.cat([pk for pk, _ in past[layer]] + [k], dim=2)
        values = torch.cat([pv for _, pv in past[layer]] + [v], dim=2)
        n_past = keys.size(2) - T
        visible = torch.ones(T, n_past + T, dtype=torch.bool).tril(n_past)
        y = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=visible, enable_gqa=True)
        x = x + block.attn_post(attn.wo(y.transpose(1, 2).reshape(1, T, -1)))
        x = x + block.mlp_post(block.mlp(block.mlp_norm(x)))
        new_kv.append((k, v))
    return x, new_kv


def reference_feed(model, tokens, s, positions, past, depth):
    """New tokens (1, T) looping together: every token r_max loops (T > 1: a prefill at uniform depth),
    or a single token until its exit test. Appends their K/V to past, the core's and (KL exit) the
    coda's of their last loop. -> (the last token's logits (V,), its loops)."""
    e, prelude_kv = run_stack(model, model.prelude_blocks.blocks, model.wte(tokens), positions, past["prelude"])
    test = depth.test
    logits = None
    for loop in range(1, depth.r_max + 1):
        x = model.core.adapter(torch.cat([e, s], dim=-1)).to(e.dtype)
        s_new, core_kv = run_stack(model, model.core.blocks, x, positions, past["core"])
        stop = loop == depth.r_max
        if test is not None and test.needs_logits:
            coda_x, coda_kv = run_stack(model, model.coda_blocks.blocks, s_new, positions, past["coda"])
            new_logits = model.lm_head(model.norm(coda_x))
            stop = stop or loop >= MIN_EXIT_LOOP and test.score(s_new, s, new_logits, logits) < depth.threshold
            logits = new_logits
        elif test is not None:
            stop = stop or loop >= MIN_EXIT_LOOP and test.score(s_new, s, None, None) < depth.threshold
        s = s_new
        if stop:
            break
    if logits is None:
        coda_x, coda_kv = run_stack(model, model.coda_blocks.blocks, s, positions, past["coda"])
        logits = model.lm_head(model.norm(coda_x))
    for part, kv in (("prelude", prelude_kv), ("core", core_kv), ("coda", coda_kv)):
        for layer, (k, v) in enumerate(kv):
            past[part][layer].append((k, v))
    return logits[0, -1], loop


@torch.no_grad()
def reference_generate(model, prompt, n_new, s0, pick, prompt_depth, new_depth):
    """One sequence (prompt (T0,), s0 (T0 + n_new, d)) as sample.py's documented rule has it: the prompt
    prefilled together; each new token alone at the next position, seeing every earlier token's K/V of
    its last loop; a new token that finds the context full keeps the last block_size // 2 tokens before
    it, prefilled again together. -> (tokens, the loops of the token each new token was read from)."""
    block = model.config.block_size
    tokens = prompt.tolist()

    def empty_past():
        c = model.config
        return {"prelude": [[] for _ in range(c.n_prelude)], "core": [[] for _ in range(c.n_core)],
                "coda": [[] for _ in range(c.n_coda)]}

    def prefill(first, last):
        past = empty_past()
        ids = torch.tensor([tokens[first:last]])
        logits, loops = reference_feed(model, ids, s0[None, first:last], torch.arange(last - first), past,
                                       prompt_depth)
        return past, logits, loops
    first = max(0, len(tokens) - block)
    past, logits, loops = prefill(first, len(tokens))
    read_after = []
    for step in range(n_new):
        tokens.append(int(pick(logits[None])[0]))
        read_after.append(loops)
        if step == n_new - 1:
            break
        t = len(tokens) - 1
        n_cached = sum(k.size(2) for k, _ in past["core"][0])  # tokens in the context
        if n_cached == block:
            past, _, _ = prefill(t - block // 2, t)
            n_cached = block // 2
        logits, loops = reference_feed(model, torch.tensor([[tokens[t]]]), s0[None, t:t + 1],
                                       torch.tensor([n_cached]), past, new_depth)
    return tokens, read_after


def test_the_reference_is_nanogpts_generate_at_one_loop(tiny):
    """At 1 loop every token's last loop is its only one: the rule is plain causal attention, and the
    reference equals model.forward recomputed for every new token."""
    model, idx = tiny
    s0 = torch.zeros(idx.size(1) + 12, model.config.n_embd)
    tokens, _ = reference_generate(model, idx[0], 12, s0, GREEDY, uniform_depth(1), uniform_depth(1))
    reference = idx
    with torch.no_grad():
        for _ in range(12):
            logits = model(reference, loops=1, state_init="zero")[0][:, -1]
            reference = torch.cat([reference, logits.argmax(-1, keepdim=True)], 1)
    assert tokens == reference[0].tolist()


@pytest.mark.parametrize("loops", [1, 2, MAX_LOOPS + 2])
@pytest.mark.parametrize("mode", ["zero", "noise"])
def test_fixed_depth_equals_the_reference(tiny, loops, mode):
    model, idx = tiny
    idx = idx.expand(2, -1)  # a batch of two: with noise init the rows differ
    s0 = initial_states(model, 2, idx.size(1) + 16, mode, 7, "cpu")
    for pick in (GREEDY, sampler(0, 2)):
        seen = []
        out, depths = generate_all(model, idx, 16, s0, recording(pick, seen), uniform_depth(loops))
        assert torch.equal(depths, torch.full((2, 16), loops))
        for b in range(2):
            reference_pick = GREEDY if pick is GREEDY else sampler(b, 1)
            tokens, _ = reference_generate(model, idx[b], 16, s0[b], reference_pick, uniform_depth(loops),
                                           uniform_depth(loops))
            assert out[b].tolist() == tokens
    assert torch.equal(seen[0][0], seen[0][1]) == (mode == "zero")


@pytest.mark.parametrize("T0", [5, 20])  # 20: the prompt itself is longer than block_size 16
@pytest.mark.parametrize("loops", [1, 3])
def test_generation_far_past_block_size_equals_the_reference(tiny, monkeypatch, T0, loops):
    """Block 16, 60 new tokens: the context is refilled 6 times or more; every token equals the
    reference's (noise init: each token starts from its own row of s0 in both)."""
    model = small_block(tiny[0])
    idx = prompts(3, T0)
    s0 = initial_states(model, 3, T0 + 60, "noise", 3, "cpu").double()
    prefills = counting_prefills(monkeypatch)
    out, depths = generate_all(model, idx, 60, s0, GREEDY, uniform_depth(loops))
    for b in range(3):
        tokens, _ = reference_generate(model, idx[b], 60, s0[b], GREEDY, uniform_depth(loops), uniform_depth(loops))
        assert out[b].tolist() == tokens
    assert len({tuple(row.tolist()) for row in out}) == 3 and (depths == loops).all()
    assert prefills[0] == min(T0, 16) and len(prefills) >= 7 and set(prefills[1:]) == {8}  # half a block


# ---- per-token exits -----------------------------------------------------------------------------
def typical_threshold(model, test):
    """The median exit score after loops 2..MAX_LOOPS on the tiny val text: tokens stop at varied depths."""
    val = torch.from_numpy(np.fromfile("data/tiny/val.bin", dtype=np.uint16).astype(np.int64))[None, :64]
    with torch.no_grad():
        e = model.prelude(val)
        s = model.init_state(e, "zero")
        logits = model.readout(s)
        scores = []
        for i in range(1, MAX_LOOPS + 1):
            s_new = model.core_step(e, s)
            new = model.readout(s_new)
            if i >= MIN_EXIT_LOOP:
                scores.append(test.score(s_new, s, new, logits))
            s, logits = s_new, new
    return torch.cat(scores).median().item()


@pytest.mark.parametrize("exit", ["kl", "state"])
def test_adaptive_generation_far_past_block_size_equals_the_reference(tiny, monkeypatch, exit):
    """Batch 3, block 16, 40 new tokens with per-token exits: each sequence equals the reference alone,
    its new tokens at varied depths, the context refilled past block_size."""
    model = small_block(tiny[0])
    idx = prompts(3)
    test = EXIT_TESTS[exit]
    policy = DepthPolicy(test, typical_threshold(model, test), MAX_LOOPS + 2)
    s0 = torch.zeros(3, idx.size(1) + 40, model.config.n_embd, dtype=torch.float64)
    prefills = counting_prefills(monkeypatch)
    out, depths = generate_all(model, idx, 40, s0, GREEDY, uniform_depth(2), policy)
    assert len({tuple(d.tolist()) for d in depths}) > 1 and len(set(depths.flatten().tolist())) > 2
    assert len(prefills) >= 5
    for b in range(3):
        tokens, read_after = reference_generate(model, idx[b], 40, s0[b], GREEDY, uniform_depth(2), policy)
        assert out[b].tolist() == tokens and depths[b].tolist() == read_after


@pytest.mark.parametrize("exit", ["kl", "state"])
def test_batched_adaptive_generation_equals_each_sequence_alone(tiny, exit):
    """Past block_size too (block 16, 40 new tokens); sampled with noise init as well as greedy."""
    model = small_block(tiny[0])
    idx = prompts(3)
    test = EXIT_TESTS[exit]
    policy = DepthPolicy(test, typical_threshold(model, test), MAX_LOOPS + 2)
    for mode, make_pick in (("zero", lambda seed, n: GREEDY), ("noise", sampler)):
        s0 = initial_states(model, 3, idx.size(1) + 40, mode, 11, "cpu").double()
        out, depths = generate_all(model, idx, 40, s0, make_pick(11, 3), uniform_depth(2), policy)
        assert len({tuple(d.tolist()) for d in depths}) > 1  # the sequences really ran different depths
        for b in range(3):
            s0_b = initial_states(model, 1, idx.size(1) + 40, mode, 11 + b, "cpu").double()
            out_b, depths_b = generate_all(model, idx[b:b + 1], 40, s0_b, make_pick(11 + b, 1),
                                           uniform_depth(2), policy)
            assert torch.equal(out_b[0], out[b]) and torch.equal(depths_b[0], depths[b])


@pytest.mark.parametrize("exit", ["kl", "state"])
def test_adaptive_threshold_zero_is_fixed_r_max_and_huge_stops_at_loop_2(tiny, exit):
    model, idx = tiny
    test = EXIT_TESTS[exit]
    s0 = initial_states(model, 1, idx.size(1) + 20, "noise", 3, "cpu")
    fixed, _ = generate_all(model, idx, 20, s0, GREEDY, uniform_depth(MAX_LOOPS))
    never = DepthPolicy(test, 0.0, MAX_LOOPS)
    adaptive, depths = generate_all(model, idx, 20, s0, GREEDY, uniform_depth(MAX_LOOPS), never)
    assert torch.equal(fixed, adaptive) and (depths == MAX_LOOPS).all()
    at_once = DepthPolicy(test, 1e9, MAX_LOOPS)
    _, depths = generate_all(model, idx, 20, s0, GREEDY, uniform_depth(2), at_once)
    assert (depths == 2).all()  # no exit before loop 2, for either test


def test_the_cache_holds_each_tokens_last_loop(tiny):
    """Exit decisions scripted (each new token runs schedule[i] loops): every core write is recorded.
    Each position is written once per loop its token ran, and its slot ends with its last loop's K/V."""
    model, idx = tiny
    schedule = [3, 2, 5, 2, 2, 4]  # loops of each fed new token, deeper and shallower than the prompt's 2
    stops = iter([loop == n for n in schedule for loop in range(1, n + 1)])  # tested at every loop, heeded from 2

    def scripted(s_new, s_old, logits_new, logits_old):  # 0 (stop) or 1 (go on), one per token
        return torch.tensor([[0.0 if next(stops) else 1.0]])
    policy = DepthPolicy(ExitTest(scripted, lambda config: 0, needs_logits=False), 0.5, 6)
    writes = []
    core_caches = []
    real_write, real_new_cache = model_lib.CacheView.write, model.new_cache

    def recording_write(view, layer, k, v):
        if view.cache is core_caches[0]:
            positions = list(range(k.size(2))) if view.pos is None else view.pos.tolist()
            writes.append((layer, positions, k[0].clone()))
        real_write(view, layer, k, v)

    def recording_new_cache(n_layers, batch):
        cache = real_new_cache(n_layers, batch)
        if n_layers == model.config.n_core:
            core_caches.append(cache)
        return cache
    s0 = initial_states(model, 1, idx.size(1) + len(schedule) + 1, "zero", 0, "cpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_lib.CacheView, "write", recording_write)
        mp.setattr(model, "new_cache", recording_new_cache)
        _, depths = generate_all(model, idx, len(schedule) + 1, s0, GREEDY, uniform_depth(2), policy)
    assert depths[0, 1:].tolist() == schedule
    loops_of = [2] * idx.size(1) + schedule
    core = core_caches[0]
    for layer in range(model.config.n_core):
        per_position = {}
        for w_layer, positions, k in writes:
            for j, p in enumerate(positions):
                if w_layer == layer:
                    per_position.setdefault(p, []).append(k[:, j])
        assert {p: len(ks) for p, ks in per_position.items()} == dict(enumerate(loops_of))
        for p, ks in per_position.items():
            assert torch.equal(core.k[layer][0, :, p], ks[-1])


# ---- a decode step without host waits -------------------------------------------------------------
aten = torch.ops.aten
HOST_READS = (aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.nonzero.default)


class CountingSyncs(TorchDispatchMode):
    """Counts the ops that make the host wait for a GPU: a value read on the host (item, a nonzero's
    size, a tensor's truth) or a copy to another device. On the CPU nothing waits, but the same ops run."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        devices = {t.device for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)}
        copies_across = func in (aten._to_copy.default, aten.copy_.default) and len(devices) > 1
        if func in HOST_READS or copies_across:
            self.count += 1
        return out


def test_the_sync_counter_sees_what_the_old_engine_did():
    """The old engine's nonzero() and .item() each loop, and a copy to another device: each counted; a
    copy on the same device is not."""
    looping = torch.tensor([True, False, True])
    with CountingSyncs() as syncs:
        rows = looping.nonzero()[:, 0]
        looping[rows].any().item()
        looping.to("meta")  # (a copy to a GPU reads the same)
        looping.clone()
    assert syncs.count == 3


@pytest.mark.parametrize("exit", ["none", "kl", "state"])
def test_a_decode_step_reads_nothing_on_the_host_but_its_exit_flags(tiny, exit):
    """Uniform depth: no host read in generate at all. With an exit: one read of "no row is looping"
    after each loop from MIN_EXIT_LOOP, until one finds every row stopped (the deepest token's loops - 1)."""
    model = small_block(tiny[0])
    idx = prompts(3)
    policy = uniform_depth(3)
    if exit != "none":
        policy = DepthPolicy(EXIT_TESTS[exit], typical_threshold(model, EXIT_TESTS[exit]), MAX_LOOPS + 2)
    s0 = initial_states(model, 3, idx.size(1) + 30, "noise", 5, "cpu").double()
    with CountingSyncs() as syncs:
        _, depths = generate_all(model, idx, 30, s0, sampler(5, 3), uniform_depth(2), policy)
    deepest = depths[:, 1:].amax(0)  # (steps,): each decode step's deepest token
    expected = 0 if exit == "none" else (deepest - 1).sum().item()
    assert syncs.count == expected and (exit == "none" or len(set(deepest.tolist())) > 1)


class CountingOps(TorchDispatchMode):
    """Counts the aten ops dispatched outside the decode steps given to generate's compiler, which stand for
    compiled code (on a GPU, CUDA graphs): what is left is what the host launches op by op."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.in_compiled_code = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not self.in_compiled_code
        return func(*args, **(kwargs or {}))

    def compiler(self, step):
        def compiled(*args):
            self.in_compiled_code = True
            try:
                return step(*args)
            finally:
                self.in_compiled_code = False
        return compiled


@pytest.mark.parametrize("exit", ["none", "kl", "state"])
def test_a_new_token_launches_at_most_30_ops_outside_compiled_code_at_s0s_shape(exit):
    """The paper's S0 (vocabulary 49,152, width 384, 2/4/2 blocks), batch 2, 4 loops a token (an exit: at most 4,
    and since it never fires, a flag read after loops 2, 3 and 4): per new token, counted as the difference
    between 20 and 10 new tokens. The engine before this one launched ~336."""
    torch.manual_seed(0)
    model = model_lib.GPT(model_lib.GPTConfig()).eval()
    idx = torch.randint(0, 49152, (2, 8))
    policy = uniform_depth(4)
    if exit != "none":
        policy = DepthPolicy(EXIT_TESTS[exit], 0.0, 4)  # a test that never fires: every token runs r_max
    per_run = []
    for n_new in (10, 20):
        s0 = torch.zeros(2, 8 + n_new, 384)
        counting = CountingOps()
        with counting:
            generate_all(model, idx, n_new, s0, GREEDY, uniform_depth(4), policy, counting.compiler)
        per_run.append(counting.count)
    per_token = (per_run[1] - per_run[0]) / 10
    assert per_token <= 30, per_token


@pytest.mark.parametrize("exit", ["none", "kl"])
def test_main_never_waits_for_a_token(tiny, capsys, exit):
    """The new tokens stay on the device, read once at the end: no wait a step but an exit's flag reads."""
    for n_samples in (1, 3):
        counts = []
        for n_new in (10, 30):
            with CountingSyncs() as syncs:
                run_main(capsys, f"--num_samples={n_samples}", f"--max_new_tokens={n_new}", f"--exit={exit}",
                         "--exit_threshold=0", "--r_max=2")  # the exit runs 2 loops: one flag read a token
            counts.append(syncs.count)
        exit_reads = 0 if exit == "none" else 1
        assert (counts[1] - counts[0]) == 20 * exit_reads


def counting_calls(calls):
    """A compiler for generate that compiles nothing and records the name of each step run (begin, loop, end)."""
    def compiler(step):
        def counted(*args):
            calls.append(step.__name__)
            return step(*args)
        return counted
    return compiler


def test_a_gpu_reads_each_flag_one_loop_late_and_the_extra_loop_changes_nothing(tiny, monkeypatch):
    """LOOPS_AHEAD as on CUDA, run on the CPU: every step runs one loop past its deepest token (fully masked),
    except at r_max, and every token and depth is what reading at once gives."""
    model = small_block(tiny[0])
    idx = prompts(3)
    test = EXIT_TESTS["kl"]
    policy = DepthPolicy(test, typical_threshold(model, test), MAX_LOOPS + 2)
    s0 = initial_states(model, 3, idx.size(1) + 30, "noise", 2, "cpu").double()
    at_once = generate_all(model, idx, 30, s0, sampler(2, 3), uniform_depth(2), policy)
    monkeypatch.setitem(sample.LOOPS_AHEAD, "cpu", 1)
    calls = []
    late = generate_all(model, idx, 30, s0, sampler(2, 3), uniform_depth(2), policy, counting_calls(calls))
    assert torch.equal(late[0], at_once[0]) and torch.equal(late[1], at_once[1])
    deepest = at_once[1][:, 1:].amax(0)  # each step's deepest token: its flag is read one loop later
    assert calls.count("loop") == (deepest + (deepest < MAX_LOOPS + 2)).sum() and (deepest < MAX_LOOPS + 2).any()
    assert calls.count("begin") == calls.count("end") == 29


def test_the_compiled_decode_steps_equal_eager_without_graph_breaks_or_recompiles(tiny, fresh_compiler):
    """Each of a decode step's three parts under torch.compile(fullgraph=True) (inductor on the CPU), 100 new
    tokens with a KL exit, batch 2, past block_size: three graphs, never recompiled, the same tokens and
    loops as eager."""
    model = small_block(tiny[0])
    idx = prompts(2)
    test = EXIT_TESTS["kl"]
    policy = DepthPolicy(test, typical_threshold(model, test), MAX_LOOPS)
    s0 = torch.zeros(2, idx.size(1) + 100, model.config.n_embd, dtype=torch.float64)
    eager = generate_all(model, idx, 100, s0, GREEDY, uniform_depth(2), policy)
    with torch._dynamo.config.patch(error_on_recompile=True):  # never monkeypatch: its undo hides the entry
        compiled = generate_all(model, idx, 100, s0, GREEDY, uniform_depth(2), policy,
                                partial(torch.compile, fullgraph=True))
    counters = fresh_compiler
    assert counters["stats"]["unique_graphs"] == 3 and not counters["graph_break"]
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
    assert len(set(eager[1].flatten().tolist())) > 2  # the exit really stopped tokens at varied loops


needs_cuda = pytest.mark.cuda  # skipped without a GPU; with one, the scripts keep their CUDA defaults (conftest.py)


@needs_cuda
def test_on_cuda_a_decode_step_at_uniform_depth_never_syncs(tiny):
    model = tiny[0].cuda()
    idx = tiny[1].cuda()
    s0 = initial_states(model, 1, idx.size(1) + 20, "zero", 0, "cuda")
    torch.cuda.set_sync_debug_mode("error")  # a synchronizing CUDA call raises
    try:
        steps = list(sample.generate(model, idx, 20, s0, GREEDY, 2, uniform_depth(3)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(steps) == 20


@needs_cuda
@pytest.mark.parametrize("exit", ["none", "kl", "state"])
def test_on_cuda_the_decode_steps_run_in_cuda_graphs_and_equal_eager(tiny, fresh_compiler, exit):
    """CUDA graphs (mode reduce-overhead), 100 new tokens past block_size, in float64 so that no rounding can
    flip a token or an exit: the same tokens as eager, three graphs, no recompilation, no CUDA-graph skip, and
    each graph recorded once (a compiled step's output kept alive would record a new one every token)."""
    from studies.gpu_check import cuda_graphs_recorded
    model = small_block(tiny[0]).cuda()
    idx = prompts(2).cuda()
    policy = uniform_depth(3)
    if exit != "none":
        test = EXIT_TESTS[exit]
        policy = DepthPolicy(test, typical_threshold(model.cpu(), test), MAX_LOOPS)
        model.cuda()
    s0 = torch.zeros(2, idx.size(1) + 100, model.config.n_embd, dtype=torch.float64, device="cuda")
    eager = generate_all(model, idx, 100, s0, GREEDY, uniform_depth(2), policy)
    compiler = partial(torch.compile, mode="reduce-overhead", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = generate_all(model, idx, 100, s0, GREEDY, uniform_depth(2), policy, compiler)
    counters = fresh_compiler  # cleared before the test, as sample.py's compiled line reads them
    assert counters["stats"]["unique_graphs"] == 3 and not counters["graph_break"]
    assert not torch._dynamo.utils.guard_failures  # no guard failed: nothing compiled again
    assert counters["inductor"]["cudagraph_skips"] == 0  # every graph runs as a CUDA graph
    assert cuda_graphs_recorded() == 3  # begin, loop and end, each replayed at every token
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])


def test_main_compiled_says_how_many_graphs_ran_and_that_none_broke_recompiled_or_skipped(tiny, capsys, monkeypatch,
                                                                                           fresh_compiler):
    """--compile's line: what torch.compile did in this run (aot_eager stands in for inductor: the same graphs,
    without its compile time; on a GPU the CUDA-graph skips count too)."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", partial(real_compile, backend="aot_eager"))
    eager = run_main(capsys, "--exit=kl", "--exit_threshold=0.01", "--num_samples=2", "--max_new_tokens=80")
    compiled = run_main(capsys, "--compile=True", "--exit=kl", "--exit_threshold=0.01", "--num_samples=2",
                        "--max_new_tokens=80")  # past block_size (64)
    assert compiled[0] == eager[0]
    assert "compiled: 3 graphs, 0 graph breaks, 0 recompilations, 0 CUDA-graph skips" in compiled[2]


# ---- dtype -----------------------------------------------------------------------------------
@pytest.mark.parametrize("exit", ["none", "kl", "state"])
def test_bfloat16_autocast_generates_close_to_float32(tiny, exit):
    model, idx = tiny
    s0 = initial_states(model, 1, idx.size(1) + 20, "zero", 0, "cpu")
    policy = uniform_depth(2) if exit == "none" else DepthPolicy(EXIT_TESTS[exit], 1e-3, MAX_LOOPS)
    first = {}
    for dtype in ("float32", "bfloat16"):
        seen = []
        with model_lib.autocast("cpu", dtype):
            out, depths = generate_all(model, idx, 20, s0, recording(GREEDY, seen), uniform_depth(2), policy)
            cache = model.new_cache(1, 1)
        first[dtype] = seen[0].float()
        assert cache.k[0].dtype == getattr(torch, dtype)  # K/V stored in the dtype attention computes in
        assert out.shape == (1, idx.size(1) + 20) and 0 <= out.min() <= out.max() < 300
    torch.testing.assert_close(first["bfloat16"], first["float32"], atol=0.15, rtol=0.02)
    assert not torch.equal(first["bfloat16"], first["float32"])  # the matmuls really ran in bf16


# ---- the command line --------------------------------------------------------------------------
def run_main(capsys, *args):
    new_ids = sample.main(["--out_dir=out", "--start=The king", "--max_new_tokens=30", "--device=cpu", *args])
    captured = capsys.readouterr()
    return new_ids, captured.out, captured.err


def one_line_error(capsys, *args):
    """main with args must refuse them: exit 2 and one line on stderr, through configurator.run."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("sys.argv", ["sample.py", "--out_dir=out", "--start=The king", "--max_new_tokens=30", *args])
        with pytest.raises(SystemExit) as exit_:
            configurator.run(sample.main)
    stderr = capsys.readouterr().err
    assert exit_.value.code == 2 and stderr.startswith("error: ") and stderr.count("\n") == 1, stderr
    return stderr


@pytest.mark.parametrize("exit", ["none", "kl", "state"])
def test_main_runs_in_bfloat16(tiny, capsys, exit):
    _, text, err = run_main(capsys, "--dtype=bfloat16", f"--exit={exit}", "--num_samples=2", "--seed=2")
    assert text.count(SEP) == 2 and text.startswith("The king") and "bfloat16" in err and "tokens/s" in err


def test_printed_text_and_reproducible_sampling(tiny, capsys):
    _, decode = prepare.load_tokenizer("data/tiny")
    prompt = prepare.load_tokenizer("data/tiny")[0]("The king")
    new_ids, text, err = run_main(capsys, "--num_samples=2", "--temperature=1.0", "--seed=5")
    assert len(new_ids) == 2 and all(len(row) == 30 for row in new_ids)
    assert text == "".join(decode(prompt + row) + SEP for row in new_ids)  # every sample, whole
    assert "tokens/s" in err and "MFLOP per token" in err
    assert run_main(capsys, "--num_samples=2", "--temperature=1.0", "--seed=5")[1] == text
    assert run_main(capsys, "--num_samples=2", "--temperature=1.0", "--seed=6")[1] != text
    alone = run_main(capsys, "--num_samples=1", "--temperature=1.0", "--seed=5")[1]
    assert alone == text.split(SEP)[0] + SEP  # sequence 0 is the same alone


def test_main_starts_from_zero_and_reports_loops(tiny, capsys, monkeypatch):
    """Every token's loops start from a zero state, as allocate.py calibrates the exits: the state it
    generates from is zeros, whatever the seed, and the report counts each new token's loops."""
    args = ("--num_samples=2", "--exit=kl", "--exit_threshold=1e-3", "--seed=1")
    starts = []
    real_generate = sample.generate

    def watched(model, idx, max_new_tokens, s0, *rest):
        starts.append(s0)
        return real_generate(model, idx, max_new_tokens, s0, *rest)
    monkeypatch.setattr(sample, "generate", watched)
    _, text, err = run_main(capsys, *args)
    assert text.count(SEP) == 2 and text.startswith("The king")
    assert re.search(r"^loops per new token \(loops:tokens\):( \d+:\d+)+$", err, re.M)
    assert run_main(capsys, *args)[1] == text
    assert all(not s0.any() for s0 in starts) and starts[0].shape == (2, len(starts[0][0]), 32)


@pytest.mark.parametrize("exit", ["kl", "state"])
def test_the_exit_threshold_is_allocates_for_this_checkpoint_else_the_tests_own(tiny, capsys, exit):
    """Without --exit_threshold: the operating threshold allocate.py wrote for this very checkpoint, else the
    exit test's default (its allocate.json from another checkpoint is not this one's); given, it is used."""
    def threshold_line(*args):
        err = run_main(capsys, f"--exit={exit}", "--max_new_tokens=3", *args)[2]
        return re.search(rf"^--exit={exit} at threshold (\S+): (.*)$", err, re.M).groups()
    assert threshold_line() == (f"{EXIT_TESTS[exit].threshold:.3g}", "the exit test's default (no allocate.json "
                                                                     "for this checkpoint)")
    ckpt = torch.load("out/ckpt.pt", weights_only=True)
    calibrated = {"checkpoint": model_lib.checkpoint_id(ckpt), "operating_thresholds": {exit: 0.0123}}
    try:
        for checkpoint, expected in ((calibrated["checkpoint"], "0.0123"), ("another@40", None)):
            with open("out/allocate.json", "w") as f:
                json.dump(calibrated | {"checkpoint": checkpoint}, f)
            threshold, source = threshold_line()
            assert threshold == (expected or f"{EXIT_TESTS[exit].threshold:.3g}")
            assert ("allocate.py" in source) == (expected is not None)
        assert threshold_line("--exit_threshold=0.5") == ("0.5", "--exit_threshold")
    finally:
        os.remove("out/allocate.json")  # the module's checkpoint is shared by the tests after this one


def test_every_decoded_depth_moves_with_min_exit_loop(tiny, monkeypatch):
    """MIN_EXIT_LOOP = 3: a huge threshold stops every new token at loop 3, not 2."""
    model, idx = tiny
    s0 = initial_states(model, 1, idx.size(1) + 10, "zero", 0, "cpu")
    at_once = DepthPolicy(EXIT_TESTS["state"], 1e9, MAX_LOOPS)
    monkeypatch.setattr(model_lib, "MIN_EXIT_LOOP", 3)
    _, depths = generate_all(model, idx, 10, s0, GREEDY, uniform_depth(2), at_once)
    assert (depths[:, 1:] == 3).all()


def test_r_max_defaults_to_the_models_max_loops(tiny, capsys):
    _, _, err = run_main(capsys, "--exit=state", "--exit_threshold=0")  # never stops early
    # 3 samples of 30 new tokens: the first read after the prompt (mean_loops 2), the rest at r_max
    assert f"loops per new token (loops:tokens): 2:3 {MAX_LOOPS}:87" in err


def test_tokens_per_second_count_the_decode_steps_after_a_warm_up(tiny, capsys, monkeypatch):
    """Timed from the end of the second decode step (the warm-up: compiling, then recording CUDA graphs) to the
    end: the prefill's token and the warm-up's are not counted. Beside the mean loops, each step's deepest."""
    readings = iter([0.0, 10.0, 14.0])  # before the prefill, after the warm-up steps, at the end
    monkeypatch.setattr(sample, "clock", lambda device: next(readings))
    _, _, err = run_main(capsys, "--num_samples=2", "--exit=kl", "--exit_threshold=0.01")  # tokens exit at 2-4
    assert "13.5 tokens/s (54 timed)" in err  # 2 x (30 - 3) tokens in 4 s
    mean, deepest = map(float, re.search(r"([\d.]+) loops \(a step's deepest ([\d.]+)\)", err).groups())
    assert 1 <= mean < deepest <= MAX_LOOPS


def test_the_clock_waits_for_a_gpu_and_not_for_the_cpu(monkeypatch):
    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", synchronized.append)
    model_lib.clock("cpu")
    model_lib.clock("cuda:1")
    assert synchronized == ["cuda:1"]


def test_a_vanishing_temperature_is_greedy(tiny, capsys):
    greedy = run_main(capsys, "--temperature=0", "--num_samples=2")[1]
    assert run_main(capsys, "--temperature=1e-300", "--num_samples=2")[1] == greedy  # no inf / inf


def test_a_multibyte_prompt(tiny, capsys):
    _, text, _ = run_main(capsys, "--start=Good night café 日本", "--temperature=0", "--num_samples=1")
    assert text.startswith("Good night café 日本")


def test_help_lists_every_setting_with_its_comment(capsys):
    with pytest.raises(SystemExit) as err:
        sample.main(["--help"])
    assert err.value.code == 0
    text = capsys.readouterr().out
    settings = configurator.read_settings(vars(sample))
    assert {"out_dir", "exit", "r_max", "exit_threshold"} <= set(settings)
    for key, (default, comment) in settings.items():
        assert comment and re.search(rf"^  --{key}={re.escape(repr(default))}\s+{re.escape(comment)}$", text, re.M)


@pytest.mark.parametrize("args", [["--start="], ["--max_new_tokens=0"], ["--loops=-1"], ["--num_samples=0"],
                                  ["--loops=2.5"], ["--exit=never"], ["--exit=kl", "--r_max=1"],
                                  ["--temperature=-1"], ["--out_dir=nowhere"],
                                  ["--cache=exact"], ["--dtype=float16"], ["--device=tpu"], ["--bench"]])
def test_bad_input_is_one_line(tiny, args, capsys):
    one_line_error(capsys, *args)


NUMERIC = [key for key, (default, _) in configurator.read_settings(vars(sample)).items()
           if type(default) in (int, float)]


@pytest.mark.parametrize("key", NUMERIC)
def test_every_numeric_setting_takes_odd_values_without_a_traceback(tiny, capsys, key):
    """0, -1, nan (not parseable), 1e999 (inf) and True: a normal run, or exit 2 with one line."""
    for value in ("0", "-1", "nan", "1e999", "True"):
        args = ["--exit=state", "--max_new_tokens=5", "--num_samples=2", f"--{key}={value}"]
        try:
            run_main(capsys, *args)
        except UserError as err:
            assert "\n" not in str(err)


def test_foreign_checkpoint_and_missing_dataset_are_one_line(tiny, tmp_path, capsys):
    (tmp_path / "foreign").mkdir()
    torch.save({"model": {}, "config": {}}, tmp_path / "foreign" / "ckpt.pt")
    one_line_error(capsys, f"--out_dir={tmp_path / 'foreign'}")
    ckpt = torch.load("out/ckpt.pt", weights_only=True)
    ckpt["config"]["dataset"] = "gone"
    (tmp_path / "orphan").mkdir()
    torch.save(ckpt, tmp_path / "orphan" / "ckpt.pt")
    assert "data/gone" in one_line_error(capsys, f"--out_dir={tmp_path / 'orphan'}")


def test_a_prompt_of_whitespace_is_a_prompt(tiny, capsys, tmp_path):
    """The default prompt "\\n", typed out or set in a config file, and any whitespace: generated from."""
    for start in ("\n", " ", "\n\n\t"):
        _, text, _ = run_main(capsys, f"--start={start}", "--num_samples=1", "--max_new_tokens=3")
        assert text.startswith(start)
    config = tmp_path / "prompt.py"
    config.write_text('start = "\\n"\n')
    _, text, _ = run_main(capsys, str(config), "--start=\n", "--num_samples=1", "--max_new_tokens=3")
    assert text.startswith("\n")


def test_a_prompt_that_is_not_utf8_is_one_line(tiny, capsys):
    """--start="$(cat prompt.txt)" of a Latin-1 file: its bytes reach Python as lone surrogates."""
    latin1 = b"The caf\xe9".decode("utf-8", "surrogateescape")
    assert "--start is not UTF-8 text" in one_line_error(capsys, f"--start={latin1}")


def test_a_dataset_without_its_tokenizer_is_one_line(tiny, tmp_path, capsys):
    shutil.copytree("data", tmp_path / "data")
    shutil.copytree("out", tmp_path / "out")
    os.remove(tmp_path / "data" / "tiny" / "tokenizer.json")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        assert "data/tiny/ has no tokenizer.json" in one_line_error(capsys)


def test_a_dataset_prepared_again_is_refused(tiny, tmp_path, capsys):
    shutil.copytree("data", tmp_path / "data")
    shutil.copytree("out", tmp_path / "out")
    meta_path = tmp_path / "data" / "tiny" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps(meta | {"val_tokens": meta["val_tokens"] + 100}))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        assert "data/tiny is not the dataset out/ckpt.pt was trained on: val_tokens" in one_line_error(capsys)


def test_unencodable_prompt_is_one_line(tiny, monkeypatch, capsys):
    encode, decode = prepare.load_tokenizer("data/tiny")

    def lossy(text):  # a tokenizer that drops what it does not know
        return encode(text.replace("§", ""))
    monkeypatch.setattr(sample, "load_tokenizer", lambda data_dir: (lossy, decode))
    assert "cannot encode" in one_line_error(capsys, "--start=The § king")
