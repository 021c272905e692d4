"""Tests for sample.py on a tiny model trained for a few steps on a tiny byte-level BPE dataset.
The checkpoint is written here (train.py's format) so that these tests need only model.py and prepare.py."""
import copy
import json
import random
import re
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

import model as model_lib
import prepare
import sample
from model import MIN_EXIT_LOOP, exit_score

SEP = "\n---------------\n"
MAX_LOOPS = 4
MODEL_ARGS = dict(vocab_size=300, block_size=64, n_embd=32, n_head=2, n_kv_head=1, ffn_hidden=64, n_prelude=1,
                  n_core=2, n_coda=1, mean_loops=2, max_loops=MAX_LOOPS, bptt_k=4)


def make_dataset(root):
    """data/tiny: a 300-entry byte-level BPE over text with multi-byte characters (café, 日本)."""
    rng = random.Random(0)
    words = "the king queen said to a of and my lord good night café 日本 sweet love thou art".split()
    docs = ["\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))).capitalize() + "."
                      for _ in range(rng.randint(3, 8))) + "\n" for _ in range(60)]
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


def small_block(model, block_size=16):
    """The tiny model in float64 (batch shapes cannot flip a decision by rounding), its context cut
    to block_size: the crop rule then acts every block_size // 2 tokens."""
    model = copy.deepcopy(model).double()
    model.config.block_size = block_size
    return model


GREEDY = partial(sample.sample_next, temperature=0.0, top_k=0, generators=None)


def recording(pick, seen):
    """A pick that also keeps the logits it was given."""
    return lambda logits, seqs: (seen.append(logits), pick(logits, seqs))[1]


def sampler(seed, n):
    gens = [torch.Generator().manual_seed(seed + i) for i in range(n)]
    return lambda logits, seqs: sample.sample_next(logits, seqs, 1.0, 0, gens)


def prompts(n, length=12):
    """n different prompts: windows of the tiny val text."""
    val = torch.from_numpy(np.fromfile("data/tiny/val.bin", dtype=np.uint16).astype(np.int64))
    return torch.stack([val[23 * i:23 * i + length] for i in range(n)])


# ---- the cache against recomputation ---------------------------------------------------------
@torch.no_grad()
def generate_nocache(model, idx, n_new, loops, s0, pick):
    """nanoGPT's generate, the reference: the whole context recomputed for every new token, and cropped
    by sample.py's rule: the prompt's last block_size tokens; a new token that finds the context full
    keeps its last block_size // 2 tokens before itself."""
    block, first = model.config.block_size, max(0, idx.size(1) - model.config.block_size)
    every = torch.arange(idx.size(0))
    for _ in range(n_new):
        if idx.size(1) - first > block:
            first = idx.size(1) - 1 - block // 2
        e, s = model.prelude(idx[:, first:]), s0[:, first:idx.size(1)]
        for _ in range(loops):
            s = model.core_step(e, s)
        idx = torch.cat([idx, pick(model.readout(s)[:, -1], every)[:, None]], dim=1)
    return idx


@pytest.mark.parametrize("loops", [1, 2, MAX_LOOPS + 2])
@pytest.mark.parametrize("mode", ["zero", "noise"])
def test_cache_matches_recomputation(tiny, loops, mode):
    model, idx = tiny
    idx = idx.expand(2, -1)  # a batch of two: with noise init the rows differ
    s0 = sample.initial_states(model, 2, idx.size(1) + 16, mode, 7, "cpu")
    for make_pick in (lambda: GREEDY, lambda: sampler(0, 2)):
        seen_cached, seen_recomputed = [], []
        cached, depths, _ = sample.generate(model, idx, 16, loops, s0, recording(make_pick(), seen_cached))
        recomputed = generate_nocache(model, idx, 16, loops, s0, recording(make_pick(), seen_recomputed))
        assert depths == [[loops] * 15] * 2 and torch.equal(cached, recomputed)
        torch.testing.assert_close(torch.stack(seen_cached), torch.stack(seen_recomputed), atol=1e-4, rtol=0)
    assert torch.equal(seen_cached[0][0], seen_cached[0][1]) == (mode == "zero")
    if mode == "zero":  # zero init is what model.forward's own path does
        ref = idx
        for _ in range(16):
            ref = torch.cat([ref, model(ref, loops=loops, state_init="zero")[0][:, -1].argmax(-1, keepdim=True)], 1)
        assert torch.equal(sample.generate(model, idx, 16, loops, s0, GREEDY)[0], ref)


