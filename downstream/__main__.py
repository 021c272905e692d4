"""python -m downstream --out_dir=DIR --tasks=a,b: lm-eval's tasks at every depth and under the exits (harness.py).

lm-eval is this folder's own requirement, never the core's: without it, one line says what to install.
"""
from configurator import UserError, run


def main(argv):
    try:
        from downstream import harness  # imports lm-eval
    except ModuleNotFoundError as err:
        missing = (err.name or "").partition(".")[0]  # the package, of a module inside it
        if missing != "lm_eval":  # another package missing: configurator.run names it
            raise
        raise UserError("lm-eval is not installed: pip install -r downstream/requirements.txt") from None
    return harness.main(argv)


if __name__ == "__main__":
    run(main)
