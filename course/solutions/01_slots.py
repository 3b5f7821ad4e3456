# %% 1.1: ceil((n - P) / 8) slots; the layout's response positions fall in exactly that many
predicted = math.ceil((n - P) / 8)
b8 = layout_slots(tokens, prompt_len, length, torch.tensor([8]), torch.tensor([p]),
                  slot_is_masked, slot_rank, MASK)
pos8 = b8.position_ids[0, :n]
counted = len(set(((pos8[pos8 >= P] - P) // 8).tolist()))
assert predicted == counted, (predicted, counted)
print("1.1:", predicted, "slots")

# %% 1.2: no AR label anywhere (the prompt has none, every slot is masked); the weights add up to
# (n - P) / (p * (n - P)) = 1 / p
all_masked = torch.ones_like(slot_is_masked)
b = layout_slots(tokens, prompt_len, length, torch.tensor([S]), torch.tensor([p]), all_masked,
                 slot_rank, MASK)
ar_labels = ((b.labels != IGNORE) & (b.mdm_weight == 0)).sum().item()
assert ar_labels == 0
assert abs(b.mdm_weight.sum().item() - 1 / p) < 1e-4
print("1.2: AR labels", ar_labels, "; weights sum to", b.mdm_weight.sum().item(), "= 1/p")

# %% 1.3: one more label per clean slot whose last token is not the response's last (EOS), plus
# the prompt's last token
clean = [k for k in range(n_slots) if not slot_is_masked[0, k]]
predicted = sum(1 for k in clean if P + k * S + S < n) + 1
from data import label_slot_ends  # noqa: E402  (a cell of the notebook)

b_end = label_slot_ends(batch, tokens, prompt_len, length)
extra = (b_end.labels != IGNORE).sum().item() - (batch.labels != IGNORE).sum().item()
assert extra == predicted, (extra, predicted)
print("1.3:", extra, "more labels")
