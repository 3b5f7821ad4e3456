"""
Text <-> token ids: the built-in tokenizers (tiktoken) and a Hugging Face folder's (tokenizers).

    get_tokenizer(name)      "bytes" (offline, the default), "gpt2" -> a tiktoken Encoding;
                             "hf:FOLDER" -> an HFTokenizer, called alike
    special_ids(enc)         (eos_id, mask_id, pad_id) that training appends,
                             masks with and pads with
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
    """
    Return the tokenizer called `name`, with EOS, MASK and PAD as special tokens
    (hf:FOLDER: the folder's own special tokens).

    "bytes": one token per byte (ids 0..255) + EOS=256, MASK=257, PAD=258; n_vocab = 259.
             Built in code, needs no download: the offline default.
    "gpt2":  GPT-2's BPE (ids 0..50255) + EOS=50256, MASK=50257, PAD=50258; n_vocab = 50259.
             tiktoken downloads the BPE file once and caches it (see TIKTOKEN_CACHE_DIR).
    "hf:FOLDER": the tokenizer.json of a Hugging Face model folder (Qwen3, ReFusion, SmolLM2) as
             the `tokenizers` library reads it (hf_tokenizer.hf_tokenizer); its special ids come
             from hf_tokenizer.hf_special_ids.
    Raises ValueError for an unknown name, FileNotFoundError if the GPT-2 BPE file cannot be had,
    and what hf_tokenizer raises.
    """
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
    """(eos_id, mask_id, pad_id) that training appends, masks with and pads with.

    bytes / gpt2: EOS, MASK and PAD of get_tokenizer. hf:FOLDER (hf_special_ids): the first EOS id
    (<|im_end|> for Qwen3), <|mask|>, or for a folder without one (a plain Qwen3, fine-tuned into a
    ReFusion model) the first id after the tokenizer's own, and the pad id. Raises what
    hf_special_ids raises.
    """
    if enc.name.startswith("hf:"):
        eos_ids, mask_id, pad_id = hf_special_ids(enc.name[len("hf:"):])
        return eos_ids[0], enc.n_vocab if mask_id is None else mask_id, pad_id
    return enc.encode_single_token(EOS), enc.encode_single_token(MASK), enc.encode_single_token(PAD)


def vocab_size(enc: tiktoken.Encoding | HFTokenizer) -> int:
    """Rows a model's embedding needs for this tokenizer: every id,
    the mask id of special_ids included."""
    return max(enc.n_vocab, max(special_ids(enc)) + 1)


def encode(enc: tiktoken.Encoding | HFTokenizer, text: str) -> list[int]:
    """Token ids of `text`. Special-token strings in the text stay plain text, never special ids.

    A tokenizer from a Hugging Face folder (hf:FOLDER) encodes as the `tokenizers` library does
    (its normalizer, its non-special added tokens found in text).
    """
    if isinstance(enc, HFTokenizer):  # the library takes a whitespace run of any length whole
        return enc.encode_ordinary(text)
    ids = []
    for piece in _pieces(text):
        ids += enc.encode_ordinary(piece)
    return ids


def encode_prompt(enc: tiktoken.Encoding | HFTokenizer, text: str) -> list[int]:
    """Token ids of `text` as a prompt (or a training sample's prompt): encode(enc, text) with the
    ids a Hugging Face folder's post-processor puts around a sequence (Llama 3: its BOS first),
    as AutoTokenizer(text) gives them. A chat prompt takes its markers from its template instead
    (support.chat)."""
    if isinstance(enc, HFTokenizer):
        return enc.encode_prompt(text)
    return encode(enc, text)


def decode(enc: tiktoken.Encoding | HFTokenizer, ids) -> str:
    """Text of `ids` (ints, special ids included); broken UTF-8 becomes U+FFFD, never an error."""
    return enc.decode([int(i) for i in ids], errors="replace")


# tiktoken's pre-tokenizing regex (GPT-2's, whose whitespace alternative looks ahead) runs out of
# its backtracking stack on a run of about 500,000 whitespace characters and panics: encode() feeds
# it a longer run than this in pieces
MAX_SPACE_RUN = 10_000
# from the run's start: linear time
_LONG_SPACE_RUN = re.compile(r"(?<!\s)\s{%d,}" % (MAX_SPACE_RUN + 1))


def _pieces(text: str) -> list[str]:
    """text cut every MAX_SPACE_RUN characters inside each run of more whitespace than that, for
    encode(); text without such a run is one piece. A cut is exact for the byte tokenizer (one token
    per byte however the text is cut); a BPE may merge such a run's whitespace differently at a
    cut."""
    cuts = [0]
    for run in _LONG_SPACE_RUN.finditer(text):
        cuts += range(run.start() + MAX_SPACE_RUN, run.end(), MAX_SPACE_RUN)
    return [text[a:b] for a, b in zip(cuts, cuts[1:] + [len(text)])]
