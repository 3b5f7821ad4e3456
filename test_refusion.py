"""
The specification, as tests, in the order of SPEC.md: the model's positions and the cache
(section 2), the slot reorganization and the hybrid loss (section 3), plan / verify / infill /
commit against an oracle and a naive reference decoder, then the baselines (section 4), and the
speculative infill (section 4.1) and exact verification (section 4.5). Above each test, a comment
quotes the SPEC sentence it proves. Each test checks a property with exact values or an equality
between two code paths (float32, tolerance 1e-5).

Plumbing (data preparation, training runs, the command line, errors) is tested under tests/.
Run everything: python -m pytest -q
"""

import math
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import data
from data import layout_one_sample
from sampler import (DecodeSettings, MDMSettings, RefusionSettings, draft_tokens, generate_exact,
                     generate_exact_plain, generate_mdm, generate_next_token, generate_refusion,
                     generate_refusion_plain, tokens_per_step)
from kvcache import KVCache
from model import ModelConfig, Transformer
import train
from train import hybrid_loss, load_weights

TOL = 1e-5


def tiny_model(seed=0, causal=True, **overrides):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=40, block_size=128, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
               causal=causal)
    cfg.update(overrides)
    return Transformer(ModelConfig(**cfg)).eval()


# ----------------------------------------------------------------------------------------------
# model.py + kvcache.py: the model reads (tokens, position_ids) causally, and the cache does not
# care where a key sits (SPEC section 2)

# SPEC 2: "Attention is causal over the physical order; RoPE uses the logical positions." A
# forward pass in pieces after the cache is the causal pass over the whole.
@torch.no_grad()
def test_cached_decode_matches_full_forward():
    model = tiny_model()
    idx = torch.randint(0, 40, (1, 20))
    pos = torch.arange(20)[None]
    full = model(idx, pos)
    cache = model.new_kv_cache(max_len=20)
    parts = [model(idx[:, a:b], pos[:, a:b], cache)
             for a, b in [(0, 7), (7, 8), (8, 9), (9, 14), (14, 20)]]
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=TOL, rtol=0)


# SPEC 2: "Attention is causal over the physical order"; SPEC 3, baselines: "`mdm`:
# LLaDA-style: bidirectional attention".
@torch.no_grad()
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_only_the_bidirectional_model_sees_later_tokens(causal):
    model = tiny_model(seed=7, causal=causal)
    idx = torch.randint(0, 36, (1, 12), generator=torch.Generator().manual_seed(7))
    changed = idx.clone()
    changed[0, 9] = (idx[0, 9] + 1) % 36
    pos = torch.arange(12)[None]
    # the positions before the change
    diff = float((model(idx, pos) - model(changed, pos))[0, :9].abs().max())
    assert diff <= 1e-6 if causal else diff > 1e-4


# SPEC 2: "attention over a set of cached keys/values is invariant to their order in the
# buffer, so blocks of KV that were each computed independently (each seeing the same prefix)
# give the same result for a later token whichever order they are appended in."
@torch.no_grad()
def test_cache_is_order_invariant_for_independent_blocks():
    model = tiny_model(seed=2)
    prefix = torch.randint(0, 40, (1, 6))
    # start position -> tokens
    blocks = {4: torch.randint(0, 40, (1, 4)), 10: torch.randint(0, 40, (1, 4))}
    nxt = torch.randint(0, 40, (1, 1))
    nxt_pos = torch.tensor([[14]])
    outs = []
    for order in ([4, 10], [10, 4]):
        cache = model.new_kv_cache(max_len=32, max_batch=2)
        model(prefix, torch.tensor([[0, 1, 2, 3, 14 + 1, 14 + 2]]), cache)
        cache.repeat_prefix(2)
        toks = torch.cat([blocks[s] for s in order])
        model(toks, torch.tensor([[s + i for i in range(4)] for s in order]), cache)
        cache.commit_rows([(0, 4), (1, 4)], start=6)
        outs.append(model(nxt, nxt_pos, cache))
    torch.testing.assert_close(outs[0], outs[1], atol=TOL, rtol=0)


# ----------------------------------------------------------------------------------------------
# data.py: the slot reorganization of a training sample (SPEC section 3, steps 1-4)

# SPEC 3, steps 3-5, one sample by hand: "prompt, then the clean slots in a random permutation,
# then the masked slots in their original order"; "the last token of a clean slot has no
# label"; a masked token weighs "CE / p, divided by the sample's response length (EOS
# included)".
def test_slot_layout_hand_computed_case():
    """prompt [10, 11], response [1, 2, 3, 4, 5, EOS] in slots of 2 at positions (2,3) (4,5) (6,7);
    slot 1 masked; clean slots ordered slot 2 then slot 0; two pads."""
    E = 256
    M = 257
    PAD_ID = 258
    tokens = torch.tensor([[10, 11, 1, 2, 3, 4, 5, E, PAD_ID, PAD_ID]])
    b = data.layout_slots(tokens, torch.tensor([2]), torch.tensor([8]), S=torch.tensor([2]),
                          p=torch.tensor([0.5]),
                          slot_is_masked=torch.tensor([[False, True, False] + [False] * 7]),
                          slot_rank=torch.tensor([[1, 2, 0] + list(range(3, 10))]), mask_id=M)
    X = data.IGNORE
    assert b.idx.tolist() == [[10, 11, 5, E, 1, 2, M, M, PAD_ID, PAD_ID]]
    assert b.position_ids.tolist() == [[0, 1, 6, 7, 2, 3, 4, 5, 8, 9]]
    assert b.labels.tolist() == [[X, X, E, X, 2, X, 3, 4, X, X]]
    w = 1 / (0.5 * 6)                       # 1 / (p_mask * response length, EOS included)
    torch.testing.assert_close(b.mdm_weight, torch.tensor([[0, 0, 0, 0, 0, 0, w, w, 0, 0]]),
                               atol=1e-7, rtol=0)


def random_samples(seed, B=6, T=60, vocab=200):
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(1, 12, (B,), generator=g)
    length = torch.minimum(prompt_len + torch.randint(1, 50, (B,), generator=g), torch.tensor(T))
    tokens = torch.randint(0, vocab, (B, T), generator=g)
    tokens[torch.arange(T) >= length[:, None]] = 258
    return tokens, prompt_len, length


# SPEC 3, step 3: "prompt, then the clean slots in a random permutation, then the masked slots
# in their original order, every token of a masked slot replaced by the mask id. Padding (if
# any) goes last. Every token keeps its true position id."
@pytest.mark.parametrize("S", [1, 3, 4, 8])
def test_clean_slots_shuffled_masked_slots_in_order(S):
    M = 257
    shuffled_rows = 0
    for seed in range(4):
        tokens, prompt_len, length = random_samples(seed)
        b = data.reorganize_slots(tokens, prompt_len, length, (S,), M,
                                  torch.Generator().manual_seed(seed))
        for row in range(len(tokens)):
            P = int(prompt_len[row])
            n = int(length[row])
            idx = b.idx[row].tolist()
            pos = b.position_ids[row].tolist()
            lab = b.labels[row].tolist()
            w = b.mdm_weight[row].tolist()
            orig = tokens[row].tolist()
            assert idx[:P] == orig[:P] and pos[:P] == list(range(P))   # prompt untouched, first
            assert lab[:P] == [data.IGNORE] * P
            assert pos[n:] == list(range(n, len(orig))) and idx[n:] == orig[n:]  # padding last

            def slot_of(q):                                        # the slot of true position q
                return (q - P) // S

            order = [slot_of(q) for q in pos[P:n]]                     # slot id along the buffer
            slots = [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k]
            assert sorted(slots) == list(range(slot_of(n - 1) + 1))   # each slot one run
            masked = [k for k in slots if idx[P + order.index(k)] == M]
            clean = [k for k in slots if k not in masked]
            assert slots == clean + masked and masked == sorted(masked)  # clean first; in order
            shuffled_rows += clean != sorted(clean)
            for i in range(P, n):
                q = pos[i]
                follows = i > P and slot_of(pos[i - 1]) == slot_of(q)
                assert pos[i] == (pos[i - 1] + 1 if follows else q)
                if slot_of(q) in masked:
                    assert (idx[i], lab[i]) == (M, orig[q])
                    assert w[i] == w[P + order.index(masked[0])] > 0
                else:
                    has_next = q + 1 < n and slot_of(q + 1) == slot_of(q)
                    assert idx[i] == orig[q]
                    assert lab[i] == (orig[q + 1] if has_next else data.IGNORE)
                    assert w[i] == 0
    if S < 8:
        assert shuffled_rows > 0                                   # clean slots really permuted


