"""
ReFusion's plan-and-infill decoder (SPEC section 4), told as its named steps:

    plan_slots     step 1  one diffusion step over the masked slots: draft them, pick the confident ones
    verify_drafts  step 2  one causal pass over the picked drafts: accept their longest confident prefix
    infill_slots   step 3  finish the picked slots in parallel, each one left to right, one row each
    commit_slots   step 4  append the finished slots (tokens, true positions, keys/values) to the buffer

Every committed token's keys/values are computed once and reused by every later forward pass: the
buffer holds committed slots in commit order, the model sees their true positions through RoPE.

The baselines of SPEC section 4 report the same Generation statistics: generate_ar (next-token
decoding with the KV cache) and generate_mdm (LLaDA-style, the whole sequence recomputed each step).
`python sampler.py --method=refusion|ar|mdm` picks one.
"""

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from functools import partial

import torch

from checkpoint import load_checkpoint, model_from_checkpoint
from configurator import check_device, parse_args, run_cli
from data import TokenDataset, decode, encode, get_tokenizer, prepare


@dataclass
class Generation:
    """The result of one decode and its statistics (SPEC section 4, "Statistics").

    tokens:  generated response ids, in position order, cut after the first EOS (EOS included).
    nfe:     model forward calls (a batched call counts once; the prompt prefill counts).
    seconds: wall-clock decode time in seconds.
    """
    tokens: list[int]
    nfe: int
    seconds: float
    steps: list = field(default_factory=list, repr=False)  # per plan step: committed (position, token) pairs

    @property
    def tpf(self):
        """Tokens per forward over the whole generation: tokens / NFE."""
        return len(self.tokens) / max(self.nfe, 1)

    @property
    def tokens_per_s(self):
        """Generated tokens per second of wall-clock decode time."""
        return len(self.tokens) / max(self.seconds, 1e-9)

    def stats(self):
        """The statistics as a dict of plain numbers (tokens, nfe, tpf, seconds, tokens_per_s), for --json."""
        return {"tokens": len(self.tokens), "nfe": self.nfe, "tpf": round(self.tpf, 3),
                "seconds": round(self.seconds, 4), "tokens_per_s": round(self.tokens_per_s, 2)}


class DecodeState:
    """What the decoder carries between steps: the model, its cache and the committed buffer.

    The cache row 0 holds `ctx` committed tokens; `pending` are committed tokens not yet fed to the
    model (the prompt, until the first plan call feeds it together with the masks).
    """

    def __init__(self, model, prompt, cache, mask_id, eos_id, temperature, generator, on_step=None, banned_ids=()):
        self.model, self.cache = model, cache
        self.mask_id, self.eos_id = mask_id, eos_id
        self.banned = [mask_id, *banned_ids]  # never written into the response
        self.temperature, self.generator = temperature, generator
        self.device = cache.kv.device
        self.pending = list(prompt)
        self.pending_pos = list(range(len(prompt)))
        self.ctx = 0
        self.nfe = 0
        self.response = {}   # true position -> committed token
        self.steps = []
        self.on_step = on_step  # called with each step's committed (position, token) pairs

    def forward(self, tokens, positions):
        """One counted forward pass of (B, T) tokens at (B, T) positions after the cache."""
        self.nfe += 1
        return self.model(tokens, positions, kv_cache=self.cache)


def ban(scores, token_ids):
    """Set scores[..., id] = -inf for each id, in place, and return scores (logits or probabilities
    (..., V) about to be maximized), so that no banned token is ever chosen. Only the choice is
    affected: confidences stay the raw softmax probabilities (SPEC section 4), so a ban changes no
    threshold decision. ReFusion and the MDM always ban the mask id (in the response it would read
    as a still-masked position); make_decoder bans the mask and pad ids for every decoder, since no
    training label is either."""
    scores[..., list(token_ids)] = -math.inf
    return scores


def check_length_and_temperature(max_new_tokens, temperature):
    """The settings every decoder shares. Raises ValueError."""
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}: ask for at least one new token")
    if not (temperature >= 0):  # also catches NaN
        raise ValueError(f"temperature={temperature}: use 0 for greedy decoding or a positive value to sample")


def cut_after_eos(tokens, eos_id):
    """tokens (list of ids) up to and including the first EOS (all of them if there is none)."""
    return tokens[:tokens.index(eos_id) + 1] if eos_id in tokens else tokens


