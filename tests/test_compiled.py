"""Compiled decoding (support/compiled.py): padded passes on bucketed shapes give every decoder the
tokens, steps and NFE of the model itself, in a few graphs."""

import math

import pytest
import torch

from helpers import PROMPTS, SETTINGS, tiny_model
from support import sampling
from sampler import DEFAULTS, make_decoder
from support.benchmark import compiled_vs_eager
from support.compiled import WIDE, bucket, CompiledModel


def uncompiled(model):
    """A CompiledModel running its graph's body eagerly: the padding, masks and cache writes of a
    compiled pass, without the compiler's own rounding."""
    wrapped = CompiledModel(model)
    wrapped.compiled = wrapped._forward
    return wrapped


def decoders(ids):
    """Every decoder of a causal model: ReFusion (each setting, both infills, exact verification)
    and next-token."""
    for S, blocks, slot_threshold, token_threshold in SETTINGS:
        for infill in ("paper", "speculative"):
            yield make_decoder(dict(DEFAULTS, method="refusion", max_new_tokens=16, slot_size=S,
                                    serial_num_blocks=blocks, slot_threshold=slot_threshold,
                                    token_threshold=token_threshold, infill=infill), ids, None)[0]
    for S in (4, 16):                                  # verify="exact" (SPEC 4.5)
        yield make_decoder(dict(DEFAULTS, method="refusion", max_new_tokens=16, slot_size=S,
                                verify="exact"), ids, None)[0]
    yield make_decoder(dict(DEFAULTS, method="next_token", max_new_tokens=16), ids, None)[0]


def same_generations(decode, model, other):
    for p in PROMPTS:
        a, b = decode(model, p), decode(other, p)
        assert (b.tokens, b.trace, b.nfe, b.step_nfe) == (a.tokens, a.trace, a.nfe, a.step_nfe)


def test_a_pass_is_padded_to_its_bucket():
    assert [bucket(T) for T in (1, 2, 8, 9, 16, 17, WIDE)] == [1, 8, 8, 16, 16, 32, WIDE]
    assert [bucket(T) for T in (WIDE + 1, 300)] == [WIDE + 1, 300]     # wider: one dynamic graph


def test_padded_passes_give_the_models_logits_and_cache():
    model = tiny_model(block_size=512)                    # positions up to 390 below
    padded = uncompiled(model)
    a, b = model.new_kv_cache(200, max_batch=3), padded.new_kv_cache(200, max_batch=3)
    with torch.inference_mode():
        def both(idx, pos, **kw):
            x, y = model(idx, pos, kv_cache=a, **kw), padded(idx, pos, kv_cache=b, **kw)
            torch.testing.assert_close(y, x)
            assert a.length == b.length
            torch.testing.assert_close(b.kv[..., :b.length, :], a.kv[..., :a.length, :])
        both(torch.randint(0, 40, (1, 13)), torch.arange(13)[None], logits_from=-1)  # prefill
        both(torch.randint(0, 40, (1, 5)), torch.arange(20, 25)[None], logits_from=2)
        for c in (a, b):                                  # an infill round: 3 rows
            c.crop(15)
            c.repeat_prefix(3)
        both(torch.randint(0, 40, (3, 4)), torch.arange(30, 42).view(3, 4))
        both(torch.randint(0, 40, (3, 20)), torch.arange(40, 100).view(3, 20))  # padded to 32
        both(torch.randint(0, 40, (3, 130)), torch.arange(390).view(3, 130))    # wider than WIDE
        x = torch.randint(0, 40, (2, 11))                 # no cache: causal, then a given mask
        torch.testing.assert_close(padded(x, torch.arange(11).expand(2, -1), logits_from=4),
                                   model(x, torch.arange(11).expand(2, -1), logits_from=4))
        mask = torch.rand(2, 1, 11, 11) < 0.5
        mask[..., torch.arange(11), torch.arange(11)] = True
        torch.testing.assert_close(padded(x, torch.arange(11).expand(2, -1), attn_mask=mask),
                                   model(x, torch.arange(11).expand(2, -1), attn_mask=mask))


def test_padded_passes_take_every_decoder_along_the_models_path(refusion_model, mdm_model):
    model, ids = refusion_model
    for decode in decoders(ids):
        same_generations(decode, model, uncompiled(model))
    model, ids = mdm_model
    for block_length in (0, 4):
        decode, _ = make_decoder(dict(DEFAULTS, method="mdm", max_new_tokens=16, steps=8,
                                      block_length=block_length), ids, None)
        same_generations(decode, model, uncompiled(model))


def test_compiled_decoding_gives_eager_tokens_in_a_few_graphs(refusion_model):
    """torch.compile itself, as the benchmarks run it (compiled_vs_eager): verify="exact", ReFusion
    with infill rows and next-token decoding, each in at most 8 new graphs, every prompt's tokens
    the eager ones. A graph is compiled once a process: a decoder whose pass shapes an earlier one
    compiled adds none (ReFusion after exact verification may not), the first always some."""
    model, ids = refusion_model
    every = list(decoders(ids))
    result = compiled_vs_eager({"exact": (model, every[-2]), "refusion": (model, every[1]),
                                "next_token": (model, every[-1])}, PROMPTS[:4])
    for row in result["rows"]:
        assert row["identical"] == 1.0 and 0 <= row["graphs"] <= 8, row
    assert result["rows"][0]["graphs"] >= 1


def test_compile_takes_one_prompt_at_a_time():
    with pytest.raises(ValueError, match="--compile decodes one prompt at a time"):
        sampling.check_sample_config(dict(DEFAULTS, compile=True, batch_size=2))


class Poisoned:
    """The model as a CUDA graph runs it: each pass writes its output where the last pass's was,
    so that every output handed out before is overwritten (here: NaN) when the next pass starts.
    A decoder that reads an output after a later pass then reads NaN."""

    def __init__(self, model):
        self.model, self.config, self.parameters = model, model.config, model.parameters
        self.new_kv_cache = model.new_kv_cache
        self.outputs = []

    def __call__(self, *args, **kwargs):
        for old in self.outputs:
            old.fill_(math.nan)
        self.outputs = [self.model(*args, **kwargs)]
        return self.outputs[0]


def test_no_decoder_reads_an_output_after_the_next_pass(refusion_model, mdm_model):
    """Every decoder gives through Poisoned the tokens, trace and NFE of the plain model: none
    keeps a pass's output past the next pass without copying it (support/compiled.py)."""
    model, ids = refusion_model
    for decode in decoders(ids):
        same_generations(decode, model, Poisoned(model))
    model, ids = mdm_model
    decode, _ = make_decoder(dict(DEFAULTS, method="mdm", max_new_tokens=16, steps=8,
                                  block_length=4), ids, None)
    same_generations(decode, model, Poisoned(model))


def test_lowered_code_paths_compile_into_a_cache_of_their_own(monkeypatch):
    """ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA get Inductor a cache folder named after them
    (tests/test_train.py shows what a shared one did); a folder the user chose is kept."""
    import os

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from support.compiled import ISA_SETTINGS, separate_compile_cache
    for name in ISA_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # as Inductor leaves it
    assert separate_compile_cache() is None                             # nothing lowered
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    folder = default_cache_dir() + "_aten_cpu_capability-avx2_onednn_max_cpu_isa-avx2"
    assert separate_compile_cache() == folder == os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert separate_compile_cache() is None                             # set once
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/srv/my-cache")
    assert separate_compile_cache() is None and os.environ["TORCHINDUCTOR_CACHE_DIR"] == \
        "/srv/my-cache"
