"""README's "To change X, edit Y", row by row, as a forker meets it: a copy of the repository, one
edit in the one place its row names, then the scripts run as processes on a tiny model, and the
change shows where the row says it does (training and inference alike). A row of the README's
table without a test here fails, and so does a test here without its row."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import script_env
from test_allocate import write_byte_dataset

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--dataset=tiny", "--n_embd=32", "--n_head=2", "--n_kv_head=1", "--ffn_hidden=64", "--block_size=32",
        "--batch_size=4", "--mean_loops=2", "--max_loops=4", "--bptt_k=2", "--eval_iters=1",
        "--log_interval=1", "--learning_rate=5e-3"]
SAMPLE = ["--start=The", "--max_new_tokens=12", "--temperature=0", "--num_samples=2"]
# drawn from the whole distribution (a seed a row): any change to it shows in the text
DRAWN = ["--start=The", "--max_new_tokens=24", "--temperature=1.0", "--top_k=0", "--num_samples=2"]


@pytest.fixture(scope="module")
def trained_fork(tmp_path_factory):
    """A copy of the repository's core and config/ with data/tiny and out/ckpt.pt trained on it."""
    root = tmp_path_factory.mktemp("fork")
    for path in ROOT.glob("*.py"):
        shutil.copy(path, root)
    shutil.copytree(ROOT / "config", root / "config")
    write_byte_dataset(root)
    run(root, "train.py", *TINY, "--max_iters=20", "--eval_interval=20", "--out_dir=out")
    return root


@pytest.fixture
def fork(trained_fork, tmp_path):
    """The trained fork, copied for one test's edit."""
    copy = tmp_path / "fork"
    shutil.copytree(trained_fork, copy)
    return copy


