# The fixed-depth control for the CPU default run: the same model, data and schedule,
# but r = mean_loops (8) at every step instead of a LogNormal draw.
out_dir = "out-shakespeare-fixed"
loop_dist = "fixed"
