"""
ReFusion's training layout (SPEC section 3) and the baselines', as batches of tensors: what each
objective feeds the model and what it asks it to predict.

    reorganize_slots      ReFusion: slots, masking, the clean slots shuffled before the masked ones
    layout_one_sample     one sample's layout as a plain loop, the reference layout_slots equals
    layout_slots          the deterministic half of reorganize_slots, vectorized over the batch
    label_slot_ends       a label pass after the layout (--slot_end_labels, beyond the paper)
    mix_layouts           a share of samples in another layout (--ar_fraction, beyond the paper)
    autoregressive_batch  the ARM baseline's layout
    pad_with_eos          the MDM baseline's canvas (LLaDA's supervised fine-tuning: EOS padding)
    random_mask_batch     the MDM baseline's layout (each response token masked independently)
    pack_rows             several samples of a causal layout in each row (--pack, beyond the paper)

Token ids come in from support/prepare.py's TokenDataset; nothing here reads files or text.
"""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

IGNORE = -100  # label of a token that is not predicted (F.cross_entropy's ignore_index)


@dataclass
class Batch:
    """One training batch, in the order the model sees it.

    idx:          (B, T) int64 input tokens (mask ids where masked, pad_id after the sample).
    position_ids: (B, T) int64 true position of every token (RoPE).
    labels:       (B, T) int64 target at each input token, IGNORE where none.
    mdm_weight:   (B, T) float32 1 / (p_mask * response length) where the label is a masked
                  token's own token (masked-diffusion loss), 0 where it is a next token
                  (autoregressive loss).
    key_mask:     (B, T) bool, False on padding: the bidirectional MDM's (a causal model's
                  padding comes last, where no query sees it), or None.
    sample_id:    (B, T) int64, packed rows only (pack_rows): the sample of each token, -1 on
                  padding; a token attends causally to its own sample's tokens. Else None.
    n_samples:    the samples of the batch (hybrid_loss's divisor), when rows hold several.
    """
    idx: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    mdm_weight: torch.Tensor
    key_mask: torch.Tensor | None = None
    sample_id: torch.Tensor | None = None
    n_samples: int | None = None

    @property
    def attn_mask(self):
        """The model's attn_mask: key_mask as (B, 1, 1, T) (every query sees every key that is not
        padding), sample_id as (B, 1, T, T) (causal within a sample), or None."""
        # packed rows: a query sees the keys of its own sample, at or before its place
        if self.sample_id is not None:
            T = self.sample_id.shape[1]
            causal = torch.ones(T, T, dtype=torch.bool, device=self.sample_id.device).tril()
            return ((self.sample_id[:, :, None] == self.sample_id[:, None, :]) & causal)[:, None]
        # the bidirectional MDM: every query sees every key but padding (a causal model's padding
        # comes last, where no query sees it: no mask)
        return None if self.key_mask is None else self.key_mask[:, None, None]


def _p_mask(batch_size, eps, generator, device):
    """p = (1 - eps) t + eps with t ~ U(0, 1): one masking probability per sample, (B,) float32."""
    # drawn on the CPU generator, so the draws do not depend on the device
    t = torch.rand(batch_size, generator=generator).to(device)
    # eps keeps p_mask above 0: the MDM loss divides by it
    return (1 - eps) * t + eps


def reorganize_slots(tokens, prompt_len, length, slot_sizes, mask_id, generator, eps=1e-3):
    """ReFusion's slot reorganization of a batch (SPEC section 3; paper section 3.1).

    tokens: (B, T) int64, each row prompt + response (ending with EOS), right-padded;
    prompt_len, length: (B,) int64 (length counts EOS, not padding). Per sample, draws the slot size
    S uniformly from slot_sizes, p_mask = (1 - eps) t + eps with t ~ U(0, 1), which slots are masked
    (each with probability p_mask) and a random order of the clean slots, then lays the batch out
    with layout_slots. All randomness comes from `generator` (a CPU torch.Generator), in that order.
    Returns a Batch of the same (B, T). No Python loop over samples.
    """
    B, T = tokens.shape
    dev = tokens.device
    # Step 1: each sample's slot size S, drawn from slot_sizes: (B,)
    pick = torch.randint(len(slot_sizes), (B,), generator=generator)
    S = torch.tensor(slot_sizes)[pick].to(dev)
    # Step 2: each sample's masking probability p_mask, never 0 (eps): (B,)
    p = _p_mask(B, eps, generator, dev)
    # (B, T) indexed by slot id (a response of <= T tokens has <= T slots): slot k masked with
    # probability p
    slot_is_masked = torch.rand(B, T, generator=generator).to(dev) < p[:, None]
    # (B, T) a random order of the slots: argsort of uniform noise lists the slot ids in a random
    # order, and argsort of that list inverts it, giving each slot k its place in that order (its
    # rank)
    slot_rank = torch.rand(B, T, generator=generator).argsort(dim=1).argsort(dim=1).to(dev)
    # Steps 3-4: the buffer, its labels and loss weights, from these draws alone.
    return layout_slots(tokens, prompt_len, length, S, p, slot_is_masked, slot_rank, mask_id)


