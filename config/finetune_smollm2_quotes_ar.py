# The baseline a user would otherwise pick: SmolLM2-135M-Instruct fine-tuned by next-token
# prediction on the quotes task, with the same data, steps and settings as the ReFusion fine-tune
# (finetune_smollm2_quotes.py), on 2 CPU cores under bf16 autocast (docs/pretrained.md):
#   python train.py config/finetune_smollm2_quotes_ar.py
init_from = "smollm2"
out_dir = "out-smollm2-quotes-ar"
objective = "ar"
dataset = "quotes"
block_size = 128           # the longest quotes sample is 125 SmolLM2 tokens
dtype = "auto"             # bf16 where the CPU multiplies bf16 natively
device = "cpu"
batch_size = 16
max_iters = 700
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 30
weight_decay = 0.0
eval_interval = 100
eval_iters = 5
