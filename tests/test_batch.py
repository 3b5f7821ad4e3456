"""Batched decoding (support/batching.py: generate_batch, BatchedCache): every prompt of a batch
gets the tokens, steps and NFE the one-prompt decoder gives it alone."""

import math
import threading

import pytest
import torch

from helpers import PROMPTS, SETTINGS, PathCounter, tiny_model
from configurator import INFILL_MODES, ContextTooLong
from sampler import DEFAULTS, make_decoder
from support.batching import CPU_PAD, BatchedCache, forward_batch, generate_batch, pad_passes
from test_refusion import EOS, MASK, V, BadDrafterOracle, OracleModel, oracle_target

def assert_batched_equals_one_prompt(model, decode, prompts, batch_size, pad=math.inf, **kwargs):
    """Decode prompts one by one and batched (pad: inf, every waiting pass of a kind as one padded
    pass, as on a GPU; 0, a pass per length; else generate_batch's budget); every prompt's
    Generation must agree in tokens, trace, NFE, forward passes per step and cache bytes, and the
    batch must have carried each prompt in exactly its NFE forward passes. Returns the batched
    forward passes' prompt lists."""
    one = [decode(model, p) for p in prompts]
    forwards = []
    many = generate_batch(model, decode, prompts, batch_size, forwards=forwards, pad=pad, **kwargs)
    for i, (a, b) in enumerate(zip(one, many)):
        assert (b.tokens, b.trace, b.nfe, b.step_nfe, b.cache_bytes) == \
            (a.tokens, a.trace, a.nfe, a.step_nfe, a.cache_bytes), f"prompt {i}"
        assert sum(i in carried for carried in forwards) == a.nfe, f"prompt {i}"
    return forwards


@pytest.mark.parametrize("infill", ["paper", "speculative"])
def test_batched_refusion_equals_the_one_prompt_decoder_on_a_trained_model(
        refusion_model, infill, monkeypatch):
    model, ids = refusion_model
    paths, left_early = PathCounter(monkeypatch), 0
    for S, blocks, slot_threshold, token_threshold in SETTINGS:
        cfg = dict(DEFAULTS, method="refusion", max_new_tokens=16, slot_size=S, infill=infill,
                   serial_num_blocks=blocks, slot_threshold=slot_threshold,
                   token_threshold=token_threshold)
        decode, _ = make_decoder(cfg, ids, None)
        forwards = assert_batched_equals_one_prompt(model, decode, PROMPTS, batch_size=len(PROMPTS))
        assert len(forwards[0]) == len(PROMPTS)
        left_early += len(forwards[-1]) < len(PROMPTS)  # prompts left while others decoded on
    assert left_early >= len(SETTINGS) // 2
    assert set(paths.seen) == {"verify commits whole slots", "verify ends at EOS",
                               "infill of one row", "infill of several rows",
                               "infill ends at EOS"}, paths.seen


@pytest.mark.parametrize("batch_size", [1, 2, 4, 6])
def test_any_batch_size_gives_the_same_generations(refusion_model, batch_size):
    model, ids = refusion_model
    cfg = dict(DEFAULTS, method="refusion", max_new_tokens=16, slot_size=4)
    decode, _ = make_decoder(cfg, ids, None)
    forwards = assert_batched_equals_one_prompt(model, decode, PROMPTS, batch_size)
    assert max(len(carried) for carried in forwards) == batch_size


@pytest.mark.parametrize("pad", [0, CPU_PAD])
def test_passes_run_by_length_give_every_decoder_its_one_prompt_generations(refusion_model,
                                                                            mdm_model, pad):
    """With no padding, or a CPU's budget of it, the waiting passes run one per length or a few
    lengths: ReFusion (both infills), next-token and MDM decoding still give each prompt its own
    generation, and some passes do carry several prompts."""
    model, ids = refusion_model
    cfgs = [dict(method="refusion", slot_size=4, infill=i) for i in INFILL_MODES]
    for cfg in cfgs + [dict(method="next_token")]:
        decode, _ = make_decoder(dict(DEFAULTS, max_new_tokens=16, **cfg), ids, None)
        forwards = assert_batched_equals_one_prompt(model, decode, PROMPTS, len(PROMPTS), pad=pad)
        assert max(len(carried) for carried in forwards) > 1, cfg
    model, ids = mdm_model
    decode, _ = make_decoder(dict(DEFAULTS, method="mdm", max_new_tokens=16, steps=8), ids, None)
    forwards = assert_batched_equals_one_prompt(model, decode, PROMPTS[:3], 3, pad=pad)
    assert max(len(carried) for carried in forwards) > 1


