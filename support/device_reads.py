"""
What a decode would make a GPU wait for, counted on any device, the CPU too (SPEC 4.4).

    with DecodeCounter() as seen:       # around one decode or many
        for prompt in prompts:
            seen.new_decode()
            decode(model, prompt)
    seen.reads          the reads from the device (int(t), t.item(), nonzero, boolean indexing,
                        tolist): a Counter of the operations that made them
    seen.made           tensors made from Python data after a decode's first pass (its prefill)
    seen.shapes         the distinct attention calls: (query, key and mask shapes, key strides)
    seen.passes         forward passes seen
"""

import collections

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# the operations that read from the device, as a dispatch mode sees them (under inference mode a
# value's read is `item` or `is_nonzero`, elsewhere `_local_scalar_dense`)
READS = {aten._local_scalar_dense.default: "a value", aten.item.default: "a value",
         aten.is_nonzero.default: "a value", aten.nonzero.default: "nonzero"}


class DecodeCounter(TorchDispatchMode):
    """Counts reads from the device, tensors made from Python data and attention shapes (module
    docstring); a pass where it starts, at its token embedding."""

    def __init__(self):
        super().__init__()
        self.reads, self.passes, self.made = collections.Counter(), 0, 0
        self.shapes = set()
        self.start = 0  # the passes seen before the current decode

    def new_decode(self):
        """A decode starts: its tensors made before its first pass ends (the prefill's) are free."""
        self.start = self.passes

    def __enter__(self):
        self._sdpa, self._tolist = F.scaled_dot_product_attention, torch.Tensor.tolist
        F.scaled_dot_product_attention = self._attention
        counter = self

        def read_list(tensor):  # Tensor.tolist, counted: on a CPU it runs no operation seen below
            counter.reads["tolist"] += 1
            return counter._tolist(tensor)

        torch.Tensor.tolist = read_list
        return super().__enter__()

    def __exit__(self, *exc):
        F.scaled_dot_product_attention, torch.Tensor.tolist = self._sdpa, self._tolist
        return super().__exit__(*exc)

    def _attention(self, q, k, v, attn_mask=None, **kwargs):
        """Record the call's shapes, then attend as SDPA does."""
        mask = None if attn_mask is None else tuple(attn_mask.shape)
        self.shapes.add((tuple(q.shape), tuple(k.shape), k.stride(), mask))
        return self._sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.embedding.default:
            self.passes += 1
        elif func in READS:
            self.reads[READS[func]] += 1
        elif func is aten.index.Tensor and any(
                i is not None and i.dtype == torch.bool for i in args[1]):
            self.reads["boolean indexing"] += 1
        elif func is aten.lift_fresh.default and self.passes > self.start:
            self.made += 1
        return func(*args, **kwargs)

    def total_reads(self):
        """Every read from the device counted so far."""
        return sum(self.reads.values())
