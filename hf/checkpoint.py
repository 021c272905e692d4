"""A model folder in the Hugging Face format (hf.export's, or downloaded) as a nanoloop
checkpoint:

    python -m hf.checkpoint --from=hf-shakespeare --out_dir=out-back --dataset=shakespeare
    python -m hf.checkpoint --from=owner/name --out_dir=out-back --dataset=shakespeare

out_dir/ckpt.pt gets the folder's weights and shape, for evaluate.py, allocate.py and sample.py
(its logits are the folder's). Its dataset, data/<dataset>, must have been prepared with the
folder's tokenizer (the same tokenizer.json), so that the ids mean the same text. The checkpoint
has no optimizer state: fine-tune from it (train.py --init_from=out_dir/ckpt.pt), never resume it.

--from is a local folder, or a hub repository's id (owner/name: downloaded with huggingface_hub
into its cache, or read from that cache offline, HF_HUB_OFFLINE=1). Only the folder's
config.json, tokenizer.json and safetensors weights are read: none of its code runs.
"""
import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path

import torch

from configurator import UserError, configure, run
from model import CKPT_FORMAT, GPT, GPTConfig, save_atomic
from prepare import open_dataset

source = ""  # (also --from) a model folder, or a hub repository id owner/name
revision = ""  # a hub repository's branch, tag or commit ("": main)
out_dir = ""  # writes ckpt.pt there
dataset = ""  # the data/ folder whose tokenizer.json is the model's, for evaluate.py, sample.py
overwrite = False  # replace out_dir/ckpt.pt

HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def renamed_from(argv):
    """argv with --from, the command's own word for the source (a Python keyword), as --source."""
    renamed = []
    for arg in argv:
        if arg == "--from" or arg.startswith("--from="):
            arg = "--source" + arg[len("--from"):]
        renamed.append(arg)
    return renamed


