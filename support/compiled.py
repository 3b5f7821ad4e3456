"""
Compiled decoding (SPEC section 4.3, beyond the paper, opt-in: --compile in sampler.py, tools.probe
and the benchmarks): the model's forward pass under torch.compile, for every decoder of sampler.py,
unchanged.

    CompiledModel(model)            the model as the decoders call it, each pass run by a graph
    bucket(T)                       the length a pass of T tokens is padded to
    CompiledModel.graphs            the graphs compiled so far (one per bucket and kind of pass)

A compiled graph is fast for the shapes it was compiled for and recompiles for others, and a decode
feeds many: every pass of ReFusion has its own width (a plan's masks, a verify's drafts, an infill
round's rows), its cache its own length. So, as gpt-fast does, the shapes are bounded:

- A pass of T <= WIDE tokens is padded to bucket(T) (1, 8, 16, 32): the padding goes *before* the
  real tokens, so that the last input token is the last real one (a prefill's logits); no real
  query sees it, and its keys/values are dropped. A wider pass (a prefill, a plan over many
  slots) runs unpadded in one graph with a dynamic width: where a pass is bound by its
  arithmetic, padding costs what it saves. (2 AVX512 cores; ReFusion-SmolLM2 in bf16, 8 prompts:
  1.13x eager with WIDE = 32, 0.94x with buckets up to 128. The quick start's model, float32:
  1.08x with 32, 1.07x to 1.36x in three runs up to 128, 1.01x with every pass of 2 tokens or
  more in the dynamic graph.)
- The KV cache is read, not written, inside the graph: a pass attends to the whole cache tensor
  and its own new keys, masked to the P cached tokens and causally among the new ones, and the
  real tokens' keys/values are written after the pass. The cache's length and rows (one per
  infilled slot) are dynamic dimensions, so a new prompt length compiles nothing new.
- The output layer runs for the last token only (logits_from=-1) or for all, sliced after.

On CUDA the graphs run as CUDA graphs (torch.compile's "reduce-overhead": a pass is one launch,
not hundreds). A CUDA graph reads and writes fixed addresses, which asks three things of the
decoding around it:

- each pass starts with torch.compiler.cudagraph_mark_step_begin(), and the next pass writes its
  outputs where the last one's were: a decoder copies what it keeps past a pass (sampler.py's
  SpeculativeInfill clones the logits it keeps; tests/test_compiled.py poisons every output at the
  next pass to prove that no decoder reads a stale one);
- the KV cache is a static tensor, every row allocated, one per (max_len, max_batch) kept for
  every decode (new_kv_cache), written in place between passes, never copied into the graph;
- the shapes are few: bucketed widths (above, bucket), and decoders' caches of bucketed
  lengths (kvcache.cache_length), so that a graph is recorded once per shape and replayed after.

So a decode setting compiles a few graphs: one per bucket it feeds, per kind of pass (with a KV
cache or without, the last token's logits or all) and per rows (1, or more: ReFusion's infill).
Greedy tokens equal eager decoding's up to rounding: a padded, compiled pass sums in another order,
which can flip a near tie (SPEC section 4.2 says the same of batching).
"""

import os
import shutil
import time
import warnings

import torch
import torch.nn.functional as F

from kvcache import KVCache


# a pass of more tokens than WIDE keeps its width (bucket): where a pass is bound by its arithmetic,
# padding costs what it saves
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
    """--compile=True where torch.compile cannot run (an unsupported Python, or no C compiler for a
    CPU run) becomes False, with a warning: running without it gives the same results, slower.
    Under lowered CPU code paths (ATEN_CPU_CAPABILITY or ONEDNN_MAX_CPU_ISA set) Inductor keeps its
    compiled kernels in a folder of those settings (separate_compile_cache)."""
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
    folder named after them (beside its default, torchinductor_<user> in the temporary folder;
    one set by the user is kept):
    kernels it compiled under other code paths, found in a shared cache, gave NaN losses under
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 (torch 2.13, an AVX-512 CPU). Returns the
    folder set, or None where nothing was changed."""
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
    """The KV cache as a compiled pass sees it: read-only. A layer's new keys/values are kept (to
    be written to the cache after the pass, outside the graph) and attended after the whole cache
    (the mask hides what a query may not see). kv: the KVCache's tensor, (n_layer, 2, rows,
    n_kv_head, L, head_dim)."""

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
    """A Transformer whose forward passes run as compiled graphs on bucketed shapes (module doc).

    Called as the Transformer is: (idx (B, T) int64, position_ids (B, T) int64, kv_cache=None,
    attn_mask=None, logits_from=0) -> logits (B, T - logits_from, vocab_size) float32, and
    new_kv_cache(max_len, max_batch) as the Transformer's. A pass with both a KV cache and
    attn_mask (batched decoding, support/batching.py) is not taken: ValueError.
    """

    def __init__(self, model, mode=None):
        """mode: torch.compile's; None takes "reduce-overhead" on CUDA (CUDA graphs: one launch a
        pass) and the default elsewhere."""
        device = next(model.parameters()).device
        if mode is None and device.type == "cuda":
            mode = "reduce-overhead"
        self.cuda_graphs = mode == "reduce-overhead" and device.type == "cuda"
        self.model, self.config, self.parameters = model, model.config, model.parameters
        self.static = {}  # (max_len, max_batch) -> the KV tensor every decode's cache reuses
        model.rope_tables(device)  # built here, not inside a graph
        torch._dynamo.config.recompile_limit = 64  # a graph per bucket and kind of pass
        separate_compile_cache()
        self.compiled = torch.compile(self._forward, mode=mode, dynamic=False)

    def new_kv_cache(self, max_len, max_batch=1):
        """An empty KVCache as the model's. With CUDA graphs, over one tensor per (max_len,
        max_batch), every row allocated, kept for every decode (decodes run one at a time: a
        compiled model takes no batch), whose address the graphs read (module doc)."""
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
