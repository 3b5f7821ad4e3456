"""
The decoders (SPEC section 4): ReFusion on one screen, the same with the KV cache as named steps,
the baselines, their settings, and the command line.

    generate_refusion_plain  the paper's algorithm in one function: no cache, no extension
    generate_refusion        the same with the KV cache, serial block after serial block
    plan_slots, verify_drafts, infill_slots, commit_slots    steps 1 to 4
    SpeculativeInfill        infill="speculative" (SPEC 4.1, beyond the paper)
    generate_next_token, generate_mdm    the baselines: next-token decoding, LLaDA-style MDM
    DEFAULTS, make_decoder, main         the command line

    python sampler.py config/sample_quotes.py            # the quick start's model, 10 prompts
    python sampler.py --init_from=smollm2 --chat --prompt="What is a hash table?"   # a real model
"""

import math
import sys
import time
from dataclasses import dataclass, field, fields
from functools import partial

import torch

from configurator import (Defaults, check_attention, check_confidence, check_context,
                          check_decode_settings, check_mdm_settings, check_refusion_settings,
                          explicit_keys, parse_args, run_cli)
from kvcache import cache_length

# -----------------------------------------------------------------------------
# ReFusion on one screen: the paper's decoding, plainly (SPEC section 4)


# Decoders run under inference mode: no autograd records (about 10% a token faster than no_grad).
@torch.inference_mode()
def generate_refusion_plain(model, prompt, settings, *, mask_id, eos_ids, generator=None):
    """ReFusion's decoding of one prompt (token ids) without a cache, unchecked: each pass feeds
    the committed buffer, then the new tokens. settings: RefusionSettings (the paper's infill,
    whatever its infill); only the mask id is banned. Returns a Generation. SPEC section 4."""
    t0 = time.perf_counter()
    P = len(prompt)
    S = settings.slot_size
    n = settings.slots_per_serial_block
    device = next(model.parameters()).device
    cols = torch.arange(S, device=device)                   # each token's place in its slot
    # The committed buffer in commit order: its tokens, their true positions, and for each token
    # the span [lo, hi) of the buffer it never saw (the slots infilled beside its own).
    buf = list(prompt)
    pos = list(range(P))
    unseen = [(0, 0)] * P
    trace = []
    nfe = 0
    eos = False

    def forward(tokens, at):
        """One pass: the buffer, then tokens (R, T) at true positions at (R, T) in every row.
        Returns the new tokens' logits (R, T, V)."""
        nonlocal nfe
        nfe += 1
        R, T = tokens.shape
        idx = torch.cat([torch.tensor([buf] * R, device=device), tokens], dim=1)
        where = torch.cat([torch.tensor([pos] * R, device=device), at], dim=1)
        mask = sees(unseen + [(0, 0)] * T, device)
        return model(idx, where, attn_mask=mask, logits_from=len(buf))

    def commit(starts, slots, infilled):
        """Step 4: append the slots (token lists) at true starts to the buffer; slots infilled
        side by side never saw each other. Returns the starts of the committed slots."""
        first = len(buf)
        for start, slot in zip(starts, slots):
            # an infilled slot never saw the slots infilled before it in this step
            span = (first, len(buf)) if infilled else (0, 0)
            for i, token in enumerate(slot):
                buf.append(token)
                pos.append(start + i)
                unseen.append(span)
        trace.append(list(zip(pos[first:], buf[first:])))
        return starts[:len(slots)]

    for b in range(settings.serial_num_blocks):
        # The pool: the true starts of the serial block's masked slots.
        pool = [P + (b * n + k) * S for k in range(n)]
        while pool:
            # 1. Plan: one pass drafts every masked slot; the slots whose first token passes
            # slot_threshold are selected (if none passes, the one whose first token is best).
            at = torch.tensor(pool, device=device)[:, None] + cols          # (slots, S)
            logits = forward(torch.full_like(at, mask_id).view(1, -1), at.view(1, -1))[0]
            drafts, probs = draft_tokens(logits, settings.temperature, generator, [mask_id])
            selected = select_slots(probs.view(-1, S)[:, 0], settings.slot_threshold)
            starts = [pool[k] for k in selected]
            drafts = drafts.view(-1, S)[selected]
            at = at[selected]

            # 2. Verify: one causal pass over the selected drafts, concatenated. A token passes
            # when it is a slot's first or its probability passes token_threshold.
            flat = drafts.view(1, -1)
            probs = next_token_probs(forward(flat, at.view(1, -1)), flat).view(-1, S)
            passed = (probs > settings.token_threshold) | (cols == 0)
            slots, ended = passing_slots(drafts, passed, eos_ids)

            if slots:
                # 4. Commit the passing prefix's whole slots, or its tokens up to its EOS.
                done = commit(starts, slots, infilled=False)
            else:
                # 3. Infill: each selected slot in a row of its own, from what verify accepted.
                accepted = leading_true(passed)                 # (rows,) accepted tokens
                lengths = torch.full_like(accepted, S)          # (rows,) each row's length
                while True:
                    # c. A row ends at its first accepted EOS (verify's prefix may hold one);
                    # the rows after it go.
                    found = first_eos_row(drafts, accepted, eos_ids)
                    if found:
                        r, length = found
                        drafts = drafts[:r + 1]
                        at = at[:r + 1]
                        lengths = lengths[:r + 1]
                        lengths[r] = length
                        accepted = torch.minimum(accepted[:r + 1], lengths)
                        ended = True
                    if (accepted >= lengths).all():
                        break
                    # a. Draft: one pass predicts every masked token of every row.
                    masked = cols >= accepted[:, None]
                    logits = forward(torch.where(masked, mask_id, drafts), at)
                    drafts = torch.where(masked, ban(logits, [mask_id]).argmax(dim=-1), drafts)
                    # b. Verify: one causal pass; each row keeps its longest passing prefix.
                    probs = next_token_probs(forward(drafts, at), drafts)
                    passed = (probs > settings.token_threshold) | (cols <= accepted[:, None])
                    accepted = torch.minimum(leading_true(passed), lengths)
                # 4. Commit every row up to its end; the rows never saw each other.
                slots = [row[:n] for row, n in zip(drafts.tolist(), lengths.tolist())]
                done = commit(starts, slots, infilled=True)

            # The committed slots leave the pool; after an EOS, so does every slot past it.
            eos = eos or ended
            pool = [p for p in pool if p not in done and not (ended and p > done[-1])]
        if eos:
            break

    # The response, read by true position, as the cached decoder reads it.
    tokens = [t for p, t in sorted(zip(pos, buf)) if p >= P]
    tokens = cut_after_eos(tokens, eos_ids)
    return Generation(tokens[:settings.max_new_tokens], nfe, time.perf_counter() - t0, trace)


