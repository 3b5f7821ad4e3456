# Decode the SmolLM2 ReFusion fine-tune of the arith task (finetune_smollm2_arith.py) on
# the CPU (bf16 where native), and compare it in its summary with next-token decoding of it:
#   python sampler.py config/sample_smollm2_arith.py
out_dir = "out-smollm2-arith"
dtype = "auto"             # bf16 where the CPU multiplies bf16 natively
num_samples = 20
max_new_tokens = 48        # the longest validation response, EOS included: 43 SmolLM2 tokens
slot_size = 32
serial_num_blocks = 1
slot_threshold = 0.9
token_threshold = 0.3
infill = "speculative"     # a serial task: the next-token pathway forces each round's token
