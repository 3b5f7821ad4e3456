"""
The specification, as tests. Each test names a property of ReFusion (SPEC.md) and checks it with
exact values or an equality between two code paths (float32, tolerance 1e-5).

Run: python -m pytest -q test_refusion.py
"""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from kvcache import KVCache
from model import ModelConfig, Transformer
from sampler import generate_refusion

TOL = 1e-5


def tiny_model(seed=0, causal=True, **overrides):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=40, block_size=128, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, causal=causal)
    cfg.update(overrides)
    return Transformer(ModelConfig(**cfg)).eval()


# ----------------------------------------------------------------------------------------------
# model.py + kvcache.py: cached attention is exact, and the cache is order-invariant (SPEC section 2)

@torch.no_grad()
def test_cached_decode_matches_full_forward():
    model = tiny_model()
    idx = torch.randint(0, 40, (1, 20))
    pos = torch.arange(20)[None]
    full = model(idx, pos)
    cache = model.new_kv_cache(max_len=20)
    parts = [model(idx[:, a:b], pos[:, a:b], cache) for a, b in [(0, 7), (7, 8), (8, 9), (9, 14), (14, 20)]]
    assert cache.pos == 20
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=TOL, rtol=0)


@torch.no_grad()
def test_cached_decode_after_crop_and_repeated_rows():
    model = tiny_model(seed=1)
    prefix, a, b = torch.randint(0, 40, (1, 9)), torch.randint(0, 40, (1, 5)), torch.randint(0, 40, (1, 5))
    cache = model.new_kv_cache(max_len=32, max_batch=3)
    model(prefix, torch.arange(9)[None], cache)
    model(torch.randint(0, 40, (1, 4)), torch.arange(9, 13)[None], cache)   # a detour, then cropped away
    cache.crop(9)
    cache.repeat_prefix(2)
    pos = torch.arange(9, 14).expand(2, 5)
    out = model(torch.cat([a, b]), pos, cache)                                 # (2, 5, V), one row each
    for row, cont in enumerate([a, b]):
        full = model(torch.cat([prefix, cont], 1), torch.arange(14)[None])[:, 9:]
        torch.testing.assert_close(out[row:row + 1], full, atol=TOL, rtol=0)


@torch.no_grad()
def test_cache_is_order_invariant_for_independent_blocks():
    """Two blocks of KV computed independently after the same prefix, appended in either order,
    give the same logits for a later token: attention does not care where a key sits."""
    model = tiny_model(seed=2)
    prefix = torch.randint(0, 40, (1, 6))
    blocks = {4: torch.randint(0, 40, (1, 4)), 10: torch.randint(0, 40, (1, 4))}  # start position -> tokens
    nxt, nxt_pos = torch.randint(0, 40, (1, 1)), torch.tensor([[14]])
    outs = []
    for order in ([4, 10], [10, 4]):
        cache = model.new_kv_cache(max_len=32, max_batch=2)
        model(prefix, torch.tensor([[0, 1, 2, 3, 14 + 1, 14 + 2]]), cache)
        cache.repeat_prefix(2)
        starts = order
        toks = torch.cat([blocks[s] for s in starts])
        model(toks, torch.tensor([[s + i for i in range(4)] for s in starts]), cache)
        cache.commit_rows([(0, 4), (1, 4)], start=6)
        outs.append(model(nxt, nxt_pos, cache))
    torch.testing.assert_close(outs[0], outs[1], atol=TOL, rtol=0)


def test_commit_rows_lays_segments_in_the_given_order():
    cache = KVCache(n_layer=1, n_kv_head=1, head_dim=1, max_len=8, max_batch=3)
    cache.pos, cache.batch = 5, 3
    cache.kv[0, 0, :, 0, :, 0] = torch.arange(3 * 8, dtype=torch.float32).view(3, 8)  # row r, token t -> 8r + t
    cache.commit_rows([(2, 2), (0, 3), (1, 1)], start=2)
    assert (cache.batch, cache.pos) == (1, 8)
    assert cache.kv[0, 0, 0, 0, :, 0].tolist() == [0, 1, 18, 19, 2, 3, 4, 10]


