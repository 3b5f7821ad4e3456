"""
ReFusion's plan-and-infill decoder (SPEC section 4), told top-down as its named steps, then the
baselines it is measured against, then the command line.

    generate_refusion      the response as serial blocks, one after another, cut after EOS
    decode_serial_block    one serial block: plan, verify, infill (if verify commits none), commit
    plan_slots     step 1  one diffusion step over the masked slots: draft, pick the confident ones
    verify_drafts  step 2  one causal pass over the picked drafts: their longest confident prefix
    infill_slots   step 3  finish the picked slots in parallel, left to right, one cache row each
    commit_slots   step 4  record the finished slots, whose keys/values now follow the buffer
    DecodeState            what the steps share: the committed buffer, the KV cache, the NFE

Every committed token's keys/values are computed once and reused by every later forward pass: the
cache holds the committed slots in commit order, the model sees their true positions through RoPE.
What goes beyond the paper (infill="ar", SPEC section 4.1) is a few small functions after these,
each called from one place. Then the baselines, reporting the same Generation statistics:
generate_ar (next-token decoding with the KV cache) and generate_mdm (LLaDA-style, the whole
sequence recomputed each step); the settings objects (each checked once, when built); the helpers
that choose tokens; and the command line:

    python sampler.py --num_samples=3                    # prompts from the validation split
    python sampler.py --prompt_file=my_prompt.txt --json
    python sampler.py --show --num_samples=1             # watch the slots fill in, step by step
    python sampler.py --plot=decode.png --num_samples=1  # draw which step committed each token
    python sampler.py --init_from=smollm2 --chat --prompt="What is a hash table?"   # a real model

Its plumbing (loading models and prompts, the live trace, printing) is support/sampling.py.
"""

import math
import queue
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from functools import partial

import torch
import torch.nn.functional as F

from configurator import check_device, check_seed, explicit_keys, parse_args, run_cli, settings_in
from kvcache import BatchedCache

# -----------------------------------------------------------------------------
# ReFusion: plan, verify, infill, commit (SPEC section 4)


# The decoders run under inference mode: no autograd records at all, which makes the many small
# forward passes of decoding cheaper than under no_grad (about 10% per token on a small model).
@torch.inference_mode()
def generate_refusion(model, prompt, settings, *, mask_id, eos_ids, generator=None, on_step=None,
                      banned_ids=()):
    """ReFusion's plan-and-infill decoding of one prompt (SPEC section 4; paper section 3.2).

    model:    a causal Transformer (or any module with its forward and new_kv_cache), in eval mode.
    prompt:   list of token ids (at least one).
    settings: RefusionSettings (slot size, serial blocks, thresholds, temperature, infill, length).
    mask_id:  the id fed at still-masked positions; eos_ids: tuple of the EOS ids (any ends it).
    generator: torch.Generator on the model's device, for temperature > 0 (plan drafts only).
    on_step:  optional callable, given the (position, token) pairs each step commits (--show).
    banned_ids: ids never generated besides the mask id (the command line adds the pad id).
    Returns a Generation of at most settings.max_new_tokens tokens.
    Raises ValueError for a bidirectional model, ContextTooLong for a prompt + generation longer
    than the context.
    """
    check_attention(model, "refusion")
    check_context(model, len(prompt), settings)
    t0 = time.perf_counter()
    state = DecodeState(model, prompt, settings, mask_id, eos_ids, generator, on_step, banned_ids)
    S, n = settings.slot_size, settings.slots_per_serial_block
    for b in range(settings.serial_num_blocks):
        first = len(prompt) + b * n * S                 # the serial block's first position
        if decode_serial_block(state, [first + i * S for i in range(n)], settings):
            break                                       # EOS: no later serial block starts
    tokens = cut_after_eos([state.response[p] for p in sorted(state.response)], eos_ids)
    return Generation(tokens[:settings.max_new_tokens], state.nfe, time.perf_counter() - t0,
                      state.trace, state.step_nfe, state.cache.peak_bytes)


def decode_serial_block(state, pool, settings):
    """Decode one serial block until none of its slots is masked (SPEC section 4, steps 1-4).

    state: the DecodeState; pool: ascending start positions of the serial block's slots.
    Returns True when EOS ended it (the slots before the EOS slot are still decoded; no later
    serial block starts).
    """
    eos = False
    while pool:
        starts, drafts = plan_slots(state, pool, settings.slot_size, settings.slot_threshold)
        commit, accepted = verify_drafts(state, starts, drafts, settings.token_threshold)
        if not commit:  # not one whole slot passed verify: finish every selected slot in parallel
            commit = infill_slots(state, starts, drafts, accepted, settings.token_threshold)
        commit_slots(state, commit)
        eos = eos or commit.eos
        pool = [p for p in pool
                if p not in commit.starts and not (commit.eos and p > commit.starts[-1])]
    return eos


def plan_slots(state, pool, slot_size, slot_threshold):
    """Step 1, plan: one diffusion step over every still-masked slot of the serial block (SPEC
    section 4, step 1). The pending prompt, on the first call, is fed before the masks.

    pool: ascending start positions of the masked slots. The masks' keys/values are not kept.
    Returns (starts: ascending start positions of the selected slots,
             drafts: (len(starts), slot_size) int64).
    """
    n_pending = len(state.pending)
    masks = [state.mask_id] * (slot_size * len(pool))
    positions = [p + i for p in pool for i in range(slot_size)]
    tokens = torch.tensor([state.pending + masks], device=state.device)
    pos = torch.tensor([state.pending_pos + positions], device=state.device)
    logits = state.forward(tokens, pos, keep=n_pending)[0]   # (n_pending + n_slots * S, V)
    state.pending, state.pending_pos = [], []                # the prompt's KV stays cached
    drafts, probs = draft_tokens(logits[n_pending:], state.temperature, state.generator,
                                 state.banned)
    drafts, probs = drafts.view(len(pool), slot_size), probs.view(len(pool), slot_size)
    if state.infill == "ar":
        take_frontier_prediction(state, pool, logits, n_pending, drafts, probs)
    scores = probs[:, 0]  # a slot's score: its first token's probability
    # the first of equal best scores (torch.argmax) when none passes the threshold (SPEC step 1)
    selected = (scores > slot_threshold).nonzero()[:, 0].tolist() or [int(scores.argmax())]
    return [pool[i] for i in selected], drafts[selected]


