"""Decoder settings, the choice of tokens, the step trace and SpeculativeInfill's hooks
(sampler.py), beyond the specification."""

import re
from dataclasses import MISSING, fields

import pytest
import torch
import torch.nn as nn

from configurator import check_context
from support.sampling import note_mismatch
from helpers import PROMPTS, SETTINGS, PathCounter, tiny_model
from sampler import (DecodeSettings, MDMSettings, RefusionSettings, draft_tokens,
                     generate_next_token, generate_refusion, generate_refusion_plain)
from sampler import DECODERS, DEFAULTS, make_decoder
from test_refusion import (EOS, MASK, V, BadDrafterOracle, OracleModel, assert_same_or_tie,
                           oracle_target)

class PrefersSpecialIds(nn.Module):
    """A tiny model whose logits favour some ids by +50 (an undertrained model that drafts
    masks)."""

    def __init__(self, model, ids):
        super().__init__()
        self.model, self.ids, self.config = model, ids, model.config

    def new_kv_cache(self, max_len, max_batch=1):
        return self.model.new_kv_cache(max_len, max_batch)

    def forward(self, idx, position_ids, kv_cache=None, attn_mask=None, logits_from=0):
        logits = self.model(idx, position_ids, kv_cache=kv_cache, attn_mask=attn_mask,
                            logits_from=logits_from)
        logits[..., self.ids] += 50.0
        return logits


@pytest.mark.parametrize("method", ["refusion", "next_token", "mdm"])
def test_no_decoder_writes_the_mask_or_pad_id(method):
    """No training label is the mask or the pad id, so the CLI's decoders never write either, even
    from a model that prefers them; the mask id would read as a position still to be decoded."""
    ids = {"eos_ids": (39,), "mask_id": 38, "pad_id": 37}
    model = PrefersSpecialIds(tiny_model(causal=method != "mdm"), [37, 38])
    assert set(model(torch.tensor([[1, 2, 3]]),
                     torch.tensor([[0, 1, 2]])).argmax(-1)[0].tolist()) <= {37, 38}
    cfg = dict(DEFAULTS, method=method, max_new_tokens=16, serial_num_blocks=1, slot_threshold=0.5,
               token_threshold=0.0)
    run, _ = make_decoder(cfg, ids, torch.Generator())
    out = run(model, [1, 2, 3]).tokens
    assert len(out) > 0 and not {37, 38} & set(out)
    generate, Settings = DECODERS[method]
    kwargs = dict(eos_ids=(39,)) | ({} if method == "next_token" else dict(mask_id=38))
    # without the ban, the pad id wins
    assert 37 in generate(model, [1, 2, 3], Settings(16), **kwargs).tokens


@pytest.mark.parametrize("method", ["refusion", "next_token", "mdm"])
def test_decoder_refuses_a_model_of_the_other_attention_with_the_fix(method):
    model = tiny_model(causal=method == "mdm")      # the wrong kind of model for each method
    generate, Settings = DECODERS[method]
    ids = {"eos_ids": (39,)} if method == "next_token" else {"eos_ids": (39,), "mask_id": 38}
    fix = ("trained with a causal objective.*use --method=refusion or --method=next_token"
           if method == "mdm" else "bidirectional attention.*use --method=mdm")
    with pytest.raises(ValueError, match=fix):
        generate(model, [1, 2, 3], Settings(8), **ids)


@pytest.mark.parametrize("prompt,kwargs,message", [
    ([], {}, "the prompt is empty"),
    (list(range(120)), {},
     r"prompt \(120 tokens\) \+ generation \(16 tokens.*exceeds the model's context of 128"),
    ([1, 2], dict(max_new_tokens=0), "max_new_tokens=0: ask for at least one"),
    ([1, 2], dict(slot_size=0), "slot_size=0: a slot holds at least one token"),
    (list(range(100)), dict(max_new_tokens=10, serial_num_blocks=4),
     r"prompt \(100 tokens\) \+ generation \(32 tokens, max_new_tokens=10 rounded up to 4 serial "
     r"block\(s\) of whole 8-token slots\) exceeds the model's context of 128 positions; shorten "
     r"the prompt or lower max_new_tokens, slot_size or serial_num_blocks"),
    ([1, 2], dict(slot_threshold=-0.1),
     "slot_threshold=-0.1: thresholds are finite probabilities >= 0"),
    ([1, 2], dict(token_threshold=float("nan")), "token_threshold=nan"),
    ([1, 2], dict(slot_threshold=float("inf")),
     "slot_threshold=inf: thresholds are finite .* >= 1 already means"),
    ([1, 2], dict(temperature=-1.0), "temperature=-1.0: use 0 for greedy"),
    ([1, 2], dict(temperature=float("inf")),
     "temperature=inf: use 0 for greedy decoding or a finite positive"),
])
def test_decoder_settings_errors_name_the_setting_and_the_fix(prompt, kwargs, message):
    with pytest.raises(ValueError, match=message):
        settings = RefusionSettings(**(dict(max_new_tokens=16, slot_size=8) | kwargs))
        generate_refusion(tiny_model(), prompt, settings, mask_id=38, eos_ids=(39,))


