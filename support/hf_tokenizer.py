"""
A Hugging Face folder's tokenizer: its tokenizer.json read by the `tokenizers` library, its chat
template, and its special ids.

    hf_tokenizer(folder)           tokenizer.json -> HFTokenizer, called as a tiktoken Encoding
    hf_special_ids(folder)         its EOS, mask and pad ids
    undecodable_ids(enc, rows)     a model's embedding rows its tokenizer has no token for
"""

import os
import stat
from functools import cache

import tokenizers

from support.files import (DAMAGED, TOKENIZER_LIMIT, abridged, check_kind, expect, is_int,
                           read_json, read_text)


class HFTokenizer:
    """The library's Tokenizer with the calls of a tiktoken Encoding that support/tokenizer.py and
    support/chat.py make: a special token's string in a text stays text, an added token that is not
    special (Qwen3's <think>) is found, decode writes every token. name: "hf:FOLDER"; token_ids:
    every id with a token; special_tokens: {token: id}; chat_template: a Jinja template or None;
    template_tokens: the bos_token and eos_token strings a template is given."""

    def __init__(self, tokenizer, name, chat_template, template_tokens):
        # transformers encodes whole texts, whatever truncation or padding the file sets
        tokenizer.no_truncation()
        tokenizer.no_padding()
        tokenizer.encode_special_tokens = True
        self.tokenizer = tokenizer
        self.name = name
        self.token_ids = set(tokenizer.get_vocab(with_added_tokens=True).values())
        self.n_vocab = max(self.token_ids, default=-1) + 1
        added = tokenizer.get_added_tokens_decoder()
        self.special_tokens = {t.content: i for i, t in added.items() if t.special}
        self.special_tokens_set = set(self.special_tokens)
        self.chat_template = chat_template
        self.template_tokens = template_tokens

    def encode_ordinary(self, text: str) -> list[int]:
        """Token ids of text, without what the post-processor adds."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of text with what the post-processor puts around a sequence (Llama 3's BOS),
        as AutoTokenizer(text) gives them."""
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int], errors="replace") -> str:
        """Text of ids, special tokens included, broken UTF-8 as U+FFFD (errors: tiktoken's
        argument, unused)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def encode_single_token(self, token: str) -> int:
        """The id of a special token. Raises KeyError for another string."""
        return self.special_tokens[token]


@cache
def hf_tokenizer(folder: str) -> HFTokenizer:
    """The HFTokenizer of a folder's tokenizer.json, with the chat template of its
    tokenizer_config.json or chat_template.jinja. Raises FileNotFoundError without tokenizer.json;
    ValueError naming a folder that is not a directory, a file that is not a regular file, is
    larger than any real one or is not UTF-8 (read_text), one the library cannot read, or a chat
    template that is not one text."""
    check_kind(folder, "hf:FOLDER must name a Hugging Face model folder", stat.S_ISDIR)
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no tokenizer.json in {folder!r}: hf:FOLDER must name a "
                                "Hugging Face model folder holding one "
                                "(as Qwen3's, SmolLM2's and ReFusion's releases do)")
    # read here, within bounds: the library's from_file would read any size whole
    text = read_text(path, TOKENIZER_LIMIT)
    try:
        tokenizer = tokenizers.Tokenizer.from_str(text)
    except Exception as e:  # the library raises Exception, its message naming the problem
        raise ValueError(f"{path} does not load in the tokenizers library ({e}); "
                         f"{DAMAGED}") from None
    config_path = os.path.join(folder, "tokenizer_config.json")
    config = read_json(config_path) if os.path.exists(config_path) else {}
    template = config.get("chat_template")
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(jinja):
        template = read_text(jinja)
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{config_path}: chat_template is a list of named templates; only a "
                         "single template is supported")
    # a template's {{ bos_token }}, as apply_chat_template gives it
    template_tokens = {k: v.get("content") if isinstance(v, dict) else v for k, v in config.items()
                       if k in ("bos_token", "eos_token") and v}
    return HFTokenizer(tokenizer, f"hf:{folder}", template, template_tokens)


MASK_TOKEN = "<|mask|>"                          # ReFusion's (151670 in its release)
EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")     # the end of a chat turn, then of a document


def hf_special_ids(folder: str) -> tuple[tuple[int, ...], int | None, int]:
    """(eos_ids, mask_id, pad_id) of a folder, as transformers reads its files. eos_ids (a tuple):
    generation_config.json's eos_token_id, else config.json's, else EOS_TOKENS that are special
    tokens; mask_id: MASK_TOKEN, else config.json's mask_token_id, else None (a plain Qwen3 or
    Llama); pad_id: config.json's pad_token_id (a negative one: none), else the last EOS id.
    Raises what hf_tokenizer raises; ValueError when no EOS id is found, or naming the file for an
    id that is not a whole number or ids beyond its vocab_size (undecodable_ids)."""
    enc = hf_tokenizer(folder)
    added = enc.special_tokens
    config_path = os.path.join(folder, "config.json")
    config = read_json(config_path) if os.path.exists(config_path) else {}
    generation_path = os.path.join(folder, "generation_config.json")
    generation = read_json(generation_path) if os.path.exists(generation_path) else {}

    def ids_in(source, path, key, many=False):  # the id (or ids, when many) a file names, as a list
        value = source.get(key)
        ids = value if many and isinstance(value, list) else [] if value is None else [value]
        expect(all(is_int(i, -2**31) for i in ids), path,
               f"{key}={value!r} is not a token id (a whole number)" + " or a list of them" * many)
        expect(key == "pad_token_id" or all(i >= 0 for i in ids), path,
               f"{key}={value!r}: a token id is a whole number from 0")
        return [i for i in ids if i >= 0]

    def config_ids(key, many=False):
        return ids_in(config, config_path, key, many)
    eos_ids = (tuple(ids_in(generation, generation_path, "eos_token_id", True))
               or tuple(config_ids("eos_token_id", True))
               or tuple(added[token] for token in EOS_TOKENS if token in added))
    if not eos_ids:
        raise ValueError(f"{folder}/tokenizer.json has neither {' nor '.join(EOS_TOKENS)} "
                         "among its special tokens, and neither generation_config.json nor "
                         "config.json names an eos_token_id, so generation could not stop")
    mask_id = added.get(MASK_TOKEN, next(iter(config_ids("mask_token_id")), None))
    pad_id = next(iter(config_ids("pad_token_id")), eos_ids[-1])
    if "vocab_size" in config:
        rows = config["vocab_size"]
        expect(is_int(rows, 1), config_path, f"vocab_size={rows!r} is not a positive whole number")
        undecodable_ids(enc, rows, f"the model in {config_path} (vocab_size)",
                        (*eos_ids, mask_id, pad_id))
    return eos_ids, mask_id, pad_id


def undecodable_ids(enc, rows, model, special_ids=()):
    """The ids below `rows` (a model's vocab_size) that `enc` (an HFTokenizer or tiktoken
    Encoding) has no token for, a tuple: the decoders ban them (sampler.make_decoder). model: names
    the model in messages; special_ids: the ids it is used with (None for none). Raises ValueError
    when one of these or enc's ids is at or beyond rows: the tokenizer is not this model's."""
    known = enc.token_ids if isinstance(enc, HFTokenizer) else set(range(enc.n_vocab))
    beyond = sorted({i for i in known | set(special_ids) if i is not None and i >= rows})
    if beyond:
        raise ValueError(f"token ids {abridged([str(i) for i in beyond])} (of the tokenizer "
                         f"{enc.name} and its special tokens) are at or beyond the {rows} "
                         f"embedding rows of {model}; the tokenizer is "
                         "not this model's: use the tokenizer.json released with these weights")
    return tuple(i for i in range(rows) if i not in known)
