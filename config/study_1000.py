# The laptop study's trend with training length (issue 20): config/study.py at 1,000 steps
# (2.5x the CPU default's 400), everything else the same.
exec(open("config/study.py").read())
out_dir = "out-study_1000"
max_iters = 1000
eval_interval = 100
