"""The model's configuration (model.py), beyond the specification."""

import inspect

import pytest

import torch

from helpers import tiny_model
from model import ModelConfig


@pytest.mark.parametrize("theta", [0.0, -1.0, float("nan"), float("inf")])
def test_a_rope_theta_that_is_not_positive_and_finite_is_refused(theta):
    """Every rotary angle is position / theta ** (2i / head_dim): a NaN or infinite base (or 0)
    makes angles NaN or constant, and the loss NaN only after data preparation and a training
    step."""
    with pytest.raises(ValueError, match=f"rope_theta={theta}: the base of the rotary angles "
                                         "must be positive"):
        ModelConfig(rope_theta=theta)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("logits_from", [0, 3, 7, -1])
def test_logits_from_computes_the_suffix_of_every_logit_and_the_same_cache(causal, logits_from):
    """The output layer only where a decoder reads it: the same logits for those tokens as a pass
    that computes every one, alone, after a cache, and under an attention mask, and the same
    keys/values cached."""
    model = tiny_model(seed=3, causal=causal)
    g = torch.Generator().manual_seed(3)
    idx, pos = torch.randint(0, 40, (2, 8), generator=g), torch.arange(8).expand(2, 8)
    with torch.no_grad():
        passes = [dict(), dict(attn_mask=torch.rand(2, 1, 8, 8, generator=g) > 0.3)]
        if causal:
            passes.append(dict(kv_cache="prefix"))
        for kwargs in passes:
            caches = []
            for f in (0, logits_from):
                if kwargs.get("kv_cache") == "prefix":  # one row, after 5 cached tokens
                    cache = model.new_kv_cache(13)
                    model(torch.arange(5)[None] + 1, torch.arange(5)[None], kv_cache=cache)
                    caches.append(cache)
                    out = model(idx[:1], pos[:1] + 5, kv_cache=cache, logits_from=f)
                else:
                    out = model(idx, pos, logits_from=f, **kwargs)
                if f == 0:
                    every = out
            assert out.shape == (len(every), 8 - logits_from if logits_from >= 0 else 1, 40)
            torch.testing.assert_close(out, every[:, logits_from:], atol=1e-6, rtol=0)
            if caches:
                assert torch.equal(caches[0].kv, caches[1].kv)
                assert caches[0].length == caches[1].length


def contract(protocol):
    """{method: its parameter names, self left out}, {attribute} that a Protocol names, its
    protocol bases' included."""
    import typing
    methods, attributes = {}, set()
    for cls in reversed(protocol.__mro__):
        if cls in (object, typing.Protocol, typing.Generic):
            continue
        attributes |= set(vars(cls).get("__annotations__", {}))
        for name, value in vars(cls).items():
            if inspect.isfunction(value) and (name == "__call__" or not name.startswith("_")):
                methods[name] = list(inspect.signature(value).parameters)[1:]
    return methods, attributes


def parameter_names(obj, name):
    """The parameter names of obj's method `name` (a module's __call__: its forward), or None where
    it takes any (*args, **kwargs: a wrapper that passes them on)."""
    if name == "__call__" and isinstance(obj, torch.nn.Module):
        name = "forward"
    parameters = inspect.signature(getattr(obj, name)).parameters.values()
    if {p.kind for p in parameters} >= {inspect.Parameter.VAR_POSITIONAL,
                                        inspect.Parameter.VAR_KEYWORD}:
        return None
    return [p.name for p in parameters]


def test_every_model_and_cache_keeps_the_contract_the_decoders_rely_on():
    """kvcache.LayerCache and DecodeCache and model.DecoderModel name what each side calls; every
    implementation has each method with the same parameters, and each attribute."""
    import queue

    from kvcache import DecodeCache, LayerCache
    from model import DecoderModel
    from support.batching import BatchedCache, BatchedModel
    from support.benchmark import TimedModel
    from support.compiled import CompiledModel, NewKeys
    model = tiny_model()
    cache = model.new_kv_cache(16, max_batch=2)
    implementations = [
        (cache, DecodeCache, ()), (cache, LayerCache, ()),
        (BatchedCache([cache, model.new_kv_cache(16)], 32), LayerCache, ()),
        (NewKeys(cache.kv), LayerCache, ("attention_mask",)),   # a compiled pass gives its mask
        (model, DecoderModel, ()), (CompiledModel(model), DecoderModel, ()),
        (BatchedModel(model, queue.SimpleQueue(), 0), DecoderModel, ()),
        (TimedModel(model), DecoderModel, ())]
    broken = []
    for obj, protocol, exempt in implementations:
        methods, attributes = contract(protocol)
        assert methods and (protocol is LayerCache or attributes)
        for name, names in methods.items():
            if name in exempt:
                continue
            if not callable(getattr(obj, name, None)):
                broken.append(f"{type(obj).__name__} has no {name}")
            elif parameter_names(obj, name) not in (None, names):
                broken.append(f"{type(obj).__name__}.{name}{parameter_names(obj, name)} is not "
                              f"{protocol.__name__}'s {names}")
        broken += [f"{type(obj).__name__} has no {a}" for a in attributes if not hasattr(obj, a)]
    assert broken == [], "\n".join(broken)
