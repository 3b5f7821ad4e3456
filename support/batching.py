"""
Many prompts at once (SPEC section 4.2, opt-in: --batch_size): each prompt runs sampler.py's
one-prompt decoder in its own thread, on a BatchedModel, and the passes they wait for run together.

    generate_batch(model, decode, prompts, batch_size)   the Generations, in prompt order
    decode_together                                      one batch: a thread per prompt
    forward_batch, pad_passes, padded_pass               the passes they wait for, together
    BatchedCache                                         their KV caches side by side, padded
"""

import math
import queue
import threading

import torch
import torch.nn.functional as F

from kvcache import KEY_BUCKET, round_up


CPU_PAD = 0.125  # the share of padding a pass may compute on a CPU, where it costs about its tokens


def generate_batch(model, decode, prompts, batch_size, generators=None, forwards=None, pad=None):
    """Decode prompts (token-id lists) batch_size at a time with the one-prompt decoder `decode`
    (sampler.make_decoder's), the forward passes they wait for run together (SPEC section 4.2).
    generators: a torch.Generator per prompt, or None for decode's. forwards: optional list; each
    pass appends the indexes of the prompts it carried. pad: forward_batch's; None: inf on a GPU,
    CPU_PAD elsewhere. Returns the Generations in prompt order, their seconds each prompt's latency
    in its batch. Raises ValueError for batch_size < 1, and the first error a decode raised. The
    process's intra-op thread count is left as it was, however the batches end."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: decode at least one prompt at a time")
    generators = generators or [None] * len(prompts)
    if pad is None:
        pad = math.inf if next(model.parameters()).device.type == "cuda" else CPU_PAD
    out = []
    threads = torch.get_num_threads()
    try:
        for b in range(0, len(prompts), batch_size):
            chunk = range(b, min(b + batch_size, len(prompts)))
            log = [] if forwards is not None else None
            out += decode_together(model, decode, [prompts[i] for i in chunk],
                                   [generators[i] for i in chunk], log, pad)
            if log is not None:
                forwards += [[b + i for i in carried] for carried in log]
    finally:
        # the prompts' threads set one intra-op thread (decode_together), which every thread the
        # process starts later would inherit, and MKL's count with it: set back here
        torch.set_num_threads(threads)
    return out


class BatchedModel:
    """The model as one prompt's decoder sees it in a batch: its config and caches, but each
    forward pass is posted to the batch's inbox, and waits for its logits."""

    def __init__(self, model, inbox, index):
        self.config, self.new_kv_cache, self.parameters = (model.config, model.new_kv_cache,
                                                           model.parameters)
        self.inbox, self.index, self.replies = inbox, index, queue.SimpleQueue()

    def __call__(self, idx, position_ids, kv_cache=None, attn_mask=None, logits_from=0):
        if attn_mask is not None:
            raise ValueError("a batched pass takes no attention mask: batching serves the cached "
                             "decoders (generate_refusion, generate_next_token)")
        self.inbox.put((self.index, "forward", (idx, position_ids, kv_cache, logits_from)))
        reply = self.replies.get()
        if isinstance(reply, BaseException):
            raise reply
        return reply


class BatchAborted(Exception):
    """Raised in a prompt's decode when another prompt of its batch failed."""


def decode_together(model, decode, prompts, generators, forwards, pad):
    """One batch of generate_batch: a thread per prompt, taking turns (one runs until its next
    forward pass or its end), and this loop running their passes. Returns their Generations in
    order; raises the first error one of them raised."""
    inbox = queue.SimpleQueue()
    proxies = [BatchedModel(model, inbox, i) for i in range(len(prompts))]

    def work(i):
        # one intra-op thread: a thread that ran an OpenMP operation keeps its team spinning on the
        # cores the batched pass needs (2 AVX512 cores, next-token decoding at batch 4: 2.1x as
        # long); the batched passes run in the calling thread, with its own thread count
        torch.set_num_threads(1)
        try:
            gen = {} if generators[i] is None else {"generator": generators[i]}
            inbox.put((i, "done", decode(proxies[i], prompts[i], **gen)))
        except BaseException as e:  # handed to the loop, which raises it
            inbox.put((i, "error", e))

    requests, results, error = {}, [None] * len(prompts), None
    kept = {}  # the batch's caches side by side, from pass to pass (padded_pass)

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
                passes = []
                replies = dict(zip(waiting, forward_batch(model, [requests[j] for j in waiting],
                                                          pad, passes, kept)))
                if forwards is not None:
                    forwards += [[waiting[k] for k in carried] for carried in passes]
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