def sees(unseen, device):
    """The plain decoder's attention mask, (N, N) bool over N tokens in buffer order, each with the
    span [lo, hi) of earlier tokens it never saw: causal, except slots infilled side by side, which
    never saw each other (SPEC section 4, step 3)."""
    j = torch.arange(len(unseen), device=device)
    lo, hi = torch.tensor(unseen, device=device).T
    causal = j[None, :] <= j[:, None]
    infilled_beside = (j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None])
    return causal & ~infilled_beside


def select_slots(scores, slot_threshold):
    """Step 1's choice: the indexes of the slots whose score (k,) float32 exceeds slot_threshold,
    ascending; if none does, the first of the best (torch.argmax takes the first). SPEC 4, step 1.
    """
    passing = (scores > slot_threshold).tolist()
    selected = [k for k, passes in enumerate(passing) if passes]
    if not selected:
        selected = [int(scores.argmax())]
    return selected


def passing_slots(drafts, passed, eos_ids):
    """Step 2's commit: the longest prefix of drafts (k, S) int64, read slot after slot, whose
    tokens all passed (passed: (k, S) bool), cut into whole slots, or after its first EOS.
    Returns (slots: a list of ids per committed slot, possibly none; whether an EOS ended them).
    SPEC 4, step 2."""
    S = drafts.shape[1]
    n_passed = int(leading_true(passed.view(1, -1)))
    prefix = drafts.view(-1)[:n_passed].tolist()
    stop = first_eos(prefix, eos_ids)
    # the whole slots the prefix covers, or its tokens up to and including its first EOS
    n = n_passed // S * S if stop is None else stop + 1
    return [prefix[i:min(i + S, n)] for i in range(0, n, S)], stop is not None


def first_eos_row(tokens, accepted, eos_ids):
    """Step 3c: (r, its length up to and including EOS) for the first row of tokens (k, S) int64
    whose accepted tokens (the first accepted[r], accepted: (k,) int64) hold an EOS, or None."""
    columns = torch.arange(tokens.shape[1], device=tokens.device)
    is_eos = torch.isin(tokens, torch.tensor(eos_ids, device=tokens.device))
    is_eos &= columns < accepted[:, None]
    holds_eos = is_eos.any(dim=1).tolist()
    if True not in holds_eos:
        return None
    r = holds_eos.index(True)
    return r, int(is_eos[r].long().argmax()) + 1

# -----------------------------------------------------------------------------
# ReFusion with the KV cache: plan, verify, infill, commit as named steps (SPEC section 4)
# The same decisions as generate_refusion_plain, pass for pass. A comment starting "KV cache:"
# marks what the cache changes: the committed buffer is fed once and its keys/values kept (the
# cache's row 0), so each pass feeds only its new tokens; a pass keeps the keys/values of what it
# commits and drops the rest; the infill's rows share the buffer's keys/values, repeated into rows.


@torch.inference_mode()
def generate_refusion(model, prompt, settings, *, mask_id, eos_ids, generator=None, on_step=None,
                      banned_ids=()):
    """ReFusion's decoding of one prompt (token ids) with the KV cache (SPEC section 4). settings:
    RefusionSettings; eos_ids: a tuple; generator: for temperature > 0; on_step: called with each
    step's (position, token) pairs; banned_ids: never drafted, besides mask_id. Returns a
    Generation. Raises ValueError for a bidirectional model, ContextTooLong past its context."""
    check_attention(model, "refusion")
    check_context(model, len(prompt), settings)
    t0 = time.perf_counter()
    state = DecodeState(model, prompt, settings, mask_id, eos_ids, generator, on_step, banned_ids)
    S = settings.slot_size
    n = settings.slots_per_serial_block
    # Serial blocks one after another, each decoded until none of its slots is masked.
    for b in range(settings.serial_num_blocks):
        # The pool: the true starts of the serial block's masked slots.
        pool = [len(prompt) + (b * n + k) * S for k in range(n)]
        if decode_serial_block(state, pool, settings):
            break                                       # EOS: no later serial block starts
    # The response, read by true position (the buffer holds it in commit order).
    tokens = cut_after_eos([state.response[p] for p in sorted(state.response)], eos_ids)
    return Generation(tokens[:settings.max_new_tokens], state.nfe, time.perf_counter() - t0,
                      state.trace, state.step_nfe, state.cache.cache_bytes)


def decode_serial_block(state, pool, settings):
    """Decode one serial block, the masked slots starting at pool (true starts, ascending), until
    none is masked (SPEC section 4, steps 1-4). Returns True when EOS ended it."""
    eos = False
    while pool:
        # 1. Plan: draft every masked slot, select the confident ones.
        starts, at, drafts = plan_slots(state, pool, settings.slot_threshold)
        # 2. Verify: the selected drafts in one causal pass; its whole passing slots commit.
        commit, accepted = verify_drafts(state, starts, at, drafts, settings.token_threshold)
        # 3. Infill: not one whole slot passed verify, so finish every selected slot in parallel.
        if not commit.starts:
            commit = infill_slots(state, starts, at, drafts, accepted, settings.token_threshold)
        # 4. Commit: the finished slots join the buffer.
        commit_slots(state, commit)
        eos = eos or commit.eos
        # The committed slots leave the pool; after an EOS, so does every slot past it.
        last = commit.starts[-1]
        pool = [p for p in pool if p not in commit.starts and not (commit.eos and p > last)]
    return eos


