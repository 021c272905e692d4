# The laptop study's trend with training length: config/study.py at 2,000 steps
# (5x the CPU default's 400), everything else the same.
exec(open("config/study.py").read())
out_dir = "out-study_2000"
max_iters = 2000
eval_interval = 200
