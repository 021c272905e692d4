"""python -m corpora: prepare.py with the hub's corpora and tokenizers among its choices."""
import prepare
from configurator import run
from corpora import HUB_SOURCES, HUB_TOKENIZERS

if __name__ == "__main__":
    prepare.SOURCES.update(HUB_SOURCES)
    prepare.TOKENIZERS.update(HUB_TOKENIZERS)
    run(prepare.main)