def forward_batch(model, requests, pad=math.inf, passes=None, kept=None):
    """The forward passes several prompts asked for, run together in the passes pad_passes forms (a
    request alone in its pass on its own cache). requests: as padded_pass's. pad: the share of
    padding a pass may compute (inf: one padded pass per kind; 0: none). passes: optional list;
    each pass appends the indexes of the requests it carried. kept: padded_pass's, or None.
    Returns the logits of each request, in order."""
    out = [None] * len(requests)
    for members in pad_passes(requests, pad):
        members = sorted(members)  # in the requests' order: a kept BatchedCache's rows stay put
        if len(members) == 1:
            with torch.inference_mode():
                idx, positions, cache, first = requests[members[0]]
                out[members[0]] = model(idx, positions, kv_cache=cache, logits_from=first)
        else:
            group = [requests[i] for i in members]
            for i, logits in zip(members, padded_pass(model, group, kept)):
                out[i] = logits
        if passes is not None:
            passes.append(members)
    return out


def pad_passes(requests, pad):
    """The indexes of the requests each pass runs (forward_batch): per kind, the requests in order
    of new tokens, a pass closed when the next one would make rows x T exceed (1 + pad) x the sum
    of rows_i x T_i."""
    out = []
    for cached in (True, False):
        kind = [i for i, r in enumerate(requests) if (r[2] is not None) == cached]
        members, rows, real = [], 0, 0
        for i in sorted(kind, key=lambda i: requests[i][0].shape[1]):
            R, T = requests[i][0].shape
            if members and (rows + R) * T > (1 + pad) * (real + R * T):
                out.append(members)
                members, rows, real = [], 0, 0
            members, rows, real = members + [i], rows + R, real + R * T
        out += [members] if members else []
    return out


def kept_cache(caches, lengths, T, kept):
    """The BatchedCache for a pass of these caches, laid out for it: the one in `kept` where the
    pass fits, else a new one, kept in place of any other holding one of them (so that a cache's
    changed_from speaks of its one copy). kept: dict, BatchedCache.key -> BatchedCache, or None."""
    key = BatchedCache.key(caches)
    cache = (kept or {}).get(key)
    if cache is None or not cache.start_pass(lengths, T):
        cache = BatchedCache(caches, max(c.max_len for c in caches) + T)
        cache.start_pass(lengths, T)
        if kept is not None:
            ids = {id(c) for c in caches}
            for other in [k for k in kept if ids & {i for i, _ in k}]:
                del kept[other]
            kept[key] = cache
    return cache


@torch.inference_mode()
def padded_pass(model, requests, kept=None):
    """One padded forward pass for several prompts' requests: a list of (idx (R_i, T_i) int64,
    position_ids (R_i, T_i) int64, KVCache or None, logits_from f_i), all cached or all not. Rows
    are padded to the longest T_i; cached rows attend through a BatchedCache (kept_cache), uncached
    ones to every key but the padding. Returns each request's logits (R_i, T_i - f_i, V) float32,
    views of one tensor. Raises ValueError for a mix of cached and uncached requests."""
    T = max(r[0].shape[1] for r in requests)
    starts = [r[3] % r[0].shape[1] for r in requests]  # logits_from -1: the last token
    first = min(starts)
    idx = torch.cat([F.pad(r[0], (0, T - r[0].shape[1])) for r in requests])
    positions = torch.cat([F.pad(r[1], (0, T - r[1].shape[1])) for r in requests])
    lengths = [r[0].shape[1] for r in requests]
    caches = [r[2] for r in requests]
    if all(c is not None for c in caches):
        cache = kept_cache(caches, lengths, T, kept)
        logits = model(idx, positions, kv_cache=cache, attn_mask=cache.attention_mask(T),
                       logits_from=first)
    elif all(c is None for c in caches):  # the MDM's bidirectional passes
        mask = None
        if min(lengths) < T:  # (rows, 1, 1, T): every key of the row's own tokens
            row_lengths = torch.tensor([n for r, n in zip(requests, lengths)
                                        for _ in range(r[0].shape[0])], device=idx.device)
            mask = (torch.arange(T, device=idx.device)[None] < row_lengths[:, None])[:, None, None]
        logits = model(idx, positions, attn_mask=mask, logits_from=first)
    else:
        raise ValueError("a batch mixes forward passes with and without a KV cache")
    out, r0 = [], 0
    for r, n, f in zip(requests, lengths, starts):
        out.append(logits[r0:r0 + r[0].shape[0], f - first:n - first])
        r0 += r[0].shape[0]
    return out


