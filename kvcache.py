"""
The KV cache: preallocated keys and values of every layer, plus the few operations the ReFusion
decoder performs on it (SPEC section 4).

One tensor holds everything: (n_layer, 2, rows, n_kv_head, max_len, head_dim). Every active row
holds the same number of tokens, `length`; new keys/values are written at [length, length + T).
In a decoder's cache row 0 holds the committed buffer, so `length` is the buffer's length. Rows
beyond row 0 exist only while slots are infilled in parallel: each row is then one slot, sharing
the committed prefix. They are allocated when an infill first needs that many (up to max_batch), not
up front, so memory follows the rows a decode uses, not the slots it could use.

Few attention shapes. A GPU's attention kernels (cuDNN's on Hopper) build a plan for every shape
and stride they meet, which costs far more than a small model's pass. So a pass attends to a key
length rounded up to a multiple of KEY_BUCKET, the keys past the cached and new tokens masked, and
the decoders size a cache by cache_length, so that prompts of many lengths share one tensor shape
(and so the same strides). A decode then feeds the attention a few shapes, not one per pass.

The model/cache contract. Two protocols name what each side may call, and every implementation is
tested against them (tests/test_model.py):

    LayerCache   what Transformer.forward calls on the kv_cache it is given: update in every
                 layer, advance after the last, attention_mask when it is given no mask
                 (KVCache; support/batching.py's BatchedCache; support/compiled.py's NewKeys,
                 which is always given a mask)
    DecodeCache  what a decoder calls on the cache model.new_kv_cache returns (KVCache)

and model.py's DecoderModel names what a decoder calls on a model.
"""

from typing import Protocol

import torch

KEY_BUCKET = 64     # a pass attends to a multiple of this many keys (the extra ones masked)
CACHE_BUCKET = 256  # the decoders' caches hold a multiple of this many tokens (cache_length)


WIDE = 32           # bucket(T): a pass of more tokens keeps its width


def bucket(T):
    """The width a pass of T new tokens is padded to where padding is free (a GPU's eager passes,
    every compiled pass): 1 for 1, the next power of two from 8 up to WIDE, T itself above."""
    # one token (next-token decoding's pass) stays one: its kernels differ from a wide pass's
    if T == 1:
        return 1
    # past WIDE a pass costs its tokens even on a GPU: padding would only add work
    if T > WIDE:
        return T
    # the next power of two, at least 8: widths 8, 16, 32
    return max(8, 1 << (T - 1).bit_length())