def layout_one_sample(tokens, P, n, S, p, slot_is_masked, slot_rank, mask_id):
    """layout_slots for one sample, as a plain loop (SPEC section 3, steps 3-4): the reference the
    vectorized layout_slots must equal (test_vectorized_layout_equals_the_per_sample_loop).

    tokens: list of ids (prompt, response, padding); P: prompt length; n: prompt + response length;
    S: slot size, slot k holding response positions P + kS ...; p: p_mask; slot_is_masked and
    slot_rank: lists indexed by slot id.
    Returns (idx, position_ids, labels, mdm_weight) as lists.
    """
    # Step 3: the response cut into slots of S tokens (the last may be shorter), as true positions.
    slots = [list(range(start, min(start + S, n))) for start in range(P, n, S)]
    # The clean slots in the order of their rank (the random permutation of step 3).
    clean = sorted((k for k in range(len(slots)) if not slot_is_masked[k]),
                   key=lambda k: slot_rank[k])
    # The masked slots in their original order.
    masked = [k for k in range(len(slots)) if slot_is_masked[k]]

    # Step 4, the buffer: first the prompt, at its positions, with no labels.
    idx = tokens[:P]
    pos = list(range(P))
    labels = [IGNORE] * P
    weight = [0.0] * P
    # Then the clean slots in rank order: each token is labelled with the next token of its own
    # slot (autoregressive loss); a slot's last token has no next token inside the slot.
    for k in clean:
        for i, q in enumerate(slots[k]):
            # the clean token itself, at its true position
            idx.append(tokens[q])
            pos.append(q)
            # the next token of the same slot, if the slot has one after q
            has_next = i + 1 < len(slots[k])
            labels.append(tokens[q + 1] if has_next else IGNORE)
            # a next-token label: no MDM loss weight
            weight.append(0.0)
    # Then the masked slots: mask ids, each labelled with its own token (masked-diffusion loss),
    # weighted 1 / (p_mask * response length).
    for k in masked:
        for q in slots[k]:
            # the mask id, at the true position of the token it hides
            idx.append(mask_id)
            pos.append(q)
            # the hidden token itself, not shifted
            labels.append(tokens[q])
            weight.append(1.0 / (p * (n - P)))
    # Padding last, where no real token's causal attention reaches it; no labels.
    for q in range(n, len(tokens)):
        idx.append(tokens[q])
        pos.append(q)
        labels.append(IGNORE)
        weight.append(0.0)
    return idx, pos, labels, weight


def layout_slots(tokens, prompt_len, length, S, p, slot_is_masked, slot_rank, mask_id):
    """The deterministic half of reorganize_slots: the buffer, labels and loss weights of SPEC
    section 3, steps 3-4 (the clean slots in ascending slot_rank; every token at its true position).

    S: (B,) int64 slot size; p: (B,) float32 p_mask; slot_is_masked: (B, n) bool and slot_rank:
    (B, n) int64 (a permutation), indexed by slot id (n between the number of slots and T; T
    always suffices). The whole batch at once, no loop: every tensor is first computed in input
    (true position) order, then one sort per row lays it out in buffer order. layout_one_sample is
    the same, as a plain loop per sample. Returns a Batch of the same (B, T).
    """
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
    """--slot_end_labels (SPEC section 3, beyond the paper): the last token of every clean slot,
    and the prompt's last token, are labelled with the token at the next true position (where
    that is in the response), as every other clean token already is, so that the next-token
    pathway is trained at every position.

    batch: the Batch reorganize_slots laid out from tokens (B, T) int64, prompt_len and length
    (B,) int64, which are given here too. Returns a new Batch with those labels; nothing else
    changes, and no random number is drawn.
    """
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
    """--ar_fraction (SPEC section 3, beyond the paper): each sample takes `other`'s layout (the
    ARM's autoregressive_batch) instead of batch's with probability `fraction` (in [0, 1)), so
    that the next-token pathway keeps seeing whole contexts in natural order. One draw per sample
    from generator (a CPU torch.Generator: torch.rand(B), float32), after the layout's.
    batch, other: Batches of the same (B, T). Returns the mixed Batch.
    """
    B = batch.idx.shape[0]
    # (B, 1): which samples take the other layout, one draw each
    chosen = (torch.rand(B, generator=generator) < fraction).to(batch.idx.device)[:, None]
    # a chosen sample's row comes whole from the other layout: inputs, positions, labels, weights
    mine = (batch.idx, batch.position_ids, batch.labels, batch.mdm_weight)
    theirs = (other.idx, other.position_ids, other.labels, other.mdm_weight)
    return Batch(*(torch.where(chosen, t, m) for m, t in zip(mine, theirs)))


