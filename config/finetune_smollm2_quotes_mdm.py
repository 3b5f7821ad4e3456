# The masked-diffusion baseline, the Dream way: SmolLM2-135M-Instruct fine-tuned into an MDM on the
# quotes task with the same data, steps and settings as the ReFusion fine-tune
# (finetune_smollm2_quotes.py): bidirectional attention from the pretrained weights, the output at
# position i predicting token i + 1 as the pretrained head did (mdm_shift, SPEC section 3), and
# LLaDA's EOS padding of every answer to the 48-token canvas it decodes (docs/pretrained.md):
#   python train.py config/finetune_smollm2_quotes_mdm.py
#   python sampler.py --out_dir=out-smollm2-quotes-mdm --steps=12 --block_length=16
init_from = "smollm2"
out_dir = "out-smollm2-quotes-mdm"
objective = "mdm"
mdm_shift = True
gen_length = 48            # the canvas: the longest validation response, EOS included, is 45 tokens
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
