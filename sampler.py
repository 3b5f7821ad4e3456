"""
The decoders (SPEC section 4): ReFusion's decoding on one screen, then the same with the KV cache as
named steps, then the baselines and a short command line.

    generate_refusion_plain  the paper's algorithm in one function: no cache, no extension
    generate_refusion        the same with the KV cache: serial blocks, one after another
    decode_serial_block      one serial block: plan, verify, infill (if verify commits none), commit
    plan_slots       step 1  one diffusion step over the masked slots: draft, select the confident
    verify_drafts    step 2  one causal pass over the selected drafts: their longest passing prefix
    infill_slots     step 3  finish the selected slots in parallel, left to right, a cache row each
    commit_slots     step 4  record the finished slots, whose keys/values now follow the buffer
    SpeculativeInfill        infill="speculative" (SPEC 4.1, beyond the paper): one object, or None
    generate_next_token, generate_mdm    the baselines: next-token decoding, LLaDA-style MDM

    python sampler.py config/sample_quotes.py            # the quick start's model, 10 prompts
    python sampler.py config/sample_quotes.py --show --num_samples=1 --plot=decode.png
    python sampler.py --init_from=smollm2 --chat --prompt="What is a hash table?"   # a real model

The command line's plumbing (models, prompts, the live trace, printing) is support/sampling.py;
many prompts at once (--batch_size, SPEC section 4.2) is support/batching.py.
"""

import math
import sys
import time
from dataclasses import dataclass, field, fields
from functools import partial

import torch
import torch.nn.functional as F

from configurator import (INFILL_MODES, ContextTooLong, DecodeSettings,  # noqa: F401
                          MDMSettings, RefusionSettings, check_attention, check_context,
                          explicit_keys, parse_args, run_cli, settings_in)
from kvcache import bucket, cache_length

# -----------------------------------------------------------------------------
# ReFusion on one screen: the paper's decoding, plainly (SPEC section 4)


# Decoders run under inference mode: no autograd records (about 10% a token faster than no_grad).
@torch.inference_mode()
def generate_refusion_plain(model, prompt, settings, *, mask_id, eos_ids, generator=None):
    """ReFusion's decoding of one prompt (token ids), plainly (SPEC section 4, the paper's infill;
    settings: RefusionSettings, whose infill is not read; only the mask id is banned; the helpers
    are under "choosing tokens" below). No cache: each pass feeds the whole committed buffer (the
    prompt, then the slots in commit order, at true positions) and the new tokens, each committed
    token seeing what it saw (infilled slots not each other). Returns a Generation."""
    check_attention(model, "refusion")
    check_context(model, len(prompt), settings)
    t0 = time.perf_counter()
    S = settings.slot_size
    device = next(model.parameters()).device
    cols = torch.arange(S, device=device)                   # each token's place in its slot
    eos_tensor = torch.tensor(eos_ids, device=device)
    # The committed buffer in commit order: its tokens, their true positions, and for each token
    # the span of the buffer it never saw, (lo, hi): the slots infilled beside its own.
    buf = list(prompt)
    pos = list(range(len(prompt)))
    unseen = [(0, 0)] * len(prompt)
    trace = []
    nfe = 0
    eos = False

    def forward(tokens, at):
        """One pass: the buffer, then tokens (R, T) at true positions at (R, T) in every row.
        Returns the new tokens' logits (R, T, V)."""
        nonlocal nfe
        nfe += 1
        idx = torch.cat([torch.tensor(buf, device=device).expand(len(tokens), -1), tokens], 1)
        where = torch.cat([torch.tensor(pos, device=device).expand(len(tokens), -1), at], 1)
        mask = sees(unseen + [(0, 0)] * tokens.shape[1], device)
        return model(idx, where, attn_mask=mask, logits_from=len(buf))

    def commit(starts, slots, infilled):
        """Step 4: append the slots (token lists) from true positions starts to the buffer;
        infilled slots never saw each other. Returns the starts of the committed slots."""
        first = len(buf)
        for start, slot in zip(starts, slots):
            # an infilled slot never saw the slots infilled before it in this step
            unseen.extend([(first, len(buf)) if infilled else (0, 0)] * len(slot))
            buf.extend(slot)
            pos.extend(range(start, start + len(slot)))
        trace.append([(s + i, t) for s, slot in zip(starts, slots) for i, t in enumerate(slot)])
        return starts[:len(slots)]

    for b in range(settings.serial_num_blocks):
        n = settings.slots_per_serial_block
        # The pool: the true starts of the serial block's masked slots.
        pool = [len(prompt) + (b * n + k) * S for k in range(n)]
        while pool:
            # 1. Plan: one pass drafts every masked slot; the slots whose first token passes
            # slot_threshold are selected (if none passes, the one whose first token is best).
            at = torch.tensor(pool, device=device)[:, None] + cols          # (slots, S)
            logits = forward(torch.full_like(at, mask_id).view(1, -1), at.view(1, -1))[0]
            drafts, probs = draft_tokens(logits, settings.temperature, generator, [mask_id])
            scores = probs.view(-1, S)[:, 0]
            selected = (scores > settings.slot_threshold).nonzero()[:, 0].tolist()
            if not selected:
                selected = [int(scores.argmax())]
            starts = [pool[k] for k in selected]
            drafts = drafts.view(-1, S)[selected]
            at = at[selected]

            # 2. Verify: one causal pass over the selected drafts, concatenated. A token passes
            # when it is a slot's first or its probability passes token_threshold.
            flat = drafts.view(1, -1)
            probs = next_token_probs(forward(flat, at.view(1, -1)), flat).view(-1, S)
            passed = (probs > settings.token_threshold) | (cols == 0)
            n_passed = int(leading_true(passed.view(1, -1))[0])
            prefix = flat[0, :n_passed].tolist()
            stop = first_eos(prefix, eos_ids)
            ended = stop is not None                  # an EOS ends the decode after this step

            if ended or len(prefix) >= S:
                # 4. Commit the passing prefix's whole slots, or its tokens up to its EOS.
                n_commit = stop + 1 if ended else len(prefix) // S * S
                slots = [prefix[i:min(i + S, n_commit)] for i in range(0, n_commit, S)]
                done = commit(starts, slots, infilled=False)
            else:
                # 3. Infill: each selected slot in a row of its own, from what verify accepted.
                accepted = leading_true(passed)                 # (rows,) accepted tokens
                ends = torch.full_like(at[:, 0], S)             # (rows,) each row's length
                while True:
                    # c. A row ends at its first accepted EOS (verify's prefix may hold one);
                    # the rows after it go.
                    is_eos = torch.isin(drafts, eos_tensor) & (cols < accepted[:, None])
                    if is_eos.any():
                        r = int(is_eos.any(dim=1).nonzero()[0])
                        drafts = drafts[:r + 1]
                        at = at[:r + 1]
                        ends = ends[:r + 1]
                        ends[r] = int(is_eos[r].long().argmax()) + 1
                        accepted = torch.minimum(accepted[:r + 1], ends)
                        ended = True
                    if (accepted >= ends).all():
                        break
                    # a. Draft: one pass predicts every masked token of every row.
                    masked = cols >= accepted[:, None]
                    logits = forward(torch.where(masked, mask_id, drafts), at)
                    guess = ban(logits, [mask_id]).argmax(dim=-1)
                    drafts = torch.where(masked, guess, drafts)
                    # b. Verify: one causal pass; each row keeps its longest passing prefix.
                    probs = next_token_probs(forward(drafts, at), drafts)
                    passed = (probs > settings.token_threshold) | (cols <= accepted[:, None])
                    accepted = torch.minimum(leading_true(passed), ends)
                # 4. Commit every row up to its end; the rows never saw each other.
                slots = [row[:end] for row, end in zip(drafts.tolist(), ends.tolist())]
                done = commit(starts, slots, infilled=True)

            # The committed slots leave the pool; after an EOS, so does every slot past it.
            eos = eos or ended
            pool = [p for p in pool if p not in done and not (ended and p > done[-1])]
        if eos:
            break

    # The response, read by true position, as the cached decoder reads it.
    response = {p: t for p, t in zip(pos, buf) if p >= len(prompt)}
    tokens = cut_after_eos([response[p] for p in sorted(response)], eos_ids)
    return Generation(tokens[:settings.max_new_tokens], nfe, time.perf_counter() - t0, trace)


