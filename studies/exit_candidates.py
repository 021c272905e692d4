"""Cheap exit tests: candidates for an exit that saves compute, each a model.ExitTest built once
per checkpoint from its weights (and its training data's token counts), none of them a readout.

The KL exit (A1) settles tokens well but runs the readout (coda, norm, head) after every loop,
which costs more than a loop at the CPU default; the state exit (A1s) costs next to nothing but
weighs every direction of the state alike. Each candidate spends at most MAX_TEST_COST of one core
loop's FLOPs (checked against the FLOP ledger at the model's shape, attention over a full block):

    cosine        1 - cos(s_i, s_{i-1}), CALM's state saturation
    head_change   the relative state change in the directions the tied head reads most
    lens_kl       KL between two loops' logit lenses over the corpus's most frequent tokens
    lens_margin   1 - (top-1 - top-2) of one logit lens over them, CALM's softmax response
    lens_spread   the logit lens's change over the whole vocabulary, through a d x d matrix

A score sees the last two loops' states only (a test without logits gets None for them), so a test
that compares two loops' lenses computes both, and counts both. Where a candidate's size is free
(the tokens a lens reads, the directions a projection keeps), it takes what SIZE_BUDGET of a loop
buys: the candidates compare at about the same cost.
"""
import numpy as np
import torch
import torch.nn.functional as F

from model import ExitTest, token_kl

# the most a test may cost, in core loops: what this study calls a cheap test
MAX_TEST_COST = 0.10
# what a candidate of free size spends, in core loops: half the most, so the sizing cannot break it
SIZE_BUDGET = 0.05
# train.bin tokens counted for the frequent tokens, in evenly spaced pieces (all if it holds fewer)
COUNTED_TOKENS = 2 ** 24
COUNTED_PIECES = 64
# FLOPs a channel of an RMS norm (a square, a sum, a scale), an entry of the per-token KL (the
# model's count), of a softmax (a max, an exp, a sum, a division) and of a top-2 (two comparisons)
NORM_FLOPS = 3
KL_FLOPS = 12
SOFTMAX_FLOPS = 4
TOP2_FLOPS = 2


def tokens_by_frequency(path, bin_dtype, vocab_size):
    """The vocabulary's ids, the most frequent in the split at path first (ties by id) ->
    (vocab_size,) int64; counted over COUNTED_TOKENS of it at most, in COUNTED_PIECES pieces."""
    data = np.memmap(path, dtype=bin_dtype, mode="r")
    pieces = [data]
    # a large corpus is counted in pieces spread over it: its first documents may not be typical
    if len(data) > COUNTED_TOKENS:
        piece = COUNTED_TOKENS // COUNTED_PIECES
        starts = np.linspace(0, len(data) - piece, COUNTED_PIECES).astype(np.int64)
        pieces = [data[start:start + piece] for start in starts]
    counts = sum(np.bincount(piece, minlength=vocab_size)[:vocab_size] for piece in pieces)
    return torch.from_numpy(np.argsort(-counts, kind="stable"))


def loop_flops(model):
    """One core loop's FLOPs per token, at the model's shape (attention over a full block)."""
    return model.flop_terms(model.config.block_size)[1]


def largest_within(cost, model, most):
    """The largest size n in [2, most] whose cost(d, n) fits SIZE_BUDGET of a loop; 2 if none does
    (a margin needs two tokens), which MAX_TEST_COST's check then refuses."""
    budget = SIZE_BUDGET * loop_flops(model)
    fitting = [n for n in range(2, most + 1) if cost(model.config.n_embd, n) <= budget]
    return max(fitting, default=2)


