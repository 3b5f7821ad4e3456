"""What a decode would make a GPU wait for, counted on the CPU (support/device_reads.py): reads
from the device, tensors made from Python data after the prefill, and distinct attention shapes,
each within its budget for every decoder, so that a regression fails here without a GPU."""

import math

import pytest
import torch

import sampler
from helpers import PROMPTS, SETTINGS, tiny_model
from sampler import DecodeSettings, generate_next_token
from support.device_reads import DecodeCounter
from support.sampling import DEFAULTS, make_decoder

LENGTHS = len({len(p) for p in PROMPTS})  # distinct prompt lengths


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    """The decoders' GPU choices on the CPU: passes padded to bucketed widths (ReFusion) and a
    look for EOS every GPU_EOS_EVERY tokens (next-token decoding)."""
    monkeypatch.setitem(sampler.PAD_WIDTHS, "cpu", True)
    monkeypatch.setitem(sampler.EOS_EVERY, "cpu", sampler.GPU_EOS_EVERY)


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


def test_next_token_decoding_reads_once_every_16_tokens_and_feeds_few_shapes(as_on_a_gpu):
    model = tiny_model(block_size=256)
    settings = DecodeSettings(64)
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
    settings = DecodeSettings(16)
    ended = 0
    for p in PROMPTS:
        every = generate_next_token(model, p, settings, eos_ids=ids["eos_ids"], eos_every=1)
        sparse = generate_next_token(model, p, settings, eos_ids=ids["eos_ids"], eos_every=5)
        assert (sparse.tokens, sparse.trace) == (every.tokens, every.trace)
        assert every.nfe == len(every.tokens)
        assert sparse.nfe == min(math.ceil(len(every.tokens) / 5) * 5, 16)
        assert sum(sparse.step_nfe) == sparse.nfe
        ended += every.tokens[-1] in ids["eos_ids"]
    assert ended >= 2                                      # decodes that ended at an EOS


def test_refusion_reads_at_most_3_times_a_step_and_makes_no_tensor_from_python(refusion_model,
                                                                               as_on_a_gpu):
    model, ids = refusion_model
    for decode in refusion_decoders(ids):
        out, seen = count(decode, model)
        steps = sum(len(g.trace) for g in out)
        nfe = sum(g.nfe for g in out)
        units = steps + nfe / 2             # plans + verifies + infill rounds (2 passes each)
        assert seen.passes == nfe
        assert seen.total_reads() <= 3 * units, (seen.reads, units)
        assert seen.made == 0
        assert len(seen.shapes) <= 4 * LENGTHS + 4, sorted(seen.shapes)


def test_the_mdm_reads_nothing_per_step(mdm_model):
    model, ids = mdm_model
    decode, _ = make_decoder(dict(DEFAULTS, method="mdm", max_new_tokens=16, steps=8,
                                  block_length=4), ids, None)
    out, seen = count(decode, model)
    assert sum(g.nfe for g in out) == 8 * len(PROMPTS)
    assert seen.total_reads() == 2 * len(PROMPTS)         # the trace and the tokens, at the end
    assert seen.made == 0


def test_the_gpu_choices_change_no_token(refusion_model, monkeypatch):
    """Padded widths and sparse EOS looks give every decoder the tokens, trace and NFE it gives
    without them (next-token decoding: the same tokens, its passes past EOS counted)."""
    model, ids = refusion_model
    decoders = list(refusion_decoders(ids))
    plain = [[decode(model, p) for p in PROMPTS] for decode in decoders]
    monkeypatch.setitem(sampler.PAD_WIDTHS, "cpu", True)
    for decode, want in zip(decoders, plain):
        got = [decode(model, p) for p in PROMPTS]
        assert [(g.tokens, g.trace, g.nfe) for g in got] == [(w.tokens, w.trace, w.nfe)
                                                             for w in want]
