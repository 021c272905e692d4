# The laptop study model: the CPU default's shape and schedule, trained 2.5x longer
# (1,000 steps x 4,096 tokens = 4.1M tokens, ~2.1 epochs of Shakespeare; 24 minutes on 2 cores), to
# ask whether the allocation gap opens with training, as the paper's S1 suggests.
# config/study_2000.py is the same at 2,000 steps (44 minutes: over the study's 40-minute budget,
# kept as the trend's longest run).
out_dir = "out-study"
max_iters = 1000
eval_interval = 100
