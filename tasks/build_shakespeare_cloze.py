"""Builds shakespeare_cloze.jsonl, a two-choice cloze over held-out Shakespeare (prepare.py's val works):
after a passage, the true next line against another line of the same length from elsewhere in val.

    python tasks/build_shakespeare_cloze.py   # from the repository's root; writes tasks/shakespeare_cloze.jsonl
"""
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # prepare.py, at the root
import prepare  # noqa: E402

ITEMS = 500
CONTEXT_CHARS = 600  # about 150 tokens of the 1024-entry BPE: well inside block_size


def is_verse(line):
    """A line of speech, not a speaker's name ("TROILUS."), a stage direction or a short cue."""
    return len(line) >= 25 and not line.startswith("[") and not line.isupper()


def main():
    _, val = prepare.shakespeare(val_fraction=0.1)  # the default dataset's val works
    text = "\n".join(val)
    lines = text.split("\n")
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line) + 1)  # where each line begins in text
    # a target follows a line of the same speech, with a passage before it
    targets = [i for i in range(1, len(lines)) if is_verse(lines[i]) and is_verse(lines[i - 1])
               and starts[i] > CONTEXT_CHARS]
    rng = random.Random(0)
    items = []
    for i in sorted(rng.sample(targets, ITEMS)):
        context = text[starts[i] - CONTEXT_CHARS:starts[i]]
        context = context[context.index("\n") + 1:]  # from a line's start
        far = [j for j in targets if abs(starts[j] - starts[i]) > 5000]  # not from the same scene
        distractor = min(far, key=lambda j: (abs(len(lines[j]) - len(lines[i])), rng.random()))
        choices = [lines[i], lines[distractor]]
        label = rng.randrange(2)
        if label:
            choices.reverse()
        items.append({"context": context, "choices": choices, "label": label})
    out = Path(__file__).with_name("shakespeare_cloze.jsonl")
    out.write_text("".join(json.dumps(item) + "\n" for item in items))
    print(f"wrote {out}: {len(items)} items")


if __name__ == "__main__":
    main()
