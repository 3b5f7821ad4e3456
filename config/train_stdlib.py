# The CPU demo (the defaults of train.py, spelled out): a 0.9M-parameter ReFusion model on the
# Python standard library, about 8 minutes on 2 CPU cores.
objective = "refusion"
dataset = "stdlib"
slot_sizes = (4, 8)
n_layer = 4
n_head = 4
n_embd = 128
block_size = 384
batch_size = 16
max_iters = 1500
learning_rate = 2e-3
eval_interval = 250
dtype = "float32"          # a model this small trains no faster in bf16, even with bf16 units
