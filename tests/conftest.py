import os
import sys
from pathlib import Path

import pytest
import torch
import torch._inductor.config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the scripts are modules at the repo root

# the scripts whose defaults follow the machine, the core's and the folders'
SCRIPTS = ("train", "evaluate", "allocate", "sample", "studies.timing", "studies.token_classes", "studies.probe",
           "downstream.harness")
CPU_DEFAULTS = {"device": "cpu", "dtype": "float32", "compile": False}  # what they default to without a GPU


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one); the scripts keep their "
                                       "CUDA defaults instead of the CPU's")


def global_state():
    """What a test could change for every test after it: torch's compiler settings and caches, its
    process-wide defaults, and the globals of the project's modules (compared by identity)."""
    state = {"torch._dynamo.config": config_state(torch._dynamo.config),
             "torch._inductor.config": config_state(torch._inductor.config),
             "dynamo's compiled frames": len(torch._dynamo.convert_frame.input_codes.seen),
             "default dtype": torch.get_default_dtype(),
             "threads": torch.get_num_threads(),
             "grad mode": torch.is_grad_enabled(),
             "TF32 matmuls": torch.backends.cuda.matmul.allow_tf32}
    for name in PROJECT_MODULES:
        if name in sys.modules:
            # not the __dunder__ names: torch.compile adds __import_<module> ones to the modules it traces
            module_globals = vars(sys.modules[name]).items()
            state[f"{name}'s globals"] = {key: id(value) for key, value in module_globals if not key.startswith("__")}
    return state


def script_env():
    """The environment of a script the tests start as a process: no GPU visible, so that its defaults are the
    CPU's; one thread; the repository importable, before what PYTHONPATH held (an older torch's studies/older_torch).
    (Only there: hiding the GPU from the tests' own process, once CUDA has started in it, makes torch count no
    GPU where it already uses one, and torch.compile then fails.)"""
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def stderr_of_a_refusal(capsys, main, argv):
    """main run on argv through configurator.run, as a script's command line runs it: it must exit 2 -> what
    it printed on stderr (the tests' own checks read it: one line, or its last)."""
    import configurator  # the repository's root is on sys.path from the top of this file
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("sys.argv", ["script", *argv])
        with pytest.raises(SystemExit) as exit_:
            configurator.run(main)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def config_state(config):
    """A torch config module's values, and the entries it hides: pytest's monkeypatch, undone, hides the
    entry it set (reading it then raises AttributeError), and the values alone do not show that."""
    hidden = [name for name, entry in config._config.items() if entry.hide]
    return config.get_config_copy(), hidden


PROJECT_MODULES = ("configurator", "model", "prepare", *SCRIPTS)


@pytest.fixture(autouse=True)
def leaves_no_global_state():
    """Fails the test that changed global state (see global_state) and did not put it back: a later test would
    run under it. The test's own fixtures are set up after this one, so it looks once they are torn down (after
    monkeypatch's undo).
    torch's configs are changed only through their own patch(): pytest's monkeypatch deletes their entries."""
    before = global_state()
    yield
    after = global_state()
    changed = [key for key in before if after.get(key) != before[key]]
    for key in changed:
        if key.endswith("globals"):  # name them
            names = {name for name in before[key] | after[key] if before[key].get(name) != after[key].get(name)}
            changed[changed.index(key)] = f"{key} ({', '.join(sorted(names))})"
    if changed:
        torch._dynamo.reset()  # what can be emptied is, so that the tests after it fail only for their own reasons
        pytest.fail(f"the test left global state changed: {', '.join(changed)}")


@pytest.fixture
def fresh_compiler():
    """torch.compile from an empty cache, emptied again after the test, even one that fails -> dynamo's counters."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


@pytest.fixture
def tf32_restored():
    """For a test that runs train.main on a GPU: it allows TF32 matmuls for its whole process, as a script may."""
    allowed = torch.backends.cuda.matmul.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32 = allowed


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
    imported by the tests gets the CPU's defaults (a script started as a process gets script_env()).
    Session-wide, so that a module's fixture that trains a model trains it on the CPU. -> the values it
    replaced, for the tests marked cuda: [(module, name, value)]."""
    replaced = []
    with pytest.MonkeyPatch.context() as patch:
        # the scripts the test files imported (a script that nothing imported runs no test)
        loaded = [sys.modules[name] for name in SCRIPTS if name in sys.modules]
        for module in loaded:
            for name, value in CPU_DEFAULTS.items():
                if hasattr(module, name):
                    replaced.append((module, name, getattr(module, name)))
                    patch.setattr(module, name, value)
        yield replaced


@pytest.fixture(autouse=True)
def cuda_tests_keep_the_cuda_defaults(request, cpu_defaults):
    """A test marked cuda is skipped without a GPU; with one, it runs with the scripts' own defaults
    (cuda, bfloat16 in train.py and sample.py, compile)."""
    if request.node.get_closest_marker("cuda") is None:
        yield
        return
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    # its own MonkeyPatch, not the test's: the test's is undone before leaves_no_global_state looks
    with pytest.MonkeyPatch.context() as patch:
        for module, name, value in cpu_defaults:
            patch.setattr(module, name, value)
        yield