def sees(unseen, device):
    """The plain decoder's attention mask, (N, N) bool over N tokens in buffer order, each with
    the span [lo, hi) of earlier tokens it never saw: causal, except slots infilled side by side,
    which never saw each other (SPEC section 4, step 3)."""
    j = torch.arange(len(unseen), device=device)
    lo, hi = torch.tensor(unseen, device=device).T
    causal = j[None, :] <= j[:, None]
    infilled_beside = (j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None])
    return causal & ~infilled_beside

# -----------------------------------------------------------------------------
# ReFusion with the KV cache: plan, verify, infill, commit as named steps (SPEC section 4)


@torch.inference_mode()
def generate_refusion(model, prompt, settings, *, mask_id, eos_ids, generator=None, on_step=None,
                      banned_ids=()):
    """ReFusion's decoding of one prompt (SPEC section 4) with the KV cache: each committed token's
    keys/values are computed once, then reused. model: a causal Transformer (or a module with its
    forward and new_kv_cache), in eval mode; prompt: token ids; settings: RefusionSettings;
    mask_id: fed at masked positions; eos_ids: tuple of EOS ids; generator: for temperature > 0;
    on_step: optional, given each step's committed (position, token) pairs; banned_ids: never
    generated, besides the mask id. Returns a Generation of at most max_new_tokens tokens. Raises
    ValueError for a bidirectional model, ContextTooLong past the model's context."""
    check_attention(model, "refusion")
    check_context(model, len(prompt), settings)
    t0 = time.perf_counter()
    state = DecodeState(model, prompt, settings, mask_id, eos_ids, generator, on_step, banned_ids)
    S, n = settings.slot_size, settings.slots_per_serial_block
    for b in range(settings.serial_num_blocks):
        first = len(prompt) + b * n * S                 # the serial block's first position
        if decode_serial_block(state, first, n, settings):
            break                                       # EOS: no later serial block starts
    tokens = cut_after_eos([state.response[p] for p in sorted(state.response)], eos_ids)
    return Generation(tokens[:settings.max_new_tokens], state.nfe, time.perf_counter() - t0,
                      state.trace, state.step_nfe, state.cache.cache_bytes)


def decode_serial_block(state, first, n, settings):
    """Decode one serial block, its n slots from true position `first` on, until none of them is
    masked (SPEC section 4, steps 1-4). Returns True when EOS ended it (the slots before the EOS
    slot are still decoded; no later serial block starts)."""
    S = settings.slot_size
    # The pool: its slots' true starts, ascending (a list, for the decisions), and the true
    # positions of their tokens (n, S) on the device, for the passes.
    pool = [first + i * S for i in range(n)]
    at = torch.arange(first, first + n * S, device=state.device).view(n, S)
    eos = False
    while pool:
        selected, starts, drafts = plan_slots(state, pool, at, settings.slot_threshold)
        commit, accepted = verify_drafts(state, starts, at[selected], drafts,
                                         settings.token_threshold)
        if not commit:  # not one whole slot passed verify: finish every selected slot in parallel
            commit = infill_slots(state, starts, at[selected], drafts, accepted,
                                  settings.token_threshold)
        commit_slots(state, commit)
        eos = eos or commit.eos
        # The committed slots leave the pool; after an EOS, so does every slot past it.
        stays = torch.ones(len(pool), dtype=torch.bool, device=state.device)
        stays.index_fill_(0, selected[:len(commit)], False)
        if commit.eos:
            stays[pool.index(commit.starts[-1]):].fill_(False)
        pool = [p for p in pool
                if p not in commit.starts and not (commit.eos and p > commit.starts[-1])]
        # the rows of `at` that stay, found on the device (its size is known: no read from it)
        rows = torch.nonzero_static(stays, size=len(pool))[:, 0]
        at = at[rows]
    return eos