def autoregressive_batch(tokens, prompt_len, length):
    """The ARM baseline's batch: natural order, each token labelled with the next response token.

    tokens (B, T), prompt_len (B,), length (B,) int64 as for reorganize_slots. Returns a Batch.
    """
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
    """LLaDA's supervised fine-tuning layout for the MDM baseline (SPEC section 3): every response
    is followed by EOS up to gen_length tokens, the canvas generate_mdm fills at decoding, so that
    training and decoding see sequences of the same length. A response is never cut, and no sample
    grows past max_len positions (the model's context).

    tokens (B, T), prompt_len (B,), length (B,) int64 as get_batch_at gives them (right-padded with
    pad_id). Returns (tokens (B, T') with T' the longest new length, length (B,) int64 counting the
    EOS padding); random_mask_batch then masks, labels and attends the padding EOS like any response
    token.
    """
    # (B,) each sample's new length: its prompt and gen_length tokens, within the context, and
    # never shorter than the sample itself
    end = torch.maximum(length, (prompt_len + gen_length).clamp(max=max_len))
    # (B, T') room for the longest, pad_id after each sample
    wide = F.pad(tokens, (0, int(end.max()) - tokens.shape[1]), value=pad_id)
    # EOS from each sample's end up to its new length; pad_id after that
    pos = torch.arange(wide.shape[1], device=tokens.device)
    return torch.where((pos >= length[:, None]) & (pos < end[:, None]), eos_id, wide), end


def random_mask_batch(tokens, prompt_len, length, mask_id, generator, eps=1e-3, shift=False):
    """The MDM baseline's batch (SPEC section 3): each response token masked independently with
    p_mask.

    tokens (B, T), prompt_len (B,), length (B,) int64. Labels: a masked token's own token, weighted
    1 / (p_mask * response length), at its own position (LLaDA) or, with shift, at the position
    before it (Dream: the output at i predicts token i + 1, as the ARM it starts from did).
    key_mask hides padding from bidirectional attention. Returns a Batch.
    """
    B, T = tokens.shape
    # natural order: each token at its own position
    pos = torch.arange(T, device=tokens.device).expand(B, T)
    # (B,) each sample's p_mask, drawn before the masks
    p = _p_mask(B, eps, generator, tokens.device)
    # each response token masked with probability p_mask, independently (no slots)
    in_response = (pos >= prompt_len[:, None]) & (pos < length[:, None])
    masked = in_response & (torch.rand(B, T, generator=generator).to(tokens.device) < p[:, None])
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
    return Batch(torch.where(masked, mask_id, tokens), pos, labels, weight,
                 key_mask=pos < length[:, None])


def pack_rows(batch, length):
    """Several samples in each row (SPEC section 3, beyond the paper, opt-in: train.py's --pack):
    a causal batch's samples laid one after another into as few rows of its width T as first fit
    (longest first) finds, each token at its own position id and attending causally to its own
    sample only. The model computes each sample as it would alone, and hybrid_loss divides by the
    samples, not the rows: the loss and gradient are the unpacked batch's (up to rounding).

    batch: (B, T) from reorganize_slots or autoregressive_batch, sample i in its first length[i]
    tokens; length: (B,) int64. Returns a Batch of (R, T), R <= B, with sample_id and n_samples=B;
    padding: token 0 at position 0, no label.
    """
    B, T = batch.idx.shape
    # First fit, longest first. rows: the samples of each row; room: the tokens each has left.
    rows = []
    room = []
    for i in sorted(range(B), key=lambda i: -int(length[i])):
        # the first row with room for sample i, else a new row
        r = next((r for r, left in enumerate(room) if left >= length[i]), len(rows))
        if r == len(rows):
            rows.append([])
            room.append(T)
        rows[r].append(i)
        room[r] -= int(length[i])
    # (R, T) where each token of the packed rows comes from, as the index b * T + t into the
    # flattened batch; -1 on padding
    src = torch.full((len(rows), T), -1)
    for r, samples in enumerate(rows):
        # a row's samples one after another from its start, each its first length[i] tokens
        at = 0
        for i in samples:
            n = int(length[i])
            src[r, at:at + n] = i * T + torch.arange(n)
            at += n
    src = src.to(batch.idx.device)
    # (R, T) the sample of each token (b of b * T + t), -1 on padding
    sample_id = torch.where(src >= 0, src // T, -1)

    def take(x, fill):
        """x (B, T) laid out as the packed rows (R, T), fill on padding."""
        return torch.where(src >= 0, x.reshape(-1)[src.clamp(min=0)], fill)
    # padding: token 0 at position 0, no label, no MDM loss weight
    return Batch(take(batch.idx, 0), take(batch.position_ids, 0), take(batch.labels, IGNORE),
                 take(batch.mdm_weight, 0.0), sample_id=sample_id, n_samples=B)
