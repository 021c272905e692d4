"""Would the tests notice? Each mutant is one deliberate bug in a copy of the repository; the tests named
beside it must fail on it. Not collected by pytest (no test_ prefix); run it alone, it takes minutes:

    OMP_NUM_THREADS=1 python tests/mutants.py            # every mutant
    OMP_NUM_THREADS=1 python tests/mutants.py kl ddp     # those whose name contains a word given

Prints one line per mutant, `caught` or `MISSED`, and exits 1 if any was missed.
"""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name: (file, the line as it is, the line as the bug has it, the tests that must catch it)
MUTANTS = {
    "ddp: the gradient all-reduce deleted": (
        "train.py", "dist.all_reduce(p.grad)", "pass", "tests/test_train.py -k ddp"),
    "ddp: the gradients divided by the world size twice": (
        "train.py", "p.grad /= world", "p.grad /= world * world", "tests/test_train.py -k ddp"),
    "kl: token_kl's direction reversed": (
        "model.py", "return (log_p.exp() * (log_p - log_q)).sum(-1)",
        "return (log_q.exp() * (log_q - log_p)).sum(-1)", "tests/test_model.py"),
    "kl: the trace's exit scores given the two readouts the wrong way round": (
        "evaluate.py", "out[name].append(test.score(s, s_old, logits, previous).float())",
        "out[name].append(test.score(s, s_old, previous, logits).float())", "tests/test_evaluate.py"),
    "trace: argmax of the previous loop": (
        "evaluate.py", 'out["argmax"].append(logits.argmax(-1))',
        'out["argmax"].append((logits if previous is None else previous).argmax(-1))', "tests/test_evaluate.py"),
    "generation: the KL exit's carried logits never updated (tests against loop 1's)": (
        "sample.py", "logits = logits_new if logits is None else torch.where(ran, logits_new, logits)",
        "logits = logits_new if logits is None else logits", "tests/test_sample.py -k adaptive"),
    "generation: the new token's rotary position off by one": (
        "model.py", "positions = slice(T) if cache is None or cache.pos is None else cache.pos\n",
        "positions = slice(T) if cache is None or cache.pos is None else cache.pos - 1\n",
        "tests/test_sample.py -k reference"),
    "cache: a new token's K/V written one position late": (
        "model.py", "positions = torch.arange(k.size(2), device=k.device) if self.pos is None else self.pos\n",
        "positions = torch.arange(k.size(2), device=k.device) if self.pos is None else self.pos + 1\n",
        "tests/test_sample.py tests/test_model.py"),
    "memory: the no-grad loops run with gradients, detached after": (
        "model.py", "        with torch.no_grad():\n            for _ in range(loops - n_grad):\n                s = self.core_step(e, s)",
        "        for _ in range(loops - n_grad):\n            s = self.core_step(e, s)\n        s = s.detach()",
        "tests/test_model.py"),
    "bootstrap: each array resampled apart (pairing lost)": (
        "evaluate.py", "resampled = {name: array[..., pick] for name, array in per_window.items()}",
        "resampled = {name: array[..., rng.integers(0, n_windows, n_windows)] for name, array in per_window.items()}",
        "-k bootstrap tests/test_allocate.py tests/test_evaluate.py"),
    "A2: labels that overlook a change at the very next loop": (
        "studies/probe.py", "later = [(argmax[i + 1:] != argmax[i]).any(0)",
        "later = [(argmax[i + 2:] != argmax[i]).any(0)", "tests/test_studies.py -k label"),
    "exits: a token may stop after loop 1": (
        "model.py", "return go_on & ((loop < MIN_EXIT_LOOP) | ~settled)",
        "return go_on & ((loop < MIN_EXIT_LOOP - 1) | ~settled)", "tests/test_allocate.py"),
    "FLOPs: the KL exit's cost counted without its exp and sum": (
        "model.py", "lambda config: 12 * config.vocab_size", "lambda config: 10 * config.vocab_size",
        "tests/test_allocate.py -k exit_test_costs"),
    "saturation: the best depth read past 4 x mean_loops": (
        "studies/saturation.py", "depths = [r for r in swept if r <= 4 * mean]", "depths = list(swept)",
        "tests/test_studies.py -k saturation"),
    "token classes: each exit counted for the token it predicts": (
        "studies/token_classes.py", "windows[:, :-1], decode)", "windows[:, 1:], decode)",
        "tests/test_studies.py -k token_classes_of"),
    "training loss: one row a chunk (torch's default made hundreds of chunks at S1)": (
        "model.py", "rows = math.ceil(LOGITS_CHUNK / self.config.vocab_size)", "rows = 1",
        "tests/test_model.py -k chunks"),
    "attention: k and v swapped in the stacked matmul": (
        "model.py", "qkv_weight = torch.cat([self.wq.weight, self.wk.weight, self.wv.weight])",
        "qkv_weight = torch.cat([self.wq.weight, self.wv.weight, self.wk.weight])",
        "tests/test_model.py -k stacked"),
    "loop sampler: no clamp at max_loops": (
        "model.py", "log_loops = min(log_loops, math.log(config.max_loops))", "pass",
        "tests/test_train.py -k sampler"),
}


def run_mutant(name, file, line, bug, tests):
    """-> True if the named tests fail on a copy of the repository with the bug in place."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "data", "out*", "__pycache__"))
        source = (copy / file).read_text()
        if source.count(line) != 1:
            raise SystemExit(f"{name}: {file} no longer holds its line once; update tests/mutants.py")
        (copy / file).write_text(source.replace(line, bug))
        command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests.split()]
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        result = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True)
        return result.returncode != 0


def main(words):
    missed = 0
    for name, (file, line, bug, tests) in MUTANTS.items():
        if words and not any(word in name for word in words):
            continue
        caught = run_mutant(name, file, line, bug, tests)
        missed += not caught
        print(f"{'caught' if caught else 'MISSED'}  {name}  ({tests})", flush=True)
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main(sys.argv[1:])
