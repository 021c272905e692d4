"""nanoGPT's configurator without exec-ing the command line. Settings are a
script's globals, each with a rule in its RULES: (low, high) a number in that
range, a tuple of strings a choice, str any non-empty text, bool. A config
file overrides them, then --key=value or --key value (a bare --flag is True);
--help lists them. Bad input: one line, exit 2."""
import ast
import re
import sys
import traceback
from types import SimpleNamespace


def die(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def check(key, value, default, rule):
    value = float(value) if isinstance(default, float) and type(value) is int else value
    if type(value) is not type(default):
        die(f"--{key}: expected {type(default).__name__}, got {value!r}")
    choice = isinstance(rule, tuple) and isinstance(rule[0], str)
    if choice and value not in rule:
        die(f"--{key} must be one of {', '.join(rule)}, got {value!r}")
    if isinstance(rule, tuple) and not choice and not rule[0] <= value <= rule[1]:
        die(f"--{key} must be in [{rule[0]}, {rule[1]}], got {value!r}")
    if rule is str and not value.strip():
        die(f"--{key} must not be empty")
    return value


def read_config_file(path):
    scope = {}
    try:
        exec(compile(open(path, encoding="utf-8").read(), path, "exec"), scope)
    except (Exception, SystemExit) as err:  # user code raises anything: say where
        lines = [f.lineno for f in traceback.extract_tb(err.__traceback__) if f.filename == path]
        line = getattr(err, "lineno", None) or (lines or ["?"])[-1]
        die(f"{path}:{line}: {type(err).__name__}: {err}")
    return {k: v for k, v in scope.items() if k[0] != "_" and type(v).__name__ != "module"}


def configure(script, rules, argv):
    """-> (settings namespace, the keys a config file or the command line set)."""
    defaults = {key: script[key] for key in rules}
    if "--help" in argv:  # the docstring, each setting's default and comment
        print(script["__doc__"].strip() + "\n\nsettings (--key=value):")
        comments = dict(re.findall(r"^(\w+) = .*?# (.*)$", open(script["__file__"]).read(), re.M))
        for key, value in defaults.items():
            print(f"  --{key}={value!r:<18} {comments.get(key, '')}")
        sys.exit(0)
    given, args = {}, list(argv)
    while args:
        arg = args.pop(0)
        key, eq, text = arg[2:].partition("=")
        if not arg.startswith("--"):
            given |= read_config_file(arg)
            continue
        if not eq:  # --key value, or a bare --flag for True
            text = True if not args or args[0].startswith("--") else args.pop(0)
        try:
            given[key] = text if isinstance(defaults.get(key), str) else ast.literal_eval(str(text))
        except (ValueError, SyntaxError):
            die(f"--{key}: cannot parse {text!r}")
    for key, value in given.items():
        if key not in rules:
            die(f"unknown setting {key!r} (see --help)")
        given[key] = check(key, value, defaults[key], rules[key])
    return SimpleNamespace(**(defaults | given)), set(given)


def run(main):
    """A script's entry point: Ctrl-C is one line and exit 130, not a traceback."""
    try:
        main(sys.argv[1:])
    except (KeyboardInterrupt, RuntimeError) as err:  # torch.save's writer wraps a Ctrl-C
        if KeyboardInterrupt not in (type(err), type(err.__context__)):
            raise
        print("interrupted", file=sys.stderr)
        sys.exit(130)