@pytest.mark.parametrize("T0", [5, 20])  # 20: the prompt itself is longer than block_size 16
@pytest.mark.parametrize("loops,cache", [(1, "exact"), (3, "exact"), (1, "latest")])
def test_generation_far_past_block_size_equals_recomputation(tiny, monkeypatch, T0, loops, cache):
    """Block 16, 60 new tokens: the context is refilled 6 times or more; every token equals the uncached
    reference's (noise init: each token starts from its own row of s0 in both)."""
    model = small_block(tiny[0])
    idx = prompts(3, T0)
    s0 = sample.initial_states(model, 3, T0 + 60, "noise", 3, "cpu").double()
    refills = counting_prefills(monkeypatch)
    out, depths, _ = sample.generate(model, idx, 60, loops, s0, GREEDY, cache=cache)
    assert torch.equal(out, generate_nocache(model, idx, 60, loops, s0, GREEDY))
    assert len({tuple(row.tolist()) for row in out}) == 3 and depths == [[loops] * 59] * 3
    assert len(refills) >= 7 and all(r == [0, 1, 2] for r in refills)  # the prompt, then in lockstep


def counting_prefills(monkeypatch):
    """-> the sequences of every sample.prefill call (the prompt's, then each refill's), as they come."""
    calls, prefill = [], sample.prefill
    monkeypatch.setattr(sample, "prefill", lambda *a: calls.append(a[4].tolist()) or prefill(*a))
    return calls


# ---- adaptive depth: an uncached reference for the K/V rule ----------------------------------
def depthwise(model, ids, depth, exit, threshold, r_max):
    """One context ids (T,) recomputed from scratch, loop by loop, each token for its own depth (None
    for the last: its exit decides), a token at loop i attending to every earlier token's K/V of loop
    min(i, its depth): caches built for this call only hold what frozen tokens last computed.
    -> (the last token's logits after its last loop, its loops)."""
    c, T, dt = model.config, len(ids), model.wte.weight.dtype
    e = model.prelude(torch.tensor([ids]))
    s = torch.zeros_like(e)
    core, coda = model.new_caches(c.n_core, 1, T, dt), model.new_caches(c.n_coda, 1, T, dt)
    n = torch.tensor([r_max if d is None else d for d in depth])
    prev = last = None
    for i in range(1, int(n.max()) + 1):
        act = (n >= i).nonzero()[:, 0]
        if len(act) == 0:  # the last token stopped before the deepest one it was given
            break
        s_new = model.core_step(e[:, act], s[:, act], core, act[None])
        logits = model.readout(s_new, coda, act[None]) if exit == "kl" else None
        if act[-1] == T - 1:  # the last token ran loop i
            new = None if logits is None else logits[0, -1:]  # (1, V): exit_score takes rows
            if depth[-1] is None and i >= MIN_EXIT_LOOP:
                if exit_score(exit, s_new[0, -1:], s[0, -1:], new, prev) < threshold:
                    n[-1] = i
            prev = last = new
        s[:, act] = s_new
    return (last if exit == "kl" else model.readout(s)[0, -1]), int(n[-1])


@torch.no_grad()
def generate_depthwise(model, prompt, n_new, loops, exit, threshold, r_max):
    """The adaptive reference for one sequence (greedy, zero init): every new token recomputes the
    context the crop rule keeps, the prompt's and a crop's tokens at `loops`. -> (tokens, the loops
    of each token whose exit it decided)."""
    block, tokens = model.config.block_size, prompt.tolist()
    first = max(0, len(tokens) - block)
    depth, decided = [loops] * len(tokens), []
    for _ in range(n_new):
        if len(tokens) - first > block:
            first = len(tokens) - 1 - block // 2
            depth[first:-1] = [loops] * (len(tokens) - 1 - first)
        logits, n = depthwise(model, tokens[first:], depth[first:], exit, threshold, r_max)
        if depth[-1] is None:
            depth[-1] = n
            decided.append(n)
        tokens.append(int(logits.argmax()))
        depth.append(None)
    return tokens, decided


