"""
The network: a decoder-only transformer in the Qwen3 / Llama style (RMSNorm, RoPE, SwiGLU MLP,
optional QK-norm, grouped-query attention) whose forward takes position_ids beside the tokens:
attention is causal over the buffer's order, RoPE uses the true positions (SPEC section 2).
DecoderModel names what a decoder may call on a model; kvcache.py names the caches' side.
"""

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from kvcache import KVCache


@dataclass
class ModelConfig:
    vocab_size: int = 259           # the byte tokenizer: 256 bytes + EOS, mask, pad
    block_size: int = 512           # the context (nanoGPT's name): position ids are < block_size
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None    # grouped-query attention; None means n_head (plain multi-head)
    n_embd: int = 128
    head_dim: int | None = None     # None means n_embd // n_head (Qwen3 sets it explicitly)
    intermediate_size: int | None = None  # SwiGLU hidden width; None: ~8/3 n_embd, rounded to 64
    rope_theta: float = 10000.0
    qk_norm: bool = True            # RMSNorm on each head's queries and keys (Qwen3; not Llama)
    tie_embeddings: bool = True     # lm_head shares the token embedding matrix
    norm_eps: float = 1e-6
    causal: bool = True             # False: bidirectional attention (the MDM baseline)

    def __post_init__(self):
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.head_dim is None:
            if self.n_embd % self.n_head:
                raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                                 "pick n_embd as a multiple of n_head (or set head_dim)")
            self.head_dim = self.n_embd // self.n_head
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} must be a multiple of "
                             f"n_kv_head={self.n_kv_head}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if not 0 < self.rope_theta < math.inf:  # also catches NaN, which would make every angle NaN
            raise ValueError(f"rope_theta={self.rope_theta}: the base of the rotary angles must be "
                             "positive and finite")
        if self.intermediate_size is None:
            self.intermediate_size = 64 * math.ceil(8 * self.n_embd / 3 / 64)


def rope_cos_sin(position_ids, head_dim, theta):
    """Rotary angles of the true positions position_ids: (B, T) int64. Returns cos, sin:
    (B, 1, T, head_dim) float32, broadcastable over heads."""
    # One frequency per pair of dimensions, from 1 down to about 1/theta
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device,
                                            dtype=torch.float32) / head_dim)
    # Each token's angle is its true position times each frequency
    angles = position_ids.float()[..., None] * inv_freq      # (B, T, hd/2)
    # Qwen and Llama pair dimension i with i + hd/2 (the halves), so the angles repeat
    angles = torch.cat([angles, angles], dim=-1)[:, None]     # (B, 1, T, hd)
    return angles.cos(), angles.sin()