class BatchedCache:
    """Several prompts' KVCaches side by side, kept from pass to pass while the same caches (with
    the same rows) run together, each pass copying in only what a cache changed since
    (KVCache.changed_from). caches: cache i with R_i rows and P_i tokens; max_len: a row's tokens.
    kv: (n_layer, 2, sum R_i, n_kv_head, max_len, head_dim), cache i's tokens at [0, P_i). A pass
    writes its T new tokens at [length, length + T), length = max P_i, the keys between masked;
    advance moves each cache's T_i real ones to [P_i, P_i + T_i), here and in the cache."""

    def __init__(self, caches, max_len):
        self.caches = caches
        self.max_len = max_len
        self.first_row = [0]
        for c in caches:
            self.first_row.append(self.first_row[-1] + c.batch)
        self.batch = self.first_row[-1]
        n_layer, _, _, n_kv_head, _, head_dim = caches[0].kv.shape
        self.kv = caches[0].kv.new_zeros(n_layer, 2, self.batch, n_kv_head, max_len, head_dim)
        for c in caches:
            c.changed_from = 0                 # nothing of it is here yet

    @staticmethod
    def key(caches):
        """What a kept BatchedCache serves: the same caches, in order, each with the same rows."""
        return tuple((id(c), c.batch) for c in caches)

    def start_pass(self, lengths, T):
        """Lay out a pass of T new tokens per row, cache i's first lengths[i] of them real: copy
        in what each cache changed since the last pass. Returns False when the pass does not fit
        in max_len tokens (a new BatchedCache is then needed)."""
        self.length = max(c.length for c in self.caches)
        if self.length + T > self.max_len:
            return False
        for c, r0, r1 in zip(self.caches, self.first_row, self.first_row[1:]):
            if c.changed_from < c.length:
                changed = slice(c.changed_from, c.length)
                self.kv[:, :, r0:r1, :, changed] = c.kv[:, :, :c.batch, :, changed]
            c.changed_from = c.length
        self.lengths = lengths
        device = self.kv.device
        self.cached = torch.cat([torch.full((c.batch,), c.length, device=device)
                                 for c in self.caches])
        return True

    def key_length(self, T):
        """length + T rounded up to a multiple of KEY_BUCKET, at most max_len (KVCache's)."""
        return min(round_up(self.length + T, KEY_BUCKET), self.max_len)

    def attention_mask(self, T):
        """(batch, 1, T, key_length(T)) bool: query t of a row sees the row's own cached keys and
        new keys length..length + t. (A padded query sees keys too, so its ignored output stays
        finite.)"""
        k_idx = torch.arange(self.key_length(T), device=self.kv.device)[None, None, :]
        q_idx = torch.arange(T, device=self.kv.device)[None, :, None]
        own = k_idx < self.cached[:, None, None]
        new = (k_idx >= self.length) & (k_idx <= self.length + q_idx)
        return (own | new)[:, None]

    def update(self, layer, k, v):
        """As KVCache.update: k, v (batch, n_kv_head, T, head_dim) -> (batch, n_kv_head,
        key_length(T), head_dim) views of cached + new."""
        T = k.shape[2]
        self.kv[layer, 0, :, :, self.length:self.length + T] = k
        self.kv[layer, 1, :, :, self.length:self.length + T] = v
        L = self.key_length(T)
        return self.kv[layer, 0, :, :, :L], self.kv[layer, 1, :, :, :L]

    def advance(self, T):
        """Append each cache's own new tokens (its first T_i of the T) to it, and move them here
        to where the cache holds them."""
        for c, n, r0, r1 in zip(self.caches, self.lengths, self.first_row, self.first_row[1:]):
            c.check_room(r1 - r0, n)
            new = self.kv[:, :, r0:r1, :, self.length:self.length + n]
            c.kv[:, :, :r1 - r0, :, c.length:c.length + n] = new
            if c.length < self.length:              # a copy first: the two places may overlap
                self.kv[:, :, r0:r1, :, c.length:c.length + n] = new.clone()
            c.advance(n)
            c.changed_from = c.length            # here as in the cache


def prompt_generator(device, seed, i):
    """Prompt i's random stream: a torch.Generator on device seeded with seed + i, so a sample
    depends on no other decode and seed s decodes the first prompt as Generator().manual_seed(s)."""
    return torch.Generator(device).manual_seed(seed + i)