def typical_threshold(model, exit):
    """The median exit score after loops 2..MAX_LOOPS on the tiny val text: tokens stop at varied depths."""
    val = torch.from_numpy(np.fromfile("data/tiny/val.bin", dtype=np.uint16).astype(np.int64))[None, :64]
    with torch.no_grad():
        e = model.prelude(val)
        s = model.init_state(e, "zero")
        logits, scores = model.readout(s), []
        for i in range(1, MAX_LOOPS + 1):
            s_new = model.core_step(e, s)
            new = model.readout(s_new)
            if i >= MIN_EXIT_LOOP:
                scores.append(exit_score(exit, s_new, s, new, logits))
            s, logits = s_new, new
    return torch.cat(scores).median().item()


@pytest.mark.parametrize("exit", ["kl", "state"])
def test_adaptive_generation_far_past_block_size_equals_recomputation(tiny, monkeypatch, exit):
    """Batch 3, block 16, 40 new tokens with per-token exits: the sequences run different depths, so
    their contexts fill at different steps, and each equals the uncached depth-wise reference alone."""
    model = small_block(tiny[0])
    idx = prompts(3)
    threshold = typical_threshold(model, exit)
    s0 = torch.zeros(3, idx.size(1) + 40, model.config.n_embd, dtype=torch.float64)
    refills = counting_prefills(monkeypatch)
    out, depths, _ = sample.generate(model, idx, 40, 2, s0, GREEDY, exit, threshold, MAX_LOOPS + 2)
    assert len({tuple(d) for d in depths}) > 1 and len({n for d in depths for n in d}) > 2
    assert refills[0] == [0, 1, 2] and all(sum(b in r for r in refills[1:]) >= 3 for b in range(3))
    assert any(len(r) < 3 for r in refills[1:])  # a refill while the other sequences' tokens are in flight
    for b in range(3):
        tokens, decided = generate_depthwise(model, idx[b], 40, 2, exit, threshold, MAX_LOOPS + 2)
        assert out[b].tolist() == tokens and depths[b] == decided


@pytest.mark.parametrize("cache", ["exact", "latest"])
@pytest.mark.parametrize("exit", ["kl", "state"])
def test_batched_adaptive_generation_equals_each_sequence_alone(tiny, exit, cache):
    """Past block_size too (block 16, 40 new tokens); sampled with noise init as well as greedy."""
    model = small_block(tiny[0])
    idx = prompts(3)
    threshold = typical_threshold(model, exit)
    for mode, pick in (("zero", lambda: GREEDY), ("noise", lambda: sampler(11, 3))):
        s0 = sample.initial_states(model, 3, idx.size(1) + 40, mode, 11, "cpu").double()
        out, depths, _ = sample.generate(model, idx, 40, 2, s0, pick(), exit, threshold, MAX_LOOPS + 2, cache=cache)
        assert len({tuple(d) for d in depths}) > 1  # the sequences really ran different depths
        for b in range(3):
            s0_b = sample.initial_states(model, 1, idx.size(1) + 40, mode, 11 + b, "cpu").double()
            pick_b = GREEDY if mode == "zero" else sampler(11 + b, 1)
            out_b, depths_b, _ = sample.generate(model, idx[b:b + 1], 40, 2, s0_b, pick_b, exit, threshold,
                                                 MAX_LOOPS + 2, cache=cache)
            assert torch.equal(out_b[0], out[b]) and depths_b[0] == depths[b]


