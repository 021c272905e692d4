"""Tests for engine/: sample.py's decoding laid out for a GPU. Its tokens and loops are sample.py's (and
so the references' of test_sample.py), on the same tiny checkpoint; a decode step waits for the host
only to read its exit flags, and launches a few ops outside its compiled parts."""
import json
import re
from functools import partial

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import model as model_lib
import engine
from engine import cli, decoder, fused
from model import EXIT_TESTS, DepthPolicy, uniform_depth
from test_sample import (GREEDY, MAX_LOOPS, SEP, assert_each_slot_holds_its_last_loop, core_writes_of,
                         generate_all, prompts, run_main, sampler, small_block, tiny, typical_threshold,
                         workdir)

assert tiny and workdir  # the fixtures test_sample.py defines, used here by name


def engine_generate(compiler=None):
    """engine's generate with sample.generate's signature (and a compiler for a decode step's parts)."""
    return partial(decoder.generate, compiler=compiler)


@pytest.mark.parametrize("exit", ["none", "kl", "state"])
def test_the_engine_generates_sample_pys_tokens_and_loops(tiny, exit):
    """Batch 3, block 16, 40 new tokens past block_size, sampled: sample.generate's tokens and loops (which
    test_sample.py holds to the references), with each exit at a threshold where tokens stop at varied loops."""
    model = small_block(tiny[0])
    idx = prompts(3)
    policy = uniform_depth(3)
    if exit != "none":
        policy = DepthPolicy(EXIT_TESTS[exit], typical_threshold(model, EXIT_TESTS[exit]), MAX_LOOPS + 2)
    reference = generate_all(model, idx, 40, sampler(4, 3), uniform_depth(2), policy)
    engine = generate_all(model, idx, 40, sampler(4, 3), uniform_depth(2), policy, engine_generate())
    assert torch.equal(engine[0], reference[0]) and torch.equal(engine[1], reference[1])
    assert exit == "none" or len(set(reference[1].flatten().tolist())) > 2


def test_the_engines_cache_holds_each_tokens_last_loop(tiny):
    """The decoder scores a token from loop 1, where the stop rule does not read the score."""
    writes = core_writes_of(tiny, engine_generate(), first_scored_loop=1)
    assert_each_slot_holds_its_last_loop(tiny[0], *writes)


def test_python_m_engine_prints_what_sample_py_prints(tiny, capsys):
    for args in (["--num_samples=2", "--temperature=1.0", "--seed=5"], ["--exit=kl", "--exit_threshold=0.01"],
                 ["--num_samples=2", "--temperature=0"]):  # greedy: the pick in the step
        new_ids, text, _ = run_main(capsys, *args)
        engine_ids, engine_text, err = run_main(capsys, *args, main=cli.main)
        assert engine_ids == new_ids and engine_text == text and text.count(SEP) >= 1
        assert "tokens/s" in err and "MFLOP per token" in err
        # the baseline: sample.py's own generate, timed in the engine's harness
        baseline_ids, baseline_text, err = run_main(capsys, "--baseline=True", *args, main=cli.main)
        assert baseline_ids == new_ids and baseline_text == text and "tokens/s" in err


def test_the_report_is_json_with_the_speed_loops_and_flops(tiny, capsys, tmp_path):
    report_path = tmp_path / "report.json"
    report = cli.main(["--out_dir=out", "--max_new_tokens=10", "--num_samples=2", f"--report={report_path}"])
    assert json.loads(report_path.read_text()) == json.loads(json.dumps(report))
    assert report["tokens_per_s"] > 0 and report["timed_tokens"] == 2 * (10 - 3) and report["mean_loops"] == 2


# ---- a decode step without host waits -------------------------------------------------------------
aten = torch.ops.aten
HOST_READS = (aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.nonzero.default)


