"""Tests for sample.py on a tiny model trained for a few steps on a tiny byte-level BPE dataset.
The checkpoint is written here (train.py's format). References: nanoGPT's uncached generate for fixed
depth, and for per-token exits an uncached depth-wise recomputation implementing the documented K/V rule
(a stopped token is seen by later loops as it was at its last loop). engine/'s decoder is held to the
same references in test_engine.py."""
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
        loss = model(x, y, loops=1 + step % MAX_LOOPS)
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


def zero_states(model, length):
    """The reference's s_0 of every position (length, d): zeros, as sample.py starts each token."""
    return torch.zeros(length, model.config.n_embd, dtype=model.wte.weight.dtype)


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


def generate_all(model, idx, n_new, pick, prompt_depth, new_depth=None, generate=None):
    """sample.generate (or another generate with its signature) run to the end -> (prompts and new
    tokens (B, T0 + n_new), the loops run by the token each new token was read from (B, n_new): the
    prompt's last, then each fed new token)."""
    new_depth = new_depth or prompt_depth
    generate = generate or sample.generate
    steps = list(generate(model, idx, n_new, pick, prompt_depth.r_max, new_depth))
    new_tokens = torch.stack([token for token, _ in steps], dim=1)
    loops = torch.stack([loops for _, loops in steps], dim=1)
    return torch.cat([idx, new_tokens], dim=1), loops


def counting_prefills(monkeypatch):
    """-> the number of tokens of every prefill (the prompt's, then each refill's), as they come."""
    calls = []
    prefill = sample.prefill

    def counted(model, caches, tokens, loops):
        calls.append(tokens.size(1))
        return prefill(model, caches, tokens, loops)
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
    s0 = zero_states(model, idx.size(1) + 12)
    tokens, _ = reference_generate(model, idx[0], 12, s0, GREEDY, uniform_depth(1), uniform_depth(1))
    reference = idx
    with torch.no_grad():
        for _ in range(12):
            logits = model(reference, loops=1, state_init="zero")[:, -1]
            reference = torch.cat([reference, logits.argmax(-1, keepdim=True)], 1)
    assert tokens == reference[0].tolist()


@pytest.mark.parametrize("loops", [1, 2, MAX_LOOPS + 2])
def test_fixed_depth_equals_the_reference(tiny, loops):
    model = small_block(tiny[0], 64)
    idx = prompts(2)
    s0 = zero_states(model, idx.size(1) + 16)
    for pick in (GREEDY, sampler(0, 2)):
        out, depths = generate_all(model, idx, 16, pick, uniform_depth(loops))
        assert torch.equal(depths, torch.full((2, 16), loops))
        for b in range(2):
            reference_pick = GREEDY if pick is GREEDY else sampler(b, 1)
            tokens, _ = reference_generate(model, idx[b], 16, s0, reference_pick, uniform_depth(loops),
                                           uniform_depth(loops))
            assert out[b].tolist() == tokens


@pytest.mark.parametrize("T0", [5, 20])  # 20: the prompt itself is longer than block_size 16
@pytest.mark.parametrize("loops", [1, 3])
def test_generation_far_past_block_size_equals_the_reference(tiny, monkeypatch, T0, loops):
    """Block 16, 60 new tokens: the context is refilled 6 times or more; every token equals the
    reference's."""
    model = small_block(tiny[0])
    idx = prompts(3, T0)
    s0 = zero_states(model, T0 + 60)
    prefills = counting_prefills(monkeypatch)
    out, depths = generate_all(model, idx, 60, GREEDY, uniform_depth(loops))
    for b in range(3):
        tokens, _ = reference_generate(model, idx[b], 60, s0, GREEDY, uniform_depth(loops), uniform_depth(loops))
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
    s0 = zero_states(model, idx.size(1) + 40)
    prefills = counting_prefills(monkeypatch)
    out, depths = generate_all(model, idx, 40, GREEDY, uniform_depth(2), policy)
    assert len({tuple(d.tolist()) for d in depths}) > 1 and len(set(depths.flatten().tolist())) > 2
    assert len(prefills) >= 5
    for b in range(3):
        tokens, read_after = reference_generate(model, idx[b], 40, s0, GREEDY, uniform_depth(2), policy)
        assert out[b].tolist() == tokens and depths[b].tolist() == read_after