# Where a wider pass costs no more (a GPU's small passes), ReFusion pads each pass to a bucketed
# width (DecodeState.forward): the same tokens, in a few shapes. A CPU's pass costs its tokens.
PAD_WIDTHS = {"cuda": True}


class DecodeState:
    """What the decoder carries from step to step (SPEC section 4, "State"): the committed buffer
    (the prompt, then the slots in commit order) as `response` (true position -> token) and the
    cache's row 0 (so `cache.length` is its length); `pending`, the prompt until the first plan call
    feeds it; nfe; per step its trace and step_nfe; speculative (a SpeculativeInfill, or None)."""

    def __init__(self, model, prompt, settings, mask_id, eos_ids, generator, on_step, banned_ids):
        self.model, self.generator, self.on_step = model, generator, on_step
        # a cache of a bucketed length: prompts of similar lengths share its shape (kvcache.py)
        max_len = cache_length(len(prompt) + settings.gen_length, model.config.block_size)
        self.cache = model.new_kv_cache(max_len, max_batch=settings.slots_per_serial_block)
        self.device = self.cache.kv.device
        self.mask_id, self.eos_ids = mask_id, tuple(eos_ids)
        # Made once, on the device: no step builds a tensor from Python data.
        self.eos_tensor = torch.tensor(self.eos_ids, device=self.device)  # for end_rows_at_eos
        self.banned = torch.tensor([mask_id, *banned_ids], device=self.device)  # never written
        self.temperature, self.prompt_len = settings.temperature, len(prompt)
        self.pending = torch.tensor([prompt], device=self.device)          # (1, P) until fed
        self.pending_pos = torch.arange(len(prompt), device=self.device)[None]
        self.response, self.nfe, self.trace, self.step_nfe = {}, 0, [], []
        self.speculative = SpeculativeInfill.of(settings, len(prompt))  # SPEC 4.1, or None
        self.pad_widths = PAD_WIDTHS.get(self.device.type, False)

    def forward(self, tokens, positions, keep=None, logits_from=0):
        """One counted pass of tokens (B, T) at true positions (B, T) after the cache -> logits
        (B, T - logits_from, V); the cache keeps the keys/values of the first `keep` (None: all).
        With pad_widths the pass is padded to kvcache.bucket(T) tokens, after the real ones (which
        see none of it, causally), so that a decode feeds few shapes."""
        start = self.cache.length
        self.nfe += 1
        T = tokens.shape[1]
        if self.pad_widths:
            pad = min(bucket(T), self.cache.max_len - start) - T
            tokens = F.pad(tokens, (0, pad), value=self.mask_id)
            positions = F.pad(positions, (0, pad))
        logits = self.model(tokens, positions, kv_cache=self.cache, logits_from=logits_from)
        self.cache.crop(start + (T if keep is None else keep))
        return logits[:, :T - logits_from]


def plan_slots(state, pool, at, slot_threshold):
    """Step 1, plan: one diffusion step over the masked slots starting at pool (ascending; at:
    (len(pool), S) int64, their true positions), after the pending prompt on the first call; the
    masks' keys/values are not kept. Returns (selected: (k,) int64 the selected slots' indexes
    into pool, ascending, on the device; their starts, a list; their drafts (k, S) int64)."""
    n_pending = state.pending.shape[1]
    masks = torch.full((1, at.numel()), state.mask_id, device=state.device)
    tokens = torch.cat([state.pending, masks], dim=1)
    pos = torch.cat([state.pending_pos, at.view(1, -1)], dim=1)
    lead = min(n_pending, 1)  # the prompt's last token, whose logits predict the first response's
    logits = state.forward(tokens, pos, keep=n_pending, logits_from=n_pending - lead)[0]
    # the prompt's keys/values stay cached; logits: lead + masks
    state.pending, state.pending_pos = tokens[:, :0], pos[:, :0]
    drafts, probs = draft_tokens(logits[lead:], state.temperature, state.generator, state.banned)
    drafts, probs = drafts.view(at.shape), probs.view(at.shape)
    if state.speculative:  # SPEC 4.1
        state.speculative.plan(state, pool, logits, lead, drafts, probs)
    scores = probs[:, 0]  # a slot's score: its first token's probability
    chosen = scores > slot_threshold
    # none passes: the first of equal best scores (torch.argmax takes the first; SPEC step 1)
    best = torch.arange(len(pool), device=state.device) == scores.argmax()
    chosen = torch.where(chosen.any(), chosen, best)
    starts = [p for p, c in zip(pool, chosen.tolist()) if c]  # the step's read: which slots
    selected = torch.nonzero_static(chosen, size=len(starts))[:, 0]
    return selected, starts, drafts[selected]


def verify_drafts(state, starts, at, drafts, token_threshold):
    """Step 2, verify: one causal pass over the drafts (k, S) int64 of the slots at true starts
    `starts` (at: (k, S) int64 their positions), concatenated. Its longest passing prefix commits
    the slots up to the first EOS, or the whole slots it covers (their keys/values stay cached); if
    none, the Commit is empty and infill_slots follows. Returns (commit, accepted: (k,) int64 each
    slot's own accepted prefix, for infill_slots)."""
    k, S = drafts.shape
    buffer_length = state.cache.length
    tokens = drafts.reshape(1, k * S)
    logits = state.forward(tokens, at.reshape(1, k * S))     # (1, k * S, V)
    passed = (next_token_probs(logits, tokens) > token_threshold).view(k, S)
    passed[:, 0].fill_(True)                                 # a slot's first token: as drafted
    # the step's read: how many drafts passed, then the drafts
    n_passed, *flat = torch.cat([leading_true(passed.view(1, -1)), drafts.view(-1)]).tolist()
    prefix = flat[:n_passed]
    eos_at = first_eos(prefix, state.eos_ids)
    n = eos_at + 1 if eos_at is not None else len(prefix) // S * S  # tokens to commit
    # the committed tokens' keys/values, already after the buffer, stay
    state.cache.crop(buffer_length + n)
    slots = [prefix[i:min(i + S, n)] for i in range(0, n, S)]
    if state.speculative:  # SPEC 4.1
        state.speculative.verified(slots, logits, S)
    return Commit(starts[:len(slots)], slots, eos_at is not None), leading_true(passed)


