"""Tests for corpora/: the hub's corpora as prepare.py sources, on local stand-ins for the hub (it is
unreachable from the machines the suite runs on), and the hub's failure in one line within seconds."""
import json
import sys
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer

import corpora
import prepare
from tokenizers import decoders, models, pre_tokenizers

from test_prepare import (EOT, SMOLLM2_JSON, TIKTOKEN_CACHE, decoded, exit_line, fake_hub_tokenizer, make_docs,
                          read_dataset, run_prepare, split_texts, txt_corpus, workdir)

assert workdir and txt_corpus  # test_prepare.py's fixtures, used here by name


@pytest.fixture(autouse=True)
def hub_sources(monkeypatch):
    """prepare's SOURCES and TOKENIZERS with the hub's, as python -m corpora runs it."""
    monkeypatch.setattr(prepare, "SOURCES", prepare.SOURCES | corpora.HUB_SOURCES)
    monkeypatch.setattr(prepare, "TOKENIZERS", prepare.TOKENIZERS | corpora.HUB_TOKENIZERS)


def run_corpora(argv, cwd, env):
    """python -m corpora as a real process -> (exit code, stderr)."""
    code, stderr = run_prepare(argv, cwd, env, module="corpora")
    return code, stderr


@pytest.mark.parametrize("source", ["tinystories", "fineweb-edu"])
def test_hub_sources_streamed(workdir, monkeypatch, source):
    """The hub's code path on local stand-ins for its datasets and SmolLM2's tokenizer."""
    if not SMOLLM2_JSON.is_file():
        pytest.skip(f"no {SMOLLM2_JSON}: the SmolLM2 tokenizer cannot be loaded offline")
    datasets = pytest.importorskip("datasets", reason="the hub's sources need it (pip install datasets)")
    docs = {"train": make_docs(40, seed=2), "validation": make_docs(5, seed=3)}
    for split, texts in docs.items():  # a token_count (GPT-2 tokens) per row, like fineweb-edu's
        rows = [json.dumps({"text": text, "token_count": 1000}) + "\n" for text in texts]
        Path(f"{split}.jsonl").write_text("".join(rows))
    loads = []
    real_load_dataset = datasets.load_dataset

    def load_from_here(path, name=None, split=None, streaming=False):
        loads.append((path, name, split, streaming))
        return real_load_dataset("json", data_files=f"{split}.jsonl", split="train", streaming=True)
    monkeypatch.setattr(datasets, "load_dataset", load_from_here)
    asked = fake_hub_tokenizer(monkeypatch, lambda name: Tokenizer.from_file(str(SMOLLM2_JSON)))
    monkeypatch.setattr(corpora, "check_hub", lambda: None)  # the hub answers
    prepare.main([f"--source={source}", "--max_tokens=400000"])  # a cap that no split reaches
    meta, _ = read_dataset(source)
    assert (meta["source"], meta["tokenizer"], meta["vocab_size"], meta["eot_id"]) == (source, "smollm2", 49152, 0)
    assert asked == ["HuggingFaceTB/SmolLM2-135M"]
    if source == "tinystories":  # its own validation split
        assert sorted(loads) == [("roneneldan/TinyStories", None, split, True) for split in ("train", "validation")]
        train_docs, val_docs = docs["train"], docs["validation"]
    else:  # val: the first documents, up to val_fraction (0.005) of max_tokens by token_count: 2 documents
        assert set(loads) == {("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", True)}
        train_docs, val_docs = docs["train"][2:], docs["train"][:2]
    text = decoded(source)
    assert text["train"] == "".join(doc + EOT for doc in train_docs)
    assert text["val"] == "".join(doc + EOT for doc in val_docs)


def test_fineweb_sample_holds_what_is_asked(monkeypatch):
    datasets = pytest.importorskip("datasets", reason="the hub's sources need it (pip install datasets)")

    def name_of_the_sample(path, name=None, split=None, streaming=False):
        raise LookupError(name)  # the sample asked for, before any download
    monkeypatch.setattr(datasets, "load_dataset", name_of_the_sample)
    monkeypatch.setattr(corpora, "check_hub", lambda: None)  # the hub answers
    for max_tokens, sample in ((0, "sample-10BT"),  # no cap: the whole 10B sample
                               (100_000_000, "sample-10BT"), (9 * 10 ** 9, "sample-10BT"),
                               (13_000_000_000, "sample-100BT")):  # S1's prepare (README)
        with pytest.raises(LookupError) as caught:
            corpora.fineweb_edu(0.005, max_tokens)
        assert caught.value.args == (sample,)