# SPEC 3: "For each sample independently:" steps 1-4, laid out for the whole batch at once
# (layout_slots) as the plain loop lays out one sample (layout_one_sample).
@pytest.mark.parametrize("seed", range(4))
def test_vectorized_layout_equals_the_per_sample_loop(seed):
    """layout_slots sorts the whole batch at once (one argsort of group, rank and position); on
    random batches with mixed slot sizes, masks and orders it builds exactly what the loop does."""
    g = torch.Generator().manual_seed(100 + seed)
    tokens, prompt_len, length = random_samples(seed, B=8, T=50)
    B, T = tokens.shape
    S = torch.tensor([1, 2, 3, 4, 5, 8, 16, 32])[torch.randperm(8, generator=g)]
    p = torch.rand(B, generator=g) * 0.999 + 0.001
    slot_is_masked = torch.rand(B, T, generator=g) < p[:, None]
    slot_rank = torch.stack([torch.randperm(T, generator=g) for _ in range(B)])
    b = data.layout_slots(tokens, prompt_len, length, S, p, slot_is_masked, slot_rank, 257)
    for r in range(B):
        idx, pos, labels, weight = layout_one_sample(tokens[r].tolist(), int(prompt_len[r]),
                                                     int(length[r]), int(S[r]), float(p[r]),
                                                     slot_is_masked[r].tolist(),
                                                     slot_rank[r].tolist(), 257)
        assert b.idx[r].tolist() == idx and b.position_ids[r].tolist() == pos
        assert b.labels[r].tolist() == labels
        torch.testing.assert_close(b.mdm_weight[r], torch.tensor(weight), atol=1e-7, rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# train.py: the hybrid loss (SPEC section 3, step 5)

# SPEC 3, step 5: "Loss = AR_loss + MDM_loss, where AR_loss is the mean cross-entropy over all
# clean-slot labels of the batch (a token mean; 0 when the batch has none, never NaN) and
# MDM_loss = sum over masked tokens of CE / p, [...] averaged over the batch (0 when nothing
# is masked)."
def test_hybrid_loss_is_ar_mean_plus_weighted_mdm_sum():
    X = data.IGNORE
    labels = torch.tensor([[X, 1, 2, 3], [0, X, X, 2]])
    # row 0: tokens 2, 3 masked; row 1: token 3
    weight = torch.tensor([[0, 0, 0.5, 0.5], [0, 0, 0, 0.25]])
    logits = torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(0))
    ce = -torch.log_softmax(logits, -1)
    ar = (ce[0, 1, 1] + ce[1, 0, 0]) / 2
    mdm = (0.5 * ce[0, 2, 2] + 0.5 * ce[0, 3, 3] + 0.25 * ce[1, 3, 2]) / 2
    loss, ar_loss, mdm_loss = hybrid_loss(logits, data.Batch(None, None, labels, weight))
    torch.testing.assert_close((ar_loss, mdm_loss, loss), (ar, mdm, ar + mdm), atol=TOL, rtol=0)
    # nothing clean, nothing masked: both parts are 0, never NaN
    empty = data.Batch(None, None, torch.full((2, 4), X), torch.zeros(2, 4))
    assert [x.item() for x in hybrid_loss(logits, empty)] == [0.0, 0.0, 0.0]


# SPEC 3, steps 4-5: "clean slot tokens: next token inside the same slot (the last token of a
# clean slot has no label, since the next buffer token belongs to another slot)", and AR_loss
# is their token mean.
def test_refusion_ar_loss_from_an_ar_model_equals_its_loss_without_slot_boundaries():
    """An ARM loaded with --init_from into a ReFusion run: with nothing masked and the clean slots
    in their original order, the AR part of the hybrid loss is the ARM's next-token loss over the
    response, minus the labels that would cross a slot boundary."""
    ar_model = tiny_model(seed=6)
    refusion_model = tiny_model(seed=7)
    load_weights(refusion_model, {"model": ar_model.state_dict()})
    tokens, prompt_len, length = random_samples(8, B=4, T=40, vocab=36)
    tokens[tokens == 258] = 39                                        # the tiny model's pad id
    S = torch.tensor([4, 3, 8, 5])
    B, T = tokens.shape
    b = data.layout_slots(tokens, prompt_len, length, S, p=torch.full((B,), 0.5),
                          slot_is_masked=torch.zeros(B, T, dtype=torch.bool),
                          slot_rank=torch.arange(T).expand(B, T), mask_id=38)
    assert torch.equal(b.idx, tokens)                          # nothing moved, nothing masked
    _, ar_part, mdm_part = hybrid_loss(refusion_model(b.idx, b.position_ids), b)
    # the reference: the ARM's cross-entropy at every response label except those at slot boundaries
    logits = ar_model(tokens, torch.arange(T).expand(B, T))
    ce = []
    for r in range(B):
        P = int(prompt_len[r])
        n = int(length[r])
        for j in range(P, n - 1):                                     # position j predicts j + 1
            if (j + 1 - P) % int(S[r]) != 0:                           # j + 1 starts no new slot
                ce.append(F.cross_entropy(logits[r, j], tokens[r, j + 1]))
    torch.testing.assert_close(ar_part, torch.stack(ce).mean(), atol=TOL, rtol=0)
    assert mdm_part.item() == 0.0


# ----------------------------------------------------------------------------------------------
# data.py, train.py beyond the paper: slot_end_labels and ar_fraction (SPEC section 3, opt-in)

def label_slot_ends_of_one_sample(tokens, P, n, pos, labels, weight):
    """label_slot_ends for one sample, as a plain loop over its buffer: a clean response token
    (no loss weight) and the prompt's last token take the token at the next true position, where
    that position is in the response."""
    out = list(labels)
    for i, q in enumerate(pos):
        clean = P <= q < n and weight[i] == 0
        if (clean or q == P - 1) and q + 1 < n:
            out[i] = tokens[q + 1]
    return out


# SPEC 3, beyond the paper: "`slot_end_labels` also labels the last token of every clean slot,
# and the prompt's last token, with the token at the next position."
@pytest.mark.parametrize("seed", range(4))
def test_slot_end_label_pass_equals_the_per_sample_loop(seed):
    """label_slot_ends after reorganize_slots: the labels the plain loop gives, every other field
    unchanged, and no random number drawn."""
    tokens, prompt_len, length = random_samples(seed, B=8, T=50)
    g = torch.Generator().manual_seed(seed)
    b = data.reorganize_slots(tokens, prompt_len, length, (1, 3, 4, 8), 257, g)
    state = g.get_state()
    labelled = data.label_slot_ends(b, tokens, prompt_len, length)
    assert torch.equal(g.get_state(), state)
    for field in ("idx", "position_ids", "mdm_weight"):
        assert torch.equal(getattr(labelled, field), getattr(b, field))
    for r in range(8):
        expected = label_slot_ends_of_one_sample(tokens[r].tolist(), int(prompt_len[r]),
                                                 int(length[r]), b.position_ids[r].tolist(),
                                                 b.labels[r].tolist(), b.mdm_weight[r].tolist())
        assert labelled.labels[r].tolist() == expected
    # slot ends were labelled: more labels than the paper's layout gives
    assert (labelled.labels != data.IGNORE).sum() > (b.labels != data.IGNORE).sum()


# SPEC 3, beyond the paper: "With nothing masked and the slots in order, the labels become
# exactly the ARM's."
def test_slot_end_labels_give_the_arm_loss_when_nothing_is_masked():
    """Every response token predicted from the one before, the first from the prompt's last
    token: the AR part of the hybrid loss is the ARM's loss on the same weights."""
    model = tiny_model(seed=6)
    tokens, prompt_len, length = random_samples(9, B=4, T=40, vocab=36)
    tokens[tokens == 258] = 39
    B, T = tokens.shape
    b = data.layout_slots(tokens, prompt_len, length, torch.tensor([4, 3, 8, 5]),
                          p=torch.full((B,), 0.5),
                          slot_is_masked=torch.zeros(B, T, dtype=torch.bool),
                          slot_rank=torch.arange(T).expand(B, T), mask_id=38)
    b = data.label_slot_ends(b, tokens, prompt_len, length)
    arm = data.autoregressive_batch(tokens, prompt_len, length)
    assert torch.equal(b.labels, arm.labels)
    torch.testing.assert_close(hybrid_loss(model(b.idx, b.position_ids), b),
                               hybrid_loss(model(arm.idx, arm.position_ids), arm), atol=TOL, rtol=0)


