"""The repository as a newcomer meets it: the test command CI runs, and the suite's own guard against a
test that leaves global state behind for the next one."""
import ast
import re
from pathlib import Path

import pytest
import torch

import conftest

ROOT = Path(__file__).resolve().parents[1]


def test_the_global_state_check_sees_a_torch_config_entry_that_monkeypatch_hid():
    """The failure a newcomer met: pytest's MonkeyPatch, undone, hides a torch config entry (reading it
    raises), and every torch.compile after it fails. conftest.global_state must see it."""
    default = torch._dynamo.config.error_on_recompile
    before = conftest.global_state()
    patch = pytest.MonkeyPatch()
    patch.setattr(torch._dynamo.config, "error_on_recompile", True)
    patch.undo()
    try:
        assert conftest.global_state() != before
        with pytest.raises(AttributeError):
            torch._dynamo.config.error_on_recompile
    finally:
        torch._dynamo.config.error_on_recompile = default  # an assignment shows the entry again
    assert conftest.global_state() == before


def test_the_global_state_check_sees_a_default_dtype_and_a_module_global():
    import sample
    before = conftest.global_state()
    real_generate = sample.generate
    torch.set_default_dtype(torch.float64)
    sample.generate = None
    try:
        after = conftest.global_state()
    finally:
        torch.set_default_dtype(torch.float32)
        sample.generate = real_generate
    changed = {key for key in before if after[key] != before[key]}
    assert changed == {"default dtype", "sample's globals"}


def test_ci_runs_the_readmes_test_command_in_a_fresh_virtual_environment():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"^(python -m pytest[^#\n]*?)\s*(#.*)?$", readme, re.M).group(1)
    assert command in ci.splitlines()
    assert "-m venv" in ci and "pip install" in ci and "-r requirements.txt" in ci


READ_BY_USERS = [*ROOT.glob("*.md"), *ROOT.glob("*/README.md"), *ROOT.glob("*.sh"), *ROOT.glob("studies/*.sh"),
                 *ROOT.glob("config/**/*.py")]


@pytest.mark.parametrize("path", READ_BY_USERS, ids=lambda path: str(path.relative_to(ROOT)))
def test_what_users_read_names_no_issue_numbers_and_no_paths_outside_the_repository(path):
    """A user of the repository cannot open the project's issues or the developers' shared folder."""
    text = path.read_text()
    assert not re.search(r"\b[Ii]ssues? #?\d+", text), re.search(r".*\b[Ii]ssues? #?\d+.*", text).group()
    assert "../shared" not in text


CORE = ["allocate.py", "configurator.py", "evaluate.py", "model.py", "prepare.py", "sample.py", "train.py"]
FOLDERS = sorted(path.name for path in ROOT.iterdir()
                 if path.is_dir() and not path.name.startswith(".") and (path / "README.md").is_file())


def test_the_readme_is_a_front_door():
    """At most 150 lines, and its files table names every core file and every folder built on the core
    (its line counts are the reader's, never compared here: an edit to a file breaks no test)."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    for name in CORE:
        assert f"| `{name}` |" in readme, name
    for folder in FOLDERS:
        assert f"| `{folder}/` |" in readme, folder


def test_every_folder_built_on_the_core_is_a_package_with_a_readme_and_tests():
    assert {"downstream", "engine", "studies"} <= set(FOLDERS)
    tested = {path.stem.removeprefix("test_") for path in (ROOT / "tests").glob("test_*.py")}
    for folder in FOLDERS:
        assert (ROOT / folder / "__init__.py").is_file() or (ROOT / folder / "__main__.py").is_file(), folder
        assert folder in tested, folder


def test_the_core_is_under_two_thousand_lines_and_never_imports_its_folders():
    """Nor their packages (lm-eval), at its top or inside a function: the core runs without them."""
    core = sorted(ROOT.glob("*.py"))
    assert [path.name for path in core] == CORE
    assert sum(len(path.read_text().splitlines()) for path in core) < 2000
    for path in core:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in getattr(node, "names", [])] + [getattr(node, "module", None) or ""]
            assert not any(name.split(".")[0] in (*FOLDERS, "lm_eval") for name in names), path.name