def verify_drafts(state, starts, drafts, token_threshold):
    """Step 2, global verify: one causal pass over the selected drafts, concatenated in slot order
    (SPEC section 4, step 2).

    starts: true start positions of the selected slots; drafts: (k, S) int64.
    The longest prefix of the concatenation whose tokens pass decides: a Commit of the slots up to
    the first EOS (eos=True), or of the whole slots it covers (their keys/values from this pass
    stay in the cache), or an empty Commit, and infill_slots finishes every selected slot.
    Returns (commit, accepted: (k,) int64 each slot's own accepted prefix, for infill_slots).
    """
    k, S = drafts.shape
    ctx = state.cache.pos
    tokens = drafts.reshape(1, k * S)
    pos = torch.tensor([[p + i for p in starts for i in range(S)]], device=state.device)
    logits = state.forward(tokens, pos)                      # (1, k * S, V)
    probs = next_token_probs(logits, tokens)                 # (1, k * S)
    passed = (probs > token_threshold).view(k, S)
    passed[:, 0] = True                                      # a slot's first token: as drafted
    prefix = drafts.view(-1)[:int(leading_true(passed.view(1, -1))[0])].tolist()
    eos_at = first_eos(prefix, state.eos_ids)
    eos = eos_at is not None
    n = eos_at + 1 if eos else len(prefix) // S * S         # tokens to commit
    state.cache.crop(ctx + n)  # the committed tokens' keys/values, already after the buffer, stay
    slots = [prefix[i:min(i + S, n)] for i in range(0, n, S)]
    commit = Commit(starts[:len(slots)], slots, eos)
    if state.infill == "ar":  # SPEC 4.1: each slot saw every slot before it in the concatenation
        commit.next_logits = [logits[0, i * S + len(slot) - 1] for i, slot in enumerate(slots)]
    return commit, leading_true(passed)


@dataclass
class Commit:
    """Finished slots, as verify_drafts or infill_slots hand them to commit_slots (SPEC step 4).
    Their keys/values already follow the committed buffer in the cache's row 0, in slot order.

    starts:  true start positions of the slots, ascending.
    tokens:  one list of ids per slot, cut after EOS.
    eos:     True when the last slot ends with EOS: every later slot of the serial block is
             dropped and no later serial block starts.
    next_logits: infill="ar" only (SPEC section 4.1): per slot, the logits (V,) its last token
             predicts for the next position, or None for a slot that did not see every slot
             committed with it before it (infill rows after the first); empty otherwise.
    """
    starts: list[int]
    tokens: list[list[int]]
    eos: bool = False
    next_logits: list = field(default_factory=list)

    def __len__(self):
        return len(self.starts)


@dataclass
class InfillRows:
    """The slots of one parallel infill (SPEC step 3): row i of every field, and of the cache, is
    slot i. What infill_slots keeps true between its forward passes:
      - cache row i holds the committed buffer, then tokens[i, :shared], where `shared` (the
        cache's length beyond the buffer) is a prefix every row has accepted;
      - tokens[i, :accepted[i]] are accepted and never change again; the rest are drafts;
      - slot i commits tokens[i, :lengths[i]]: lengths[i] is S, or ends at the slot's EOS;
        accepted <= lengths.
    """
    starts: list[int]          # true start position of each slot, ascending
    positions: torch.Tensor    # (k, S) int64 true position of every token
    tokens: torch.Tensor       # (k, S) int64
    accepted: torch.Tensor     # (k,) int64
    lengths: torch.Tensor      # (k,) int64
    eos: bool = False          # a row ended at EOS (step 3c): every slot after it is dropped

    def done(self):
        """True when every row has accepted all the tokens it commits."""
        return bool((self.accepted >= self.lengths).all())

    def keep(self, n, cache):
        """Keep rows 0..n-1, here and in the cache."""
        if n < cache.batch:
            cache.keep_rows(list(range(n)))
        self.starts, self.positions = self.starts[:n], self.positions[:n]
        self.tokens = self.tokens[:n]
        self.accepted, self.lengths = self.accepted[:n], self.lengths[:n]


def infill_slots(state, starts, drafts, accepted, token_threshold):
    """Step 3, parallel autoregressive infill: finish each selected slot in its own cache row,
    sharing the committed buffer (SPEC section 4, step 3; verify kept none of its pass).

    starts: k true start positions; drafts: (k, S) int64 from the plan step; accepted: (k,) int64
    each slot's accepted prefix as verify judged it (at least 1). At most S rounds of (a) draft
    (draft_rows), (b) verify (verify_rows), (c) EOS (end_rows_at_eos), (d) keep the prefix every
    row accepted (kept_prefix). Returns a Commit of the k' <= k finished slots, laid after the
    buffer in the cache's row 0 in slot order (KVCache.commit_rows), as commit_slots expects.
    """
    k, S = drafts.shape
    ctx = state.cache.pos                          # the committed buffer, shared by every row
    columns = torch.arange(S, device=state.device)
    positions = torch.tensor(starts, device=state.device)[:, None] + columns
    rows = InfillRows(list(starts), positions, drafts.clone(), accepted.clone(),
                      torch.full_like(accepted, S))
    if state.infill == "ar":
        restart_later_rows(rows)
    state.cache.repeat_prefix(k)
    # Verify committed only what the whole concatenation accepted, but a later slot's own accepted
    # prefix may already hold EOS: that slot ends there and the slots after it go before any pass.
    end_rows_at_eos(state, rows)
    last = None
    for _ in range(S):                   # each round accepts >= 1 token of every unfinished row
        if rows.done():
            break
        shared = state.cache.pos - ctx             # slot tokens [0, shared) of every row are cached
        draft_rows(state, rows, shared)                             # (a)
        last = verify_rows(state, rows, shared, token_threshold)    # (b)
        end_rows_at_eos(state, rows)                                # (c)
        state.cache.crop(ctx + kept_prefix(state, rows))            # (d)
    lengths = rows.lengths.tolist()
    state.cache.commit_rows(list(enumerate(lengths)), ctx)  # row i's slot after the buffer, row 0
    tokens = [row[:n] for row, n in zip(rows.tokens.tolist(), lengths)]
    commit = Commit(rows.starts, tokens, rows.eos)
    if state.infill == "ar":  # SPEC 4.1: only row 0 saw every slot committed with it before it
        commit.next_logits = [last] + [None] * (len(commit) - 1)
    return commit