@pytest.mark.parametrize("exit", ["kl", "state"])
def test_generation_exits_where_teacher_forced_scoring_does(tiny, exit):
    """allocate.py calibrates the thresholds sample.py runs: on the generated text, its realized exit stops
    every token after exactly the loops it ran in generation (same K/V rule, same zero init, same r_max)."""
    allocate = pytest.importorskip("allocate", exc_type=ImportError)  # another engineer's file, mid-edit
    model, idx = tiny
    model = copy.deepcopy(model).double()
    threshold = typical_threshold(model, exit)
    first = idx[:, :1]
    _, first_depth = allocate.realized_exit(model, first, first, MAX_LOOPS, exit, threshold)
    s0 = sample.initial_states(model, 1, 41, "zero", 0, "cpu").double()
    out, depths, _ = sample.generate(model, first, 40, int(first_depth[0, 0]), s0, GREEDY, exit, threshold, MAX_LOOPS)
    _, scored = allocate.realized_exit(model, out[:, :-1], out[:, 1:], MAX_LOOPS, exit, threshold)
    assert scored[0].tolist() == [int(first_depth[0, 0])] + depths[0]
    assert len(set(depths[0])) > 1


@pytest.mark.parametrize("cache", ["exact", "latest"])
@pytest.mark.parametrize("exit", ["kl", "state"])
def test_adaptive_threshold_zero_is_fixed_r_max_and_huge_stops_at_loop_2(tiny, exit, cache):
    model, idx = tiny
    s0 = sample.initial_states(model, 1, idx.size(1) + 20, "noise", 3, "cpu")
    fixed, _, _ = sample.generate(model, idx, 20, MAX_LOOPS, s0, GREEDY, cache=cache)
    adaptive, depths, _ = sample.generate(model, idx, 20, MAX_LOOPS, s0, GREEDY, exit, 0.0, MAX_LOOPS, cache=cache)
    assert torch.equal(fixed, adaptive) and depths == [[MAX_LOOPS] * 19]
    _, depths, _ = sample.generate(model, idx, 20, 2, s0, GREEDY, exit, 1e9, MAX_LOOPS, cache=cache)
    assert depths == [[2] * 19]  # no exit before loop 2, for either test