@dataclass
class Commit:
    """Finished slots, as verify_drafts or infill_slots hand them to commit_slots (SPEC step 4),
    their keys/values already after the committed buffer in the cache's row 0, in slot order.
    starts: true start positions, ascending; tokens: one list of ids per slot, cut after EOS;
    eos: the last slot ends with EOS (the later slots of the serial block are dropped, and no
    later serial block starts)."""
    starts: list[int]
    tokens: list[list[int]]
    eos: bool = False

    def __len__(self):
        return len(self.starts)


@dataclass
class InfillRows:
    """The slots of one parallel infill (SPEC step 3): row i of every field, and of the cache, is
    slot i. What infill_slots keeps true between its forward passes:
      - cache row i holds the committed buffer, then tokens[i, :shared], where `shared` (the
        cache's length beyond the buffer) is a prefix every row has accepted;
      - tokens[i, :accepted[i]] are accepted and never change again; the rest are drafts;
      - slot i commits tokens[i, :lengths[i]] (S, or up to its EOS); accepted <= lengths.
    """
    starts: list[int]          # true start position of each slot, ascending
    positions: torch.Tensor    # (k, S) int64 true position of every token
    tokens: torch.Tensor       # (k, S) int64
    accepted: torch.Tensor     # (k,) int64
    lengths: torch.Tensor      # (k,) int64
    eos: bool = False          # a row ended at EOS (step 3c): every slot after it is dropped

    def keep(self, n, cache):
        """Keep rows 0..n-1, here and in the cache."""
        if n < cache.batch:
            cache.keep_rows(n)
        self.starts = self.starts[:n]
        self.positions = self.positions[:n]
        self.tokens = self.tokens[:n]
        self.accepted = self.accepted[:n]
        self.lengths = self.lengths[:n]


def infill_slots(state, starts, at, drafts, accepted, token_threshold):
    """Step 3, parallel autoregressive infill: each selected slot (k true starts, at (k, S) their
    positions, drafts (k, S), accepted (k,) as verify judged them) in its own cache row after the
    committed buffer. At most S rounds of (a) draft_rows, (b) verify_rows, (c) end_rows_at_eos,
    (d) kept_prefix; each round reads from the device once (end_rows_at_eos).
    Returns a Commit of the k' <= k finished slots, laid after the buffer in the cache's row 0."""
    k, S = drafts.shape
    buffer_length = state.cache.length          # the committed buffer, shared by every row
    rows = InfillRows(list(starts), at, drafts.clone(), accepted.clone(),
                      torch.full_like(accepted, S))
    if state.speculative:  # SPEC 4.1
        state.speculative.restart_later_rows(rows)
    state.cache.repeat_prefix(k)
    # Verify committed only what the whole concatenation accepted, but a later slot's own accepted
    # prefix may already hold EOS: that slot ends there and the slots after it go before any pass.
    done, least = end_rows_at_eos(state, rows)
    for _ in range(S):                   # each round accepts >= 1 token of every unfinished row
        if done:
            break
        # slot tokens [0, shared) of every row are cached
        shared = state.cache.length - buffer_length
        draft_rows(state, rows, shared)                             # (a)
        verify_rows(state, rows, shared, token_threshold)           # (b)
        done, least = end_rows_at_eos(state, rows)                  # (c)
        state.cache.crop(buffer_length + kept_prefix(state, rows, done, least))   # (d)
    # one read: each row's length, then its tokens
    finished = torch.cat([rows.lengths[:, None], rows.tokens], dim=1).tolist()
    # each row's slot laid after the buffer, in row 0, in slot order
    state.cache.commit_rows([(i, row[0]) for i, row in enumerate(finished)], buffer_length)
    tokens = [row[1:1 + row[0]] for row in finished]
    return Commit(rows.starts, tokens, rows.eos)


def draft_rows(state, rows, shared):
    """Step 3a, draft: feed every row's tokens from column `shared` on, its unaccepted ones as mask
    ids; each masked position's prediction (argmax) fills it. Its keys/values are not kept."""
    window = rows.tokens[:, shared:]
    columns = torch.arange(shared, shared + window.shape[1], device=state.device)
    masked = columns >= rows.accepted[:, None]
    fed = torch.where(masked, state.mask_id, window)
    logits = state.forward(fed, rows.positions[:, shared:], keep=0)
    guess = ban(logits, state.banned).argmax(dim=-1)                   # (k, T)
    rows.tokens[:, shared:] = torch.where(masked, guess, window)
    if state.speculative:  # SPEC 4.1
        state.speculative.force_next_tokens(state, rows, logits, shared)


def verify_rows(state, rows, shared, token_threshold):
    """Step 3b, verify: feed every row's tokens from column `shared` on; in each row the first
    unaccepted token is accepted (it was predicted from an accepted prefix), later ones while
    their next-token probability exceeds token_threshold."""
    window = rows.tokens[:, shared:]
    logits = state.forward(window, rows.positions[:, shared:])
    columns = torch.arange(shared, shared + window.shape[1], device=state.device)
    probs = next_token_probs(logits, window)
    passed = (probs > token_threshold) | (columns <= rows.accepted[:, None])
    rows.accepted = torch.minimum(shared + leading_true(passed), rows.lengths)
    if state.speculative:  # SPEC 4.1
        state.speculative.rows_verified(logits)


