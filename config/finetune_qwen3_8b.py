# The paper's recipe at its own size: fine-tune a pretrained Qwen3-8B into a ReFusion model on one
# node of 8 GPUs with 80 GB each, sharded with FSDP (docs/training.md, "Models larger than one
# GPU").
# Download the weights yourself first (this code never uses the network):
#   huggingface-cli download Qwen/Qwen3-8B --local-dir Qwen3-8B
# and point `dataset` at prompt/response data in the ReFusion release's format (a JSON list of
# {"query": ..., "response": ...}, e.g. its data/train_data.json). Then:
#   torchrun --standalone --nproc_per_node=8 train.py config/finetune_qwen3_8b.py
#   python -m tools.consolidate --out_dir=out-qwen3-8b &&
#   python sampler.py --out_dir=out-qwen3-8b --prompt="..."
# Not yet run on GPUs: every figure below is an estimate.
# Memory per GPU, from the parameter count (8.19B: shard.memory_table, as in docs/training.md):
#   weights, gradients and AdamW state, sharded 8 ways: 16 bytes / 8 per parameter, 16.4 GB;
#   the largest unit FSDP gathers (embedding and lm_head, 1.24B parameters) in bf16 with its float32
#   gradients: 7.5 GB; so 23.8 GB of model state (training with DDP instead would need 131 GB per
#   GPU). Activations for 8 samples of up to 1,024 tokens, with activation checkpointing: the
#   logits, about 10 bytes per token per vocabulary entry (bf16, their float32 copy and
#   log-softmax), 12 GB; each block's bf16 input, 2.4 GB; one block's recomputed activations, about
#   2 GB; in backward, the logits' float32 gradient, 5 GB. About 45 GB at the peak, so there is room
#   to spare.
# Host memory: every process reads the float32 weights before sharding them, up to 66 GB each while
# loading (0.5 TB for the node).
# Compute: at most 6.4e18 FLOPs (2,000 steps of 64 samples of 1,024 tokens, about 6 per parameter
# and token), 8.6e18 with the recomputation: about 45 minutes on 8 H100s at 40% MFU if every sample
# is that long.
init_from = "Qwen3-8B"
out_dir = "out-qwen3-8b"
objective = "refusion"
dataset = "train_data.json"
# longest sample (prompt + response + EOS, in Qwen tokens); longer ones are skipped
block_size = 1024
slot_sizes = (4, 8, 16, 32)
device = "cuda"            # bf16 compute (autocast and FSDP's mixed precision), float32 shards
fsdp = True
activation_checkpointing = True
batch_size = 8             # per GPU
gradient_accumulation_steps = 8  # over the 8 processes: one micro-batch each, 64 samples per step
max_iters = 2000
learning_rate = 2e-5       # the paper's: 2e-5 with cosine decay
min_lr = 2e-6
warmup_iters = 50
weight_decay = 0.0
eval_interval = 200
eval_iters = 10
