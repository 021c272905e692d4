"""sample.py's decoding, laid out for a GPU: the same tokens and loops as sample.generate.

sample.generate is written to be read: a new token's loops are plain tensors, and with an exit the
host asks after every loop whether a row still loops (a wait for the GPU each loop). Here a batch's
KV caches and its new tokens' state sit at fixed addresses, and the model's matrices are stored
as the matmuls read them (engine/fused.py). At uniform depth a new token is one step (its prelude,
r loops with no mask, its next logits and, greedy, its pick), one CUDA graph under
torch.compile(mode="reduce-overhead"). With an exit it takes three steps, begin, loop (one masked
loop of every row) and end, each its own graph; the host reads "a row is looping" a loop late
(LOOPS_AHEAD), so that the GPU never waits for it, or, where CUDA graphs have conditional nodes,
never: the whole token is one CUDA graph whose loops run while the GPU finds a row looping.
"""
import sys

import torch

from engine.fused import DecodeView, for_decoding
from model import MIN_EXIT_LOOP, DepthPolicy, autocast_input, keeps_looping
from sample import prefill


class Decoder:
    """A batch's KV caches and its new tokens' state at fixed addresses, and the steps each new
    token takes. No step returns a tensor: a CUDA graph's output lives until its next replay, and
    one kept alive across calls makes torch record the next call as a new graph."""

    def __init__(self, model, batch, depth, device, compiler=None, pick=None):
        """pick None: the caller picks each next token from `carried`; else pick(logits (B, V))
        -> (B,), traceable (greedy), runs at the end of each step, into `token`."""
        c = model.config
        self.model = model
        # the dtype the matmuls compute in: autocast's, else the weights'
        matmul_dtype = autocast_input(model.wte.weight[:1]).dtype
        self.net = for_decoding(model, matmul_dtype)
        self.pick = pick
        # the loops the uniform step unrolls
        self.uniform_loops = depth.r_max
        # The depth policy with its numbers as tensors, so that a graph compiled for one threshold
        # or r_max serves every other. They are filled on the device: no wait for a copy.
        threshold = torch.full((), depth.threshold, device=device)
        r_max = torch.full((), depth.r_max, device=device)
        self.depth = DepthPolicy(depth.test, threshold, r_max)
        self.caches = model.new_caches(batch)
        # the weights' dtype, or autocast's: the state's (float32 under bf16 autocast)
        state_dtype = model.wte.weight.dtype
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.positions = torch.arange(c.block_size, device=device)
        # the cache positions a new token sees (those up to pos), (1, block_size)
        self.visible = torch.zeros(1, c.block_size, dtype=torch.bool, device=device)
        self.token = torch.zeros(batch, dtype=torch.long, device=device)
        self.e = torch.zeros(batch, 1, c.n_embd, device=device, dtype=state_dtype)
        self.s = torch.zeros(batch, 1, c.n_embd, device=device, dtype=state_dtype)
        # Each row's last readout, in float32 or finer (the KL exit's softmaxes; float64 in the
        # tests' references).
        carried_dtype = torch.promote_types(state_dtype, torch.float32)
        self.carried = torch.zeros(batch, 1, c.vocab_size, device=device, dtype=carried_dtype)
        self.looping = torch.zeros(batch, dtype=torch.bool, device=device)
        # at uniform depth every row runs r_max loops: never written
        self.loops_ran = torch.full((batch,), depth.r_max, dtype=torch.long, device=device)
        # whether a row is still looping: a 0-dim bool on the device
        self.looping_any = torch.zeros((), dtype=torch.bool, device=device)
        cache_tensors = [t for cache in self.caches.values() for t in cache.k + cache.v]
        buffers = [self.pos, self.visible, self.token, self.e, self.s, self.carried,
                   self.looping, self.loops_ran, self.looping_any]
        # a CUDA graph writes them in place
        for buffer in cache_tensors + buffers:
            torch._dynamo.mark_static_address(buffer, guard=False)
        # each step its own compiled graph
        if compiler is not None and depth.test is None:
            self.step = compiler(self.step)
        elif compiler is not None:
            self.begin = compiler(self.begin)
            self.loop = compiler(self.loop)
            self.end = compiler(self.end)

    def view(self, part, active=None):
        """Where the new tokens' K/V go in the caches of `part` (prelude, core, coda)."""
        return DecodeView(self.caches[part], self.pos, self.visible, active)

    def step(self):
        """A new token at uniform depth, whole: begin, r_max loops of every row (no row stops:
        no mask on the cache writes), end."""
        self.begin()
        view = self.view("core")
        s = self.s
        for _ in range(self.uniform_loops):
            s = self.net.core_step(self.e, s, view)
        self.s.copy_(s)
        self.end()

    def begin(self):
        """Every row's new token (`token`, B) at pos: its prelude into e; its loops start afresh
        from the zero state."""
        self.visible.copy_(self.positions <= self.pos[:, None])
        self.e.copy_(self.net.prelude(self.token[:, None], self.view("prelude")))
        self.s.copy_(self.net.init_state(self.e, "zero"))
        if self.depth.test is not None:
            self.looping.fill_(True)
            self.loops_ran.zero_()

    def loop(self):
        """One more loop of every row's new token: every row runs, and one that has stopped keeps
        its s, carried logits, loop count and cache slots. Then `looping_any` says whether a row
        loops on (read by the host, or by a CUDA graph's conditional node)."""
        net, test = self.net, self.depth.test
        # the rows this loop runs: their cache slots take its K/V
        active = self.looping.clone()
        s_new = net.core_step(self.e, self.s, self.view("core", active))
        self.loops_ran.add_(active)
        logits_new = None
        if test.needs_logits:
            logits_new = net.readout(s_new, self.view("coda", active)).to(self.carried.dtype)
        # before MIN_EXIT_LOOP the score (against the last token's carried logits at loop 1) is
        # not read
        score = test.score(s_new, self.s, logits_new, self.carried)[:, 0]
        go_on = keeps_looping(self.loops_ran, score, self.depth)
        ran = active[:, None, None]
        self.s.copy_(torch.where(ran, s_new, self.s))
        if logits_new is not None:
            self.carried.copy_(torch.where(ran, logits_new, self.carried))
        self.looping.copy_(active & go_on)
        self.looping_any.copy_(self.looping.any())

    def end(self):
        """Every row's next logits in carried (B, 1, V), valid until the next step: the KL exit
        carried each row's last readout, else one readout of every row's final state. The next
        token goes to the next position; with a pick, it is picked into `token`."""
        if self.depth.test is None or not self.depth.test.needs_logits:
            self.carried.copy_(self.net.readout(self.s, self.view("coda")))
        self.pos.add_(1)
        if self.pick is not None:
            self.token.copy_(self.pick(self.carried[:, 0]))


