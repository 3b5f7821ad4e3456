# One 80 GB-class GPU (A100/H100), about an hour: a 25M-parameter ReFusion model on the Python
# standard library with the byte tokenizer. Not measured on this project's CPU-only machines; the
# corpus is small (about 2.3M tokens at block_size=1024), so this budget is about 75 epochs.
# python train.py config/train_stdlib_gpu.py
objective = "refusion"
dataset = "stdlib"
out_dir = "out-gpu"
device = "cuda"
compile = True
slot_sizes = (4, 8, 16, 32)
n_layer = 8
n_head = 8
n_embd = 512
block_size = 1024
batch_size = 64
gradient_accumulation_steps = 1
max_iters = 3000
learning_rate = 6e-4
min_lr = 6e-5
warmup_iters = 200
eval_interval = 500
eval_iters = 20