@pytest.mark.parametrize("pad, want", [
    (0, [[4], [0, 2], [1], [3], [5], [6]]),
    (0.125, [[4], [0, 2], [1], [3], [5, 6]]),       # 4 rows x 5 > 1.125 x 17, 2 x 12 <= 1.125 x 22
    (0.25, [[4], [0, 2, 1], [3], [5, 6]]),          # 4 x 5 <= 1.25 x 17, 5 x 8 > 1.25 x 25
    (math.inf, [[4, 0, 2, 1, 3], [5, 6]]),
])
def test_a_pass_takes_requests_while_its_padding_stays_within_the_budget(pad, want):
    """pad_passes, worked by hand: cached requests of (rows, new tokens) (1, 4), (1, 5), (2, 4),
    (1, 8), (1, 1) and uncached ones of (1, 10), (1, 12); a pass never mixes the two kinds."""
    shapes = [(1, 4), (1, 5), (2, 4), (1, 8), (1, 1), (1, 10), (1, 12)]
    requests = [(torch.zeros(s, dtype=torch.long), None, "cache" if i < 5 else None, 0)
                for i, s in enumerate(shapes)]
    assert pad_passes(requests, pad) == want


def test_batched_next_token_decoding_equals_one_prompt(refusion_model):
    model, ids = refusion_model
    decode, _ = make_decoder(dict(DEFAULTS, method="next_token", max_new_tokens=16), ids, None)
    forwards = assert_batched_equals_one_prompt(model, decode, PROMPTS, len(PROMPTS))
    assert len(forwards[0]) > len(forwards[-1])       # EOS ended some prompts before others


@pytest.mark.parametrize("block_length", [0, 4])
def test_batched_mdm_equals_one_prompt(mdm_model, block_length):
    """Prompts of different lengths: the batch pads the shorter ones and masks the padding."""
    model, ids = mdm_model
    cfg = dict(DEFAULTS, method="mdm", max_new_tokens=12, steps=6, block_length=block_length)
    decode, _ = make_decoder(cfg, ids, None)
    assert_batched_equals_one_prompt(model, decode, PROMPTS, len(PROMPTS))


@pytest.mark.parametrize("infill", ["paper", "speculative"])
@pytest.mark.parametrize("eos_at", [None, 3, 11])
def test_batched_oracle_decodes_reproduce_the_target(infill, eos_at):
    """Prefixes of one target as prompts (1 to 20 tokens): each decodes its own continuation."""
    L = 16
    target = oracle_target(20, L + 20, eos_at=eos_at if eos_at is None else 20 + eos_at)
    model = OracleModel(target, V, MASK)
    cfg = dict(DEFAULTS, method="refusion", max_new_tokens=L, slot_size=4, infill=infill,
               serial_num_blocks=2)
    decode, _ = make_decoder(cfg, dict(eos_ids=(EOS,), mask_id=MASK, pad_id=None), None)
    prompts = [target[:n].tolist() for n in (1, 7, 20, 13)]
    one = [decode(model, p) for p in prompts]
    assert_batched_equals_one_prompt(model, decode, prompts, 3)
    for p, out in zip(prompts, one):
        expected = target[len(p):len(p) + L].tolist()
        if EOS in expected:
            expected = expected[:expected.index(EOS) + 1]
        assert out.tokens == expected


