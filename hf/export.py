"""A nanoloop checkpoint as a folder that transformers loads offline:

    python -m hf.export --out_dir=out-shakespeare --to=hf-shakespeare

--to gets config.json (with its auto_map), the configuration and modeling files copied from
hf/, model.safetensors (the tied embedding stored once), the dataset's tokenizer.json with its
tokenizer_config.json and special_tokens_map.json, generation_config.json, and a model card
(README.md) with what out_dir holds of this checkpoint: eval.json's loss by depth,
allocate.json's thresholds. Then

    AutoModelForCausalLM.from_pretrained("hf-shakespeare", trust_remote_code=True)
    AutoTokenizer.from_pretrained("hf-shakespeare")

The folder is written whole or not at all (into a hidden sibling, then renamed), and replaces
only a folder this command wrote, unless --overwrite=True.
"""
import json
import os
import shutil
from math import inf
from pathlib import Path

import torch

from allocate import read_allocation
from configurator import UserError, configure, run
from hf import FOLDER_FILES, MODEL_FILES, require_transformers
from model import MIN_EXIT_LOOP, checkpoint_id
from prepare import EOT, open_run

out_dir = "out-shakespeare"  # reads ckpt.pt, eval.json, allocate.json, the dataset's tokenizer
to = ""  # the folder to write, e.g. hf-shakespeare (its parent must exist)
overwrite = False  # replace a folder at --to that this command did not write
num_loops = 0  # the folder's default depth (config.num_loops); 0: the checkpoint's mean_loops
exit = "none"  # the folder's default exit for generate: none, kl (output settles) or state
exit_threshold = -1.0  # its default threshold; -1: allocate.py's, else the exit test's own
r_max = 0  # the most loops a new token may run under an exit; 0: the checkpoint's max_loops
RULES = {"exit_threshold": (-1, inf)}

HERE = Path(__file__).parent


def read_evaluation(out_dir, ckpt):
    """out_dir/eval.json if it is there and of this very checkpoint, else None."""
    path = Path(out_dir, "eval.json")
    if not path.is_file():
        return None
    evaluation = json.loads(path.read_text())
    if evaluation.get("checkpoint") != checkpoint_id(ckpt):
        return None
    return evaluation


def read_calibration(out_dir, ckpt):
    """out_dir/allocate.json if it is there and of this very checkpoint, else None."""
    try:
        return read_allocation(out_dir, ckpt)
    except UserError:
        return None


def calibration(allocation):
    """The config's fields of allocate.json's operating point: its thresholds, and the r_max and
    dtype it was found at (read as sample.py reads them)."""
    if allocation is None:
        return {}
    return {"operating_thresholds": allocation["operating_thresholds"],
            "calibrated_r_max": allocation["r_max"],
            "calibrated_dtype": allocation["args"]["dtype"]}


def depth_settings(C, model_config):
    """The folder's default depth, from the settings -> NanoloopConfig's fields; UserError for an
    unknown exit or an r_max too shallow for one."""
    from hf.modeling_nanoloop import EXIT_TESTS
    if C.exit != "none" and C.exit not in EXIT_TESTS:
        choices = ", ".join(EXIT_TESTS)
        raise UserError(f"--exit must be none or one of {choices}, got {C.exit!r}")
    if C.exit != "none" and (C.r_max or model_config.max_loops) < MIN_EXIT_LOOP:
        raise UserError(f"--r_max={C.r_max}: an exit needs r_max >= {MIN_EXIT_LOOP}")
    threshold = None
    if C.exit_threshold >= 0:
        threshold = C.exit_threshold
    return {"num_loops": C.num_loops or model_config.mean_loops, "exit": C.exit,
            "exit_threshold": threshold, "r_max": C.r_max}