# ----------------------------------------------------------------------------- the hub, offline

@pytest.mark.parametrize("source", ["tinystories", "fineweb-edu"])
def test_the_hub_unreachable_is_one_line(workdir, source):
    """`python prepare.py --source=tinystories` with no network: datasets raises a ConnectionError at once in
    the hub's offline mode (an unreachable endpoint raises the same after a minute of retries)."""
    pytest.importorskip("datasets", reason="without it the error is another one (the next test's)")
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(workdir / "hf")}  # an empty cache
    code, stderr = run_corpora([f"--source={source}"], workdir, offline)
    assert code == 2 and stderr.count("\n") == 1
    assert stderr.startswith("error: ") and "on the Hub" in stderr  # datasets' own words, from configurator.run
    assert not Path("data", source).exists()


def test_the_sources_defaults_are_their_own():
    assert prepare.parse_settings(["--source=tinystories"])[0].tokenizer == "smollm2"
    assert prepare.parse_settings(["--source=fineweb-edu"])[0].val_fraction == 0.005
    assert prepare.parse_settings(["--source=fineweb-edu", "--val_fraction=0.01"])[0].val_fraction == 0.01


def test_hub_sources_without_datasets_installed_say_how_to_install_it(workdir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)  # what an uninstalled package raises: ModuleNotFoundError
    stderr = exit_line(["--source=tinystories"], monkeypatch, capsys)
    assert stderr == "error: import of datasets halted; None in sys.modules: pip install datasets\n"


def test_the_hub_not_answering_is_one_line_within_seconds(workdir):
    """huggingface_hub retries a lost connection for about half a minute, a line each time: the hub is
    asked once first. (Here its address is a local port nothing listens on.)"""
    pytest.importorskip("datasets", reason="without it the error is another one")
    started = time.perf_counter()
    code, stderr = run_corpora(["--source=tinystories"], workdir, {"HF_ENDPOINT": "http://127.0.0.1:9"})
    assert code == 2 and stderr.count("\n") == 1 and "does not answer" in stderr, stderr
    assert time.perf_counter() - started < 15


def gpt2_from_tiktoken_files(name):
    """GPT-2's tokenizer.json as the hub serves it, rebuilt from tiktoken's copy of GPT-2's files."""
    encoder = TIKTOKEN_CACHE / "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6"  # encoder.json
    merges = TIKTOKEN_CACHE / "6d1cbeee0f20b3d9449abfede4726ed8212e3aee"  # vocab.bpe
    tok = Tokenizer(models.BPE.from_file(str(encoder), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    return tok


def test_gpt2_from_the_hub_matches_tiktoken(txt_corpus, monkeypatch):
    """gpt2 is the hub's tokenizer.json (here rebuilt offline); its ids must be tiktoken's GPT-2 ids."""
    if not TIKTOKEN_CACHE.is_dir():
        pytest.skip(f"no {TIKTOKEN_CACHE}: GPT-2's files cannot be read offline")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE))
    import tiktoken
    enc = tiktoken.get_encoding("gpt2")
    asked = fake_hub_tokenizer(monkeypatch, gpt2_from_tiktoken_files)
    prepare.main(["--source=corpus.txt", "--tokenizer=gpt2"])
    meta, bins = read_dataset("corpus")
    assert asked == ["openai-community/gpt2"]
    assert (meta["vocab_size"], meta["eot_id"], meta["dtype"]) == (50257, 50256, "uint16")
    train, val = split_texts("corpus")
    assert train + val == txt_corpus
    assert bins["train"].tolist() == enc.encode_ordinary(train) + [enc.eot_token]
    assert bins["val"].tolist() == enc.encode_ordinary(val) + [enc.eot_token]
    encode, _ = prepare.load_tokenizer("data/corpus")  # offline: the saved tokenizer.json
    assert encode(val + EOT) == bins["val"].tolist()


def test_hub_tokenizers_offline_say_so(txt_corpus, tmp_path, monkeypatch, capsys):
    """No network and an empty cache: smollm2 and gpt2 are each one line saying what is needed."""
    import huggingface_hub.constants
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no probe of the hub: its own offline mode
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    for spec in ("gpt2", "smollm2"):
        stderr = exit_line(["--source=corpus.txt", f"--tokenizer={spec}"], monkeypatch, capsys)
        assert "Hub" in stderr and "connection" in stderr  # huggingface_hub's own words
    assert not Path("data/corpus").exists()