def end_rows_at_eos(state, rows):
    """Step 3c: the first row whose accepted tokens hold EOS ends after it; the rows after it are
    dropped, from rows (an InfillRows) and from the cache, and rows.eos is set. Worked out on the
    device with what step 3d needs, so that a round reads once: returns (every row is done, the
    fewest tokens a row has accepted)."""
    k, S = rows.tokens.shape
    is_eos = torch.isin(rows.tokens, state.eos_tensor)
    is_eos &= torch.arange(S, device=state.device) < rows.accepted[:, None]   # accepted EOS only
    found = is_eos.any(dim=1)                                       # (k,) rows holding one
    eos = found.any()
    r = found.long().argmax()                                       # the first such row
    row = torch.arange(k, device=state.device)
    kept = ~eos | (row <= r)                                        # the rows that stay
    up_to_eos = is_eos.index_select(0, r[None])[0].long().argmax() + 1   # row r's length
    lengths = torch.where(eos & (row == r), up_to_eos, rows.lengths)
    accepted = torch.minimum(rows.accepted, lengths)
    done = ((accepted >= lengths) | ~kept).all()
    least = torch.where(kept, accepted, S).min()
    eos, r, done, least = torch.stack([eos.long(), r, done.long(), least]).tolist()  # the read
    if eos:
        rows.keep(r + 1, state.cache)
        rows.lengths, rows.accepted, rows.eos = lengths[:r + 1], accepted[:r + 1], True
    return bool(done), least


def kept_prefix(state, rows, done, shared):
    """Step 3d: how many slot tokens every cache row keeps after the buffer: all of them once every
    row is done, else `shared`, the prefix every row has accepted (its keys/values are never
    recomputed)."""
    if done:
        return rows.tokens.shape[1]
    if state.speculative:  # SPEC 4.1
        shared = state.speculative.kept_prefix(shared)
    return shared


def commit_slots(state, commit):
    """Step 4, commit: record the Commit's tokens at their true positions (its keys/values already
    follow the buffer in the cache); the step's pairs go to state.trace (and on_step)."""
    step = [(start + i, t) for start, ids in zip(commit.starts, commit.tokens)
            for i, t in enumerate(ids)]
    assert not any(p in state.response for p, _ in step), "a position was committed twice"
    state.response.update(step)
    buffer_length = state.prompt_len + len(state.response)
    assert state.cache.length == buffer_length, "the cache holds the buffer"
    state.trace.append(step)
    state.step_nfe.append(state.nfe - sum(state.step_nfe))
    if state.speculative:  # SPEC 4.1
        state.speculative.committed(state, commit)
    if state.on_step:
        state.on_step(step)


# -----------------------------------------------------------------------------
# beyond the paper: infill="speculative", the next-token pathway in charge (SPEC 4.1, opt-in)


class SpeculativeInfill:
    """SPEC section 4.1: the next-token pathway writes each infill round's forced token, as the
    target model corrects a rejected draft in speculative decoding. Each of the paper's steps calls
    one method. frontier: the first uncommitted response position; next_logits: (position, (V,)),
    the prediction for the frontier made seeing every position before it, or None; ends: the step's
    logits (V,) at the end of each slot it commits that saw the slots committed before it."""

    def __init__(self, prompt_len):
        self.frontier, self.next_logits, self.ends = prompt_len, None, []

    @classmethod
    def of(cls, settings, prompt_len):
        """One for a decode with infill="speculative"; None with the paper's infill."""
        return cls(prompt_len) if settings.infill == "speculative" else None

    def plan(self, state, pool, logits, lead, drafts, probs):
        """Step 1: a leftmost slot at the frontier takes its first draft and score from the kept
        prediction (first logits[0]: the prompt's last). drafts, probs (len(pool), S): in place."""
        if lead:  # kept past later passes: a copy (a compiled pass may reuse its output's memory)
            self.next_logits = (self.frontier, logits[0].clone())
        if self.next_logits is not None and self.next_logits[0] == pool[0]:
            drafts[0, :1], probs[0, :1] = draft_tokens(self.next_logits[1][None],
                                                       state.temperature, state.generator,
                                                       state.banned)

    def verified(self, slots, logits, S):
        """Step 2: each slot verify commits (logits (1, k * S, V)) saw every slot before it."""
        self.ends = [logits[0, i * S + len(slot) - 1].clone() for i, slot in enumerate(slots)]

    def restart_later_rows(self, rows):
        """Step 3: every row but the first restarts from its first token: verify judged the rest
        after the drafts of the slots before it, which its row does not see."""
        rows.accepted[1:].fill_(1)

    def force_next_tokens(self, state, rows, logits, shared):
        """Step 3a: the first unaccepted token of every unfinished row becomes what its accepted
        left neighbour, fed in this draft pass (logits (k, T, V) from column `shared`), predicts."""
        k, S = rows.tokens.shape
        j = rows.accepted.clamp(max=S - 1)[:, None]         # (k, 1); a finished row keeps its own
        left = (j - 1 - shared).clamp(min=0)[:, :, None].expand(-1, -1, logits.shape[-1])
        predicted = ban(logits.gather(1, left)[:, 0], state.banned).argmax(dim=-1)   # (k,)
        unfinished = rows.accepted < rows.lengths
        own = rows.tokens.gather(1, j)[:, 0]
        rows.tokens.scatter_(1, j, torch.where(unfinished, predicted, own)[:, None])

    def rows_verified(self, logits):
        """Step 3b: only row 0 saw the slots committed before it: its last token's logits."""
        self.ends = [logits[0, -1].clone()]

    def kept_prefix(self, shared):
        """Step 3d: one token less than the paper's: the last is fed again, to predict the next."""
        return shared - 1

    def committed(self, state, commit):
        """Step 4: move the frontier past the committed positions, keeping the prediction for it
        when the slot just committed before it saw every position to its left."""
        frontier = self.frontier
        while frontier in state.response:
            frontier += 1
        if frontier == self.frontier:
            return
        self.frontier, self.next_logits = frontier, None
        for start, ids, logits in zip(commit.starts, commit.tokens, self.ends):
            if start + len(ids) == frontier:
                self.next_logits = (frontier, logits)

# -----------------------------------------------------------------------------
# baseline decoders (SPEC section 4, "Baseline decoders"): next-token decoding, LLaDA-style MDM


