# The side-by-side comparison at a scale where the models learn more: one 80 GB GPU, about an hour.
# 26M-parameter models on the serial task (arith on arith-1m: ARM, ReFusion, MDM, 6,000 iterations
# of 512 samples each; ReFusion fine-tuned from the ARM: 3,000 more), then 200 validation prompts
# through every decoder of the sweep. Sized by FLOP count, not yet timed on a GPU: 21,000 iterations
# x 512 x ~149 tokens x 162 MFLOP per token = 2.6e17 FLOPs, 46 minutes on an A100 at 30% MFU, plus
# decoding.
# python -m tools.bench config/bench_gpu.py
out_dir = "bench-gpu"
tasks = ("arith",)
throughput_task = "arith"  # its batched throughput table (tools.bench --batch_sizes)
# a million problems (operands of 3 to 6 digits): the ARM sees each about 3 times
dataset = "arith-1m"
block_size = 192
max_new_tokens = 128
num_prompts = 200
device = "cuda"
compile = True
n_layer = 8
n_head = 8
n_embd = 512
batch_size = 512
max_iters = 6000
finetune_iters = 3000
learning_rate = 1e-3