# SPEC 3, beyond the paper: "`ar_fraction` (also opt-in, 0 by default) lays that share of the
# samples of each batch out as the ARM's instead"
def test_ar_fraction_lays_out_that_share_of_samples_as_the_arm_does():
    """ar_fraction (mix_layouts, after the layout) draws which samples take the ARM's layout; the
    other samples are exactly what reorganize_slots gives (same random stream before)."""
    tokens, prompt_len, length = random_samples(10, B=16, T=50)
    mixing = torch.Generator().manual_seed(3)
    plain = data.reorganize_slots(tokens, prompt_len, length, (4, 8), 257, mixing)
    arm = data.autoregressive_batch(tokens, prompt_len, length)
    mixed = data.mix_layouts(plain, arm, 0.5, mixing)
    g = torch.Generator().manual_seed(3)
    data.reorganize_slots(tokens, prompt_len, length, (4, 8), 257, g)   # the same draws first
    as_arm = torch.rand(16, generator=g) < 0.5
    assert 0 < as_arm.sum() < 16
    for r in range(16):
        expected = arm if as_arm[r] else plain
        for field in ("idx", "position_ids", "labels", "mdm_weight"):
            assert torch.equal(getattr(mixed, field)[r], getattr(expected, field)[r])


def arm_one_sample(tokens, P, n):
    """autoregressive_batch for one sample, as a plain loop: natural order, each token labelled
    with the next token where that one is in the response."""
    labels = [tokens[q + 1] if P <= q + 1 < n else data.IGNORE for q in range(len(tokens))]
    return tokens, list(range(len(tokens))), labels, [0.0] * len(tokens)


# SPEC 3, beyond the paper: "Both act after the paper's layout (`data.label_slot_ends`, a label
# pass; `data.mix_layouts`, one draw per sample after the layout's draws)"
@pytest.mark.parametrize("slot_end_labels,ar_fraction", [(False, 0.0), (True, 0.0), (False, 0.5),
                                                         (True, 0.5)])
def test_make_batch_is_the_paper_layout_then_the_options_as_plain_loops(slot_end_labels,
                                                                        ar_fraction):
    """train.make_batch for ReFusion, with and without slot_end_labels and ar_fraction: the draws of
    SPEC section 3 in order (slot size, p_mask, masks, slot order), each sample laid out by
    layout_one_sample, its slot ends labelled by the plain loop, then one draw per sample for the
    ARM's layout: the batch make_batch gives, and the generator left where make_batch leaves it."""
    tokens, prompt_len, length = random_samples(11, B=12, T=50)
    B, T = tokens.shape
    cfg = dict(train.DEFAULTS, slot_sizes=(1, 4, 8), slot_end_labels=slot_end_labels,
               ar_fraction=ar_fraction)
    g = torch.Generator().manual_seed(5)
    batch = train.make_batch(cfg, tokens, prompt_len, length, {"mask_id": 257}, g)
    # the same draws, in the same order, from a generator seeded alike
    ref = torch.Generator().manual_seed(5)
    S = [(1, 4, 8)[k] for k in torch.randint(3, (B,), generator=ref).tolist()]
    p = (1 - 1e-3) * torch.rand(B, generator=ref) + 1e-3
    slot_is_masked = (torch.rand(B, T, generator=ref) < p[:, None]).tolist()
    noise = torch.rand(B, T, generator=ref).tolist()
    # a slot's rank: its place when the slots are sorted by their noise
    slot_rank = [[sorted(row).index(x) for x in row] for row in noise]
    as_arm = (torch.rand(B, generator=ref) < ar_fraction).tolist() if ar_fraction else [False] * B
    assert torch.equal(g.get_state(), ref.get_state())
    for r in range(B):
        row = tokens[r].tolist()
        P = int(prompt_len[r])
        n = int(length[r])
        idx, pos, labels, weight = layout_one_sample(row, P, n, S[r], float(p[r]),
                                                     slot_is_masked[r], slot_rank[r], 257)
        if slot_end_labels:
            labels = label_slot_ends_of_one_sample(row, P, n, pos, labels, weight)
        if as_arm[r]:
            idx, pos, labels, weight = arm_one_sample(row, P, n)
        assert batch.idx[r].tolist() == idx and batch.position_ids[r].tolist() == pos
        assert batch.labels[r].tolist() == labels
        torch.testing.assert_close(batch.mdm_weight[r], torch.tensor(weight), atol=1e-7, rtol=1e-6)
    if ar_fraction:
        assert 0 < sum(as_arm) < B


# ----------------------------------------------------------------------------------------------
# data.py, train.py: the MDM baseline's training layout (SPEC section 3, baselines)

def pad_one_sample_with_eos(tokens, P, n, eos_id, pad_id, gen_length, max_len, width):
    """pad_with_eos for one sample, as a plain loop: the prompt, the response, then EOS until the
    response holds gen_length tokens, but never past max_len positions and never cutting it."""
    row = tokens[:n]
    while len(row) - P < gen_length and len(row) < max_len:
        row.append(eos_id)
    return row + [pad_id] * (width - len(row)), len(row)


# SPEC 3, baselines: "each response is first padded with EOS up to the generation length `G`
# (the canvas the MDM decodes; never cut, never past the context)"
@pytest.mark.parametrize("seed,gen_length,max_len",
                         [(0, 16, 60), (1, 40, 60), (2, 40, 45), (3, 1, 60)])
def test_mdm_layout_pads_every_response_with_eos_to_the_canvas(seed, gen_length, max_len):
    tokens, prompt_len, length = random_samples(seed, B=8, T=max_len)
    padded, new_length = data.pad_with_eos(tokens, prompt_len, length, 256, 258, gen_length,
                                           max_len)
    for r in range(8):
        row, n = pad_one_sample_with_eos(tokens[r].tolist(), int(prompt_len[r]), int(length[r]),
                                         256, 258,
                                         gen_length, max_len, padded.shape[1])
        assert padded[r].tolist() == row and int(new_length[r]) == n
    assert padded.shape[1] == int(new_length.max())


# SPEC 3, baselines: "the padding EOS are attended, masked, labelled and counted in the
# response length like any response token [...] The decoder is used with that same `G`."
def test_mdm_trains_on_the_canvas_it_decodes():
    """LLaDA's SFT layout: a training sequence is as long as generate_mdm's canvas (prompt +
    max_new_tokens), and its EOS padding is attended, masked like the response and scored, with the
    response length (padding included) in the weight."""
    G = 12
    P = 3
    tokens = torch.tensor([[5, 6, 7, 8, 9, 256, 258, 258], [5, 6, 7, 8, 9, 10, 11, 256]])
    prompt_len = torch.tensor([P, P])
    length = torch.tensor([6, 8])
    cfg = dict(objective="mdm", gen_length=G, block_size=64, mask_eps=1e-3, mdm_shift=False)
    meta = {"mask_id": 257, "eos_id": 256, "pad_id": 258}
    batch = train.make_batch(cfg, tokens, prompt_len, length, meta,
                             torch.Generator().manual_seed(0))
    canvas = P + MDMSettings(G).max_new_tokens                       # what generate_mdm feeds
    assert batch.idx.shape == (2, canvas) and batch.key_mask.all()   # every position attended
    laid_out = torch.tensor([[5, 6, 7, 8, 9] + [256] * 10, [5, 6, 7, 8, 9, 10, 11] + [256] * 8])
    masked = batch.idx == 257
    assert not masked[:, :P].any() and masked[:, 8:].any()   # the padding EOS are masked too
    assert torch.equal(batch.idx[~masked], laid_out[~masked])
    assert torch.equal(batch.labels[masked], laid_out[masked])
    assert (batch.labels[~masked] == data.IGNORE).all()
    # the batch's p_mask
    p = (1 - 1e-3) * torch.rand(2, generator=torch.Generator().manual_seed(0)) + 1e-3
    # the padding counts in the response length
    expected = torch.where(masked, 1 / (p[:, None] * G), 0.0)
    torch.testing.assert_close(batch.mdm_weight, expected, atol=1e-7, rtol=1e-6)


