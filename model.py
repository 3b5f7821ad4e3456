"""
The network: a decoder-only transformer in the Qwen3 style (RMSNorm, rotary position embeddings
applied from explicit position ids, SwiGLU MLP, optional QK-norm, grouped-query attention).

ReFusion needs one thing a plain GPT does not: tokens may sit anywhere in the buffer while keeping
their true positions. So `forward` takes `position_ids` next to the tokens; attention is causal over
the *physical* order of the buffer, RoPE uses the *logical* positions (SPEC section 2).

Module names follow the Hugging Face Qwen3 checkpoints (embed_tokens, self_attn.q_proj, mlp.gate_proj,
...), so released weights map onto this model name for name (Transformer.from_pretrained).
"""

import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open

from kvcache import KVCache


@dataclass
class ModelConfig:
    vocab_size: int = 259           # the byte tokenizer: 256 bytes + EOS, mask, pad
    block_size: int = 512           # context length: position ids are < block_size
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None    # grouped-query attention; None means n_head (plain multi-head)
    n_embd: int = 128
    head_dim: int | None = None     # None means n_embd // n_head (Qwen3 sets it explicitly)
    intermediate_size: int | None = None  # SwiGLU hidden width; None means ~8/3 n_embd, rounded to 64
    rope_theta: float = 10000.0
    qk_norm: bool = True            # RMSNorm on each head's queries and keys, as in Qwen3
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
            raise ValueError(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if not 0 < self.rope_theta < math.inf:  # also catches NaN, which would make every angle NaN
            raise ValueError(f"rope_theta={self.rope_theta}: the base of the rotary angles must be positive and finite")
        if self.intermediate_size is None:
            self.intermediate_size = 64 * math.ceil(8 * self.n_embd / 3 / 64)


def rope_cos_sin(position_ids, head_dim, theta):
    """Rotary angles for explicit positions.

    position_ids: (B, T) int64, the true (logical) position of every token.
    Returns cos, sin: (B, 1, T, head_dim) float32, broadcastable over heads.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device,
                                            dtype=torch.float32) / head_dim)
    angles = position_ids.float()[..., None] * inv_freq      # (B, T, hd/2)
    angles = torch.cat([angles, angles], dim=-1)[:, None]     # (B, 1, T, hd), Qwen's half-split layout
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """x: (B, H, T, hd). Rotates pairs (i, i + hd/2) by the angles of each token's position."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):

    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.q_proj = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, config.n_embd, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps) if config.qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps) if config.qk_norm else nn.Identity()

    def forward(self, x, cos, sin, mask, is_causal, kv_cache):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_head, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)      # (B, nkv, P + T, hd): cached + new
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                           enable_gqa=self.n_kv_head != self.n_head)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):

    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask, is_causal, kv_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, is_causal, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Decoder-only transformer over (tokens, position_ids); see ModelConfig for the knobs."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self):
        """Number of parameters (a tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def new_kv_cache(self, max_len, max_batch=1):
        """An empty KVCache sized for this model: up to max_batch rows of max_len tokens."""
        c, p = self.config, self.embed_tokens.weight
        return KVCache(c.n_layer, c.n_kv_head, c.head_dim, max_len, max_batch, dtype=p.dtype, device=p.device)

    def forward(self, idx, position_ids, kv_cache=None, key_mask=None):
        """Logits for every input token.

        idx:          (B, T) int64 token ids, in buffer (physical) order.
        position_ids: (B, T) int64 true positions, used only by RoPE.
        kv_cache:     optional KVCache holding P earlier tokens of every row; the new tokens attend
                      to all of them and causally to each other (when config.causal), and their
                      keys/values are appended to the cache.
        key_mask:     optional (B, P + T) bool, False for keys no query may attend to (padding in
                      the bidirectional MDM baseline).
        Returns logits: (B, T, vocab_size) float32.
        Raises ValueError when idx and position_ids differ in shape.
        """
        if idx.shape != position_ids.shape:
            raise ValueError(f"idx {tuple(idx.shape)} and position_ids {tuple(position_ids.shape)} "
                             "must have the same (B, T) shape")
        T = idx.shape[1]
        P = kv_cache.pos if kv_cache is not None else 0
        mask, is_causal = None, False
        if self.config.causal and P == 0 and key_mask is None:
            is_causal = True  # square (T, T): SDPA's top-left-aligned mask is the right one
        elif self.config.causal:
            # With P cached keys SDPA's is_causal would align the mask top-left (query i sees keys
            # 0..i); query i must see keys 0..P+i, so build the mask explicitly.
            q_idx = torch.arange(T, device=idx.device)[:, None]
            k_idx = torch.arange(P + T, device=idx.device)[None, :]
            mask = (k_idx <= P + q_idx)[None, None]           # (1, 1, T, P + T)
        if key_mask is not None:
            km = key_mask[:, None, None, :]                   # (B, 1, 1, P + T)
            mask = km if mask is None else mask & km
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta)
        x = self.embed_tokens(idx)
        for block in self.layers:
            x = block(x, cos, sin, mask, is_causal, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(T)
        return self.lm_head(self.norm(x)).float()

    @classmethod
    def from_pretrained(cls, folder, dtype=torch.float32):
        """A Qwen3 checkpoint in Hugging Face's layout (Qwen3's or ReFusion's release), on the CPU.

        folder: config.json and model.safetensors, or the shards model.safetensors.index.json lists, as
                transformers' save_pretrained writes them. Tensor names are ours prefixed "model."
                (model.layers.0.self_attn.q_proj.weight: (n_head * head_dim, n_embd)), but lm_head.weight,
                absent when tie_word_embeddings.
        dtype:  of the parameters (the releases store bfloat16; float32 takes twice the memory).
        Every name and shape is checked in the files' headers first; then the model, built on the meta
        device (no memory, no random init), takes each shard's tensors as its parameters, so the weights
        are held once. Returns the causal Transformer in eval mode (block_size = max_position_embeddings);
        its forward gives (B, T, vocab_size) float32 logits.
        Raises FileNotFoundError for a missing folder, config.json or weights file; ValueError when
        config.json is not a Qwen3 this model implements (model_type, rope scaling, attention bias, sliding
        window, a missing field), the tensors' names or shapes do not match it, or the index names a file
        outside the folder (weight_file_in).
        """
        def need(name):
            path = os.path.join(folder, name)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} not found: from_pretrained needs a Hugging Face model folder "
                                        "(config.json and model.safetensors or its shards), downloaded whole")
            return path

        with open(need("config.json")) as f:
            hf = json.load(f)
        # transformers 4 writes rope_theta and rope_scaling (null when plain), transformers 5 rope_parameters
        rope_key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
        rope = hf.get(rope_key) or {}
        unsupported = [f"{key}={hf.get(key)!r}" for key, ok in [
            ("model_type", hf.get("model_type") == "qwen3"),
            (rope_key, rope.get("rope_type", rope.get("type", "default")) == "default"),
            ("attention_bias", not hf.get("attention_bias")),
            ("use_sliding_window", not hf.get("use_sliding_window")),
            ("hidden_act", hf.get("hidden_act", "silu") == "silu")] if not ok]
        if unsupported:
            raise ValueError(f"{folder}/config.json: {', '.join(unsupported)} is not implemented here; this model "
                             "loads Qwen3 checkpoints (plain RoPE, no attention bias, full attention, SiLU) only")
        try:
            config = ModelConfig(
                vocab_size=hf["vocab_size"], block_size=hf["max_position_embeddings"],
                n_layer=hf["num_hidden_layers"], n_head=hf["num_attention_heads"], n_kv_head=hf["num_key_value_heads"],
                n_embd=hf["hidden_size"], head_dim=hf["head_dim"], intermediate_size=hf["intermediate_size"],
                rope_theta=hf["rope_theta"] if "rope_theta" in hf else rope["rope_theta"],
                norm_eps=hf["rms_norm_eps"], tie_embeddings=hf["tie_word_embeddings"], qk_norm=True, causal=True)
        except KeyError as e:
            raise ValueError(f"{folder}/config.json has no {e}; it is not a complete Qwen3 config") from None
        with torch.device("meta"):
            model = cls(config)
        # Hugging Face name -> shape; named_parameters lists a tied lm_head.weight once, as embed_tokens.weight
        expected = {("" if name == "lm_head.weight" else "model.") + name: list(p.shape)
                    for name, p in model.named_parameters()}

        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()), key=str)
            files = [need(weight_file_in(folder, name, index)) for name in names]
        else:
            files = [need("model.safetensors")]
        found = {}  # Hugging Face name -> shape, from the files' headers
        for path in files:
            with safe_open(path, framework="pt") as f:
                found.update((name, f.get_slice(name).get_shape()) for name in f.keys())
        if config.tie_embeddings:
            found.pop("lm_head.weight", None)  # a stored copy of the tied matrix is ignored, as transformers does
        missing, unexpected = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
        misshaped = [f"{name} {found[name]} (config.json implies {expected[name]})"
                     for name in sorted(expected.keys() & found.keys()) if found[name] != expected[name]]

        def abridged(names):
            return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        problems = [f"{kind} tensors: {abridged(names)}" for kind, names in
                    [("missing", missing), ("unexpected", unexpected), ("wrongly shaped", misshaped)] if names]
        if problems:
            raise ValueError(f"the weights in {folder} do not match its config.json: {'; '.join(problems)}. "
                             "Check that the folder holds one whole model and its own config.json")

        for path in files:  # shard by shard; its tensors become the parameters (no second copy)
            with safe_open(path, framework="pt") as f:
                shard = {name.removeprefix("model."): f.get_tensor(name).to(dtype)
                         for name in f.keys() if name in expected}
            model.load_state_dict(shard, strict=False, assign=True)
        if config.tie_embeddings:
            model.lm_head.weight = model.embed_tokens.weight  # assign replaced the shared parameter
        return model.eval()


def weight_file_in(folder, name, index):
    """name, a weights file that the index file `index` of the model folder `folder` lists, checked
    to be a file of that folder: not an absolute path, no "..", no symlink leading out of it (the
    links of a Hugging Face cache snapshot into its own blobs/ directory are the folder's own).
    Returns name. Raises ValueError naming the index and the entry, so nothing outside is read."""
    root = os.path.realpath(folder)
    roots = [root]
    if os.path.basename(os.path.dirname(root)) == "snapshots":  # ~/.cache/huggingface/hub/models--*/snapshots/REV
        roots.append(os.path.join(os.path.dirname(os.path.dirname(root)), "blobs"))
    inside = isinstance(name, str) and not os.path.isabs(name) and ".." not in name.replace("\\", "/").split("/") \
        and any(os.path.commonpath([os.path.realpath(os.path.join(folder, name)), r]) == r for r in roots)
    if not inside:
        raise ValueError(f"{index} lists the weights file {name!r}, outside {folder}; a model folder's index "
                         "names files of that folder only: download the model whole into one folder")
    return name