def validate_settings(max_new_tokens, slot_size, num_blocks, slot_threshold, token_threshold, temperature):
    """Check decoder settings; returns (generation length L, number of slots). Raises ValueError.

    Thresholds are probabilities compared with `>`: any value >= 0 is accepted, and a value of 1
    or more means "never" (one slot per plan step / only forced tokens accepted).
    """
    check_length_and_temperature(max_new_tokens, temperature)
    if slot_size <= 0:
        raise ValueError(f"slot_size={slot_size}: a slot holds at least one token (the paper uses 4 to 32)")
    if slot_size > max_new_tokens:
        raise ValueError(f"slot_size={slot_size} is larger than max_new_tokens={max_new_tokens}; use a "
                         f"slot_size of at most {max_new_tokens} (or ask for more tokens)")
    if num_blocks <= 0:
        raise ValueError(f"num_blocks={num_blocks}: use at least one serial block")
    for name, value in (("slot_threshold", slot_threshold), ("token_threshold", token_threshold)):
        if not (value >= 0):  # also catches NaN
            raise ValueError(f"{name}={value}: thresholds are probabilities >= 0 (a value >= 1 means never)")
    gen_len = slot_size * math.ceil(max_new_tokens / slot_size)
    n_slots = gen_len // slot_size
    if n_slots % num_blocks:
        raise ValueError(f"{n_slots} slots of {slot_size} tokens (max_new_tokens={max_new_tokens} rounded up "
                         f"to {gen_len}) cannot be cut into num_blocks={num_blocks} equal blocks; "
                         f"pick num_blocks dividing {n_slots}")
    return gen_len, n_slots


def check_context(model, prompt_len, gen_len):
    """Refuse a prompt + generation that does not fit the model's positions. Raises ValueError."""
    if prompt_len == 0:
        raise ValueError("the prompt is empty: give at least one token of context")
    limit = model.config.block_size
    if prompt_len + gen_len > limit:
        raise ValueError(f"prompt ({prompt_len} tokens) + generation ({gen_len} tokens, max_new_tokens rounded up "
                         f"to whole slots) exceeds the model's context of {limit} positions; shorten the prompt, "
                         "lower max_new_tokens or use a smaller slot_size")


def check_attention(model, method):
    """Refuse a decoding method the model's attention was not trained for. Raises ValueError.

    refusion and ar feed tokens after a KV cache, which needs causal attention; mdm recomputes a
    sequence of masks, which needs bidirectional attention (SPEC section 4, "Baseline decoders").
    Reads model.config.causal (False for a model trained with --objective=mdm).
    """
    if method == "mdm" and model.config.causal:
        raise ValueError("this model was trained with a causal objective (refusion or ar), so it cannot "
                         "denoise a sequence of masks bidirectionally; use --method=refusion or --method=ar")
    if method != "mdm" and not model.config.causal:
        raise ValueError(f"this model has bidirectional attention (trained with --objective=mdm), but "
                         f"--method={method} decodes causally after a KV cache; use --method=mdm")


def draft_tokens(logits, temperature, generator, banned=()):
    """Draft a token at each row of logits (N, V) float32; returns (tokens (N,) int64, probs (N,) float32).

    temperature 0: argmax; otherwise Gumbel-max sampling in float64. Tokens in `banned` are never
    drafted (ban). The probability is the raw softmax probability of the drafted token
    (temperature does not scale it; SPEC section 4).
    """
    probs = torch.softmax(logits.float(), dim=-1)
    if temperature == 0:
        tokens = ban(probs.clone(), banned).argmax(dim=-1)
    else:
        u = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
        gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
        tokens = (ban(logits.double(), banned) / temperature + gumbel).argmax(dim=-1)
    return tokens, probs.gather(-1, tokens[:, None])[:, 0]