def frequent_lens(model, token_ids):
    """The logit lens on a few tokens: states (..., d) -> the tied head's logits of token_ids
    (..., k), read off the final-normed state with the coda skipped, in float32."""
    weight = model.lm_head.weight.detach()
    # the final norm's gain folded into the head's rows: a lens is then a norm and one matmul
    rows = weight[token_ids.to(weight.device)].float() * model.norm.weight.detach().float()
    eps = model.config.norm_eps

    def lens(s):
        # in float32 under a bf16 autocast too: the scores compare two loops' small differences
        with torch.autocast(s.device.type, enabled=False):
            normed = F.rms_norm(s.float(), (s.size(-1),), eps=eps)
            return normed @ rows.T
    return lens


def head_directions(model, n):
    """The n directions the tied head reads most: the top right singular vectors of the head (the
    final norm's gain folded in), each scaled by its singular value -> (n, d), float32."""
    readout = model.lm_head.weight.detach().float() * model.norm.weight.detach().float()
    _, singular_values, directions = torch.linalg.svd(readout, full_matrices=False)
    return singular_values[:n, None] * directions[:n]


# ---- the candidates: each builds its ExitTest from (the model, the vocabulary by frequency)
def cosine_test(model, by_frequency):
    """CALM's hidden-state saturation (Schuster et al. 2022, "Confident Adaptive Language
    Modeling", its state-propagation measure): a token stops once its state points where it pointed
    a loop before, 1 - cos(s_i, s_{i-1}) below the threshold. CALM compares consecutive layers'
    states; here, consecutive loops'. Unlike A1s, a state that only grows or shrinks has
    settled."""
    def score(s_new, s_old, logits_new, logits_old):
        """States (..., d) -> 1 - their cosine similarity (...)."""
        cosine = F.cosine_similarity(s_new.float(), s_old.float(), dim=-1)
        # rounding can leave a tiny negative where the two states agree
        return (1 - cosine).clamp_min(0.0)

    # a dot product and two squared norms, 2 a channel each
    return ExitTest(score, lambda config: 6 * config.n_embd, threshold=1e-3, label="CALM")


def head_change_flops(d, n):
    # the difference; two projections onto n directions; two squared norms of n
    return d + 2 * 2 * d * n + 2 * 2 * n


def head_change_test(model, by_frequency):
    """The state change in the directions the head reads: A1s (this project's relative state
    change) with s_i - s_{i-1} and s_i projected onto the head's top singular directions, weighted
    by their singular values: ||P (s_i - s_{i-1})|| / ||P s_i||. A change the head does not read
    (the state's own bookkeeping between loops) then keeps no token looping."""
    n = largest_within(head_change_flops, model, model.config.n_embd)
    projection = head_directions(model, n)

    def score(s_new, s_old, logits_new, logits_old):
        """States (..., d) -> the relative change of their projections (...)."""
        # in float32 under a bf16 autocast too, as the lens
        with torch.autocast(s_new.device.type, enabled=False):
            change = (s_new.float() - s_old.float()) @ projection.T
            read = s_new.float() @ projection.T
        return change.norm(dim=-1) / read.norm(dim=-1).clamp_min(1e-12)

    return ExitTest(score, lambda config: head_change_flops(config.n_embd, n), threshold=0.05)


def lens_kl_flops(d, k):
    # two states: a norm each, a lens of k rows each; then the KL over k entries
    return 2 * NORM_FLOPS * d + 2 * 2 * d * k + KL_FLOPS * k


def lens_kl_test(model, by_frequency):
    """The logit lens (nostalgebraist 2020, "interpreting GPT: the logit lens": the head read off
    a state before the last layer) restricted to the corpus's most frequent tokens: A1's test,
    KL(q_i || q_{i-1}), on the lens's softmaxes over those k tokens, without the coda and with k
    of the vocabulary's rows. The score sees states only, so both loops' lenses are computed."""
    k = largest_within(lens_kl_flops, model, model.config.vocab_size)
    lens = frequent_lens(model, by_frequency[:k])

    def score(s_new, s_old, logits_new, logits_old):
        """States (..., d) -> KL of their lenses' softmaxes over the k tokens (...)."""
        return token_kl(lens(s_new), lens(s_old))

    return ExitTest(score, lambda config: lens_kl_flops(config.n_embd, k), threshold=1e-3)


