"""
The KV cache: preallocated keys and values of every layer, plus the few operations the ReFusion
decoder performs on it (SPEC section 4).

One tensor holds everything: (n_layer, 2, rows, n_kv_head, max_len, head_dim). Every active row
holds the same number of tokens, `pos`; new keys/values are written at [pos, pos + T). Rows beyond
row 0 exist only while slots are infilled in parallel: each row is then one slot, sharing the
committed prefix. They are allocated when an infill first needs that many (up to max_batch), not
up front, so memory follows the rows a decode uses, not the slots it could use.

Few attention shapes. A GPU's attention kernels (cuDNN's on Hopper) build a plan for every shape
and stride they meet, which costs far more than a small model's pass. So a pass attends to a key
length rounded up to a multiple of KEY_BUCKET, the keys past the cached and new tokens masked, and
the decoders size a cache by cache_length, so that prompts of many lengths share one tensor shape
(and so the same strides). A decode then feeds the attention a few shapes, not one per pass.
"""

import torch

KEY_BUCKET = 64     # a pass attends to a multiple of this many keys (the extra ones masked)
CACHE_BUCKET = 256  # the decoders' caches hold a multiple of this many tokens (cache_length)


WIDE = 32           # bucket(T): a pass of more tokens keeps its width


def bucket(T):
    """The width a pass of T new tokens is padded to where padding is free (a GPU's eager passes,
    every compiled pass): 1 for 1, the next power of two from 8 up to WIDE, T itself above."""
    return 1 if T == 1 else T if T > WIDE else max(8, 1 << (T - 1).bit_length())


