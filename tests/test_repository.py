"""The repository as a newcomer meets it: the test command CI runs, and the suite's own guard against a
test that leaves global state behind for the next one."""
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
