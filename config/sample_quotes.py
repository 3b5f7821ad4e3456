# Decode the quick start's model (train_quotes.py) on validation lines: one serial block of 32-token
# slots, the paper's thresholds, and infill="speculative" (SPEC section 4.1), the next-token pathway
# in charge.
out_dir = "out-quotes"
num_samples = 10
max_new_tokens = 80
slot_size = 32
serial_num_blocks = 1
slot_threshold = 0.9
token_threshold = 0.3
infill = "speculative"
