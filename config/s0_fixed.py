# The paper's fixed-depth control for S0: the same model and data, r = 4 loops every step.
exec(open("config/s0.py").read())
out_dir = "out-s0-fixed"
loop_dist = "fixed"
