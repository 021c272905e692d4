# The CPU default trained 2.5x longer (750 steps, ~25 minutes on 2 cores): does the randomized
# model use its depth more with more training? Same model, data and schedule shape.
out_dir = "out-shakespeare-long"
max_iters = 750
eval_interval = 150
