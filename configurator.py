"""
The one configurator every script shares (nanoGPT style, without exec-ing the command line):
defaults are a script's module globals, then an optional Python config file, then
`--key=value` or `--key value` overrides (a bare `--flag` sets a boolean to True). Unknown keys and wrong types are errors, not
silently ignored settings.

    cfg = configure(defaults, sys.argv[1:])
"""
import ast
import os
import sys


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


def configure(defaults, argv):
    """Return a copy of `defaults` updated by config files and --key overrides in argv."""
    cfg = dict(defaults)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            if not os.path.isfile(arg):
                die(f"config file not found: {arg}")
            scope = {}
            with open(arg) as f:
                exec(compile(f.read(), arg, "exec"), scope)
            for key, value in scope.items():
                if key.startswith("_") or type(value).__name__ == "module":
                    continue
                if key not in cfg:
                    die(f"{arg}: unknown config key {key!r}")
                cfg[key] = _coerce(key, value, defaults[key])
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
                i += 1
                continue
            if not has_value:
                die(f"--{key}: missing value")
            text = argv[i + 1]
            i += 2
        if key not in cfg:
            die(f"unknown config key --{key}")
        cfg[key] = _parse_value(key, text, defaults[key])
    return cfg
