"""
The training layouts of SPEC section 3 as batches: ReFusion's (reorganize_slots, layout_slots and
its plain loop layout_one_sample), the options beyond the paper (label_slot_ends, mix_layouts,
pack_rows), the baselines' (autoregressive_batch, pad_with_eos, random_mask_batch).
"""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

IGNORE = -100  # label of a token that is not predicted (F.cross_entropy's ignore_index)


@dataclass
class Batch:
    """One training batch in the order the model sees it; every tensor (B, T)."""
    idx: torch.Tensor                      # int64 tokens, the mask id where masked
    position_ids: torch.Tensor             # int64 true positions (RoPE)
    labels: torch.Tensor                   # int64 target at each token, IGNORE where none
    # float32 1 / (p_mask * response length) where the label is a masked token's own (MDM loss),
    # 0 where it is a next token (AR loss)
    mdm_weight: torch.Tensor
    key_mask: torch.Tensor | None = None   # bool, False on padding (the bidirectional MDM)
    sample_id: torch.Tensor | None = None  # int64, packed rows: each token's sample, -1 on padding
    n_samples: int | None = None           # packed rows: the samples (hybrid_loss's divisor)

    @property
    def attn_mask(self):
        """The model's attn_mask: (B, 1, 1, T) bool from key_mask, (B, 1, T, T) from sample_id."""
        # packed rows: a query sees the keys of its own sample, at or before its place
        if self.sample_id is not None:
            T = self.sample_id.shape[1]
            causal = torch.ones(T, T, dtype=torch.bool, device=self.sample_id.device).tril()
            return ((self.sample_id[:, :, None] == self.sample_id[:, None, :]) & causal)[:, None]
        # the bidirectional MDM: every query sees every key but padding (a causal model's padding
        # comes last, where no query sees it: no mask)
        return None if self.key_mask is None else self.key_mask[:, None, None]


def _p_mask(batch_size, eps, generator, device):
    """p_mask = (1 - eps) t + eps, t ~ U(0, 1): (batch_size,) float32 (SPEC section 3, step 2)."""
    # drawn on the CPU generator, so the draws do not depend on the device
    t = torch.rand(batch_size, generator=generator).to(device)
    # eps keeps p_mask above 0: the MDM loss divides by it
    return (1 - eps) * t + eps


def reorganize_slots(tokens, prompt_len, length, slot_sizes, mask_id, generator, eps=1e-3):
    """ReFusion's slot reorganization (SPEC section 3, steps 1-4): per sample the draws of steps 1-3
    from generator (a CPU torch.Generator), in that order, then layout_slots. tokens: (B, T) int64,
    prompt, response, padding; prompt_len, length: (B,) int64 (EOS counted). Returns a Batch."""
    B, T = tokens.shape
    dev = tokens.device
    # Step 1: each sample's slot size S, drawn from slot_sizes: (B,)
    pick = torch.randint(len(slot_sizes), (B,), generator=generator)
    S = torch.tensor(slot_sizes)[pick].to(dev)
    # Step 2: each sample's masking probability p_mask, never 0 (eps): (B,)
    p = _p_mask(B, eps, generator, dev)
    # (B, T) indexed by slot id (a response of <= T tokens has <= T slots): slot k masked with
    # probability p
    draws = torch.rand(B, T, generator=generator).to(dev)
    slot_is_masked = draws < p[:, None]
    # (B, T) a random order of the slots: argsort of uniform noise lists the slot ids in a random
    # order, and argsort of that list inverts it, giving each slot k its place in that order (its
    # rank)
    noise = torch.rand(B, T, generator=generator)
    slot_rank = noise.argsort(dim=1).argsort(dim=1).to(dev)
    # Steps 3-4: the buffer, its labels and loss weights, from these draws alone.
    return layout_slots(tokens, prompt_len, length, S, p, slot_is_masked, slot_rank, mask_id)