def draft_rows(state, rows, shared):
    """Step 3a, draft: feed every row's tokens from column `shared` on, its unaccepted ones as mask
    ids; each masked position's prediction (argmax) fills it. The pass's keys/values are not
    kept."""
    window = rows.tokens[:, shared:].clone()
    columns = torch.arange(shared, shared + window.shape[1], device=state.device)
    masked = columns >= rows.accepted[:, None]
    window[masked] = state.mask_id
    logits = state.forward(window, rows.positions[:, shared:], keep=0)
    rows.tokens[:, shared:][masked] = ban(logits[masked], state.banned).argmax(dim=-1)
    if state.infill == "ar":
        force_next_token_drafts(state, rows, logits, shared)


def verify_rows(state, rows, shared, token_threshold):
    """Step 3b, verify: feed every row's drafted tokens from column `shared` on; in each row the
    first unaccepted token is accepted (it was predicted from an accepted prefix), later ones while
    their next-token probability exceeds token_threshold. Returns the logits (V,) that row 0's last
    token predicts (infill="ar" keeps them for the next position)."""
    window = rows.tokens[:, shared:]
    logits = state.forward(window, rows.positions[:, shared:])
    probs = next_token_probs(logits, window)
    columns = torch.arange(shared, shared + window.shape[1], device=state.device)
    passed = (probs > token_threshold) | (columns <= rows.accepted[:, None])
    rows.accepted = torch.minimum(shared + leading_true(passed), rows.lengths)
    return logits[0, -1]


def end_rows_at_eos(state, rows):
    """Step 3c: the first row whose accepted tokens hold EOS ends after it; the rows after it are
    dropped, from rows (an InfillRows) and from the cache, and rows.eos is set."""
    S = rows.tokens.shape[1]
    is_eos = torch.isin(rows.tokens, state.eos_tensor)
    is_eos &= torch.arange(S, device=state.device) < rows.accepted[:, None]   # accepted EOS only
    found = is_eos.any(dim=1).nonzero()[:, 0]
    if len(found) == 0:
        return
    r = int(found[0])
    rows.keep(r + 1, state.cache)
    rows.lengths = rows.lengths.clone()
    rows.lengths[r] = int(is_eos[r].long().argmax()) + 1
    rows.accepted = torch.minimum(rows.accepted, rows.lengths)
    rows.eos = True


def kept_prefix(state, rows):
    """Step 3d: how many slot tokens every cache row keeps after the buffer: all of them once every
    row is done, else the prefix every row has accepted (its keys/values are never recomputed)."""
    if rows.done():
        return rows.tokens.shape[1]
    if state.infill == "ar":  # SPEC 4.1: its last token is fed again; it predicts the next
        return int(rows.accepted.min()) - 1
    return int(rows.accepted.min())


def commit_slots(state, commit):
    """Step 4, commit: record the finished slots' tokens at their true positions, and the step
    (SPEC section 4, step 4).

    commit: a Commit from verify_drafts or infill_slots, whose keys/values already follow the
    buffer in the cache, so that afterwards the cache again holds exactly the committed buffer.
    The step's (position, token) pairs go to state.trace (and on_step), its forward passes to
    state.step_nfe.
    """
    step = [(start + i, t) for start, ids in zip(commit.starts, commit.tokens)
            for i, t in enumerate(ids)]
    assert not any(p in state.response for p, _ in step), "a position was committed twice"
    state.response.update(step)
    assert state.cache.pos == state.prompt_len + len(state.response), "the cache holds the buffer"
    state.trace.append(step)
    state.step_nfe.append(state.nfe - sum(state.step_nfe))
    if state.infill == "ar":
        advance_frontier(state, commit)
    if state.on_step:
        state.on_step(step)


class DecodeState:
    """What the decoder carries from step to step (SPEC section 4, "State").

    The committed buffer is the prompt, then the committed slots in commit order; `response` maps
    each committed response token's true position to it. Between steps the cache's row 0 holds
    the keys/values of the buffer's tokens fed so far, in buffer order, so `cache.pos` is the
    committed length (there is no other count of it). `pending` holds the prompt until the first
    plan call feeds it before the masks (one forward, as in the authors' code).
    nfe counts forward passes; per committed step, trace holds its (position, token) pairs and
    step_nfe its forward passes.
    infill: the setting ("paper" or "ar"). With "ar" (SPEC section 4.1), `frontier` is the first
    uncommitted response position and `next_logits` (position, logits (V,)) the next-token
    prediction for it made seeing every position before it, or None.
    """

    def __init__(self, model, prompt, settings, mask_id, eos_ids, generator, on_step, banned_ids):
        self.model, self.generator, self.on_step = model, generator, on_step
        self.cache = model.new_kv_cache(max_len=len(prompt) + settings.gen_length,
                                        max_batch=settings.slots_per_serial_block)
        self.device = self.cache.kv.device
        self.mask_id, self.eos_ids = mask_id, tuple(eos_ids)
        self.eos_tensor = torch.tensor(self.eos_ids, device=self.device)  # for end_rows_at_eos
        self.banned = [mask_id, *banned_ids]  # never written into the response
        self.temperature, self.infill = settings.temperature, settings.infill
        self.prompt_len = len(prompt)
        self.pending, self.pending_pos = list(prompt), list(range(len(prompt)))
        self.response, self.nfe, self.trace, self.step_nfe = {}, 0, [], []
        self.frontier, self.next_logits = len(prompt), None

    def forward(self, tokens, positions, keep=None):
        """One counted forward pass of tokens (B, T) at true positions (B, T) after the cache;
        returns logits (B, T, V). The cache keeps the keys/values of the first `keep` tokens fed
        (None: all)."""
        start = self.cache.pos
        self.nfe += 1
        logits = self.model(tokens, positions, kv_cache=self.cache)
        if keep is not None:
            self.cache.crop(start + keep)
        return logits

# -----------------------------------------------------------------------------
# beyond the paper: infill="ar", the next-token pathway in charge (SPEC section 4.1, opt-in)