def next_token_probs(logits, tokens):
    """Probability of each token given everything before it (causal next-token prediction).

    logits: (B, T, V) for the tokens (B, T) fed in one pass. Returns (B, T) float32 where column j
    is softmax(logits[:, j - 1])[tokens[:, j]]; column 0 has no prediction in this pass and is 0.
    """
    probs = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    probs[:, 1:] = torch.softmax(logits[:, :-1].float(), dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    return probs


def leading_true(x):
    """Length of the run of True at the start of each row of x (B, T) bool; returns (B,) int64."""
    return x.long().cumprod(dim=1).sum(dim=1)


def plan_slots(state, pool, slot_size, slot_threshold):
    """Step 1, plan: one diffusion step over every still-masked slot of the block.

    pool: ascending start positions of the masked slots. Feeds (after the cache, and after the
    pending prompt on the first call) each slot as slot_size mask ids at its true positions, drafts
    every masked position, scores each slot by its first token's probability and selects those
    above slot_threshold (else the single best). The masks' keys/values are discarded.
    Returns (selected: ascending list of indices into pool, drafts: (len(selected), slot_size) int64).
    """
    n_pending = len(state.pending)
    masks = [state.mask_id] * (slot_size * len(pool))
    positions = [p + i for p in pool for i in range(slot_size)]
    tokens = torch.tensor([state.pending + masks], device=state.device)
    pos = torch.tensor([state.pending_pos + positions], device=state.device)
    logits = state.forward(tokens, pos)[0, n_pending:]                 # (n_slots * S, V)
    state.ctx += n_pending                                              # the prompt's KV stays cached
    state.pending, state.pending_pos = [], []
    state.cache.crop(state.ctx)
    drafts, probs = draft_tokens(logits, state.temperature, state.generator, state.banned)
    drafts, probs = drafts.view(len(pool), slot_size), probs.view(len(pool), slot_size)
    scores = probs[:, 0]
    selected = (scores > slot_threshold).nonzero()[:, 0].tolist() or [int(scores.argmax())]
    return selected, drafts[selected]


def verify_drafts(state, starts, drafts, token_threshold):
    """Step 2, global verify: one causal pass over the selected drafts, concatenated in slot order.

    starts: true start positions of the selected slots; drafts: (k, S) int64.
    A slot's first token is accepted as drafted; every other token passes when its next-token
    probability (given all drafts before it) exceeds token_threshold. The pass's keys/values stay
    in the cache (the caller crops what it does not commit).
    Returns (prefix: tokens in the longest all-passing prefix of the concatenation,
             passed: (k, S) bool, each token's own verdict).
    """
    k, S = drafts.shape
    tokens = drafts.reshape(1, k * S)
    pos = torch.tensor([[p + i for p in starts for i in range(S)]], device=state.device)
    probs = next_token_probs(state.forward(tokens, pos), tokens)       # (1, k * S)
    passed = (probs > token_threshold).view(k, S)
    passed[:, 0] = True
    return int(leading_true(passed.view(1, -1))[0]), passed


def infill_slots(state, starts, drafts, accepted, token_threshold):
    """Step 3, parallel autoregressive infill: finish each selected slot in its own batch row.

    starts: (k,) true start positions; drafts: (k, S) int64 tokens from the plan step;
    accepted: (k,) int64 length of each slot's accepted prefix (at least 1). Each iteration
    (a) drafts every unaccepted token by feeding it as a mask id, then (b) verifies: the first
    unaccepted token of each row is accepted (it was predicted from an accepted prefix), later ones
    while their next-token probability exceeds token_threshold. (c) A row whose accepted tokens
    contain EOS ends there and every later row is dropped. (d) The prefix accepted in every row is
    kept in the cache (never recomputed). At most S iterations.
    Returns (tokens (k', S), lengths (k',) int64: tokens to commit per row, eos: bool), k' <= k.
    The cache is left with k' rows, row i holding slot i's keys/values after the shared prefix.
    """
    k, S = drafts.shape
    tokens, accepted = drafts.clone(), accepted.clone()
    pos = torch.tensor(starts, device=state.device)[:, None] + torch.arange(S, device=state.device)
    cols = torch.arange(S, device=state.device)
    state.cache.repeat_prefix(k)
    tokens, accepted, lengths, eos = cut_at_eos(state, tokens, accepted, torch.full_like(accepted, S))
    pos = pos[:len(tokens)]
    shared = 0                                     # slot tokens [0, shared) of every row are cached
    for _ in range(S):                             # each iteration accepts >= 1 token of every unfinished row
        if bool((accepted >= lengths).all()):
            break
        base = state.ctx + shared
        # (a) draft: unaccepted tokens become mask ids; each masked position predicts itself
        window = tokens[:, shared:].clone()
        masked = cols[shared:] >= accepted[:, None]
        window[masked] = state.mask_id
        logits = state.forward(window, pos[:, shared:])
        state.cache.crop(base)
        tokens[:, shared:][masked] = ban(logits[masked], state.banned).argmax(dim=-1)
        # (b) verify: accept the first unaccepted token, then while the next-token probability passes
        window = tokens[:, shared:]
        probs = next_token_probs(state.forward(window, pos[:, shared:]), window)
        passed = (probs > token_threshold) | (cols[shared:] == accepted[:, None])
        passed |= cols[shared:] < accepted[:, None]
        accepted = torch.minimum(shared + leading_true(passed), lengths)
        # (c) EOS ends its slot and the decode after it
        tokens, accepted, lengths, row_eos = cut_at_eos(state, tokens, accepted, lengths)
        eos, pos = eos or row_eos, pos[:len(tokens)]
        # (d) keep the keys/values of the prefix accepted in every row (all of it once all are done)
        shared = S if bool((accepted >= lengths).all()) else int(accepted.min())
        state.cache.crop(state.ctx + shared)
    return tokens, lengths, eos


def cut_at_eos(state, tokens, accepted, lengths):
    """SPEC step 3c: the first row whose accepted tokens hold EOS ends after it; later rows go.

    tokens (k, S), accepted (k,), lengths (k,). Returns the (possibly fewer) rows and lengths, and
    whether an EOS was found; drops the cache rows of removed slots.
    """
    S = tokens.shape[1]
    is_eos = (tokens == state.eos_id) & (torch.arange(S, device=tokens.device) < accepted[:, None])
    rows = is_eos.any(dim=1).nonzero()[:, 0]
    if len(rows) == 0:
        return tokens, accepted, lengths, False
    r = int(rows[0])
    end = int(is_eos[r].long().argmax()) + 1
    lengths = lengths[:r + 1].clone()
    lengths[r] = end
    if r + 1 < state.cache.batch:
        state.cache.keep_rows(list(range(r + 1)))
    return tokens[:r + 1], torch.minimum(accepted[:r + 1], lengths), lengths, True


def commit_slots(state, starts, tokens, segments):
    """Step 4, commit: append finished slots to the buffer and their keys/values to the cache.

    starts: true start positions of the slots, in slot order; tokens: one list of ids per slot
    (already cut after EOS); segments: the cache (row, length) pairs holding their keys/values from
    token ctx on, in the same order (one row per slot after infill, row 0 after a verify pass).
    """
    state.cache.commit_rows(segments, state.ctx)
    step = []
    for start, ids in zip(starts, tokens):
        for i, t in enumerate(ids):
            assert start + i not in state.response, "a position was committed twice"
            state.response[start + i] = t
            step.append((start + i, t))
    state.ctx = state.cache.pos
    state.steps.append(step)
    if state.on_step:
        state.on_step(step)


def decode_block(state, pool, slot_size, slot_threshold, token_threshold):
    """Decode one serial block until none of its slots is masked. Returns True when EOS ended it.

    pool: ascending start positions of the block's slots (consumed in place).
    """
    S, eos_seen = slot_size, False
    while pool:
        selected, drafts = plan_slots(state, pool, S, slot_threshold)
        starts = [pool[i] for i in selected]
        prefix, passed = verify_drafts(state, starts, drafts, token_threshold)
        flat = drafts.view(-1)[:prefix]
        eos_at = (flat == state.eos_id).nonzero()
        if len(eos_at):
            # EOS inside the accepted prefix: commit up to it; every slot after its slot goes
            n = int(eos_at[0]) + 1
            n_slots = math.ceil(n / S)
            ids = [flat[i * S:min((i + 1) * S, n)].tolist() for i in range(n_slots)]
            state.cache.crop(state.ctx + n)
            commit_slots(state, starts[:n_slots], ids, [(0, n)])
            eos_seen = True
            pool[:] = [p for p in pool if p < starts[n_slots - 1] and p not in starts]
        elif prefix >= S:
            # whole slots accepted: keep the keys/values this pass computed for them
            n_slots = prefix // S
            state.cache.crop(state.ctx + n_slots * S)
            commit_slots(state, starts[:n_slots], drafts[:n_slots].tolist(), [(0, n_slots * S)])
            pool[:] = [p for p in pool if p not in starts[:n_slots]]
        else:
            state.cache.crop(state.ctx)
            tokens, lengths, eos = infill_slots(state, starts, drafts, leading_true(passed), token_threshold)
            k = len(tokens)
            ids = [tokens[i, :lengths[i]].tolist() for i in range(k)]
            commit_slots(state, starts[:k], ids, [(i, int(lengths[i])) for i in range(k)])
            eos_seen = eos_seen or eos
            pool[:] = [p for p in pool if p not in starts and not (eos and p > starts[k - 1])]
    return eos_seen


@torch.no_grad()
def generate_refusion(model, prompt, max_new_tokens, *, mask_id, eos_id, slot_size=8, num_blocks=1,
                      slot_threshold=0.9, token_threshold=0.3, temperature=0.0, generator=None, on_step=None,
                      banned_ids=()):
    """Generate a response with ReFusion's plan-and-infill decoding (SPEC section 4; paper section 3.2).

    model:  a causal Transformer (or any module with the same forward and new_kv_cache), in eval mode.
    prompt: list of token ids (at least one).
    max_new_tokens: rounded up to a multiple of slot_size for decoding; at most this many are returned.
    num_blocks: serial blocks, decoded one after another; must divide the number of slots.
    slot_threshold / token_threshold: probabilities compared with `>` (>= 1 means never).
    temperature: 0 for greedy drafts; > 0 samples plan drafts by Gumbel-max (float64) from
    `generator` (a torch.Generator on the model's device).
    on_step: optional callable, given the (position, token) pairs each plan step commits (--show).
    banned_ids: token ids never generated besides the mask id (the CLI adds the pad id).
    Returns a Generation (tokens, nfe, seconds, tpf, tokens_per_s).
    Raises ValueError for invalid settings, a bidirectional model, or a prompt + generation longer
    than the context.
    """
    check_attention(model, "refusion")
    gen_len, n_slots = validate_settings(max_new_tokens, slot_size, num_blocks, slot_threshold,
                                         token_threshold, temperature)
    check_context(model, len(prompt), gen_len)
    t0 = time.perf_counter()
    slots_per_block = n_slots // num_blocks
    cache = model.new_kv_cache(max_len=len(prompt) + gen_len, max_batch=slots_per_block)
    state = DecodeState(model, prompt, cache, mask_id, eos_id, temperature, generator, on_step, banned_ids)
    first = len(prompt)
    for b in range(num_blocks):
        pool = [first + (b * slots_per_block + i) * slot_size for i in range(slots_per_block)]
        if decode_block(state, pool, slot_size, slot_threshold, token_threshold):
            break
    tokens = [state.response[p] for p in sorted(state.response)]
    tokens = cut_after_eos(tokens, eos_id)
    return Generation(tokens[:max_new_tokens], state.nfe, time.perf_counter() - t0, state.steps)


# -----------------------------------------------------------------------------
# baseline decoders (SPEC section 4, "Baseline decoders"): next-token (ar) and LLaDA-style (mdm)


@torch.no_grad()
def generate_ar(model, prompt, max_new_tokens, *, eos_id, temperature=0.0, generator=None, on_step=None,
                banned_ids=()):
    """Plain next-token decoding with the KV cache: the ARM baseline.

    One prefill forward of the prompt predicts the first token, then one forward per further token,
    each feeding only the newest token after the cache; so NFE = number of generated tokens (TPF 1).
    temperature 0: argmax; otherwise Gumbel-max in float64 from `generator` (draft_tokens).
    banned_ids are never generated (the CLI passes the mask and pad ids). Stops after EOS or
    max_new_tokens. Returns a Generation; its steps hold one (position, token) pair per forward
    (also given to on_step, if set, as it happens).
    Raises ValueError for a bidirectional model, invalid settings, or a prompt + generation longer
    than the context.
    """
    check_attention(model, "ar")
    check_length_and_temperature(max_new_tokens, temperature)
    check_context(model, len(prompt), max_new_tokens)
    t0 = time.perf_counter()
    cache = model.new_kv_cache(max_len=len(prompt) + max_new_tokens)
    device = cache.kv.device
    tokens = torch.tensor([prompt], device=device)                     # (1, P), the prefill
    positions = torch.arange(len(prompt), device=device)[None]
    out, steps = [], []
    while True:
        logits = model(tokens, positions, kv_cache=cache)[0, -1:]      # (1, V): the next token's
        token, _ = draft_tokens(logits, temperature, generator, banned_ids)
        out.append(int(token))
        steps.append([(len(prompt) + len(out) - 1, out[-1])])
        if on_step:
            on_step(steps[-1])
        if out[-1] == eos_id or len(out) == max_new_tokens:
            break
        tokens, positions = token[None], positions[:, -1:] + 1         # (1, 1) each
    return Generation(out, len(out), time.perf_counter() - t0, steps)


def validate_mdm_settings(max_new_tokens, steps, block_length):
    """LLaDA's schedule settings; returns (steps, block_length) with None filled in. Raises ValueError.

    steps None: one token per step (steps = max_new_tokens); block_length None: one block.
    """
    steps = max_new_tokens if steps is None else steps
    block_length = max_new_tokens if block_length is None else block_length
    if steps <= 0 or block_length <= 0:
        raise ValueError(f"steps={steps}, block_length={block_length}: both must be positive")
    if max_new_tokens % block_length:
        raise ValueError(f"max_new_tokens={max_new_tokens} is not a multiple of block_length={block_length}; "
                         f"pick a block_length dividing {max_new_tokens}")
    n_blocks = max_new_tokens // block_length
    if steps % n_blocks:
        raise ValueError(f"steps={steps} cannot be shared equally by the {n_blocks} blocks of {block_length} "
                         f"tokens; pick steps as a multiple of {n_blocks}")
    if steps > max_new_tokens:
        raise ValueError(f"steps={steps} > max_new_tokens={max_new_tokens}: some steps would commit no token; "
                         f"use at most {max_new_tokens} steps (one token per step)")
    return steps, block_length


def tokens_per_step(n_masked, steps):
    """LLaDA's schedule: n_masked tokens spread over `steps` steps as evenly as possible, the
    remainder going to the first steps (10 over 4 steps: [3, 3, 2, 2]). Returns a list of ints."""
    return [n_masked // steps + (i < n_masked % steps) for i in range(steps)]


@torch.no_grad()
def generate_mdm(model, prompt, max_new_tokens, *, mask_id, eos_id, steps=None, block_length=None,
                 temperature=0.0, generator=None, on_step=None, banned_ids=()):
    """LLaDA-style masked-diffusion decoding with low-confidence remasking: the MDM baseline.

    The sequence starts as prompt + max_new_tokens mask ids and is recomputed whole at every step
    (bidirectional attention, so no cache; NFE = steps). Each step predicts every masked position of
    the current block (argmax, or Gumbel-max in float64 with temperature; neither the mask id nor
    banned_ids are ever predicted: see ban) and commits the k most confident ones (confidence: the
    softmax probability of the predicted token), k following tokens_per_step. Blocks of block_length tokens go left to right, steps / n_blocks steps each.
    Committed tokens never change. The result is cut after the first EOS.
    Returns a Generation; its steps hold the (position, token) pairs committed at each step (also
    given to on_step, if set, as it happens).
    Raises ValueError for a causal model, invalid settings, or a prompt + generation longer than
    the context.
    """
    check_attention(model, "mdm")
    check_length_and_temperature(max_new_tokens, temperature)
    steps, block_length = validate_mdm_settings(max_new_tokens, steps, block_length)
    check_context(model, len(prompt), max_new_tokens)
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    P, n_blocks = len(prompt), max_new_tokens // block_length
    x = torch.tensor([prompt + [mask_id] * max_new_tokens], device=device)   # (1, P + L)
    positions = torch.arange(P + max_new_tokens, device=device)[None]
    masked = torch.zeros(P + max_new_tokens, dtype=torch.bool, device=device)
    masked[P:] = True
    trace, nfe = [], 0
    for b in range(n_blocks):
        in_block = torch.zeros_like(masked)
        in_block[P + b * block_length:P + (b + 1) * block_length] = True
        for k in tokens_per_step(block_length, steps // n_blocks):
            logits = model(x, positions)[0]                                 # (P + L, V)
            nfe += 1
            where = (masked & in_block).nonzero()[:, 0]                      # masked positions of the block
            drafts, confidence = draft_tokens(logits[where], temperature, generator, [mask_id, *banned_ids])
            best = confidence.topk(k).indices
            x[0, where[best]] = drafts[best]
            masked[where[best]] = False
            trace.append(list(zip(where[best].tolist(), drafts[best].tolist())))
            if on_step:
                on_step(trace[-1])
    tokens = cut_after_eos(x[0, P:].tolist(), eos_id)
    return Generation(tokens, nfe, time.perf_counter() - t0, trace)


# -----------------------------------------------------------------------------
# command line: decode prompts with a trained checkpoint

DEFAULTS = dict(
    out_dir="out",            # directory holding ckpt.pt (written by train.py)
    prompt="",                # decode this text ...
    prompt_file="",           # ... or the text of this file ...
    num_samples=3,            # ... or this many prompts from the validation split
    max_new_tokens=128,       # rounded up to a multiple of slot_size while decoding
    slot_size=8,
    num_blocks=4,             # serial blocks; must divide max_new_tokens / slot_size
    slot_threshold=0.9,
    token_threshold=0.3,
    temperature=0.0,
    seed=1337,
    device="cpu",
    json=False,               # one JSON object per sample instead of text
    show=False,               # redraw the response after every decoding step (masked tokens as ░)
    method="",                # refusion, ar or mdm; empty: the one the checkpoint was trained for
    steps=0,                  # mdm: denoising steps; 0 = one token per step
    block_length=0,           # mdm: semi-autoregressive block length; 0 = the whole generation
)
METHODS = ("refusion", "ar", "mdm")


def load_prompts(cfg, enc, val_data, gen_len, block_size):
    """Prompts (lists of token ids) from --prompt, --prompt_file or evenly spread over the val split.
    Raises ValueError / FileNotFoundError naming the problem."""
    if cfg["prompt"] and cfg["prompt_file"]:
        raise ValueError("give either --prompt or --prompt_file, not both")
    if cfg["prompt_file"]:
        if not os.path.isfile(cfg["prompt_file"]):
            raise FileNotFoundError(f"--prompt_file={cfg['prompt_file']}: no such file")
        with open(cfg["prompt_file"], encoding="utf-8") as f:
            return [encode(enc, f.read())]
    if cfg["prompt"]:
        return [encode(enc, cfg["prompt"])]
    fits = [i for i in range(len(val_data)) if len(val_data.sample(i)[0]) + gen_len <= block_size]
    if not fits:
        raise ValueError(f"no validation prompt leaves room for {gen_len} new tokens in the context of "
                         f"{block_size}; lower --max_new_tokens")
    picks = [fits[int(j)] for j in torch.linspace(0, len(fits) - 1, min(cfg["num_samples"], len(fits)))]
    return [val_data.sample(i)[0] for i in picks]


def make_decoder(cfg, model, meta, generator):
    """(decode: prompt ids -> Generation, generation length to leave room for) for cfg["method"].

    Every setting is checked here, before any data is prepared. Raises ValueError for an unknown
    method, a method the model's attention does not support, or invalid settings.
    """
    method, n, temperature = cfg["method"], cfg["max_new_tokens"], cfg["temperature"]
    if method not in METHODS:
        raise ValueError(f"--method={method!r}: choose one of {', '.join(METHODS)}")
    check_attention(model, method)
    common = dict(max_new_tokens=n, eos_id=meta["eos_id"], temperature=temperature, generator=generator,
                  banned_ids=(meta["mask_id"], meta["pad_id"]))
    if method == "ar":
        check_length_and_temperature(n, temperature)
        return partial(generate_ar, model, **common), n
    if method == "mdm":
        check_length_and_temperature(n, temperature)
        steps, block_length = validate_mdm_settings(n, cfg["steps"] or None, cfg["block_length"] or None)
        return partial(generate_mdm, model, mask_id=meta["mask_id"], steps=steps, block_length=block_length,
                       **common), n
    gen_len, _ = validate_settings(n, cfg["slot_size"], cfg["num_blocks"], cfg["slot_threshold"],
                                   cfg["token_threshold"], temperature)
    settings = {k: cfg[k] for k in ("slot_size", "num_blocks", "slot_threshold", "token_threshold")}
    return partial(generate_refusion, model, mask_id=meta["mask_id"], **common, **settings), gen_len


class LiveTrace:
    """--show: after every decoding step, redraw the response with still-masked tokens as '░'.

    Called with each step's committed (position, token) pairs; positions are true positions, so a
    ReFusion step fills its slots in place, out of order. Frames go to stderr (stdout keeps the
    results, e.g. --json); on a terminal each frame replaces the last.
    """

    def __init__(self, enc, prompt, gen_len, delay=0.25):
        self.enc, self.prompt, self.gen_len, self.delay = enc, prompt, gen_len, delay
        self.tty = sys.stderr.isatty()
        self.filled, self.step = {}, 0

    def __call__(self, step):
        self.step += 1
        self.filled.update(step)
        P = len(self.prompt)
        spans = sorted(p - P for p, _ in step)
        text = "".join(decode(self.enc, [self.filled[p]]) if p in self.filled else "░"
                       for p in range(P, P + self.gen_len))
        clear = "\033[H\033[J" if self.tty else ""
        print(f"{clear}{decode(self.enc, self.prompt)}{text}\n"
              f"step {self.step}: {len(step)} token(s) committed at response offsets {spans[0]}..{spans[-1]}"
              f" ({len(self.filled)}/{self.gen_len} filled)\n", file=sys.stderr, flush=True)
        if self.tty:
            time.sleep(self.delay)


MISMATCH_NOTES = {
    ("ar", "refusion"): "a refusion model never learns a slot's first token as a next token (SPEC section 4, "
                        "known limit (a)), so plain next-token decoding does poorly; for left-to-right decoding "
                        "use --method=refusion --num_blocks=<number of slots>",
    ("refusion", "ar"): "an ar model was never trained to predict mask tokens, so its plan drafts are poor and "
                        "ReFusion decoding falls back to about two forward passes per token; use --method=ar",
}


def main(argv):
    cfg = parse_args(DEFAULTS, argv)
    check_device(cfg["device"])
    if cfg["num_samples"] <= 0:
        raise ValueError(f"--num_samples={cfg['num_samples']}: ask for at least one validation prompt")
    ckpt = load_checkpoint(cfg["out_dir"], cfg["device"])
    model, meta, tcfg = model_from_checkpoint(ckpt, cfg["device"]), ckpt["meta"], ckpt["config"]
    cfg["method"] = cfg["method"] or tcfg["objective"]
    enc = get_tokenizer(meta["tokenizer"])
    generator = torch.Generator(cfg["device"]).manual_seed(cfg["seed"])
    run, gen_len = make_decoder(cfg, model, meta, generator)
    if (cfg["method"], tcfg["objective"]) in MISMATCH_NOTES:
        print("note: " + MISMATCH_NOTES[cfg["method"], tcfg["objective"]], file=sys.stderr)
    val_data = None
    if not (cfg["prompt"] or cfg["prompt_file"]):
        data_dir = ckpt.get("data_dir", "")  # absolute, so the sampler works from any directory
        try:
            val_data = TokenDataset(data_dir, "val")
        except (FileNotFoundError, ValueError):  # moved or damaged: prepare it as training did
            data_root = os.path.dirname(data_dir) if os.path.isdir(data_dir) else tcfg["data_root"]
            val_data = TokenDataset(prepare(tcfg["dataset"], tcfg["tokenizer"], tcfg["block_size"], data_root,
                                            tcfg.get("too_long", "skip")), "val")
    prompts = load_prompts(cfg, enc, val_data, gen_len, model.config.block_size)
    run(prompts[0][:8])  # warm-up: the first forward passes pay one-time costs
    for prompt in prompts:
        out = run(prompt, on_step=LiveTrace(enc, prompt, gen_len) if cfg["show"] else None)
        text = decode(enc, [t for t in out.tokens if t != meta["eos_id"]])
        if cfg["json"]:
            print(json.dumps({"prompt": decode(enc, prompt), "text": text, **out.stats()}))
            continue
        print("=" * 80)
        print(decode(enc, prompt) + text)
        print("-" * 80)
        s = out.stats()
        print(f"{s['tokens']} tokens in {s['nfe']} forward passes (NFE), {s['tpf']:.2f} tokens per forward "
              f"(TPF), {s['seconds']:.3f} s, {s['tokens_per_s']:.1f} tokens/s")


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