class DecodeState:
    """What a decode carries from step to step (SPEC section 4, "State"): the committed response
    (position -> token) and the cache, whose row 0 is the buffer; pending, the prompt until the
    first plan feeds it; nfe, trace, step_nfe; speculative (a SpeculativeInfill or None)."""

    def __init__(self, model, prompt, settings, mask_id, eos_ids, generator, on_step, banned_ids):
        self.model = model
        self.generator = generator
        self.on_step = on_step
        self.temperature = settings.temperature
        self.slot_size = settings.slot_size
        self.prompt_len = len(prompt)
        # KV cache: one row per slot an infill may hold, of a bucketed length (kvcache.py)
        max_len = cache_length(len(prompt) + settings.gen_length, model.config.block_size)
        self.cache = model.new_kv_cache(max_len, max_batch=settings.slots_per_serial_block)
        self.device = self.cache.kv.device
        self.mask_id = mask_id
        self.eos_ids = tuple(eos_ids)
        self.banned = torch.tensor([mask_id, *banned_ids], device=self.device)  # never written
        # KV cache: the prompt waits here until the first plan pass feeds it (and keeps its keys)
        self.pending = torch.tensor([prompt], device=self.device)          # (1, P) until fed
        # the committed response (true position -> token) and the decode's statistics
        self.response = {}
        self.nfe = 0
        self.trace = []
        self.step_nfe = []
        self.speculative = SpeculativeInfill.of(settings, len(prompt))  # SPEC 4.1, or None

    def forward(self, tokens, positions, keep=None, logits_from=0):
        """One counted pass of tokens (B, T) at true positions (B, T) after the cache -> logits
        (B, T - logits_from, V); the cache keeps the keys/values of the first `keep` tokens (None:
        all)."""
        start = self.cache.length
        self.nfe += 1
        logits = self.model(tokens, positions, kv_cache=self.cache, logits_from=logits_from)
        # KV cache: keep the keys/values of the first `keep` tokens, drop the rest
        if keep is not None:
            self.cache.crop(start + keep)
        return logits


def plan_slots(state, pool, slot_threshold):
    """Step 1, plan: one diffusion step over the masked slots starting at pool (true starts,
    ascending), after the pending prompt on the first call; the masks' keys/values are not kept.
    Returns the selected slots' (starts, ascending; true positions (k, S) int64; drafts (k, S))."""
    P = state.pending.shape[1]
    cols = torch.arange(state.slot_size, device=state.device)
    at = torch.tensor(pool, device=state.device)[:, None] + cols        # (len(pool), S)
    # Every token of the pool's slots is a mask at its true position.
    masks = torch.full_like(at, state.mask_id).view(1, -1)
    # KV cache: on the first call the prompt is fed before the masks (the buffer is fed once)
    tokens = torch.cat([state.pending, masks], dim=1)
    pos = torch.cat([torch.arange(P, device=state.device)[None], at.view(1, -1)], dim=1)
    lead = min(P, 1)  # the prompt's last token, whose logits predict the response's first
    # KV cache: the prompt's keys/values stay cached, the masks' are dropped; logits: lead + masks
    logits = state.forward(tokens, pos, keep=P, logits_from=P - lead)[0]
    state.pending = state.pending[:, :0]
    # Draft a token at every mask, with its probability.
    drafts, probs = draft_tokens(logits[lead:], state.temperature, state.generator, state.banned)
    drafts = drafts.view(at.shape)
    probs = probs.view(at.shape)
    if state.speculative:  # SPEC 4.1
        drafts, probs = state.speculative.plan(state, pool, logits, lead, drafts, probs)
    # Select the slots whose first token passes slot_threshold (the step's read).
    selected = select_slots(probs[:, 0], slot_threshold)
    starts = [pool[k] for k in selected]
    return starts, at[selected], drafts[selected]


def verify_drafts(state, starts, at, drafts, token_threshold):
    """Step 2, verify: one causal pass over the selected drafts (k, S) int64 at positions at (k, S),
    concatenated; the passing prefix's whole slots (or up to its EOS) commit, their keys/values
    kept. Returns (Commit, possibly empty; accepted (k,) int64, each slot's own passing prefix)."""
    k, S = drafts.shape
    buffer_length = state.cache.length
    # One causal pass over the selected drafts, concatenated.
    tokens = drafts.view(1, k * S)
    logits = state.forward(tokens, at.view(1, k * S))     # (1, k * S, V)
    # A token passes when its probability passes token_threshold, or it is a slot's first.
    passed = (next_token_probs(logits, tokens) > token_threshold).view(k, S)
    passed[:, 0] = True
    # The step's reads: commit the passing prefix's whole slots, or its tokens up to its EOS.
    slots, eos = passing_slots(drafts, passed, state.eos_ids)
    # KV cache: the committed tokens' keys/values, already after the buffer, stay
    state.cache.crop(buffer_length + sum(map(len, slots)))
    if state.speculative:  # SPEC 4.1
        state.speculative.verified(slots, logits, S)
    return Commit(starts[:len(slots)], slots, eos), leading_true(passed)


@dataclass
class Commit:
    """Finished slots, their keys/values already after the buffer in the cache's row 0 (SPEC step
    4): starts (ascending), tokens (a list per slot, cut after EOS), eos (the last ends at EOS)."""
    starts: list[int]
    tokens: list[list[int]]
    eos: bool = False


@dataclass
class InfillRows:
    """The slots of one infill (SPEC step 3), row i of each field and of the cache slot i: cache row
    i holds the buffer, then a prefix every row accepted; tokens[i, :accepted[i]] are final; slot i
    commits tokens[i, :lengths[i]]."""
    starts: list[int]          # true start position of each slot, ascending
    positions: torch.Tensor    # (k, S) int64 true position of every token
    tokens: torch.Tensor       # (k, S) int64
    accepted: torch.Tensor     # (k,) int64
    lengths: list[int]
    eos: bool = False          # a row ended at EOS (step 3c): every slot after it is dropped

    def capped(self, accepted):
        """accepted (k,) int64, each row's at most its length."""
        return torch.minimum(accepted, torch.tensor(self.lengths, device=accepted.device))

    def keep(self, n, cache):
        """Keep rows 0..n-1, here and in the cache."""
        cache.keep_rows(n)
        self.starts = self.starts[:n]
        self.positions = self.positions[:n]
        self.tokens = self.tokens[:n]
        self.accepted = self.accepted[:n]
        self.lengths = self.lengths[:n]


