"""
Compiled decoding (SPEC section 4.3, opt-in: --compile in sampler.py, tools.probe and the
benchmarks): sampler.py's decoders, unchanged, on a model whose forward passes run as
torch.compile graphs on few shapes.

    CompiledModel(model)            the model as the decoders call it, each pass run by a graph
    bucket(T)                       the width a pass of T tokens is padded to (before its tokens)
    check_compile(cfg)              turn off a --compile that cannot run here

The KV cache is read inside the graph and the real tokens' keys/values written after it. On CUDA
the graphs are CUDA graphs: the next pass overwrites a pass's outputs (a decoder clones what it
keeps), and every decode reuses one static KV tensor per (max_len, max_batch).
"""

import os
import shutil
import time
import warnings

import torch
import torch.nn.functional as F

from kvcache import KVCache


# a pass of more tokens than WIDE keeps its width (bucket): where a pass is bound by its arithmetic,
# padding costs what it saves (2 AVX512 cores, ReFusion-SmolLM2 in bf16, 8 prompts: 1.13x eager with
# WIDE = 32, 0.94x with buckets up to 128)
WIDE = 32


def bucket(T):
    """The width a compiled pass of T new tokens is padded to: 1 for 1 (next-token decoding's pass,
    whose kernels differ from a wide pass's), the next power of two from 8 up to WIDE, T above."""
    if T == 1:
        return 1
    if T > WIDE:
        return T
    return max(8, 1 << (T - 1).bit_length())


def check_compile(cfg):
    """Turn cfg["compile"] off, with a warning, where torch.compile cannot run (an unsupported
    Python, or no C compiler for a CPU run); else separate_compile_cache."""
    cpu = not cfg["device"].startswith(("cuda", "mps"))
    if cfg["compile"] and (not torch._dynamo.is_dynamo_supported()
                           or (cpu and not (shutil.which("cc") or shutil.which("gcc")))):
        warnings.warn("--compile=True: torch.compile cannot run here (unsupported Python or no C "
                      "compiler); running without it, which gives the same results more slowly")
        cfg["compile"] = False
    if cfg["compile"]:
        separate_compile_cache()


# The environment variables that lower the CPU code paths torch runs (docs/benchmark.md)
ISA_SETTINGS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def separate_compile_cache():
    """Where ISA_SETTINGS are set and TORCHINDUCTOR_CACHE_DIR is not, point Inductor's cache at a
    folder beside its default named after them. Returns the folder set, or None."""
    # kernels compiled under other code paths, found in a shared cache, gave NaN losses under
    # ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 (torch 2.13, an AVX-512 CPU)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    settings = [f"{name.lower()}-{os.environ[name].lower()}" for name in ISA_SETTINGS
                if os.environ.get(name)]
    default = default_cache_dir()
    # Inductor writes its default into the environment once it has used it: that is not a choice
    if not settings or os.environ.get("TORCHINDUCTOR_CACHE_DIR", default) != default:
        return None
    folder = "_".join([default] + settings)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    return folder


class NewKeys:
    """The KV cache as a compiled pass sees it: read-only. update keeps a layer's new keys/values
    (written to the KVCache after the pass) and returns them after the whole cache. kv: the
    KVCache's tensor, (n_layer, 2, rows, n_kv_head, L, head_dim)."""

    def __init__(self, kv):
        self.kv, self.new = kv, []

    def update(self, layer, k, v):
        self.new.append(torch.stack([k, v]))
        B = k.shape[0]
        return (torch.cat([self.kv[layer, 0, :B], k], dim=2),
                torch.cat([self.kv[layer, 1, :B], v], dim=2))

    def advance(self, T):
        pass  # the KVCache takes the real tokens' keys/values after the pass