def take_frontier_prediction(state, pool, logits, n_pending, drafts, probs):
    """Step 1: the leftmost slot, when it starts at the frontier, takes its first token and its
    score from the kept next-token prediction instead of its first mask. In the first plan call
    the prompt's last token (logits[n_pending - 1]) makes that prediction.
    drafts, probs: (len(pool), S), changed in place."""
    if n_pending:
        state.next_logits = (state.prompt_len, logits[n_pending - 1])
    if state.next_logits is not None and state.next_logits[0] == pool[0]:
        drafts[0, :1], probs[0, :1] = draft_tokens(state.next_logits[1][None], state.temperature,
                                                   state.generator, state.banned)


def restart_later_rows(rows):
    """Step 3: every infill row but the first starts from its first token alone; verify judged the
    others' tokens after the drafts of the slots before them, which their rows do not see."""
    rows.accepted[1:] = 1


def force_next_token_drafts(state, rows, logits, shared):
    """Step 3a: the first unaccepted token of every unfinished row becomes what its accepted left
    neighbour, fed in this same draft pass (logits (k, T, V) from column `shared`), predicts."""
    r = (rows.accepted < rows.lengths).nonzero()[:, 0]
    j = rows.accepted[r]
    rows.tokens[r, j] = ban(logits[r, j - 1 - shared], state.banned).argmax(dim=-1)


def advance_frontier(state, commit):
    """Step 4: move state.frontier past the committed positions and keep the next-token prediction
    for it when the slot just committed before it saw every position to its left."""
    frontier = state.frontier
    while frontier in state.response:
        frontier += 1
    if frontier == state.frontier:
        return
    state.frontier, state.next_logits = frontier, None
    for start, ids, logits in zip(commit.starts, commit.tokens, commit.next_logits):
        if start + len(ids) == frontier and logits is not None:
            state.next_logits = (frontier, logits)


# -----------------------------------------------------------------------------
# baseline decoders (SPEC section 4, "Baseline decoders"): next-token (ar) and LLaDA-style (mdm)


@torch.inference_mode()
def generate_ar(model, prompt, settings, *, eos_ids, generator=None, on_step=None, banned_ids=()):
    """Plain next-token decoding with the KV cache: the ARM baseline.

    settings: DecodeSettings (max_new_tokens, temperature). One prefill forward of the prompt
    predicts the first token, then one forward per further token, each feeding only the newest
    token after the cache; so NFE = number of generated tokens (TPF 1). temperature 0: argmax;
    otherwise Gumbel-max in float64 from `generator` (draft_tokens). banned_ids are never generated
    (the command line passes the mask and pad ids). Stops after EOS or max_new_tokens. Returns a
    Generation; its trace holds one (position, token) pair per forward (also given to on_step, if
    set, as it happens).
    Raises ValueError for a bidirectional model or a prompt + generation longer than the context.
    """
    check_attention(model, "ar")
    check_context(model, len(prompt), settings)
    t0 = time.perf_counter()
    cache = model.new_kv_cache(max_len=len(prompt) + settings.max_new_tokens)
    device = cache.kv.device
    tokens = torch.tensor([prompt], device=device)                     # (1, P), the prefill
    positions = torch.arange(len(prompt), device=device)[None]
    out, trace = [], []
    while True:
        logits = model(tokens, positions, kv_cache=cache)[0, -1:]      # (1, V): the next token's
        token, _ = draft_tokens(logits, settings.temperature, generator, banned_ids)
        out.append(int(token))
        trace.append([(len(prompt) + len(out) - 1, out[-1])])
        if on_step:
            on_step(trace[-1])
        if out[-1] in eos_ids or len(out) == settings.max_new_tokens:
            break
        tokens, positions = token[None], positions[:, -1:] + 1         # (1, 1) each
    return Generation(out, len(out), time.perf_counter() - t0, trace, [1] * len(out),
                      cache.peak_bytes)


