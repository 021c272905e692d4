"""Tests for studies/launches.py: kernel launches counted on the CPU as a GPU would make them, on
functions whose launches can be counted by hand, on a tiny decoder, and on S0's decode token."""
from functools import partial

import pytest
import torch

import model as model_lib
from engine.decoder import Decoder
from studies import launches
from studies.launches import Launches, count_launches

pytest.importorskip("triton")  # inductor's GPU code (studies/requirements.txt)

TINY = model_lib.GPTConfig(vocab_size=300, block_size=64, n_embd=32, n_head=2, n_kv_head=1,
                           ffn_hidden=64, n_prelude=1, n_core=2, n_coda=1, mean_loops=2,
                           max_loops=4, bptt_k=4)


@pytest.fixture(autouse=True)
def no_compiled_graphs_left(fresh_compiler):
    """Each test compiles from an empty cache, emptied again after it (conftest.fresh_compiler)."""


def test_a_matmul_and_its_epilogue_are_two_launches_and_an_eager_op_one():
    """relu(x @ w) + 1 compiled: one matmul (extern) and one fused kernel; then a view launches
    nothing and an eager sum one. The same count every time."""
    x, w = torch.randn(4, 8), torch.randn(8, 16)
    layer = torch.compile(lambda x, w: torch.relu(x @ w) + 1, fullgraph=True)

    def call():
        return layer(x, w).t().sum()
    assert count_launches(call) == Launches(fused=1, extern=1, eager=1)
    assert count_launches(call, warm_up=2) == count_launches(call)


def test_a_backward_counts_its_graph_and_autograds_gradient_sum():
    """tanh(x @ w) compiled, used on n inputs, summed, backward: per use, forward one matmul and
    one fused tanh, backward one matmul (w's gradient; x needs none) and one fused tanh'. Outside
    the graphs, per use: its sum, Python's + adding it, the copy of its incoming gradient (sum's
    backward, an expand: a view) into the dense layout the backward graph takes; once: backward's
    seed (ones_like); from the second use on: autograd adding w's gradients."""
    x1, x2 = torch.randn(4, 8), torch.randn(4, 8)
    w = torch.randn(8, 8, requires_grad=True)
    layer = torch.compile(lambda x: torch.tanh(x @ w), fullgraph=True)

    def step(inputs):
        # no .grad to add into: autograd takes the sum as it is
        w.grad = None
        sum(layer(x).sum() for x in inputs).backward()
    assert count_launches(step, [x1]) == Launches(fused=2, extern=2, eager=3 + 1)
    assert count_launches(step, [x1, x2]) == Launches(fused=4, extern=4, eager=2 * 3 + 1 + 1)


def test_a_cat_is_lowered_as_for_a_gpu_and_can_be_as_for_a_cpu():
    """relu(cat of two matmuls): a GPU's lowering reads both in the relu's one kernel; a CPU
    tensor's copies an input in a kernel of its own."""
    x, w1, w2 = torch.randn(4, 8), torch.randn(8, 16), torch.randn(8, 16)
    layer = torch.compile(lambda x: torch.cat([x @ w1, x @ w2]).relu(), fullgraph=True)
    assert count_launches(layer, x) == Launches(fused=1, extern=2)
    assert count_launches(layer, x, gpu_cat=False) == Launches(fused=2, extern=2)


def test_a_custom_op_counts_what_its_body_runs():
    """torch's chunked loss (a custom op written in Python): the same kernels in every chunk, so
    that each chunk more adds as many launches, not none."""
    h, head = torch.randn(6, 8, requires_grad=True), torch.randn(50, 8)
    y = torch.randint(50, (6,))

    def loss(rows):
        chunks = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=rows)
        torch.nn.functional.linear_cross_entropy(h, head, y, options=chunks).backward()
    one, two, three = (count_launches(loss, 6 // n).eager for n in (1, 2, 3))
    assert three - two == two - one > 5


def tiny_decoder(depth, dtype):
    torch.manual_seed(0)
    model = model_lib.GPT(TINY).eval()
    with model_lib.autocast("cpu", dtype):
        decoder = Decoder(model, 1, depth, "cpu", partial(torch.compile, fullgraph=True))
    decoder.pos.fill_(5)
    return decoder


@pytest.fixture(scope="module")
def tiny_steps():
    """Launches of the tiny decoder's graphs, each compiled once for the module: its uniform step
    at r = 1 and 2 (bf16; r = 1 in float32 too), and the state exit's loop (bf16)."""
    counts = {}
    steps = (("r=1", 1, "bfloat16"), ("r=2", 2, "bfloat16"), ("r=1 float32", 1, "float32"))
    for name, r, dtype in steps:
        decoder = tiny_decoder(model_lib.uniform_depth(r), dtype)
        with torch.no_grad(), model_lib.autocast("cpu", dtype):
            counts[name] = count_launches(decoder.step)
    state_exit = model_lib.DepthPolicy(model_lib.EXIT_TESTS["state"], 0.0, 4)
    decoder = tiny_decoder(state_exit, "bfloat16")
    with torch.no_grad(), model_lib.autocast("cpu", "bfloat16"):
        decoder.begin()
        counts["state loop"] = count_launches(decoder.loop)
    return counts


def test_a_uniform_step_is_one_graph_of_the_matmuls_by_hand_and_no_weight_casts(tiny_steps):
    """Each block: one matmul for q/k/v, one for the output, one for gate/up, one for down, one
    attention call; each loop adds the adapter's matmul; the readout the head's. So the step at r
    loops holds 5 (prelude) + 11 r (core: 1 + 5 x 2) + 5 + 1 (coda, head) extern kernels. The
    matrices are bf16 at load: under bf16 autocast a step launches at most an activation's cast
    more than in float32, where nothing is cast, never one a matrix (22)."""
    one, two = tiny_steps["r=1"], tiny_steps["r=2"]
    assert one.eager == two.eager == 0
    assert one.extern == 5 + 11 + 6 and two.extern - one.extern == 11
    # a block's elementwise work in a few fused kernels
    assert two.fused - one.fused <= 2 * 8
    assert one.total - tiny_steps["r=1 float32"].total <= 1


def test_an_exits_loop_is_the_uniform_loop_plus_its_masks_and_test(tiny_steps):
    """The state exit's loop graph: the same matmuls and attention as a uniform loop (1 + 5 x 2),
    its masked cache writes and its test in a few more fused kernels."""
    uniform = tiny_steps["r=2"] - tiny_steps["r=1"]
    loop = tiny_steps["state loop"]
    assert loop.extern == uniform.extern == 11
    assert uniform.fused < loop.fused <= uniform.fused + 12


def test_s0s_decode_token_within_300_launches_and_its_loop_within_60():
    """S0's shape, batch 1, bf16, greedy: a whole uniform r = 4 token (its one graph and the copy of
    its token), and a loop of the step compiled alone (its inputs from outside the graph: within
    the step a loop fuses a little more; studies.launches counts 48 there)."""
    torch.manual_seed(0)
    s0 = model_lib.GPT(launches.S0).eval()
    with torch.no_grad(), model_lib.autocast("cpu", "bfloat16"):
        token = launches.decode_token(s0, model_lib.uniform_depth(4))
        decoder = Decoder(s0, 1, model_lib.uniform_depth(4), "cpu")
        core = decoder.view("core")
        loop = torch.compile(lambda: decoder.net.core_step(decoder.e, decoder.s, core),
                             fullgraph=True)
        one_loop = count_launches(loop)
    assert token.total <= 300 and token.eager == 1
    assert one_loop.total <= 60 and one_loop.extern == 1 + 5 * launches.S0.n_core