@pytest.mark.parametrize("confident", [True, False])
def test_batched_stress_models_take_their_paths_alike(confident, monkeypatch):
    """A model whose mask predictions are wrong (infill='speculative' keeps the next-token
    pathway) and an unsure one (one slot per plan, every infill round): batched as alone."""
    target = oracle_target(24, 40, seed=4)
    model = (BadDrafterOracle(target, V, MASK, bad=[26, 27, 33]) if confident
             else OracleModel(target, V, MASK, confident=False))
    paths = PathCounter(monkeypatch)
    for infill in ("paper", "speculative"):
        cfg = dict(DEFAULTS, method="refusion", max_new_tokens=16, slot_size=4, infill=infill)
        decode, _ = make_decoder(cfg, dict(eos_ids=(EOS,), mask_id=MASK, pad_id=None),
                                 None)
        assert_batched_equals_one_prompt(model, decode, [target[:n].tolist() for n in (24, 2, 11)],
                                         3)
    assert paths.seen["infill of one row"] > 0


def test_each_prompt_draws_from_its_own_generator(refusion_model):
    """With a temperature, a prompt's output depends on its generator's seed, not on the prompts
    decoded beside it."""
    model, ids = refusion_model
    cfg = dict(DEFAULTS, method="refusion", max_new_tokens=16, slot_size=4, temperature=2.0)
    decode, _ = make_decoder(cfg, ids, None)

    def seeded(*seeds):
        return [torch.Generator().manual_seed(s) for s in seeds]

    alone = [decode(model, p, generator=g) for p, g in zip(PROMPTS[:3], seeded(0, 1, 2))]
    together = generate_batch(model, decode, PROMPTS[:3], 3, generators=seeded(0, 1, 2))
    beside_others = generate_batch(model, decode, [PROMPTS[0], PROMPTS[5]], 2,
                                   generators=seeded(0, 9))
    assert [o.tokens for o in together] == [o.tokens for o in alone]
    assert beside_others[0].tokens == alone[0].tokens
    other_seeds = generate_batch(model, decode, PROMPTS[:3], 3, generators=seeded(5, 6, 7))
    assert [o.tokens for o in other_seeds] != [o.tokens for o in alone]  # the draws are theirs


def test_a_failing_prompt_fails_the_batch_naming_its_error(refusion_model):
    model, ids = refusion_model
    decode, _ = make_decoder(dict(DEFAULTS, method="refusion", max_new_tokens=16), ids,
                             None)
    with pytest.raises(ContextTooLong, match="exceeds the model's context"):
        generate_batch(model, decode, [PROMPTS[0], [65] * 60, PROMPTS[1]], 3)
    with pytest.raises(ValueError, match="batch_size=0: decode at least one prompt"):
        generate_batch(model, decode, PROMPTS, 0)
    # the threads of the failed batch are gone; the next batch decodes as usual
    assert [o.tokens for o in generate_batch(model, decode, PROMPTS[:2], 2)] == \
        [decode(model, p).tokens for p in PROMPTS[:2]]


def threads_of_a_new_thread():
    """torch.get_num_threads() as a thread started now sees it."""
    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


def test_a_batch_leaves_every_thread_its_intra_op_thread_count(refusion_model):
    """The prompts' threads run on one intra-op thread each; after the batch, decoded or failed,
    the calling thread and every thread started later have the count they had before."""
    model, ids = refusion_model
    decode, _ = make_decoder(dict(DEFAULTS, method="refusion", max_new_tokens=16), ids, None)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # not 1, the prompts' own count
    try:
        generate_batch(model, decode, PROMPTS[:2], 2)
        assert (torch.get_num_threads(), threads_of_a_new_thread()) == (2, 2)
        with pytest.raises(ContextTooLong):
            generate_batch(model, decode, [PROMPTS[0], [65] * 60], 2)
        assert (torch.get_num_threads(), threads_of_a_new_thread()) == (2, 2)
    finally:
        torch.set_num_threads(before)