def round_up(n, multiple):
    """The least multiple of `multiple` that is >= n (n, multiple: int >= 1)."""
    return -(-n // multiple) * multiple


def cache_length(n, context):
    """The tokens a decoder's cache holds for n tokens: n rounded up to a multiple of
    CACHE_BUCKET, but never past the model's context (nor below n): prompts of similar lengths
    share a shape."""
    # rounding up may not pass the context; a prompt already past it keeps its own length
    return max(n, min(round_up(n, CACHE_BUCKET), context))


def causal_mask(P, T, device, L=None):
    """(1, 1, T, L) bool: query i of T new tokens, after P cached ones, sees keys 0..P + i; the
    keys from P + T on (up to L, by default P + T) are seen by none."""
    # new token i sits at key index P + i: it sees every key up to and including itself
    q_idx = torch.arange(T, device=device)[:, None]
    k_idx = torch.arange(P + T if L is None else L, device=device)[None, :]
    return (k_idx <= P + q_idx)[None, None]


class KVCache:
    """Keys/values for `batch` rows of `length` tokens each (a DecodeCache).

    kv: (n_layer, 2, rows, n_kv_head, max_len, head_dim), dtype and device of the model, with rows
    (1 at first) growing up to max_batch as repeat_prefix asks for them.
    batch: number of active rows (1 outside parallel infill). length: tokens held in every row.
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
        self.n_layer = n_layer
        self.max_batch = max_batch
        self.max_len = max_len
        self.batch = 1           # active rows
        self.length = 0          # tokens held in every active row
        # the first token whose keys/values a copy of this cache made before may lack (tokens
        # [0, changed_from) are unchanged since): support/batching.py keeps such a copy
        self.changed_from = 0
        self.cache_bytes = self.kv.numel() * self.kv.element_size()

    def key_length(self, T):
        """The keys a pass of T new tokens attends to: length + T rounded up to a multiple of
        KEY_BUCKET (at most max_len). The keys past length + T are masked (attention_mask)."""
        return min(round_up(self.length + T, KEY_BUCKET), self.max_len)

    def attention_mask(self, T):
        """(1, 1, T, key_length(T)) bool: the T new tokens see every cached key and each other
        causally, and none of the keys past them."""
        return causal_mask(self.length, T, self.kv.device, self.key_length(T))

    def update(self, layer, k, v):
        """Write the new keys/values of one layer after the cached ones (called by the model).

        k, v: (batch, n_kv_head, T, head_dim). Returns (k_all, v_all): (batch, n_kv_head,
        key_length(T), head_dim) views of cached + new, then the unused keys up to the bucket's end
        (attention_mask hides them). `length` moves on only in `advance`, after the last layer.
        Raises ValueError when the batch differs from the active rows or max_len would be exceeded.
        """
        B, _, T, _ = k.shape
        self.check_room(B, T)
        # a copy of this cache (support/batching.py) lacks what is written from here on
        self.changed_from = min(self.changed_from, self.length)
        # the new keys/values go right after the cached ones, in every active row
        self.kv[layer, 0, :B, :, self.length:self.length + T] = k
        self.kv[layer, 1, :B, :, self.length:self.length + T] = v
        # the views the attention reads: cached, new, then unused keys up to the bucket's end
        L = self.key_length(T)
        return self.kv[layer, 0, :B, :, :L], self.kv[layer, 1, :B, :, :L]

    def check_room(self, B, T):
        """Raise ValueError unless B is the active rows and T more tokens fit in max_len."""
        if B != self.batch:
            raise ValueError(f"cache has {self.batch} active rows but the input has batch {B}")
        if self.length + T > self.max_len:
            raise ValueError(f"KV cache overflow: {self.length} cached + {T} new "
                             f"> max_len={self.max_len}")

    def advance(self, T):
        """Count T tokens as appended to every active row (the model calls this after its last
        layer)."""
        self.length += T

    def crop(self, length):
        """Forget everything after the first `length` tokens (e.g. the keys/values of masks)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} tokens to {length}")
        # nothing is erased: the next update writes over the forgotten keys/values
        self.length = length

    def repeat_prefix(self, k):
        """Fan row 0 out into k rows that share its tokens (a row per slot infilled in parallel)."""
        if not 1 <= k <= self.max_batch:
            raise ValueError(f"cannot repeat into {k} rows: the cache was built for "
                             f"max_batch={self.max_batch}")
        # more rows than ever before: allocate them (memory follows the rows a decode uses)
        if k > self.kv.shape[2]:
            more = self.kv.new_zeros(*self.kv.shape[:2], k - self.kv.shape[2], *self.kv.shape[3:])
            self.kv = torch.cat([self.kv, more], dim=2)
            self.cache_bytes = max(self.cache_bytes, self.kv.numel() * self.kv.element_size())
        # every row starts as a copy of row 0: the committed buffer each slot's row builds on
        self.kv[:, :, 1:k, :, :self.length] = self.kv[:, :, :1, :, :self.length]
        self.batch = k
        self.changed_from = 0

    def keep_rows(self, n):
        """Keep only the first n active rows (an infill's rows up to its EOS row): nothing moves."""
        if not 1 <= n <= self.batch:
            raise ValueError(f"cannot keep {n} of the {self.batch} active rows")
        # the rows kept are the first n, where they already are: only the count changes
        self.batch = n

    def commit_rows(self, segments, start):
        """Lay segments of several rows one after another into row 0, from token `start` on.

        segments: list of (row, length): tokens [start, start + length) of that row, in the order
        they are to be committed. Afterwards the cache has one row of start + sum(lengths) tokens.
        Used by the commit step: each infilled slot's keys/values were computed in its own row,
        seeing the shared prefix [0, start) and itself (SPEC section 4, step 4).
        """
        # every segment must lie within the active rows and the tokens they hold
        if any(row >= self.batch or start + n > self.length for row, n in segments):
            raise ValueError(f"segments {segments} from {start} exceed the cache "
                             f"({self.batch} rows x {self.length})")
        # Gather first: row 0's own segment may be read after other rows have been written over it.
        gathered = torch.cat([self.kv[:, :, row, :, start:start + n] for row, n in segments],
                             dim=-2)
        # then written into row 0 after the shared prefix: one row, the buffer grown by them
        end = start + gathered.shape[-2]
        self.kv[:, :, 0, :, start:end] = gathered
        self.batch = 1
        self.length = end
        self.changed_from = min(self.changed_from, start)


class LayerCache(Protocol):
    """What Transformer.forward calls on the kv_cache it is given (module doc)."""

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """Take one layer's new keys/values (B, n_kv_head, T, head_dim); return (keys, values)
        the layer's queries attend to, cached and new: (B, n_kv_head, L, head_dim)."""

    def advance(self, T: int) -> None:
        """After the last layer: the pass's T tokens are now held."""

    def attention_mask(self, T: int) -> torch.Tensor:
        """(B or 1, 1, T, L) bool, who sees whom, for a pass given no mask of its own."""


class DecodeCache(LayerCache, Protocol):
    """What a decoder calls on the cache model.new_kv_cache returns (SPEC section 4): KVCache's
    attributes and operations, each documented there."""
    kv: torch.Tensor
    length: int
    max_len: int
    batch: int
    cache_bytes: int
    changed_from: int

    def key_length(self, T: int) -> int: ...
    def check_room(self, B: int, T: int) -> None: ...
    def crop(self, length: int) -> None: ...
    def repeat_prefix(self, k: int) -> None: ...
    def keep_rows(self, n: int) -> None: ...
    def commit_rows(self, segments: list, start: int) -> None: ...