def tokens_per_step(n_masked, steps):
    """LLaDA's schedule: n_masked tokens spread over `steps` steps as evenly as possible, the
    remainder going to the first steps (10 over 4 steps: [3, 3, 2, 2]). Returns a list of ints."""
    return [n_masked // steps + (i < n_masked % steps) for i in range(steps)]


@torch.inference_mode()
def generate_mdm(model, prompt, settings, *, mask_id, eos_ids, generator=None, on_step=None,
                 banned_ids=()):
    """LLaDA-style masked-diffusion decoding with low-confidence remasking: the MDM baseline.

    settings: MDMSettings (max_new_tokens, steps, block_length, temperature). The sequence starts
    as prompt + max_new_tokens mask ids and is recomputed whole at every step (bidirectional
    attention, so no cache; NFE = steps). Each step predicts every masked position of the current
    semi-autoregressive block (argmax, or Gumbel-max in float64 with temperature; neither the mask
    id nor banned_ids are ever predicted: see ban) and commits the k most confident ones
    (confidence: the softmax probability of the predicted token), k following tokens_per_step.
    Semi-autoregressive blocks of block_length tokens go left to right, steps / n_semi_ar_blocks
    steps each. Committed tokens never change. The result is cut after the first EOS. Returns a
    Generation; its trace holds the (position, token) pairs committed at each step (also given to
    on_step, if set, as it happens).
    Raises ValueError for a causal model or a prompt + generation longer than the context.
    """
    check_attention(model, "mdm")
    check_context(model, len(prompt), settings)
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    P, L = len(prompt), settings.max_new_tokens
    x = torch.tensor([prompt + [mask_id] * L], device=device)          # (1, P + L)
    positions = torch.arange(P + L, device=device)[None]
    masked = torch.zeros(P + L, dtype=torch.bool, device=device)
    masked[P:] = True
    trace, nfe = [], 0
    for b in range(settings.n_semi_ar_blocks):
        in_block = torch.zeros_like(masked)
        in_block[P + b * settings.block_length:P + (b + 1) * settings.block_length] = True
        steps = settings.steps // settings.n_semi_ar_blocks
        for k in tokens_per_step(settings.block_length, steps):
            logits = model(x, positions)[0]                                 # (P + L, V)
            nfe += 1
            where = (masked & in_block).nonzero()[:, 0]              # the block's masked positions
            drafts, confidence = draft_tokens(logits[where], settings.temperature, generator,
                                              [mask_id, *banned_ids])
            best = confidence.topk(k).indices
            x[0, where[best]] = drafts[best]
            masked[where[best]] = False
            trace.append(list(zip(where[best].tolist(), drafts[best].tolist())))
            if on_step:
                on_step(trace[-1])
    tokens = cut_after_eos(x[0, P:].tolist(), eos_ids)
    return Generation(tokens, nfe, time.perf_counter() - t0, trace, [1] * nfe)

# -----------------------------------------------------------------------------
# many prompts at once: the decoders above, batched (beyond the paper, opt-in: --batch_size)


def generate_batch(decode, prompts, batch_size, generators=None, forwards=None):
    """Decode prompts batch_size at a time with the one-prompt decoder `decode`, every forward
    pass of a batch's prompts run as one.

    Each prompt of a batch runs `decode` unchanged, in its own thread, on a BatchedModel that
    hands its forward passes to the batch. When every prompt still decoding has asked for one (a
    plan, a verify, an infill round, a next token, a denoising step), forward_batch runs them as
    one padded pass and each prompt goes on with its own logits; a prompt that finishes leaves the
    batch, and the next batch starts when all of it has finished. So each prompt takes the steps,
    and the NFE, it takes alone, and at temperature 0 its tokens are the same up to rounding: a
    batch of another shape sums float32 (or bfloat16) in another order, which can flip a near tie
    between two tokens, or a probability right at a threshold (tests/test_batch.py keeps such
    models out; tools/bench.py reports how often real prompts differ).

    decode: a one-prompt decoder as make_decoder returns it (a partial whose first argument is the
    model). prompts: list of token-id lists. generators: one torch.Generator per prompt (its draws
    at temperature > 0 are its own), or None for decode's. forwards: optional list; each batched
    pass appends the indexes of the prompts it carried.
    Returns the Generations in prompt order; their seconds are each prompt's latency in its batch.
    Raises ValueError for batch_size < 1; the first error a prompt's decode raised.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: decode at least one prompt at a time")
    generators = generators or [None] * len(prompts)
    out = []
    for b in range(0, len(prompts), batch_size):
        chunk = range(b, min(b + batch_size, len(prompts)))
        log = [] if forwards is not None else None
        out += decode_together(decode, [prompts[i] for i in chunk],
                               [generators[i] for i in chunk], log)
        if log is not None:
            forwards += [[b + i for i in carried] for carried in log]
    return out


class BatchedModel:
    """The model as one prompt's decoder sees it in a batch: its config and caches, but each
    forward pass is posted to the batch's inbox, and waits for its logits."""

    def __init__(self, model, inbox, index):
        self.config, self.new_kv_cache, self.parameters = (model.config, model.new_kv_cache,
                                                           model.parameters)
        self.inbox, self.index, self.replies = inbox, index, queue.SimpleQueue()

    def __call__(self, idx, position_ids, kv_cache=None):
        self.inbox.put((self.index, "forward", (idx, position_ids, kv_cache)))
        reply = self.replies.get()
        if isinstance(reply, BaseException):
            raise reply
        return reply


class BatchAborted(Exception):
    """Raised in a prompt's decode when another prompt of its batch failed."""


def decode_together(decode, prompts, generators, forwards):
    """One batch of generate_batch: a thread per prompt, and this loop running their forward
    passes. The threads take turns (one runs at a time, until its next forward pass or its end),
    so they never contend for the interpreter. Returns their Generations in order; raises the
    first error one of them raised."""
    model, inbox = decode.args[0], queue.SimpleQueue()
    proxies = [BatchedModel(model, inbox, i) for i in range(len(prompts))]

    def work(i):
        one = partial(decode.func, proxies[i], *decode.args[1:], **decode.keywords)
        try:
            gen = {} if generators[i] is None else {"generator": generators[i]}
            inbox.put((i, "done", one(prompts[i], **gen)))
        except BaseException as e:  # handed to the loop, which raises it
            inbox.put((i, "error", e))

    requests, results, error = {}, [None] * len(prompts), None

    def hear_from(i):
        """Wait for prompt i's next forward pass, or its end."""
        nonlocal error
        j, kind, value = inbox.get()
        assert j == i, "only prompt i runs"
        if kind == "forward":
            requests[i] = value
            return
        results[i] = value
        if kind == "error" and error is None and not isinstance(value, BatchAborted):
            error = value

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(prompts))]
    for i, t in enumerate(threads):
        t.start()
        hear_from(i)
    while requests:                      # every prompt still decoding waits for its logits
        waiting, replies = sorted(requests), {}
        if error is None:
            try:
                replies = dict(zip(waiting, forward_batch(model, [requests[j] for j in waiting])))
                if forwards is not None:
                    forwards.append(waiting)
            except Exception as e:
                error = e
        requests = {}
        for j in waiting:
            proxies[j].replies.put(replies.get(j) if error is None else
                                   BatchAborted("another prompt of the batch failed"))
            hear_from(j)
    for t in threads:
        t.join()
    if error is not None:
        raise error
    return results


@torch.inference_mode()
def forward_batch(model, requests):
    """One forward pass for the forward passes several prompts asked for.

    requests: list of (idx (R_i, T_i) int64, position_ids (R_i, T_i) int64, KVCache or None), all
    with a cache (ReFusion, next-token decoding) or none (the MDM). Rows are padded to the longest
    T_i (token 0 at position 0); cached rows attend through a BatchedCache, uncached ones with a
    key mask that hides the padding (none when every T_i is the same).
    Returns the logits of each request: (R_i, T_i, V) float32 (views of one tensor).
    Raises ValueError when some requests have a cache and others do not.
    """
    T = max(idx.shape[1] for idx, _, _ in requests)
    idx = torch.cat([F.pad(r[0], (0, T - r[0].shape[1])) for r in requests])
    positions = torch.cat([F.pad(r[1], (0, T - r[1].shape[1])) for r in requests])
    lengths = [r[0].shape[1] for r in requests]
    caches = [r[2] for r in requests]
    if all(c is not None for c in caches):
        logits = model(idx, positions, kv_cache=BatchedCache(caches, lengths, T))
    elif all(c is None for c in caches):
        key_mask = None
        if min(lengths) < T:
            row_lengths = torch.tensor([n for r, n in zip(requests, lengths)
                                        for _ in range(r[0].shape[0])], device=idx.device)
            key_mask = torch.arange(T, device=idx.device)[None] < row_lengths[:, None]
        logits = model(idx, positions, key_mask=key_mask)
    else:
        raise ValueError("a batch mixes forward passes with and without a KV cache")
    out, r0 = [], 0
    for (idx_i, _, _), n in zip(requests, lengths):
        out.append(logits[r0:r0 + idx_i.shape[0], :n])
        r0 += idx_i.shape[0]
    return out