@torch.inference_mode()
def test_batched_cache_pass_equals_each_cache_alone():
    """Two caches of different lengths and rows, one padded pass: the same logits, and each cache
    afterwards holds the same keys/values, as two separate passes."""
    model = tiny_model(seed=3)
    g = torch.Generator().manual_seed(3)
    alone, batched = [], []
    for P, rows in ((9, 1), (3, 2)):
        for caches in (alone, batched):
            cache = model.new_kv_cache(max_len=20, max_batch=2)
            model(torch.randint(0, 40, (1, P), generator=torch.Generator().manual_seed(P)),
                  torch.arange(P)[None], kv_cache=cache)
            cache.repeat_prefix(rows)
            caches.append(cache)
    new = [(torch.randint(0, 40, (1, 4), generator=g), torch.arange(9, 13)[None]),
           (torch.randint(0, 40, (2, 2), generator=g), torch.tensor([[3, 4], [7, 8]]))]
    # one asks for every logit, one for its last token's (logits_from), as the decoders do
    want = [model(idx, pos, kv_cache=c, logits_from=f)
            for (idx, pos), c, f in zip(new, alone, (0, -1))]
    got = forward_batch(model, [(idx, pos, c, f)
                                for (idx, pos), c, f in zip(new, batched, (0, -1))])
    for w, o, a, b in zip(want, got, alone, batched):
        assert o.shape == w.shape and torch.allclose(o, w, atol=1e-5)
        assert (a.length, a.batch) == (b.length, b.batch)
        assert torch.allclose(a.kv[:, :, :a.batch, :, :a.length],
                              b.kv[:, :, :b.batch, :, :b.length], atol=1e-6)
    side_by_side = BatchedCache(batched, 21)
    side_by_side.start_pass([1, 1], 1)
    mask = side_by_side.attention_mask(1)                  # now 13 and 5 tokens cached
    assert mask.shape == (3, 1, 1, 21)                     # keys: 14, rounded up (at most 21)
    assert mask[0, 0, 0].tolist() == [True] * 14 + [False] * 7
    assert mask[1, 0, 0].tolist() == [True] * 5 + [False] * 8 + [True] + [False] * 7


def test_a_batch_keeps_its_caches_side_by_side_from_pass_to_pass(refusion_model, monkeypatch):
    """While the same prompts pass together, their caches stay side by side: one BatchedCache
    serves every pass of a next-token batch (each pass then copies in its new tokens, not the
    caches), and a ReFusion batch builds one only when its prompts or rows change."""
    model, ids = refusion_model
    built = []
    real_init = BatchedCache.__init__

    def counted(self, caches, length):
        built.append(len(caches))
        real_init(self, caches, length)

    monkeypatch.setattr(BatchedCache, "__init__", counted)
    prompts = PROMPTS[:4]
    decode, _ = make_decoder(dict(DEFAULTS, method="next_token", max_new_tokens=12),
                             dict(ids, eos_ids=(-1,)), None)
    forwards = []
    out = generate_batch(model, decode, prompts, 4, forwards=forwards, pad=math.inf)
    assert [len(g.tokens) for g in out] == [12] * 4 and len(forwards) == 12
    assert built == [4]                                   # one, for all 12 passes
    built.clear()
    decode = make_decoder(dict(DEFAULTS, method="refusion", max_new_tokens=16, slot_size=4,
                               slot_threshold=0.9, token_threshold=0.3), ids, None)[0]
    forwards = []
    batched = generate_batch(model, decode, prompts, 4, forwards=forwards, pad=math.inf)
    assert [g.tokens for g in batched] == [decode(model, p).tokens for p in prompts]
    assert 0 < len(built) < len([f for f in forwards if len(f) > 1])


@pytest.mark.parametrize("slot_size", [1, 4, 16])
def test_batched_exact_verification_equals_one_prompt(refusion_model, slot_size):
    """verify="exact" (SPEC 4.5) in batches: each prompt's tokens, trace and passes are the ones it
    gets alone, at every batch size."""
    model, ids = refusion_model
    cfg = dict(DEFAULTS, method="refusion", max_new_tokens=16, slot_size=slot_size, verify="exact")
    decode, _ = make_decoder(cfg, ids, None)
    for batch_size in (2, len(PROMPTS)):
        assert_batched_equals_one_prompt(model, decode, PROMPTS, batch_size)
