# The baseline a user would otherwise pick: SmolLM2-135M-Instruct fine-tuned by next-token
# prediction on the arith task (arith-small), with the same data, steps and settings as the
# ReFusion fine-tune (finetune_smollm2_arith.py), on 2 CPU cores under bf16 autocast
# (docs/pretrained.md):
#   python train.py config/finetune_smollm2_arith_ar.py
init_from = "smollm2"
out_dir = "out-smollm2-arith-ar"
objective = "ar"
dataset = "arith-small"
block_size = 128           # the longest arith-small sample is 55 SmolLM2 tokens
dtype = "auto"             # bf16 where the CPU multiplies bf16 natively
device = "cpu"
batch_size = 16
max_iters = 500
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 30
weight_decay = 0.0
eval_interval = 100
eval_iters = 5
