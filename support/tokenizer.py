"""
Text <-> token ids: the built-in tokenizers (tiktoken) and a Hugging Face folder's (tokenizers).

    get_tokenizer(name)      "bytes" (offline, the default), "gpt2" -> a tiktoken Encoding;
                             "hf:FOLDER" -> an HFTokenizer, called alike
    special_ids(enc)         (eos_id, mask_id, pad_id) that training appends, masks and pads with
    vocab_size(enc)          the embedding rows a model needs for it
    encode(enc, text)        token ids; special-token strings in the text stay plain text
    encode_prompt(enc, text) the same with what a folder's post-processor adds (Llama 3's BOS)
    decode(enc, ids)         text; broken UTF-8 becomes U+FFFD
"""

import os
import re
from functools import cache

import tiktoken

from support.hf_tokenizer import HFTokenizer, hf_special_ids, hf_tokenizer

EOS, MASK, PAD = "<|endoftext|>", "<|mask|>", "<|pad|>"
TOKENIZERS = ("bytes", "gpt2")

# the byte tokenizer splits text with GPT-2's regex, as GPT-2 does
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@cache
def get_tokenizer(name: str = "bytes") -> tiktoken.Encoding | HFTokenizer:
    """The tokenizer called `name`: "bytes" (ids 0..255, EOS=256, MASK=257, PAD=258; no download),
    "gpt2" (GPT-2's BPE, EOS=50256, MASK=50257, PAD=50258; tiktoken downloads its file once, see
    TIKTOKEN_CACHE_DIR) or "hf:FOLDER" (hf_tokenizer). Raises ValueError for an unknown name,
    FileNotFoundError if the GPT-2 BPE file cannot be had, and what hf_tokenizer raises."""
    if name.startswith("hf:"):
        return hf_tokenizer(os.path.expanduser(name[len("hf:"):]))
    if name == "bytes":
        ranks = {bytes([i]): i for i in range(256)}
        return tiktoken.Encoding(name="bytes", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                                 special_tokens={EOS: 256, MASK: 257, PAD: 258})
    if name == "gpt2":
        try:
            base = tiktoken.get_encoding("gpt2")
        except Exception as e:
            raise FileNotFoundError(
                "the GPT-2 BPE file could not be downloaded or found in tiktoken's cache "
                "(set TIKTOKEN_CACHE_DIR to a directory that holds it); "
                "use --tokenizer=bytes (the offline default) instead") from e
        return tiktoken.Encoding(name="gpt2-refusion", pat_str=base._pat_str,
                                 mergeable_ranks=base._mergeable_ranks,
                                 special_tokens={EOS: 50256, MASK: 50257, PAD: 50258})
    raise ValueError(f"unknown tokenizer {name!r}; choose one of {TOKENIZERS} or hf:FOLDER")


def special_ids(enc: tiktoken.Encoding | HFTokenizer) -> tuple[int, int, int]:
    """(eos_id, mask_id, pad_id) that training appends, masks and pads with: for hf:FOLDER,
    hf_special_ids's first EOS id and pad id, and its mask id or, for a folder without one, the
    first id after the tokenizer's own. Raises what hf_special_ids raises."""
    if enc.name.startswith("hf:"):
        eos_ids, mask_id, pad_id = hf_special_ids(enc.name[len("hf:"):])
        return eos_ids[0], enc.n_vocab if mask_id is None else mask_id, pad_id
    return enc.encode_single_token(EOS), enc.encode_single_token(MASK), enc.encode_single_token(PAD)


def vocab_size(enc: tiktoken.Encoding | HFTokenizer) -> int:
    """The embedding rows a model needs for enc: every id, special_ids' included."""
    return max(enc.n_vocab, max(special_ids(enc)) + 1)


def encode(enc: tiktoken.Encoding | HFTokenizer, text: str) -> list[int]:
    """Token ids of `text`; a special token's string in it stays plain text (a folder's added
    tokens that are not special are found, as the `tokenizers` library finds them)."""
    if isinstance(enc, HFTokenizer):  # the library takes a whitespace run of any length whole
        return enc.encode_ordinary(text)
    ids = []
    for piece in _pieces(text):
        ids += enc.encode_ordinary(piece)
    return ids


def encode_prompt(enc: tiktoken.Encoding | HFTokenizer, text: str) -> list[int]:
    """encode(enc, text) with the ids a folder's post-processor puts around a prompt (Llama 3's
    BOS), as AutoTokenizer(text) gives them."""
    if isinstance(enc, HFTokenizer):
        return enc.encode_prompt(text)
    return encode(enc, text)


def decode(enc: tiktoken.Encoding | HFTokenizer, ids) -> str:
    """Text of `ids` (ints, special ids included); broken UTF-8 becomes U+FFFD, never an error."""
    return enc.decode([int(i) for i in ids], errors="replace")


# tiktoken's regex runs out of its backtracking stack on about 500,000 whitespace characters in a
# row: encode() feeds it a longer run than this in pieces
MAX_SPACE_RUN = 10_000
# from the run's start: linear time
_LONG_SPACE_RUN = re.compile(r"(?<!\s)\s{%d,}" % (MAX_SPACE_RUN + 1))


def _pieces(text: str) -> list[str]:
    """text cut every MAX_SPACE_RUN characters inside each longer run of whitespace (exact for the
    byte tokenizer; a BPE may merge whitespace differently at a cut)."""
    cuts = [0]
    for run in _LONG_SPACE_RUN.finditer(text):
        cuts += range(run.start() + MAX_SPACE_RUN, run.end(), MAX_SPACE_RUN)
    return [text[a:b] for a, b in zip(cuts, cuts[1:] + [len(text)])]
