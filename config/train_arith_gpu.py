# One 80 GB GPU for about an hour: an 85M-parameter ReFusion model (GPT-2 small's body) on
# arith-1m, a million worked arithmetic problems (116M byte tokens, 25 s to prepare on 2 CPU cores).
# Sized by FLOP count, not yet timed on a GPU: 10,000 iterations x 512 samples x ~149 tokens
# (padded) x 527 MFLOP per token = 4.0e17 FLOPs, 54 minutes on an A100 at 40% MFU. The progress
# bar prints the real MFU (set peak_tflops = 989 on an H100); scale max_iters by it. Memory:
# autograd keeps 98 MB per sample for the backward pass under bf16 autocast (135 MB in float32;
# counted on CPU), 50 GB at batch 512, plus 1.4 GB of weights, gradients and AdamW state.
# The run draws 5.1M samples, each of arith-1m's 950k training problems about 5 times; the stdlib
# corpus (5,333 functions even at block_size 1024) is far too small for this budget.
# python train.py config/train_arith_gpu.py && python sampler.py --out_dir=out-arith-gpu
out_dir = "out-arith-gpu"
objective = "refusion"
dataset = "arith-1m"
device = "cuda"
compile = True
slot_sizes = (4, 8, 16, 32)
n_layer = 12
n_head = 12
n_embd = 768
block_size = 192
batch_size = 512
gradient_accumulation_steps = 1
max_iters = 10000
learning_rate = 6e-4
min_lr = 6e-5
warmup_iters = 500
eval_interval = 1000
eval_iters = 20
