"""The model card (README.md) of an exported folder: what the model is, its depths and exits, how
to load and generate with it, and the numbers its out_dir held of this very checkpoint."""
import transformers

from hf import TESTED_TRANSFORMERS
from hf.modeling_nanoloop import EXIT_TESTS

EXIT_MEANINGS = {"kl": "the readout settles: KL(p_i ‖ p_{i-1}) of the last two loops' softmaxes "
                       "(a readout every loop)",
                 "state": "the state settles: ‖s_i - s_{i-1}‖ / ‖s_i‖ (no readout)"}


def table(headers, rows):
    """A markdown table of rows (lists of cells)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def exit_rows(config):
    """A row per exit test: its name, what it scores, its default threshold here, and why."""
    rows = []
    for name, test in EXIT_TESTS.items():
        threshold, source = f"{test.threshold:.3g}", "the test's default"
        if name in config.operating_thresholds:
            calibrated = config.operating_thresholds[name]
            threshold = (f"{calibrated:.3g} at r_max = {config.calibrated_r_max} in "
                         f"{config.calibrated_dtype}, else {test.threshold:.3g}")
            source = "allocate.py's operating point, else the test's default"
        rows.append([f"`{name}`", EXIT_MEANINGS.get(name, ""), threshold, source])
    return rows


def depth_rows(evaluation):
    """eval.json's loss at each depth it swept, in nats per token and bits per byte."""
    return [[row["loops"], f"{row['loss']:.4f}", f"{row['bits_per_byte']:.4f}"]
            for row in evaluation.get("rows", [])]


def numbers(config, evaluation, allocation):
    """The card's sections on eval.json and allocate.json (each where out_dir held it)."""
    sections = []
    if evaluation:
        windows = evaluation.get("args", {}).get("windows", "?")
        rows = depth_rows(evaluation)
        sections.append(f"""## Loss by depth (out_dir's eval.json)

Validation loss of `{config.nanoloop_checkpoint}` at each depth, from training's noise initial
state ({windows} windows of {config.block_size} tokens):

{table(["loops", "loss (nats/token)", "bits per byte"], rows)}
""")
        median = evaluation.get("median_convergence_depth")
        if median is not None:
            sections.append(f"Median convergence depth (the loop after which a token stays "
                            f"still): {median}.\n")
    if allocation:
        thresholds = ", ".join(f"`{name}` {value:.3g}"
                               for name, value in allocation["operating_thresholds"].items())
        sections.append(f"""## Exit thresholds (out_dir's allocate.json)

allocate.py's operating thresholds for this checkpoint: {thresholds}, calibrated at r_max =
{config.calibrated_r_max} in {config.calibrated_dtype} on {allocation.get('windows', '?')}
validation windows from a zero initial state. `generate` runs them where `exit_threshold` is not
given and r_max and the model's dtype are those.
""")
    return sections


