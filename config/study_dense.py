# Parity for the laptop study (issue 20): the study model's dense twin. The same block code and
# width, no weight tying: 11 plain blocks run once (n_core=0: the adapter sees e and a zero state),
# the layer count whose forward FLOPs per token (13.5M at T=512) is nearest the recurrent model's
# at mean_loops=8 (13.4M; bench.py's dense_twin). Same data, steps, tokens and schedule.
exec(open("config/study.py").read())
out_dir = "out-study_dense"
n_prelude = 11
n_core = 0
n_coda = 0
mean_loops = 1
max_loops = 1
bptt_k = 1
state_std = 0.0
loop_dist = "fixed"
