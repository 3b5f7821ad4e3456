# %% 3.1: the same tokens and the same number of forward passes: the cache changes the cost of a
# pass, never its result (SPEC section 4; test_plain_decoder_is_the_cached_decoder_pass_for_pass)
from sampler import generate_refusion_plain

plain = generate_refusion_plain(half_trained, prompt, paper, mask_id=MASK, eos_ids=EOS)
assert plain.tokens == out.tokens and plain.nfe == out.nfe
print("3.1:", plain.nfe, "forward passes either way")

# %% 3.2: one slot per step, so a right answer takes 3 steps: its 18 tokens fill slots 0, 1, 2
one_at_a_time = replace(paper, slot_threshold=1.0)
_, _, outs = run(model, generate_refusion, one_at_a_time, mask_id=MASK, eos_ids=EOS)
for p, o in zip(prompts, outs):
    assert all(len({(q - len(p)) // 8 for q, _ in step}) == 1 for step in o.trace)
    assert not right(p, o) or len(o.trace) == 3
print("3.2: one slot per step;", sum(right(p, o) for p, o in zip(prompts, outs)),
      "right answers in 3 steps each")

# %% 3.3: the same tokens: a draft is accepted only where it is the next-token prediction, and each
# infill round forces that prediction, so one slot filled left to right is next-token decoding
# (SPEC 4.1; test_speculative_infill_with_one_slot_per_block_equals_next_token_decoding). At 0.3 a
# draft that is not the most likely next token can pass, and the tokens may differ.
one_slot = replace(paper, infill="speculative", slot_size=24, token_threshold=0.5)
_, _, outs = run(half_trained, generate_refusion, one_slot, mask_id=MASK, eos_ids=EOS)
assert [o.tokens for o in outs] == [o.tokens for o in next_token["half-trained"]]
print("3.3: the same tokens on", len(outs), "prompts")

# %% 3.4: all 40: every committed token is the next-token prediction after the tokens before it
# (SPEC 4.5). No pass commits fewer than one token: the prediction after the last accepted draft
# is committed even when every draft is rejected. Slots of 24 feed more masks a pass, so a right
# run of drafts reaches further; a rejection throws the rest away, and every pass is wider.
passes = {}
for S in (4, 24):
    _, _, outs = run(model, generate_exact, replace(exact, slot_size=S), mask_id=MASK, eos_ids=EOS)
    assert [o.tokens for o in outs] == [o.tokens for o in next_token["trained"]]
    assert all(len(step) >= 1 for o in outs for step in o.trace)
    passes[S] = sum(o.nfe for o in outs)
print("3.4: the same tokens on 40 prompts; forward passes by slot size:", passes,
      "next token:", sum(o.nfe for o in next_token["trained"]))
