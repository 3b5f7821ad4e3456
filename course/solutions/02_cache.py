# %% 2.1: unchanged (up to float rounding): every score depends on position differences only
shifted = model(idx, pos + 7)
assert (shifted - full).abs().max().item() < 1e-4
print("2.1: largest difference", (shifted - full).abs().max().item())

# %% 2.2: n_layer * 2 (keys, values) * n_kv_head * max_len * head_dim * 4 bytes
c = model.config
predicted = c.n_layer * 2 * c.n_kv_head * 64 * (c.n_embd // c.n_head) * 4
assert model.new_kv_cache(max_len=64).cache_bytes == predicted
print("2.2:", predicted, "bytes")

# %% 2.3: it changes: the tokens now sit at other positions, a different sequence
cache = model.new_kv_cache(max_len=32, max_batch=2)
model(prompt, torch.arange(6)[None], cache)
cache.repeat_prefix(2)
model(torch.cat([slots[6], slots[10]]), torch.tensor([[10 + i for i in range(4)],
                                                       [6 + i for i in range(4)]]), cache)
cache.commit_rows([(0, 4), (1, 4)], start=6)
swapped = model(torch.randint(0, 40, (1, 1), generator=torch.Generator().manual_seed(1)),
                torch.tensor([[14]]), cache)
assert (swapped - a).abs().max().item() > 1e-3
print("2.3: largest difference", (swapped - a).abs().max().item())