class CountingSyncs(TorchDispatchMode):
    """Counts the ops that make the host wait for a GPU: a value read on the host (item, a nonzero's
    size, a tensor's truth) or a copy to another device. On the CPU nothing waits, but the same ops run."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        devices = {t.device for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)}
        copies_across = func in (aten._to_copy.default, aten.copy_.default) and len(devices) > 1
        if func in HOST_READS or copies_across:
            self.count += 1
        return out


def test_the_sync_counter_sees_what_the_old_engine_did():
    """The old engine's nonzero() and .item() each loop, and a copy to another device: each counted; a
    copy on the same device is not."""
    looping = torch.tensor([True, False, True])
    with CountingSyncs() as syncs:
        rows = looping.nonzero()[:, 0]
        looping[rows].any().item()
        looping.to("meta")  # (a copy to a GPU reads the same)
        looping.clone()
    assert syncs.count == 3


@pytest.mark.parametrize("exit", ["none", "kl", "state"])
def test_a_decode_step_reads_nothing_on_the_host_but_its_exit_flags(tiny, exit):
    """Uniform depth: no host read in generate at all. With an exit: one read of "no row is looping"
    after each loop from MIN_EXIT_LOOP, until one finds every row stopped (the deepest token's loops - 1).
    (sample.generate reads after every loop with an exit, and never at uniform depth.)"""
    model = small_block(tiny[0])
    idx = prompts(3)
    policy = uniform_depth(3)
    if exit != "none":
        policy = DepthPolicy(EXIT_TESTS[exit], typical_threshold(model, EXIT_TESTS[exit]), MAX_LOOPS + 2)
    with CountingSyncs() as syncs:
        _, depths = generate_all(model, idx, 30, sampler(5, 3), uniform_depth(2), policy, engine_generate())
    deepest = depths[:, 1:].amax(0)  # (steps,): each decode step's deepest token
    expected = 0 if exit == "none" else (deepest - 1).sum().item()
    assert syncs.count == expected and (exit == "none" or len(set(deepest.tolist())) > 1)


class CountingOps(TorchDispatchMode):
    """Counts the aten ops dispatched outside the decode steps given to generate's compiler, which stand for
    compiled code (on a GPU, CUDA graphs): what is left is what the host launches op by op."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.in_compiled_code = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not self.in_compiled_code
        return func(*args, **(kwargs or {}))

    def compiler(self, step):
        def compiled(*args):
            self.in_compiled_code = True
            try:
                return step(*args)
            finally:
                self.in_compiled_code = False
        return compiled


@pytest.mark.parametrize("exit", ["none", "kl", "state"])
def test_a_new_token_launches_at_most_30_ops_outside_compiled_code_at_s0s_shape(exit):
    """The paper's S0 (vocabulary 49,152, width 384, 2/4/2 blocks), batch 2, 4 loops a token (an exit: at most 4,
    and since it never fires, a flag read after loops 2, 3 and 4): per new token, counted as the difference
    between 20 and 10 new tokens. The engine before this one launched ~336."""
    torch.manual_seed(0)
    model = model_lib.GPT(model_lib.GPTConfig()).eval()
    idx = torch.randint(0, 49152, (2, 8))
    policy = uniform_depth(4)
    if exit != "none":
        policy = DepthPolicy(EXIT_TESTS[exit], 0.0, 4)  # a test that never fires: every token runs r_max
    per_run = []
    for n_new in (10, 20):
        counting = CountingOps()
        with counting:
            generate_all(model, idx, n_new, GREEDY, uniform_depth(4), policy, engine_generate(counting.compiler))
        per_run.append(counting.count)
    per_token = (per_run[1] - per_run[0]) / 10
    assert per_token <= 30, per_token


@pytest.mark.parametrize("exit", ["none", "kl"])
def test_main_never_waits_for_a_token(tiny, capsys, exit):
    """The new tokens stay on the device, read once at the end: no wait a step but an exit's flag reads."""
    for n_samples in (1, 3):
        counts = []
        for n_new in (10, 30):
            with CountingSyncs() as syncs:
                run_main(capsys, f"--num_samples={n_samples}", f"--max_new_tokens={n_new}", f"--exit={exit}",
                         "--exit_threshold=0", "--r_max=2", main=cli.main)  # the exit runs 2 loops: one read
            counts.append(syncs.count)
        exit_reads = 0 if exit == "none" else 1
        assert (counts[1] - counts[0]) == 20 * exit_reads


def counting_calls(calls):
    """A compiler for generate that compiles nothing and records the name of each step run (begin, loop, end)."""
    def compiler(step):
        def counted(*args):
            calls.append(step.__name__)
            return step(*args)
        return counted
    return compiler


def test_a_gpu_reads_each_flag_one_loop_late_and_the_extra_loop_changes_nothing(tiny, monkeypatch):
    """LOOPS_AHEAD as on CUDA, run on the CPU: every step runs one loop past its deepest token (fully masked),
    except at r_max, and every token and depth is what reading at once gives."""
    model = small_block(tiny[0])
    idx = prompts(3)
    test = EXIT_TESTS["kl"]
    policy = DepthPolicy(test, typical_threshold(model, test), MAX_LOOPS + 2)
    at_once = generate_all(model, idx, 30, sampler(2, 3), uniform_depth(2), policy, engine_generate())
    monkeypatch.setitem(decoder.LOOPS_AHEAD, "cpu", 1)
    calls = []
    late = generate_all(model, idx, 30, sampler(2, 3), uniform_depth(2), policy,
                        engine_generate(counting_calls(calls)))
    assert torch.equal(late[0], at_once[0]) and torch.equal(late[1], at_once[1])
    deepest = at_once[1][:, 1:].amax(0)  # each step's deepest token: its flag is read one loop later
    assert calls.count("loop") == (deepest + (deepest < MAX_LOOPS + 2)).sum() and (deepest < MAX_LOOPS + 2).any()
    assert calls.count("begin") == calls.count("end") == 29


def test_the_compiled_decode_steps_equal_eager_without_graph_breaks_or_recompiles(tiny, fresh_compiler):
    """Each of a decode step's three parts under torch.compile(fullgraph=True) (inductor on the CPU), 100 new
    tokens with a KL exit, batch 2, past block_size: three graphs, never recompiled, the same tokens and
    loops as eager."""
    model = small_block(tiny[0])
    idx = prompts(2)
    test = EXIT_TESTS["kl"]
    policy = DepthPolicy(test, typical_threshold(model, test), MAX_LOOPS)
    eager = generate_all(model, idx, 100, GREEDY, uniform_depth(2), policy, engine_generate())
    with torch._dynamo.config.patch(error_on_recompile=True):  # never monkeypatch: its undo hides the entry
        compiled = generate_all(model, idx, 100, GREEDY, uniform_depth(2), policy,
                                engine_generate(partial(torch.compile, fullgraph=True)))
    counters = fresh_compiler
    assert counters["stats"]["unique_graphs"] == 3 and not counters["graph_break"]
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
    assert len(set(eager[1].flatten().tolist())) > 2  # the exit really stopped tokens at varied loops


def test_a_uniform_step_compiled_with_its_pick_is_one_graph_equal_to_eager(tiny, fresh_compiler):
    """Uniform depth, the greedy pick in the step: one graph under torch.compile(fullgraph=True) (inductor on
    the CPU), 40 new tokens past block_size, batch 2, never recompiled, sample.generate's tokens and loops."""
    model = small_block(tiny[0])
    idx = prompts(2)
    reference = generate_all(model, idx, 40, GREEDY, uniform_depth(2), uniform_depth(3))
    compiler = partial(torch.compile, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = generate_all(model, idx, 40, GREEDY, uniform_depth(2), uniform_depth(3),
                                partial(decoder.generate, compiler=compiler, pick_in_step=True))
    assert fresh_compiler["stats"]["unique_graphs"] == 1 and not fresh_compiler["graph_break"]
    assert torch.equal(compiled[0], reference[0]) and torch.equal(compiled[1], reference[1])


@pytest.mark.parametrize("exit", ["none", "kl"])
def test_a_pick_in_the_step_picks_sample_pys_tokens(tiny, exit):
    """pick_in_step: the step picks each next token where the next step reads it; the same tokens and loops."""
    model = small_block(tiny[0])
    idx = prompts(3)
    policy = uniform_depth(3)
    if exit != "none":
        policy = DepthPolicy(EXIT_TESTS[exit], typical_threshold(model, EXIT_TESTS[exit]), MAX_LOOPS + 2)
    reference = generate_all(model, idx, 40, GREEDY, uniform_depth(2), policy)
    engine = generate_all(model, idx, 40, GREEDY, uniform_depth(2), policy,
                          partial(decoder.generate, pick_in_step=True))
    assert torch.equal(engine[0], reference[0]) and torch.equal(engine[1], reference[1])


def test_the_decode_copy_stores_fused_matrices_in_the_matmul_dtype_and_leaves_the_model(tiny):
    """Under bf16 autocast: q/k/v and gate/up stacked, every matrix bf16, the embedding and the norms as
    loaded, the tied head a bf16 copy; the model itself (the checkpoint's) unchanged."""
    model = tiny[0]
    before = {name: p.clone() for name, p in model.state_dict().items()}
    net = fused.for_decoding(model, torch.bfloat16)
    attention, mlp = net.core.blocks[0].attn, net.core.blocks[0].mlp
    c = model.config
    head_dim = c.n_embd // c.n_head
    assert attention.wqkv.shape == ((c.n_head + 2 * c.n_kv_head) * head_dim, c.n_embd)
    assert mlp.w_gate_up.shape == (2 * c.ffn_hidden, c.n_embd)
    assert torch.equal(attention.wqkv[:c.n_embd], model.core.blocks[0].attn.wq.weight.bfloat16())
    matrices = [p for name, p in net.named_parameters() if p.dim() == 2 and name != "wte.weight"]
    assert matrices and all(p.dtype == torch.bfloat16 for p in matrices)
    assert net.wte.weight.dtype == net.norm.weight.dtype == torch.float32
    assert net.lm_head.weight is not net.wte.weight and model.lm_head.weight is model.wte.weight
    assert all(torch.equal(before[name], p) for name, p in model.state_dict().items())


def test_device_loops_put_each_loop_after_the_first_in_an_if_node_on_the_looping_flag():
    """capture_token's loops, recorded on a stand-in for a CUDA graph: loop 1, then each later loop alone
    inside an if node on looping_any; no conditional nodes without CUDA."""
    events = []

    class Graph:
        def begin_capture_to_if_node(self, flag):
            assert flag is steps.looping_any
            events.append("if")

        def end_capture_to_conditional_node(self):
            events.append("end")

    class Steps:
        looping_any = torch.ones((), dtype=torch.bool)

        def loop(self):
            events.append("loop")
    steps = Steps()
    decoder.capture_loops(Graph(), steps, 4)
    assert events == ["loop"] + ["if", "loop", "end"] * 3
    assert not decoder.conditional_nodes_available("cpu")


def test_main_compiled_says_how_many_graphs_ran_and_that_none_broke_recompiled_or_skipped(tiny, capsys, monkeypatch,
                                                                                           fresh_compiler):
    """--compile's line: what torch.compile did in this run (aot_eager stands in for inductor: the same graphs,
    without its compile time; on a GPU the CUDA-graph skips count too)."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", partial(real_compile, backend="aot_eager"))
    args = ("--exit=kl", "--exit_threshold=0.01", "--num_samples=2", "--max_new_tokens=80")  # past block_size 64
    eager = run_main(capsys, *args, main=cli.main)
    compiled = run_main(capsys, "--compile=True", *args, main=cli.main)
    assert compiled[0] == eager[0]
    assert "compiled: 3 graphs, 0 graph breaks, 0 recompilations, 0 CUDA-graph skips" in compiled[2]


def test_tokens_per_second_count_the_decode_steps_after_a_warm_up(tiny, capsys, monkeypatch):
    """Timed from the end of the second decode step (the warm-up: compiling, then recording CUDA graphs) to the
    end: the prefill's token and the warm-up's are not counted. Beside the mean loops, each step's deepest."""
    readings = iter([0.0, 10.0, 14.0])  # before the prefill, after the warm-up steps, at the end
    monkeypatch.setattr(cli, "clock", lambda device: next(readings))
    _, _, err = run_main(capsys, "--num_samples=2", "--exit=kl", "--exit_threshold=0.01", main=cli.main)
    assert "13.5 tokens/s (54 timed)" in err  # 2 x (30 - 3) tokens in 4 s
    mean, deepest = map(float, re.search(r"([\d.]+) loops \(a step's deepest ([\d.]+)\)", err).groups())
    assert 1 <= mean < deepest <= MAX_LOOPS


def test_the_clock_waits_for_a_gpu_and_not_for_the_cpu(monkeypatch):
    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", synchronized.append)
    engine.clock("cpu")
    engine.clock("cuda:1")
    assert synchronized == ["cuda:1"]


needs_cuda = pytest.mark.cuda  # skipped without a GPU; with one, the scripts keep their CUDA defaults (conftest.py)


@needs_cuda
def test_on_cuda_a_decode_step_at_uniform_depth_never_syncs(tiny):
    model = tiny[0].cuda()
    idx = tiny[1].cuda()
    torch.cuda.set_sync_debug_mode("error")  # a synchronizing CUDA call raises
    try:
        steps = list(decoder.generate(model, idx, 20, GREEDY, 2, uniform_depth(3)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(steps) == 20


@needs_cuda
@pytest.mark.parametrize("exit", ["none", "kl", "state"])
def test_on_cuda_the_decode_steps_run_in_cuda_graphs_and_equal_eager(tiny, fresh_compiler, exit):
    """CUDA graphs (mode reduce-overhead), 100 new tokens past block_size, in float64 so that no rounding can
    flip a token or an exit: the same tokens as eager, one graph at uniform depth (the whole step) and three
    with an exit (begin, loop, end), no recompilation, no CUDA-graph skip, and each graph recorded once (a
    compiled step's output kept alive would record a new one every token)."""
    from studies.gpu_check import cuda_graphs_recorded
    model = small_block(tiny[0]).cuda()
    idx = prompts(2).cuda()
    policy = uniform_depth(3)
    if exit != "none":
        test = EXIT_TESTS[exit]
        policy = DepthPolicy(test, typical_threshold(model.cpu(), test), MAX_LOOPS)
        model.cuda()
    eager = generate_all(model, idx, 100, GREEDY, uniform_depth(2), policy, engine_generate())
    compiler = partial(torch.compile, mode="reduce-overhead", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = generate_all(model, idx, 100, GREEDY, uniform_depth(2), policy, engine_generate(compiler))
    counters = fresh_compiler  # cleared before the test, as the engine's compiled line reads them
    graphs = 1 if exit == "none" else 3
    assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]
    assert not torch._dynamo.utils.guard_failures  # no guard failed: nothing compiled again
    assert counters["inductor"]["cudagraph_skips"] == 0  # every graph runs as a CUDA graph
    assert cuda_graphs_recorded() == graphs  # each replayed at every token
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])


@needs_cuda
@pytest.mark.parametrize("exit", ["kl", "state"])
def test_on_cuda_device_loops_equal_eager_and_read_no_flag_after_the_first_token(tiny, fresh_compiler, exit):
    """With conditional nodes (CUDA 12.4 on): from the second new token each token is one CUDA graph whose
    loops run while the GPU finds a row looping. 100 new tokens past block_size in float64, compiled without
    torch's CUDA graphs: the same tokens and loops as eager; the host reads flags for the first token only."""
    if not decoder.conditional_nodes_available("cuda"):
        pytest.skip("no conditional nodes in this torch's CUDA graphs")
    model = small_block(tiny[0]).cuda()
    idx = prompts(2).cuda()
    test = EXIT_TESTS[exit]
    policy = DepthPolicy(test, typical_threshold(model.cpu(), test), MAX_LOOPS)
    model.cuda()
    eager = generate_all(model, idx, 100, GREEDY, uniform_depth(2), policy, engine_generate())
    looped = partial(decoder.generate, compiler=partial(torch.compile, fullgraph=True), device_loops=True)
    with CountingSyncs() as syncs:
        on_device = generate_all(model, idx, 100, GREEDY, uniform_depth(2), policy, looped)
    assert torch.equal(on_device[0], eager[0]) and torch.equal(on_device[1], eager[1])
    assert len(set(eager[1].flatten().tolist())) > 2  # the exit stopped tokens at varied loops
    # the first decoded token's flags alone, each a copy to the host and a read
    assert syncs.count <= 2 * MAX_LOOPS