def lens_margin_flops(d, k):
    # one state: a norm, a lens of k rows, a softmax over them and its top two
    return NORM_FLOPS * d + 2 * d * k + (SOFTMAX_FLOPS + TOP2_FLOPS) * k


def lens_margin_test(model, by_frequency):
    """Softmax response (Geifman & El-Yaniv 2017; CALM's first confidence measure, the top-1 minus
    top-2 probability) on the logit lens over the corpus's most frequent tokens: a token stops
    once the lens is sure, 1 - (p_1 - p_2) below the threshold. Confidence, not convergence: it
    reads one loop, so a token may stop while its state still moves."""
    k = largest_within(lens_margin_flops, model, model.config.vocab_size)
    lens = frequent_lens(model, by_frequency[:k])

    def score(s_new, s_old, logits_new, logits_old):
        """States (..., d) -> 1 - the margin of the lens's top two probabilities (...)."""
        top_two = F.softmax(lens(s_new), dim=-1).topk(2, dim=-1).values
        return 1 - (top_two[..., 0] - top_two[..., 1])

    return ExitTest(score, lambda config: lens_margin_flops(config.n_embd, k), threshold=0.5,
                    label="CALM")


def head_spread(model):
    """The tied head's rows (the final norm's gain folded in) (V, d) -> R (d, d) with R^T R their
    covariance: ||R x|| is then the standard deviation over the vocabulary of the logits' change
    head @ x (a softmax ignores a shift of every logit, so the rows' mean is taken out)."""
    rows = (model.lm_head.weight.detach() * model.norm.weight.detach()).double()
    centred = rows - rows.mean(0)
    variances, directions = torch.linalg.eigh(centred.T @ centred / len(rows))
    # rounding can leave a tiny negative variance
    return (variances.clamp_min(0).sqrt()[:, None] * directions.T).float()


def lens_spread_flops(d):
    # two states' norms, their difference, one d x d product, a norm of d
    return 2 * NORM_FLOPS * d + d + 2 * d * d + 2 * d


def lens_spread_test(model, by_frequency):
    """The logit lens's change over the whole vocabulary for the price of a d x d product: the
    standard deviation over the vocabulary of head @ (norm(s_i) - norm(s_{i-1})), through the head
    rows' covariance (head_spread), never through V logits. By the second-order expansion
    KL(p || q) ~ Var_p(log p - log q) / 2 it is the KL exit's measure on the lens with every token
    weighted alike instead of by p (this project's; an idea of another build of this study)."""
    spread = head_spread(model)
    eps = model.config.norm_eps

    def score(s_new, s_old, logits_new, logits_old):
        """States (..., d) -> the spread of their lenses' difference, in nats (...)."""
        with torch.autocast(s_new.device.type, enabled=False):
            normed_new = F.rms_norm(s_new.float(), (s_new.size(-1),), eps=eps)
            normed_old = F.rms_norm(s_old.float(), (s_old.size(-1),), eps=eps)
            return ((normed_new - normed_old) @ spread.T).norm(dim=-1)

    return ExitTest(score, lambda config: lens_spread_flops(config.n_embd), threshold=0.05)


CANDIDATES = {"cosine": cosine_test, "lens_spread": lens_spread_test, "head_change": head_change_test, "lens_kl": lens_kl_test,
              "lens_margin": lens_margin_test}


def build_candidates(model, by_frequency):
    """{name: ExitTest} of every candidate for this model; AssertionError for one that costs more
    than MAX_TEST_COST of a loop at the model's shape."""
    tests = {name: build(model, by_frequency) for name, build in CANDIDATES.items()}
    for name, test in tests.items():
        cost = test.flops(model.config) / loop_flops(model)
        assert cost <= MAX_TEST_COST, f"{name} costs {cost:.1%} of a loop"
    return tests