# -----------------------------------------------------------------------------
# results, settings (checked once, when built) and checks


@dataclass
class Generation:
    """The result of one decode and its statistics (SPEC section 4, "Statistics").

    tokens:  generated response ids, in position order, cut after the first EOS (EOS included).
    nfe:     model forward calls (a batched call counts once; the prompt prefill counts).
    seconds: wall-clock decode time in seconds.
    trace:   per decoding step, the (position, token) pairs it committed (true positions).
    step_nfe: per decoding step, the forward passes it made (they sum to nfe).
    cache_bytes: the most bytes its KV cache held (0 for the MDM, which has none).
    """
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
        """The statistics as a dict of plain numbers (tokens, nfe, tpf, seconds, tokens_per_s,
        cache_bytes), for --json."""
        return {"tokens": len(self.tokens), "nfe": self.nfe, "tpf": round(self.tpf, 3),
                "seconds": round(self.seconds, 4), "tokens_per_s": round(self.tokens_per_s, 2),
                "cache_bytes": self.cache_bytes}


@dataclass
class DecodeSettings:
    """What every decoder needs: how many tokens to generate and how to pick them.

    max_new_tokens: at most this many tokens are returned (> 0).
    temperature: 0 for argmax; > 0 (finite) samples by Gumbel-max in float64 (SPEC section 4).
    Raises ValueError when a value cannot work. The ARM baseline needs nothing more.
    """
    max_new_tokens: int
    temperature: float = 0.0

    def __post_init__(self):
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: ask for at least one new "
                             "token")
        if not 0 <= self.temperature < math.inf:  # also catches NaN
            raise ValueError(f"temperature={self.temperature}: use 0 for greedy decoding or a "
                             "finite positive value to sample")

    @property
    def gen_length(self):
        """Positions the generation occupies in the context (tokens)."""
        return self.max_new_tokens

    def length_words(self):
        """(how max_new_tokens became gen_length, what to lower), for ContextTooLong's message."""
        return "", "lower max_new_tokens"


INFILL_MODES = ("paper", "ar")


@dataclass
class RefusionSettings(DecodeSettings):
    """ReFusion's knobs (SPEC section 4): slot size S, serial blocks B, the two thresholds, and the
    infill mode: "paper" (the default, the paper's and the authors' code) or "ar" (SPEC section
    4.1, beyond the paper). gen_length is max_new_tokens rounded up to a multiple of S * B (SPEC
    section 4). Thresholds are probabilities compared with `>`: any finite value >= 0 is accepted,
    and 1 or more means "never" (one slot per plan step / only forced tokens accepted).
    Raises ValueError naming the setting and the fix.
    """
    slot_size: int = 8
    serial_num_blocks: int = 1
    slot_threshold: float = 0.9
    token_threshold: float = 0.3
    infill: str = "paper"

    def __post_init__(self):
        super().__post_init__()
        if self.infill not in INFILL_MODES:
            raise ValueError(f"infill={self.infill!r}: choose 'paper' (the forced token of each "
                             "infill round is its masked draft, as in the paper) or 'ar' (the "
                             "next-token prediction, SPEC 4.1)")
        S = self.slot_size
        if S <= 0:
            raise ValueError(f"slot_size={S}: a slot holds at least one token (the paper uses 4 "
                             "to 32)")
        if self.serial_num_blocks <= 0:
            raise ValueError(f"serial_num_blocks={self.serial_num_blocks}: use at least one "
                             "serial block")
        for name in ("slot_threshold", "token_threshold"):
            if not 0 <= getattr(self, name) < math.inf:  # also catches NaN
                raise ValueError(f"{name}={getattr(self, name)}: thresholds are finite "
                                 "probabilities >= 0 (any value >= 1 already means never)")

    @property
    def n_slots(self):
        """Slots in the whole generation: a multiple of serial_num_blocks."""
        B = self.serial_num_blocks
        return math.ceil(self.max_new_tokens / (self.slot_size * B)) * B

    @property
    def slots_per_serial_block(self):
        """Slots in each serial block (the most infilled in parallel: the cache's rows)."""
        return self.n_slots // self.serial_num_blocks

    @property
    def gen_length(self):
        """max_new_tokens rounded up to a multiple of slot_size * serial_num_blocks (tokens)."""
        return self.n_slots * self.slot_size

    def length_words(self):
        return (f", max_new_tokens={self.max_new_tokens} rounded up to {self.serial_num_blocks} "
                f"serial block(s) of whole {self.slot_size}-token slots",
                "lower max_new_tokens, slot_size or serial_num_blocks")


@dataclass
class MDMSettings(DecodeSettings):
    """LLaDA's schedule: `steps` denoising steps over semi-autoregressive blocks of `block_length`
    tokens, decoded left to right (SPEC section 4, "Baseline decoders").

    steps None: one token per step (steps = max_new_tokens); block_length None: one block.
    block_length must divide max_new_tokens, the number of blocks must divide steps, and
    steps <= max_new_tokens. Raises ValueError naming the setting and the fix.
    """
    steps: int | None = None
    block_length: int | None = None

    def __post_init__(self):
        super().__post_init__()
        n = self.max_new_tokens
        self.steps = n if self.steps is None else self.steps
        self.block_length = n if self.block_length is None else self.block_length
        if self.steps <= 0 or self.block_length <= 0:
            raise ValueError(f"steps={self.steps}, block_length={self.block_length}: both must be "
                             "positive")
        if n % self.block_length:
            raise ValueError(f"max_new_tokens={n} is not a multiple of "
                             f"block_length={self.block_length}; pick a block_length dividing {n}")
        if self.steps % self.n_semi_ar_blocks:
            raise ValueError(f"steps={self.steps} cannot be shared equally by the "
                             f"{self.n_semi_ar_blocks} semi-autoregressive blocks of "
                             f"{self.block_length} tokens; pick steps as a multiple of "
                             f"{self.n_semi_ar_blocks}")
        if self.steps > n:
            raise ValueError(f"steps={self.steps} > max_new_tokens={n}: some steps would commit no "
                             f"token; use at most {n} steps (one token per step)")

    @property
    def n_semi_ar_blocks(self):
        """Semi-autoregressive blocks of block_length tokens, decoded left to right."""
        return self.max_new_tokens // self.block_length


