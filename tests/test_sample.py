"""Tests for sample.py on a tiny model trained for a few steps on a tiny byte-level BPE dataset."""
import json
import os
import random
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
import model as model_lib  # noqa: E402
import prepare  # noqa: E402
import sample  # noqa: E402
import train  # noqa: E402

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
                    "--n_coda=1", "--block_size=64", "--batch_size=4", "--mean_loops=2", f"--max_loops={MAX_LOOPS}",
                    "--compile=False", "--device=cpu", "--dtype=float32", "--peak_flops=1e9"])
    yield root


@pytest.fixture
def tiny(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    model, _ = model_lib.load_checkpoint("out/ckpt.pt")
    encode, _ = prepare.load_tokenizer("data/tiny")
    return model, torch.tensor([encode("The king said to my lord")])


GREEDY = partial(sample.sample_next, temperature=0.0, top_k=0, generator=None)


def recording(pick, seen):
    """A pick that also keeps the logits it was given."""
    return lambda logits: (seen.append(logits), pick(logits))[1]


@pytest.mark.parametrize("loops", [1, 2, MAX_LOOPS, MAX_LOOPS + 2])
@pytest.mark.parametrize("mode", ["zero", "noise"])
def test_cache_matches_recomputation(tiny, loops, mode):
    model, idx = tiny
    idx = idx.expand(2, -1)  # a batch of two: with noise init the rows differ
    s0 = sample.initial_states(model, 2, idx.size(1) + 16, mode, 7, "cpu")
    sampled = lambda: partial(sample.sample_next, temperature=1.0, top_k=0, generator=torch.Generator().manual_seed(0))  # noqa: E731
    for make_pick in (lambda: GREEDY, sampled):
        seen_cached, seen_recomputed = [], []
        cached, depths, _ = sample.generate(model, idx, 16, loops, s0, recording(make_pick(), seen_cached))
        recomputed = sample.generate_nocache(model, idx, 16, loops, s0, recording(make_pick(), seen_recomputed))
        assert depths == [loops] * 15 and torch.equal(cached, recomputed)
        torch.testing.assert_close(torch.stack(seen_cached), torch.stack(seen_recomputed), atol=1e-4, rtol=0)
    assert torch.equal(seen_cached[0][0], seen_cached[0][1]) == (mode == "zero")
    if mode == "zero":  # zero init is what model.forward's own path does
        ref = idx
        for _ in range(16):
            ref = torch.cat([ref, GREEDY(model(ref, loops=loops, state_init="zero")[0][:, -1])], 1)
        cached, _, _ = sample.generate(model, idx, 16, loops, s0, GREEDY)
        assert torch.equal(cached, ref)


@pytest.mark.parametrize("exit", ["kl", "state"])
def test_adaptive_threshold_zero_is_fixed_max_loops(tiny, exit):
    model, idx = tiny
    s0 = sample.initial_states(model, 1, idx.size(1) + 20, "noise", 3, "cpu")
    fixed, _, _ = sample.generate(model, idx, 20, MAX_LOOPS, s0, GREEDY)
    adaptive, depths, _ = sample.generate(model, idx, 20, MAX_LOOPS, s0, GREEDY, exit, 0.0, MAX_LOOPS)
    assert torch.equal(fixed, adaptive) and depths == [MAX_LOOPS] * 19


def test_adaptive_exits_early_at_a_loose_threshold(tiny):
    model, idx = tiny
    s0 = sample.initial_states(model, 1, idx.size(1) + 20, "zero", 0, "cpu")
    _, depths, _ = sample.generate(model, idx, 20, 2, s0, GREEDY, "kl", 1e9, MAX_LOOPS)
    assert depths == [2] * 19  # kl needs two distributions, so 2 is its floor


@pytest.mark.parametrize("exit", ["state", "kl"])
def test_latest_sharing_rule(tiny, monkeypatch, exit):
    """Script the exit decisions, record every cache write, then check each (loop, layer, position)."""
    model, idx = tiny
    T0, n_new, prompt_loops = idx.size(1), 7, 2
    # loops run by each fed-back new token, deeper and shallower than the prompt (kl needs 2 at least)
    schedule = [3, 1, 5, 2, 1, 4] if exit == "state" else [3, 2, 5, 2, 2, 4]
    first = 1 if exit == "state" else 2  # the first loop after which the exit test is consulted
    decisions = iter([n == d for d in schedule for n in range(first, d + 1)])
    scripted = lambda *a, **k: torch.tensor(0.0 if next(decisions) else 1.0)  # noqa: E731
    monkeypatch.setattr(sample, "state_change" if exit == "state" else "token_kl", scripted)
    writes = []
    write = model_lib.KVCache.write
    monkeypatch.setattr(model_lib.KVCache, "write",
                        lambda self, k, v, pos: (writes.append((id(self), pos.clone(), k.clone(), v.clone())),
                                                 write(self, k, v, pos)))
    s0 = sample.initial_states(model, 1, T0 + n_new, "zero", 0, "cpu")
    _, depths, caches = sample.generate(model, idx, n_new, prompt_loops, s0, GREEDY, exit, 0.5, 6)
    assert depths == schedule
    core = caches["core"]
    assert len(core) == max(schedule)  # loop 6 was never needed, so its cache never made
    where = {id(c): (loop, layer) for loop, caches_of_loop in enumerate(core) for layer, c in enumerate(caches_of_loop)}
    loops_of = [prompt_loops] * T0 + schedule  # loops run by each position that was fed back
    computed = {}  # (loop, layer, position) -> (k, v) that the core computed there
    for cache_id, pos, k, v in writes:
        if cache_id in where:
            for j, p in enumerate(pos[0].tolist()):
                key = where[cache_id] + (p,)
                assert key not in computed, f"recomputed {key}"  # no token is ever recomputed
                computed[key] = (k[:, :, j], v[:, :, j])
    n_core = model.config.n_core
    assert set(computed) == {(loop, layer, p) for p, n in enumerate(loops_of) for loop in range(n) for layer in range(n_core)}
    for loop in range(len(core)):
        for layer in range(n_core):
            cache = core[loop][layer]
            for p, n in enumerate(loops_of):  # a loop the token did not run holds its last computed loop's entry
                k, v = computed[(min(loop, n - 1), layer, p)]
                assert torch.equal(cache.k[:, :, p], k) and torch.equal(cache.v[:, :, p], v), (loop, layer, p)
            assert not cache.k[:, :, len(loops_of):].any()  # the last new token is never fed back


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


def test_bench_runs(tiny, capsys):
    sample.main(["--out_dir=out", "--bench=True", "--device=cpu"])
    text = capsys.readouterr().out
    assert "P = 32 and N = 32" in text and "| (b) cache, loops 2 | 2 |" in text and "32/32 |" in text
    assert text.count("| (c) kl") == 3 and text.count("| (c) state") == 3


@pytest.mark.parametrize("args", [["--start="], ["--max_new_tokens=64"], ["--loops=0"], ["--loops=-1"],
                                  ["--loops=2.5"], ["--exit=never"], ["--exit=kl", "--max_loops=1"],
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
