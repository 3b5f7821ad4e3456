# Decode the SmolLM2 ReFusion fine-tune of the quotes task (finetune_smollm2_quotes.py) on
# the CPU (bf16 where native), and compare it in its summary with next-token decoding of it:
#   python sampler.py config/sample_smollm2_quotes.py
out_dir = "out-smollm2-quotes"
dtype = "auto"             # bf16 where the CPU multiplies bf16 natively
num_samples = 20
max_new_tokens = 48        # the longest validation response, EOS included: 45 SmolLM2 tokens
slot_size = 8
serial_num_blocks = 1
slot_threshold = 0.7
token_threshold = 0.1
infill = "speculative"     # the benchmark's fastest point at the next-token quality
