"""What a decode would make a GPU wait for, counted on the CPU (support/device_reads.py): reads
from the device and attention shapes, each within its budget for every decoder (SPEC section 4.4),
so that a regression fails here without a GPU."""

import math

import pytest
import torch

from helpers import PROMPTS, SETTINGS, tiny_model
from kvcache import KEY_BUCKET
from sampler import DEFAULTS, GPU_EOS_EVERY, DecodeSettings, generate_next_token, make_decoder
from support.device_reads import DecodeCounter

LENGTHS = len({len(p) for p in PROMPTS})  # distinct prompt lengths


def count(decode, model, prompts=PROMPTS):
    """(the Generations, the DecodeCounter) of decoding every prompt in one counter."""
    with DecodeCounter() as seen:
        out = []
        for p in prompts:
            seen.new_decode()
            out.append(decode(model, p))
    return out, seen


def refusion_decoders(ids, max_new_tokens=16):
    for S, blocks, slot_threshold, token_threshold in SETTINGS:
        for infill in ("paper", "speculative"):
            yield make_decoder(dict(DEFAULTS, method="refusion", max_new_tokens=max_new_tokens,
                                    slot_size=S, serial_num_blocks=blocks, infill=infill,
                                    slot_threshold=slot_threshold,
                                    token_threshold=token_threshold), ids, None)[0]


def test_the_counter_sees_each_kind_of_read_and_made_tensor():
    x = torch.arange(6)
    with DecodeCounter() as seen:
        seen.new_decode()
        torch.tensor([1, 2])                      # before the first pass: the prefill's, free
        tiny_model()(x[None] % 40, x[None])       # a pass
        int(x[0])
        bool((x > 2).any())
        x.tolist()
        x[x > 2]
        (x > 2).nonzero()
        torch.tensor([3])                         # after the first pass: counted
        torch.nonzero_static(x > 2, size=3)       # no read: its size is known
    assert seen.passes == 1 and seen.made == 1
    assert seen.reads == {"a value": 2, "tolist": 1, "boolean indexing": 1, "nonzero": 1}
    assert len(seen.shapes) == 1                  # 2 layers, one shape


def test_next_token_decoding_reads_once_every_16_tokens_and_feeds_few_shapes():
    """The GPU rule (eos_every=GPU_EOS_EVERY, a GPU's default): a read per 16 tokens, no tensor
    made from Python data after the prefill, and few attention shapes (kvcache.py's buckets)."""
    model = tiny_model(block_size=256)
    settings = DecodeSettings(64, eos_every=GPU_EOS_EVERY)
    prompts = [[t % 40 for t in p] for p in PROMPTS]
    out, seen = count(lambda m, p: generate_next_token(m, p, settings, eos_ids=(-1,)), model,
                      prompts)
    assert all(len(g.tokens) == 64 for g in out)  # no EOS: every decode runs to the end
    assert seen.total_reads() == len(PROMPTS) * 64 // 16          # a read per 16 tokens
    assert seen.made == 0
    assert len(seen.shapes) <= 2 * LENGTHS + 2


def test_next_token_decoding_past_an_eos_gives_the_same_tokens_and_counts_the_extra_passes(
        refusion_model):
    model, ids = refusion_model
    ended = 0
    for p in PROMPTS:
        every = generate_next_token(model, p, DecodeSettings(16, eos_every=1),
                                    eos_ids=ids["eos_ids"])
        sparse = generate_next_token(model, p, DecodeSettings(16, eos_every=5),
                                     eos_ids=ids["eos_ids"])
        assert (sparse.tokens, sparse.trace) == (every.tokens, every.trace)
        assert every.nfe == len(every.tokens)
        assert sparse.nfe == min(math.ceil(len(every.tokens) / 5) * 5, 16)
        assert sum(sparse.step_nfe) == sparse.nfe
        ended += every.tokens[-1] in ids["eos_ids"]
    assert ended >= 2                                      # decodes that ended at an EOS


def test_refusion_reads_at_most_3_times_a_step_and_attends_to_bucketed_key_lengths(
        refusion_model):
    """A plan, a verify and an infill round each read at most 3 times; every pass attends to a
    key length that is a multiple of KEY_BUCKET (or the cache's whole length)."""
    model, ids = refusion_model
    for decode in refusion_decoders(ids):
        out, seen = count(decode, model)
        steps = sum(len(g.trace) for g in out)
        nfe = sum(g.nfe for g in out)
        units = steps + nfe / 2             # plans + verifies + infill rounds (2 passes each)
        assert seen.passes == nfe
        assert seen.total_reads() <= 3 * units, (seen.reads, units)
        keys = {k[2] for _, k, _, _ in seen.shapes}
        assert all(n % KEY_BUCKET == 0 or n == model.config.block_size for n in keys), keys


def test_the_mdm_reads_at_most_3_times_a_step(mdm_model):
    """Each denoising step reads its masked positions and the pairs it committed, and a decode its
    tokens at the end."""
    model, ids = mdm_model
    decode, _ = make_decoder(dict(DEFAULTS, method="mdm", max_new_tokens=16, steps=8,
                                  block_length=4), ids, None)
    out, seen = count(decode, model)
    assert sum(g.nfe for g in out) == 8 * len(PROMPTS)
    assert seen.total_reads() == (3 * 8 + 1) * len(PROMPTS)


@pytest.mark.parametrize("slot_size", [1, 4, 16])
def test_exact_verification_reads_once_a_pass(refusion_model, slot_size):
    """verify="exact" (SPEC 4.5) reads its predictions and drafts together, once a pass, and every
    pass attends to a bucketed key length."""
    model, ids = refusion_model
    decode, _ = make_decoder(dict(DEFAULTS, method="refusion", max_new_tokens=16,
                                  slot_size=slot_size, verify="exact"), ids, None)
    out, seen = count(decode, model)
    assert seen.passes == sum(g.nfe for g in out) == seen.total_reads()
    keys = {k[2] for _, k, _, _ in seen.shapes}
    assert all(n % KEY_BUCKET == 0 or n == model.config.block_size for n in keys), keys