def run(root, script, *args):
    """python SCRIPT ARGS in the fork, as a user runs it -> (stdout, stderr); it must succeed."""
    done = subprocess.run([sys.executable, script, *args], cwd=root, capture_output=True, text=True,
                          env=script_env() | {"PYTHONPATH": str(root)}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, done.stderr


def edit(root, file, old, new):
    """The forker's one edit: old (exactly once in file) becomes new."""
    path = root / file
    source = path.read_text()
    assert source.count(old) == 1, (file, old)
    path.write_text(source.replace(old, new))


def metrics(root, out_dir="out"):
    return [json.loads(line) for line in (root / out_dir / "metrics.jsonl").read_text().splitlines()]


def loops_line(stderr):
    """sample.py's loops per new token: {loops: tokens}."""
    histogram = re.search(r"\(loops:tokens ([\d: ]+)\)", stderr).group(1)
    return dict(map(int, pair.split(":")) for pair in histogram.split())


def test_the_exit_test(fork):
    """One entry in model.EXIT_TESTS: allocate.py reads its policy and writes its threshold, sample.py runs it."""
    edit(fork, "model.py", '''    "state": ExitTest(state_score,''', '''    "always": ExitTest(lambda s_new, s_old, logits_new, logits_old: state_change(s_new, s_old),
                       lambda config: 2 * config.n_embd, threshold=1e9, label="A9"),
    "state": ExitTest(state_score,''')
    run(fork, "allocate.py", "--out_dir=out", "--windows=4", "--train_windows=2", "--batch_size=4",
        "--n_grid=6", "--bootstrap=20")
    allocated = json.loads((fork / "out" / "allocate.json").read_text())
    assert "always" in allocated["per_window"] and allocated["labels"]["always"] == "A9"
    _, stderr = run(fork, "sample.py", "--out_dir=out", *SAMPLE, "--exit=always", "--exit_threshold=1e9")
    assert set(loops_line(stderr)) == {2}  # the prompt's two loops, then every token at its first test


def test_when_tests_start_the_stop_rule(fork):
    """MIN_EXIT_LOOP = 3: no token stops before loop 3, in sample.py as in allocate.py's reading."""
    edit(fork, "model.py", "MIN_EXIT_LOOP = 2 ", "MIN_EXIT_LOOP = 3 ")
    _, stderr = run(fork, "sample.py", "--out_dir=out", *SAMPLE, "--exit=state", "--exit_threshold=1e9")
    assert loops_line(stderr) == {2: 2, 3: 22}  # the prompt's token at 2, every new one at 3


def test_the_loop_distribution(fork):
    """model.sample_loops: training's depth per step, as train.py draws it and the studies count it."""
    edit(fork, "model.py", '''    if config.loop_dist == "fixed":
        return config.mean_loops''', '''    if True:
        return 3''')
    run(fork, "train.py", *TINY, "--max_iters=4", "--eval_interval=4", "--out_dir=out2")
    assert {record["loops"] for record in metrics(fork, "out2") if "loops" in record} == {3}


def test_the_readout(fork):
    """GPT.readout, its coda and head: training's loss and inference's logits both go through it. Here the head
    reads nothing: every token's distribution is uniform, in the training loss and in evaluate.py's."""
    edit(fork, "model.py", '''        normed = self.norm(self.coda_blocks(s, *self.rope(s.size(1), cache), cache))''',
         '''        normed = 0 * self.norm(self.coda_blocks(s, *self.rope(s.size(1), cache), cache))''')
    run(fork, "train.py", *TINY, "--max_iters=1", "--eval_interval=1", "--out_dir=out2")
    uniform = pytest.approx(5.5452, abs=1e-3)  # log(256): the byte vocabulary
    assert metrics(fork, "out2")[0]["val_loss"] == uniform
    run(fork, "evaluate.py", "--out_dir=out", "--windows=2", "--batch_size=2", "--loops=1,2")
    assert json.loads((fork / "out" / "eval.json").read_text())["rows"][0]["loss"] == uniform


def test_the_initial_state(fork):
    """GPT.init_state: sampling starts every token's loops from it (its zero mode)."""
    before, _ = run(fork, "sample.py", "--out_dir=out", *DRAWN, "--loops=1")
    edit(fork, "model.py", '''        if mode == "zero":
            return torch.zeros_like(e)''', '''        if mode == "zero":
            return 30 * torch.ones_like(e)''')
    after, _ = run(fork, "sample.py", "--out_dir=out", *DRAWN, "--loops=1")
    assert after != before


def test_a_block_attention_the_mlp(fork):
    """MLP.forward (as Block and Attention): every stack of blocks runs it, in training and in sampling."""
    before, _ = run(fork, "sample.py", "--out_dir=out", *DRAWN)
    edit(fork, "model.py", '''        return self.w_down(F.silu(gate) * up)''',
         '''        return 3 * self.w_down(F.silu(gate) * up)''')
    after, _ = run(fork, "sample.py", "--out_dir=out", *DRAWN)
    assert after != before
    run(fork, "train.py", *TINY, "--max_iters=1", "--eval_interval=1", "--out_dir=out2")


def test_a_data_source(fork):
    """A function returning (train, val) and its entry in prepare.SOURCES: prepare.py --source=NAME."""
    edit(fork, "prepare.py", '''SOURCES = {"shakespeare": Source(shakespeare)}''', '''def verses(val_fraction, max_tokens):
    return ["the king said to the queen " * 200], ["the queen said to the king " * 30]


SOURCES = {"shakespeare": Source(shakespeare), "verses": Source(verses, tokenizer="bpe:300")}''')
    run(fork, "prepare.py", "--source=verses")
    meta = json.loads((fork / "data" / "verses" / "meta.json").read_text())
    assert (meta["source"], meta["tokenizer"]) == ("verses", "bpe:300") and meta["train_tokens"] > 0


def test_the_models_shape(fork):
    """train.py's settings, or a config file: the checkpoint is that shape."""
    (fork / "config" / "wider.py").write_text("n_embd = 48\nn_head = 3\nffn_hidden = 96\n")
    run(fork, "train.py", "config/wider.py", *TINY[:1], *TINY[5:], "--n_kv_head=1", "--max_iters=1",
        "--eval_interval=1", "--out_dir=out2")
    ckpt = torch.load(fork / "out2" / "ckpt.pt", weights_only=True)
    assert (ckpt["model_args"]["n_embd"], ckpt["model_args"]["n_head"], ckpt["model_args"]["ffn_hidden"]) == \
        (48, 3, 96)


def test_how_a_token_is_picked(fork):
    """sample.sample_next: every new token is the one it picks (here the least likely, not the most)."""
    before, _ = run(fork, "sample.py", "--out_dir=out", *DRAWN[:3], "--temperature=0", "--num_samples=2")
    edit(fork, "sample.py", '''    if temperature < 1e-6:
        return logits.argmax(-1)''', '''    if temperature < 1e-6:
        return logits.argmin(-1)''')
    after, _ = run(fork, "sample.py", "--out_dir=out", *DRAWN[:3], "--temperature=0", "--num_samples=2")
    assert after != before


ROWS = {"the exit test, or add one": test_the_exit_test,
        "when tests start, the stop rule": test_when_tests_start_the_stop_rule,
        "the loop distribution": test_the_loop_distribution,
        "the readout": test_the_readout,
        "the initial state": test_the_initial_state,
        "a block, attention, the MLP": test_a_block_attention_the_mlp,
        "a data source": test_a_data_source,
        "the model's shape": test_the_models_shape,
        "how a token is picked": test_how_a_token_is_picked}


def test_every_row_of_the_readmes_change_table_has_its_test():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## To change X, edit Y")[1].split("\n## ")[0]
    rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")][1:]
    assert set(rows) == set(ROWS)