@pytest.mark.parametrize("exit", ["kl", "state"])
def test_batched_adaptive_generation_equals_each_sequence_alone(tiny, exit):
    """Past block_size too (block 16, 40 new tokens); sampled as well as greedy."""
    model = small_block(tiny[0])
    idx = prompts(3)
    test = EXIT_TESTS[exit]
    policy = DepthPolicy(test, typical_threshold(model, test), MAX_LOOPS + 2)
    for make_pick in (lambda seed, n: GREEDY, sampler):
        out, depths = generate_all(model, idx, 40, make_pick(11, 3), uniform_depth(2), policy)
        assert len({tuple(d.tolist()) for d in depths}) > 1  # the sequences really ran different depths
        for b in range(3):
            out_b, depths_b = generate_all(model, idx[b:b + 1], 40, make_pick(11 + b, 1), uniform_depth(2), policy)
            assert torch.equal(out_b[0], out[b]) and torch.equal(depths_b[0], depths[b])


@pytest.mark.parametrize("exit", ["kl", "state"])
def test_adaptive_threshold_zero_is_fixed_r_max_and_huge_stops_at_loop_2(tiny, exit):
    model, idx = tiny
    test = EXIT_TESTS[exit]
    fixed, _ = generate_all(model, idx, 20, GREEDY, uniform_depth(MAX_LOOPS))
    never = DepthPolicy(test, 0.0, MAX_LOOPS)
    adaptive, depths = generate_all(model, idx, 20, GREEDY, uniform_depth(MAX_LOOPS), never)
    assert torch.equal(fixed, adaptive) and (depths == MAX_LOOPS).all()
    at_once = DepthPolicy(test, 1e9, MAX_LOOPS)
    _, depths = generate_all(model, idx, 20, GREEDY, uniform_depth(2), at_once)
    assert (depths == 2).all()  # no exit before loop 2, for either test


def scripted_exit(schedule, first_scored_loop=2):
    """An exit test that stops each new token after schedule[i] loops: its score (one per token) is 0
    (stop) after the scheduled loop, 1 (go on) before. sample.py scores a token from loop 2 on;
    engine/'s decoder from loop 1 (first_scored_loop), where the stop rule does not read it."""
    stops = iter([loop == n for n in schedule for loop in range(first_scored_loop, n + 1)])

    def scripted(s_new, s_old, logits_new, logits_old):
        return torch.tensor([[0.0 if next(stops) else 1.0]])
    return DepthPolicy(ExitTest(scripted, lambda config: 0, needs_logits=False), 0.5, 6)


def core_writes_of(tiny, generate=None, first_scored_loop=2):
    """Generates with exit decisions scripted (each fed new token runs schedule[i] loops), recording every
    write into the core's cache -> (the schedule, the prompt's loops, the writes [(layer, positions, k)],
    the core's cache)."""
    model, idx = tiny
    schedule = [3, 2, 5, 2, 2, 4]  # deeper and shallower than the prompt's 2
    writes = []
    core_caches = []
    real_write, real_new_caches = model_lib.CacheView.write, model.new_caches

    def recording_write(view, layer, k, v):
        if core_caches and view.cache is core_caches[0]:
            positions = list(range(k.size(2))) if view.pos is None else view.pos.tolist()
            writes.append((layer, positions, k[0].clone()))
        real_write(view, layer, k, v)

    def recording_new_caches(batch):
        caches = real_new_caches(batch)
        core_caches.append(caches["core"])
        return caches
    policy = scripted_exit(schedule, first_scored_loop)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_lib.CacheView, "write", recording_write)
        mp.setattr(model, "new_caches", recording_new_caches)
        _, depths = generate_all(model, idx, len(schedule) + 1, GREEDY, uniform_depth(2), policy, generate)
    assert depths[0, 1:].tolist() == schedule
    return schedule, [2] * idx.size(1), writes, core_caches[0]


