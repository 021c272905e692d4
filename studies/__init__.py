"""Studies built on the core: each a module run as python -m studies.NAME (README.md)."""