def round_up(n, multiple):
    """The least multiple of `multiple` that is >= n (n, multiple: int >= 1)."""
    return -(-n // multiple) * multiple


def cache_length(n, context):
    """The tokens a decoder's cache holds for n tokens: n rounded up to a multiple of
    CACHE_BUCKET, but never past the model's context (nor below n): prompts of similar lengths
    share a shape."""
    return max(n, min(round_up(n, CACHE_BUCKET), context))


def causal_mask(P, T, device, L=None):
    """(1, 1, T, L) bool: query i of T new tokens, after P cached ones, sees keys 0..P + i; the
    keys from P + T on (up to L, by default P + T) are seen by none."""
    q_idx = torch.arange(T, device=device)[:, None]
    k_idx = torch.arange(P + T if L is None else L, device=device)[None, :]
    return (k_idx <= P + q_idx)[None, None]


class KVCache:
    """Keys/values for `batch` rows of `pos` tokens each.

    kv: (n_layer, 2, rows, n_kv_head, max_len, head_dim), dtype and device of the model, with rows
    (1 at first) growing up to max_batch as repeat_prefix asks for them.
    batch: number of active rows (1 outside parallel infill). pos: tokens held in every row.
    cache_bytes: the most bytes kv has held.
    """

    def __init__(self, n_layer, n_kv_head, head_dim, max_len, max_batch=1, dtype=torch.float32,
                 device="cpu", kv=None):
        """kv: optional, a tensor of that shape to hold the cache in, its rows allocated already
        (support/compiled.py keeps one for every decode: a CUDA graph reads it where it was
        recorded); else one row is allocated, zeroed."""
        if kv is None:
            kv = torch.zeros(n_layer, 2, 1, n_kv_head, max_len, head_dim, dtype=dtype,
                             device=device)
        self.kv = kv
        self.n_layer, self.max_batch, self.max_len = n_layer, max_batch, max_len
        self.batch, self.pos = 1, 0
        # the first token whose keys/values a copy of this cache made before may lack (tokens
        # [0, changed_from) are unchanged since): support/batching.py keeps such a copy
        self.changed_from = 0
        self.cache_bytes = self.kv.numel() * self.kv.element_size()

    def key_length(self, T):
        """The keys a pass of T new tokens attends to: pos + T rounded up to a multiple of
        KEY_BUCKET (at most max_len). The keys past pos + T are masked (attention_mask)."""
        return min(round_up(self.pos + T, KEY_BUCKET), self.max_len)

    def attention_mask(self, T):
        """(1, 1, T, key_length(T)) bool: the T new tokens see every cached key and each other
        causally, and none of the keys past them."""
        return causal_mask(self.pos, T, self.kv.device, self.key_length(T))

    def update(self, layer, k, v):
        """Write the new keys/values of one layer after the cached ones (called by the model).

        k, v: (batch, n_kv_head, T, head_dim). Returns (k_all, v_all): (batch, n_kv_head,
        key_length(T), head_dim) views of cached + new, then the unused keys up to the bucket's end
        (attention_mask hides them). `pos` moves on only in `advance`, after the last layer.
        Raises ValueError when the batch differs from the active rows or max_len would be exceeded.
        """
        B, _, T, _ = k.shape
        self.check_room(B, T)
        self.changed_from = min(self.changed_from, self.pos)
        self.kv[layer, 0, :B, :, self.pos:self.pos + T] = k
        self.kv[layer, 1, :B, :, self.pos:self.pos + T] = v
        L = self.key_length(T)
        return self.kv[layer, 0, :B, :, :L], self.kv[layer, 1, :B, :, :L]

    def check_room(self, B, T):
        """Raise ValueError unless B is the active rows and T more tokens fit in max_len."""
        if B != self.batch:
            raise ValueError(f"cache has {self.batch} active rows but the input has batch {B}")
        if self.pos + T > self.max_len:
            raise ValueError(f"KV cache overflow: {self.pos} cached + {T} new "
                             f"> max_len={self.max_len}")

    def advance(self, n):
        """Count n tokens as appended to every active row (the model calls this after its last
        layer)."""
        self.pos += n

    def crop(self, length):
        """Forget everything after the first `length` tokens (e.g. the keys/values of masks)."""
        if not 0 <= length <= self.pos:
            raise ValueError(f"cannot crop a cache of {self.pos} tokens to {length}")
        self.pos = length

    def repeat_prefix(self, k):
        """Fan row 0 out into k rows that share its tokens (a row per slot infilled in parallel)."""
        if not 1 <= k <= self.max_batch:
            raise ValueError(f"cannot repeat into {k} rows: the cache was built for "
                             f"max_batch={self.max_batch}")
        if k > self.kv.shape[2]:                  # more rows than ever before: allocate them
            more = self.kv.new_zeros(*self.kv.shape[:2], k - self.kv.shape[2], *self.kv.shape[3:])
            self.kv = torch.cat([self.kv, more], dim=2)
            self.cache_bytes = max(self.cache_bytes, self.kv.numel() * self.kv.element_size())
        self.kv[:, :, 1:k, :, :self.pos] = self.kv[:, :, :1, :, :self.pos]
        self.batch = k
        self.changed_from = 0

    def keep_rows(self, n):
        """Keep only the first n active rows (an infill's rows up to its EOS row): nothing moves."""
        if not 1 <= n <= self.batch:
            raise ValueError(f"cannot keep {n} of the {self.batch} active rows")
        self.batch = n

    def commit_rows(self, segments, start):
        """Lay segments of several rows one after another into row 0, from token `start` on.

        segments: list of (row, length): tokens [start, start + length) of that row, in the order
        they are to be committed. Afterwards the cache has one row of start + sum(lengths) tokens.
        Used by the commit step: each infilled slot's keys/values were computed in its own row,
        seeing the shared prefix [0, start) and itself (SPEC section 4, step 4).
        """
        if any(row >= self.batch or start + n > self.pos for row, n in segments):
            raise ValueError(f"segments {segments} from {start} exceed the cache "
                             f"({self.batch} rows x {self.pos})")
        # Gather first: row 0's own segment may be read after other rows have been written over it.
        gathered = torch.cat([self.kv[:, :, row, :, start:start + n] for row, n in segments],
                             dim=-2)
        end = start + gathered.shape[-2]
        self.kv[:, :, 0, :, start:end] = gathered
        self.batch, self.pos = 1, end
        self.changed_from = min(self.changed_from, start)