def infill_slots(state, starts, at, drafts, accepted, token_threshold):
    """Step 3, parallel infill: each selected slot (starts; at, drafts (k, S); accepted (k,) from
    verify) in its own cache row, finished in at most S rounds of draft_rows, verify_rows,
    end_rows_at_eos, kept_prefix. Returns the Commit of the slots kept, in the cache's row 0."""
    k, S = drafts.shape
    buffer_length = state.cache.length          # the committed buffer, shared by every row
    # Each selected slot in a row of its own, from what verify accepted of it.
    rows = InfillRows(list(starts), at, drafts.clone(), accepted, [S] * k)
    if state.speculative:  # SPEC 4.1
        rows.accepted = state.speculative.restart_later_rows(rows.accepted)
    # KV cache: every row starts from the buffer's keys/values (row 0's, repeated)
    state.cache.repeat_prefix(k)
    # A later slot's own accepted prefix may already hold EOS: the slots after it go now.
    end_rows_at_eos(state, rows)
    # Each round accepts at least one token of every unfinished row: at most S rounds.
    for _ in range(S):
        # KV cache: slot tokens [0, shared) of every row are cached and not fed again
        shared = state.cache.length - buffer_length
        draft_rows(state, rows, shared)
        verify_rows(state, rows, shared, token_threshold)
        end_rows_at_eos(state, rows)
        done, kept = kept_prefix(state, rows)
        state.cache.crop(buffer_length + kept)
        if done:
            break
    # The infill's read: its rows' tokens.
    tokens = rows.tokens.tolist()
    # KV cache: each row's slot laid after the buffer, in row 0, in slot order
    state.cache.commit_rows(list(enumerate(rows.lengths)), buffer_length)
    slots = [row[:n] for row, n in zip(tokens, rows.lengths)]
    return Commit(rows.starts, slots, rows.eos)


def draft_rows(state, rows, shared):
    """Step 3a, draft: feed every row's tokens from column `shared` on, its unaccepted ones as mask
    ids; each masked position's prediction (argmax) fills it. Its keys/values are not kept."""
    # KV cache: only the tokens after the shared prefix are fed
    window = rows.tokens[:, shared:]
    columns = torch.arange(shared, rows.tokens.shape[1], device=state.device)
    # A row's unaccepted tokens are fed as masks.
    masked = columns >= rows.accepted[:, None]
    fed = torch.where(masked, state.mask_id, window)
    # KV cache: none of this pass's keys/values are kept (keep=0)
    logits = state.forward(fed, rows.positions[:, shared:], keep=0)
    # Each mask's prediction (argmax) replaces its draft.
    guess = ban(logits, state.banned).argmax(dim=-1)                   # (k, T)
    rows.tokens[:, shared:] = torch.where(masked, guess, window)
    if state.speculative:  # SPEC 4.1
        rows.tokens = state.speculative.force_next_tokens(state, rows, logits, shared)


def verify_rows(state, rows, shared, token_threshold):
    """Step 3b, verify: feed every row's tokens from column `shared` on; in each row the first
    unaccepted token is accepted (it was predicted from an accepted prefix), later ones while
    their next-token probability exceeds token_threshold."""
    # KV cache: only the tokens after the shared prefix are fed; their keys/values stay for now
    window = rows.tokens[:, shared:]
    logits = state.forward(window, rows.positions[:, shared:])
    columns = torch.arange(shared, rows.tokens.shape[1], device=state.device)
    # A token passes when its probability passes token_threshold; the first unaccepted one
    # always does.
    probs = next_token_probs(logits, window)
    passed = (probs > token_threshold) | (columns <= rows.accepted[:, None])
    # Each row keeps its longest passing prefix.
    rows.accepted = rows.capped(shared + leading_true(passed))
    if state.speculative:  # SPEC 4.1
        state.speculative.rows_verified(logits)


def end_rows_at_eos(state, rows):
    """Step 3c: the first row whose accepted tokens hold EOS ends after it (first_eos_row, the
    round's read); the rows after it are dropped, from rows and from the cache; rows.eos is set."""
    found = first_eos_row(rows.tokens, rows.accepted, state.eos_ids)
    if found is None:
        return
    r, length = found
    # KV cache: the dropped rows leave the cache too
    rows.keep(r + 1, state.cache)
    rows.lengths[r] = length
    rows.accepted = rows.capped(rows.accepted)
    rows.eos = True


def kept_prefix(state, rows):
    """Step 3d: (every row is done, how many slot tokens every cache row keeps after the buffer):
    all of them once every row is done, else the prefix every row has accepted (its keys/values
    are never recomputed)."""
    # The round's second read: every row's accepted tokens.
    accepted = rows.accepted.tolist()
    if accepted == rows.lengths:
        return True, rows.tokens.shape[1]
    shared = min(accepted)
    if state.speculative:  # SPEC 4.1
        shared = state.speculative.kept_prefix(shared)
    return False, shared


def commit_slots(state, commit):
    """Step 4, commit: record the Commit's tokens at their true positions (its keys/values already
    follow the buffer in the cache); the step's pairs go to state.trace (and on_step)."""
    # The step's (true position, token) pairs, slot by slot.
    step = [(start + i, t) for start, ids in zip(commit.starts, commit.tokens)
            for i, t in enumerate(ids)]
    assert not any(p in state.response for p, _ in step), "a position was committed twice"
    state.response.update(step)
    # KV cache: its row 0 holds exactly the committed buffer, the prompt and every committed slot
    assert state.cache.length == state.prompt_len + len(state.response), "the cache is the buffer"
    state.trace.append(step)
    state.step_nfe.append(state.nfe - sum(state.step_nfe))
    if state.speculative:  # SPEC 4.1
        state.speculative.committed(state, commit)
    if state.on_step:
        state.on_step(step)

# -----------------------------------------------------------------------------
# beyond the paper: infill="speculative", the next-token pathway in charge (SPEC 4.1, opt-in)