# Next-token decoding reads its tokens from the device every EOS_EVERY tokens on a GPU, where a
# read stalls the queue of passes (the passes past an EOS are wasted: NFE counts them), and after
# every token on a CPU, which waits for no one.
EOS_EVERY = {"cpu": 1}
GPU_EOS_EVERY = 16


@torch.inference_mode()
def generate_next_token(model, prompt, settings, *, eos_ids, generator=None, on_step=None,
                        banned_ids=(), eos_every=None):
    """Next-token decoding with the KV cache: the ARM baseline. settings: DecodeSettings. The
    prompt's prefill predicts the first token, then one forward per further token; tokens drawn as
    draft_tokens does, never banned_ids, until EOS or max_new_tokens. eos_every: tokens between
    two looks for EOS (None: EOS_EVERY of the device, else GPU_EOS_EVERY; an on_step looks at
    every token), the passes after the EOS counted in NFE and the last step's step_nfe. Returns a
    Generation, one (position, token) pair per step in its trace (and to on_step). Raises
    ValueError for a bidirectional model or a prompt + generation longer than the context."""
    check_attention(model, "next_token")
    check_context(model, len(prompt), settings)
    t0 = time.perf_counter()
    max_len = cache_length(len(prompt) + settings.max_new_tokens, model.config.block_size)
    cache = model.new_kv_cache(max_len)
    device = cache.kv.device
    if eos_every is None:
        eos_every = 1 if on_step else EOS_EVERY.get(device.type, GPU_EOS_EVERY)
    banned = torch.tensor(banned_ids, dtype=torch.long, device=device)
    tokens = torch.tensor([prompt], device=device)                     # (1, P), the prefill
    positions = torch.arange(len(prompt), device=device)[None]
    out = torch.zeros(settings.max_new_tokens, dtype=torch.long, device=device)
    n, response = 0, []                      # tokens drawn; those read from the device so far
    while n < settings.max_new_tokens:
        logits = model(tokens, positions, kv_cache=cache, logits_from=-1)[0]  # (1, V): the next
        token, _ = draft_tokens(logits, settings.temperature, generator, banned)
        out[n:n + 1] = token
        n += 1
        if on_step:
            on_step([(len(prompt) + n - 1, int(token))])
        # every eos_every tokens, and at the end, one read of the tokens drawn since the last one
        if n % eos_every == 0 or n == settings.max_new_tokens:
            response += out[len(response):n].tolist()
            if first_eos(response, eos_ids) is not None:
                break
        tokens, positions = token[None], positions[:, -1:] + 1         # (1, 1) each
    response = cut_after_eos(response, eos_ids)
    trace = [[(len(prompt) + i, t)] for i, t in enumerate(response)]
    step_nfe = [1] * len(response)
    step_nfe[-1] += n - len(response)                # the passes run past the EOS
    return Generation(response, n, time.perf_counter() - t0, trace, step_nfe, cache.cache_bytes)