def layout_one_sample(tokens, P, n, S, p, slot_is_masked, slot_rank, mask_id):
    """layout_slots for one sample, as a plain loop (SPEC section 3, steps 3-4). tokens: list of
    ids; P, n: prompt and prompt + response lengths; S: slot size; p: p_mask; slot_is_masked,
    slot_rank: lists by slot id. Returns lists (idx, position_ids, labels, mdm_weight)."""
    # Step 3: the response cut into slots of S tokens (the last may be shorter), as true positions.
    slots = [range(start, min(start + S, n)) for start in range(P, n, S)]
    ids = range(len(slots))
    # The clean slots in the order of their rank (the random permutation of step 3).
    clean = [slots[k] for k in sorted(ids, key=lambda k: slot_rank[k]) if not slot_is_masked[k]]
    # The masked slots in their original order.
    masked = [slots[k] for k in ids if slot_is_masked[k]]

    # Step 4, the buffer: first the prompt, at its positions, with no labels.
    idx = tokens[:P]
    pos = list(range(P))
    labels = [IGNORE] * P
    weight = [0.0] * P
    # Then the clean slots in rank order, each token at its true position.
    for slot in clean:
        idx += [tokens[q] for q in slot]
        pos += slot
        # each token labelled with the next token of its own slot (AR loss); the slot's last token
        # has no next token inside the slot
        labels += [tokens[q + 1] for q in slot[:-1]] + [IGNORE]
        weight += [0.0] * len(slot)
    # Then the masked slots: mask ids at the true positions of the tokens they hide.
    for slot in masked:
        idx += [mask_id] * len(slot)
        pos += slot
        # each labelled with its own token, not shifted (MDM loss), weighted 1 / (p_mask * response
        # length)
        labels += [tokens[q] for q in slot]
        weight += [1.0 / (p * (n - P))] * len(slot)
    # Padding last, where no real token's causal attention reaches it; no labels.
    idx += tokens[n:]
    pos += range(n, len(tokens))
    labels += [IGNORE] * (len(tokens) - n)
    weight += [0.0] * (len(tokens) - n)
    return idx, pos, labels, weight


def layout_slots(tokens, prompt_len, length, S, p, slot_is_masked, slot_rank, mask_id):
    """SPEC section 3, steps 3-4, for the whole batch: S, p: (B,) int64 slot size, float32 p_mask;
    slot_is_masked (bool), slot_rank (int64, a permutation): (B, >= slots) by slot id. Returns a
    Batch (B, T), what layout_one_sample gives per sample."""
    B, T = tokens.shape
    # Every tensor below is (B, T), in input order until the sort. A token's true position is its
    # index in the input.
    pos = torch.arange(T, device=tokens.device).expand(B, T)
    # its position in the response (negative in the prompt)
    rel = pos - prompt_len[:, None]
    # the response's tokens, EOS included
    in_response = (rel >= 0) & (pos < length[:, None])
    # the slot id of a response token (0 elsewhere)
    slot = torch.where(in_response, rel // S[:, None], 0)
    # a token of a masked slot, and one of a clean slot
    masked = in_response & slot_is_masked.gather(1, slot)
    clean = in_response & ~masked

    # Buffer order by one sort of a key per token. group: the buffer's four parts in order, prompt
    # 0, clean slots 1, masked slots 2, padding 3.
    group = torch.where(pos < prompt_len[:, None], 0,
                        torch.where(clean, 1, torch.where(masked, 2, 3)))
    # within: the order inside a part. A clean token sorts by its slot's rank, then by position
    # (rank * T + pos, pos < T: a slot's tokens stay together and in order); every other token by
    # position (the prompt, the masked slots in their own order, the padding).
    within = torch.where(clean, slot_rank.gather(1, slot) * T + pos, pos)
    # within <= (T - 1) * T + T - 1 < T * (T + 1), so group * T * (T + 1) + within sorts by group
    # first, then by within; keys are distinct (each holds its position), so the order is unique.
    # (B, T) the input index of the token at each buffer place
    order = (group * T * (T + 1) + within).argsort(dim=1)

    # (B, T) whether the next input token belongs to the same slot
    next_in_slot = torch.zeros_like(in_response)
    next_in_slot[:, :-1] = (slot[:, 1:] == slot[:, :-1]) & in_response[:, 1:]
    # (B, T) the next input token (the last one repeated at the end, never used)
    next_tok = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)
    # a clean token is labelled with the next token of its own slot
    predicts_next = clean & next_in_slot
    # masked: its own token; labelled with the next token: that token; anything else: no label
    labels = torch.where(masked, tokens, torch.where(predicts_next, next_tok, IGNORE))
    # the MDM loss weight of a masked token: 1 / (p_mask * response length)
    weight = torch.where(masked, 1.0 / (p * (length - prompt_len))[:, None], 0.0)
    # a masked slot's tokens read the mask id
    idx = torch.where(masked, mask_id, tokens)
    # all four from input order to buffer order, by the same sort
    return Batch(*(x.gather(1, order) for x in (idx, pos, labels, weight)))


