import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the scripts are modules at the repo root

SCRIPTS = ("train", "evaluate", "allocate", "sample")  # the scripts whose defaults follow the machine
CPU_DEFAULTS = {"device": "cpu", "dtype": "float32", "compile": False}  # what they default to without a GPU


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one); the scripts keep their "
                                       "CUDA defaults instead of the CPU's")


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Every test model is tiny: with two intra-op threads the hand-offs cost more than the matmuls
    (20-50x slower on a shared 2-core machine), so the suite runs on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def cpu_defaults():
    """The suite means the CPU, on any machine: on a GPU machine the scripts default to --device=cuda,
    --dtype=bfloat16 and --compile=True, which would change what every test computes. So each script
    imported by the tests gets the CPU's defaults, and a subprocess (`python train.py`, torchrun)
    sees no GPU (CUDA_VISIBLE_DEVICES empty), so that its defaults are the CPU's too. Session-wide,
    so that a module's fixture that trains a model trains it on the CPU. -> the values it replaced,
    for the tests marked cuda: {"env": CUDA_VISIBLE_DEVICES or None, "settings": [(module, name, value)]}."""
    replaced = {"env": os.environ.get("CUDA_VISIBLE_DEVICES"), "settings": []}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        # the scripts the test files imported (a script that nothing imported runs no test)
        loaded = [sys.modules[name] for name in SCRIPTS if name in sys.modules]
        for module in loaded:
            for name, value in CPU_DEFAULTS.items():
                if hasattr(module, name):
                    replaced["settings"].append((module, name, getattr(module, name)))
                    patch.setattr(module, name, value)
        yield replaced


@pytest.fixture(autouse=True)
def cuda_tests_keep_the_cuda_defaults(request, cpu_defaults, monkeypatch):
    """A test marked cuda is skipped without a GPU; with one, it runs with the scripts' own defaults
    (cuda, bfloat16 in train.py and sample.py, compile) and every GPU visible."""
    if request.node.get_closest_marker("cuda") is None:
        return
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if cpu_defaults["env"] is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cpu_defaults["env"])
    for module, name, value in cpu_defaults["settings"]:
        monkeypatch.setattr(module, name, value)