# With an exit, a GPU runs behind the host: reading loop i-1's "a row is looping" once loop i is
# queued, the host never keeps it waiting (at most one extra loop runs, every row masked: it
# changes nothing). A CPU runs ops as they come: no lag.
LOOPS_AHEAD = {"cpu": 0, "cuda": 1}


class HostFlag:
    """A device bool copied to the host without waiting; read() waits only for the work queued
    before it."""

    def __init__(self, flag):
        # into pinned memory from a GPU
        self.value = flag.to("cpu", non_blocking=True, copy=True)
        self.copied = None
        if flag.is_cuda:
            self.copied = torch.cuda.current_stream(flag.device).record_event()

    def read(self):
        # on a GPU this waits for the copy alone, never for the loops queued after it
        if self.copied is not None:
            self.copied.synchronize()
        return self.value.item()


def loop_with_host_flags(decoder, r_max, ahead):
    """A new token's loops under an exit, until no row loops (at r_max at the latest): the host
    reads "a row is looping" after each loop from MIN_EXIT_LOOP, `ahead` loops later."""
    flags = []
    for loop in range(1, r_max + 1):
        decoder.loop()
        if loop >= MIN_EXIT_LOOP:
            flags.append(HostFlag(decoder.looping_any))
        if len(flags) > ahead and not flags[-1 - ahead].read():
            return


