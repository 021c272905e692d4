"""Settings for every script, nanoGPT's way without exec-ing the command line.

A script's settings are its top-level `name = default  # what it does` lines. A config file
(Python, run as such) overrides them, then `--key=value` or `--key value`; a bare `--flag` is True.
A value keeps its default's type (an int is accepted for a float); a number is finite, in [0,
LIMITS' bound] unless the script's RULES give its range; RULES also hold text settings' choices.
Bad input anywhere raises UserError; `run` prints it as one line and exits 2.
"""
import ast
import fcntl
import math
import sys
from types import SimpleNamespace

# the largest number a setting takes: no machine's size, and what float32 tensors can scale by
LIMITS = {int: 2 ** 48, float: 3.0e38}


class UserError(Exception):
    """Input the project refuses (a setting, a file, a checkpoint): one line for the user."""


def read_settings(script):
    """{name: (default, comment)} of a script's top-level `name = default  # comment` lines."""
    with open(script["__file__"], encoding="utf-8") as f:
        source = f.read()
    lines = source.splitlines()
    settings = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name.islower():
                comment = lines[node.end_lineno - 1].partition("  # ")[2]
                settings[name] = (script[name], comment)
    return settings


def check(key, value, default, rule):
    """value, if it fits the default's type and the rule; else UserError."""
    if isinstance(default, float) and type(value) is int:
        value = float(value)
    if type(value) is not type(default):
        raise UserError(f"--{key}: expected {type(default).__name__}, got {value!r}")
    if isinstance(value, str):
        # whitespace is a value (sample.py's prompt "\n")
        if not value:
            raise UserError(f"--{key} must not be empty")
        # lone surrogates: how Python carries argv bytes that are not UTF-8
        if any("\ud800" <= ch <= "\udfff" for ch in value):
            raise UserError(f"--{key} is not UTF-8 text (convert it, e.g. with iconv)")
        if rule is not None and value not in rule:
            raise UserError(f"--{key} must be one of {', '.join(rule)}, got {value!r}")
    elif not isinstance(value, bool):
        low, high = rule or (0, math.inf)
        high = min(high, LIMITS[type(value)])
        if not (math.isfinite(value) and low <= value <= high):
            raise UserError(f"--{key} must be a finite number in [{low}, {high}], got {value!r}")
    return value


def read_config_file(path):
    """The settings a config file assigns (its own imports and _private names left out)."""
    scope = {}
    try:
        with open(path, encoding="utf-8") as f:
            exec(compile(f.read(), path, "exec"), scope)
    # a user's file may raise anything: name the file
    except (Exception, SystemExit) as err:
        raise UserError(f"{path}: {type(err).__name__}: {err}") from None
    return {k: v for k, v in scope.items() if k[0] != "_" and type(v).__name__ != "module"}


def parse_argv(argv, defaults):
    """Config files and --key=value pairs, in order, -> {key: value}."""
    given = {}
    args = list(argv)
    while args:
        arg = args.pop(0)
        if not arg.startswith("--"):
            # a config file runs as Python: never a text file by mistake
            if not arg.endswith(".py"):
                raise UserError(f"{arg!r}: expected --key=value or a config file ending in .py")
            given |= read_config_file(arg)
            continue
        key, has_value, text = arg[2:].partition("=")
        # `--key value`, or a bare `--flag`, which is True
        if not has_value and args and not args[0].startswith("--"):
            text = args.pop(0)
        elif not has_value:
            given[key] = True
            continue
        # A text setting takes the text as it is (--start=1 is "1"); anything else is a Python
        # literal. An unknown key is kept as text: configure names it.
        if key not in defaults or isinstance(defaults[key], str):
            given[key] = text
            continue
        try:
            given[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise UserError(f"--{key}: cannot parse {text!r}") from None
    return given


def configure(script, argv):
    """A script's settings (its globals) after argv -> (namespace, the keys argv set)."""
    settings = read_settings(script)
    rules = script.get("RULES", {})
    defaults = {key: default for key, (default, _) in settings.items()}
    if "--help" in argv:
        print(script["__doc__"].strip() + "\n\nsettings (--key=value):")
        for key, (default, comment) in settings.items():
            setting = f"--{key}={default!r}"
            print(f"  {setting:<32} {comment}")
        sys.exit(0)
    given = parse_argv(argv, defaults)
    for key, value in given.items():
        if key not in defaults:
            raise UserError(f"unknown setting {key!r} (see --help)")
        given[key] = check(key, value, defaults[key], rules.get(key))
    return SimpleNamespace(**(defaults | given)), set(given)


def hold_lock(path, busy):
    """An exclusive lock on path, held by the open file returned (the OS's flock: it goes with the
    process, even a killed one); UserError(busy) while another process holds it."""
    lock = open(path, "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise UserError(busy) from None
    return lock


def run(main):
    """A script's entry point: what a user typed or pointed at (a setting, a path, the network, a
    missing package, out of memory) is one line and exit 2; Ctrl-C is exit 130."""
    try:
        main(sys.argv[1:])
    except (UserError, OSError) as err:
        fail(err)
    except ModuleNotFoundError as err:
        # raised by a package itself (a broken install): its message is all there is
        if err.name is None:
            fail(f"{err} (is a package broken? reinstall it)")
        fail(f"{err}: pip install {err.name.partition('.')[0]}")
    except (KeyboardInterrupt, RuntimeError) as err:
        # torch.save's zip writer turns a Ctrl-C into a RuntimeError raised while handling it
        if KeyboardInterrupt in (type(err), type(err.__context__)):
            print("interrupted", file=sys.stderr)
            sys.exit(130)
        # torch.compile's without a C++ compiler, whose message holds its stack
        if "No working C++ compiler" in str(err):
            fail("--compile=True needs a C++ compiler (g++ or clang) on PATH, or --compile=False")
        # a GPU's OutOfMemoryError; on a CPU the allocator's RuntimeError, or C++'s bad_alloc
        out_of_memory = type(err).__name__ == "OutOfMemoryError"
        if not (out_of_memory or "can't allocate memory" in str(err) or "bad_alloc" in str(err)):
            raise
        fail("out of memory: try a smaller batch or model")
    except MemoryError:
        fail("out of memory: try a smaller batch or model")


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
