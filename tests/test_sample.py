"""Tests for sample.py on a tiny model trained for a few steps on a tiny byte-level BPE dataset."""
import copy
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
import model as model_lib  # noqa: E402
import prepare  # noqa: E402
import sample  # noqa: E402
import train  # noqa: E402
from evaluate import trace  # noqa: E402

SEP = "\n---------------\n"
MAX_LOOPS = 4


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


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sample")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        make_dataset(root)
        train.main(["--dataset=tiny", "--out_dir=out", "--max_iters=20", "--eval_interval=20", "--eval_iters=1",
                    "--n_embd=32", "--n_head=2", "--n_kv_head=1", "--ffn_hidden=64", "--n_prelude=1", "--n_core=2",
                    "--n_coda=1", "--block_size=64", "--batch_size=4", "--mean_loops=2", f"--max_loops={MAX_LOOPS}", "--bptt_k=4",
                    "--compile=False", "--device=cpu", "--dtype=float32", "--peak_flops=1e9"])
    yield root


@pytest.fixture
def tiny(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    model, _ = model_lib.load_checkpoint("out/ckpt.pt")
    encode, _ = prepare.load_tokenizer("data/tiny")
    return model, torch.tensor([encode("The king said to my lord")])


def GREEDY(logits, seqs):
    return logits.argmax(-1)


def recording(pick, seen):
    """A pick that also keeps the logits it was given."""
    return lambda logits, seqs: (seen.append(logits), pick(logits, seqs))[1]


def sampler(seed, n):
    gens = [torch.Generator().manual_seed(seed + i) for i in range(n)]
    return lambda logits, seqs: sample.sample_next(logits, 1.0, 0, [gens[i] for i in seqs.tolist()])


@pytest.mark.parametrize("loops", [1, 2, MAX_LOOPS, MAX_LOOPS + 2])
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
        cached, _, _ = sample.generate(model, idx, 16, loops, s0, GREEDY)
        assert torch.equal(cached, ref)


@torch.no_grad()
def generate_nocache(model, idx, n_new, loops, s0, pick):
    """nanoGPT's generate, the reference: the whole context recomputed for every new token."""
    every = torch.arange(idx.size(0))
    for _ in range(n_new):
        e, s = model.prelude(idx), s0[:, :idx.size(1)]
        for _ in range(loops):
            s = model.core_step(e, s)
        idx = torch.cat([idx, pick(model.readout(s)[:, -1], every)[:, None]], dim=1)
    return idx


def prompts(tiny, n):
    """n different prompts of one length: the tiny prompt with its first token changed."""
    model, idx = tiny
    rows = idx.expand(n, -1).clone()
    rows[:, 0] = torch.arange(n) + 5
    return rows


def typical_threshold(model, exit):
    """The median exit score after loops 2..MAX_LOOPS on the tiny val text: tokens stop at varied depths."""
    val = torch.from_numpy(np.fromfile("data/tiny/val.bin", dtype=np.uint16).astype(np.int64))[None, :65]
    tr = trace(model, val[:, :-1], val[:, 1:], MAX_LOOPS)
    return (tr["kl"] if exit == "kl" else tr["dstate_rel"])[1:].median().item()


@pytest.mark.parametrize("exit", ["kl", "state"])
def test_batched_adaptive_generation_equals_each_sequence_alone(tiny, exit):
    model, _ = tiny
    model = copy.deepcopy(model).double()  # float64: batch shapes cannot flip a decision by rounding
    idx = prompts(tiny, 3)
    n_new = 40
    threshold = typical_threshold(model, exit)
    for mode, pick in (("zero", lambda: GREEDY), ("noise", lambda: sampler(11, 3))):
        s0 = sample.initial_states(model, 3, idx.size(1) + n_new, mode, 11, "cpu").double()
        out, depths, _ = sample.generate(model, idx, n_new, 2, s0, pick(), exit, threshold, MAX_LOOPS + 2)
        assert len({tuple(d) for d in depths}) > 1  # the sequences really ran different depths
        for b in range(3):
            s0_b = sample.initial_states(model, 1, idx.size(1) + n_new, mode, 11 + b, "cpu").double()
            pick_b = GREEDY if mode == "zero" else sampler(11 + b, 1)
            out_b, depths_b, _ = sample.generate(model, idx[b:b + 1], n_new, 2, s0_b, pick_b, exit, threshold,
                                                 MAX_LOOPS + 2)
            assert torch.equal(out_b[0], out[b]) and depths_b[0] == depths[b]


@pytest.mark.parametrize("exit", ["kl", "state"])
def test_generation_exits_where_teacher_forced_scoring_does(tiny, exit):
    """allocate.py calibrates the thresholds sample.py runs: on the generated text, its realized exit stops
    every token after exactly the loops it ran in generation (same K/V rule, same zero init, same r_max)."""
    import allocate
    model, idx = tiny
    model = copy.deepcopy(model).double()
    threshold = typical_threshold(model, exit)
    first = idx[:, :1]
    _, first_depth, _ = allocate.realized_exit(model, first, first, MAX_LOOPS, exit, threshold)
    s0 = sample.initial_states(model, 1, 41, "zero", 0, "cpu").double()
    out, depths, _ = sample.generate(model, first, 40, int(first_depth[0, 0]), s0, GREEDY, exit, threshold, MAX_LOOPS)
    _, scored, _ = allocate.realized_exit(model, out[:, :-1], out[:, 1:], MAX_LOOPS, exit, threshold)
    assert scored[0].tolist() == [int(first_depth[0, 0])] + depths[0]
    assert len(set(depths[0])) > 1


@pytest.mark.parametrize("exit", ["kl", "state"])
def test_adaptive_threshold_zero_is_fixed_r_max_and_huge_stops_at_loop_2(tiny, exit):
    model, idx = tiny
    s0 = sample.initial_states(model, 1, idx.size(1) + 20, "noise", 3, "cpu")
    fixed, _, _ = sample.generate(model, idx, 20, MAX_LOOPS, s0, GREEDY)
    adaptive, depths, _ = sample.generate(model, idx, 20, MAX_LOOPS, s0, GREEDY, exit, 0.0, MAX_LOOPS)
    assert torch.equal(fixed, adaptive) and depths == [[MAX_LOOPS] * 19]
    _, depths, _ = sample.generate(model, idx, 20, 2, s0, GREEDY, exit, 1e9, MAX_LOOPS)
    assert depths == [[2] * 19]  # no exit before loop 2, for either test


@pytest.mark.parametrize("exit", ["none", "kl", "state"])
def test_generation_runs_past_block_size(tiny, exit):
    """block_size 64: a 40-token prompt and 100 new tokens. When a context is full, its last 32 tokens are
    prefilled again; the token after that is what the model predicts from those 32 alone."""
    model, idx = tiny
    idx = torch.cat([idx] * 8, 1)[:, :40].expand(2, -1).contiguous()
    s0 = sample.initial_states(model, 2, 140, "zero", 0, "cpu")
    out, depths, _ = sample.generate(model, idx, 100, 2, s0, GREEDY, exit, 1e-3, MAX_LOOPS)
    assert out.shape == (2, 140)
    # token j is fed at position j until the token at index 64 has no position left: the 32 tokens
    # ending with it are prefilled again (at the prompt's 2 loops), and token 65 is read from them
    expected = model(out[:, 33:65], loops=2, state_init="zero")[0][:, -1].argmax(-1)
    assert torch.equal(out[:, 65], expected)


@pytest.mark.parametrize("exit", ["state", "kl"])
def test_latest_sharing_rule(tiny, monkeypatch, exit):
    """Script the exit decisions, record every core cache write, then check each (loop, layer, position)."""
    model, idx = tiny
    T0, n_new, prompt_loops, r_max = idx.size(1), 7, 2, 6
    schedule = [3, 2, 5, 2, 2, 4]  # loops run by each fed-back new token, deeper and shallower than the prompt
    decisions = iter([n == d for d in schedule for n in range(1, d + 1)])
    scripted = lambda *a, **k: torch.tensor([0.0 if next(decisions) else 1.0])  # noqa: E731
    monkeypatch.setattr(sample, "exit_score", scripted)
    writes = []
    write = model_lib.KVCache.write

    def recording_write(self, k, v, pos, rows=None):
        writes.append((id(self), rows, pos.clone(), k.clone(), v.clone()))
        write(self, k, v, pos, rows)
    monkeypatch.setattr(model_lib.KVCache, "write", recording_write)
    s0 = sample.initial_states(model, 1, T0 + n_new, "zero", 0, "cpu")
    caches = {}
    real_new_caches = sample.new_caches
    monkeypatch.setattr(sample, "new_caches", lambda *a: caches.setdefault("c", real_new_caches(*a)))
    _, depths, _ = sample.generate(model, idx, n_new, prompt_loops, s0, GREEDY, exit, 0.5, r_max)
    assert depths == [schedule]
    core = caches["c"]["core"]
    layer_of = {id(c): layer for layer, c in enumerate(core)}
    loops_of = [prompt_loops] * T0 + schedule  # loops run by each position that was fed back
    computed = {}  # (loop, layer, position) -> (k, v) that the core computed there
    for cache_id, rows, pos, k, v in writes:
        if cache_id not in layer_of:
            continue
        slots = range(rows.start, rows.stop) if isinstance(rows, slice) else rows.tolist()
        for j, p in enumerate(pos[0].tolist()):
            key = (slots[0], layer_of[cache_id], p)  # batch 1: slot = loop
            assert key not in computed, f"recomputed {key}"  # no token is ever recomputed
            computed[key] = (k[0, :, j], v[0, :, j])
    n_core = model.config.n_core
    assert set(computed) == {(loop, layer, p) for p, n in enumerate(loops_of) for loop in range(n) for layer in range(n_core)}
    for loop in range(r_max):
        for layer in range(n_core):
            cache = core[layer]
            for p, n in enumerate(loops_of):  # a loop the token did not run holds its last computed loop's entry
                k, v = computed[(min(loop, n - 1), layer, p)]
                assert torch.equal(cache.k[loop, :, p], k) and torch.equal(cache.v[loop, :, p], v), (loop, layer, p)
            assert not cache.k[loop, :, len(loops_of):].any()  # the last new token is never fed back


def run_main(capsys, *args):
    out = sample.main(["--out_dir=out", "--start=The king", "--max_new_tokens=30", "--device=cpu", *args])
    captured = capsys.readouterr()
    return out, captured.out, captured.err


def test_streamed_text_and_reproducible_sampling(tiny, capsys):
    _, decode = prepare.load_tokenizer("data/tiny")
    out, text, err = run_main(capsys, "--num_samples=2", "--temperature=1.0", "--seed=5")
    assert out.size(0) == 2
    assert text == "".join(decode(row.tolist()) + SEP for row in out)  # streaming lost or doubled nothing
    assert "tokens/s" in err
    assert run_main(capsys, "--num_samples=2", "--temperature=1.0", "--seed=5")[1] == text
    assert run_main(capsys, "--num_samples=2", "--temperature=1.0", "--seed=6")[1] != text


def test_stream_waits_for_multibyte_characters(capsys):
    text = "café 日本!"
    decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731  one token per byte
    ids, shown = list(text.encode("utf-8")), ""
    for n in range(1, len(ids) + 1):
        shown = sample.stream(decode, ids[:n], shown)
    assert shown == text and capsys.readouterr().out == text  # no U+FFFD was ever printed


def test_adaptive_main_reports_loops(tiny, capsys):
    _, text, err = run_main(capsys, "--num_samples=2", "--exit=kl", "--exit_threshold=1e-3", "--seed=1")
    assert text.count(SEP) == 2 and text.startswith("The king")
    assert "loops per new token: mean" in err and "histogram" in err
    assert run_main(capsys, "--num_samples=2", "--exit=kl", "--exit_threshold=1e-3", "--seed=1")[1] == text


def test_prompt_from_file(tiny, capsys, tmp_path):
    (tmp_path / "prompt.txt").write_text("Good night café 日本", encoding="utf-8")
    _, text, _ = run_main(capsys, f"--start=FILE:{tmp_path / 'prompt.txt'}", "--temperature=0", "--num_samples=1")
    assert text.startswith("Good night café 日本")


def test_bench_against_the_frontier_computes_every_column(tiny, capsys, monkeypatch):
    import allocate
    allocate.main(["--out_dir=out", "--windows=4", "--train_windows=4", "--batch_size=2", "--n_grid=2",
                   "--probe_steps=10", "--bootstrap=20"])
    real_generate = sample.generate

    def altered(model, idx, n_new, loops, s0, pick, exit="none", threshold=0.0, r_max=0, on_token=None):
        """The state exit replaced by uniform mean_loops with its last token changed: a known difference."""
        if exit != "state":
            return real_generate(model, idx, n_new, loops, s0, pick, exit, threshold, r_max)
        out, depths, seconds = real_generate(model, idx, n_new, 2, s0, pick)
        out[:, -1] = (out[:, -1] + 1) % model.config.vocab_size
        return out, depths, seconds
    import bench
    monkeypatch.setattr(bench, "generate", altered)
    res = sample.main(["--out_dir=out", "--bench", "--device=cpu", "--bench_tokens=16"])
    assert set(res["batches"]) == {1, 8, 32}
    for batch, rows in res["batches"].items():
        assert [r["policy"] for r in rows] == ["A0"] * MAX_LOOPS + ["A1"] * 2 + ["A1s"] * 2
        assert rows[1]["equal_to_uniform_mean"] == batch * 16  # uniform r = mean_loops = 2 is the reference
        assert all(r["equal_to_uniform_mean"] == batch * 15 for r in rows if r["policy"] == "A1s")
        assert all(r["first_equal_to_batch_1"] == 16 for r in rows)
        assert all(r["tokens_per_s"] > 0 and r["speedup"]["value"] > 0 for r in rows if r["policy"] != "A0")
    assert "iso-loss speedup" in capsys.readouterr().out
    assert json.loads(Path("out/sample_bench.json").read_text())["new_tokens"] == 16


def test_bench_needs_allocate_json(tiny, capsys, tmp_path):
    (tmp_path / "data").symlink_to(Path("data").resolve())
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "ckpt.pt").symlink_to(Path("out/ckpt.pt").resolve())
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        with pytest.raises(SystemExit):
            sample.main(["--out_dir=out", "--bench", "--device=cpu"])
    assert "allocate.py" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--start="], ["--max_new_tokens=0"], ["--loops=-1"], ["--num_samples=0"],
                                  ["--loops=2.5"], ["--exit=never"], ["--exit=kl", "--r_max=1"],
                                  ["--temperature=-1"], ["--out_dir=nowhere"], ["--start=FILE:nofile.txt"]])
