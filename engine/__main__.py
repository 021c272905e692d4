"""python -m engine: sample.py's generation at a GPU's speed, with its measurements (cli.py)."""
from configurator import run
from engine.cli import main

if __name__ == "__main__":
    run(main)
