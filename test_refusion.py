"""
The specification, as tests. Each test names a property of ReFusion (SPEC.md) and checks it with
exact values or an equality between two code paths (float32, tolerance 1e-5).

Run: python -m pytest -q test_refusion.py
"""

import ast
import json
import json.decoder
import math
import os
import re
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn

import data
from kvcache import KVCache
from model import ModelConfig, Transformer
from sampler import DEFAULTS, draft_tokens, generate_ar, generate_mdm, generate_refusion, make_decoder, \
    tokens_per_step

TOL = 1e-5
ROOT = Path(__file__).resolve().parent


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
        self.config = SimpleNamespace(block_size=len(target) + 1, causal=True)
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

    def pick(probs):                                                  # the mask id is never drafted
        return probs.clone().index_fill_(-1, torch.tensor([mask_id]), -1.0).argmax(-1)

    n_block = gen_len // slot_size // num_blocks
    for b in range(num_blocks):
        pool = [len(prompt) + (b * n_block + i) * slot_size for i in range(n_block)]
        stop = False
        while pool:
            pos = [p + i for p in pool for i in range(slot_size)]
            probs = torch.softmax(logits_after([mask_id] * len(pos), pos), -1).view(len(pool), slot_size, -1)
            drafts = pick(probs)
            best = int(probs[:, 0].gather(-1, drafts[:, :1])[:, 0].argmax())   # raw probability of each first draft
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
                    slot.append(int(pick(logits_after(fed, list(range(start, start + slot_size)))[j])))
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


# ----------------------------------------------------------------------------------------------
# sampler.py: the baseline decoders (SPEC section 4, "Baseline decoders")

