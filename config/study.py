# The laptop study model (issue 20): the CPU default's shape and schedule, trained 5x
# longer (2,000 steps x 4,096 tokens = 8.2M tokens, ~4.3 epochs of Shakespeare), to
# ask whether the allocation gap opens with training, as the paper's S1 suggests.
# config/study_1000.py is the same at 1,000 steps (the trend with training length).
out_dir = "out-study"
max_iters = 2000
eval_interval = 200