def additive_mask(mask, dtype):
    """mask (bool, True: may attend) as the mask SDPA adds to the scores: 0 or -inf, in dtype."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, -math.inf)


def apply_rope(x, cos, sin):
    """x: (B, H, T, hd) with pairs (i, i + hd/2) rotated by cos, sin (rope_cos_sin's)."""
    # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), both halves at once
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):

    def __init__(self, config, layer_idx):
        super().__init__()
        # the layer's index: which slice of the KV cache holds its keys and values
        self.layer_idx = layer_idx
        # grouped-query attention: n_kv_head key/value heads, each shared by n_head / n_kv_head
        # query heads (Qwen3, Llama); n_kv_head == n_head is ordinary multi-head attention
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, config.n_embd, bias=False)
        # Qwen3 normalizes each head's queries and keys (qk_norm); Llama does not
        eps = config.norm_eps
        self.q_norm = nn.RMSNorm(self.head_dim, eps=eps) if config.qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(self.head_dim, eps=eps) if config.qk_norm else nn.Identity()

    def forward(self, x, cos, sin, mask, is_causal, kv_cache):
        B, T, _ = x.shape
        # Project to heads: q (B, nh, T, hd); k and v (B, nkv, T, hd), fewer heads under GQA.
        # Qwen3 normalizes each head's queries and keys (qk_norm); Llama does not.
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_head, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        # Rotate queries and keys by each token's true position (cos, sin: gathered by the caller).
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        # With a cache, the new keys and values are written after the P cached ones, and the
        # queries attend to all of them: (B, nkv, P + T, hd).
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)
        # One fused attention; the mask (or SDPA's own causal mask) says who sees whom.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                           enable_gqa=self.n_kv_head != self.n_head)
        # Heads back side by side, then the output projection.
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x):
        # SwiGLU: a SiLU-gated product of two projections, then back to the model's width
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):

    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask, is_causal, kv_cache):
        # Pre-norm residual blocks: attention, then the MLP, each added to the stream.
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, is_causal, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Decoder-only transformer over (tokens, position_ids); see ModelConfig for the knobs."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # token embeddings, n_layer pre-norm blocks, a final norm and the output layer, named as
        # Qwen3's and Llama's Hugging Face weights are (support/hf_folder.py loads them as they are)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.n_layer))
        self.norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._rope = {}  # device -> the rope_tables, float32 whatever the weights' dtype
        # GPT-2's initialization: N(0, 0.02), the residual projections scaled down by depth
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self):
        """Number of parameters (a tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def rope_tables(self, device):
        """cos, sin: (block_size, head_dim) float32, rope_cos_sin of every position (per device)."""
        if device not in self._rope:
            positions = torch.arange(self.config.block_size, device=device)[None]
            cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
            self._rope[device] = (cos[0, 0], sin[0, 0])
        return self._rope[device]

    def new_kv_cache(self, max_len, max_batch=1):
        """An empty KVCache sized for this model: up to max_batch rows of max_len tokens."""
        c = self.config
        # the cache holds keys/values in the weights' dtype, on their device
        p = self.embed_tokens.weight
        return KVCache(c.n_layer, c.n_kv_head, c.head_dim, max_len, max_batch, dtype=p.dtype,
                       device=p.device)

    def forward(self, idx, position_ids, kv_cache=None, attn_mask=None, logits_from=0):
        """Logits of the tokens from logits_from on (SPEC section 2).

        idx, position_ids: (B, T) int64, the tokens in buffer order and their true positions
        (< block_size). kv_cache: optional kvcache.LayerCache holding P earlier tokens of every
        row, which the new tokens see (its attention_mask) and to which their keys/values are
        appended. attn_mask: optional (B, 1, T, P + T) bool, True where a query may attend to a
        key (when given, the whole rule). Without either, attention is causal (config.causal) or
        bidirectional. logits_from: the first of the T tokens given logits (-1: the last).
        Returns logits: (B, T - logits_from, vocab_size) float32. Raises ValueError when idx and
        position_ids differ in shape.
        """
        if idx.shape != position_ids.shape:
            raise ValueError(f"idx {tuple(idx.shape)} and position_ids {tuple(position_ids.shape)} "
                             "must have the same (B, T) shape")
        T = idx.shape[1]
        x = self.embed_tokens(idx)
        # The attention rule. With a cache: the mask given, or every cached key and then causal
        # (the cache's mask also hides the unused keys of its bucketed length); converted to the
        # additive form once here: SDPA would convert a bool mask in every layer.
        if kv_cache is not None:
            if attn_mask is None:
                attn_mask = kv_cache.attention_mask(T)
            attn_mask = additive_mask(attn_mask, x.dtype)
        # Without a mask or a cache: SDPA's own causal mask, or none for a bidirectional model.
        is_causal = attn_mask is None and self.config.causal
        # RoPE from the true positions, not the buffer order: each token's row of the tables.
        cos, sin = self.rope_tables(idx.device)
        cos = cos[position_ids][:, None]                           # (B, 1, T, hd)
        sin = sin[position_ids][:, None]
        for layer in self.layers:
            x = layer(x, cos, sin, attn_mask, is_causal, kv_cache)
        # The cache now holds these T tokens' keys and values after its P.
        if kv_cache is not None:
            kv_cache.advance(T)
        # Logits only where the caller reads them (the output layer is a small model's largest
        # matmul), in float32 whatever the weights' dtype.
        return self.lm_head(self.norm(x[:, logits_from:])).float()


class DecoderModel(Protocol):
    """What a decoder may call on a model (Transformer, or a wrapper of support/); its cache is a
    kvcache.DecodeCache."""
    config: ModelConfig

    def __call__(self, idx, position_ids, kv_cache=None, attn_mask=None, logits_from=0): ...
    def new_kv_cache(self, max_len, max_batch=1): ...
    def parameters(self, recurse=True): ...