def conditional_nodes_available(device):
    """Whether a CUDA graph on `device` can hold conditional nodes in this torch: CUDA 12.4 on
    (torch.cuda.CUDAGraph.begin_capture_to_if_node; a driver too old fails at capture)."""
    if not str(device).startswith("cuda") or torch.version.cuda is None:
        return False
    version = tuple(int(part) for part in torch.version.cuda.split(".")[:2])
    return version >= (12, 4) and hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node")


def capture_loops(graph, decoder, r_max):
    """Captures a token's loops into graph: loop 1, then each later loop inside an if node on
    decoder.looping_any, so that it runs only while a row loops on, decided on the GPU. (torch
    2.13 has if nodes, no while node; once no row loops, each node left costs a one-thread kernel
    setting its condition, not a loop.)"""
    decoder.loop()
    for _ in range(2, r_max + 1):
        graph.begin_capture_to_if_node(decoder.looping_any)
        try:
            decoder.loop()
        finally:
            graph.end_capture_to_conditional_node()


def capture_token(decoder, r_max):
    """-> a CUDA graph of a whole new token under an exit (begin, its loops, end), replayed each
    token with no host read a loop, or None where this GPU refuses conditional nodes. Each part
    has run once before (compiled, its kernels tuned): a capture runs nothing."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            decoder.begin()
            capture_loops(graph, decoder, r_max)
            decoder.end()
    except RuntimeError as err:
        print(f"engine: no conditional nodes in CUDA graphs here ({err}); the host reads a "
              f"flag each loop", file=sys.stderr)
        return None
    return graph


@torch.no_grad()
def generate(model, prompts, max_new_tokens, pick, prompt_loops, depth, compiler=None,
             pick_in_step=False, device_loops=False):
    """sample.generate's tokens and loops, (B,) each step, from a Decoder. pick(logits (B, V))
    -> (B,) must keep no logits: the next step overwrites them. compiler wraps each decode step
    (torch.compile: on a GPU, CUDA graphs); pick_in_step: pick is traceable (greedy), run at the
    end of each step, in its graph. device_loops, with an exit on a GPU with conditional nodes
    (conditional_nodes_available): from the second new token on, each token is one CUDA graph
    captured here (so compiler must make no CUDA graphs of its own)."""
    B, T0 = prompts.shape
    block = model.config.block_size
    decoder = Decoder(model, B, depth, prompts.device, compiler, pick if pick_in_step else None)
    ahead = LOOPS_AHEAD[prompts.device.type]
    token_graph = None
    # 1) prefill: the prompt's last block_size tokens, at positions 0..
    logits = prefill(model, decoder.caches, prompts[:, -block:], prompt_loops)
    loops = torch.full((B,), prompt_loops, device=prompts.device)
    n_cached = min(T0, block)
    decoder.pos.fill_(n_cached)
    # the tokens so far, joined only when a refill reads them
    recent = [prompts]
    next_token = pick(logits)
    for step in range(max_new_tokens):
        # 2) every sequence's next token, picked from its last readout
        yield next_token, loops
        if step == max_new_tokens - 1:
            return
        recent.append(next_token[:, None])
        # 3) the context is full: keep its last half before the new token, prefilled again
        if n_cached == block:
            n_cached = block // 2
            window = torch.cat(recent, dim=1)[:, -1 - n_cached:]
            recent = [window]
            prefill(model, decoder.caches, window[:, :-1], prompt_loops)
            decoder.pos.fill_(n_cached)
        # a pick in the step left the token where the next step reads it
        if step == 0 or not pick_in_step:
            decoder.token.copy_(next_token)
        # 4) the new token at the next position: at uniform depth one step; with an exit, looped
        # until no row loops (at r_max at the latest)
        if depth.test is None:
            decoder.step()
            # never written at uniform depth: no copy
            loops = decoder.loops_ran
        else:
            if device_loops and step > 0 and token_graph is None:
                token_graph = capture_token(decoder, depth.r_max)
                device_loops = token_graph is not None
            # a capture runs nothing: its first replay runs this token
            if token_graph is not None:
                token_graph.replay()
            else:
                decoder.begin()
                loop_with_host_flags(decoder, depth.r_max, ahead)
                decoder.end()
            loops = decoder.loops_ran.clone()
        if pick_in_step:
            next_token = decoder.token.clone()
        else:
            next_token = pick(decoder.carried[:, 0])
        n_cached += 1