# ----------------------------------------------------------------------------------------------
# sampler.py on an oracle: a stub whose logits put all mass on a known target at each position

class OracleModel(nn.Module):
    """Knows the target token at every position. A mask token predicts its own position's target,
    a clean token the next position's (what a trained ReFusion model does)."""

    def __init__(self, target, vocab_size, mask_id, confident=True):
        super().__init__()
        self.target, self.vocab_size, self.mask_id, self.confident = target, vocab_size, mask_id, confident
        self.config = SimpleNamespace(block_size=len(target) + 1)
        self.seen = []    # every (position, token) fed with a clean token

    def new_kv_cache(self, max_len, max_batch=1):
        return KVCache(0, 1, 2, max_len, max_batch)

    def forward(self, idx, position_ids, kv_cache=None):
        want = position_ids + (idx != self.mask_id).long()
        want = self.target[want.clamp(max=len(self.target) - 1)]
        logits = torch.zeros(*idx.shape, self.vocab_size)
        if self.confident:
            logits.scatter_(-1, want[..., None], 100.0)
        if kv_cache is not None:
            kv_cache.advance(idx.shape[1])
        return logits


MASK, EOS, V = 30, 31, 32


def oracle_target(prompt_len, gen_len, eos_at=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 30, (prompt_len + gen_len + 1,), generator=g)
    if eos_at is not None:
        target[prompt_len + eos_at] = EOS
    return target


@pytest.mark.parametrize("slot_size,num_blocks", [(4, 1), (4, 3), (8, 3), (6, 2), (1, 4)])
def test_oracle_decode_reproduces_target_in_few_forwards(slot_size, num_blocks):
    P, L = 5, 24
    target = oracle_target(P, L)
    out = generate_refusion(OracleModel(target, V, MASK), target[:P].tolist(), L, mask_id=MASK, eos_id=EOS,
                            slot_size=slot_size, num_blocks=num_blocks)
    assert out.tokens == target[P:P + L].tolist()
    assert out.nfe == 2 * num_blocks      # per block: one plan picks every slot, one verify accepts all
    assert out.tpf > 1
    positions = [p for step in out.steps for p, _ in step]
    assert sorted(positions) == list(range(P, P + L))    # every position filled exactly once


@pytest.mark.parametrize("eos_at", [0, 5, 13, 23])
def test_oracle_decode_cuts_at_eos(eos_at):
    P, L = 3, 24
    target = oracle_target(P, L, eos_at=eos_at, seed=1)
    out = generate_refusion(OracleModel(target, V, MASK), target[:P].tolist(), L, mask_id=MASK, eos_id=EOS,
                            slot_size=4, num_blocks=2)
    assert out.tokens == target[P:P + eos_at + 1].tolist()
    positions = sorted(p for step in out.steps for p, _ in step)
    assert positions == list(range(P, P + eos_at + 1))