def model_card(name, config, meta, n_params, evaluation, allocation):
    """The README.md of a model folder named `name` -> markdown."""
    c = config
    shape = table(["prelude blocks", "core blocks (looped)", "coda blocks", "width", "heads (KV)",
                   "FFN", "vocabulary", "context (block_size)", "parameters"],
                  [[c.n_prelude, c.n_core, c.n_coda, c.n_embd, f"{c.n_head} ({c.n_kv_head})",
                    c.ffn_hidden, c.vocab_size, c.block_size, f"{n_params:,}"]])
    exits = table(["exit", "what it scores", "default exit_threshold", "from"], exit_rows(c))
    versions = " and ".join(TESTED_TRANSFORMERS)
    head = f"""---
library_name: transformers
pipeline_tag: text-generation
tags:
- nanoloop
- depth-recurrent
- custom_code
---

# {name}

A depth-recurrent transformer trained with nanoloop: a prelude of unique blocks reads the tokens
once, one weight-tied core is applied a chosen number of times (the input re-injected at every
loop), and a coda reads the result out. One set of weights serves many depths, and each generated
token can stop looping on its own once it has converged.

Checkpoint `{c.nanoloop_checkpoint}` of dataset `{c.nanoloop_dataset}` ({meta.get('source', '?')},
tokenizer `{meta.get('tokenizer', '?')}`, {c.vocab_size} entries, `<|endoftext|>` =
{c.eos_token_id}), trained at a depth drawn around mean_loops = {c.mean_loops} each step
(max_loops = {c.max_loops}).

{shape}

## Depth and exits

- `num_loops` (a config field and a forward and generate argument; here {c.num_loops}): the loops
  every token runs. `model(ids, num_loops=r).logits` are nanoloop's
  `GPT.forward(ids, loops=r, state_init="zero")`'s.
- `exit="kl"` or `"state"` (generate's argument; here `{c.exit}`): in `generate`, each new token
  loops until its exit score is below `exit_threshold`, from loop 2 and at `r_max` (here
  {c.r_max or c.max_loops}) at the latest; a NaN score stops no token. The prompt runs `num_loops`
  loops, as nanoloop's `sample.py --exit` runs it.

{exits}

## Load and generate, offline

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("{name}", trust_remote_code=True)
batch = tokenizer(["To be, or not", "My lord"], return_tensors="pt", padding=True)
# every token at 4 loops, greedy: the tokens of nanoloop's sample.py --loops=4 --temperature=0
out = model.generate(**batch, num_loops=4, do_sample=False, max_new_tokens=40)
print(tokenizer.batch_decode(out))
# each new token until its readout settles: sample.py --exit=kl's tokens
out = model.generate(**batch, exit="kl", do_sample=False, max_new_tokens=40)
print(model.generation_loops)  # (batch, new tokens): the loops each new token was read after
logits = model(batch.input_ids, attention_mask=batch.attention_mask, num_loops=8).logits
```

- **Loops**: after `generate`, `model.generation_loops` holds, for each new token, the loops run
  by the token it was read from (for the first, the prompt's last token, at `num_loops`); with
  `return_dict_in_generate=True`, the output's `loops` too (not under beam search).
- **The cache** is a `DynamicCache` with one layer per block. A core layer keeps, for each token,
  the K/V of the last loop that token ran (Huginn's rule): a new token loops over the cached past
  and its own current loop, and only its last loop's K/V are appended. The prompt's tokens loop
  together, each loop attending to the others' K/V of the same loop, as in training.
- **`use_cache=False`** runs the whole sequence again at every step, every position at
  `num_loops` from a zero state: each step's logits are `GPT.forward`'s of the sequence so far,
  where earlier tokens are seen at the loop being run, not at their last loop. At 1 loop this is
  the cached decode exactly; at more loops the logits differ, and the tokens may. Exits need the
  cache.
- **Padding**: the tokenizer pads on the left; `attention_mask` keeps the padding out of every
  real token, and positions start at each row's first real token: a padded row gets the logits
  it gets alone.
- **Context**: block_size = `max_position_embeddings` = {c.block_size} tokens; a position past it
  is an error (nanoloop's sample.py refills the last half of a full context; this model does not).
- **Stopping**: `generate` stops a row at `<|endoftext|>`, sample.py does not: pass
  `eos_token_id=None` for its tokens past one.
- **Precision**: in float32 the logits are nanoloop's; loaded in bfloat16 they are close, and a
  threshold calibrated in float32 is not used there.
- The tokenizer needs `trust_remote_code=True` only because transformers reads this config.json
  first, whose `auto_map` names code: without it, it asks on a terminal.
"""
    tail = f"""## Versions

Exported with transformers {transformers.__version__}. nanoloop's tests of this format
(`python -m pytest -q tests/test_hf.py`, hf/README.md) pass with transformers {versions}, on
torch 2.13.0. Back to a nanoloop checkpoint, for evaluate.py, allocate.py and sample.py:
`python -m hf.checkpoint --from={name} --out_dir=DIR --dataset=NAME`, NAME a dataset prepared
with this tokenizer.
"""
    return "\n".join([head, *numbers(c, evaluation, allocation), tail])
