"""The model's configuration (model.py), beyond the specification."""

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
                assert torch.equal(caches[0].kv, caches[1].kv) and caches[0].pos == caches[1].pos