class CompiledModel:
    """A Transformer whose forward passes run as compiled graphs on bucketed shapes, called as the
    Transformer is: (idx (B, T) int64, position_ids (B, T) int64, kv_cache=None, attn_mask=None,
    logits_from=0) -> logits (B, T - logits_from, vocab_size) float32; new_kv_cache likewise.
    Raises ValueError for a pass with both a KV cache and attn_mask (batched decoding)."""

    def __init__(self, model):
        device = next(model.parameters()).device
        # on CUDA, CUDA graphs: one launch a pass
        self.cuda_graphs = device.type == "cuda"
        mode = "reduce-overhead" if self.cuda_graphs else None
        self.model, self.config, self.parameters = model, model.config, model.parameters
        self.static = {}  # (max_len, max_batch) -> the KV tensor every decode's cache reuses
        model.rope_tables(device)  # built here, not inside a graph
        torch._dynamo.config.recompile_limit = 64  # a graph per bucket and kind of pass
        separate_compile_cache()
        self.compiled = torch.compile(self._forward, mode=mode, dynamic=False)

    def new_kv_cache(self, max_len, max_batch=1):
        """An empty KVCache as the model's; with CUDA graphs over one tensor per (max_len,
        max_batch), every row allocated, reused by every decode (the graphs read its address)."""
        if not self.cuda_graphs:
            return self.model.new_kv_cache(max_len, max_batch)
        if (max_len, max_batch) not in self.static:
            cache = self.model.new_kv_cache(max_len, max_batch)
            cache.repeat_prefix(max_batch)                   # every row, allocated now
            torch._dynamo.mark_static_address(cache.kv)
            self.static[max_len, max_batch] = cache.kv
        kv = self.static[max_len, max_batch]
        n_layer, _, _, n_kv_head, _, head_dim = kv.shape
        return KVCache(n_layer, n_kv_head, head_dim, max_len, max_batch, kv=kv)

    def compile_for(self, decode, prompts):
        """Decode every prompt once (untimed), compiling the graphs those decodes need.
        decode(model, prompt) -> Generation. Returns (graphs compiled, seconds taken)."""
        graphs, t0 = self.graphs, time.perf_counter()
        for p in prompts:
            decode(self, p)
        return self.graphs - graphs, time.perf_counter() - t0

    @property
    def graphs(self):
        """Graphs compiled so far (torch._dynamo's count, of every CompiledModel of the process)."""
        from torch._dynamo.utils import counters
        return counters["stats"]["unique_graphs"]

    def _forward(self, idx, position_ids, kv, mask, last_only):
        cache = None if kv is None else NewKeys(kv)
        logits = self.model(idx, position_ids, kv_cache=cache, attn_mask=mask,
                            logits_from=-1 if last_only else 0)
        return logits, None if kv is None else torch.stack(cache.new)

    @torch.inference_mode()
    def __call__(self, idx, position_ids, kv_cache=None, attn_mask=None, logits_from=0):
        B, T = idx.shape
        pad, device = bucket(T) - T, idx.device
        # padding before the real tokens: the last input token is the last real one
        idx, position_ids = F.pad(idx, (pad, 0)), F.pad(position_ids, (pad, 0))
        if kv_cache is not None:
            if attn_mask is not None:
                raise ValueError("compiled decoding takes one prompt at a time: decode with "
                                 "--batch_size=1, or without --compile")
            kv_cache.check_room(B, T)
            P, kv = kv_cache.length, kv_cache.kv
            k_idx = torch.arange(kv.shape[4] + T + pad, device=device)
            q_idx = torch.arange(T + pad, device=device)[:, None] + kv.shape[4]
            # the first P cached keys, then the new ones causally, the padding's seen by none
            mask = (k_idx < P) | ((k_idx <= q_idx) & ((k_idx >= kv.shape[4] + pad) |
                                                       (q_idx < kv.shape[4] + pad)))
            mask = mask[None, None]                         # (1, 1, Tb, L + Tb)
            if not self.cuda_graphs:  # a CUDA graph is recorded per shape: a static cache
                torch._dynamo.maybe_mark_dynamic(kv, 2)
                torch._dynamo.maybe_mark_dynamic(kv, 4)
                torch._dynamo.maybe_mark_dynamic(mask, 3)
        else:
            kv = None          # a padding query sees every key; a real query sees no padding
            inner = attn_mask if attn_mask is not None else torch.ones(
                T, T, dtype=torch.bool, device=device).tril(0 if self.config.causal else T)
            mask = torch.zeros(inner.shape[0] if inner.dim() == 4 else 1, 1, T + pad, T + pad,
                               dtype=torch.bool, device=device)
            mask[..., :pad, :] = True
            mask[..., pad:, pad:] = inner
        dynamic = [(idx, 1), (position_ids, 1), (mask, 2), (mask, 3)] * (T > WIDE) + [
            (idx, 0), (position_ids, 0), (mask, 0)] * (B > 1)      # any width, any rows above 1
        for x, dim in dynamic:
            torch._dynamo.maybe_mark_dynamic(x, dim)
        torch.compiler.cudagraph_mark_step_begin()  # a new pass: the last one's outputs are done
        logits, new = self.compiled(idx, position_ids, kv, mask, logits_from == -1)
        if kv_cache is not None:  # (n_layer, 2, B, n_kv_head, T, head_dim): the real tokens'
            kv[:, :, :B, :, P:P + T] = new[..., pad:, :]
            kv_cache.advance(T)
        return logits if logits_from == -1 else logits[:, pad + logits_from:]