@pytest.mark.parametrize("steps, block_length, message", [
    (12, 5, "max_new_tokens=12 is not a multiple of block_length=5"),
    (5, 4, "steps=5 cannot be shared equally by the 3 semi-autoregressive blocks"),
    (13, None, "steps=13 > max_new_tokens=12"),
    (0, None, "must be positive"),
])
def test_mdm_settings_errors_say_what_to_change(steps, block_length, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        MDMSettings(12, steps=steps, block_length=block_length)


def test_on_step_sees_every_committed_step_as_it_happens():
    P, L = 4, 16
    target = oracle_target(P, L, seed=5)
    seen = []
    out = generate_refusion(OracleModel(target, V, MASK, confident=False), target[:P].tolist(),
                            RefusionSettings(L, slot_size=4), mask_id=MASK, eos_ids=(EOS,),
                            on_step=seen.append)
    assert seen == out.trace and len(seen) == L // 4


def test_a_vanishing_temperature_samples_the_greedy_choice_and_never_a_banned_id():
    """At temperature 1e-310 every logit / temperature overflows to +-inf; such rows take the limit
    of sampling as the temperature goes to 0, the argmax over the ids not banned."""
    logits = torch.tensor([[-1.0, -3.0, -2.0], [1.0, 3.0, 2.0], [0.5, 0.1, 0.2]])
    tokens, probs = draft_tokens(logits, 1e-310, torch.Generator().manual_seed(0), banned=(0,))
    assert tokens.tolist() == [2, 1, 2]
    torch.testing.assert_close(probs, torch.softmax(logits, -1)[[0, 1, 2], [2, 1, 2]])
    # accepted: finite and positive
    settings = DecodeSettings(8, temperature=1e-310)
    model = tiny_model()
    greedy = generate_next_token(model, [1, 2, 3], DecodeSettings(8), eos_ids=(39,),
                         banned_ids=(37, 38)).tokens
    assert generate_next_token(model, [1, 2, 3], settings, eos_ids=(39,),
                       generator=torch.Generator().manual_seed(0),
                       banned_ids=(37, 38)).tokens == greedy


def test_generation_length_rounds_up_to_whole_slots_and_returns_at_most_max_new_tokens():
    """max_new_tokens below slot_size, or not a multiple of slot_size x serial_num_blocks, decodes
    whole slots in equal serial blocks (10 tokens, S=8, 4 serial blocks: 32 positions) and returns
    at most max_new_tokens; only a rounded length that does not fit the context is refused, and the
    command line says how the knobs set it: the AR and MDM baselines, which have no slots, in their
    own words."""
    settings = RefusionSettings(10, slot_size=8, serial_num_blocks=4, slot_threshold=0.0)
    assert (settings.gen_length, settings.n_slots) == (32, 4)
    assert RefusionSettings(3, slot_size=8).gen_length == 8
    out = generate_refusion(tiny_model(), [1, 2, 3], settings, mask_id=38, eos_ids=(-1,))
    assert len(out.tokens) == 10 and 38 not in out.tokens
    ids = {"eos_ids": (-1,), "mask_id": 38, "pad_id": 37}
    cfg = dict(DEFAULTS, method="refusion", max_new_tokens=10, slot_size=8, serial_num_blocks=4,
               slot_threshold=0.0)
    run, _ = make_decoder(cfg, ids, torch.Generator())
    model = tiny_model()
    with pytest.raises(ValueError, match=r"^prompt \(97 tokens\) \+ generation \(32 tokens, "
                                         r"max_new_tokens=10 rounded up to 4 serial block\(s\) of "
                                         r"whole 8-token slots\) exceeds the model's context of "
                                         r"128 positions; shorten the prompt or lower "
                                         r"max_new_tokens, slot_size or serial_num_blocks$"):
        run(model, [1] * 97)
    # 96 + 32 = 128 fits
    run(model, [1] * 96)
    for method in ("next_token", "mdm"):
        run, _ = make_decoder(dict(DEFAULTS, method=method, max_new_tokens=16), ids,
                              torch.Generator())
        with pytest.raises(ValueError, match=r"generation \(16 tokens\) exceeds .* shorten the "
                                             r"prompt or lower max_new_tokens$") as error:
            run(tiny_model(causal=method == "next_token"), list(range(120)))
        assert "slot" not in str(error.value)


def test_the_command_lines_defaults_are_the_settings_defaults():
    """sampler.py's default for every decoder knob is the settings object's own (one default
    each); mdm_shift is no knob: the checkpoint's own (support.sampling.fit_mdm_layout)."""
    defaults = {f.name: f.default for _, Settings in DECODERS.values() for f in fields(Settings)
                if f.default is not MISSING and f.default is not None}
    assert set(defaults) == {"temperature", "slot_size", "serial_num_blocks", "slot_threshold",
                             "token_threshold", "infill", "verify", "confidence", "mdm_shift"}
    assert "mdm_shift" not in DEFAULTS
    del defaults["mdm_shift"]
    assert {name: DEFAULTS[name] for name in defaults} == defaults


@pytest.mark.parametrize("slot_size", [1, 8])
def test_the_kv_cache_holds_the_rows_a_decode_uses_not_a_row_per_slot(slot_size):
    """A model too unsure to plan two slots at once infills one slot at a time, so its cache holds
    one row of the whole context, whatever the slot size: memory linear in the context. (Rows were
    preallocated for every slot of a serial block: 400 slots of 1 token were 400 rows.) The row
    holds the 410 tokens rounded up to the cache bucket of 256 tokens: 512."""
    model = tiny_model(block_size=512)
    P, N = 10, 400
    out = generate_refusion(model, list(range(P)), RefusionSettings(N, slot_size=slot_size),
                            mask_id=38, eos_ids=(-1,))
    c = model.config
    one_row = c.n_layer * 2 * c.n_kv_head * 512 * c.head_dim * 4       # float32 keys and values
    assert len(out.tokens) == N and out.cache_bytes == one_row
    ar = generate_next_token(model, list(range(P)), DecodeSettings(N), eos_ids=(-1,))
    assert ar.cache_bytes == one_row


def test_plain_decoder_equals_the_cached_one_on_a_trained_model(refusion_model, monkeypatch):
    """generate_refusion_plain (no cache) and generate_refusion give the same tokens and NFE on a
    trained model, over settings that take every path of the cached decoder (asserted): verify
    committing whole slots and ending at EOS, infill of one row and of several, ending at EOS."""
    model, ids = refusion_model
    paths = PathCounter(monkeypatch)
    for S, blocks, slot_threshold, token_threshold in SETTINGS:
        settings = RefusionSettings(16, slot_size=S, serial_num_blocks=blocks,
                                    slot_threshold=slot_threshold, token_threshold=token_threshold)
        for prompt in PROMPTS:
            plain = generate_refusion_plain(model, prompt, settings, mask_id=ids["mask_id"],
                                            eos_ids=ids["eos_ids"])
            cached = generate_refusion(model, prompt, settings, mask_id=ids["mask_id"],
                                       eos_ids=ids["eos_ids"])
            assert (plain.tokens, plain.nfe, plain.trace) == \
                (cached.tokens, cached.nfe, cached.trace), (S, blocks, prompt)
    assert set(paths.seen) == {"verify commits whole slots", "verify ends at EOS",
                               "infill of one row", "infill of several rows",
                               "infill ends at EOS"}, paths.seen


def test_speculative_infill_hooks_change_no_tensor_they_are_given(monkeypatch):
    """SpeculativeInfill's hooks return what they change (plan: the drafts and their scores; step
    3: the rows' accepted prefixes and tokens), so that the paper's steps show the data flow: no
    hook writes into a tensor it is given, or into the rows' tensors. Checked on decodes whose
    hooks do change drafts and tokens (the bad drafter of the test above)."""
    from sampler import InfillRows, SpeculativeInfill

    def snapshot(args):
        found = []
        for a in args:
            for t in (vars(a).values() if isinstance(a, InfillRows) else [a]):
                if torch.is_tensor(t):
                    found.append((t, t.clone()))
        return found

    changed = []
    for name in ("plan", "verified", "restart_later_rows", "force_next_tokens", "rows_verified",
                 "kept_prefix", "committed"):
        def checked(self, *args, _hook=getattr(SpeculativeInfill, name), _name=name):
            before = snapshot(args)
            out = _hook(self, *args)
            for tensor, copy in before:
                assert torch.equal(tensor, copy), f"{_name} wrote into a tensor it was given"
            changed.append(_name)
            return out
        monkeypatch.setattr(SpeculativeInfill, name, checked)
    P, L, S = 5, 16, 4
    target = oracle_target(P, L, seed=5)
    for blocks in (1, 4):
        settings = RefusionSettings(L, slot_size=S, serial_num_blocks=blocks, slot_threshold=0.0,
                                    token_threshold=0.5, infill="speculative")
        generate_refusion(BadDrafterOracle(target, V, MASK), target[:P].tolist(), settings,
                          mask_id=MASK, eos_ids=(EOS,))
    # later slots that pass verify whole restart from their first token (the test above)
    target = oracle_target(P, 12, seed=6)
    model = BadDrafterOracle(target, V, MASK, bad=list(range(P + 1, P + S)))
    settings = RefusionSettings(12, slot_size=S, slot_threshold=0.0, token_threshold=0.5,
                                infill="speculative")
    generate_refusion(model, target[:P].tolist(), settings, mask_id=MASK, eos_ids=(EOS,))
    assert {"plan", "restart_later_rows", "force_next_tokens"} <= set(changed)


@pytest.mark.parametrize("slot_size", [1, 2, 4, 8, 16, 32])
def test_exact_verification_of_a_trained_model_is_next_token_decoding(refusion_model, slot_size):
    """A trained ReFusion model (its masks draft well where the data is clear): verify="exact"
    gives next-token decoding's tokens on every prompt (a difference only where the two best
    logits tie: test_refusion.assert_same_or_tie), in fewer passes over all of them."""
    model, ids = refusion_model
    cfg = dict(DEFAULTS, max_new_tokens=16, slot_size=slot_size)     # (a context of 64)
    exact, _ = make_decoder(dict(cfg, method="refusion", verify="exact"), ids, None)
    next_token, _ = make_decoder(dict(cfg, method="next_token"), ids, None)
    nfe = {"exact": 0, "next_token": 0}
    for prompt in PROMPTS:
        out, ref = exact(model, prompt), next_token(model, prompt)
        assert_same_or_tie(model, prompt, out.tokens, ref.tokens)
        nfe["exact"] += out.nfe
        nfe["next_token"] += ref.nfe
    assert nfe["exact"] <= nfe["next_token"]
    if slot_size > 1:
        assert nfe["exact"] < nfe["next_token"], nfe


def test_exact_verification_refuses_sampling_and_names_why(capsys):
    """Sampling, an unknown mode and another method than refusion are refused naming the fix; a
    model trained for next tokens only is told it gains nothing."""
    for method in ("next_token", "mdm"):
        with pytest.raises(ValueError, match=f"--verify=exact is read by --method=refusion only, "
                                             f"not --method={method}; drop it"):
            make_decoder(dict(DEFAULTS, method=method, verify="exact"),
                         {"eos_ids": (39,), "mask_id": 38, "pad_id": 37}, None)
    note_mismatch("refusion", "ar", None, "exact")
    assert "verify=exact's drafts are rejected and it writes about one token a pass" in \
        capsys.readouterr().err
    note_mismatch("refusion", "refusion", {"config": {"slot_end_labels": True}}, "exact")
    assert capsys.readouterr().err == ""                   # its next-token pathway was trained
    with pytest.raises(ValueError, match="verify='exact' with temperature=0.7: exact verification "
                                         "decodes greedily .*use temperature=0, or verify='paper'"):
        RefusionSettings(16, temperature=0.7, verify="exact")
    with pytest.raises(ValueError, match="verify='fast': choose 'paper' .* or 'exact'"):
        RefusionSettings(16, verify="fast")
    # its generation is max_new_tokens long, not whole slots: a context error says so
    settings = RefusionSettings(20, slot_size=16, verify="exact")
    with pytest.raises(ValueError, match=r"^prompt \(50 tokens\) \+ generation \(20 tokens\) "
                                         r"exceeds the model's context of 64 positions; shorten "
                                         r"the prompt or lower max_new_tokens$"):
        check_context(tiny_model(block_size=64), 50, settings)