def is_ours(path, needs_config=True):
    """Whether the folder at path holds nothing but what this command writes (and, unless told,
    a config.json that says so): only such a folder is replaced without --overwrite."""
    if not path.is_dir() or path.is_symlink() or not set(os.listdir(path)) <= FOLDER_FILES:
        return False
    if not needs_config:
        return True
    try:
        config = json.loads(Path(path, "config.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and "nanoloop_checkpoint" in config


def hidden_sibling(folder, suffix):
    return folder.parent / f".{folder.name}.{suffix}"


def check_destination(folder, overwrite):
    """UserError unless folder may be (re)written: its parent a folder, and it absent, an earlier
    export, or --overwrite=True. What a killed export left beside it must be one's too."""
    if not folder.parent.is_dir():
        raise UserError(f"--to={folder}: its parent folder {folder.parent} does not exist")
    if folder.is_symlink() or folder.exists() and not folder.is_dir():
        raise UserError(f"--to={folder} exists and is not a folder: left alone")
    if folder.exists() and not overwrite and not is_ours(folder):
        raise UserError(f"--to={folder} exists and is not a folder hf.export wrote: left alone "
                        f"(--overwrite=True replaces it)")
    for leftover in (hidden_sibling(folder, "tmp"), hidden_sibling(folder, "old")):
        if os.path.lexists(leftover) and not is_ours(leftover, needs_config=False):
            raise UserError(f"{leftover} is in the way and is not hf.export's: move it")


def hf_config(ckpt, meta, allocation, depth):
    """The NanoloopConfig of a checkpoint: its model_args, its default depth (depth_settings),
    the thresholds allocate.py calibrated for it, its tokenizer's EOT, where it came from."""
    from hf.configuration_nanoloop import NanoloopConfig
    eot = meta["eot_id"]
    # where it came from: `python -m hf.checkpoint` and the model card read these
    provenance = {"nanoloop_checkpoint": checkpoint_id(ckpt),
                  "nanoloop_dataset": ckpt["config"]["dataset"],
                  "tokenizer_sha256": meta.get("tokenizer_sha256", "")}
    special_tokens = {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot}
    config = NanoloopConfig(**ckpt["model_args"], **depth, **calibration(allocation),
                            **special_tokens, **provenance)
    config.architectures = ["NanoloopForCausalLM"]
    config.auto_map = {"AutoConfig": "configuration_nanoloop.NanoloopConfig",
                       "AutoModelForCausalLM": "modeling_nanoloop.NanoloopForCausalLM"}
    return config


def write_tokenizer(folder, data_dir, block_size):
    """The dataset's tokenizer.json as it is (byte for byte: its sha256 names it), and the files
    transformers' AutoTokenizer reads beside it: a PreTrainedTokenizerFast whose EOT starts, ends
    and pads a text, padding on the left (where generate wants it)."""
    shutil.copyfile(f"{data_dir}/tokenizer.json", folder / "tokenizer.json")
    special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT, "pad_token": EOT}
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
                "model_max_length": block_size, "padding_side": "left", "add_bos_token": False,
                "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def write_folder(folder, name, model, ckpt, meta, data_dir, depth, evaluation, allocation):
    """Every file of the model folder `name` into the empty folder `folder` (a hidden sibling)."""
    from transformers import GenerationConfig

    from hf.card import model_card
    from hf.modeling_nanoloop import NanoloopForCausalLM
    config = hf_config(ckpt, meta, allocation, depth)
    hf_model = NanoloopForCausalLM(config)
    # nanoloop's parameter names, under the base model's prefix; the head beside it
    weights = {f"model.{name}": value for name, value in model.state_dict().items()}
    weights["lm_head.weight"] = weights.pop("model.lm_head.weight")
    hf_model.load_state_dict(weights)
    eot = meta["eot_id"]
    hf_model.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=eot,
                                                  pad_token_id=eot, do_sample=False)
    # config.json, generation_config.json and model.safetensors (the tied head stored once)
    hf_model.save_pretrained(folder)
    for file_name in MODEL_FILES:
        shutil.copyfile(HERE / file_name, folder / file_name)
    write_tokenizer(folder, data_dir, config.block_size)
    n_params = sum(p.numel() for p in model.parameters())
    card = model_card(name, config, meta, n_params, evaluation, allocation)
    (folder / "README.md").write_text(card)


def sync_folder(folder):
    """Each file of folder onto the disk, before the folder is renamed into place."""
    for path in folder.iterdir():
        descriptor = os.open(path, os.O_RDONLY)
        os.fsync(descriptor)
        os.close(descriptor)


def main(argv=()):
    C, _ = configure(globals(), argv)
    require_transformers()
    if not C.to:
        raise UserError("--to: name the folder to write, e.g. --to=hf-shakespeare")
    folder = Path(C.to)
    # 1) every refusal before any work: the checkpoint, its dataset and tokenizer, the destination
    model, ckpt, data_dir, meta = open_run(C.out_dir, "cpu", splits=())
    if not os.path.isfile(f"{data_dir}/tokenizer.json"):
        raise UserError(f"{data_dir}/ has no tokenizer.json: run prepare.py for it")
    if "eot_id" not in meta:
        raise UserError(f"{data_dir}/meta.json has no eot_id: prepare the dataset again")
    depth = depth_settings(C, model.config)
    check_destination(folder, C.overwrite)
    evaluation = read_evaluation(C.out_dir, ckpt)
    allocation = read_calibration(C.out_dir, ckpt)
    # 2) the whole folder into a hidden sibling, then swapped in (as prepare.py swaps a dataset)
    tmp = hidden_sibling(folder, "tmp")
    old = hidden_sibling(folder, "old")
    if not folder.exists() and is_ours(old):
        # a kill between the two renames below left the last export aside: put it back
        os.replace(old, folder)
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with torch.no_grad():
        write_folder(tmp, folder.name, model, ckpt, meta, data_dir, depth, evaluation,
                     allocation)
    sync_folder(tmp)
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)
    n_files = len(os.listdir(folder))
    print(f"wrote {folder}/: {checkpoint_id(ckpt)} of {C.out_dir}, {n_files} files")
    return folder


if __name__ == "__main__":
    run(main)