# SPEC 3, baselines: "With `mdm_shift` [...], the output at position `i` predicts token `i + 1`
# [...]: a masked token's label and weight sit at the position before it"; "Every sample needs
# a prompt of at least one token."
def test_the_shifted_mdm_moves_each_label_to_the_position_before_it():
    """mdm_shift (Dream): the masking draws of LLaDA's layout, each masked token's label and weight
    moved to the position before it; the MDM loss is, by hand, the sum over masked q of
    CE(logits at q - 1, token q) / (p * response length), over the samples; no AR part."""
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 258, 258]])
    prompt_len = torch.tensor([2, 1])
    length = torch.tensor([6, 4])
    llada = data.random_mask_batch(tokens, prompt_len, length, 257,
                                   torch.Generator().manual_seed(0))
    dream = data.random_mask_batch(tokens, prompt_len, length, 257,
                                   torch.Generator().manual_seed(0), shift=True)
    assert torch.equal(dream.idx, llada.idx) and torch.equal(dream.key_mask, llada.key_mask)
    p = (1 - 1e-3) * torch.rand(2, generator=torch.Generator().manual_seed(0)) + 1e-3
    logits = torch.randn(2, 6, 260, generator=torch.Generator().manual_seed(4))
    want = 0.0
    n_masked = 0
    for r in range(2):
        for q in range(int(prompt_len[r]), int(length[r])):
            if llada.idx[r, q] == 257:
                assert int(dream.labels[r, q - 1]) == int(tokens[r, q])
                ce = -torch.log_softmax(logits[r, q - 1], -1)[tokens[r, q]]
                want += ce / (p[r] * (length[r] - prompt_len[r]))
                n_masked += 1
    assert int((dream.labels != data.IGNORE).sum()) == n_masked == 5
    _, ar_loss, mdm_loss = hybrid_loss(logits, dream)
    assert ar_loss.item() == 0.0
    torch.testing.assert_close(mdm_loss, want / 2, atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="has no prompt.*give every sample a prompt"):
        data.random_mask_batch(tokens, torch.tensor([2, 0]), length, 257,
                               torch.Generator().manual_seed(0), shift=True)


# ----------------------------------------------------------------------------------------------
# sampler.py: plan, verify, infill, commit on an oracle whose logits put all mass on a known target
# (SPEC section 4)

class OracleModel(nn.Module):
    """Knows the target token at every position. A mask token predicts its own position's target,
    a clean token the next position's (what a trained ReFusion model does)."""

    def __init__(self, target, vocab_size, mask_id, confident=True):
        super().__init__()
        self.target = target
        self.vocab_size = vocab_size
        self.mask_id = mask_id
        self.confident = confident
        self.config = SimpleNamespace(block_size=len(target) + 1, causal=True)
        self.device_of = nn.Parameter(torch.zeros(0))  # no weights, but a device

    def new_kv_cache(self, max_len, max_batch=1):
        return KVCache(0, 1, 2, max_len, max_batch)

    def target_at(self, positions):
        """The target token at each position (past the target: its last token)."""
        last = len(self.target) - 1
        return self.target[positions.clamp(max=last)]

    def forward(self, idx, position_ids, kv_cache=None, attn_mask=None, logits_from=0):
        want = self.target_at(position_ids + (idx != self.mask_id).long())
        logits = torch.zeros(*idx.shape, self.vocab_size)
        if self.confident:
            logits.scatter_(-1, want[..., None], 100.0)
        if kv_cache is not None:
            kv_cache.advance(idx.shape[1])
        return logits[:, logits_from:]


# the oracles' mask id, EOS and vocabulary
MASK = 30
EOS = 31
V = 32


def oracle_target(prompt_len, gen_len, eos_at=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 30, (prompt_len + gen_len + 1,), generator=g)
    if eos_at is not None:
        target[prompt_len + eos_at] = EOS
    return target


class BadDrafterOracle(OracleModel):
    """An oracle whose clean tokens predict the next target token, but whose mask tokens at the
    positions in `bad` (default: all) confidently predict a wrong one (target + 1): a model whose
    masked-diffusion pathway is untrained. `fed` keeps the tokens of every call."""

    def __init__(self, target, vocab_size, mask_id, bad=None):
        super().__init__(target, vocab_size, mask_id)
        self.bad = bad
        self.fed = []

    def forward(self, idx, position_ids, kv_cache=None, attn_mask=None, logits_from=0):
        self.fed.append(idx.clone())
        logits = super().forward(idx, position_ids, kv_cache)
        wrong = (self.target_at(position_ids) + 1) % 30
        bad = idx == self.mask_id
        if self.bad is not None:
            bad &= torch.isin(position_ids, torch.tensor(self.bad))
        return torch.where(bad[..., None], F.one_hot(wrong, self.vocab_size) * 100.0,
                           logits)[:, logits_from:]