# ---- the K/V rule, cache by cache --------------------------------------------------------------
def scripted_run(tiny, exit, cache, schedule, part="core", prompt_loops=2, r_max=6):
    """Generate with the exit decisions scripted (each fed-back token runs schedule[i] loops), recording every
    write to part's caches. -> (part's caches, [(layer, rows, pos, k, v)] in order, each position's loops)."""
    model, idx = tiny
    decisions = iter([n == d for d in schedule for n in range(1, d + 1)])
    writes, made = [], []
    write, new_caches = model_lib.KVCache.write, sample.new_caches

    def recording_write(self, k, v, pos, rows=None):
        at = torch.arange(k.size(2)).expand(len(k), -1) if pos is None else pos.clone()  # None: 0..T-1
        writes.append((id(self), rows, at, k.clone(), v.clone()))
        write(self, k, v, pos, rows)
    s0 = sample.initial_states(model, 1, idx.size(1) + len(schedule) + 1, "zero", 0, "cpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sample, "exit_score", lambda *a: torch.tensor([0.0 if next(decisions) else 1.0]))
        mp.setattr(model_lib.KVCache, "write", recording_write)
        mp.setattr(sample, "new_caches", lambda *a: made.append(new_caches(*a)) or made[-1])
        _, depths, _ = sample.generate(model, idx, len(schedule) + 1, prompt_loops, s0, GREEDY, exit, 0.5, r_max,
                                       cache=cache)
    assert depths == [schedule]
    layer_of = {id(c): layer for layer, c in enumerate(made[0][part])}
    part_writes = [(layer_of[w[0]],) + w[1:] for w in writes if w[0] in layer_of]
    return made[0][part], part_writes, [prompt_loops] * idx.size(1) + schedule


SCHEDULE = [3, 2, 5, 2, 2, 4]  # loops run by each fed-back new token, deeper and shallower than the prompt


@pytest.mark.parametrize("exit,part", [("state", "core"), ("kl", "core"), ("kl", "coda")])
def test_exact_cache_keeps_every_loop_under_the_latest_rule(tiny, exit, part):
    """Check each (loop, layer, position) of the exact cache (the core's; the coda's, per loop under the KL exit):
    a loop the token did not run holds its last loop's K/V."""
    core, writes, loops_of = scripted_run(tiny, exit, "exact", SCHEDULE, part)
    computed = {}  # (loop, layer, position) -> (k, v) that the core computed there
    for layer, rows, pos, k, v in writes:
        slots = range(rows.start, rows.stop) if isinstance(rows, slice) else rows.tolist()
        for j, p in enumerate(pos[0].tolist()):
            key = (slots[0], layer, p)  # batch 1: slot = loop
            assert key not in computed, f"recomputed {key}"  # no token is ever recomputed
            computed[key] = (k[0, :, j], v[0, :, j])
    n_core = len(core)
    assert set(computed) == {(loop, layer, p) for p, n in enumerate(loops_of) for loop in range(n)
                             for layer in range(n_core)}
    for loop in range(6):
        for layer in range(n_core):
            for p, n in enumerate(loops_of):
                k, v = computed[(min(loop, n - 1), layer, p)]
                assert torch.equal(core[layer].k[loop, :, p], k) and torch.equal(core[layer].v[loop, :, p], v)
            assert not core[layer].k[loop, :, len(loops_of):].any()  # the last new token is never fed back


@pytest.mark.parametrize("exit", ["state", "kl"])
def test_latest_cache_holds_each_tokens_last_loop(tiny, exit):
    """cache='latest': one slot per sequence (r_max = 6 times less than 'exact'), each position holding the K/V
    of its token's last loop, every loop written once; the prompt's (prefilled in lockstep) equal the exact
    cache's slot for that loop."""
    core, writes, loops_of = scripted_run(tiny, exit, "latest", SCHEDULE)
    exact, _, _ = scripted_run(tiny, exit, "exact", SCHEDULE)
    assert len(core[0].k) == 1 and len(exact[0].k) == 6
    for layer in range(len(core)):
        per_position = {}
        for w_layer, _, pos, k, v in writes:
            for j, p in enumerate(pos[0].tolist()):
                if w_layer == layer:
                    per_position.setdefault(p, []).append((k[0, :, j], v[0, :, j]))
        assert {p: len(kv) for p, kv in per_position.items()} == dict(enumerate(loops_of))
        for p, kv in per_position.items():
            assert torch.equal(core[layer].k[0, :, p], kv[-1][0]) and torch.equal(core[layer].v[0, :, p], kv[-1][1])
        T0 = len(loops_of) - len(SCHEDULE)
        assert torch.equal(core[layer].k[0, :, :T0], exact[layer].k[1, :, :T0])  # the prompt: loop 2, slot 1


def test_latest_cache_equals_exact_at_one_loop(tiny):
    """At 1 loop every token's only loop is its last: the two layouts are the same computation."""
    model = small_block(tiny[0])
    idx = prompts(3)
    s0 = sample.initial_states(model, 3, idx.size(1) + 30, "noise", 5, "cpu").double()
    seen = {}
    for cache in ("exact", "latest"):
        seen[cache] = []
        out, _, _ = sample.generate(model, idx, 30, 1, s0, recording(sampler(5, 3), seen[cache]), cache=cache)
        seen[cache].append(out)
    assert all(torch.equal(a, b) for a, b in zip(seen["exact"], seen["latest"]))


@pytest.mark.parametrize("cache", ["exact", "latest"])
def test_core_reads_of_the_whole_batch_are_views_under_latest(tiny, cache):
    """Adaptive depth, batch 2: under 'latest' a core call carrying both sequences reads its one slot per
    sequence as a slice (a view); under 'exact' the two tokens at their own loops need a gather."""
    model, _ = tiny
    idx = prompts(2)
    reads, made = [], []  # each call's rows: the same slots it writes and reads
    write, new_caches = model_lib.KVCache.write, sample.new_caches

    def recording_write(self, k, v, pos, rows=None):
        reads.append((self, rows))
        return write(self, k, v, pos, rows)
    s0 = sample.initial_states(model, 2, idx.size(1) + 12, "zero", 0, "cpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_lib.KVCache, "write", recording_write)
        mp.setattr(sample, "new_caches", lambda *a: made.append(new_caches(*a)) or made[-1])
        sample.generate(model, idx, 12, 2, s0, GREEDY, "state", 0.0, MAX_LOOPS, cache=cache)
    core_rows = [rows for c, rows in reads if any(c is k for k in made[0]["core"])]
    whole = [rows for rows in core_rows if isinstance(rows, slice) or len(rows) == 2]
    assert whole and all(isinstance(rows, slice) for rows in whole) == (cache == "latest")


# ---- dtype -----------------------------------------------------------------------------------
@pytest.mark.parametrize("exit", ["none", "kl", "state"])
def test_bfloat16_autocast_generates_close_to_float32(tiny, monkeypatch, exit):
    model, idx = tiny
    s0 = sample.initial_states(model, 1, idx.size(1) + 20, "zero", 0, "cpu")
    made = []
    real_new_caches = sample.new_caches
    monkeypatch.setattr(sample, "new_caches", lambda *a: made.append(real_new_caches(*a)) or made[-1])
    first = {}
    for dtype in ("float32", "bfloat16"):
        seen = []
        with model_lib.autocast("cpu", dtype):
            out, depths, _ = sample.generate(model, idx, 20, 2, s0, recording(GREEDY, seen), exit, 1e-3, MAX_LOOPS)
        first[dtype] = seen[0].float()
        assert out.shape == (1, idx.size(1) + 20) and len(depths[0]) == 19 and 0 <= out.min() <= out.max() < 300
    assert made[0]["core"][0].k.dtype == torch.float32 and made[1]["core"][0].k.dtype == torch.bfloat16
    torch.testing.assert_close(first["bfloat16"], first["float32"], atol=0.15, rtol=0.02)
    assert not torch.equal(first["bfloat16"], first["float32"])  # the matmuls really ran in bf16


@pytest.mark.parametrize("exit", ["none", "kl", "state"])
def test_main_runs_in_bfloat16(tiny, capsys, exit):
    _, text, err = run_main(capsys, "--dtype=bfloat16", f"--exit={exit}", "--num_samples=2", "--seed=2")
    assert text.count(SEP) == 2 and text.startswith("The king") and "bfloat16" in err and "tokens/s" in err


# ---- the command line --------------------------------------------------------------------------
def run_main(capsys, *args):
    out = sample.main(["--out_dir=out", "--start=The king", "--max_new_tokens=30", "--device=cpu", *args])
    captured = capsys.readouterr()
    return out, captured.out, captured.err


def test_printed_text_and_reproducible_sampling(tiny, capsys):
    _, decode = prepare.load_tokenizer("data/tiny")
    out, text, err = run_main(capsys, "--num_samples=2", "--temperature=1.0", "--seed=5")
    assert out.size(0) == 2
    assert text == "".join(decode(row.tolist()) + SEP for row in out)  # every sample, whole
    assert "tokens/s" in err
    assert run_main(capsys, "--num_samples=2", "--temperature=1.0", "--seed=5")[1] == text
    assert run_main(capsys, "--num_samples=2", "--temperature=1.0", "--seed=6")[1] != text
    assert run_main(capsys, "--num_samples=1", "--temperature=1.0", "--seed=5")[1] == text.split(SEP)[0] + SEP


@pytest.mark.parametrize("cache", ["exact", "latest"])
def test_adaptive_main_reports_loops(tiny, capsys, cache):
    args = ("--num_samples=2", "--exit=kl", "--exit_threshold=1e-3", "--seed=1", f"--cache={cache}")
    _, text, err = run_main(capsys, *args)
    assert text.count(SEP) == 2 and text.startswith("The king")
    assert re.search(r"^loops per new token \(loops:tokens\):( \d+:\d+)+$", err, re.M) and f"{cache} cache" in err
    assert run_main(capsys, *args)[1] == text


def test_a_vanishing_temperature_is_greedy(tiny, capsys):
    greedy = run_main(capsys, "--temperature=0", "--num_samples=2")[1]
    assert run_main(capsys, "--temperature=1e-300", "--num_samples=2")[1] == greedy  # no inf / inf


def test_prompt_from_file(tiny, capsys, tmp_path):
    (tmp_path / "prompt.txt").write_text("Good night café 日本", encoding="utf-8")
    _, text, _ = run_main(capsys, f"--start=FILE:{tmp_path / 'prompt.txt'}", "--temperature=0", "--num_samples=1")
    assert text.startswith("Good night café 日本")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(SystemExit) as err:
        run_main(capsys, f"--start=FILE:{tmp_path / 'latin1.txt'}")
    assert err.value.code == 2 and "latin1.txt" in capsys.readouterr().err


def test_help_lists_every_setting_with_its_comment(capsys):
    with pytest.raises(SystemExit) as err:
        sample.main(["--help"])
    assert err.value.code == 0
    text = capsys.readouterr().out
    settings = re.findall(r"^([a-z_]+) = ", Path(sample.__file__).read_text(), re.M)
    assert set(settings) == set(sample.RULES)  # every setting has a rule
    for key in settings:
        assert re.search(rf"^  --{key}=.*\S\s+\S", text, re.M), key  # listed, with its comment


def one_line_error(capsys, code):
    stderr = capsys.readouterr().err
    assert code == 2 and stderr.startswith("error: ") and stderr.count("\n") == 1, stderr


@pytest.mark.parametrize("args", [["--start="], ["--max_new_tokens=0"], ["--loops=-1"], ["--num_samples=0"],
                                  ["--loops=2.5"], ["--exit=never"], ["--exit=kl", "--r_max=1"],
                                  ["--temperature=-1"], ["--out_dir=nowhere"], ["--start=FILE:nofile.txt"],
                                  ["--cache=compact"], ["--dtype=float16"], ["--device=tpu"], ["--bench"]])
def test_bad_input_dies_in_one_line(tiny, args, capsys):
    with pytest.raises(SystemExit) as err:
        run_main(capsys, *args)
    one_line_error(capsys, err.value.code)


NUMERIC = [key for key, rule in sample.RULES.items() if isinstance(rule, tuple) and not isinstance(rule[0], str)]


@pytest.mark.parametrize("key", NUMERIC)
def test_every_numeric_setting_takes_odd_values_without_a_traceback(tiny, capsys, key):
    """0, -1, nan (not parseable), 1e999 (inf) and True: exit 2 with one line, or a normal run."""
    for value in ("0", "-1", "nan", "1e999", "True"):
        base = ["--exit=state", "--max_new_tokens=5", "--num_samples=2"]
        try:
            run_main(capsys, *base, f"--{key}={value}")
        except SystemExit as err:
            one_line_error(capsys, err.code)


def test_foreign_checkpoint_and_missing_dataset_die(tiny, tmp_path, capsys):
    (tmp_path / "foreign").mkdir()
    torch.save({"model": {}, "config": {}}, tmp_path / "foreign" / "ckpt.pt")
    with pytest.raises(SystemExit) as err:
        sample.main([f"--out_dir={tmp_path / 'foreign'}"])
    one_line_error(capsys, err.value.code)
    ckpt = torch.load("out/ckpt.pt", weights_only=True)
    ckpt["config"]["dataset"] = "gone"
    (tmp_path / "orphan").mkdir()
    torch.save(ckpt, tmp_path / "orphan" / "ckpt.pt")
    with pytest.raises(SystemExit) as err:
        sample.main([f"--out_dir={tmp_path / 'orphan'}"])
    assert err.value.code == 2 and "data/gone" in capsys.readouterr().err


def test_unencodable_prompt_dies(tiny, monkeypatch, capsys):
    encode, decode = prepare.load_tokenizer("data/tiny")
    lossy = lambda s: encode(s.replace("§", ""))  # noqa: E731  a tokenizer that drops what it does not know
    monkeypatch.setattr(sample, "load_tokenizer", lambda d: (lossy, decode))
    with pytest.raises(SystemExit) as err:
        run_main(capsys, "--start=The § king")
    assert err.value.code == 2 and "cannot encode" in capsys.readouterr().err