def assert_each_slot_holds_its_last_loop(model, schedule, prompt_loops, writes, core):
    """Each position is written once per loop its token ran, and its slot ends with its last loop's K/V."""
    loops_of = prompt_loops + schedule
    for layer in range(model.config.n_core):
        per_position = {}
        for w_layer, positions, k in writes:
            for j, p in enumerate(positions):
                if w_layer == layer:
                    per_position.setdefault(p, []).append(k[:, j])
        assert {p: len(ks) for p, ks in per_position.items()} == dict(enumerate(loops_of))
        for p, ks in per_position.items():
            assert torch.equal(core.k[layer][0, :, p], ks[-1])


def test_the_cache_holds_each_tokens_last_loop(tiny):
    """Exit decisions scripted (each new token runs schedule[i] loops): every core write is recorded."""
    assert_each_slot_holds_its_last_loop(tiny[0], *core_writes_of(tiny))


def test_the_initial_state_is_init_states_zero_state(tiny, monkeypatch):
    """Every loop of generation starts from GPT.init_state (the README's one place for it), in its zero
    mode, for the prompt and for every new token; a changed init_state changes what is generated."""
    model, idx = tiny
    modes = []
    real_init_state = model_lib.GPT.init_state

    def recorded(self, e, mode="noise", generator=None):
        modes.append((mode, e.shape[1]))
        return real_init_state(self, e, mode, generator)
    monkeypatch.setattr(model_lib.GPT, "init_state", recorded)
    before, after = [], []
    generate_all(model, idx, 5, recording(GREEDY, before), uniform_depth(2))
    assert modes == [("zero", idx.size(1))] + [("zero", 1)] * 4

    def ones(self, e, mode="noise", generator=None):
        return torch.ones_like(e)
    monkeypatch.setattr(model_lib.GPT, "init_state", ones)
    generate_all(model, idx, 5, recording(GREEDY, after), uniform_depth(2))
    assert all(not torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("exit", ["none", "kl", "state"])
def test_bfloat16_autocast_generates_close_to_float32(tiny, exit):
    model, idx = tiny
    policy = uniform_depth(2) if exit == "none" else DepthPolicy(EXIT_TESTS[exit], 1e-3, MAX_LOOPS)
    first = {}
    for dtype in ("float32", "bfloat16"):
        seen = []
        with model_lib.autocast("cpu", dtype):
            out, depths = generate_all(model, idx, 20, recording(GREEDY, seen), uniform_depth(2), policy)
            cache = model.new_caches(1)["prelude"]
        first[dtype] = seen[0].float()
        assert cache.k[0].dtype == getattr(torch, dtype)  # K/V stored in the dtype attention computes in
        assert out.shape == (1, idx.size(1) + 20) and 0 <= out.min() <= out.max() < 300
    torch.testing.assert_close(first["bfloat16"], first["float32"], atol=0.15, rtol=0.02)
    assert not torch.equal(first["bfloat16"], first["float32"])  # the matmuls really ran in bf16


def test_every_decoded_depth_moves_with_min_exit_loop(tiny, monkeypatch):
    """MIN_EXIT_LOOP = 3: a huge threshold stops every new token at loop 3, not 2."""
    model, idx = tiny
    at_once = DepthPolicy(EXIT_TESTS["state"], 1e9, MAX_LOOPS)
    monkeypatch.setattr(model_lib, "MIN_EXIT_LOOP", 3)
    _, depths = generate_all(model, idx, 10, GREEDY, uniform_depth(2), at_once)
    assert (depths[:, 1:] == 3).all()


# ---- the command line --------------------------------------------------------------------------
def run_main(capsys, *args, main=None):
    """sample.main (or another main taking sample.py's settings) -> (its new ids, stdout, stderr)."""
    main = main or sample.main
    generated = main(["--out_dir=out", "--start=The king", "--max_new_tokens=30", "--device=cpu", *args])
    captured = capsys.readouterr()
    return generated["new_ids"], captured.out, captured.err


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
    assert text.count(SEP) == 2 and text.startswith("The king") and "loops per new token" in err


def test_printed_text_and_reproducible_sampling(tiny, capsys):
    _, decode = prepare.load_tokenizer("data/tiny")
    prompt = prepare.load_tokenizer("data/tiny")[0]("The king")
    new_ids, text, err = run_main(capsys, "--num_samples=2", "--temperature=1.0", "--seed=5")
    assert len(new_ids) == 2 and all(len(row) == 30 for row in new_ids)
    assert text == "".join(decode(prompt + row) + SEP for row in new_ids)  # every sample, whole
    assert run_main(capsys, "--num_samples=2", "--temperature=1.0", "--seed=5")[1] == text
    assert run_main(capsys, "--num_samples=2", "--temperature=1.0", "--seed=6")[1] != text
    alone = run_main(capsys, "--num_samples=1", "--temperature=1.0", "--seed=5")[1]
    assert alone == text.split(SEP)[0] + SEP  # sequence 0 is the same alone


def test_main_reports_each_new_tokens_loops(tiny, capsys):
    """The loops each new token ran, returned and summed up on stderr: their mean and histogram."""
    generated = sample.main(["--out_dir=out", "--start=The king", "--max_new_tokens=30", "--num_samples=2",
                             "--exit=kl", "--exit_threshold=1e-3", "--seed=1"])
    err = capsys.readouterr().err
    loops = [n for row in generated["loops"] for n in row]
    assert len(generated["loops"]) == 2 and len(generated["loops"][0]) == 30
    histogram = " ".join(f"{k}:{loops.count(k)}" for k in sorted(set(loops)))
    assert f"{sum(loops) / len(loops):.2f} loops per new token (loops:tokens {histogram})" in err


@pytest.mark.parametrize("exit", ["kl", "state"])
def test_the_exit_threshold_is_allocates_for_this_checkpoint_at_these_settings_else_the_tests_own(tiny, capsys, exit):
    """Without --exit_threshold: the operating threshold allocate.py wrote for this very checkpoint at this
    r_max and dtype, else the exit test's default, saying why; given, it is used."""
    def threshold_line(*args):
        err = run_main(capsys, f"--exit={exit}", "--max_new_tokens=3", *args)[2]
        return re.search(rf"^--exit={exit} at threshold (\S+): (.*)$", err, re.M).groups()
    default = f"{EXIT_TESTS[exit].threshold:.3g}"
    assert threshold_line() == (default, "the test's default: no out/allocate.json: run "
                                         "`python allocate.py --out_dir=out` first")
    ckpt = torch.load("out/ckpt.pt", weights_only=True)
    calibrated = {"checkpoint": model_lib.checkpoint_id(ckpt), "operating_thresholds": {exit: 0.0123},
                  "r_max": MAX_LOOPS, "args": {"dtype": "float32"}}
    try:
        cases = ((calibrated, "0.0123", "allocate.py's"),
                 (calibrated | {"checkpoint": "another@40"}, default, "is of another@40"),
                 (calibrated | {"r_max": 2}, default, "calibrated r_max=2 and float32, not r_max=4 and float32"),
                 (calibrated | {"args": {"dtype": "bfloat16"}}, default, "calibrated r_max=4 and bfloat16"),
                 (calibrated | {"operating_thresholds": {}}, default, f"has no threshold for {exit}"))
        for written, expected, why in cases:
            with open("out/allocate.json", "w") as f:
                json.dump(written, f)
            threshold, source = threshold_line()
            assert threshold == expected and why in source, source
        assert threshold_line("--exit_threshold=0.5") == ("0.5", "--exit_threshold")
    finally:
        os.remove("out/allocate.json")  # the module's checkpoint is shared by the tests after this one


def test_r_max_defaults_to_the_models_max_loops(tiny, capsys):
    _, _, err = run_main(capsys, "--exit=state", "--exit_threshold=0")  # never stops early
    # 3 samples of 30 new tokens: the first read after the prompt (mean_loops 2), the rest at r_max
    assert f"(loops:tokens 2:3 {MAX_LOOPS}:87)" in err


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


@pytest.mark.parametrize("args", [["--num_samples=100000000000000000000"], ["--max_new_tokens=9223372036854775808"],
                                  ["--loops=100000"], ["--exit=kl", "--r_max=5000"], ["--exit=kl", "--exit_threshold=1e39"]])
def test_counts_that_mean_hours_or_no_machine_are_one_line(tiny, args, capsys):
    assert "must be a finite number in" in one_line_error(capsys, *args)


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
    val = tmp_path / "data" / "tiny" / "val.bin"
    np.concatenate([np.fromfile(val, dtype=np.uint16), np.zeros(100, np.uint16)]).tofile(val)
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
