"""
The KV cache of a decode (SPEC section 4): row 0 the committed buffer, a row a slot while slots are
infilled, and the decoder's operations on it. LayerCache and DecodeCache name what each side calls.
"""

from typing import Protocol

import torch

# Few attention shapes (SPEC section 4.4): a GPU's attention kernels (cuDNN's on Hopper) build a
# plan for every shape and stride they meet, which costs far more than a small model's pass, so key
# lengths and cache sizes are rounded up and prompts of similar lengths share them.
KEY_BUCKET = 64     # a pass attends to a multiple of this many keys (the extra ones masked)
CACHE_BUCKET = 256  # the decoders' caches hold a multiple of this many tokens (cache_length)


def round_up(n, multiple):
    """The least multiple of `multiple` that is >= n (n, multiple: int >= 1)."""
    return -(-n // multiple) * multiple


def cache_length(n, context):
    """The tokens a decoder's cache holds for n tokens: n rounded up to CACHE_BUCKET, <= context."""
    # rounding up may not pass the context; a prompt already past it keeps its own length
    return max(n, min(round_up(n, CACHE_BUCKET), context))


def causal_mask(P, T, device, L=None):
    """(1, 1, T, L) bool, L = P + T by default: new token i after P cached ones sees keys <= P+i."""
    # new token i sits at key index P + i: it sees every key up to and including itself
    q_idx = torch.arange(T, device=device)[:, None]
    k_idx = torch.arange(P + T if L is None else L, device=device)[None, :]
    return (k_idx <= P + q_idx)[None, None]


class KVCache:
    """Keys/values of `batch` active rows of `length` tokens each (a DecodeCache). kv: (n_layer,
    2, rows, n_kv_head, max_len, head_dim), rows up to max_batch; cache_bytes: the most it held."""

    def __init__(self, n_layer, n_kv_head, head_dim, max_len, max_batch=1, dtype=torch.float32,
                 device="cpu", kv=None):
        # kv given: a tensor whose rows are allocated already (support/compiled.py keeps one for
        # every decode: a CUDA graph reads it where it was recorded); else one row, zeroed
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
        """The keys a pass of T new tokens attends to: length + T rounded up to KEY_BUCKET."""
        return min(round_up(self.length + T, KEY_BUCKET), self.max_len)

    def attention_mask(self, T):
        """(1, 1, T, key_length(T)) bool: every cached key, then causal (causal_mask)."""
        return causal_mask(self.length, T, self.kv.device, self.key_length(T))

    def update(self, layer, k, v):
        """Write one layer's k, v: (batch, n_kv_head, T, head_dim) after the cached ones. Returns
        the keys, values to attend (key_length(T) of each row). Raises ValueError (check_room)."""
        B, _, T, _ = k.shape
        self.check_room(B, T)
        # a copy of this cache (support/batching.py) lacks what is written from here on; length
        # itself moves on in advance, after the last layer
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
        """Count T tokens as appended to every active row (after the model's last layer)."""
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
        """Lay segments, (row, n) each: tokens [start, start + n) of that row, one after another
        into row 0 from start on, leaving one row (SPEC section 4, step 4)."""
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


# The model/cache contract, every implementation tested against it (tests/test_model.py): a
# LayerCache is KVCache, support/batching.py's BatchedCache or support/compiled.py's NewKeys (always
# given a mask); a DecodeCache is KVCache.


class LayerCache(Protocol):
    """What Transformer.forward calls on its kv_cache, as KVCache does (each documented there)."""

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple: ...
    def advance(self, T: int) -> None: ...
    def attention_mask(self, T: int) -> torch.Tensor: ...


class DecodeCache(LayerCache, Protocol):
    """What a decoder calls on model.new_kv_cache()'s cache: KVCache's attributes and operations."""
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
