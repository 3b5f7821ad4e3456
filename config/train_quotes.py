# The quick start: a 0.9M-parameter ReFusion model trained from scratch on the `quotes` corpus
# (lines of the standard library whose single-quoted strings black would double-quote), 7 minutes on
# 2 CPU cores (docs/training.md, "The quick start's output"). Two training options beyond the paper
# (SPEC section 3) keep the next-token pathway trained, which sample_quotes.py's
# infill="speculative" decodes with: on the first 50 validation lines 46 right at 6.45 tokens per
# forward pass (the paper's infill on the same weights: 33 right, 6.60).
out_dir = "out-quotes"
objective = "refusion"
dataset = "quotes"
slot_sizes = (8, 16)
slot_end_labels = True
ar_fraction = 0.25
n_layer = 4
n_head = 4
n_embd = 128
block_size = 160
batch_size = 32
max_iters = 1700
learning_rate = 3e-3
min_lr = 3e-4
eval_interval = 500
dtype = "float32"          # a model this small trains no faster in bf16, even with bf16 units
