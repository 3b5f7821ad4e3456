"""
A Hugging Face folder's tokenizer.json (a byte-level BPE: Qwen2/3, Llama 3, GPT-2, SmolLM2) as a
tiktoken Encoding that encodes exactly as the reference `tokenizers` library does, and the folder's
special ids.

    hf_tokenizer(folder)           tokenizer.json -> HFEncoding (a tiktoken Encoding)
    hf_special_ids(folder)         its EOS, mask and pad ids
    undecodable_ids(enc, rows)     a model's embedding rows its tokenizer has no token for
                                   (never generated)
"""

import os
import unicodedata
from collections import Counter
from functools import cache

import regex
import tiktoken

from support.files import DAMAGED, abridged, expect, is_int, read_json


# The pre-tokenizers of the byte-level BPE families, each as the one regex tiktoken splits with.
# GPT-2's, also what tokenizers' ByteLevel pre-tokenizer splits with when use_regex is true.
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Qwen2/3's (the Split pattern of their tokenizer.json): unlike GPT-2's, every digit is its own
# piece and a letter run takes one leading non-letter ("_name", "(x")
QWEN2_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
             r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Llama 3's: numbers in runs of up to three digits
LLAMA3_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
              r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# SmolLM2's (and StarCoder's): tokenizers' Digits(individual_digits) cuts the text around every
# digit, then GPT-2's regex splits each part. As one regex: a digit is a piece, GPT-2's " ?\p{N}+"
# never applies, and a whitespace run before a digit ends its part, so it is taken whole as at the
# text's end.
SMOLLM_PAT = (r"""\p{N}|'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})"""
              r"""|\s+(?!\S)|\s+""")

# spell each piece's bytes, one character a byte
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False}
# tokenizer.json's pre_tokenizer (its steps, as pre_tokenizer_steps lists them) -> the regex above
PRE_TOKENIZERS = {
    "Qwen2/3": ([{"type": "Split", "pattern": {"Regex": QWEN2_PAT}, "behavior": "Isolated",
                  "invert": False},
                 {**BYTE_LEVEL, "use_regex": False}], QWEN2_PAT),
    "Llama 3": ([{"type": "Split", "pattern": {"Regex": LLAMA3_PAT}, "behavior": "Isolated",
                  "invert": False},
                 {**BYTE_LEVEL, "use_regex": False}], LLAMA3_PAT),
    "GPT-2": ([{**BYTE_LEVEL, "use_regex": True}], GPT2_PAT),
    "SmolLM2": ([{"type": "Digits", "individual_digits": True}, {**BYTE_LEVEL, "use_regex": True}],
                SMOLLM_PAT),
}
NORMALIZERS = (None, {"type": "NFC"})      # none, or Qwen's NFC
# the BPE model's options this encoding implements (their defaults)
MODEL_OPTIONS = {"dropout": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
                 "byte_fallback": False}