class SpeculativeInfill:
    """infill="speculative" (SPEC section 4.1): each of the paper's steps calls one method.
    frontier: the first uncommitted response position; next_logits: (position, (V,) logits)
    predicting it from every position before it, or None; ends: the logits (V,) at the end of each
    slot the step commits that saw the slots committed before it."""

    def __init__(self, prompt_len):
        self.frontier = prompt_len
        self.next_logits = None
        self.ends = []

    @classmethod
    def of(cls, settings, prompt_len):
        """One for a decode with infill="speculative"; None with the paper's infill."""
        return cls(prompt_len) if settings.infill == "speculative" else None

    def plan(self, state, pool, logits, lead, drafts, probs):
        """Step 1: a leftmost slot at the frontier takes its first draft and score from the kept
        prediction (first logits[0]: the prompt's last). drafts, probs: (len(pool), S) as
        plan_slots drew them. Returns (drafts, probs), new tensors where they change."""
        if lead:  # kept past later passes: a copy (a compiled pass may reuse its output's memory)
            self.next_logits = (self.frontier, logits[0].clone())
        if self.next_logits is None or self.next_logits[0] != pool[0]:
            return drafts, probs
        first, score = draft_tokens(self.next_logits[1][None], state.temperature,
                                    state.generator, state.banned)
        # the first draft of the first slot: written into copies, the caller's tensors unchanged
        drafts = drafts.clone()
        probs = probs.clone()
        drafts[0, :1] = first
        probs[0, :1] = score
        return drafts, probs

    def verified(self, slots, logits, S):
        """Step 2: each slot verify commits (logits (1, k * S, V)) saw every slot before it."""
        self.ends = [logits[0, i * S + len(slot) - 1].clone() for i, slot in enumerate(slots)]

    def restart_later_rows(self, accepted):
        """Step 3: every row but the first restarts from its first token: verify judged the rest
        after the drafts of the slots before it, which its row does not see. accepted: (k,) int64
        each row's accepted prefix. Returns the new (k,) int64."""
        return torch.cat([accepted[:1], torch.ones_like(accepted[1:])])

    def force_next_tokens(self, state, rows, logits, shared):
        """Step 3a: the first unaccepted token of every unfinished row becomes what its accepted
        left neighbour, fed in this draft pass (logits (k, T, V) from column `shared`), predicts.
        Returns the rows' new tokens (k, S) int64; rows.tokens is unchanged."""
        k, S = rows.tokens.shape
        row = torch.arange(k, device=state.device)
        # each row's first unaccepted column (S - 1 for a finished row, which keeps its token)
        j = rows.accepted.clamp(max=S - 1)
        # the prediction of its left neighbour, fed in this pass at column j - 1
        predicted = ban(logits[row, (j - 1 - shared).clamp(min=0)], state.banned).argmax(dim=-1)
        unfinished = rows.accepted < torch.tensor(rows.lengths, device=state.device)
        tokens = rows.tokens.clone()
        tokens[row, j] = torch.where(unfinished, predicted, tokens[row, j])
        return tokens

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
        self.frontier = frontier
        self.next_logits = None
        for start, ids, logits in zip(commit.starts, commit.tokens, self.ends):
            if start + len(ids) == frontier:
                self.next_logits = (frontier, logits)

# -----------------------------------------------------------------------------
# beyond the paper: verify="exact", next-token decoding's own tokens, several a pass (SPEC 4.5)


@torch.inference_mode()
def generate_exact_plain(model, prompt, settings, *, mask_id, eos_ids, banned_ids=()):
    """verify="exact" without a cache, unchecked: generate_next_token's greedy tokens for one
    prompt (token ids), several a pass where the masked drafts are right. settings:
    RefusionSettings (slot_size masks a pass). Returns a Generation. SPEC section 4.5."""
    t0 = time.perf_counter()
    P = len(prompt)
    end = P + settings.max_new_tokens              # the first position never decoded
    device = next(model.parameters()).device
    never = [mask_id, *banned_ids]                 # never a draft
    seq = list(prompt)                             # the committed tokens, position by position
    drafts = []                                    # guesses at the positions after seq
    trace = []
    while len(seq) < end:
        # One pass: seq, the drafts, then masks for the slot after the drafts.
        start = len(seq) + len(drafts)
        idx = seq + drafts + [mask_id] * min(settings.slot_size, end - start)
        logits = model(torch.tensor([idx], device=device),
                       torch.arange(len(idx), device=device)[None], logits_from=len(seq) - 1)[0]
        # Verify: the next-token prediction after seq and after each draft, as
        # generate_next_token draws it. Drafts are accepted while they equal it; the prediction
        # after the last accepted one is committed too.
        predicted = draft_tokens(logits[:len(drafts) + 1], 0, None, banned_ids)[0].tolist()
        accepted = leading_equal(drafts, predicted)
        # (up to an EOS, and max_new_tokens)
        new = cut_after_eos(drafts[:accepted] + [predicted[accepted]], eos_ids)[:end - len(seq)]
        trace.append(list(zip(range(len(seq), len(seq) + len(new)), new)))
        seq += new
        if first_eos(new, eos_ids) is not None:
            break
        # Draft: the masks' tokens, if they saw accepted tokens only; the first mask's position
        # is the committed prediction's.
        masks = logits[len(drafts) + 2:]
        drafts = ban(masks, never).argmax(dim=-1).tolist() if accepted == len(drafts) else []
    return Generation(seq[P:], len(trace), time.perf_counter() - t0, trace, [1] * len(trace))


@torch.inference_mode()
def generate_exact(model, prompt, settings, *, mask_id, eos_ids, generator=None, on_step=None,
                   banned_ids=()):
    """verify="exact" with the KV cache: generate_exact_plain's tokens, passes and trace; the
    committed tokens keep their keys/values. generator: unused (greedy). Returns a Generation.
    Raises ValueError for a bidirectional model, ContextTooLong past its context. SPEC 4.5."""
    check_attention(model, "refusion")
    check_context(model, len(prompt), settings)
    t0 = time.perf_counter()
    end = len(prompt) + settings.max_new_tokens
    cache = model.new_kv_cache(cache_length(end, model.config.block_size))
    device = cache.kv.device
    banned = torch.tensor(banned_ids, dtype=torch.long, device=device)
    never = torch.tensor([mask_id, *banned_ids], dtype=torch.long, device=device)
    # What the next pass feeds after the cache: tokens known right (first the prompt, then the
    # last committed prediction), then the drafts after them.
    known = list(prompt)
    drafts = []
    response = []
    trace = []
    while True:
        n = cache.length + len(known)              # the first draft's position
        start = n + len(drafts)                    # the first mask's
        idx = known + drafts + [mask_id] * min(settings.slot_size, end - start)
        positions = torch.arange(cache.length, cache.length + len(idx), device=device)[None]
        logits = model(torch.tensor([idx], device=device), positions, kv_cache=cache,
                       logits_from=len(known) - 1)[0]
        # Verify and draft from one read: the next-token predictions, then the masks' tokens.
        predicted = draft_tokens(logits[:len(drafts) + 1], 0, None, banned)[0]
        masks = ban(logits[len(drafts) + 2:], never).argmax(dim=-1)
        read = torch.cat([predicted, masks]).tolist()
        accepted = leading_equal(drafts, read)
        new = cut_after_eos(drafts[:accepted] + [read[accepted]], eos_ids)
        new = new[:settings.max_new_tokens - len(response)]
        # Commit: the known tokens and accepted drafts keep their keys/values, nothing after.
        cache.crop(n + accepted)
        response += new
        trace.append(list(zip(range(n, n + len(new)), new)))
        if on_step:
            on_step(trace[-1])
        if len(response) >= settings.max_new_tokens or first_eos(new, eos_ids) is not None:
            break
        known = new[-1:]
        drafts = read[len(drafts) + 1:] if accepted == len(drafts) else []
    return Generation(response, len(trace), time.perf_counter() - t0, trace, [1] * len(trace),
                      cache.cache_bytes)