def test_unconfident_model_still_finishes_one_slot_per_plan_step():
    P, L, S = 4, 16, 4
    target = oracle_target(P, L, seed=2)
    model = OracleModel(target, V, MASK, confident=False)     # uniform logits: every probability is 1/V
    out = generate_refusion(model, target[:P].tolist(), L, mask_id=MASK, eos_id=EOS, slot_size=S)
    assert len(out.tokens) == L and len(out.steps) == L // S
    assert all(len(step) == S for step in out.steps)
    # one plan and one verify per slot, then S - 1 infill iterations of draft + verify
    assert out.nfe == (L // S) * (2 + 2 * (S - 1))


# ----------------------------------------------------------------------------------------------
# sampler.py against a naive reference decoder that recomputes the whole buffer for every prediction

@torch.no_grad()
def naive_one_slot_decode(model, prompt, gen_len, slot_size, num_blocks, accept_all, eos_id, mask_id):
    """SPEC section 4 in the regime slot_threshold > 1 (one slot per plan step), without a cache.
    accept_all: token_threshold 0 (the plan's drafts are committed whole), else token_threshold > 1
    (each later token is drafted from the accepted prefix and forced in, one at a time).
    Returns (response tokens, the NFE the algorithm implies)."""
    toks, poss = list(prompt), list(range(len(prompt)))
    response, nfe = {}, 0

    def logits_after(extra_toks, extra_pos):
        return model(torch.tensor([toks + extra_toks]), torch.tensor([poss + extra_pos]))[0, len(toks):]

    n_block = gen_len // slot_size // num_blocks
    for b in range(num_blocks):
        pool = [len(prompt) + (b * n_block + i) * slot_size for i in range(n_block)]
        stop = False
        while pool:
            pos = [p + i for p in pool for i in range(slot_size)]
            probs = torch.softmax(logits_after([mask_id] * len(pos), pos), -1).view(len(pool), slot_size, -1)
            drafts = probs.argmax(-1)
            best = int(probs.max(-1).values[:, 0].argmax())
            start = pool[best]
            if accept_all:
                slot = drafts[best].tolist()
                nfe += 2
            else:
                slot = [int(drafts[best, 0])]
                nfe += 2
                while len(slot) < slot_size and eos_id not in slot:
                    j = len(slot)
                    fed = slot + [mask_id] * (slot_size - j)
                    slot.append(int(logits_after(fed, list(range(start, start + slot_size)))[j].argmax()))
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
    return (out[:out.index(eos_id) + 1] if eos_id in out else out), nfe


@pytest.mark.parametrize("accept_all", [False, True], ids=["token_threshold_above_1", "token_threshold_0"])
@pytest.mark.parametrize("seed,slot_size,num_blocks", [(0, 4, 1), (1, 4, 2), (2, 8, 1), (3, 2, 3)])
def test_decode_matches_naive_reference_with_one_slot_per_step(accept_all, seed, slot_size, num_blocks):
    model = tiny_model(seed=seed)
    prompt = torch.randint(0, 36, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
    gen_len = 24
    kwargs = dict(slot_size=slot_size, num_blocks=num_blocks, slot_threshold=1.5,
                  token_threshold=0.0 if accept_all else 1.5, mask_id=38)
    # once with an EOS the model never emits, once with one it emits mid-way
    ref, _ = naive_one_slot_decode(model, prompt, gen_len, slot_size, num_blocks, accept_all, -1, 38)
    for eos in (-1, ref[len(ref) // 2]):
        ref, ref_nfe = naive_one_slot_decode(model, prompt, gen_len, slot_size, num_blocks, accept_all, eos, 38)
        out = generate_refusion(model, prompt, gen_len, eos_id=eos, **kwargs)
        assert out.tokens == ref
        assert out.nfe == ref_nfe


@pytest.mark.parametrize("eos_at", [None, 6, 9, 15])
def test_parallel_infill_fills_every_selected_slot(eos_at):
    """slot_threshold 0 selects every slot and token_threshold > 1 accepts only forced tokens, so all
    slots of the block are infilled side by side, one token per row per iteration."""
    P, L, S = 5, 16, 4
    target = oracle_target(P, L, eos_at=eos_at, seed=3)
    out = generate_refusion(OracleModel(target, V, MASK), target[:P].tolist(), L, mask_id=MASK, eos_id=EOS,
                            slot_size=S, slot_threshold=0.0, token_threshold=1.5)
    end = L if eos_at is None else eos_at + 1
    assert out.tokens == target[P:P + end].tolist()
    assert len(out.steps) == 1                       # one plan step commits every slot (up to EOS)
    if eos_at is None:
        assert out.nfe == 2 + 2 * (S - 1)            # plan + verify, then S - 1 draft/verify pairs