# -----------------------------------------------------------------------------
# beyond the paper (SPEC section 3, opt-in): train.py's make_batch applies these after the layout


def label_slot_ends(batch, tokens, prompt_len, length):
    """--slot_end_labels (SPEC section 3): batch, reorganize_slots' layout of tokens, prompt_len and
    length, with each clean slot's last token and the prompt's labelled too. Draws nothing."""
    T = tokens.shape[1]
    pos = batch.position_ids
    # the token at the next true position of every buffer place (clamped at the row's end)
    next_tok = tokens.gather(1, (pos + 1).clamp(max=T - 1))
    # a clean token: a response token that is not masked (a masked token has a loss weight)
    in_response = (pos >= prompt_len[:, None]) & (pos < length[:, None])
    clean = in_response & (batch.mdm_weight == 0)
    prompt_end = pos == prompt_len[:, None] - 1
    # labelled when the next position holds a response token
    labelled = (clean | prompt_end) & (pos + 1 < length[:, None])
    return replace(batch, labels=torch.where(labelled, next_tok, batch.labels))


def mix_layouts(batch, other, fraction, generator):
    """--ar_fraction (SPEC section 3): each row of batch replaced by other's (the same (B, T)) with
    probability fraction, one torch.rand(B) draw from generator. Returns the mixed Batch."""
    B = batch.idx.shape[0]
    # (B, 1): which samples take the other layout, one draw each
    draws = torch.rand(B, generator=generator).to(batch.idx.device)
    chosen = (draws < fraction)[:, None]
    # a chosen sample's row comes whole from the other layout: inputs, positions, labels, weights
    mine = (batch.idx, batch.position_ids, batch.labels, batch.mdm_weight)
    theirs = (other.idx, other.position_ids, other.labels, other.mdm_weight)
    return Batch(*(torch.where(chosen, t, m) for m, t in zip(mine, theirs)))


def autoregressive_batch(tokens, prompt_len, length):
    """The ARM baseline's Batch (SPEC section 3): tokens (B, T), prompt_len, length (B,) int64."""
    B, T = tokens.shape
    # natural order: each token at its own position
    pos = torch.arange(T, device=tokens.device).expand(B, T)
    # a token is labelled when the next one is a response token (the prompt's last included)
    predicts_response = (pos + 1 >= prompt_len[:, None]) & (pos + 1 < length[:, None])
    # (B, T) the next token (the last one repeated at the end, never used)
    next_tok = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)
    labels = torch.where(predicts_response, next_tok, IGNORE)
    # no masked tokens, so no MDM loss weights
    return Batch(tokens, pos, labels, torch.zeros(B, T, device=tokens.device))