def leading_equal(drafts, predicted):
    """How many of drafts (list of ids) equal predicted (list, at least as long) from the first."""
    return next((i for i, (d, p) in enumerate(zip(drafts, predicted)) if d != p), len(drafts))

# -----------------------------------------------------------------------------
# baseline decoders (SPEC section 4, "Baseline decoders"): next-token decoding, LLaDA-style MDM


# Next-token decoding on a GPU reads its tokens every GPU_EOS_EVERY passes, as fast decoders do: a
# read waits for every queued pass (the passes run past an EOS count in NFE); a CPU waits for none.
GPU_EOS_EVERY = 16


@torch.inference_mode()
def generate_next_token(model, prompt, settings, *, eos_ids, generator=None, on_step=None,
                        banned_ids=()):
    """Next-token decoding with the KV cache, the ARM baseline (SPEC section 4): a prefill, then one
    pass a token, drawn as draft_tokens draws, until EOS or max_new_tokens; EOS is looked for every
    settings.eos_every tokens (every token with on_step). Returns a Generation, a step a token.
    Raises ValueError for a bidirectional model, ContextTooLong past its context."""
    check_attention(model, "next_token")
    check_context(model, len(prompt), settings)
    t0 = time.perf_counter()
    # KV cache: the prompt and every drawn token fed once, of a bucketed length (kvcache.py)
    max_len = cache_length(len(prompt) + settings.max_new_tokens, model.config.block_size)
    cache = model.new_kv_cache(max_len)
    device = cache.kv.device
    every = settings.eos_every or (1 if on_step or device.type == "cpu" else GPU_EOS_EVERY)
    banned = torch.tensor(banned_ids, dtype=torch.long, device=device)
    # The first pass is the prefill: the whole prompt.
    tokens = torch.tensor([prompt], device=device)                     # (1, P)
    positions = torch.arange(len(prompt), device=device)[None]
    # The drawn tokens stay on the device until a read; n counts them.
    out = torch.zeros(settings.max_new_tokens, dtype=torch.long, device=device)
    n = 0
    response = []                            # the tokens read from the device so far
    while n < settings.max_new_tokens:
        # One pass: the last position's logits predict the next token.
        logits = model(tokens, positions, kv_cache=cache, logits_from=-1)[0]  # (1, V)
        token, _ = draft_tokens(logits, settings.temperature, generator, banned)
        out[n] = token[0]
        n += 1
        if on_step:
            on_step([(len(prompt) + n - 1, int(token))])
        # every `every` tokens, and at the end, read the tokens drawn since the last read
        if n % every == 0 or n == settings.max_new_tokens:
            response += out[len(response):n].tolist()
            if first_eos(response, eos_ids) is not None:
                break
        # The next pass feeds the drawn token at the next position.
        tokens = token[None]                                           # (1, 1)
        positions = positions[:, -1:] + 1
    # One step per token; the passes run past the EOS count in the last step's.
    response = cut_after_eos(response, eos_ids)
    trace = [[(len(prompt) + i, t)] for i, t in enumerate(response)]
    step_nfe = [1] * len(response)
    step_nfe[-1] += n - len(response)
    return Generation(response, n, time.perf_counter() - t0, trace, step_nfe, cache.cache_bytes)


