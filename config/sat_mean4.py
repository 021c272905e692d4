# The saturation study (studies/saturation.sh): the CPU default (train.py's settings: shape, data,
# steps, tokens) with only its loop distribution changed, scaled as S0 and S1 scale it:
# bptt_k = mean_loops, max_loops = 4 x mean_loops.
out_dir = "out-sat-mean4"
mean_loops = 4
bptt_k = 4
max_loops = 16
loop_spread = 0.5
