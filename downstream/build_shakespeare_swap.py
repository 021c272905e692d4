"""Builds downstream/tasks/shakespeare_swap.jsonl, the laptop task, from the prepared Shakespeare val split (the last
works, which training never sees), deterministically: the same data/shakespeare gives the same items, byte for byte.

After a passage, its true next line against the same line with two neighbouring words swapped. Each item is
{"context": the passage, ending with a newline, "choices": the two lines, "label": the true one's index}.

    python prepare.py && python -m downstream.build_shakespeare_swap   # writes downstream/tasks/shakespeare_swap.jsonl
"""
import json
import os
import random
import re

import numpy as np

from configurator import UserError, configure, run
from prepare import load_tokenizer, open_dataset

dataset = "shakespeare"  # data/<dataset>/ from prepare.py: its val.bin, decoded by its tokenizer.json
out = "downstream/tasks"  # the folder shakespeare_swap.jsonl is written to (its YAML reads it there)
items = 500  # items in the task
seed = 0  # picks the lines, the words swapped and the order of the choices
RULES = {"items": (1, 10 ** 6), "seed": (0, 2 ** 32 - 1)}
CONTEXT_CHARS = 600  # the passage before a line: about 200 tokens of the 1024-entry BPE, well inside block_size
MIN_LINE_CHARS = 25  # shorter lines are mostly cues ("Ay, my lord.")
PLAIN_WORD = re.compile(r"[a-z']+")  # a lowercase word: no capital or punctuation to give a swap away


def val_works(data_dir, meta):
    """The val split's works as texts: its token ids decoded, split at each EOT (a work ends with one)."""
    ids = np.fromfile(f"{data_dir}/val.bin", dtype=meta["dtype"])
    _, decode = load_tokenizer(data_dir)
    works = []
    for work in np.split(ids, np.flatnonzero(ids == meta["eot_id"])):
        text = decode(work[work != meta["eot_id"]])
        if text:
            works.append(text)
    return works


def is_verse(line):
    """A line of speech, not a speaker's name ("TROILUS."), a stage direction or a short cue."""
    return len(line) >= MIN_LINE_CHARS and not line.startswith("[") and not line.isupper()


def lines_in_context(works):
    """[(passage, line)]: every line of speech that follows another of the same speech, with the CONTEXT_CHARS of its
    work before it as the passage (from a line's start, ending with the newline before the line)."""
    found = []
    for work in works:
        lines = work.split("\n")
        line_start = 0  # where lines[i] begins in work
        for i, line in enumerate(lines):
            if i > 0 and is_verse(line) and is_verse(lines[i - 1]) and line_start > CONTEXT_CHARS:
                passage = work[line_start - CONTEXT_CHARS:line_start]
                passage = passage[passage.find("\n") + 1:]  # from the first whole line (if the window holds one)
                found.append((passage, line))
            line_start += len(line) + 1
    return found


def swap_neighbours(line, rng):
    """line with two neighbouring lowercase words swapped, past its first word (the capital and the punctuation
    stay where they were, so only the order of the words tells), or None where no two such words meet."""
    words = line.split(" ")
    pairs = []
    for i in range(1, len(words) - 1):
        both_plain = PLAIN_WORD.fullmatch(words[i]) and PLAIN_WORD.fullmatch(words[i + 1])
        if both_plain and words[i] != words[i + 1]:
            pairs.append(i)
    if not pairs:
        return None
    i = rng.choice(pairs)
    words[i], words[i + 1] = words[i + 1], words[i]
    return " ".join(words)


def swap_items(works, n_items, rng):
    """shakespeare_swap: after a passage, its true next line (label) against the line with two words swapped."""
    candidates = []
    for passage, line in lines_in_context(works):
        swapped = swap_neighbours(line, rng)
        if swapped is not None:
            candidates.append((passage, line, swapped))
    if len(candidates) < n_items:
        raise UserError(f"--items={n_items}: the val split holds {len(candidates)} lines to swap words in")
    items = []
    for passage, line, swapped in rng.sample(candidates, n_items):
        label = rng.randrange(2)  # the true line's place: second in half the items
        choices = [line, swapped]
        if label:
            choices.reverse()
        items.append({"context": passage, "choices": choices, "label": label})
    return items


def main(argv=()):
    C, _ = configure(globals(), argv)
    data_dir, meta = open_dataset(C.dataset, splits=("val",))
    items = swap_items(val_works(data_dir, meta), C.items, random.Random(C.seed))
    os.makedirs(C.out, exist_ok=True)
    path = os.path.join(C.out, "shakespeare_swap.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item) + "\n")
    print(f"wrote {path}: {len(items)} items")
    return items


if __name__ == "__main__":
    run(main)