def local_folder(source, revision):
    """The folder of --from: itself, or a hub repository's snapshot (downloaded, or cached)."""
    if os.path.isdir(source):
        return Path(source)
    if not HUB_ID.fullmatch(source) or source.startswith("."):
        raise UserError(f"--from={source}: no such folder, and not a hub repository id "
                        f"(owner/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    try:
        # the files this command reads, not the rest of the repository
        return Path(snapshot_download(source, revision=revision or None,
                                      allow_patterns=["*.json", "*.safetensors"]))
    except LocalEntryNotFoundError:
        raise UserError(f"--from={source}: the hub is out of reach and its cache has no copy "
                        f"(download it where the hub is reachable, or pass a folder)") from None
    except HfHubHTTPError as err:
        first_line = str(err).strip().partition("\n")[0]
        raise UserError(f"--from={source}: the hub refused: {first_line}") from None


def read_json(path, what):
    """A JSON file -> its object; UserError if it is missing or is no JSON."""
    if not path.is_file():
        raise UserError(f"{path.parent} is not a model folder: it has no {path.name} ({what})")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not JSON: {err}") from None


def weight_files(folder):
    """The folder's safetensors files: model.safetensors, or the shards its index names."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_json(index, "the shards' index")["weight_map"].values()))
        return [folder / shard for shard in shards]
    if not (folder / "model.safetensors").is_file():
        raise UserError(f"{folder} has no model.safetensors: only safetensors weights are read")
    return [folder / "model.safetensors"]


def read_weights(folder, model_args):
    """The folder's weights as GPT's state_dict (float32, the head tied to the embedding) -> (it,
    the sha256 of the weight files: the imported run's name). UserError if they do not fit."""
    from safetensors.torch import load_file
    files = weight_files(folder)
    weights = {}
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.read_bytes())
        weights |= load_file(path)
    # transformers' names are nanoloop's under the base model's prefix; the tied head stored once
    state = {name.removeprefix("model."): tensor.float() for name, tensor in weights.items()}
    head = state.pop("lm_head.weight", None)
    if head is not None and not torch.equal(head, state.get("wte.weight", head)):
        raise UserError(f"{folder}: its head is not its embedding, and nanoloop ties the two")
    state["lm_head.weight"] = state.get("wte.weight")
    expected = GPT(GPTConfig(**model_args)).state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshapen = sorted(name for name in set(expected) & set(state)
                       if state[name] is not None and state[name].shape != expected[name].shape)
    if missing or unexpected or misshapen:
        named = ", ".join((missing + unexpected + misshapen)[:3])
        raise UserError(f"{folder}: its weights do not fit its config.json ({len(missing)} "
                        f"missing, {len(unexpected)} unexpected, {len(misshapen)} of another "
                        f"shape: {named})")
    return state, digest.hexdigest()


def same_tokenizer(folder_file, data_file):
    """Whether two tokenizer.json files are one tokenizer: the same bytes, or the same JSON."""
    mine, theirs = folder_file.read_bytes(), data_file.read_bytes()
    if mine == theirs:
        return True
    try:
        return json.loads(mine) == json.loads(theirs)
    except json.JSONDecodeError:
        return False


def main(argv=()):
    C, _ = configure(globals(), renamed_from(argv))
    for name, value in (("--from", C.source), ("--out_dir", C.out_dir), ("--dataset", C.dataset)):
        if not value:
            raise UserError(f"{name} is required (see --help)")
    ckpt_path = Path(C.out_dir, "ckpt.pt")
    # 1) every refusal before the download and the work
    if ckpt_path.exists() and not C.overwrite:
        raise UserError(f"{ckpt_path} exists: --overwrite=True replaces it")
    data_dir, meta = open_dataset(C.dataset, splits=())
    if not Path(data_dir, "tokenizer.json").is_file():
        raise UserError(f"{data_dir}/ has no tokenizer.json: run prepare.py for it")
    folder = local_folder(C.source, C.revision)
    config = read_json(folder / "config.json", "a transformers model's config")
    if config.get("model_type") != "nanoloop":
        raise UserError(f"{folder} is not a nanoloop model: its config.json has model_type "
                        f"{config.get('model_type')!r}")
    if not (folder / "tokenizer.json").is_file():
        raise UserError(f"{folder} has no tokenizer.json: its ids cannot be matched to a dataset")
    if not same_tokenizer(folder / "tokenizer.json", Path(data_dir, "tokenizer.json")):
        raise UserError(f"{data_dir}/tokenizer.json is not {folder}'s tokenizer: prepare a "
                        f"dataset with --tokenizer={folder}/tokenizer.json")
    if config.get("vocab_size") != meta["vocab_size"]:
        raise UserError(f"{folder} has vocab_size {config.get('vocab_size')}, data/{C.dataset} "
                        f"{meta['vocab_size']}")
    # 2) the shape: GPTConfig's fields as config.json names them (one it lacks: the default)
    fields = [field.name for field in dataclasses.fields(GPTConfig)]
    model_args = vars(GPTConfig(**{name: config[name] for name in fields if name in config}))
    state, digest = read_weights(folder, model_args)
    model = GPT(GPTConfig(**model_args))
    model.load_state_dict(state)
    # 3) the checkpoint as train.py saves one, named by its weights: one folder, one run
    settings = {"dataset": C.dataset, "dataset_meta": meta, "run_id": f"hf-{digest[:16]}",
                "init_from": f"hf:{C.source}", "exported_from": config.get("nanoloop_checkpoint")}
    ckpt = {"format": CKPT_FORMAT, "model_args": model_args, "config": settings,
            "model": model.state_dict(), "optimizer": None, "iter_num": 0}
    os.makedirs(C.out_dir, exist_ok=True)
    save_atomic(str(ckpt_path), ckpt)
    print(f"wrote {ckpt_path}: {folder}'s weights ({sum(t.numel() for t in model.parameters()):,} "
          f"parameters) for data/{C.dataset}")
    return ckpt_path


if __name__ == "__main__":
    run(main)