def test_bad_input_dies(tiny, args, capsys):
    with pytest.raises(SystemExit) as err:
        run_main(capsys, *args)
    assert err.value.code != 0 and "error:" in capsys.readouterr().err


def test_foreign_checkpoint_and_missing_dataset_die(tiny, tmp_path, capsys):
    os.makedirs(tmp_path / "foreign")
    torch.save({"model": {}, "config": {}}, tmp_path / "foreign" / "ckpt.pt")
    with pytest.raises(SystemExit) as err:
        sample.main([f"--out_dir={tmp_path / 'foreign'}"])
    assert err.value.code != 0
    ckpt = torch.load("out/ckpt.pt", weights_only=True)
    ckpt["config"]["dataset"] = "gone"
    os.makedirs(tmp_path / "orphan")
    torch.save(ckpt, tmp_path / "orphan" / "ckpt.pt")
    with pytest.raises(SystemExit) as err:
        sample.main([f"--out_dir={tmp_path / 'orphan'}"])
    assert err.value.code != 0 and "data/gone" in capsys.readouterr().err


def test_unencodable_prompt_dies(tiny, monkeypatch, capsys):
    encode, decode = prepare.load_tokenizer("data/tiny")
    lossy = lambda s: encode(s.replace("§", ""))  # noqa: E731  a tokenizer that drops what it does not know
    monkeypatch.setattr(sample, "load_tokenizer", lambda d: (lossy, decode))
    with pytest.raises(SystemExit) as err:
        run_main(capsys, "--start=The § king")
    assert err.value.code != 0 and "cannot encode" in capsys.readouterr().err
