"""The Hugging Face hub's corpora and tokenizers, as prepare.py's sources: TinyStories (S0) and
FineWeb-Edu (S1), streamed so that a corpus never has to fit on disk, and SmolLM2's and GPT-2's
tokenizers. `python -m corpora` is prepare.py with them in its SOURCES and TOKENIZERS: the same
settings, folders, checks and outputs.

    python -m corpora --source=tinystories
    python -m corpora --source=fineweb-edu --max_tokens=13000000000
    python -m corpora --source=input.txt --tokenizer=smollm2 --name=mine_smollm2

The hub not answering is one line within seconds (its libraries retry for half a minute); offline
(HF_HUB_OFFLINE=1) its cache is read; without the datasets package, one line says what to install.
"""
import os
import urllib.request
from functools import partial

from tokenizers import Tokenizer

from configurator import UserError
from prepare import Source


def check_hub():
    """UserError at once if the hub does not answer; offline (HF_HUB_OFFLINE=1) nothing is asked."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", ""):
        return
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(endpoint, timeout=10).close()
    # an answer, even a refusal, is a hub that answers
    except urllib.error.HTTPError:
        return
    except OSError as err:
        raise UserError(f"the Hugging Face hub ({endpoint}) does not answer: {err}") from None


def tinystories(val_fraction, max_tokens):
    """(train, val) streamed from the hub, its own validation split as val."""
    from datasets import load_dataset
    check_hub()
    train = load_dataset("roneneldan/TinyStories", split="train", streaming=True)
    return train, load_dataset("roneneldan/TinyStories", split="validation", streaming=True)


def fineweb_edu(val_fraction, max_tokens):
    """(train, val) streamed from the hub; val is the first documents, val_fraction of max_tokens
    (of 10B without a cap) by their GPT-2 tokens."""
    from datasets import load_dataset
    check_hub()
    # about 100B or 10B GPT-2 tokens
    sample = "sample-100BT" if max_tokens > 9 * 10 ** 9 else "sample-10BT"
    corpus = load_dataset("HuggingFaceFW/fineweb-edu", name=sample, split="train", streaming=True)
    still_wanted = val_fraction * (max_tokens or 10 ** 10)
    for n_val, row in enumerate(corpus, 1):
        still_wanted -= row["token_count"]
        if still_wanted <= 0:
            break
    return corpus.skip(n_val), corpus.take(n_val)


def hub_tokenizer(repo):
    """The tokenizer.json of a hub repository (from its cache when offline)."""
    check_hub()
    return Tokenizer.from_pretrained(repo)


# SmolLM2's tokenizer for both corpora; fineweb-edu's val 50M of ~10B tokens, plenty
HUB_SOURCES = {"tinystories": Source(tinystories, tokenizer="smollm2"),
               "fineweb-edu": Source(fineweb_edu, tokenizer="smollm2", val_fraction=0.005)}
HUB_TOKENIZERS = {"smollm2": partial(hub_tokenizer, "HuggingFaceTB/SmolLM2-135M"),
                  "gpt2": partial(hub_tokenizer, "openai-community/gpt2")}
