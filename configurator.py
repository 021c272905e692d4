"""
The one configurator every script shares (nanoGPT style, without exec-ing the command line):
defaults are a script's module globals, then an optional Python config file, then
`--key=value` or `--key value` overrides (a bare `--flag` sets a boolean to True). Unknown keys and wrong types are errors, not
silently ignored settings.

    cfg = configure(defaults, sys.argv[1:])

It also holds the checks every script shares: positive values, the model's shape, the device, and
Ctrl-C as one line (`run`).
"""
import ast
import importlib
import json
import os
import sys
import traceback


def die(msg):
    """One clear line on stderr and a non-zero exit: the project's answer to bad input."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def _coerce(key, value, default):
    if default is None or isinstance(value, type(default)):
        return value
    # an int where a float is expected is fine; bool is an int subclass, so refuse it explicitly
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    die(f"--{key}: expected {type(default).__name__}, got {type(value).__name__} {value!r}")


def _parse_value(key, text, default):
    if isinstance(default, str):
        return text  # strings need no quotes on the command line
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        if default is None:
            return text
        die(f"--{key}: cannot parse {text!r} as {type(default).__name__}")
    return _coerce(key, value, default)


def configure(defaults, argv, given=None):
    """Return a copy of `defaults` updated by config files and --key overrides in argv. If `given` is a set,
    the keys set explicitly (by a config file or on the command line) are added to it: a resumed run tells
    a value the user asked for from a default that way."""
    cfg = dict(defaults)
    given = set() if given is None else given
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            if not os.path.isfile(arg):
                die(f"config file not found: {arg}")
            scope = _run_config_file(arg)
            for key, value in scope.items():
                if key.startswith("_") or type(value).__name__ == "module":
                    continue
                if key not in cfg:
                    die(f"{arg}: unknown config key {key!r}")
                cfg[key] = _coerce(key, value, defaults[key])
                given.add(key)
            i += 1
            continue
        if "=" in arg:
            key, text = arg[2:].split("=", 1)
            i += 1
        else:
            key = arg[2:]
            if key not in cfg:
                die(f"unknown config key --{key}")
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            if not has_value and isinstance(cfg.get(key), bool):
                cfg[key] = True  # a bare boolean flag: `--plot` means --plot=True
                given.add(key)
                i += 1
                continue
            if not has_value:
                die(f"--{key}: missing value")
            text = argv[i + 1]
            i += 2
        if key not in cfg:
            die(f"unknown config key --{key}")
        cfg[key] = _parse_value(key, text, defaults[key])
        given.add(key)
    return cfg


def _run_config_file(path):
    """A config file's globals. It is the user's Python: an error in it is one line with its file and line."""
    scope = {}
    with open(path) as f:
        source = f.read()
    try:
        exec(compile(source, path, "exec"), scope)
    except SyntaxError as err:
        die(f"{path}:{err.lineno}: {type(err).__name__}: {err.msg}")
    except Exception as err:  # user code can raise anything; report where, not a traceback into configurator
        lines = [frame.lineno for frame in traceback.extract_tb(err.__traceback__) if frame.filename == path]
        die(f"{path}:{lines[-1] if lines else '?'}: {type(err).__name__}: {err}")
    return scope


# ----------------------------------------------------------------------------- shared checks

def require_positive(cfg, *keys):
    """One check per key, one message naming the key and its wrong value (cfg: a namespace)."""
    for key in keys:
        value = getattr(cfg, key)
        if not value > 0:
            die(f"--{key} must be > 0, got {value!r}")


def check_model(cfg):
    """The rules GPTConfig asserts, as one clear line each, before anything is built."""
    require_positive(cfg, "n_embd", "n_head", "n_kv_head", "ffn_hidden", "block_size", "mean_loops",
                     "max_loops", "bptt_k")
    if cfg.n_embd % cfg.n_head:
        die(f"--n_head={cfg.n_head} must divide --n_embd={cfg.n_embd}")
    if cfg.n_head % cfg.n_kv_head:
        die(f"--n_kv_head={cfg.n_kv_head} must divide --n_head={cfg.n_head}")
    if cfg.n_embd // cfg.n_head % 2:  # rotary embeddings rotate pairs of channels
        die(f"the head size n_embd / n_head = {cfg.n_embd // cfg.n_head} must be even")
    if cfg.mean_loops > cfg.max_loops:
        die(f"--mean_loops={cfg.mean_loops} must be <= --max_loops={cfg.max_loops}")


def inherit(cfg, saved, given, source):
    """Set cfg's keys to the values in `saved` (a resumed run's model, from its checkpoint). A value the user
    gave explicitly (`given`, from configure) that differs is an error naming both, never silently dropped."""
    for key, value in saved.items():
        asked = getattr(cfg, key)
        if key in given and asked != value:
            die(f"--{key}={asked}, but {source} has {key}={value}: a resumed run keeps it (drop --{key})")
        setattr(cfg, key, value)


def require_package(name, setting):
    """Import an optional package that a setting needs, or one line and exit 2 saying how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        die(f"{setting} needs the optional package {name}: pip install {name}")


def default_device():
    """(device, dtype) every script defaults to: CUDA and bfloat16 when a GPU is there, else CPU and float32.
    torch is imported here, not at the top: prepare.py uses this module without it."""
    import torch
    return ("cuda", "bfloat16") if torch.cuda.is_available() else ("cpu", "float32")


def check_device(device, dtype="float32"):
    """One line and exit 2 for a device this machine does not have or a dtype the scripts do not run,
    before anything else (a checkpoint, say) could be blamed for it."""
    import torch
    if dtype not in ("float32", "bfloat16"):
        die(f"--dtype must be float32 or bfloat16, got {dtype!r}")
    if device.split(":")[0] not in ("cpu", "cuda"):
        die(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        die(f"--device={device}: no CUDA GPU is available on this machine (use --device=cpu)")


def write_json(path, obj):
    """Whole or not at all: written to a temporary file, then renamed over the old one."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def run(main):
    """A script's entry point: main(command-line args), with Ctrl-C as one line and exit 130, no traceback.
    Checkpoints and datasets are only ever renamed into place whole, so nothing is left half-written."""
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
