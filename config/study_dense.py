# Parity for the laptop study: the study model's dense twin, the same blocks unrolled once
# (train.py logs each step's FLOP/s: the two runs' ratio is the parity of their FLOP rates). The core's block (sandwich norms and all) appears
# n_core * mean_loops = 8 times, run in a single loop from a zero initial state (state_std = 0: one pass
# from noise would be a noisy input, which no dense stack has), with the same prelude, coda and width,
# and no weight tying across depth (4.0M unique non-embedding parameters against the study model's 1.3M).
# Its forward FLOPs per token at T=512 (12.3M) are the study model's at mean_loops=8 (13.4M) less the 7
# adapters of loops 2..8. Same data, steps, tokens and schedule.
# (Before 2026-11-25 this was 11 plain blocks with n_core=0, which model.py now refuses.)
exec(open("config/study.py").read())
out_dir = "out-study_dense"
n_core = 8
mean_loops = 1
max_loops = 1
bptt_k = 1
state_std = 0.0
loop_dist = "fixed"