def pad_with_eos(tokens, prompt_len, length, eos_id, pad_id, gen_length, max_len):
    """The MDM baseline's canvas (SPEC section 3): tokens (B, T), prompt_len, length (B,) int64.
    Returns (tokens (B, T'), length (B,)), int64, each response followed by EOS to gen_length."""
    # (B,) each sample's new length: its prompt and gen_length tokens, within the context, and
    # never shorter than the sample itself
    end = torch.maximum(length, (prompt_len + gen_length).clamp(max=max_len))
    # (B, T') room for the longest, pad_id after each sample
    wide = F.pad(tokens, (0, int(end.max()) - tokens.shape[1]), value=pad_id)
    # EOS from each sample's end up to its new length; pad_id after that
    pos = torch.arange(wide.shape[1], device=tokens.device)
    padded = torch.where((pos >= length[:, None]) & (pos < end[:, None]), eos_id, wide)
    return padded, end


def random_mask_batch(tokens, prompt_len, length, mask_id, generator, eps=1e-3, shift=False):
    """The MDM baseline's Batch (SPEC section 3): tokens (B, T), prompt_len, length (B,) int64.
    Raises ValueError when shift (mdm_shift) is set and a sample has no prompt."""
    B, T = tokens.shape
    # natural order: each token at its own position
    pos = torch.arange(T, device=tokens.device).expand(B, T)
    # (B,) each sample's p_mask, drawn before the masks
    p = _p_mask(B, eps, generator, tokens.device)
    # each response token masked with probability p_mask, independently (no slots)
    in_response = (pos >= prompt_len[:, None]) & (pos < length[:, None])
    draws = torch.rand(B, T, generator=generator).to(tokens.device)
    masked = in_response & (draws < p[:, None])
    # a masked token's label is its own token, weighted 1 / (p_mask * response length)
    labels = torch.where(masked, tokens, IGNORE)
    weight = torch.where(masked, 1.0 / (p * (length - prompt_len))[:, None], 0.0)
    # Dream's shift: the label of response token q moves to position q - 1, a prompt token or one
    # of the response
    if shift:
        if (prompt_len < 1).any():
            raise ValueError("mdm_shift: a sample has no prompt, so its first token has no "
                             "position before it to be predicted from; give every sample a prompt")
        labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
        weight = F.pad(weight[:, 1:], (0, 1))
    # a masked token reads the mask id; bidirectional attention: every token but padding is a key
    idx = torch.where(masked, mask_id, tokens)
    return Batch(idx, pos, labels, weight, key_mask=pos < length[:, None])


def pack_rows(batch, length):
    """--pack (SPEC section 3): a causal batch's samples (sample i: the first length[i] tokens of
    row i; length (B,) int64) laid one after another into as few rows as first fit, longest first,
    finds. Returns a Batch (R, T), R <= B, with sample_id and n_samples; padding: token 0."""
    B, T = batch.idx.shape
    lengths = length.tolist()
    # (B, T) where each token of the packed rows comes from, as the index b * T + t into the
    # flattened batch; -1 on padding (rows past the last used are dropped below)
    src = torch.full((B, T), -1)
    # the tokens each row has left
    room = []
    # First fit, longest first.
    for i in sorted(range(B), key=lambda i: -lengths[i]):
        n = lengths[i]
        # the first row with room for sample i, else a new row
        r = 0
        while r < len(room) and room[r] < n:
            r += 1
        if r == len(room):
            room.append(T)
        # the sample goes right after the samples the row holds
        at = T - room[r]
        src[r, at:at + n] = i * T + torch.arange(n)
        room[r] -= n
    src = src[:len(room)].to(batch.idx.device)
    # (R, T) the sample of each token (b of b * T + t), -1 on padding
    sample_id = torch.where(src >= 0, src // T, -1)

    # x (B, T) laid out as the packed rows (R, T), fill on padding
    def take(x, fill):
        return torch.where(src >= 0, x.reshape(-1)[src.clamp(min=0)], fill)
    # padding: token 0 at position 0, no label, no MDM loss weight
    return Batch(take(batch.idx, 0), take(batch.position_ids, 0), take(batch.labels, IGNORE),
                 take(batch.mdm_weight, 0.0), sample_id=sample_id, n_samples=B)
