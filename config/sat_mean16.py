# The saturation study (studies/saturation.sh): the CPU default (train.py's settings: shape, data,
# steps, tokens) with only its loop distribution changed, scaled as S0 and S1 scale it:
# bptt_k = mean_loops, max_loops = 4 x mean_loops.
out_dir = "out-sat-mean16"
mean_loops = 16
bptt_k = 16
max_loops = 64
loop_spread = 0.5