class ContextTooLong(ValueError):
    """A prompt + generation longer than the model's context: prompt_len, settings (whose gen_length
    is the generation's length in tokens) and limit (the context, in positions) say by how much;
    the message names the settings to change (settings.length_words)."""

    def __init__(self, prompt_len, settings, limit):
        how, fix = settings.length_words()
        super().__init__(f"prompt ({prompt_len} tokens) + generation ({settings.gen_length} "
                         f"tokens{how}) exceeds the model's context of {limit} positions; shorten "
                         f"the prompt or {fix}")
        self.prompt_len, self.settings, self.limit = prompt_len, settings, limit


def check_context(model, prompt_len, settings):
    """Refuse an empty prompt (ValueError) or a prompt + generation (settings.gen_length positions)
    that does not fit the model's positions (ContextTooLong)."""
    if prompt_len == 0:
        raise ValueError("the prompt is empty: give at least one token of context")
    if prompt_len + settings.gen_length > model.config.block_size:
        raise ContextTooLong(prompt_len, settings, model.config.block_size)


def check_attention(model, method):
    """Refuse a decoding method the model's attention was not trained for. Raises ValueError.

    refusion and ar feed tokens after a KV cache, which needs causal attention; mdm recomputes a
    sequence of masks, which needs bidirectional attention (SPEC section 4, "Baseline decoders").
    Reads model.config.causal (False for a model trained with --objective=mdm).
    """
    if method == "mdm" and model.config.causal:
        raise ValueError("this model was trained with a causal objective (refusion or ar), so it "
                         "cannot denoise a sequence of masks bidirectionally; use "
                         "--method=refusion or --method=ar")
    if method != "mdm" and not model.config.causal:
        raise ValueError(f"this model has bidirectional attention (trained with "
                         f"--objective=mdm), but --method={method} decodes causally after a KV "
                         "cache; use --method=mdm")

# -----------------------------------------------------------------------------
# choosing tokens


def ban(scores, token_ids):
    """Set scores[..., id] = -inf for each id, in place, and return scores (logits or probabilities
    (..., V) about to be maximized), so that no banned token is ever chosen. Only the choice is
    affected: confidences stay the raw softmax probabilities (SPEC section 4), so a ban changes no
    threshold decision. ReFusion and the MDM always ban the mask id (in the response it would read
    as a still-masked position); the command line bans the mask and pad ids for every decoder,
    since no training label is either."""
    scores[..., list(token_ids)] = -math.inf
    return scores


def draft_tokens(logits, temperature, generator, banned=()):
    """Draft a token at each row of logits (N, V) float32; returns (tokens (N,) int64, probs (N,)
    float32).

    temperature 0: argmax; otherwise Gumbel-max sampling in float64, and a row whose scaled logits
    overflow (a temperature so small that logits / temperature is +-inf) takes the limit of sampling
    as the temperature goes to 0, the argmax. Tokens in `banned` are never drafted (ban). The
    probability is the raw softmax probability of the drafted token (temperature does not scale it;
    SPEC section 4).
    """
    probs = torch.softmax(logits.float(), dim=-1)
    if temperature == 0:
        tokens = ban(probs.clone(), banned).argmax(dim=-1)
    else:
        u = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
        gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
        scores = logits.double() / temperature + gumbel
        # overflowed scores tie at +-inf, and argmax would take the lowest id among them, banned
        # or not
        overflow = (torch.isfinite(logits) & ~torch.isfinite(scores)).any(dim=-1, keepdim=True)
        tokens = ban(torch.where(overflow, logits.double(), scores), banned).argmax(dim=-1)
    return tokens, probs.gather(-1, tokens[:, None])[:, 0]


def next_token_probs(logits, tokens):
    """Probability of each token given everything before it (causal next-token prediction).

    logits: (B, T, V) for the tokens (B, T) fed in one pass. Returns (B, T) float32 where column j
    is softmax(logits[:, j - 1])[tokens[:, j]]; column 0 has no prediction in this pass and is 0.
    """
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
DECODERS = {"refusion": (generate_refusion, RefusionSettings), "ar": (generate_ar, DecodeSettings),
            "mdm": (generate_mdm, MDMSettings)}


def decoder_settings(cfg):
    """The settings object of cfg["method"] built from cfg's knobs (a dict with every field of it),
    which checks every knob, so the command line checks them before loading any weights: a
    RefusionSettings, DecodeSettings or MDMSettings. Raises ValueError for an unknown method or
    invalid settings."""
    if cfg["method"] not in DECODERS:
        raise ValueError(f"--method={cfg['method']!r}: choose one of {', '.join(DECODERS)}")
    Settings = DECODERS[cfg["method"]][1]
    knobs = {f.name: cfg[f.name] for f in fields(Settings)}
    if cfg["method"] == "mdm":  # 0: one token per step, one semi-autoregressive block
        knobs.update(steps=cfg["steps"] or None, block_length=cfg["block_length"] or None)
    return Settings(**knobs)


def make_decoder(cfg, model, ids, generator):
    """(decode: prompt ids -> Generation, its settings) for cfg["method"] and cfg's knobs.

    ids: {"eos_ids": a tuple of ids, "mask_id", "pad_id", optionally "undecodable_ids"}. The mask
    and pad ids, and the ids the tokenizer cannot decode (a model's padded rows), are never
    generated (unless one is an EOS, as Qwen's <|endoftext|>, its pad id, is). decode takes the
    prompt and, optionally, generator= and on_step= for this one call.
    Raises ValueError for an unknown method, a method the model's attention does not support, a
    ReFusion or MDM decode without a mask token, or invalid settings.
    """
    settings = decoder_settings(cfg)
    check_attention(model, cfg["method"])
    if cfg["method"] != "ar" and ids["mask_id"] is None:
        raise ValueError(f"--method={cfg['method']}: this model has no mask token (a plain "
                         "pretrained model, such as Qwen3 or SmolLM2, was never trained to fill "
                         "masks); use --method=ar, or fine-tune it with train.py first")
    banned = tuple(i for i in (ids["mask_id"], ids["pad_id"], *ids.get("undecodable_ids", ()))
                   if i is not None and i not in ids["eos_ids"])
    kwargs = dict(eos_ids=ids["eos_ids"], banned_ids=banned)
    if cfg["method"] != "ar":
        kwargs["mask_id"] = ids["mask_id"]
    return partial(DECODERS[cfg["method"]][0], model, settings=settings, generator=generator,
                   **kwargs), settings


