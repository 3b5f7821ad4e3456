# The paper's recipe on one 80 GB GPU: fine-tune a pretrained Qwen3-0.6B into a ReFusion model.
# Download the weights yourself first (this code never uses the network):
#   huggingface-cli download Qwen/Qwen3-0.6B --local-dir Qwen3-0.6B
# and point `dataset` at prompt/response data in the ReFusion release's format (a JSON list of
# {"query": ..., "response": ...}, e.g. its data/train_data.json).
#   python train.py config/finetune_qwen3_0.6b.py &&
#   python sampler.py --out_dir=out-qwen3-0.6b --prompt="..."
# Untimed: this config has not run on a GPU yet. Memory, estimated from the parameter count
# (0.6B, the tied 151,936 x 1,024 embedding included): float32 weights, gradients and AdamW state
# take 16 bytes per parameter, about 10 GB; bf16 activations for 8 samples of up to 1,024 tokens
# come on top, the largest single part being the float32 logits of 8 x 1,024 x 151,936 (5 GB).
# Lower batch_size (and raise gradient_accumulation_steps) if it does not fit.
init_from = "Qwen3-0.6B"
out_dir = "out-qwen3-0.6b"
objective = "refusion"
dataset = "train_data.json"
# longest sample (prompt + response + EOS, in Qwen tokens); longer ones are skipped
block_size = 1024
slot_sizes = (4, 8, 16, 32)
device = "cuda"
batch_size = 8
gradient_accumulation_steps = 8
max_iters = 2000
learning_rate = 2e-5       # the paper's: 2e-5 with cosine decay
min_lr = 2e-6
warmup_iters = 50
weight_decay = 0.0
eval_interval = 200
eval_iters = 10
