# The fixed-depth control for config/shakespeare_long.py: same model, data and 750-step
# schedule, r = mean_loops (4) at every step.
exec(open("config/shakespeare_long.py").read())
out_dir = "out-shakespeare-long-fixed"
loop_dist = "fixed"