def check_config(cfg):
    """Refuse settings that cannot work before any weights are read: the device, the seed, the
    number of samples, the batch size and, when --method is given, the decoder's settings. Raises
    ConfigError or ValueError naming the flag. config/sample_*.py pass it (tests/test_config.py)."""
    check_device(cfg["device"])
    check_seed(cfg)
    if cfg["num_samples"] <= 0:
        raise ValueError(f"--num_samples={cfg['num_samples']}: ask for at least one validation "
                         "prompt")
    if cfg["batch_size"] < 1:
        raise ValueError(f"--batch_size={cfg['batch_size']}: decode at least one prompt at a time")
    if cfg["batch_size"] > 1 and cfg["show"]:
        raise ValueError("--show redraws one decode at a time; use it with --batch_size=1")
    if cfg["method"]:
        decoder_settings(cfg)  # bad decoder settings fail before the weights are read

# -----------------------------------------------------------------------------
# the command line: python sampler.py [config/sample_*.py] [--key=value ...]
out_dir = "out"            # directory holding ckpt.pt (written by train.py) ...
init_from = ""             # ... or a Hugging Face model folder (Qwen3, SmolLM2), or a ckpt.pt
dtype = "float32"          # the weights in float32 or bfloat16 (half the memory)
tokenizer = ""             # hf:FOLDER: a checkpoint's tokenizer folder, moved; empty: as recorded
chat = False               # wrap the prompt in the model's chat template (a user turn)
prompt = ""                # decode this text ...
prompt_file = ""           # ... or the text of this file (a pipe too; - for standard input) ...
num_samples = 3            # ... or this many prompts from the validation split
method = ""                # refusion, ar or mdm; empty: the one the checkpoint was trained for
max_new_tokens = 128       # at most this many tokens are returned (refusion: whole serial blocks)
slot_size = 8              # refusion: tokens per slot (S)
serial_num_blocks = 1      # refusion: serial blocks, each of the same whole number of slots
slot_threshold = 0.9       # refusion: a slot is planned when its first draft's probability passes
token_threshold = 0.3      # refusion: a draft token is accepted when its probability exceeds this
infill = "paper"           # refusion: 'paper' (force masked drafts) or 'ar' (next tokens, SPEC 4.1)
steps = 0                  # mdm: denoising steps; 0 = one token per step
block_length = 0           # mdm: semi-autoregressive block length; 0 = the whole generation
temperature = 0.0          # 0: greedy; above 0: sample (Gumbel-max)
batch_size = 1             # prompts decoded together (generate_batch); each sample is its own
compare_ar = True          # refusion: also decode them by --method=ar, compared in the summary
seed = 1337                # prompt i is sampled from a torch.Generator seeded with seed + i
device = "cpu"             # cpu, cuda, cuda:N or mps
json = False               # one JSON object per sample instead of text
show = False               # redraw the response after every decoding step (masked tokens as ░)
plot = ""                  # draw the first prompt's decode into this PNG (matplotlib), step by step
# -----------------------------------------------------------------------------
DEFAULTS = settings_in(globals())


def main(argv):
    """Decode prompts with a checkpoint or a Hugging Face folder; print each response with its
    verdict (where the data set has a check) and speed, then a summary line that compares ReFusion
    with next-token decoding of the same prompts (compare_ar)."""
    from support import sampling  # loading models and prompts, the live trace, printing
    cfg = parse_args(DEFAULTS, argv)
    explicit = explicit_keys(cfg, DEFAULTS, argv)
    check_config(cfg)
    if cfg["plot"]:
        sampling.check_plot_path(cfg)  # before any weights are read
    model, enc, ids, objective, ckpt = sampling.load_model(cfg)
    cfg["method"] = cfg["method"] or objective
    if cfg["method"] == "mdm":
        sampling.fit_mdm_canvas(cfg, ckpt, "max_new_tokens" in explicit)
    # the generator of the warm-up (each prompt has its own)
    decode, settings = make_decoder(cfg, model, ids, torch.Generator(cfg["device"]))
    sampling.note_mismatch(cfg["method"], objective, ckpt)
    prompts = sampling.load_prompts(cfg, enc, ckpt, settings.gen_length, model.config.block_size)
    decode(prompts[0][:8])  # warm-up: the first forward passes pay one-time costs
    compare = sampling.compares_next_token(cfg, len(prompts), "compare_ar" in explicit)
    if compare:  # next-token decoding of the same model, warmed up the same way
        sampling.note_mismatch("ar", objective, ckpt)
        next_token, _ = make_decoder(dict(cfg, method="ar"), model, ids,
                                     torch.Generator(cfg["device"]))
        next_token(prompts[0][:8])
    report = sampling.Report(cfg, enc, ids, ckpt)
    B = cfg["batch_size"]
    for b in range(0, len(prompts), B):  # batch_size 1: a prompt at a time, as the decoders run
        batch = prompts[b:b + B]
        generators = [sampling.prompt_generator(cfg["device"], cfg["seed"], b + i)
                      for i in range(len(batch))]
        live = (sampling.LiveTrace(enc, batch[0], settings.max_new_tokens, ids["eos_ids"])
                if cfg["show"] else None)
        outs = report.timed(lambda: [decode(batch[0], generator=generators[0], on_step=live)]
                            if B == 1 else generate_batch(decode, batch, B, generators))
        if cfg["plot"] and b == 0:
            sampling.plot_first_decode(cfg, enc, ids, settings, prompts[0], outs[0])
        for prompt, out in zip(batch, outs):
            report.sample(prompt, out)
        if compare:  # the same prompts right after, so that both see the same machine
            generators = [sampling.prompt_generator(cfg["device"], cfg["seed"], b + i)
                          for i in range(len(batch))]
            outs = report.timed(lambda: [next_token(batch[0], generator=generators[0])]
                                if B == 1 else generate_batch(next_token, batch, B, generators),
                                next_token=True)
            for prompt, out in zip(batch, outs):
                report.next_token(prompt, out)
    report.summary()


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