@cache
def byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character that stands for each byte -> that byte.

    Byte-level BPE vocabularies (GPT-2's, Qwen's, SmolLM2's) spell every token with one printable
    character per byte: the 188 printable Latin-1 bytes stand for themselves, the other 68
    (controls, space, ...) for chr(256), chr(257), ... in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
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
    chat_template: the folder's Jinja chat template, or None. around: the ids the post-processor
    puts before and after a text it encodes as a sequence (Llama 3's BOS), for support.tokenizer's
    encode_prompt.
    """

    def __init__(self, name, *, pat_str, mergeable_ranks, special_tokens, text_tokens, nfc,
                 chat_template, template_tokens, around=((), ())):
        super().__init__(name, pat_str=pat_str, mergeable_ranks=mergeable_ranks,
                         special_tokens=special_tokens)
        self.around = around
        self.text_tokens = text_tokens  # the non-special added tokens, found in text
        self.split_text_tokens = alternation(text_tokens)
        self.nfc, self.chat_template = nfc, chat_template
        # the tokens a chat template's markers may be (bos/eos strings)
        self.template_tokens = template_tokens
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
            # the reference's pieces, minus the missing bytes
            for piece in self.pieces.findall(part):
                kept = piece.encode("utf-8").translate(None, self.missing)
                if kept:
                    # tiktoken's BPE of one piece, no regex split
                    ids += self._encode_single_piece(kept)
        return ids


def alternation(strings):
    """A function splitting a text around every occurrence of `strings`: [text, match, text, ...],
    leftmost first and the longest at a place first, as the reference's added-token matcher does."""
    if not strings:
        return lambda text: [text]
    pattern = regex.compile("(" + "|".join(map(regex.escape,
                                               sorted(strings, key=len, reverse=True))) + ")")
    return pattern.split


def pre_tokenizer_steps(spec):
    """tokenizer.json's pre_tokenizer as a list of steps, each with only the fields that change how
    text is split (offsets, for one, do not)."""
    pre = spec.get("pre_tokenizer") or {}
    listed = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" \
        else [pre]
    if not isinstance(listed, list) or not all(isinstance(step, dict) for step in listed):
        return pre  # not a pre-tokenizer: matches no family
    steps = []
    for step in listed:
        fields = {"Split": ("type", "pattern", "behavior", "invert"),
                  "ByteLevel": ("type", "add_prefix_space", "use_regex"),
                  "Digits": ("type", "individual_digits")}.get(str(step.get("type")), step.keys())
        steps.append({k: step.get(k) for k in fields})
    return steps


def merge_ranks(vocab, merges, special_ids, ignore_merges, path):
    """tiktoken's mergeable ranks (token bytes -> id) of a byte-level BPE,
    checked against its merges.

    tiktoken joins the adjacent pair of parts whose concatenation is the token of lowest id, any
    such pair, and takes a piece of text that is a whole token as that token; the reference joins
    only the pairs `merges` lists, the one listed first first, and takes a whole token as itself
    only with ignore_merges. Checked here: (a) each merge's result has an id no lower than the
    results of the merges before it, (b) every multi-byte token is some merge's result, (c) both
    join each token's own bytes alike (bpe_parts): into the token itself, or with ignore_merges into
    the same parts. Without one of them the two encode some text differently (without (c): the
    token's own text, or text around it), so the vocabulary is refused; with all three they agreed
    on every text tried (trained vocabularies, SmolLM2's, Qwen's converted from tiktoken's, and
    thousands of random ones against the reference). Raises ValueError naming the first offending
    merge or token.
    """
    byte_of = byte_of_char()
    ranks, by_id = {}, {}  # token bytes -> id, and token as spelled -> id, for the BPE's own tokens
    for token, rank in vocab.items():
        if rank in special_ids:
            # a special token listed in the vocabulary (SmolLM2's <|im_start|>) is no BPE token
            continue
        try:
            ranks[bytes(byte_of[c] for c in token)] = by_id[token] = rank
        except KeyError as e:
            raise ValueError(f"{path}: the vocabulary token {token!r} has the character {e}, "
                             "outside the byte-level alphabet; "
                             "the file is damaged or not a byte-level BPE") from None
    last, made, rank_of = -1, set(), {}  # rank_of: (left, right) -> its place in merges
    for k, merge in enumerate(merges):
        pair = merge.split(" ") if isinstance(merge, str) else merge
        expect(isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair),
               path, f"merge {k} ({merge!r}) is not two tokens")
        left, right = pair
        rank = vocab.get(left + right)
        if rank is None or left not in vocab or right not in vocab:
            raise ValueError(f"{path}: merge {k} ({left!r}, {right!r}) joins or makes a token the "
                             "vocabulary lacks; the file is damaged")
        if rank < last:
            raise ValueError(f"{path}: the vocabulary is not in merge order "
                             f"(merge {k} makes id {rank}, after a merge that made id {last}); "
                             "tiktoken ranks tokens by id, so it would encode differently "
                             "from this tokenizer: not supported")
        last = rank
        made.add(rank)
        rank_of.setdefault((left, right), k)
    unmade = sorted(rank for token, rank in ranks.items() if len(token) > 1 and rank not in made)
    if unmade:
        raise ValueError(f"{path}: tokens {abridged([str(r) for r in unmade])} are longer than "
                         "a byte but no merge makes them; tiktoken would make them where the "
                         "reference cannot: not supported")
    differ = []
    for token in by_id:
        if len(token) > 1:
            by_merges = bpe_parts(token, lambda a, b: rank_of.get((a, b)))
            by_ids = bpe_parts(token, lambda a, b: by_id.get(a + b)) if ignore_merges else [token]
            if by_merges != by_ids:
                differ.append((by_id[token], token, by_merges, by_ids))
    if differ:
        rank, token, by_merges, by_ids = min(differ)
        raise ValueError(f"{path}: its merges join the bytes of token {rank} ({token!r}) into "
                         f"{by_merges}, where tiktoken makes {by_ids}" +
                         (f" ({len(differ) - 1} more tokens alike)" if len(differ) > 1 else "") +
                         "; tiktoken would encode differently from this tokenizer: not supported")
    return ranks


def bpe_parts(token, priority):
    """The parts a byte-pair encoding makes of `token` (a str, one character a byte): while some
    pair of adjacent parts has a priority (priority(left, right) is not None), join the pair of
    lowest priority, the leftmost among equals, as the reference `tokenizers` does (priority: its
    place in merges) and tiktoken does (priority: the id of the joined token)."""
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
    added token with "special": true becomes a special token (Qwen3: <|endoftext|>=151643,
    <|im_start|>, <|im_end|>, ...; ReFusion adds <|beginoftext|>=151669 and <|mask|>=151670; SmolLM2
    lists its 17 in the vocabulary too, ids 0..16): decode() writes it, encode() never makes it from
    text. An added token with "special": false (Qwen3's <think>) is found in the text, as the
    reference does. The pre-tokenizer must be one of PRE_TOKENIZERS, the normalizer none or NFC. A
    chat template, when the folder has one (tokenizer_config.json's chat_template or
    chat_template.jinja), rides along as .chat_template.
    Raises FileNotFoundError without tokenizer.json; ValueError naming the file and what is not
    supported (another model, normalizer, pre-tokenizer or decoder, BPE options, an added token that
    is not special but strips or matches words only, an unknown token for missing bytes, merges that
    tiktoken would apply otherwise: merge_ranks), is inconsistent (an id given twice, an added token
    reusing another token's id) or malformed (not JSON: read_json; fields of the wrong type).
    """
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no tokenizer.json in {folder!r}: hf:FOLDER must name a "
                                "Hugging Face model folder holding one "
                                "(as Qwen3's, SmolLM2's and ReFusion's releases do)")
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
        raise ValueError(f"{path}: {'; '.join(unsupported)} not supported: this reads byte-level "
                         "BPE tokenizers (no normalizer or NFC; "
                         f"the pre-tokenizer of {', '.join(PRE_TOKENIZERS)})")
    nfc = spec.get("normalizer") is not None
    vocab, merges, added = model.get("vocab"), model.get("merges", []), \
        spec.get("added_tokens") or []
    expect(isinstance(vocab, dict) and all(is_int(rank) for rank in vocab.values()), path,
           "model.vocab is not an object of tokens to ids (whole numbers from 0)")
    expect(isinstance(merges, list), path, "model.merges is not a list")
    well_formed = [isinstance(t, dict) and is_int(t.get("id")) and
                   isinstance(t.get("content"), str) and t["content"]
                   for t in added] if isinstance(added, list) else [False]
    expect(all(well_formed), path,
           "added_tokens is not a list of objects, each with an id (a whole number from 0) and a "
           "content (a string)")
    token_of = {}
    for token, rank in vocab.items():
        expect(token_of.setdefault(rank, token) == token, path,
               f"model.vocab gives id {rank} to both {token_of[rank]!r} and {token!r}")
    twice = [repr(x) for x, n in Counter([t["id"] for t in added] +
                                         [t["content"] for t in added]).items() if n > 1]
    expect(not twice, path, f"added_tokens lists {abridged(twice)} more than once")
    for t in added:
        clash = token_of.get(t["id"], t["content"])
        if clash != t["content"] or vocab.get(t["content"], t["id"]) != t["id"]:
            raise ValueError(f"{path}: added token {t['content']!r} (id {t['id']}) clashes with "
                             f"the vocabulary's {clash!r}; give each added token an id of its own, "
                             "or its own vocabulary entry")
        flags = [k for k in ("lstrip", "rstrip", "single_word") if t.get(k)] + \
            ["normalized"] * (nfc and t.get("normalized", True))
        if not t.get("special") and flags:
            raise ValueError(f"{path}: added token {t['content']!r} is not special and has "
                             f"{', '.join(flags)} set; only "
                             "non-special added tokens matched exactly as written are supported")
    ranks = merge_ranks(vocab, merges, {t["id"] for t in added},
                        model.get("ignore_merges", False), path)
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing and model.get("unk_token") is not None:
        raise ValueError(f"{path}: bytes {missing} have no token and model.unk_token is set; only "
                         "a vocabulary that drops such bytes (unk_token null) is supported")
    config = read_json(os.path.join(folder, "tokenizer_config.json")) \
        if os.path.isfile(os.path.join(folder, "tokenizer_config.json")) else {}
    template = config.get("chat_template")
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, "rb") as f:
            try:
                template = f.read().decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{jinja} is not UTF-8 (byte offset {e.start}); "
                                 f"{DAMAGED}") from None
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{folder}/tokenizer_config.json: chat_template is a list of named "
                         "templates; only a single template is supported")
    template_tokens = {k: v.get("content") if isinstance(v, dict) else v for k, v in config.items()
                       if k in ("bos_token", "eos_token") and v}
    return HFEncoding(f"hf:{folder}", pat_str=PRE_TOKENIZERS[family[0]][1], mergeable_ranks=ranks,
                      special_tokens={t["content"]: t["id"] for t in added},
                      text_tokens={t["content"]: t["id"] for t in added if not t.get("special")},
                      nfc=nfc, chat_template=template, template_tokens=template_tokens,
                      around=post_processor_ids(spec.get("post_processor"), path))


def post_processor_ids(spec, path):
    """(ids before, ids after) that tokenizer.json's post_processor adds around one sequence, as
    the reference does when it encodes a text with its special tokens (AutoTokenizer(text)):
    a TemplateProcessing's special tokens around $A (Llama 3's BOS), nothing for ByteLevel (which
    leaves the ids as they are) or for none, a Sequence of these in turn.
    Raises ValueError naming another kind (RobertaProcessing, BertProcessing), which this does not
    implement."""
    if spec is None or (isinstance(spec, dict) and spec.get("type") == "ByteLevel"):
        return (), ()
    expect(isinstance(spec, dict), path, "post_processor is not an object")
    if spec.get("type") == "Sequence":
        before, after = (), ()
        for step in spec.get("processors") or []:
            b, a = post_processor_ids(step, path)
            before, after = b + before, after + a
        return before, after
    if spec.get("type") != "TemplateProcessing":
        raise ValueError(f"{path}: post_processor {spec.get('type')!r} is not supported: this "
                         "applies TemplateProcessing (special tokens around the text) and "
                         "ByteLevel")
    single, specials = spec.get("single"), spec.get("special_tokens") or {}
    pieces = [next(iter(item.items())) for item in single or [] if isinstance(item, dict) and item]
    names = [kind for kind, _ in pieces]
    expect(names.count("Sequence") == 1 and set(names) <= {"Sequence", "SpecialToken"}, path,
           "post_processor.single is not one sequence with special tokens around it")

    def ids_of(part):  # the ids of the special tokens in part, as special_tokens lists them
        ids = []
        for _, item in part:
            token = specials.get(item.get("id")) if isinstance(item, dict) else None
            expect(isinstance(token, dict) and all(is_int(i) for i in token.get("ids", [None])),
                   path, f"post_processor names the special token {item!r} without its ids")
            ids += token["ids"]
        return tuple(ids)
    at = names.index("Sequence")
    return ids_of(pieces[:at]), ids_of(pieces[at + 1:])


MASK_TOKEN = "<|mask|>"                          # ReFusion's (151670 in its release)
EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")     # the end of a chat turn, then of a document


def hf_special_ids(folder: str) -> tuple[tuple[int, ...], int | None, int]:
    """
    (eos_ids, mask_id, pad_id) of a Hugging Face folder, from its files as transformers reads them.

    eos_ids: the ids generation stops at, as transformers' generate takes them: generation_config
             .json's eos_token_id (an id or a list; where it names an end-of-turn token only there,
             vllm#4180), else config.json's; a folder naming none stops at <|im_end|> (the end of a
             chat turn) and <|endoftext|>, those its tokenizer has, in that order.
    mask_id: <|mask|> (151670 in ReFusion's release), else config.json's mask_token_id; None for a
             plain Qwen3 or Llama, which has no mask token and so cannot be decoded with ReFusion.
    pad_id:  config.json's pad_token_id (a negative one, as transformers takes it, means none),
             else the last EOS id: <|endoftext|>, Qwen's padding token.
    Raises what hf_tokenizer raises, and ValueError when no EOS id is found, or naming the file
    when one of its ids is not a whole number, or when they or the tokenizer's ids do not fit the
    model's embedding rows, its vocab_size (undecodable_ids).
    """
    enc = hf_tokenizer(folder)
    added = {token: enc.encode_single_token(token) for token in enc.special_tokens_set}
    config_path = os.path.join(folder, "config.json")
    config = read_json(config_path) if os.path.isfile(config_path) else {}
    generation_path = os.path.join(folder, "generation_config.json")
    generation = read_json(generation_path) if os.path.isfile(generation_path) else {}

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
                         "among its added_tokens, and neither generation_config.json nor "
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
    """The ids below `rows` that the tiktoken Encoding `enc` cannot decode, a tuple: a model's
    embedding rows past its tokenizer's ids (Qwen3's and ReFusion's 151,936 rows hold 151,671 ids,
    the rest pad the matrix to a multiple of 128) and any gap between ids. A model may still give
    them probability; the decoders are told to ban them (sampling.make_decoder), as they ban the
    mask id, since decode() has no text for them.
    rows: the model's embedding rows (vocab_size); model: names it in messages; special_ids: the ids
    the model is used with (EOS, mask, pad; None for none), checked with the tokenizer's own.
    Raises ValueError naming enc and the model when any of these ids is at or beyond rows: the model
    has no embedding row for it (IndexError when it is fed), so the tokenizer is not this model's.
    """
    known = set(enc._mergeable_ranks.values()) | set(enc._special_tokens.values())
    beyond = sorted({i for i in known | set(special_ids) if i is not None and i >= rows})
    if beyond:
        raise ValueError(f"token ids {abridged([str(i) for i in beyond])} (of the tokenizer "
                         f"{enc.name} and its special tokens) are at or beyond the {rows} "
                         f"embedding rows of {model}; the tokenizer is "
                         "not this model's: use the tokenizer.json released with these weights")
    return tuple(i for i in range(rows) if i not in known)
