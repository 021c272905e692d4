"""Training throughput of the recurrent model against its dense twin, as nanoGPT's bench.py times
a training step: train.py's settings and train_step on random tokens, each model's median over rounds
that alternate the two. Prints tokens/s, FLOP/s and MFU (on CUDA, as train.py); writes bench.json.

The dense twin is the same blocks unrolled once: n_core * mean_loops core blocks in a single loop
from a zero initial state, with the same prelude, coda and width. Its forward FLOPs per token differ
from the recurrent model's at mean_loops only by the extra adapters (a Linear(2d -> d) a loop).
The recurrent model trains at the depths train.py would draw for its first bench_steps steps, so
its FLOPs per token vary from step to step; the ratio of FLOP/s says how well each one's work
fills the device, and 0 recompiles while timing says that a new depth costs no new graph.

    python bench.py                                      # the CPU default's shape
    python bench.py config/s1.py --vocab_size=49152 --compile=True
"""
import statistics
import time

import torch
import torch._dynamo.utils

import train
from configurator import configure, run
from model import GPT, GPTConfig, save_atomic

bench_steps = 4  # timed training steps per model per round
rounds = 3  # timed rounds; each model keeps its median
vocab_size = 1024  # of the random tokens (S0/S1: 49152)
RULES = dict.fromkeys(["bench_steps", "rounds", "vocab_size"], (1, 2**20))


def dense_twin(config):
    """The GPTConfig of a recurrent model's blocks unrolled once (see the docstring above)."""
    # one loop from s_0 = 0: from noise the one pass would see a noisy input, which no dense stack does
    unrolled = dict(n_core=config.n_core * config.mean_loops, mean_loops=1, max_loops=1, bptt_k=1, state_std=0.0)
    return GPTConfig(**vars(config) | unrolled)


def main(argv=()):
    """-> bench.json's contents: each model's figures, the depths timed, the recompiles while timing."""
    C, _ = configure([vars(train), globals()], argv)
    train.check_settings(C)
    recurrent = GPTConfig(vocab_size=C.vocab_size, **{key: getattr(C, key) for key in train.MODEL_KEYS})
    # the same settings for both, the same random batches, the recurrent model at train.py's depths
    models = {"recurrent": GPT(recurrent), "dense": GPT(dense_twin(recurrent))}
    depths = [train.sample_loops(i, C.seed, C.mean_loops, C.max_loops, C.loop_dist, C.loop_spread)
              for i in range(C.bench_steps)]
    loops = {"recurrent": depths, "dense": [1] * C.bench_steps}
    tokens = torch.randint(C.vocab_size, (C.bench_steps, 2, C.batch_size, C.block_size))  # (x, y) of each step
    batches = [[(x, y)] for x, y in tokens.to(C.device)]  # a step is one micro-batch
    optimizers = {}
    for name, model in models.items():
        optimizers[name] = train.prepare_model(model, C, C.device)  # compiled as train.py compiles it
        # an untimed step at the deepest depth: every graph is compiled before the timing
        train.train_step(model, optimizers[name], batches[0], max(loops[name]), C)
    # rounds alternate the models, so that the machine's drifts in speed fall on both
    sync = torch.cuda.synchronize if "cuda" in C.device else (lambda: None)
    seconds = {name: [] for name in models}
    frames = torch._dynamo.utils.counters["frames"]["total"]
    for _ in range(C.rounds):
        for name, model in models.items():
            sync()  # a timing waits for the work queued before it
            t0 = time.perf_counter()
            for batch, r in zip(batches, loops[name]):
                train.train_step(model, optimizers[name], batch, r, C)
            sync()
            seconds[name].append(time.perf_counter() - t0)
    recompiles = torch._dynamo.utils.counters["frames"]["total"] - frames
    # FLOP/s counts what each step computed: a no-grad loop once, a loop with gradients three times
    peak = C.peak_flops  # 0: no MFU (README lists cards' bf16 peaks)
    out = {"depths": depths, "recompiles": recompiles}
    tokens_per_step = C.batch_size * C.block_size
    for name, model in models.items():
        median = statistics.median(seconds[name])
        per_token = [model.flops_per_token(r, min(r, C.bptt_k), C.block_size) for r in loops[name]]
        speed = C.bench_steps * tokens_per_step / median
        flops = sum(per_token) * tokens_per_step / median
        out[name] = {"tokens_per_s": speed, "flops_per_s": flops}
        line = f"{name}: {speed:,.0f} tokens/s, {flops:.4g} FLOP/s"
        if peak:
            out[name]["mfu"] = flops / peak
            line += f", MFU {flops / peak:.1%}"
        print(line)
    ratio = out["recurrent"]["flops_per_s"] / out["dense"]["flops_per_s"]
    print(f"recurrent / dense FLOP/s: {ratio:.3f}; recompiles while timing: {recompiles}")
    save_atomic("bench.json", out)  # whole or not at all, as every file the project writes
    return out


if __name__ == "__main__":
    run(main)