@torch.no_grad()
def naive_next_token_decode(model, prompt, max_new_tokens, eos_id, temperature, generator):
    """Next-token decoding without a cache: the whole sequence is recomputed for every new token."""
    toks = list(prompt)
    while len(toks) - len(prompt) < max_new_tokens and eos_id not in toks[len(prompt):]:
        logits = model(torch.tensor([toks]), torch.arange(len(toks))[None])[0, -1:]
        toks.append(int(draft_tokens(logits, temperature, generator)[0][0]))
    return toks[len(prompt):]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_ar_decode_with_cache_matches_no_cache_reference(temperature):
    model = tiny_model(seed=4)
    prompt = torch.randint(0, 36, (7,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = naive_next_token_decode(model, prompt, 20, -1, temperature, torch.Generator().manual_seed(0))
    for eos in (-1, ref[len(ref) // 2]):    # an EOS the model never emits, then one it emits mid-way
        ref = naive_next_token_decode(model, prompt, 20, eos, temperature, torch.Generator().manual_seed(0))
        out = generate_ar(model, prompt, 20, eos_id=eos, temperature=temperature,
                          generator=torch.Generator().manual_seed(0))
        assert out.tokens == ref and len(ref) == (20 if eos == -1 else ref.index(eos) + 1)
        # the prefill predicts the first token, then one forward per further token: TPF is exactly 1
        assert out.nfe == len(out.tokens)


class RecordingModel(nn.Module):
    """Passes every call on to `model` and keeps a copy of its input tokens and output logits."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config, self.calls = model, model.config, []

    def forward(self, idx, position_ids, kv_cache=None, key_mask=None):
        logits = self.model(idx, position_ids, kv_cache, key_mask)
        self.calls.append((idx[0].clone(), logits[0].clone()))
        return logits


@pytest.mark.parametrize("block_length", [None, 4])
def test_mdm_commits_the_most_confident_token_each_step_and_never_changes_it(block_length):
    P, L, M = 5, 12, 38
    model = RecordingModel(tiny_model(seed=5, causal=False))
    prompt = torch.randint(0, 36, (P,), generator=torch.Generator().manual_seed(5)).tolist()
    out = generate_mdm(model, prompt, L, mask_id=M, eos_id=-1, steps=L, block_length=block_length)
    assert out.nfe == len(model.calls) == L and len(out.tokens) == L
    block = block_length or L
    inputs = [idx for idx, _ in model.calls] + [torch.tensor(prompt + out.tokens)]
    for step, (before, after) in enumerate(zip(inputs, inputs[1:])):
        known = before != M
        assert before[:P].tolist() == prompt and int(known.sum()) == P + step   # one more per call
        assert torch.equal(after[known], before[known])                         # committed never change
        new = ((after != M) & ~known).nonzero()[:, 0].tolist()
        # low-confidence remasking: the new token is the most probable masked one of the current block
        logits = model.calls[step][1].clone()
        logits[:, M] = -math.inf
        confidence, token = torch.softmax(logits, -1).max(-1)
        start = P + step // block * block      # one token per step, so block b owns steps b*block ...
        candidates = [p for p in range(start, start + block) if before[p] == M]
        best = max(candidates, key=lambda p: float(confidence[p]))
        assert new == [best] and int(after[best]) == int(token[best])
        assert out.steps[step] == [(best, int(token[best]))]


def test_mdm_schedule_spreads_each_blocks_tokens_evenly_over_its_steps():
    assert tokens_per_step(10, 4) == [3, 3, 2, 2]
    model = tiny_model(seed=6, causal=False)
    P = 4
    prompt = list(range(P))
    for L, steps, block_length, per_step in [(12, 4, None, [3, 3, 3, 3]), (10, 4, None, [3, 3, 2, 2]),
                                             (12, 6, 6, [2, 2, 2, 2, 2, 2]), (12, 4, 3, [3, 3, 3, 3])]:
        out = generate_mdm(model, prompt, L, mask_id=38, eos_id=-1, steps=steps, block_length=block_length)
        assert [len(s) for s in out.steps] == per_step and out.nfe == steps and len(out.tokens) == L
        block, n_blocks = block_length or L, L // (block_length or L)
        for b in range(n_blocks):                # block b is filled by its own steps, left to right
            own = out.steps[b * steps // n_blocks:(b + 1) * steps // n_blocks]
            assert sorted(p for s in own for p, _ in s) == list(range(P + b * block, P + (b + 1) * block))


@pytest.mark.parametrize("steps, block_length, message", [
    (12, 5, "max_new_tokens=12 is not a multiple of block_length=5"),
    (5, 4, "steps=5 cannot be shared equally by the 3 blocks"),
    (13, None, "steps=13 > max_new_tokens=12"),
    (0, None, "must be positive"),
])
def test_mdm_settings_errors_say_what_to_change(steps, block_length, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        generate_mdm(tiny_model(causal=False), [1, 2], 12, mask_id=38, eos_id=39, steps=steps,
                     block_length=block_length)


@torch.no_grad()
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_only_the_bidirectional_model_sees_later_tokens(causal):
    model = tiny_model(seed=7, causal=causal)
    idx = torch.randint(0, 36, (1, 12), generator=torch.Generator().manual_seed(7))
    changed = idx.clone()
    changed[0, 9] = (idx[0, 9] + 1) % 36
    pos = torch.arange(12)[None]
    diff = float((model(idx, pos) - model(changed, pos))[0, :9].abs().max())   # positions before the change
    assert diff <= 1e-6 if causal else diff > 1e-4


@pytest.mark.parametrize("method", ["refusion", "ar", "mdm"])
def test_decoder_refuses_a_model_of_the_other_attention_with_the_fix(method):
    model = tiny_model(causal=method == "mdm")      # the wrong kind of model for each method
    generate = {"refusion": generate_refusion, "ar": generate_ar, "mdm": generate_mdm}[method]
    ids = {"eos_id": 39} if method == "ar" else {"eos_id": 39, "mask_id": 38}
    fix = ("trained with a causal objective.*use --method=refusion or --method=ar" if method == "mdm"
           else "bidirectional attention.*use --method=mdm")
    with pytest.raises(ValueError, match=fix):
        generate(model, [1, 2, 3], 8, **ids)


class PrefersSpecialIds(nn.Module):
    """A tiny model whose logits favour some ids by +50 (an undertrained model that drafts masks)."""

    def __init__(self, model, ids):
        super().__init__()
        self.model, self.ids, self.config = model, ids, model.config

    def new_kv_cache(self, max_len, max_batch=1):
        return self.model.new_kv_cache(max_len, max_batch)

    def forward(self, idx, position_ids, kv_cache=None):
        logits = self.model(idx, position_ids, kv_cache=kv_cache)
        logits[..., self.ids] += 50.0
        return logits


@pytest.mark.parametrize("method", ["refusion", "ar", "mdm"])
def test_no_decoder_writes_the_mask_or_pad_id(method):
    """No training label is the mask or the pad id, so the CLI's decoders never write either, even
    from a model that prefers them; the mask id would read as a position still to be decoded."""
    meta = {"eos_id": 39, "mask_id": 38, "pad_id": 37}
    model = PrefersSpecialIds(tiny_model(causal=method != "mdm"), [37, 38])
    assert set(model(torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 2]])).argmax(-1)[0].tolist()) <= {37, 38}
    cfg = dict(DEFAULTS, method=method, max_new_tokens=16, num_blocks=1, slot_threshold=0.5, token_threshold=0.0)
    run, _ = make_decoder(cfg, model, meta, torch.Generator())
    out = run([1, 2, 3]).tokens
    assert len(out) > 0 and not {37, 38} & set(out)
    favoured = {"refusion": generate_refusion, "ar": generate_ar, "mdm": generate_mdm}[method]
    kwargs = dict(eos_id=39) | ({} if method == "ar" else dict(mask_id=38))
    assert 37 in favoured(model, [1, 2, 3], 16, **kwargs).tokens      # without the ban, the pad id wins


def test_cli_builds_each_decoder_and_refuses_an_unknown_method():
    meta = {"eos_id": 39, "mask_id": 38, "pad_id": 37}
    for method, causal, gen_len in [("refusion", True, 16), ("ar", True, 10), ("mdm", False, 10)]:
        cfg = dict(DEFAULTS, method=method, max_new_tokens=10, num_blocks=1)  # refusion: 10 -> 2 slots of 8
        run, length = make_decoder(cfg, tiny_model(causal=causal), meta, torch.Generator())
        out = run([1, 2, 3])
        assert length == gen_len and 0 < len(out.tokens) <= 10 and out.nfe > 0
    with pytest.raises(ValueError, match="--method='beam': choose one of refusion, ar, mdm"):
        make_decoder(dict(DEFAULTS, method="beam"), tiny_model(), meta, torch.Generator())


# ----------------------------------------------------------------------------------------------
# data.py: tokenizer


def test_byte_tokenizer_round_trips_any_text():
    enc = data.get_tokenizer("bytes")
    text = "def f(x):\n    return x  # naïve 😀 λ\t\r\n"
    ids = data.encode(enc, text)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    assert all(0 <= i < 256 for i in ids)
    assert data.decode(enc, ids) == text


def test_byte_tokenizer_special_ids_and_vocab():
    enc = data.get_tokenizer("bytes")
    assert data.special_ids(enc) == (256, 257, 258)
    assert enc.n_vocab == 259


def test_literal_mask_text_is_not_the_mask_id():
    enc = data.get_tokenizer("bytes")
    ids = data.encode(enc, "x = '<|mask|>' + '<|endoftext|>'")
    assert not set(ids) & set(data.special_ids(enc))
    assert data.decode(enc, ids) == "x = '<|mask|>' + '<|endoftext|>'"


def test_decode_tolerates_special_ids_and_broken_utf8():
    enc = data.get_tokenizer("bytes")
    eos, mask, pad = data.special_ids(enc)
    assert data.decode(enc, [104, 105, mask, eos, pad]) == "hi<|mask|><|endoftext|><|pad|>"
    assert data.decode(enc, [0xE2, 0x82]) == "\ufffd"  # first two bytes of the 3-byte "€"
    assert data.decode(enc, torch.tensor([104, 105])) == "hi"


def test_unknown_tokenizer_is_a_value_error_listing_the_choices():
    with pytest.raises(ValueError, match="bytes.*gpt2"):
        data.get_tokenizer("llama")


def test_gpt2_tokenizer_or_a_clear_offline_error():
    try:
        enc = data.get_tokenizer("gpt2")
    except FileNotFoundError as e:
        msg = str(e)
        assert "GPT-2 BPE" in msg and "TIKTOKEN_CACHE_DIR" in msg and "--tokenizer=bytes" in msg
        pytest.skip("GPT-2 BPE file not downloadable or cached here (offline); error message checked")
    assert enc.n_vocab == 50259
    assert data.special_ids(enc) == (50256, 50257, 50258)
    assert data.encode(enc, "hello world") == [31373, 995]  # GPT-2's own ids
    assert 50257 not in data.encode(enc, "<|mask|>")

# ----------------------------------------------------------------------------------------------
# the built-in stdlib corpus


@pytest.fixture(scope="module")
def stdlib():
    return data.stdlib_records()


def test_stdlib_query_is_signature_and_docstring(stdlib):
    assert len(stdlib) > 1000
    for r in stdlib:
        assert r["query"].startswith(("def ", "async def ")), (r["module"], r["name"])
        fn = ast.parse(r["query"] + "    pass\n").body[0]  # the query alone is a complete header
        doc = ast.get_docstring(fn, clean=False)
        assert doc is not None and fn.name == r["name"].split(".")[-1]


def test_stdlib_query_plus_response_is_the_dedented_source(stdlib):
    lines = open(json.decoder.__file__, encoding="utf-8").read().split("\n")
    by_name = {r["name"]: r for r in stdlib if r["module"] == "json.decoder"}
    fn = by_name["JSONDecoder.raw_decode"]
    node = next(n for n in ast.walk(ast.parse("\n".join(lines)))
                if isinstance(n, ast.FunctionDef) and n.name == "raw_decode")
    indent = " " * node.col_offset  # a method: the def is indented once
    source = "".join(line.removeprefix(indent) + "\n" for line in lines[node.lineno - 1:node.end_lineno])
    assert fn["query"] + fn["response"] == source
    assert fn["response"].strip() and fn["response"].endswith("\n")
    for r in stdlib:  # in general: both parts end a line, and together they parse
        assert r["query"].endswith("\n") and r["response"].endswith("\n") and r["response"].strip()
        ast.parse(r["query"] + r["response"])


def test_stdlib_has_methods_and_no_test_packages(stdlib):
    modules = {r["module"] for r in stdlib}
    assert "json.decoder" in modules and "json" in modules  # json/__init__.py is "json"
    assert not any(part in ("test", "tests", "idle_test") or part.startswith("test_")
                   for m in modules for part in m.split("."))
    assert any("." in r["name"] for r in stdlib)  # methods are qualified: Class.method


def test_stdlib_split_is_deterministic_and_about_5_percent_val(stdlib):
    splits = [data.split_of(r) for r in stdlib]
    assert splits == [data.split_of(dict(r)) for r in stdlib]
    assert set(splits) == {"train", "val"}
    assert 0.02 < splits.count("val") / len(splits) < 0.08
    assert data.split_of({"module": "json.decoder", "name": "JSONDecoder.raw_decode"}) == \
        data.split_of({"module": "json.decoder", "name": "JSONDecoder.raw_decode", "query": "x"})


def test_function_records_skip_docstring_only_and_too_long():
    source = textwrap.dedent('''\
        @decorator
        def kept(a):
            """Doc
            on two lines."""
            return a

        def only_doc():
            """Nothing else."""

        def undocumented():
            return 1

        class C:
            async def m(self):
                "Doc."
                await self.x()

            def n(self):
                """Doc."""
                return """
        column 0"""
        ''')
    records = data.function_records(source, "mod")
    assert [r["name"] for r in records] == ["kept", "C.m", "C.n"]
    assert records[0]["query"] == 'def kept(a):\n    """Doc\n    on two lines."""\n'
    assert records[0]["response"] == "    return a\n"
    assert records[1]["query"] == 'async def m(self):\n    "Doc."\n'
    assert records[2]["response"] == '    return """\ncolumn 0"""\n'  # the def's indent only
    assert [r["name"] for r in data.function_records(source, "mod", max_chars=50)] == ["C.m"]

# ----------------------------------------------------------------------------------------------
# a user's own records


def write(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return str(path)


def test_load_records_json_and_jsonl(tmp_path):
    rows = [{"query": "2+2?", "response": "4", "extra": 1}, {"query": "π", "response": "é"}]
    for path in (write(tmp_path, "a.json", json.dumps(rows)),
                 write(tmp_path, "a.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")):
        records = data.load_records(path)
        assert [(r["query"], r["response"]) for r in records] == [("2+2?", "4"), ("π", "é")]
        assert [r["name"] for r in records] == ["0", "1"]
        assert {r["module"] for r in records} == {os.path.basename(path)}


def test_load_records_plain_text_windows(tmp_path):
    text = "abcdefgh" * 300  # 2400 characters -> windows of 1024, 1024, 352
    records = data.load_records(write(tmp_path, "notes.txt", text))
    assert [len(r["query"]) + len(r["response"]) for r in records] == [1024, 1024, 352]
    assert [len(r["query"]) for r in records] == [256, 256, 88]
    assert "".join(r["query"] + r["response"] for r in records) == text


@pytest.mark.parametrize("block_size", [64, 384])
def test_text_in_any_script_prepares_into_windows_that_fit_the_context(tmp_path, block_size):
    """Windows are measured in UTF-8 bytes, so Chinese or Cyrillic text (3 or 2 bytes a character)
    fits block_size as well as ASCII does, and no character is split."""
    text = "".join(("漢字の文章。", "Кириллица. ", "ascii text. ", "emoji \U0001f600. ")[i % 4] for i in range(400))
    data_dir = data.prepare(write(tmp_path, "mixed.txt", text), "bytes", block_size, data_root=str(tmp_path))
    meta = json.load(open(os.path.join(data_dir, "meta.json")))
    assert meta["counts"]["train"]["skipped_too_long"] == meta["counts"]["val"]["skipped_too_long"] == 0
    records = data.load_records(str(tmp_path / "mixed.txt"), window_bytes=block_size - 1)
    assert "".join(r["query"] + r["response"] for r in records) == text
    assert all(len((r["query"] + r["response"]).encode()) <= block_size - 1 for r in records)


@pytest.mark.parametrize("name, content, error, message", [
    ("missing.json", None, FileNotFoundError, "does not exist"),
    ("empty.json", "", ValueError, "empty"),
    ("empty.txt", "  \n", ValueError, "empty"),
    ("bad.json", '[{"query": "a",\n "response": }]', ValueError, "line 2, column"),
    ("bad.jsonl", '{"query": "a", "response": "b"}\n{"query": \n', ValueError, "line 2"),
    ("dict.json", '{"query": "a", "response": "b"}', ValueError, "not a list"),
    ("str.json", '[{"query": "a", "response": "b"}, "c"]', ValueError, "record 1 is a str"),
    ("noresp.json", '[{"query": "a"}]', ValueError, "record 0 has no 'response'"),
    ("int.jsonl", '{"query": 3, "response": "b"}', ValueError, "record 0 .*'query' must be a string"),
    ("emptyresp.json", '[{"query": "a", "response": "b"}, {"query": "a", "response": ""}]',
     ValueError, "record 1 has an empty response"),
    ("emptyquery.jsonl", '{"query": "", "response": "b"}', ValueError, "record 0 .*has an empty query"),
    ("latin1.txt", b"ok caf\xe9", ValueError, "byte offset 6"),
])
def test_load_records_errors_say_what_is_wrong(tmp_path, name, content, error, message):
    path = str(tmp_path / name) if content is None else write(tmp_path, name, content)
    with pytest.raises(error, match=message):
        data.load_records(path)

# ----------------------------------------------------------------------------------------------
# prepare and TokenDataset


@pytest.fixture
def qa_file(tmp_path):
    """100 small records plus 3 too long for block_size=64 with the byte tokenizer."""
    rows = [{"query": f"What is {i} + {i}?", "response": f" {2 * i}"} for i in range(100)]
    rows += [{"query": "long " * 20, "response": "answer"} for _ in range(3)]
    return write(tmp_path, "sums.json", json.dumps(rows)), rows


def test_prepare_round_trips_tokens_and_skips_too_long(tmp_path, qa_file):
    path, rows = qa_file
    enc = data.get_tokenizer("bytes")
    data_dir = data.prepare(path, "bytes", 64, data_root=str(tmp_path / "data"))
    import hashlib
    digest = hashlib.sha1(open(path, "rb").read()).hexdigest()[:8]
    assert data_dir == str(tmp_path / "data" / f"sums-{digest}-bytes-64")    # name + content hash
    meta = json.load(open(os.path.join(data_dir, "meta.json")))
    assert (meta["vocab_size"], meta["eos_id"], meta["mask_id"], meta["pad_id"]) == (259, 256, 257, 258)
    counts = meta["counts"]
    assert counts["train"]["samples"] + counts["val"]["samples"] == 100
    assert counts["train"]["skipped_too_long"] + counts["val"]["skipped_too_long"] == 3
    records = data.load_records(path)
    for split in ("train", "val"):
        ds = data.TokenDataset(data_dir, split)
        expected = [r for r in records if data.split_of(r) == split and len(r["query"]) < 50]
        assert len(ds) == len(expected) == counts[split]["samples"] > 0
        for i, r in enumerate(expected):
            prompt, response = ds.sample(i)
            assert prompt == data.encode(enc, r["query"])
            assert response == data.encode(enc, r["response"]) + [256]
        assert counts[split]["tokens"] == sum(len(p) + len(q) for p, q in map(ds.sample, range(len(ds))))


def test_prepare_reuses_a_finished_preparation_and_redoes_an_unfinished_one(tmp_path, qa_file):
    path, _ = qa_file
    root = str(tmp_path / "data")
    data_dir = data.prepare(path, "bytes", 64, data_root=root)
    bin_path = os.path.join(data_dir, "train.bin")
    os.utime(bin_path, (0, 0))
    assert data.prepare(path, "bytes", 64, data_root=root) == data_dir
    assert data.prepare(os.path.relpath(path), "bytes", 64, data_root=root) == data_dir  # the same file
    assert os.stat(bin_path).st_mtime == 0  # not rewritten
    os.remove(os.path.join(data_dir, "meta.json"))  # as if interrupted before the last write
    data.prepare(path, "bytes", 64, data_root=root)
    assert os.stat(bin_path).st_mtime > 0
    assert not [f for f in os.listdir(data_dir) if f.startswith(".tmp")]


@pytest.mark.skipif(data.fcntl is None, reason="no fcntl file locks on this platform")
def test_prepare_waits_while_another_process_prepares_the_same_data(tmp_path, qa_file):
    """torchrun starts every process at once: while one holds the data dir's lock, another one's
    prepare() writes nothing, then finds the finished preparation and reuses it as it is."""
    import multiprocessing
    import shutil
    import time
    path, _ = qa_file
    finished = data.prepare(path, "bytes", 64, data_root=str(tmp_path / "elsewhere"))
    root = str(tmp_path / "data")
    data_dir = os.path.join(root, os.path.basename(finished))         # data/sums-<hash>-bytes-64
    os.makedirs(data_dir)
    child = multiprocessing.get_context("spawn").Process(target=data.prepare, args=(path, "bytes", 64, root))
    with data._exclusive(os.path.join(data_dir, ".lock")):            # as if another process were preparing
        child.start()
        time.sleep(3)                                                 # time to start and reach the lock
        assert child.is_alive() and os.listdir(data_dir) == [".lock"]  # waiting, nothing written
        for name in os.listdir(finished):                             # the other process finishes
            shutil.copy2(os.path.join(finished, name), data_dir)
        stamps = {f: os.stat(os.path.join(data_dir, f)).st_mtime_ns for f in os.listdir(data_dir)}
    child.join(timeout=60)
    assert child.exitcode == 0
    assert stamps == {f: os.stat(os.path.join(data_dir, f)).st_mtime_ns for f in os.listdir(data_dir)}


def test_two_data_files_with_the_same_name_never_share_a_prepared_dir(tmp_path, qa_file):
    """Runs on a/train.json and b/train.json keep their own prepared data: a sampler reading one
    run's validation prompts never gets the other file's."""
    rows = qa_file[1]
    dirs = []
    for sub, text in (("a", "first"), ("b", "second")):
        (tmp_path / sub).mkdir()
        path = write(tmp_path / sub, "train.json", json.dumps([dict(r, response=f" {text}") for r in rows]))
        dirs.append(data.prepare(path, "bytes", 64, data_root=str(tmp_path / "data")))
    assert dirs[0] != dirs[1]
    first = data.TokenDataset(dirs[0], "val")
    assert data.decode(data.get_tokenizer("bytes"), first.sample(0)[1]).startswith(" first")


@pytest.mark.parametrize("name", ["train.bin", "val_samples.npy"])
def test_damaged_prepared_data_is_named_and_prepared_anew(tmp_path, qa_file, name):
    """A prepared file cut short (a full disk, a copy stopped half-way): reading it names the file
    and the fix, and prepare() sees the damage and writes the data again."""
    root = str(tmp_path / "data")
    data_dir = data.prepare(qa_file[0], "bytes", 64, data_root=root)
    path = os.path.join(data_dir, name)
    whole = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(whole[:-6])
    split = name.split(".")[0].split("_")[0]
    with pytest.raises(ValueError, match=f"{re.escape(path)} does not hold what .*meta.json counts: .*writes it anew"):
        data.TokenDataset(data_dir, split)
    assert data.prepare(qa_file[0], "bytes", 64, data_root=root) == data_dir
    assert open(path, "rb").read() == whole and len(data.TokenDataset(data_dir, split)) > 0


def test_prepare_with_block_size_too_small_says_what_to_change(tmp_path, qa_file):
    with pytest.raises(ValueError, match="block_size"):
        data.prepare(qa_file[0], "bytes", 8, data_root=str(tmp_path / "data"))


def test_prepare_unknown_dataset_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="stdlib"):
        data.prepare(str(tmp_path / "nope.json"), "bytes", 64, data_root=str(tmp_path))


def test_token_dataset_without_preparation_says_to_prepare(tmp_path):
    with pytest.raises(FileNotFoundError, match="prepare"):
        data.TokenDataset(str(tmp_path / "nothing"), "train")


def test_get_batch_pads_right_to_longest_sample(tmp_path, qa_file):
    data_dir = data.prepare(qa_file[0], "bytes", 64, data_root=str(tmp_path / "data"))
    ds = data.TokenDataset(data_dir, "train")
    indices = [0, 11, 99 % len(ds), 0]
    tokens, prompt_len, length = ds.get_batch_at(indices)
    assert tokens.dtype == prompt_len.dtype == length.dtype == torch.int64
    assert tokens.shape == (4, int(length.max()))
    for b, i in enumerate(indices):
        prompt, response = ds.sample(i)
        assert prompt_len[b] == len(prompt) and length[b] == len(prompt) + len(response)
        assert tokens[b, :length[b]].tolist() == prompt + response
        assert (tokens[b, length[b]:] == 258).all()
        assert tokens[b, length[b] - 1] == 256  # every sample ends with EOS
    batch = ds.get_batch(8, np.random.default_rng(0))
    again = ds.get_batch(8, np.random.default_rng(0))
    assert batch[0].shape[0] == 8 and all(torch.equal(a, b) for a, b in zip(batch, again))


# ----------------------------------------------------------------------------------------------
# data.py: ReFusion's slot reorganization (SPEC section 3)

def test_slot_layout_hand_computed_case():
    """prompt [10, 11], response [1, 2, 3, 4, 5, EOS] in slots of 2 at positions (2,3) (4,5) (6,7);
    slot 1 masked; clean slots ordered slot 2 then slot 0; two pads."""
    E, M, PAD_ID = 256, 257, 258
    tokens = torch.tensor([[10, 11, 1, 2, 3, 4, 5, E, PAD_ID, PAD_ID]])
    b = data.layout_slots(tokens, torch.tensor([2]), torch.tensor([8]), S=torch.tensor([2]), p=torch.tensor([0.5]),
                          slot_is_masked=torch.tensor([[False, True, False] + [False] * 7]),
                          slot_rank=torch.tensor([[1, 2, 0] + list(range(3, 10))]), mask_id=M)
    X = data.IGNORE
    assert b.idx.tolist() == [[10, 11, 5, E, 1, 2, M, M, PAD_ID, PAD_ID]]
    assert b.position_ids.tolist() == [[0, 1, 6, 7, 2, 3, 4, 5, 8, 9]]
    assert b.labels.tolist() == [[X, X, E, X, 2, X, 3, 4, X, X]]
    w = 1 / (0.5 * 6)                       # 1 / (p_mask * response length, EOS included)
    torch.testing.assert_close(b.mdm_weight, torch.tensor([[0, 0, 0, 0, 0, 0, w, w, 0, 0]]), atol=1e-7, rtol=0)


def random_samples(seed, B=6, T=60, vocab=200):
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(1, 12, (B,), generator=g)
    length = torch.minimum(prompt_len + torch.randint(1, 50, (B,), generator=g), torch.tensor(T))
    tokens = torch.randint(0, vocab, (B, T), generator=g)
    tokens[torch.arange(T) >= length[:, None]] = 258
    return tokens, prompt_len, length


@pytest.mark.parametrize("S", [1, 3, 4, 8])
def test_clean_slots_shuffled_masked_slots_in_order(S):
    M, shuffled_rows = 257, 0
    for seed in range(4):
        tokens, prompt_len, length = random_samples(seed)
        b = data.reorganize_slots(tokens, prompt_len, length, (S,), M, torch.Generator().manual_seed(seed))
        for row in range(len(tokens)):
            P, n = int(prompt_len[row]), int(length[row])
            idx, pos, lab = b.idx[row].tolist(), b.position_ids[row].tolist(), b.labels[row].tolist()
            w, orig = b.mdm_weight[row].tolist(), tokens[row].tolist()
            assert idx[:P] == orig[:P] and pos[:P] == list(range(P))             # prompt untouched, first
            assert lab[:P] == [data.IGNORE] * P
            assert pos[n:] == list(range(n, len(orig))) and idx[n:] == orig[n:]  # padding last
            slot_of = lambda q: (q - P) // S
            order = [slot_of(q) for q in pos[P:n]]                               # slot id along the buffer
            slots = [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k]
            assert sorted(slots) == list(range(slot_of(n - 1) + 1))             # each slot one contiguous run
            masked = [k for k in slots if idx[P + order.index(k)] == M]
            clean = [k for k in slots if k not in masked]
            assert slots == clean + masked and masked == sorted(masked)          # clean first; masked in order
            shuffled_rows += clean != sorted(clean)
            for i in range(P, n):
                q = pos[i]
                assert pos[i] == (pos[i - 1] + 1 if i > P and slot_of(pos[i - 1]) == slot_of(q) else q)
                if slot_of(q) in masked:
                    assert (idx[i], lab[i]) == (M, orig[q]) and w[i] == w[P + order.index(masked[0])] > 0
                else:
                    has_next = q + 1 < n and slot_of(q + 1) == slot_of(q)
                    assert idx[i] == orig[q] and lab[i] == (orig[q + 1] if has_next else data.IGNORE)
                    assert w[i] == 0
    if S < 8:
        assert shuffled_rows > 0                                                # clean slots really permuted


def test_hybrid_loss_is_ar_mean_plus_weighted_mdm_sum():
    from train import hybrid_loss
    X = data.IGNORE
    labels = torch.tensor([[X, 1, 2, 3], [0, X, X, 2]])
    weight = torch.tensor([[0, 0, 0.5, 0.5], [0, 0, 0, 0.25]])    # row 0: tokens 2, 3 masked; row 1: token 3
    logits = torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(0))
    ce = -torch.log_softmax(logits, -1)
    ar = (ce[0, 1, 1] + ce[1, 0, 0]) / 2
    mdm = (0.5 * ce[0, 2, 2] + 0.5 * ce[0, 3, 3] + 0.25 * ce[1, 3, 2]) / 2
    loss, ar_loss, mdm_loss = hybrid_loss(logits, data.Batch(None, None, labels, weight))
    torch.testing.assert_close((ar_loss, mdm_loss, loss), (ar, mdm, ar + mdm), atol=TOL, rtol=0)
    # nothing clean, nothing masked: both parts are 0, never NaN
    empty = data.Batch(None, None, torch.full((2, 4), X), torch.zeros(2, 4))
    assert [x.item() for x in hybrid_loss(logits, empty)] == [0.0, 0.0, 0.0]

# ----------------------------------------------------------------------------------------------
# data.py: the built-in arithmetic corpus, whose answers can be checked exactly


@pytest.fixture(scope="module")
def arith():
    return data.DATASETS["arith"]()    # what prepare() builds for --dataset=arith


STEP = re.compile(r"(\d+)([+*-])(\d+)(?:([+-])(\d+))?=(\d+) (carry|borrow) (\d)")


def check_step(line):
    """Assert one worked step is arithmetically right; return (digit written, carry or borrow out)."""
    match = STEP.fullmatch(line)
    assert match, line
    x, op, y, op2, z, value, word, out = match.groups()
    x, y, value, out = int(x), int(y), int(value), int(out)
    result = {"+": x + y, "-": x - y, "*": x * y}[op]
    result += 0 if op2 is None else int(z) if op2 == "+" else -int(z)
    assert result == value, line
    if word == "carry":
        assert op in "+*" and out == value // 10, line
        return value % 10, out
    # "12-3-1=8 borrow 1": the top digit shows the 10 it borrowed
    assert op == "-" and 0 <= value <= 9 and out == int(x >= 10) and 0 <= x - 10 * out <= 9, line
    return value, out


def test_arith_answer_is_the_independently_computed_one(arith):
    assert len(arith) == 20000
    assert data.arithmetic_expected("Add 4821 and 937.\n") == "5758"
    assert data.arithmetic_expected("Subtract 937 from 4821.\n") == "3884"
    assert data.arithmetic_expected("Multiply 4821 by 7.\n") == "33747"
    with pytest.raises(ValueError, match="not an arithmetic query"):
        data.arithmetic_expected("Divide 4 by 2.\n")
    assert {r["query"].split()[0] for r in arith} == {"Add", "Subtract", "Multiply"}
    for r in arith:
        assert data.arithmetic_answer(r["response"]) == data.arithmetic_expected(r["query"]), r


def test_arith_answer_extraction_takes_the_last_answer_line():
    assert data.arithmetic_answer("1+2=3 carry 0\nanswer: 12\nanswer: 345\n7") == "345"
    assert data.arithmetic_answer("answer: 7") == "7"                  # a generation cut before "\n"
    assert data.arithmetic_answer("1+2=3 carry 0\nansw") is None


def test_arith_worked_steps_are_correct_and_spell_the_answer(arith):
    assert data._add_steps(4821, 937) == ["1+7=8 carry 0", "2+3+0=5 carry 0", "8+9+0=17 carry 1",
                                          "4+0+1=5 carry 0"]
    assert data._subtract_steps(4821, 937) == ["11-7=4 borrow 1", "12-3-1=8 borrow 1", "18-9-1=8 borrow 1",
                                               "4-0-1=3 borrow 0"]
    for r in arith:
        *steps, last = r["response"].removesuffix("\n").split("\n")
        assert last.startswith("answer: ") and len(steps) >= 3
        digits = []
        for line in steps:                     # least significant column first
            digit, out = check_step(line)
            digits.append(digit)
        if out:
            digits.append(out)                 # a final carry is the leading digit (a final borrow is wrong)
        spelled = "".join(map(str, reversed(digits))).lstrip("0") or "0"
        assert spelled == data.arithmetic_expected(r["query"]), r


def test_arith_responses_are_48_to_128_byte_tokens(arith):
    lengths = [len(r["response"].encode("utf-8")) + 1 for r in arith]    # byte tokenizer, EOS included
    assert sum(48 <= n <= 128 for n in lengths) >= 0.95 * len(lengths)


def test_arith_is_deterministic_distinct_and_about_5_percent_val(arith):
    assert data.arithmetic_records(n=300, seed=1) == data.arithmetic_records(n=300, seed=1)
    assert data.arithmetic_records(n=300, seed=1) != data.arithmetic_records(n=300, seed=2)
    assert data.arithmetic_records(n=300) == arith[:300]   # a prefix: arith-1m starts with arith's records,
    # and split_of depends on the record alone, so they keep their splits there
    assert len({r["name"] for r in arith}) == len({r["query"] for r in arith}) == len(arith)
    assert {r["module"] for r in arith} == {"arith"}
    assert 0.03 < [data.split_of(r) for r in arith].count("val") / len(arith) < 0.07


# ----------------------------------------------------------------------------------------------
# train.py, configurator.py: starting from a pretrained ARM, and flags

def test_init_from_a_checkpoint_without_the_mask_token_adds_its_row():
    from train import load_pretrained
    small = tiny_model(seed=4, vocab_size=38)                 # an ARM whose vocabulary has no mask id
    big = tiny_model(seed=5, vocab_size=40)
    load_pretrained(big, {"model": small.state_dict()})
    emb_small, emb_big = small.embed_tokens.weight, big.embed_tokens.weight
    torch.testing.assert_close(emb_big[:38], emb_small, atol=0, rtol=0)
    torch.testing.assert_close(emb_big[38:], emb_small.mean(0).expand(2, -1), atol=TOL, rtol=0)
    for name, p in small.named_parameters():                  # every other weight copied exactly
        if "embed_tokens" not in name and "lm_head" not in name:
            torch.testing.assert_close(big.get_parameter(name), p, atol=0, rtol=0)
    with pytest.raises(ValueError, match="does not fit"):
        load_pretrained(tiny_model(n_layer=3), {"model": small.state_dict()})


def test_flags_override_defaults_with_type_checks():
    from configurator import ConfigError, parse_args
    d = dict(slot_sizes=(4, 8), datasets=("arith",), lr=1e-3, json=False, device="cpu", n_layer=4)
    cfg = parse_args(d, ["--slot_sizes=(16,)", "--datasets=arith,stdlib", "--lr=1", "--json", "--device=cuda"])
    assert cfg == dict(slot_sizes=(16,), datasets=("arith", "stdlib"), lr=1.0, json=True, device="cuda", n_layer=4)
    assert parse_args(d, ["--slot_sizes=4,8"])["slot_sizes"] == (4, 8)
    with pytest.raises(ConfigError, match="did you mean --n_layer"):
        parse_args(d, ["--n_layers=2"])
    with pytest.raises(ConfigError, match="expected int"):
        parse_args(d, ["--n_layer=2.5"])
    with pytest.raises(ConfigError, match="has no value"):
        parse_args(d, ["--n_layer"])
    for text in ("1e1", "'quoted'", "3,4", "0x1F", '"""doc"""'):                  # text keys keep the text as written
        assert parse_args(d, [f"--device={text}"])["device"] == text


@pytest.mark.parametrize("content, message", [
    ("from math import sqrt\nn_layer = int(sqrt(4))\n", None),                      # an import is no setting
    ("n_layer = (2\n", r"config file .*bad.py, line 1: SyntaxError"),
    ("n_layer = undefined_name\n", r"config file .*bad.py, line 1: NameError"),
    ("n_layer = '3'\n", r"n_layer = '3' in .*bad.py: expected int like 4, got str"),
    (b"device = '\xff'\n", r"config file .*bad.py: UnicodeDecodeError"),
])
def test_config_file_errors_name_the_file_and_line(tmp_path, content, message):
    from configurator import ConfigError, parse_args
    path = tmp_path / "bad.py"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    d = dict(n_layer=4, device="cpu")
    if message is None:
        assert parse_args(d, [str(path)]) == dict(n_layer=2, device="cpu")
    else:
        with pytest.raises(ConfigError, match=message):
            parse_args(d, [str(path)])


@pytest.mark.parametrize("path", sorted(p.name for p in (ROOT / "config").glob("*.py")))
def test_every_config_file_names_known_keys_and_passes_the_scripts_checks(path):
    """config/train_*.py are read by train.py and config/bench_*.py by bench.py; a GPU config is
    checked as if on CPU, since this machine may have no GPU."""
    import bench
    import train
    from configurator import parse_args
    script, check = (train, train.check_config) if path.startswith("train_") else (bench, bench.check_bench_config)
    cfg = parse_args(script.DEFAULTS, [str(ROOT / "config" / path), "--device=cpu"])
    check(cfg)                                                        # raises on a setting that cannot work


def test_on_step_sees_every_committed_step_as_it_happens():
    P, L = 4, 16
    target = oracle_target(P, L, seed=5)
    seen = []
    out = generate_refusion(OracleModel(target, V, MASK, confident=False), target[:P].tolist(), L, mask_id=MASK,
                            eos_id=EOS, slot_size=4, on_step=seen.append)
    assert seen == out.steps and len(seen) == L // 4


def tiny_run_flags(tmp_path, qa_file, out, objective="refusion"):
    return [f"--dataset={qa_file[0]}", f"--data_root={tmp_path / 'data'}", f"--out_dir={tmp_path / out}",
            f"--objective={objective}", "--block_size=64", "--n_layer=1", "--n_head=2", "--n_embd=16",
            "--batch_size=4", "--eval_interval=2", "--eval_iters=1", "--slot_sizes=2,4",
            "--warmup_iters=10"]  # 6 steps inside warm-up: the learning rate does not depend on max_iters


def test_learning_rate_schedule_and_a_resume_with_more_iterations_holds_min_lr(tmp_path, qa_file):
    """Warm-up, cosine to min_lr at lr_decay_iters (default: max_iters, fixed when the run starts),
    then min_lr: resuming with a larger --max_iters continues at min_lr instead of jumping back up."""
    import train
    from checkpoint import load_checkpoint, save_checkpoint
    cfg = dict(learning_rate=1.0, min_lr=0.1, warmup_iters=2, lr_decay_iters=12)
    assert [train.get_lr(it, cfg) for it in (0, 1, 2, 7, 12, 20)] == pytest.approx(
        [0.5, 1.0, 1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)), 0.1, 0.1])
    flags = tiny_run_flags(tmp_path, qa_file, "run") + ["--warmup_iters=1", "--learning_rate=0.01", "--min_lr=0.001"]
    train.main(flags + ["--max_iters=3"])
    assert load_checkpoint(str(tmp_path / "run"))["config"]["lr_decay_iters"] == 3
    train.main(flags + ["--max_iters=5", "--init_from=resume"])
    ckpt = load_checkpoint(str(tmp_path / "run"))
    assert ckpt["iter_num"] == 5 and ckpt["config"]["lr_decay_iters"] == 3
    assert [g["lr"] for g in ckpt["optimizer"]["param_groups"]] == pytest.approx([0.001, 0.001])
    del ckpt["config"]["lr_decay_iters"]                              # a checkpoint from before the setting:
    save_checkpoint(str(tmp_path / "run"), ckpt)                      # its decay ended at its max_iters (5)
    train.main(flags + ["--max_iters=7", "--init_from=resume"])
    ckpt = load_checkpoint(str(tmp_path / "run"))
    assert ckpt["config"]["lr_decay_iters"] == 5
    assert [g["lr"] for g in ckpt["optimizer"]["param_groups"]] == pytest.approx([0.001, 0.001])


def test_grad_clip_zero_means_no_clipping(tmp_path, qa_file):
    """--grad_clip=0 trains unclipped (as in nanoGPT), the same as a clip far above any gradient norm."""
    import train
    from checkpoint import load_checkpoint
    for name, clip in (("none", "0.0"), ("huge", "1e9")):
        train.main(tiny_run_flags(tmp_path, qa_file, name) + ["--max_iters=2", f"--grad_clip={clip}"])
    a, b = load_checkpoint(str(tmp_path / "none")), load_checkpoint(str(tmp_path / "huge"))
    for name in a["model"]:
        torch.testing.assert_close(a["model"][name], b["model"][name], atol=0, rtol=0)


@pytest.mark.parametrize("objective", ["refusion", "mdm"])
def test_resumed_training_matches_an_uninterrupted_run(tmp_path, qa_file, objective):
    import train
    from checkpoint import load_checkpoint
    train.main(tiny_run_flags(tmp_path, qa_file, "straight", objective) + ["--max_iters=6"])
    train.main(tiny_run_flags(tmp_path, qa_file, "resumed", objective) + ["--max_iters=3"])
    train.main(tiny_run_flags(tmp_path, qa_file, "resumed", objective) + ["--max_iters=6", "--init_from=resume"])
    a, b = load_checkpoint(str(tmp_path / "straight")), load_checkpoint(str(tmp_path / "resumed"))
    assert a["iter_num"] == b["iter_num"] == 6
    for name in a["model"]:
        torch.testing.assert_close(a["model"][name], b["model"][name], atol=0, rtol=0)


def test_training_never_overwrites_a_checkpoint_unless_resuming(tmp_path, qa_file):
    import train
    flags = tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=2"]
    train.main(flags)
    ckpt = tmp_path / "run" / "ckpt.pt"
    before = ckpt.read_bytes()
    for init in ([], [f"--init_from={ckpt}"]):                  # neither a fresh run nor a fine-tune
        with pytest.raises(ValueError, match="already exists.*--init_from=resume"):
            train.main(flags + init)
    assert ckpt.read_bytes() == before
    with pytest.raises(ValueError, match="--n_layer=2 differs from the checkpoint's 1"):
        train.main(flags + ["--init_from=resume", "--n_layer=2", "--max_iters=4"])
    with pytest.raises(ValueError, match="already trained for 2 iterations"):
        train.main(flags + ["--init_from=resume"])
    assert ckpt.read_bytes() == before


def _ddp_worker(rank, flags, port):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import train
    train.main(flags)


def test_two_processes_match_one_with_gradient_accumulation(tmp_path, qa_file):
    """torchrun's data parallelism (2 processes, gloo) equals 1 process accumulating the same global batch."""
    import socket
    import train
    from checkpoint import load_checkpoint
    steps = ["--max_iters=3", "--gradient_accumulation_steps=2"]
    train.main(tiny_run_flags(tmp_path, qa_file, "one") + steps)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_ddp_worker, args=(tiny_run_flags(tmp_path, qa_file, "two") + steps, port), nprocs=2)
    a, b = load_checkpoint(str(tmp_path / "one")), load_checkpoint(str(tmp_path / "two"))
    assert a["iter_num"] == b["iter_num"] == 3
    for name in a["model"]:
        torch.testing.assert_close(b["model"][name], a["model"][name], atol=1e-5, rtol=0)


def test_refusion_ar_loss_from_an_ar_model_equals_its_loss_without_slot_boundaries():
    """An ARM loaded with --init_from into a ReFusion run: with nothing masked and the clean slots in
    their original order, the AR part of the hybrid loss is the ARM's next-token loss over the
    response, minus the labels that would cross a slot boundary."""
    import torch.nn.functional as F
    from train import hybrid_loss, load_pretrained
    ar_model = tiny_model(seed=6)
    refusion_model = tiny_model(seed=7)
    load_pretrained(refusion_model, {"model": ar_model.state_dict()})
    tokens, prompt_len, length = random_samples(8, B=4, T=40, vocab=36)
    tokens[tokens == 258] = 39                                        # the tiny model's pad id
    S = torch.tensor([4, 3, 8, 5])
    B, T = tokens.shape
    b = data.layout_slots(tokens, prompt_len, length, S, p=torch.full((B,), 0.5),
                          slot_is_masked=torch.zeros(B, T, dtype=torch.bool),
                          slot_rank=torch.arange(T).expand(B, T), mask_id=38)
    assert torch.equal(b.idx, tokens)                                 # nothing moved, nothing masked
    _, ar_part, mdm_part = hybrid_loss(refusion_model(b.idx, b.position_ids), b)
    # the reference: the ARM's cross-entropy at every response label except those at slot boundaries
    logits = ar_model(tokens, torch.arange(T).expand(B, T))
    ce, kept = [], 0
    for r in range(B):
        P, n = int(prompt_len[r]), int(length[r])
        for j in range(P, n - 1):                                     # position j predicts j + 1
            if (j + 1 - P) % int(S[r]) != 0:                           # j + 1 starts no new slot
                ce.append(F.cross_entropy(logits[r, j], tokens[r, j + 1]))
    torch.testing.assert_close(ar_part, torch.stack(ce).mean(), atol=TOL, rtol=0)
    assert mdm_part.item() == 0.0


@pytest.mark.parametrize("tie", [True, False])
def test_flops_per_token_is_what_torch_counts_for_a_training_step(tie):
    """The FLOP/s and MFU in the progress bar: flops_per_token x tokens equals the matrix-multiply
    FLOPs PyTorch's own counter sees in one forward + backward (dense attention kernel)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    from train import flops_per_token
    model = tiny_model(seed=9, tie_embeddings=tie).train()
    B, T = 3, 48
    idx = torch.randint(0, 40, (B, T))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx, torch.arange(T).expand(B, T)).sum().backward()
    assert flops_per_token(model, T) * B * T == counter.get_total_flops()


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # CPU autocast's rms_norm
@pytest.mark.parametrize("objective", ["refusion", "ar", "mdm"])
def test_bf16_autocast_trains_every_objective_close_to_float32(objective):
    """On CUDA training runs under bf16 autocast; the same code under CPU autocast (a stand-in for
    a GPU here) gives float32 logits, a loss within 1% and gradients for every weight."""
    from train import hybrid_loss, make_batch
    import train
    model = tiny_model(seed=12, causal=objective != "mdm").train()
    tokens, prompt_len, length = random_samples(13, B=4, T=40, vocab=36)
    tokens[tokens == 258] = 39                                        # the tiny model's pad id
    cfg = dict(train.DEFAULTS, objective=objective)
    batch = make_batch(cfg, tokens, prompt_len, length, 38, torch.Generator().manual_seed(0))
    reference = hybrid_loss(model(batch.idx, batch.position_ids, key_mask=batch.key_mask), batch)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(batch.idx, batch.position_ids, key_mask=batch.key_mask)
    assert logits.dtype == torch.float32
    loss = hybrid_loss(logits, batch)[0]
    loss.backward()
    assert abs(loss.item() - reference.item()) < 0.01 * reference.item()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_compile_never_changes_the_loss_or_the_gradients():
    """--compile=True (torch.compile) on a ReFusion batch: the same hybrid loss and gradients as eager."""
    import warnings
    from train import compile_model, hybrid_loss
    model = tiny_model(seed=10).train()
    tokens, prompt_len, length = random_samples(11, B=4, T=40, vocab=36)
    tokens[tokens == 258] = 39                                        # the tiny model's pad id
    batch = data.reorganize_slots(tokens, prompt_len, length, (4, 8), 38, torch.Generator().manual_seed(0))

    def loss_and_grads(forward):
        model.zero_grad()
        loss = hybrid_loss(forward(batch.idx, batch.position_ids, key_mask=batch.key_mask), batch)[0]
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    eager = loss_and_grads(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = compile_model(model)
    if compiled is model:
        pytest.skip(f"torch.compile cannot run here: {caught[0].message}")
    for a, b in zip(loss_and_grads(compiled), eager, strict=True):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)


def test_bench_at_toy_size_reuses_only_models_trained_with_the_same_settings(tmp_path, monkeypatch, capsys):
    """bench.py end to end: every row's TPF is its tokens / NFE and its speed-ups are over the ARM
    row and the first MDM row. A second run reuses the trained models; one interrupted part-way is
    resumed; a changed setting retrains the models, and with the ARM the fine-tune started from it."""
    import bench
    from checkpoint import load_checkpoint, save_checkpoint
    monkeypatch.chdir(tmp_path)                                       # data/ and bench/ land here
    flags = ["--datasets=arith", "--max_iters=2", "--finetune_iters=2", "--num_prompts=2", "--batch_size=4",
             "--n_layer=1", "--n_head=2", "--n_embd=32", "--max_new_tokens=32", "--num_blocks=2"]
    with pytest.raises(ValueError, match="no arith validation prompt leaves room for 176 new tokens"):
        bench.main(flags + ["--max_new_tokens=176"])                  # refused before any training
    assert not (tmp_path / "bench" / "arith-ar").exists()
    bench.main(flags)
    rows = json.loads((tmp_path / "bench" / "bench.json").read_text())["rows"]
    ar_row, mdm_row = rows[0], next(r for r in rows if r["method"] == "mdm")
    assert ar_row["label"] == "ARM" and ar_row["nfe"] == ar_row["tokens"]     # one token per forward
    for r in rows:
        assert r["tpf"] == r["tokens"] / r["nfe"]
        assert r["speedup_vs_ar"] == r["tokens_per_s"] / ar_row["tokens_per_s"]
        assert r["speedup_vs_mdm"] == r["tokens_per_s"] / mdm_row["tokens_per_s"]
        assert 0.0 <= r["quality"]["accuracy"] <= 1.0
    names = ["arith-ar", "arith-mdm", "arith-refusion", "arith-refusion-ft"]
    ckpts = [tmp_path / "bench" / n / "ckpt.pt" for n in names]
    stamps = lambda: [p.stat().st_mtime_ns for p in ckpts]           # noqa: E731
    first = stamps()
    interrupted = load_checkpoint(str(ckpts[1]))
    interrupted["iter_num"] = 1                                       # as if stopped after one step
    save_checkpoint(str(ckpts[1].parent), interrupted)
    capsys.readouterr()
    bench.main(flags)
    out = capsys.readouterr().out
    assert out.count("== reusing") == 3 and "== resuming bench/arith-mdm at iteration 1 of 2" in out
    assert load_checkpoint(str(ckpts[1]))["iter_num"] == 2
    assert [a == b for a, b in zip(stamps(), first)] == [True, False, True, True]
    second = stamps()
    bench.main([f for f in flags if f != "--max_iters=2"] + ["--max_iters=3"])
    assert all(a != b for a, b in zip(stamps(), second))             # all four retrained, the fine-tune too


# ----------------------------------------------------------------------------------------------
# bad input gets a clear error and loses nothing

@pytest.mark.parametrize("prompt,kwargs,message", [
    ([], {}, "the prompt is empty"),
    (list(range(120)), {}, r"prompt \(120 tokens\) \+ generation \(16 tokens.*exceeds the model's context of 128"),
    ([1, 2], dict(max_new_tokens=0), "max_new_tokens=0: ask for at least one"),
    ([1, 2], dict(slot_size=0), "slot_size=0: a slot holds at least one token"),
    ([1, 2], dict(slot_size=32), "slot_size=32 is larger than max_new_tokens=16"),
    ([1, 2], dict(num_blocks=3), "2 slots of 8 tokens .* cannot be cut into num_blocks=3"),
    ([1, 2], dict(slot_threshold=-0.1), "slot_threshold=-0.1: thresholds are probabilities >= 0"),
    ([1, 2], dict(token_threshold=float("nan")), "token_threshold=nan"),
    ([1, 2], dict(temperature=-1.0), "temperature=-1.0: use 0 for greedy"),
])
def test_decoder_settings_errors_name_the_setting_and_the_fix(prompt, kwargs, message):
    settings = dict(max_new_tokens=16, slot_size=8, mask_id=38, eos_id=39) | kwargs
    with pytest.raises(ValueError, match=message):
        generate_refusion(tiny_model(), prompt, **settings)


def test_bad_checkpoints_are_refused_and_never_run_code(tmp_path, qa_file):
    import pickle
    import train
    from checkpoint import load_checkpoint
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*ckpt.pt: train one first"):
        load_checkpoint(str(tmp_path / "missing"))
    train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=2"])
    good = (tmp_path / "run" / "ckpt.pt").read_bytes()
    marker = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    cases = {"garbage.pt": b"not a checkpoint at all", "truncated.pt": good[:len(good) // 2], "empty.pt": b"",
             "crafted.pt": pickle.dumps({"model": Payload(), "model_args": {}}, protocol=2)}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match="is not a readable checkpoint .*retrain it or point to another file"):
            load_checkpoint(str(tmp_path / name))
    assert not marker.exists()                                     # the crafted file's code never ran
    old = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)
    old["format"] = 0
    torch.save(old, tmp_path / "old.pt")
    with pytest.raises(ValueError, match="has checkpoint format 0, this code reads format 1; retrain"):
        load_checkpoint(str(tmp_path / "old.pt"))
    torch.save({"weights": torch.zeros(2)}, tmp_path / "foreign.pt")
    with pytest.raises(ValueError, match="not a checkpoint written by train.py"):
        load_checkpoint(str(tmp_path / "foreign.pt"))
    assert (tmp_path / "run" / "ckpt.pt").read_bytes() == good


def test_training_input_errors_lose_nothing(tmp_path, qa_file):
    import train
    flags = tiny_run_flags(tmp_path, qa_file, "run")
    train.main(flags + ["--max_iters=2"])
    ckpt = tmp_path / "run" / "ckpt.pt"
    before = ckpt.read_bytes()
    other = tiny_run_flags(tmp_path, qa_file, "other")
    for extra, message in [
        (["--device=cuda"] if not torch.cuda.is_available() else ["--device=tpu"], "--device=.*use"),
        (["--n_embd=20", "--n_head=4"], "head_dim=5 must be even"),
        (["--too_long=truncate"], "--too_long='truncate': choose skip or fail"),
        (["--block_size=24", "--too_long=fail"], "is .* tokens, longer than block_size=24; raise --block_size"),
        (["--gradient_accumulation_steps=0"], "--gradient_accumulation_steps=0: must be positive"),
        (["--n_kv_head=-2"], "--n_kv_head=-2: must be 0 or more"),
        (["--grad_clip=-1.0"], "--grad_clip=-1.0: must be 0 or more"),
        (["--mask_eps=2.0"], r"--mask_eps=2.0: must be in \[0, 1\)"),
    ]:
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            train.main(other + extra + ["--max_iters=2"])
    assert ckpt.read_bytes() == before and not (tmp_path / "other" / "ckpt.pt").exists()


def test_a_loss_that_becomes_nan_stops_and_keeps_the_last_good_checkpoint(tmp_path, qa_file):
    import train
    flags = tiny_run_flags(tmp_path, qa_file, "run")
    train.main(flags + ["--max_iters=2"])
    ckpt = tmp_path / "run" / "ckpt.pt"
    before = ckpt.read_bytes()
    # an absurd learning rate overflows the weights after one step, as a diverging run would
    with pytest.raises(SystemExit, match=r"loss became nan at iteration \d; the last good checkpoint"):
        train.main(flags + ["--max_iters=6", "--init_from=resume", "--learning_rate=1e30", "--grad_clip=0"])
    assert ckpt.read_bytes() == before


@pytest.mark.parametrize("sig", ["SIGINT", "SIGKILL"])
def test_killed_training_resumes_to_the_same_weights(tmp_path, qa_file, sig):
    """Interrupted (Ctrl-C: saves at once) or killed (resumes from the last periodic checkpoint),
    then resumed: the same final weights as a run that was never stopped."""
    import signal
    import subprocess
    import sys
    import time
    from checkpoint import load_checkpoint
    flags = tiny_run_flags(tmp_path, qa_file, "straight") + ["--max_iters=400", "--eval_interval=50"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")]
    subprocess.run(cmd + flags, check=True, capture_output=True, env=env)
    stopped = [f.replace("straight", "stopped") for f in flags]
    proc = subprocess.Popen(cmd + stopped, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    ckpt = tmp_path / "stopped" / "ckpt.pt"
    while not ckpt.exists() and proc.poll() is None:       # stop it after the first checkpoint
        time.sleep(0.05)
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=60)
    if sig == "SIGINT":
        assert proc.returncode == 1 and b"--init_from=resume" in err
    stopped_at = load_checkpoint(str(ckpt))["iter_num"]
    assert 0 < stopped_at < 400
    subprocess.run(cmd + stopped + ["--init_from=resume"], check=True, capture_output=True, env=env)
    a, b = load_checkpoint(str(tmp_path / "straight")), load_checkpoint(str(ckpt))
    for name in a["model"]:
        torch.testing.assert_close(b["model"][name], a["model"][name], atol=0, rtol=0)


def test_sampler_cli_prints_one_json_object_per_sample(tmp_path, qa_file, capsys):
    import sampler
    import train
    train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=2"])
    capsys.readouterr()
    out_dir = f"--out_dir={tmp_path / 'run'}"
    sampler.main([out_dir, "--json", "--num_samples=2", "--max_new_tokens=8", "--slot_size=4", "--num_blocks=1"])
    sampler.main([out_dir, "--json", "--prompt=What is 7 + 7?", "--max_new_tokens=6", "--slot_size=4",
                  "--num_blocks=2", "--method=refusion"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 3 and lines[2]["prompt"] == "What is 7 + 7?"
    for row, limit in zip(lines, (8, 8, 6)):
        assert {"text", "tokens", "nfe", "tpf", "seconds", "tokens_per_s"} <= set(row)
        assert 0 < row["tokens"] <= limit and row["tpf"] == round(row["tokens"] / row["nfe"], 3)
    for bad, message in [(["--num_samples=0"], "--num_samples=0"), (["--prompt_file=nope.txt"], "no such file"),
                         (["--method=mdm"], "trained with a causal objective")]:
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            sampler.main([out_dir] + bad)


def test_sampler_prepares_damaged_validation_data_anew(tmp_path, qa_file, capsys):
    import sampler
    import train
    train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=2"])
    val_bin = next((tmp_path / "data").glob("*/val.bin"))
    whole = val_bin.read_bytes()
    val_bin.write_bytes(whole[:-4])                                   # cut short
    sampler.main([f"--out_dir={tmp_path / 'run'}", "--num_samples=1", "--max_new_tokens=8", "--num_blocks=1", "--json"])
    assert val_bin.read_bytes() == whole
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["tokens"] >= 1


def test_checkpoint_tokenizer_mismatch_and_crashed_writes_lose_nothing(tmp_path, qa_file, monkeypatch):
    import checkpoint
    import train
    flags = tiny_run_flags(tmp_path, qa_file, "run")
    train.main(flags + ["--max_iters=2"])
    ckpt = tmp_path / "run" / "ckpt.pt"
    before = ckpt.read_bytes()
    foreign = torch.load(ckpt, weights_only=True)                    # a checkpoint of another tokenizer
    foreign["meta"]["tokenizer"] = "gpt2"
    torch.save(foreign, tmp_path / "gpt2.pt")
    with pytest.raises(ValueError, match="trained with the 'gpt2' tokenizer but this run uses 'bytes'"):
        train.main(tiny_run_flags(tmp_path, qa_file, "ft") + [f"--init_from={tmp_path / 'gpt2.pt'}"])

    def crash(obj, path):                                             # the disk fills up mid-write
        open(path, "wb").write(b"partial")
        raise OSError("No space left on device")
    monkeypatch.setattr(checkpoint.torch, "save", crash)
    with pytest.raises(OSError, match="No space left"):
        train.main(flags + ["--init_from=resume", "--max_iters=4"])
    assert ckpt.read_bytes() == before                                # the old checkpoint is intact


def test_small_data_warns_and_compile_falls_back_where_it_cannot_run(tmp_path, qa_file, monkeypatch, capsys):
    import train
    monkeypatch.setattr(train.shutil, "which", lambda name: None)     # no C compiler on this machine
    with pytest.warns(UserWarning, match="torch.compile cannot run here"):
        train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=1", "--compile=True", "--batch_size=200"])
    assert "fewer than one batch of 200; batches draw samples with replacement" in capsys.readouterr().err


def test_resume_takes_the_checkpoints_settings_and_init_from_its_shape(tmp_path, qa_file):
    import train
    from checkpoint import load_checkpoint
    train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=2", "--batch_size=3"])
    out = f"--out_dir={tmp_path / 'run'}"
    train.main([out, "--init_from=resume", "--max_iters=4"])            # no other flag repeated
    cfg = load_checkpoint(str(tmp_path / "run"))["config"]
    assert (cfg["batch_size"], cfg["n_embd"], cfg["dataset"], cfg["max_iters"]) == (3, 16, qa_file[0], 4)
    ft = tiny_run_flags(tmp_path, qa_file, "ft")
    with pytest.raises(ValueError, match="--n_embd=32 differs from the checkpoint's 16; a fine-tune keeps"):
        train.main(ft + [f"--init_from={tmp_path / 'run'}", "--n_embd=32"])
    with pytest.raises(FileNotFoundError, match="--init_from=Resume: use 'scratch', 'resume', or the path"):
        train.main(ft + ["--init_from=Resume"])
    assert not (tmp_path / "ft").exists()