def tokens_per_step(n_masked, steps):
    """LLaDA's schedule: n_masked tokens spread over `steps` steps as evenly as possible, the
    remainder going to the first steps (10 over 4 steps: [3, 3, 2, 2]). Returns a list of ints."""
    return [n_masked // steps + (i < n_masked % steps) for i in range(steps)]


@torch.inference_mode()
def generate_mdm(model, prompt, settings, *, mask_id, eos_ids, generator=None, on_step=None,
                 banned_ids=()):
    """LLaDA-style masked diffusion with low-confidence remasking, the MDM baseline (SPEC 4): the
    prompt and max_new_tokens masks recomputed whole each step (NFE = steps); a step drafts the
    masked positions of the current semi-autoregressive block (from position p - 1's logits with
    settings.mdm_shift) and commits the k most confident (tokens_per_step; settings.confidence).
    Returns a Generation. Raises ValueError for a causal model, ContextTooLong past its context."""
    check_attention(model, "mdm")
    check_context(model, len(prompt), settings)
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    P = len(prompt)
    L = settings.max_new_tokens
    # The canvas: the prompt, then L masks, at their own positions.
    x = torch.tensor([prompt + [mask_id] * L], device=device)          # (1, P + L)
    positions = torch.arange(P + L, device=device)[None]
    masked = positions[0] >= P                                          # (P + L,) still masked
    banned = torch.tensor([mask_id, *banned_ids], device=device)
    trace = []
    # Semi-autoregressive blocks, left to right; each shares out its masks over its steps.
    for b in range(settings.n_semi_ar_blocks):
        in_block = (positions[0] - P) // settings.block_length == b
        steps = settings.steps // settings.n_semi_ar_blocks
        for k in tokens_per_step(settings.block_length, steps):
            # One pass over the whole canvas (bidirectional, no cache).
            logits = model(x, positions, logits_from=P - settings.mdm_shift)[0][:L]  # (L, V)
            # Draft every masked position of the block, with its confidence.
            where = (masked & in_block).nonzero()[:, 0]
            drafts, confidence = draft_tokens(logits[where - P], settings.temperature, generator,
                                              banned)
            if settings.confidence != "prob":  # Dream's rules (opt-in)
                confidence = dream_confidence(logits[where - P], drafts, settings.confidence,
                                              banned)
            # Commit the k most confident; the rest stay masked (low-confidence remasking).
            best = confidence.topk(k).indices
            x[0, where[best]] = drafts[best]
            masked[where[best]] = False
            # The step's read: the (position, token) pairs it committed.
            step = list(zip(where[best].tolist(), drafts[best].tolist()))
            trace.append(step)
            if on_step:
                on_step(step)
    tokens = cut_after_eos(x[0, P:].tolist(), eos_ids)
    return Generation(tokens, len(trace), time.perf_counter() - t0, trace, [1] * len(trace))

# -----------------------------------------------------------------------------
# the decoders' settings and their checks (SPEC section 4), each object checked once, when built


@dataclass
class DecodeSettings:
    """What every decoder takes (SPEC section 4): max_new_tokens, temperature (0: argmax, else
    Gumbel-max), and next-token decoding's eos_every (None: every token on a CPU, GPU_EOS_EVERY on
    a GPU). Raises ValueError naming the setting and the fix (check_decode_settings)."""
    max_new_tokens: int
    temperature: float = 0.0
    eos_every: int | None = None

    def __post_init__(self):
        check_decode_settings(self)

    @property
    def gen_length(self):
        """Positions the generation occupies in the context (tokens)."""
        return self.max_new_tokens


@dataclass
class RefusionSettings(DecodeSettings):
    """ReFusion's knobs (SPEC section 4): slot_size (S), serial_num_blocks, slot_threshold and
    token_threshold (compared with `>`; >= 1 means never), infill ("paper", or "speculative":
    SPEC 4.1), verify ("paper", or "exact": SPEC 4.5, which reads slot_size alone). Raises
    ValueError naming the setting and the fix (check_refusion_settings)."""
    slot_size: int = 8
    serial_num_blocks: int = 1
    slot_threshold: float = 0.9
    token_threshold: float = 0.3
    infill: str = "paper"
    verify: str = "paper"

    def __post_init__(self):
        check_refusion_settings(self)

    @property
    def n_slots(self):
        """Slots in the whole generation: a multiple of serial_num_blocks."""
        n = self.serial_num_blocks
        return math.ceil(self.max_new_tokens / (self.slot_size * n)) * n

    @property
    def slots_per_serial_block(self):
        """Slots in each serial block (the most infilled in parallel: the cache's rows)."""
        return self.n_slots // self.serial_num_blocks

    @property
    def gen_length(self):
        """max_new_tokens rounded up to whole serial blocks of whole slots (tokens); verify="exact"
        decodes max_new_tokens, as next-token decoding does."""
        return self.max_new_tokens if self.verify == "exact" else self.n_slots * self.slot_size


@dataclass
class MDMSettings(DecodeSettings):
    """LLaDA's schedule (SPEC section 4, "Baseline decoders"): `steps` denoising steps (None: one
    token a step) over semi-autoregressive blocks of `block_length` tokens (None: one block).
    Raises ValueError naming the setting and the fix (check_mdm_settings)."""
    steps: int | None = None
    block_length: int | None = None
    mdm_shift: bool = False  # Dream's shifted prediction (SPEC section 3): the model's, not a knob
    confidence: str = "prob"  # what a step ranks its drafts by: one of MDM_CONFIDENCES

    def __post_init__(self):
        # None: one token per step, one semi-autoregressive block
        n = self.max_new_tokens
        self.steps = n if self.steps is None else self.steps
        self.block_length = n if self.block_length is None else self.block_length
        check_mdm_settings(self)

    @property
    def n_semi_ar_blocks(self):
        """Semi-autoregressive blocks of block_length tokens, decoded left to right."""
        return self.max_new_tokens // self.block_length


# -----------------------------------------------------------------------------
# results


@dataclass
class Generation:
    """One decode's result (SPEC section 4, "Statistics"): tokens (cut after the first EOS), nfe,
    seconds, trace (per step its (position, token) pairs), step_nfe (per step its passes),
    cache_bytes (the most its KV cache held; 0 for the MDM)."""
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


# -----------------------------------------------------------------------------
# choosing tokens


def ban(scores, token_ids):
    """Set scores[..., id] = -inf for each banned id, in place, and return scores (..., V).
    token_ids: (n,) int64 on scores' device, or a list."""
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
    """Dream's confidence (SPEC section 4): logits (N, V), tokens (N,) int64 drafted from them ->
    (N,) float32: "margin", the token's raw probability minus the best other's (not banned);
    "entropy", minus the softmax's entropy. Raises ValueError for another rule."""
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
# the command line: python sampler.py [config/sample_*.py] [--key=value ...]
# One dict, not module globals, so that no setting's name (prompt, device, json, ...) stands for
# anything else in this file; --help prints each entry's comment.
DEFAULTS = Defaults({
    "out_dir": "out",          # directory holding ckpt.pt (written by train.py) ...
    "init_from": "",           # ... or a Hugging Face model folder (Qwen3, SmolLM2), or a ckpt.pt
    "dtype": "auto",           # the weights: auto (bf16 where native), float32, bfloat16
    "tokenizer": "",           # hf:FOLDER: a checkpoint's tokenizer folder, moved; empty: recorded
    "chat": False,             # wrap the prompt in the model's chat template (a user turn)
    "prompt": "",              # decode this text ...
    "prompt_file": "",         # ... or the text of this file (a pipe too; - for standard input) ...
    "num_samples": 3,          # ... or this many prompts from the validation split
    "method": "",              # refusion, next_token or mdm; empty: the checkpoint's objective's
    "max_new_tokens": 128,     # at most this many tokens returned (refusion: whole serial blocks)
    "slot_size": 8,            # refusion: tokens per slot (S)
    "serial_num_blocks": 1,    # refusion: serial blocks, each of the same whole number of slots
    "slot_threshold": 0.9,     # refusion: plan a slot whose first draft's probability passes
    "token_threshold": 0.3,    # refusion: accept a draft token whose probability exceeds this
    "infill": "paper",         # refusion: 'paper' (force masked drafts), 'speculative' (SPEC 4.1)
    "verify": "paper",         # refusion: 'paper' (thresholds), 'exact' (next-token's tokens, 4.5)
    "steps": 0,                # mdm: denoising steps; 0 = one token per step
    "block_length": 0,         # mdm: semi-autoregressive block length; 0 = the whole generation
    "confidence": "prob",      # mdm: ranks a step's drafts: prob (LLaDA), margin or entropy (Dream)
    "temperature": 0.0,        # 0: greedy; above 0: sample (Gumbel-max)
    "batch_size": 1,           # prompts decoded together (SPEC 4.2); each sample is its own
    "compile": False,          # the forward passes as compiled graphs (support/compiled.py)
    "compare_next_token": True, # refusion: also decode them by --method=next_token, in the summary
    "seed": 1337,              # prompt i is sampled from a torch.Generator seeded with seed + i
    "device": "cpu",           # cpu, cuda, cuda:N or mps
    "json": False,             # one JSON object per sample instead of text
    "show": False,             # redraw the response after every decoding step (masked tokens as ░)
    "plot": "",                # draw the first prompt's decode: a PNG, or a GIF a frame per step
}, __file__, command="sampler.py")

# the decoder and its settings for each --method
DECODERS = {"refusion": (generate_refusion, RefusionSettings),
            "next_token": (generate_next_token, DecodeSettings),
            "mdm": (generate_mdm, MDMSettings)}
# the decoding method a model of each training objective is made for (--method's default)
METHOD_OF = {"refusion": "refusion", "ar": "next_token", "mdm": "mdm"}


def decoder_settings(cfg):
    """The settings object of cfg["method"] (RefusionSettings, DecodeSettings or MDMSettings),
    which checks cfg's knobs. Raises ValueError for an unknown method, verify="exact" beside
    another method, or invalid settings."""
    if cfg["method"] not in DECODERS:
        renamed = " (--method=ar is now called next_token)" if cfg["method"] == "ar" else ""
        raise ValueError(f"--method={cfg['method']!r}: choose one of {', '.join(DECODERS)}"
                         f"{renamed}")
    if cfg.get("verify") == "exact" and cfg["method"] != "refusion":
        raise ValueError(f"--verify=exact is read by --method=refusion only, not --method="
                         f"{cfg['method']}; drop it, or decode with --method=refusion")
    Settings = DECODERS[cfg["method"]][1]
    knobs = {f.name: cfg[f.name] for f in fields(Settings) if f.name in cfg}  # mdm_shift: ckpt
    if cfg["method"] == "mdm":  # 0: one token per step, one semi-autoregressive block
        knobs["steps"] = cfg["steps"] or None
        knobs["block_length"] = cfg["block_length"] or None
    return Settings(**knobs)


def make_decoder(cfg, ids, generator):
    """(decode, settings) of cfg["method"]: decode(model, prompt, generator=None, on_step=None) ->
    Generation. ids: {"eos_ids", "mask_id", "pad_id", "undecodable_ids" (optional)}: all but the
    EOS ids are banned. Raises ValueError for an unknown method, a decoder that needs a mask id
    the model lacks, or invalid settings."""
    settings = decoder_settings(cfg)
    if cfg["method"] != "next_token" and ids["mask_id"] is None:
        raise ValueError(f"--method={cfg['method']}: this model has no mask token (a plain "
                         "pretrained model, such as Qwen3 or SmolLM2, was never trained to fill "
                         "masks); use --method=next_token, or fine-tune it with train.py first")
    never = (ids["mask_id"], ids["pad_id"], *ids.get("undecodable_ids", ()))
    banned = tuple(i for i in never if i is not None and i not in ids["eos_ids"])
    kwargs = {"eos_ids": ids["eos_ids"], "banned_ids": banned}
    if cfg["method"] != "next_token":
        kwargs["mask_id"] = ids["mask_id"]
    generate = DECODERS[cfg["method"]][0]
    if getattr(settings, "verify", "paper") == "exact":
        generate = generate_exact
    decode = partial(generate, settings=settings, generator=generator, **kwargs)
    return decode, settings


def main(argv):
    """python sampler.py: decode prompts with a checkpoint or a Hugging Face folder; print each
    response with its verdict (where the data set has a check) and speed, then a summary line that
    compares ReFusion with next-token decoding of the same prompts (compare_next_token)."""
    from support import sampling
    cfg = parse_args(DEFAULTS, argv)
    explicit = explicit_keys(cfg, DEFAULTS, argv)
    # settings that cannot work fail before the weights are read (the decoder's own when --method
    # names the decoder; else once the model's objective has chosen it)
    sampling.check_sample_config(cfg)
    check_confidence(cfg)
    if cfg["method"]:
        decoder_settings(cfg)
    if cfg["plot"]:
        sampling.check_plot_path(cfg)
    model, enc, ids, objective, ckpt = sampling.load_model(cfg)
    # no --method: the one the model was trained for
    cfg["method"] = cfg["method"] or METHOD_OF[objective]
    if cfg["method"] == "mdm":
        sampling.fit_mdm_layout(cfg, ckpt, "max_new_tokens" in explicit)
    decode, settings = make_decoder(cfg, ids, torch.Generator(cfg["device"]))
    check_attention(model, cfg["method"])
    sampling.note_mismatch(cfg["method"], objective, ckpt, cfg["verify"])
    # a prompt leaves room for ReFusion's generation whichever the method (so that next-token
    # decoding takes the lines the summary compares with), for the MDM's canvas for the MDM
    room = settings.gen_length
    if cfg["method"] != "mdm":
        room = decoder_settings(dict(cfg, method="refusion")).gen_length
    prompts = sampling.load_prompts(cfg, enc, ckpt, room, model.config.block_size)
    # one-time costs (compiling) are paid here, apart from the timed decodes
    model = sampling.warm_up(cfg, model, decode, prompts, settings)
    # the summary's comparison: the same prompts by next-token decoding
    next_token = None
    if sampling.compares_next_token(cfg, len(prompts), "compare_next_token" in explicit):
        sampling.note_mismatch("next_token", objective, ckpt)
        next_token, _ = make_decoder(dict(cfg, method="next_token", verify="paper"), ids,
                                     torch.Generator(cfg["device"]))
        sampling.warm_up(cfg, model, next_token, prompts, settings)
    sampling.decode_prompts(cfg, model, enc, ids, ckpt, prompts, settings, decode, next_token)


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
