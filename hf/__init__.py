"""A nanoloop checkpoint as a Hugging Face model folder, and back (see hf/README.md):

    python -m hf.export --out_dir=out-shakespeare --to=hf-shakespeare
    python -m hf.checkpoint --from=hf-shakespeare --out_dir=out-back --dataset=shakespeare

transformers is this folder's requirement, never the core's: without it, one line says what to
install.
"""
from configurator import UserError

# the transformers releases tests/test_hf.py passed on (hf/README.md says how they were run)
TESTED_TRANSFORMERS = ("5.20.2", "5.24.0")
# what a model folder holds: the files export writes, and the two Python files it copies from here
MODEL_FILES = ("configuration_nanoloop.py", "modeling_nanoloop.py")
FOLDER_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "README.md", *MODEL_FILES}


def require_transformers():
    """UserError, in one line, if transformers is not installed."""
    try:
        import transformers  # noqa: F401
    except ModuleNotFoundError as err:
        # another package missing inside transformers: configurator.run names that one
        if (err.name or "").partition(".")[0] != "transformers":
            raise
        raise UserError("transformers is not installed: "
                        "pip install -r hf/requirements.txt") from None
