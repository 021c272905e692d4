"""sample.py's decoding, laid out for a GPU: the same tokens and loops as sample.generate.

sample.generate is written to be read: a new token's loops are plain tensors, and with an exit the
host asks after every loop whether a row still loops (a wait for the GPU each loop). Here a batch's
KV caches and its new tokens' state sit at fixed addresses, and each new token takes three steps,
begin (its prelude), loop (one masked loop of every row) and end (its next logits). Each step
writes only these buffers, never waits for the host and has the same shapes at every token, so
that under torch.compile(mode="reduce-overhead") each is one CUDA graph. With an exit, the host
reads "no row is looping" a loop late (LOOPS_AHEAD), so the GPU never waits for it.
"""
import torch

from model import MIN_EXIT_LOOP, CacheView, DepthPolicy, keeps_looping
from sample import prefill


class Decoder:
    """A batch's KV caches and its new tokens' state at fixed addresses, and the three steps each
    new token takes. No step returns a tensor: a CUDA graph's output lives until its next replay,
    and one kept alive across calls makes torch record the next call as a new graph."""

    def __init__(self, model, batch, depth, device, compiler=None):
        c = model.config
        self.model = model
        # The depth policy with its numbers as tensors, so that a graph compiled for one threshold
        # or r_max serves every other. They are filled on the device: no wait for a copy.
        threshold = torch.full((), depth.threshold, device=device)
        r_max = torch.full((), depth.r_max, device=device)
        self.depth = DepthPolicy(depth.test, threshold, r_max)
        self.caches = model.new_caches(batch)
        # the weights' dtype, or autocast's: the state's (float32 under bf16 autocast)
        state_dtype = model.wte.weight.dtype
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.e = torch.zeros(batch, 1, c.n_embd, device=device, dtype=state_dtype)
        self.s = torch.zeros(batch, 1, c.n_embd, device=device, dtype=state_dtype)
        # Each row's last readout, in float32 or finer (the KL exit's softmaxes; float64 in the
        # tests' references).
        carried_dtype = torch.promote_types(state_dtype, torch.float32)
        self.carried = torch.zeros(batch, 1, c.vocab_size, device=device, dtype=carried_dtype)
        self.looping = torch.zeros(batch, dtype=torch.bool, device=device)
        self.loops_ran = torch.zeros(batch, dtype=torch.long, device=device)
        # whether no row is looping: a 0-dim bool on the device
        self.stopped = torch.zeros((), dtype=torch.bool, device=device)
        cache_tensors = [t for cache in self.caches.values() for t in cache.k + cache.v]
        buffers = [self.pos, self.e, self.s, self.carried, self.looping, self.loops_ran,
                   self.stopped]
        # a CUDA graph writes them in place
        for buffer in cache_tensors + buffers:
            torch._dynamo.mark_static_address(buffer, guard=False)
        # each step its own compiled graph
        if compiler is not None:
            self.begin = compiler(self.begin)
            self.loop = compiler(self.loop)
            self.end = compiler(self.end)

    def begin(self, token):
        """Every row's new token (B,) at pos: its prelude into e; its loops start afresh from the
        zero state."""
        view = CacheView(self.caches["prelude"], self.pos)
        self.e.copy_(self.model.prelude(token[:, None], view))
        self.s.copy_(self.model.init_state(self.e, "zero"))
        self.looping.fill_(True)
        self.loops_ran.zero_()

    def loop(self):
        """One more loop of every row's new token: every row runs, and one that has stopped keeps
        its s, carried logits, loop count and cache slots. Then `stopped` says whether no row is
        looping (reading it is the caller's one host wait)."""
        model, test = self.model, self.depth.test
        # the rows this loop runs: their cache slots take its K/V
        active = self.looping.clone()
        s_new = model.core_step(self.e, self.s, CacheView(self.caches["core"], self.pos, active))
        self.loops_ran.add_(active)
        logits_new = None
        if test is not None and test.needs_logits:
            view = CacheView(self.caches["coda"], self.pos, active)
            logits_new = model.readout(s_new, view).to(self.carried.dtype)
        # uniform depth: the stop rule reads the loop count alone; before MIN_EXIT_LOOP the score
        # (against the last token's carried logits at loop 1) is not read
        score = None
        if test is not None:
            score = test.score(s_new, self.s, logits_new, self.carried)[:, 0]
        go_on = keeps_looping(self.loops_ran, score, self.depth)
        ran = active[:, None, None]
        self.s.copy_(torch.where(ran, s_new, self.s))
        if logits_new is not None:
            self.carried.copy_(torch.where(ran, logits_new, self.carried))
        self.looping.copy_(active & go_on)
        self.stopped.copy_(~self.looping.any())

    def end(self):
        """Every row's next logits in carried (B, 1, V), valid until the next step: the KL exit
        carried each row's last readout, else one readout of every row's final state. The next
        token goes to the next position."""
        if self.depth.test is None or not self.depth.test.needs_logits:
            view = CacheView(self.caches["coda"], self.pos)
            self.carried.copy_(self.model.readout(self.s, view))
        self.pos.add_(1)


# With an exit, a GPU runs behind the host: reading loop i-1's "no row is looping" once loop i is
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


@torch.no_grad()
def generate(model, prompts, max_new_tokens, pick, prompt_loops, depth, compiler=None):
    """sample.generate's tokens and loops, (B,) each step, from a Decoder. pick(logits (B, V))
    -> (B,) must keep no logits: the next step overwrites them. compiler wraps each of a decode
    step's three parts (torch.compile: on a GPU, CUDA graphs)."""
    B, T0 = prompts.shape
    block = model.config.block_size
    decoder = Decoder(model, B, depth, prompts.device, compiler)
    ahead = LOOPS_AHEAD[prompts.device.type]
    # 1) prefill: the prompt's last block_size tokens, at positions 0..
    logits = prefill(model, decoder.caches, prompts[:, -block:], prompt_loops)
    loops = torch.full((B,), prompt_loops, device=prompts.device)
    n_cached = min(T0, block)
    decoder.pos.fill_(n_cached)
    tokens = prompts
    for step in range(max_new_tokens):
        # 2) every sequence picks its next token from its last readout
        next_token = pick(logits)
        yield next_token, loops
        if step == max_new_tokens - 1:
            return
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        # 3) the context is full: keep its last half before the new token, prefilled again
        if n_cached == block:
            n_cached = block // 2
            prefill(model, decoder.caches, tokens[:, -1 - n_cached:-1], prompt_loops)
            decoder.pos.fill_(n_cached)
        # 4) the new token at the next position, looped until every row has stopped (at r_max at
        # the latest); "no row is looping" after each loop from MIN_EXIT_LOOP, read `ahead` loops
        # later
        decoder.begin(next_token)
        flags = []
        for loop in range(1, depth.r_max + 1):
            decoder.loop()
            if depth.test is not None and loop >= MIN_EXIT_LOOP:
                flags.append(HostFlag(decoder.stopped))
            if len(flags) > ahead and flags[-1 - ahead].read():
                break
        decoder.end()
        logits = decoder.carried[:, 0]
        loops = decoder.loops_ran.clone()
        n_cached += 1
