"""
The KV cache: preallocated keys and values of every layer, plus the few operations the ReFusion
decoder performs on it (SPEC section 4).

One tensor holds everything: (n_layer, 2, rows, n_kv_head, max_len, head_dim). Every active row
holds the same number of tokens, `pos`; new keys/values are written at [pos, pos + T). Rows beyond
row 0 exist only while slots are infilled in parallel: each row is then one slot, sharing the
committed prefix. They are allocated when an infill first needs that many (up to max_batch), not
up front, so memory follows the rows a decode uses, not the slots it could use.
"""

import torch


def causal_mask(P, T, device):
    """(1, 1, T, P + T) bool: query i of T new tokens, after P cached ones, sees keys 0..P + i."""
    q_idx = torch.arange(T, device=device)[:, None]
    k_idx = torch.arange(P + T, device=device)[None, :]
    return (k_idx <= P + q_idx)[None, None]


class KVCache:
    """Keys/values for `batch` rows of `pos` tokens each.

    kv: (n_layer, 2, rows, n_kv_head, max_len, head_dim), dtype and device of the model, with rows
    (1 at first) growing up to max_batch as repeat_prefix asks for them.
    batch: number of active rows (1 outside parallel infill). pos: tokens held in every row.
    cache_bytes: the most bytes kv has held.
    """

    def __init__(self, n_layer, n_kv_head, head_dim, max_len, max_batch=1, dtype=torch.float32,
                 device="cpu"):
        self.kv = torch.zeros(n_layer, 2, 1, n_kv_head, max_len, head_dim, dtype=dtype,
                              device=device)
        self.n_layer, self.max_batch, self.max_len = n_layer, max_batch, max_len
        self.batch, self.pos = 1, 0
        self.cache_bytes = self.kv.numel() * self.kv.element_size()

    def update(self, layer, k, v):
        """Write the new keys/values of one layer after the cached ones (called by the model).

        k, v: (batch, n_kv_head, T, head_dim). Returns (k_all, v_all): (batch, n_kv_head, pos + T,
        head_dim) views of cached + new. `pos` moves on only in `advance`, after the last layer.
        Raises ValueError when the batch differs from the active rows or max_len would be exceeded.
        """
        B, _, T, _ = k.shape
        self.check_room(B, T)
        self.kv[layer, 0, :B, :, self.pos:self.pos + T] = k
        self.kv[layer, 1, :B, :, self.pos:self.pos + T] = v
        return self.kv[layer, 0, :B, :, :self.pos + T], self.kv[layer, 1, :B, :, :self.pos + T]

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

    def keep_rows(self, rows):
        """Keep only the given active rows (list of int, in that order) as rows 0..len(rows)-1."""
        if not rows or max(rows) >= self.batch:
            raise ValueError(f"rows {rows} are not a non-empty subset of the {self.batch} active "
                             "rows")
        self.kv[:, :, :len(rows)] = self.kv[:, :, rows]
        self.batch = len(rows)

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