# SPEC 4, step 1: "if none does, select the single best slot, and among equal best scores the
# first in position order (`torch.argmax` takes the first maximum)."
def test_a_tie_for_the_best_slot_goes_to_the_leftmost():
    """Equal scores decode a serial block left to right, one slot per plan step."""
    P = 4
    L = 16
    S = 4
    target = oracle_target(P, L, seed=2)
    model = OracleModel(target, V, MASK, confident=False)      # every slot's score is 1/V
    out = generate_refusion(model, target[:P].tolist(), RefusionSettings(L, slot_size=S),
                            mask_id=MASK, eos_ids=(EOS,))
    assert [min(p for p, _ in step) for step in out.trace] == [P + i * S for i in range(L // S)]


# SPEC 4, step 1: "Select every slot whose score exceeds `slot_threshold`; if none does, select
# the single best slot"; step 3: "Iterate at most `S` times until every slot is complete".
def test_unconfident_model_still_finishes_one_slot_per_plan_step():
    P = 4
    L = 16
    S = 4
    target = oracle_target(P, L, seed=2)
    model = OracleModel(target, V, MASK, confident=False)  # uniform logits: every probability 1/V
    out = generate_refusion(model, target[:P].tolist(), RefusionSettings(L, slot_size=S),
                            mask_id=MASK, eos_ids=(EOS,))
    assert len(out.tokens) == L and len(out.trace) == L // S
    assert all(len(step) == S for step in out.trace)
    # one plan and one verify per slot, then S - 1 infill iterations of draft + verify
    assert out.nfe == (L // S) * (2 + 2 * (S - 1))


# SPEC 4, step 2: "Else if the prefix covers one or more whole slots: commit those slots, keep
# the KV this pass computed for them, and go back to step 1".
@pytest.mark.parametrize("slot_size,serial_num_blocks", [(4, 1), (4, 3), (8, 3), (6, 2), (1, 4)])
def test_oracle_decode_reproduces_target_in_few_forwards(slot_size, serial_num_blocks):
    P = 5
    L = 24
    target = oracle_target(P, L)
    settings = RefusionSettings(L, slot_size=slot_size, serial_num_blocks=serial_num_blocks)
    out = generate_refusion(OracleModel(target, V, MASK), target[:P].tolist(), settings,
                            mask_id=MASK, eos_ids=(EOS,))
    assert out.tokens == target[P:P + L].tolist()
    assert out.nfe == 2 * serial_num_blocks  # a block: a plan picks every slot, a verify takes all
    assert out.tpf > 1
    positions = [p for step in out.trace for p, _ in step]
    assert sorted(positions) == list(range(P, P + L))    # every position filled exactly once


# SPEC 4, step 2: "If that prefix contains EOS: commit the slots up to the one holding the
# first EOS (that slot only up to and including EOS) [...] and no later serial block is
# started."
@pytest.mark.parametrize("eos_at", [0, 5, 13, 23])
def test_oracle_decode_cuts_at_eos(eos_at):
    P = 3
    L = 24
    target = oracle_target(P, L, eos_at=eos_at, seed=1)
    settings = RefusionSettings(L, slot_size=4, serial_num_blocks=2)
    out = generate_refusion(OracleModel(target, V, MASK), target[:P].tolist(), settings,
                            mask_id=MASK, eos_ids=(EOS,))
    assert out.tokens == target[P:P + eos_at + 1].tolist()
    positions = sorted(p for step in out.trace for p, _ in step)
    assert positions == list(range(P, P + eos_at + 1))


# SPEC 4, step 3: "Give each selected slot its own batch row sharing the cached prefix [...]
# Iterate at most `S` times until every slot is complete"; step 3c: "keep only the slots up to
# and including that one".
@pytest.mark.parametrize("eos_at", [None, 6, 9, 15])
def test_parallel_infill_fills_every_selected_slot(eos_at):
    """slot_threshold 0 selects every slot and token_threshold > 1 accepts only forced tokens, so
    all slots of the block are infilled side by side, one token per row per iteration."""
    P = 5
    L = 16
    S = 4
    target = oracle_target(P, L, eos_at=eos_at, seed=3)
    settings = RefusionSettings(L, slot_size=S, slot_threshold=0.0, token_threshold=1.5)
    out = generate_refusion(OracleModel(target, V, MASK), target[:P].tolist(), settings,
                            mask_id=MASK, eos_ids=(EOS,))
    end = L if eos_at is None else eos_at + 1
    assert out.tokens == target[P:P + end].tolist()
    assert len(out.trace) == 1                       # one plan step commits every slot (up to EOS)
    if eos_at is None:
        assert out.nfe == 2 + 2 * (S - 1)            # plan + verify, then S - 1 draft/verify pairs


# ----------------------------------------------------------------------------------------------
# kvcache.py: the cache operations of steps 3 and 4 (SPEC section 4)

# SPEC 4, step 3: "Give each selected slot its own batch row sharing the cached prefix (the KV
# computed in step 2 is dropped)."
@torch.no_grad()
def test_cached_decode_after_crop_and_repeated_rows():
    model = tiny_model(seed=1)
    prefix = torch.randint(0, 40, (1, 9))
    a = torch.randint(0, 40, (1, 5))
    b = torch.randint(0, 40, (1, 5))
    cache = model.new_kv_cache(max_len=32, max_batch=3)
    model(prefix, torch.arange(9)[None], cache)
    model(torch.randint(0, 40, (1, 4)), torch.arange(9, 13)[None], cache)  # a detour, cropped away
    cache.crop(9)
    cache.repeat_prefix(2)
    pos = torch.arange(9, 14).expand(2, 5)
    out = model(torch.cat([a, b]), pos, cache)                         # (2, 5, V), one row each
    for row, cont in enumerate([a, b]):
        full = model(torch.cat([prefix, cont], 1), torch.arange(14)[None])[:, 9:]
        torch.testing.assert_close(out[row:row + 1], full, atol=TOL, rtol=0)


# SPEC 4, step 4: "append their KV (each slot's KV was computed seeing the shared prefix plus
# itself) to the cache, in slot order."
def test_commit_rows_lays_segments_in_the_given_order():
    cache = KVCache(n_layer=1, n_kv_head=1, head_dim=1, max_len=8, max_batch=3)
    cache.length = 5
    cache.repeat_prefix(3)                                  # three rows of 5 tokens each
    # row r, token t -> 8r + t
    cache.kv[0, 0, :, 0, :, 0] = torch.arange(3 * 8, dtype=torch.float32).view(3, 8)
    cache.commit_rows([(2, 2), (0, 3), (1, 1)], start=2)
    assert (cache.batch, cache.length) == (1, 8)
    assert cache.kv[0, 0, 0, 0, :, 0].tolist() == [0, 1, 18, 19, 2, 3, 4, 10]


# ----------------------------------------------------------------------------------------------
# sampler.py against a naive reference decoder that recomputes the whole buffer for every prediction

@torch.no_grad()
def naive_one_slot_decode(model, prompt, gen_len, slot_size, serial_num_blocks, accept_all, eos_id,
                          mask_id):
    """SPEC section 4 in the regime slot_threshold > 1 (one slot per plan step), without a cache.
    accept_all: token_threshold 0 (the plan's drafts are committed whole), else token_threshold > 1
    (each later token is drafted from the accepted prefix and forced in, one at a time).
    Returns (response tokens, the NFE the algorithm implies)."""
    toks = list(prompt)
    poss = list(range(len(prompt)))
    response = {}
    nfe = 0

    def logits_after(extra_toks, extra_pos):
        logits = model(torch.tensor([toks + extra_toks]), torch.tensor([poss + extra_pos]))
        return logits[0, len(toks):]

    def pick(probs):                                                  # the mask id is never drafted
        return probs.clone().index_fill_(-1, torch.tensor([mask_id]), -1.0).argmax(-1)

    n_block = gen_len // slot_size // serial_num_blocks
    for b in range(serial_num_blocks):
        pool = [len(prompt) + (b * n_block + i) * slot_size for i in range(n_block)]
        stop = False
        while pool:
            pos = [p + i for p in pool for i in range(slot_size)]
            probs = torch.softmax(logits_after([mask_id] * len(pos), pos), -1)
            probs = probs.view(len(pool), slot_size, -1)
            drafts = pick(probs)
            # the raw probability of each first draft
            first = probs[:, 0].gather(-1, drafts[:, :1])[:, 0]
            best = int(first.argmax())
            start = pool[best]
            nfe += 2                                                # a plan and a verify
            if accept_all:
                slot = drafts[best].tolist()
            else:
                slot = [int(drafts[best, 0])]
                while len(slot) < slot_size and eos_id not in slot:
                    j = len(slot)
                    fed = slot + [mask_id] * (slot_size - j)
                    at = list(range(start, start + slot_size))
                    slot.append(int(pick(logits_after(fed, at)[j])))
                    nfe += 2
            if eos_id in slot:
                slot = slot[:slot.index(eos_id) + 1]
                pool = [p for p in pool if p < start]
                stop = True
            else:
                pool.remove(start)
            toks += slot
            poss += list(range(start, start + len(slot)))
            response.update({start + i: t for i, t in enumerate(slot)})
        if stop:
            break
    out = [response[p] for p in sorted(response)]
    if eos_id in out:
        out = out[:out.index(eos_id) + 1]
    return out, nfe


# SPEC 4: "a re-run with plain causal attention matches it only while every commit is a single
# slot or comes from step 2" (slot_threshold > 1: one slot per plan step).
@pytest.mark.parametrize("accept_all", [False, True],
                         ids=["token_threshold_above_1", "token_threshold_0"])
@pytest.mark.parametrize("seed,slot_size,serial_num_blocks",
                         [(0, 4, 1), (1, 4, 2), (2, 8, 1), (3, 2, 3)])
def test_decode_matches_naive_reference_with_one_slot_per_step(accept_all, seed, slot_size,
                                                               serial_num_blocks):
    model = tiny_model(seed=seed)
    prompt = torch.randint(0, 36, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
    gen_len = 24
    settings = RefusionSettings(gen_len, slot_size=slot_size, serial_num_blocks=serial_num_blocks,
                                slot_threshold=1.5, token_threshold=0.0 if accept_all else 1.5)
    # once with an EOS the model never emits, once with one it emits mid-way
    naive = partial(naive_one_slot_decode, model, prompt, gen_len, slot_size, serial_num_blocks,
                    accept_all)
    ref, _ = naive(-1, 38)
    for eos in (-1, ref[len(ref) // 2]):
        ref, ref_nfe = naive(eos, 38)
        out = generate_refusion(model, prompt, settings, mask_id=38, eos_ids=(eos,))
        assert out.tokens == ref
        assert out.nfe == ref_nfe


# ----------------------------------------------------------------------------------------------
# sampler.py: the decoder on one screen (no cache) and the cached decoder are one algorithm

class PassRecorder(nn.Module):
    """Passes every call on to `model` and keeps a copy of the tokens each pass feeds, `fed`
    (R, T), and of the logits of every one of them, `passes` (R, T, V); those the decoder asked
    for (logits_from on) are returned."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.config = model.config
        self.fed = []
        self.passes = []

    def new_kv_cache(self, max_len, max_batch=1):
        return self.model.new_kv_cache(max_len, max_batch)

    def forward(self, idx, position_ids, kv_cache=None, attn_mask=None, logits_from=0):
        logits = self.model(idx, position_ids, kv_cache=kv_cache, attn_mask=attn_mask)
        self.fed.append(idx.clone())
        self.passes.append(logits.clone())
        return logits[:, logits_from:]


def assert_plain_equals_cached(model, prompt, settings, generator_seed=None, **ids):
    """Decode with generate_refusion_plain and generate_refusion: the same tokens, trace and NFE,
    and every forward pass gives the same logits for the tokens it adds (so each committed token
    was shown, without a cache, exactly what it saw with one). Returns the cached Generation."""
    plain = PassRecorder(model)
    cached = PassRecorder(model)

    def seeded():
        """A fresh generator of the seed for each decoder (none at greedy decoding)."""
        if generator_seed is None:
            return {}
        return {"generator": torch.Generator().manual_seed(generator_seed)}

    a = generate_refusion_plain(plain, prompt, settings, **ids, **seeded())
    b = generate_refusion(cached, prompt, settings, **ids, **seeded())
    assert (a.tokens, a.trace, a.nfe) == (b.tokens, b.trace, b.nfe)
    assert len(plain.passes) == len(cached.passes) == b.nfe
    for p, c in zip(plain.passes, cached.passes):
        torch.testing.assert_close(p[:, -c.shape[1]:], c, atol=TOL, rtol=0)
    return b


# SPEC 4: "A decoder without a cache matches this one exactly when each forward pass re-runs the
# buffer showing every committed token only what it saw when it was committed (an attention
# mask: `generate_refusion_plain`, tested pass for pass)".
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("slot_size,serial_num_blocks,slot_threshold,token_threshold", [
    (4, 3, 0.0, 1.5),   # every slot of a serial block infilled side by side, seen by the next
    (4, 2, 0.0, 0.6),   # infill rows finished at different rounds
    (2, 3, 0.5, 0.1),
    (8, 1, 0.9, 0.3),   # the paper's thresholds
    (4, 1, 0.5, 0.0),   # verify commits whole slots
    (1, 2, 0.5, 0.1)])
def test_plain_decoder_is_the_cached_decoder_pass_for_pass(
        seed, slot_size, serial_num_blocks, slot_threshold, token_threshold):
    model = tiny_model(seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)      # confident enough that drafts pass the thresholds
    prompt = torch.randint(0, 36, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
    settings = RefusionSettings(24, slot_size=slot_size, serial_num_blocks=serial_num_blocks,
                                slot_threshold=slot_threshold, token_threshold=token_threshold)
    free = assert_plain_equals_cached(model, prompt, settings, mask_id=38, eos_ids=(-1,))
    # an EOS the model writes mid-way, then sampled plan drafts (Gumbel-max, one generator each)
    assert_plain_equals_cached(model, prompt, settings, mask_id=38, eos_ids=(free.tokens[9],))
    sampled = RefusionSettings(24, slot_size=slot_size, serial_num_blocks=serial_num_blocks,
                               slot_threshold=slot_threshold, token_threshold=token_threshold,
                               temperature=1.0)
    assert_plain_equals_cached(model, prompt, sampled, generator_seed=seed, mask_id=38,
                               eos_ids=(-1,))


# SPEC 4: "A decoder without a cache matches this one exactly" (`generate_refusion_plain`), on
# oracles that meet EOS in verify (step 2) and in infill (step 3c).
@pytest.mark.parametrize("eos_at", [None, 0, 5, 13, 23])
def test_plain_decoder_is_the_cached_decoder_on_oracles(eos_at):
    """Confident, unsure and wrong-drafting oracles: EOS met in verify and in infill."""
    P = 5
    L = 24
    target = oracle_target(P, L, eos_at=eos_at, seed=7)
    models = [OracleModel(target, V, MASK), OracleModel(target, V, MASK, confident=False),
              BadDrafterOracle(target, V, MASK), BadDrafterOracle(target, V, MASK, bad=[6, 7, 12])]
    for model in models:
        for S, blocks, slot_thr, token_thr in [(4, 1, 0.9, 0.3), (4, 3, 0.0, 1.5), (8, 3, 0.0, 0.5),
                                               (6, 2, 0.5, 0.0), (1, 4, 0.9, 0.3)]:
            settings = RefusionSettings(L, slot_size=S, serial_num_blocks=blocks,
                                        slot_threshold=slot_thr, token_threshold=token_thr)
            out = assert_plain_equals_cached(model, target[:P].tolist(), settings, mask_id=MASK,
                                             eos_ids=(EOS,))
            if model is models[0]:
                assert out.tokens == target[P:P + (L if eos_at is None else eos_at + 1)].tolist()


# ----------------------------------------------------------------------------------------------
# sampler.py: the baselines' defining properties (SPEC section 4, "Baseline decoders")

@torch.no_grad()
def naive_next_token_decode(model, prompt, max_new_tokens, eos_id, temperature, generator):
    """Next-token decoding without a cache: the whole sequence is recomputed for every new token."""
    toks = list(prompt)
    while len(toks) - len(prompt) < max_new_tokens and eos_id not in toks[len(prompt):]:
        logits = model(torch.tensor([toks]), torch.arange(len(toks))[None])[0, -1:]
        toks.append(int(draft_tokens(logits, temperature, generator)[0][0]))
    return toks[len(prompt):]


# SPEC 4, baselines: "`next_token`: greedy or sampled next-token decoding with the KV cache
# (one forward per token)"; statistics: "NFE: every call counts once, the prompt prefill
# included".
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_next_token_decode_with_cache_matches_no_cache_reference(temperature):
    model = tiny_model(seed=4)
    prompt = torch.randint(0, 36, (7,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = naive_next_token_decode(model, prompt, 20, -1, temperature,
                                  torch.Generator().manual_seed(0))
    for eos in (-1, ref[len(ref) // 2]):  # an EOS the model never emits, then one it emits mid-way
        ref = naive_next_token_decode(model, prompt, 20, eos, temperature,
                                      torch.Generator().manual_seed(0))
        out = generate_next_token(model, prompt, DecodeSettings(20, temperature=temperature),
                                  eos_ids=(eos,), generator=torch.Generator().manual_seed(0))
        assert out.tokens == ref and len(ref) == (20 if eos == -1 else ref.index(eos) + 1)
        # the prefill predicts the first token, then one forward per further token: TPF is exactly 1
        assert out.nfe == len(out.tokens)


def mdm_order(confidence, block_length=None, shift=False):
    """A tiny bidirectional model's MDM decode, one token per step: (the recording model, prompt,
    its Generation)."""
    P = 5
    L = 12
    M = 38
    model = PassRecorder(tiny_model(seed=5, causal=False))
    prompt = torch.randint(0, 36, (P,), generator=torch.Generator().manual_seed(5)).tolist()
    out = generate_mdm(model, prompt, MDMSettings(L, steps=L, block_length=block_length,
                                                  mdm_shift=shift, confidence=confidence),
                       mask_id=M, eos_ids=(-1,))
    return model, prompt, out


# SPEC 4, baselines: "low-confidence remasking (commit the most confident masked positions each
# step)"; "A shifted MDM [...] reads position `p`'s draft from the logits at `p - 1`"; Dream's
# rules `margin` and `entropy`, "both from the raw softmax".
@pytest.mark.parametrize("confidence", ["prob", "margin", "entropy"])
@pytest.mark.parametrize("shift", [False, True], ids=["llada", "dream"])
@pytest.mark.parametrize("block_length", [None, 4])
def test_mdm_commits_the_most_confident_token_each_step_and_never_changes_it(block_length, shift,
                                                                            confidence):
    """Low-confidence remasking, by LLaDA's rule (the drafted token's probability) or Dream's
    (margin, entropy); a shifted MDM (Dream) reads position p's draft from the logits at p - 1."""
    P = 5
    L = 12
    M = 38
    model, prompt, out = mdm_order(confidence, block_length, shift)
    assert out.nfe == len(model.passes) == L and len(out.tokens) == L
    block = block_length or L
    inputs = [idx[0] for idx in model.fed] + [torch.tensor(prompt + out.tokens)]
    for step, (before, after) in enumerate(zip(inputs, inputs[1:])):
        known = before != M
        assert before[:P].tolist() == prompt and int(known.sum()) == P + step  # one more per call
        assert torch.equal(after[known], before[known])                        # committed: final
        new = ((after != M) & ~known).nonzero()[:, 0].tolist()
        # low-confidence remasking: the new token is the most probable masked one of the block
        logits = model.passes[step][0].roll(int(shift), 0)  # row p: the logits read for p
        probs = torch.softmax(logits.double(), -1)          # raw: the mask id's share included
        top2, ids = probs.clone().index_fill(1, torch.tensor([M]), -1.0).topk(2, -1)
        token = ids[:, 0]                                   # the draft: never the mask id
        score = {"prob": top2[:, 0], "margin": top2[:, 0] - top2[:, 1],
                 "entropy": (probs * probs.log()).sum(-1)}[confidence]
        start = P + step // block * block  # one token per step: block b owns steps b * block ...
        candidates = [p for p in range(start, start + block) if before[p] == M]
        best = max(candidates, key=lambda p: float(score[p]))
        assert new == [best] and int(after[best]) == int(token[best])
        assert out.trace[step] == [(best, int(token[best]))]


# SPEC 4, baselines: "Opt-in, Dream's confidence rules (`confidence`; default `prob`, [...]):
# `margin`, [...] and `entropy`": three rules, three orders.
def test_dreams_confidence_rules_change_the_order_the_mdm_commits_in():
    """The model of the test above commits its masks in another order under each rule, so that
    test tells the rules apart."""
    orders = {rule: [s[0][0] for s in mdm_order(rule)[2].trace]
              for rule in ("prob", "margin", "entropy")}
    assert len({tuple(o) for o in orders.values()}) == 3


# SPEC 4, baselines: "`mdm`: [...] `steps` steps, [...] optional semi-autoregressive blocks";
# SPEC 1: a semi-autoregressive block is "the MDM baseline's `block_length` positions,
# denoised left to right".
def test_mdm_schedule_spreads_each_blocks_tokens_evenly_over_its_steps():
    assert tokens_per_step(10, 4) == [3, 3, 2, 2]
    model = tiny_model(seed=6, causal=False)
    P = 4
    prompt = list(range(P))
    for L, steps, block_length, per_step in [(12, 4, None, [3, 3, 3, 3]),
                                             (10, 4, None, [3, 3, 2, 2]),
                                             (12, 6, 6, [2, 2, 2, 2, 2, 2]),
                                             (12, 4, 3, [3, 3, 3, 3])]:
        settings = MDMSettings(L, steps=steps, block_length=block_length)
        out = generate_mdm(model, prompt, settings, mask_id=38, eos_ids=(-1,))
        assert [len(s) for s in out.trace] == per_step and out.nfe == steps and len(out.tokens) == L
        block = block_length or L
        n_blocks = L // block
        for b in range(n_blocks):                # block b is filled by its own steps, left to right
            own = out.trace[b * steps // n_blocks:(b + 1) * steps // n_blocks]
            filled = sorted(p for s in own for p, _ in s)
            assert filled == list(range(P + b * block, P + (b + 1) * block))


# ----------------------------------------------------------------------------------------------
# sampler.py, infill="speculative" (SPEC section 4.1, beyond the paper): the next-token pathway
# forces the tokens

# SPEC 4.1: `infill="speculative"` "changes three things and nothing else (no extra forward
# pass)".
@pytest.mark.parametrize("slot_size,serial_num_blocks", [(4, 1), (8, 3), (6, 2), (1, 4)])
def test_speculative_infill_matches_the_paper_on_a_confident_oracle(slot_size, serial_num_blocks):
    """Where both pathways agree, the variant changes nothing: the same tokens in the same NFE."""
    P = 5
    L = 24
    for eos_at in (None, 13):
        target = oracle_target(P, L, eos_at=eos_at)
        runs = [generate_refusion(OracleModel(target, V, MASK), target[:P].tolist(),
                                  RefusionSettings(L, slot_size=slot_size,
                                                   serial_num_blocks=serial_num_blocks,
                                                   infill=infill),
                                  mask_id=MASK, eos_ids=(EOS,))
                for infill in ("paper", "speculative")]
        end = P + L if eos_at is None else P + eos_at + 1
        assert runs[0].tokens == runs[1].tokens == target[P:end].tolist()
        assert runs[0].nfe == runs[1].nfe


# SPEC 4.1, infill (step 3a): "the first unaccepted token of every row is taken from the
# next-token prediction at its left neighbour [...] instead of the prediction at its own
# mask"; the frontier slot (step 1) takes "the next-token prediction its last token made".
@pytest.mark.parametrize("serial_num_blocks", [1, 4])
def test_speculative_infill_keeps_the_next_token_pathway_where_the_paper_forces_bad_drafts(
        serial_num_blocks):
    """slot_threshold 0 plans every slot of a block at once; the drafter is always wrong, so each
    infill round accepts only its forced token. The paper forces the wrong masked drafts; the
    variant forces next-token predictions, so only the first token of a slot that did not start at
    the frontier (drafted from masks) is wrong. With one slot per block everything is right."""
    P = 5
    L = 16
    S = 4
    target = oracle_target(P, L, seed=5)
    settings = dict(slot_size=S, serial_num_blocks=serial_num_blocks, slot_threshold=0.0,
                    token_threshold=0.5)
    runs = {infill: generate_refusion(BadDrafterOracle(target, V, MASK), target[:P].tolist(),
                                      RefusionSettings(L, infill=infill, **settings),
                                      mask_id=MASK, eos_ids=(EOS,))
            for infill in ("paper", "speculative")}
    paper = runs["paper"]
    speculative = runs["speculative"]
    wrong = ((target + 1) % 30)[P:P + L].tolist()
    assert paper.tokens == wrong
    expected = target[P:P + L].tolist()
    slots_per_serial_block = L // S // serial_num_blocks
    for i in range(L // S):
        if i % slots_per_serial_block:              # planned together with a slot to its left
            expected[i * S] = wrong[i * S]
    assert speculative.tokens == expected
    # per block: plan, verify, then S - 1 rounds of draft + verify, one forced token per row each
    assert paper.nfe == speculative.nfe == serial_num_blocks * (2 + 2 * (S - 1))


# SPEC 4.1, rows after the first (step 3): "every row but the first starts from its first token
# alone."
def test_speculative_infill_restarts_later_rows_from_their_first_token():
    """Verify judges a later slot's tokens after the drafts of the slots before it; the variant
    keeps only that slot's first token, so the rest is judged in the slot's own row. Slot 0's
    drafts after its first token are wrong (it is infilled); slots 1 and 2 pass verify whole."""
    P = 5
    L = 12
    S = 4
    target = oracle_target(P, L, seed=6)
    wrong = target.clone()
    wrong[P + 1:P + S] = (target[P + 1:P + S] + 1) % 30        # what the paper forces into slot 0
    for infill, row, expected in (("paper", target[P + S:P + 2 * S].tolist(), wrong),
                                  ("speculative", [int(target[P + S])] + [MASK] * 3, target)):
        model = BadDrafterOracle(target, V, MASK, bad=list(range(P + 1, P + S)))
        settings = RefusionSettings(L, slot_size=S, slot_threshold=0.0, token_threshold=0.5,
                                    infill=infill)
        out = generate_refusion(model, target[:P].tolist(), settings, mask_id=MASK, eos_ids=(EOS,))
        first_draft_pass = model.fed[2]          # after plan and verify: 3 rows, one per slot
        assert first_draft_pass.shape == (3, S) and first_draft_pass[1].tolist() == row
        assert out.tokens == expected[P:P + L].tolist()


@torch.no_grad()
def naive_speculative_infill_of_one_block(model, prompt, gen_len, slot_size, eos_id, mask_id):
    """SPEC 4.1 without a cache, in the regime slot_threshold 0 (every slot planned at once),
    token_threshold > 1 (only forced tokens) and one serial block: slot 0 starts with what the last
    prompt token predicts, every other slot with its planned (masked) draft; then each slot is
    continued by next-token predictions given the prompt and its own tokens. The first slot holding
    an EOS ends there and drops the slots after it. Returns (tokens, the NFE the algorithm
    implies)."""
    def best(logits):                                         # the mask id is never drafted
        return int(logits.index_fill(-1, torch.tensor([mask_id]), -math.inf).argmax())

    def predict(toks, poss):
        return best(model(torch.tensor([toks]), torch.tensor([poss]))[0, -1])

    P = len(prompt)
    n = gen_len // slot_size
    positions = list(range(P, P + gen_len))
    plan = model(torch.tensor([prompt + [mask_id] * gen_len]),
                 torch.tensor([list(range(P)) + positions]))[0, P:]
    slots = []
    for i in range(n):
        start = P + i * slot_size
        if i == 0:
            slot = [predict(prompt, list(range(P)))]
        else:
            slot = [best(plan[i * slot_size])]
        while len(slot) < slot_size and eos_id not in slot:
            at = list(range(P)) + list(range(start, start + len(slot)))
            slot.append(predict(prompt + slot, at))
        slots.append(slot)
        if eos_id in slot:
            slots[-1] = slot[:slot.index(eos_id) + 1]
            break
    rounds = max(len(slot) for slot in slots) - 1
    return [t for slot in slots for t in slot], 2 + 2 * rounds


# SPEC 4.1, infill (step 3a): "each round keeps in the cache one token less than the paper [...]
# The forced token is fed as the real token in 3b, so its keys/values are computed from it,
# never from the draft it replaced."
@pytest.mark.parametrize("seed,slot_size", [(0, 4), (1, 8), (2, 6)])
def test_speculative_infill_of_parallel_rows_matches_naive_reference(seed, slot_size):
    """Several rows infilled side by side: each row sees the prompt and itself only, and its keys
    and values are recomputed where a forced token replaced a draft (checked by the exact
    tokens)."""
    model = tiny_model(seed=seed)
    prompt = torch.randint(0, 36, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
    L = 24
    ref, _ = naive_speculative_infill_of_one_block(model, prompt, L, slot_size, -1, 38)
    for eos in (-1, ref[len(ref) // 2 + 1]):
        ref, ref_nfe = naive_speculative_infill_of_one_block(model, prompt, L, slot_size, eos, 38)
        settings = RefusionSettings(L, slot_size=slot_size, slot_threshold=0.0, token_threshold=1.5,
                                    infill="speculative")
        out = generate_refusion(model, prompt, settings, mask_id=38, eos_ids=(eos,))
        assert out.tokens == ref
        assert out.nfe == ref_nfe


# SPEC 4.1, guarantee: "With one slot per serial block (`serial_num_blocks = L / S`) the
# response is then exactly greedy next-token decoding of the same model".
@pytest.mark.parametrize("seed,slot_size", [(0, 4), (1, 8), (2, 3), (3, 1)])
def test_speculative_infill_with_one_slot_per_block_equals_next_token_decoding(seed, slot_size):
    """At greedy decoding, with a token threshold only the argmax can pass (0.5): next-token
    decoding, whatever the model's drafts."""
    model = tiny_model(seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)      # confident enough that some drafts pass 0.5
    prompt = torch.randint(0, 36, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
    L = 24
    ref = generate_next_token(model, prompt, DecodeSettings(L), eos_ids=(-1,)).tokens
    for eos in (-1, ref[len(ref) // 2]):
        ref = generate_next_token(model, prompt, DecodeSettings(L), eos_ids=(eos,)).tokens
        settings = RefusionSettings(L, slot_size=slot_size, serial_num_blocks=L // slot_size,
                                    token_threshold=0.5, infill="speculative")
        out = generate_refusion(model, prompt, settings, mask_id=38, eos_ids=(eos,))
        assert out.tokens == ref


# ----------------------------------------------------------------------------------------------
# sampler.py, verify="exact" (SPEC section 4.5, beyond the paper): next-token decoding's tokens,
# several a pass


def greedy_gap(model, prompt, tokens):
    """The gap between the two best next-token logits after prompt + tokens (a full pass)."""
    idx = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(idx, torch.arange(idx.shape[1])[None], logits_from=-1)[0, 0]
    best = logits.topk(2).values
    return float(best[0] - best[1])


def assert_same_or_tie(model, prompt, out, ref):
    """out's tokens are ref's (next-token decoding's), or differ first where the two best logits
    tie within float rounding (a gap under TOL), which is named."""
    differ = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), None)
    if differ is None:
        assert out == ref
        return
    gap = greedy_gap(model, prompt, ref[:differ])
    assert gap < TOL, f"token {differ} differs with a top-2 gap of {gap}: no tie"


# SPEC 4.5, guarantee: "at temperature 0 the tokens equal `generate_next_token`'s; where the float
# rounding of a wide pass against a one-token pass flips an argmax, the test names the tie".
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_verify_gives_next_token_decodings_tokens_at_every_slot_size(seed):
    """Random models (confident enough that drafts are accepted), every slot size from 1 to 32,
    an EOS that never comes and one forced early, and a prompt at the context's edge."""
    model = tiny_model(seed=seed, block_size=64)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    rng = torch.Generator().manual_seed(seed)
    L = 20
    for prompt_len in (5, 64 - L):
        prompt = torch.randint(0, 38, (prompt_len,), generator=rng).tolist()
        free = generate_next_token(model, prompt, DecodeSettings(L), eos_ids=(-1,)).tokens
        for eos in (-1, free[L // 3]):
            ref = generate_next_token(model, prompt, DecodeSettings(L), eos_ids=(eos,))
            for slot_size in range(1, 33):
                settings = RefusionSettings(L, slot_size=slot_size, verify="exact")
                out = generate_exact(model, prompt, settings, mask_id=38, eos_ids=(eos,))
                assert_same_or_tie(model, prompt, out.tokens, ref.tokens)


# SPEC 4.5: "a pass commits at least one token, as next-token decoding does, and at most
# `slot_size`"; "the prediction after the last accepted draft is committed too".
@pytest.mark.parametrize("slot_size", [1, 2, 5, 8])
def test_exact_verify_commits_one_to_slot_size_tokens_a_pass(slot_size):
    model = tiny_model(seed=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    prompt = list(range(3, 12))
    settings = RefusionSettings(30, slot_size=slot_size, verify="exact")
    out = generate_exact(model, prompt, settings, mask_id=38, eos_ids=(-1,))
    counts = [len(step) for step in out.trace]
    assert out.nfe == len(out.trace) == len(out.step_nfe) == sum(out.step_nfe)
    assert all(1 <= n <= slot_size for n in counts) and sum(counts) == len(out.tokens) == 30
    # the committed positions follow each other from the prompt's end
    assert [p for step in out.trace for p, _ in step] == list(range(9, 39))


# SPEC 4.5: "The decoder without a cache (`generate_exact_plain`) gives the same tokens, passes and
# trace as the cached one."
@pytest.mark.parametrize("seed,slot_size", [(0, 1), (1, 4), (2, 8), (3, 16)])
def test_exact_verify_without_a_cache_is_the_cached_decoder_pass_for_pass(seed, slot_size):
    model = tiny_model(seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    prompt = torch.randint(0, 38, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
    settings = RefusionSettings(24, slot_size=slot_size, verify="exact")
    ref = generate_next_token(model, prompt, DecodeSettings(24), eos_ids=(-1,)).tokens
    for eos in (-1, ref[10]):
        plain = generate_exact_plain(model, prompt, settings, mask_id=38, eos_ids=(eos,))
        cached = generate_exact(model, prompt, settings, mask_id=38, eos_ids=(eos,))
        assert (plain.tokens, plain.nfe, plain.trace) == (cached.tokens, cached.nfe, cached.trace)


# SPEC 4.5, draft: "The masks' tokens [...] are the next pass's drafts when every draft was
# accepted"; "a slot whose drafts are all accepted costs one" pass.
def test_exact_verify_writes_a_whole_slot_a_pass_when_the_masks_draft_right():
    """A model whose masked pathway predicts exactly what its next-token pathway will (a mask at
    position p returns the token the causal rule gives there): after the first pass, every pass
    commits slot_size tokens."""

    class Counting(nn.Module):
        """Token at position p is (p * 7) % 37 by both pathways: a clean token's logits
        predict position p + 1, a mask's its own position p."""

        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace(block_size=128, causal=True)
            self.inner = tiny_model()

        def new_kv_cache(self, max_len, max_batch=1):
            return self.inner.new_kv_cache(max_len, max_batch)

        def forward(self, idx, position_ids, kv_cache=None, attn_mask=None, logits_from=0):
            self.inner(idx, position_ids, kv_cache, attn_mask)   # the cache's bookkeeping
            target = torch.where(idx == 38, position_ids, position_ids + 1) * 7 % 37
            return F.one_hot(target, 40).float()[:, logits_from:] * 10

    model = Counting()
    prompt = [1, 2, 3]
    settings = RefusionSettings(40, slot_size=8, verify="exact")
    for decode in (generate_exact, generate_exact_plain):
        out = decode(model, prompt, settings, mask_id=38, eos_ids=(-1,))
        assert out.tokens == [p * 7 % 37 for p in range(3, 43)]
        # the prefill commits one token and drafts 7; then 8 a pass; the last pass what is left
        assert [len(step) for step in out.trace] == [1, 8, 8, 8, 8, 7]