def tokens_per_step(n_masked, steps):
    """LLaDA's schedule: n_masked tokens spread over `steps` steps as evenly as possible, the
    remainder going to the first steps (10 over 4 steps: [3, 3, 2, 2]). Returns a list of ints."""
    return [n_masked // steps + (i < n_masked % steps) for i in range(steps)]


@torch.inference_mode()
def generate_mdm(model, prompt, settings, *, mask_id, eos_ids, generator=None, on_step=None,
                 banned_ids=()):
    """LLaDA-style masked-diffusion decoding with low-confidence remasking: the MDM baseline.
    settings: MDMSettings. prompt + max_new_tokens masks, recomputed whole at every step (no
    cache; NFE = steps). Each step drafts every masked position of the current semi-autoregressive
    block (as draft_tokens does; never the mask id or banned_ids; from the position's own logits,
    or with settings.mdm_shift the previous position's, as Dream) and commits the k most confident
    (tokens_per_step; by settings.confidence, dream_confidence); the blocks go left to right.
    Cut after the first EOS. Returns a Generation, each step's committed (position, token) pairs
    in its trace (and to on_step). Raises ValueError for a causal model or a prompt + generation
    longer than the context."""
    check_attention(model, "mdm")
    check_context(model, len(prompt), settings)
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    P, L = len(prompt), settings.max_new_tokens
    x = torch.tensor([prompt + [mask_id] * L], device=device)          # (1, P + L)
    positions = torch.arange(P + L, device=device)[None]
    masked = positions[0] >= P                                          # (P + L,) still masked
    banned = torch.tensor([mask_id, *banned_ids], device=device)
    steps = []                                       # per step, (positions, tokens) on the device
    for b in range(settings.n_semi_ar_blocks):
        in_block = (positions[0] - P) // settings.block_length == b
        left = settings.block_length                 # the block's masked positions, counted here
        for k in tokens_per_step(left, settings.steps // settings.n_semi_ar_blocks):
            logits = model(x, positions, logits_from=P - settings.mdm_shift)[0][:L]  # (L, V)
            # the block's masked positions: their number is known, so no read from the device
            where = torch.nonzero_static(masked & in_block, size=left)[:, 0]
            drafts, confidence = draft_tokens(logits[where - P], settings.temperature, generator,
                                              banned)
            if settings.confidence != "prob":  # Dream's rules (opt-in)
                confidence = dream_confidence(logits[where - P], drafts, settings.confidence,
                                              banned)
            best = confidence.topk(k).indices
            x[0, where[best]] = drafts[best]
            masked.index_fill_(0, where[best], False)
            left -= k
            steps.append((where[best], drafts[best]))
            if on_step:
                on_step(list(zip(where[best].tolist(), drafts[best].tolist())))
    committed = torch.cat([torch.stack(step) for step in steps], dim=1).tolist()  # one read
    trace, i = [], 0
    for where, _ in steps:
        trace.append(list(zip(committed[0][i:i + len(where)], committed[1][i:i + len(where)])))
        i += len(where)
    tokens = cut_after_eos(x[0, P:].tolist(), eos_ids)
    return Generation(tokens, len(steps), time.perf_counter() - t0, trace, [1] * len(steps))

# -----------------------------------------------------------------------------
# results (the settings and their checks: configurator.py)


@dataclass
class Generation:
    """The result of one decode and its statistics (SPEC section 4, "Statistics"): tokens (the
    response's ids in position order, cut after the first EOS), nfe (forward passes, the prefill
    included), seconds (wall clock), trace (per step, the (true position, token) pairs it
    committed), step_nfe (per step, its forward passes), cache_bytes (the most bytes its KV cache
    held; 0 for the MDM, which has none)."""
    tokens: list[int]
    nfe: int
    seconds: float
    trace: list = field(default_factory=list, repr=False)
    step_nfe: list = field(default_factory=list, repr=False)
    cache_bytes: int = 0

    @property
    def tpf(self):
        """Tokens per forward over the whole generation: tokens / NFE."""
        return len(self.tokens) / max(self.nfe, 1)

    @property
    def tokens_per_s(self):
        """Generated tokens per second of wall-clock decode time."""
        return len(self.tokens) / max(self.seconds, 1e-9)

    def stats(self):
        """The statistics (tokens, nfe, tpf, seconds, tokens_per_s, cache_bytes) as numbers."""
        return {"tokens": len(self.tokens), "nfe": self.nfe, "tpf": round(self.tpf, 3),
                "seconds": round(self.seconds, 4), "tokens_per_s": round(self.tokens_per_s, 2),
                "cache_bytes": self.cache_bytes}


# -----------------------------------------------------------------------------
# choosing tokens


def ban(scores, token_ids):
    """Set scores[..., id] = -inf for each id, in place, and return scores (..., V) about to be
    maximized, so no banned token is chosen; confidences stay the raw softmax probabilities (SPEC
    section 4). ReFusion and the MDM ban the mask id; the command line also bans the pad id.
    token_ids: (n,) int64 on the scores' device (the decoders make it once), or a list."""
    if not torch.is_tensor(token_ids):
        token_ids = torch.tensor(list(token_ids), dtype=torch.long, device=scores.device)
    return scores.index_fill_(-1, token_ids, -math.inf)


def draft_tokens(logits, temperature, generator, banned=()):
    """Draft a token at each row of logits (N, V) float32 -> (tokens (N,) int64, their raw softmax
    probabilities (N,) float32). temperature 0: argmax; else Gumbel-max in float64, a row whose
    logits / temperature overflow taking the argmax (the limit). Never a `banned` token."""
    probs = torch.softmax(logits.float(), dim=-1)
    if temperature == 0:
        tokens = ban(probs.clone(), banned).argmax(dim=-1)
    else:
        u = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
        gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
        scores = logits.double() / temperature + gumbel
        # overflowed scores tie at +-inf, where argmax would take the lowest id, banned or not
        overflow = (torch.isfinite(logits) & ~torch.isfinite(scores)).any(dim=-1, keepdim=True)
        tokens = ban(torch.where(overflow, logits.double(), scores), banned).argmax(dim=-1)
    return tokens, probs.gather(-1, tokens[:, None])[:, 0]


def dream_confidence(logits, tokens, rule, banned=()):
    """Dream's confidence in each drafted token (SPEC section 4, "Baseline decoders"): logits
    (N, V), tokens (N,) int64 drafted from them -> (N,) float32. rule "margin": the token's raw
    softmax probability minus that of the most probable other token not `banned`; "entropy": minus
    the entropy (nats) of the raw softmax. Raises ValueError for another rule."""
    probs = torch.softmax(logits.float(), dim=-1)
    if rule == "entropy":
        return (probs * probs.clamp_min(1e-30).log()).sum(dim=-1)
    if rule != "margin":
        raise ValueError(f"confidence rule {rule!r}: Dream's are margin and entropy")
    others = ban(probs.scatter(-1, tokens[:, None], -math.inf), banned)
    return probs.gather(-1, tokens[:, None])[:, 0] - others.max(dim=-1).values


def next_token_probs(logits, tokens):
    """Probability of each token given everything before it (causal next-token prediction).
    logits: (B, T, V) for the tokens (B, T) fed in one pass. Returns (B, T) float32 where column j
    is softmax(logits[:, j - 1])[tokens[:, j]]; column 0 has no prediction in this pass and is 0."""
    probs = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    predicted = torch.softmax(logits[:, :-1].float(), dim=-1)     # (B, T - 1, V)
    probs[:, 1:] = predicted.gather(-1, tokens[:, 1:, None])[..., 0]
    return probs


def leading_true(x):
    """Length of the run of True at the start of each row of x (B, T) bool; returns (B,) int64."""
    return x.long().cumprod(dim=1).sum(dim=1)


def first_eos(tokens, eos_ids):
    """Index of the first EOS (any id of the tuple eos_ids) in tokens (list of ids), or None."""
    return next((i for i, t in enumerate(tokens) if t in eos_ids), None)


def cut_after_eos(tokens, eos_ids):
    """tokens (list of ids) up to and including the first EOS (all of them if there is none)."""
    i = first_eos(tokens, eos_ids)
    return tokens if i is None else tokens[:i + 1]

# -----------------------------------------------------------------------------
# a decoder from --key=value settings, for the command line and the tools

# the decoder and its settings for each --method
DECODERS = {"refusion": (generate_refusion, RefusionSettings),
            "next_token": (generate_next_token, DecodeSettings), "mdm": (generate_mdm, MDMSettings)}
# the decoding method a model of each training objective is made for (--method's default)
METHOD_OF = {"refusion": "refusion", "ar": "next_token", "mdm": "mdm"}


def decoder_settings(cfg):
    """The settings object of cfg["method"] (a RefusionSettings, DecodeSettings or MDMSettings),
    which checks cfg's knobs. Raises ValueError for an unknown method or invalid settings."""
    if cfg["method"] not in DECODERS:  # the old name too
        raise ValueError(f"--method={cfg['method']!r}: choose one of {', '.join(DECODERS)}" +
                         " (--method=ar is now called next_token)" * (cfg["method"] == "ar"))
    Settings = DECODERS[cfg["method"]][1]
    knobs = {f.name: cfg[f.name] for f in fields(Settings) if f.name in cfg}  # mdm_shift: ckpt
    if cfg["method"] == "mdm":  # 0: one token per step, one semi-autoregressive block
        knobs.update(steps=cfg["steps"] or None, block_length=cfg["block_length"] or None)
    return Settings(**knobs)


def make_decoder(cfg, ids, generator):
    """(decode, its settings) for cfg["method"] and cfg's knobs: decode(model, prompt,
    generator=None, on_step=None) -> Generation. ids: {"eos_ids", "mask_id", "pad_id",
    optionally "undecodable_ids"}: the mask and pad ids and the ids the tokenizer cannot decode
    are never generated (unless one is an EOS). Raises ValueError for an unknown method, ReFusion
    or MDM without a mask token, or invalid settings."""
    settings = decoder_settings(cfg)
    if cfg["method"] != "next_token" and ids["mask_id"] is None:
        raise ValueError(f"--method={cfg['method']}: this model has no mask token (a plain "
                         "pretrained model, such as Qwen3 or SmolLM2, was never trained to fill "
                         "masks); use --method=next_token, or fine-tune it with train.py first")
    banned = tuple(i for i in (ids["mask_id"], ids["pad_id"], *ids.get("undecodable_ids", ()))
                   if i is not None and i not in ids["eos_ids"])
    kwargs = dict(eos_ids=ids["eos_ids"], banned_ids=banned) | (
        {} if cfg["method"] == "next_token" else {"mask_id": ids["mask_id"]})
    return partial(DECODERS[cfg["method"]][0], settings=settings, generator=generator,
                   **kwargs), settings

# -----------------------------------------------------------------------------
# the command line: python sampler.py [config/sample_*.py] [--key=value ...]
out_dir = "out"            # directory holding ckpt.pt (written by train.py) ...
init_from = ""             # ... or a Hugging Face model folder (Qwen3, SmolLM2), or a ckpt.pt
dtype = "auto"             # the weights: auto (bf16 where native and faster), float32, bfloat16
tokenizer = ""             # hf:FOLDER: a checkpoint's tokenizer folder, moved; empty: as recorded
chat = False               # wrap the prompt in the model's chat template (a user turn)
prompt = ""                # decode this text ...
prompt_file = ""           # ... or the text of this file (a pipe too; - for standard input) ...
num_samples = 3            # ... or this many prompts from the validation split
method = ""                # refusion, next_token or mdm; empty: the checkpoint's objective's
max_new_tokens = 128       # at most this many tokens are returned (refusion: whole serial blocks)
slot_size = 8              # refusion: tokens per slot (S)
serial_num_blocks = 1      # refusion: serial blocks, each of the same whole number of slots
slot_threshold = 0.9       # refusion: a slot is planned when its first draft's probability passes
token_threshold = 0.3      # refusion: a draft token is accepted when its probability exceeds this
infill = "paper"           # refusion: 'paper' (force masked drafts), 'speculative' (SPEC 4.1)
steps = 0                  # mdm: denoising steps; 0 = one token per step
block_length = 0           # mdm: semi-autoregressive block length; 0 = the whole generation
confidence = "prob"        # mdm: ranks a step's drafts: prob (LLaDA), margin or entropy (Dream)
temperature = 0.0          # 0: greedy; above 0: sample (Gumbel-max)
batch_size = 1             # prompts decoded together (SPEC 4.2); each sample is its own
compile = False            # the forward passes as compiled graphs (support/compiled.py)
compare_next_token = True  # refusion: also decode them by --method=next_token, in the summary
seed = 1337                # prompt i is sampled from a torch.Generator seeded with seed + i
device = "cpu"             # cpu, cuda, cuda:N or mps
json = False               # one JSON object per sample instead of text
show = False               # redraw the response after every decoding step (masked tokens as ░)
plot = ""                  # draw the first prompt's decode: a PNG, or a GIF a frame per step
# -----------------------------------------------------------------------------
DEFAULTS = settings_in(globals())


def main(argv):
    """Decode prompts with a checkpoint or a Hugging Face folder; print each response with its
    verdict (where the data set has a check) and speed, then a summary line that compares ReFusion
    with next-token decoding of the same prompts (compare_next_token)."""
    from support import sampling  # checks, models, prompts, the live trace, printing
    cfg = parse_args(DEFAULTS, argv)
    explicit = explicit_keys(cfg, DEFAULTS, argv)
    sampling.check_sample_config(cfg)
    if cfg["method"]:
        decoder_settings(cfg)  # bad decoder settings fail before the weights are read
    if cfg["plot"]:
        sampling.check_plot_path(cfg)
    model, enc, ids, objective, ckpt = sampling.load_model(cfg)
    cfg["method"] = cfg["method"] or METHOD_OF[objective]
    if cfg["method"] == "mdm":
        sampling.fit_mdm_layout(cfg, ckpt, "max_new_tokens" in explicit)
    decode, settings = make_decoder(cfg, ids, torch.Generator(cfg["device"]))  # the warm-up's
    check_attention(model, cfg["method"])
    sampling.note_mismatch(cfg["method"], objective, ckpt)
    # prompts with room for ReFusion's rounded generation whichever the method (the MDM: its
    # canvas), so that --method=next_token decodes the lines the summary compares with
    room = settings.gen_length if cfg["method"] == "mdm" else decoder_settings(
        dict(cfg, method="refusion")).gen_length
    prompts = sampling.load_prompts(cfg, enc, ckpt, room, model.config.block_size)
    model = sampling.warm_up(cfg, model, decode, prompts)  # one-time costs (compiling) apart
    next_token = None
    if sampling.compares_next_token(cfg, len(prompts), "compare_next_token" in explicit):
        sampling.note_mismatch("next_token", objective, ckpt)
        next_token, _ = make_decoder(dict(cfg, method="next_token"), ids,
                                     torch.Generator(cfg["device"]))
        sampling.warm_up(cfg, model, next_token, prompts)
    sampling.decode_prompts(cfg, model, enc, ids, ckpt, prompts, settings, decode, next_token)


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
