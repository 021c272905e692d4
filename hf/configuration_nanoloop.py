"""A nanoloop model's configuration in transformers: its shape, as nanoloop's GPTConfig names
it, and how deep it runs (num_loops, exit, exit_threshold, r_max, and the thresholds that
allocate.py calibrated).

`python -m hf.export` copies this file beside the weights; it imports transformers alone.
"""
from transformers import PreTrainedConfig


class NanoloopConfig(PreTrainedConfig):
    """GPTConfig's fields under their nanoloop names (transformers' standard names map onto them),
    and the depth a forward and generate run at unless told otherwise:

    - num_loops: the loops every token runs (None: mean_loops); with an exit, the prompt's.
    - exit: "none", or an exit test ("kl": the readout settles, "state": the state settles) that
      stops each new token of generate once its score is below exit_threshold, at r_max loops
      at the latest.
    - exit_threshold: None for the calibrated one (operating_thresholds, used where r_max and the
      model's dtype are calibrated_r_max and calibrated_dtype), else the test's own default.
    - r_max: 0 for max_loops.
    """
    model_type = "nanoloop"
    attribute_map = {"hidden_size": "n_embd", "num_attention_heads": "n_head",
                     "num_key_value_heads": "n_kv_head", "intermediate_size": "ffn_hidden",
                     "max_position_embeddings": "block_size"}

    def __init__(self, vocab_size=256, block_size=256, n_embd=64, n_head=4, n_kv_head=2,
                 ffn_hidden=128, n_prelude=1, n_core=1, n_coda=1, mean_loops=4, max_loops=16,
                 bptt_k=4, rope_theta=10000.0, norm_eps=1e-5, state_std=0.4 ** 0.5,
                 num_loops=None, exit="none", exit_threshold=None, r_max=0,
                 operating_thresholds=None, calibrated_r_max=0, calibrated_dtype="",
                 use_cache=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                 tie_word_embeddings=True, **kwargs):
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.n_embd = n_embd
        self.n_head = n_head
        self.n_kv_head = n_kv_head
        self.ffn_hidden = ffn_hidden
        self.n_prelude = n_prelude
        self.n_core = n_core
        self.n_coda = n_coda
        self.mean_loops = mean_loops
        self.max_loops = max_loops
        self.bptt_k = bptt_k
        self.rope_theta = rope_theta
        self.norm_eps = norm_eps
        self.state_std = state_std
        self.num_loops = num_loops or mean_loops
        self.exit = exit
        self.exit_threshold = exit_threshold
        self.r_max = r_max
        self.operating_thresholds = operating_thresholds or {}
        self.calibrated_r_max = calibrated_r_max
        self.calibrated_dtype = calibrated_dtype
        self.use_cache = use_cache
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.tie_word_embeddings = tie_word_embeddings
        # A transformers cache holds one layer per block that attends: the prelude's, the core's
        # (each token's last loop) and the coda's. Derived, so a saved value is not read back.
        kwargs.pop("num_hidden_layers", None)
        self.num_hidden_layers = n_prelude + n_core + n_coda
        # GPTConfig's fields that the model does not read (the loop distribution's) come in kwargs
        # and are kept as they are, so that `python -m hf.checkpoint` gives them back.
        super().__init__(**kwargs)
