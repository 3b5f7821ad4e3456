"""
Everything about turning text into token batches.

    text records {"query", "response"}  ->  prepare()  ->  data/<name>-<tokenizer>-<block_size>/
        train.bin, val.bin                 all samples' tokens, uint16, back to back
        train_samples.npy, val_samples.npy (N, 3) int64: [start in .bin, prompt_len, total_len]
        meta.json                          tokenizer, special ids, counts; written last
    TokenDataset(data_dir, split).get_batch(...)  ->  right-padded (B, T) int64 batches

A sample is the query's tokens (the prompt, never predicted) followed by the response's tokens
and one EOS. As in nanoGPT, tokenization happens once, in prepare(); training reads memmaps.
"""

import ast
import hashlib
import json
import os
import platform
import random
import re
import sysconfig
import tempfile
import unicodedata
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from itertools import zip_longest

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

import numpy as np
import tiktoken
import torch

EOS, MASK, PAD = "<|endoftext|>", "<|mask|>", "<|pad|>"
TOKENIZERS = ("bytes", "gpt2")
TEXT_WINDOW_BYTES = 1024  # plain-text files are cut into windows of at most this many UTF-8 bytes
VAL_PERCENT = 5  # share of records that go to the validation split
FORMAT = 1  # version of the prepared-data layout, stored in meta.json

# -----------------------------------------------------------------------------
# tokenizer

# GPT-2's pre-tokenization regex, so the byte tokenizer splits text the way GPT-2 does
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Qwen2/3's (the Split pattern of their tokenizer.json): unlike GPT-2's, every digit is its own piece
# and a letter run takes one leading non-letter ("_name", "(x")
QWEN2_PAT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


@cache
def get_tokenizer(name: str = "bytes") -> tiktoken.Encoding:
    """
    Return the tiktoken Encoding called `name`, with EOS, MASK and PAD as special tokens
    (hf:FOLDER: the folder's own special tokens).

    "bytes": one token per byte (ids 0..255) + EOS=256, MASK=257, PAD=258; n_vocab = 259.
             Built in code, needs no download: the offline default.
    "gpt2":  GPT-2's BPE (ids 0..50255) + EOS=50256, MASK=50257, PAD=50258; n_vocab = 50259.
             tiktoken downloads the BPE file once and caches it (see TIKTOKEN_CACHE_DIR).
    "hf:FOLDER": the tokenizer.json of a Hugging Face model folder (Qwen3, ReFusion), see
             hf_tokenizer; its special ids come from hf_special_ids, not special_ids.
    Raises ValueError for an unknown name, FileNotFoundError if the GPT-2 BPE file cannot be had,
    and what hf_tokenizer raises.
    """
    if name.startswith("hf:"):
        return hf_tokenizer(name[len("hf:"):])
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


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character that stands for each byte -> that byte.

    Byte-level BPE vocabularies (GPT-2's, Qwen's) spell every token with one printable character per
    byte: the 188 printable Latin-1 bytes stand for themselves, the other 68 (controls, space, ...)
    for chr(256), chr(257), ... in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}


def hf_tokenizer(folder: str) -> tiktoken.Encoding:
    """
    The tiktoken Encoding of a Hugging Face folder's tokenizer.json: Qwen2/3's byte-level BPE.

    model.vocab maps each token, spelled in GPT-2's byte-level alphabet, to its id; decoded back to
    bytes these are tiktoken's mergeable ranks (an id is a merge rank: Qwen's vocabulary was made with
    tiktoken, its merges list follows the ids). Every entry of added_tokens becomes a special token
    (Qwen3: <|endoftext|>=151643, <|im_start|>, <|im_end|>, ...; ReFusion adds <|beginoftext|>=151669
    and <|mask|>=151670): decode() writes it, encode() never makes it from text. encode() also applies
    the NFC normalizer that tokenizer.json names, so call it rather than enc.encode_ordinary.
    Raises FileNotFoundError without tokenizer.json; ValueError when it is not Qwen2/3's tokenizer
    (another normalizer, pre-tokenizer or model) or an added token reuses a vocabulary id.
    """
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no tokenizer.json in {folder!r}: hf:FOLDER must name a Hugging Face model "
                                "folder holding one (as Qwen3's and ReFusion's releases do)")
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    # Qwen2/3: split the text with QWEN2_PAT, then spell each piece's bytes in the byte-level alphabet
    steps = [(s.get("type"), s.get("pattern"), s.get("behavior"), s.get("add_prefix_space", False),
              s.get("use_regex", False)) for s in pre.get("pretokenizers", [pre])]
    qwen_steps = [("Split", {"Regex": QWEN2_PAT}, "Isolated", False, False), ("ByteLevel", None, None, False, False)]
    if model.get("type") != "BPE" or spec.get("normalizer") != {"type": "NFC"} or steps != qwen_steps:
        raise ValueError(f"{path} is not Qwen2/3's tokenizer (NFC normalizer, split with Qwen's regex, then "
                         "byte-level BPE); only that tokenizer family is supported")
    byte_of = _byte_of_char()
    try:
        ranks = {bytes(byte_of[c] for c in token): rank for token, rank in model["vocab"].items()}
    except KeyError as e:
        raise ValueError(f"{path}: a vocabulary token has the character {e}, outside the byte-level alphabet; "
                         "the file is damaged or not a byte-level BPE") from None
    specials = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    if set(ranks.values()) & set(specials.values()):
        raise ValueError(f"{path}: added_tokens reuse ids of model.vocab; give each added token an id of its own")
    return tiktoken.Encoding(name=f"hf:{folder}", pat_str=QWEN2_PAT, mergeable_ranks=ranks, special_tokens=specials)


def hf_special_ids(folder: str) -> tuple[tuple[int, ...], int | None, int]:
    """
    (eos_ids, mask_id, pad_id) of a Hugging Face folder, from its added tokens and config.json.

    eos_ids: the ids of <|im_end|> (ends a chat turn: what instruction-tuned models, ReFusion among
             them, emit) and <|endoftext|>, those the tokenizer has, in that order.
    mask_id: <|mask|> (151670 in ReFusion's release), else config.json's mask_token_id; None for a
             plain Qwen3, which has no mask token and so cannot be decoded with ReFusion.
    pad_id:  config.json's pad_token_id, else the last EOS id: <|endoftext|>, Qwen's padding token.
    Raises what hf_tokenizer raises, and ValueError when the tokenizer has neither EOS token.
    """
    enc = get_tokenizer(f"hf:{folder}")
    added = {token: enc.encode_single_token(token) for token in enc.special_tokens_set}
    eos_ids = tuple(added[token] for token in ("<|im_end|>", EOS) if token in added)
    if not eos_ids:
        raise ValueError(f"{folder}/tokenizer.json has neither <|im_end|> nor {EOS} among its added_tokens, "
                         "so generation could not stop; add them as Qwen's tokenizer.json has them")
    config_path, config = os.path.join(folder, "config.json"), {}
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    mask_id = added.get(MASK, config.get("mask_token_id"))
    pad_id = config.get("pad_token_id")
    if pad_id is None:
        pad_id = eos_ids[-1]
    return eos_ids, mask_id, pad_id


def special_ids(enc: tiktoken.Encoding) -> tuple[int, int, int]:
    """(eos_id, mask_id, pad_id) of a tokenizer from get_tokenizer ("bytes" or "gpt2").

    Raises ValueError for a Hugging Face tokenizer (hf:FOLDER), whose ids hf_special_ids gives.
    """
    if enc.name.startswith("hf:"):
        raise ValueError(f"{enc.name} has its own special tokens: use hf_special_ids(folder), not special_ids")
    return enc.encode_single_token(EOS), enc.encode_single_token(MASK), enc.encode_single_token(PAD)


def encode(enc: tiktoken.Encoding, text: str) -> list[int]:
    """Token ids of `text`. Special-token strings in the text stay plain text, never special ids.

    A tokenizer from a Hugging Face folder (hf:FOLDER) first NFC-normalizes the text, as its
    tokenizer.json says (so "e" + U+0301 and "é" give the same ids).
    """
    if enc.name.startswith("hf:"):
        text = unicodedata.normalize("NFC", text)
    return enc.encode_ordinary(text)


def decode(enc: tiktoken.Encoding, ids) -> str:
    """Text of `ids` (ints, special ids included); broken UTF-8 becomes U+FFFD, never an error."""
    return enc.decode([int(i) for i in ids], errors="replace")

# -----------------------------------------------------------------------------
# records: {"query": str, "response": str, "module": str, "name": str}


def split_of(record: dict) -> str:
    """
    "train" or "val" for a record, from a stable hash of f"{module}:{name}" (VAL_PERCENT% val).
    The same record lands in the same split on every machine and every run.
    """
    digest = hashlib.sha1(f"{record['module']}:{record['name']}".encode()).digest()
    # 8 bytes, not 1: a single byte % 100 would favour 0..55 and give ~5.9% val
    return "val" if int.from_bytes(digest[:8], "big") % 100 < VAL_PERCENT else "train"


SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages"}


def _stdlib_files(root: str) -> list[tuple[str, str]]:
    """(path, dotted module name) of the non-test .py files under `root`, in sorted order."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for fn in sorted(filenames):
            if not fn.endswith(".py") or fn.startswith("test_"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, fn), root)[:-len(".py")]
            parts = rel.split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files.append((os.path.join(dirpath, fn), ".".join(parts)))
    return sorted(files)


def _functions(tree: ast.AST, prefix: str = ""):
    """Yield (qualified name, node) for every (async) function, methods and nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + node.name
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from _functions(node, name + ".")
        else:
            yield from _functions(node, prefix)  # defs under if/try/with keep the same prefix


def _dedent(lines: list[str], indent: str) -> list[str]:
    """
    Remove the `def` line's `indent` from each line; whitespace-only lines become empty.

    Not textwrap.dedent: one string literal written at column 0 would stop it dedenting anything.
    Lines that do not start with `indent` (inside such literals) stay as written.
    """
    return [line.removeprefix(indent) if line.strip() else "" for line in lines]


def function_records(source: str, module: str, max_chars: int | None = None) -> list[dict]:
    """
    Records of the documented functions in one module's `source` (newlines already '\\n').

    query    = the lines from `def` (decorators excluded) to the docstring's last line;
    response = the remaining lines of the body. Both end with "\\n" and lose the `def` line's
    indentation; query + response is the function's source so dedented. Functions whose body
    is only a docstring, or whose query + response exceeds `max_chars`, are left out.
    Raises SyntaxError if `source` does not parse.
    """
    lines = source.split("\n")
    records = []
    for name, node in _functions(ast.parse(source)):
        if ast.get_docstring(node, clean=False) is None:
            continue
        # node.lineno is the `def` line; decorators have their own lines before it
        indent = lines[node.lineno - 1][:node.col_offset]
        body = _dedent(lines[node.lineno - 1:node.end_lineno], indent)
        head = node.body[0].end_lineno - node.lineno + 1  # lines up to the docstring's end
        query, response = "\n".join(body[:head]) + "\n", "\n".join(body[head:]) + "\n"
        too_long = max_chars is not None and len(query) + len(response) > max_chars
        if not response.strip() or too_long:
            continue
        records.append({"query": query, "response": response, "module": module, "name": name})
    return records


def stdlib_records(max_chars: int | None = None) -> list[dict]:
    """
    The built-in real corpus: every documented function of the running interpreter's standard
    library, as {"query": signature + docstring, "response": rest of the body, "module", "name"}.

    Test packages and site-packages are skipped; so are files that are not UTF-8 or do not parse
    (their count is printed). The result depends on the Python version (stored in meta.json).
    """
    root = sysconfig.get_paths()["stdlib"]
    records, unreadable = [], 0
    for path, module in _stdlib_files(root):
        with open(path, "rb") as f:
            raw = f.read()
        try:
            # ast counts \r\n and \r as line ends too; normalise so our line numbers agree
            source = raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
            records += function_records(source, module, max_chars)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            unreadable += 1
    if unreadable:
        print(f"stdlib_records: skipped {unreadable} files that are not UTF-8 or do not parse")
    return records

# -----------------------------------------------------------------------------
# the built-in arithmetic corpus: column-by-column worked solutions with a checkable final answer

ARITH_DIGITS = (3, 6)  # operand digits; with the byte tokenizer responses are ~60 to ~125 tokens


def _columns(n: int) -> list[int]:
    """Decimal digits of n >= 0, least significant first."""
    return [int(c) for c in reversed(str(n))]


def _add_steps(a: int, b: int) -> list[str]:
    """One line per column of a + b, e.g. "8+9+0=17 carry 1" (the first column has no carry in)."""
    lines, carry = [], 0
    for i, (x, y) in enumerate(zip_longest(_columns(a), _columns(b), fillvalue=0)):
        s = x + y + carry
        lines.append((f"{x}+{y}" if i == 0 else f"{x}+{y}+{carry}") + f"={s} carry {s // 10}")
        carry = s // 10
    return lines


def _subtract_steps(a: int, b: int) -> list[str]:
    """One line per column of a - b (a >= b), e.g. "12-3-1=8 borrow 1": the top digit is shown
    with the 10 it borrowed, so every line is literally true."""
    lines, borrow = [], 0
    for i, (x, y) in enumerate(zip_longest(_columns(a), _columns(b), fillvalue=0)):
        out = int(x - y - borrow < 0)
        top = x + 10 * out
        lines.append((f"{top}-{y}" if i == 0 else f"{top}-{y}-{borrow}") + f"={top - y - borrow} borrow {out}")
        borrow = out
    return lines


def _multiply_steps(a: int, m: int) -> list[str]:
    """One line per column of a * m (m one digit), e.g. "2*7+4=18 carry 1"."""
    lines, carry = [], 0
    for i, x in enumerate(_columns(a)):
        s = x * m + carry
        lines.append((f"{x}*{m}" if i == 0 else f"{x}*{m}+{carry}") + f"={s} carry {s // 10}")
        carry = s // 10
    return lines


def _operand(rng: random.Random) -> int:
    """A number whose digit count is uniform over ARITH_DIGITS (so short and long ones are equally common)."""
    digits = rng.randint(*ARITH_DIGITS)
    return rng.randint(10 ** (digits - 1), 10 ** digits - 1)


def _arith_problem(rng: random.Random) -> tuple[str, list[str], int]:
    """(query, worked step lines, answer) of one problem: add, subtract or multiply by one digit."""
    a, b = _operand(rng), _operand(rng)
    op = rng.choice(("add", "subtract", "multiply"))
    if op == "add":
        return f"Add {a} and {b}.\n", _add_steps(a, b), a + b
    if op == "subtract":
        a, b = max(a, b), min(a, b)
        return f"Subtract {b} from {a}.\n", _subtract_steps(a, b), a - b
    m = rng.randint(2, 9)
    return f"Multiply {a} by {m}.\n", _multiply_steps(a, m), a * m


def arithmetic_records(n: int = 20000, seed: int = 0) -> list[dict]:
    """
    The built-in checkable corpus: n distinct multi-digit arithmetic problems, generated in code.

    query    e.g. "Add 4821 and 937.\n", "Subtract 937 from 4821.\n", "Multiply 4821 by 7.\n"
             (operands of 3 to 6 digits; the multiplier one digit, 2 to 9);
    response one line per column, least significant first, then "answer: <n>\n", e.g.
             "1+7=8 carry 0\n2+3+0=5 carry 0\n8+9+0=17 carry 1\n4+0+1=5 carry 0\nanswer: 5758\n".
    module "arith", name the record's index. Deterministic for a given seed (random.Random(seed)).
    """
    rng = random.Random(seed)
    records, seen = [], set()
    while len(records) < n:
        query, steps, answer = _arith_problem(rng)
        if query in seen:
            continue  # a repeated problem could land in both splits and leak its answer into val
        seen.add(query)
        response = "".join(line + "\n" for line in steps) + f"answer: {answer}\n"
        records.append({"query": query, "response": response, "module": "arith", "name": str(len(records))})
    return records


ARITH_QUERIES = (  # (query pattern, the answer from its two numbers), independent of the generator
    (re.compile(r"Add (\d+) and (\d+)\."), lambda a, b: a + b),
    (re.compile(r"Subtract (\d+) from (\d+)\."), lambda b, a: a - b),
    (re.compile(r"Multiply (\d+) by (\d+)\."), lambda a, b: a * b),
)


def arithmetic_expected(query: str) -> str:
    """The correct answer to an arithmetic_records query, computed from its text with Python ints.

    Raises ValueError if the query is not one of the three forms.
    """
    for pattern, op in ARITH_QUERIES:
        match = pattern.fullmatch(query.strip())
        if match:
            return str(op(int(match[1]), int(match[2])))
    raise ValueError(f"not an arithmetic query: {query!r}")


def arithmetic_answer(text: str) -> str | None:
    """The final answer in a (generated) response: the text after the last "answer: " up to the
    line end, stripped; None when the text has no "answer: " (e.g. a truncated generation)."""
    _, found, tail = text.rpartition("answer: ")
    return tail.split("\n", 1)[0].strip() if found else None

# -----------------------------------------------------------------------------
# a user's own records

FORMAT_HELP = ("expected a .json file holding a JSON list of objects with string 'query' and "
               "'response' fields, a .jsonl file with one such object per line, or plain text")


def _read_text(path: str) -> str:
    """The file's text. Raises FileNotFoundError, or ValueError if empty or not UTF-8."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path!r} does not exist; check the path")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 at byte offset {e.start}; "
                         "re-save the file as UTF-8") from None
    if not text.strip():
        raise ValueError(f"{path}: the file is empty; {FORMAT_HELP}")
    return text


def _check_record(obj, where: str, path: str) -> dict:
    """The query/response of one JSON record, or a ValueError that says which record is wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: {where} is a {type(obj).__name__}, not an object; {FORMAT_HELP}")
    for key in ("query", "response"):
        if key not in obj:
            raise ValueError(f"{path}: {where} has no {key!r} field; {FORMAT_HELP}")
        if not isinstance(obj[key], str):
            raise ValueError(f"{path}: {where}: {key!r} must be a string, "
                             f"not {type(obj[key]).__name__}")
    for key in ("query", "response"):  # an empty query leaves nothing to condition on at decoding
        if not obj[key]:
            raise ValueError(f"{path}: {where} has an empty {key}; remove it or fill it in")
    return {"query": obj["query"], "response": obj["response"]}


def _parse_json(text: str, path: str) -> list[dict]:
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON at line {e.lineno}, "
                         f"column {e.colno}: {e.msg}") from None
    if not isinstance(rows, list):
        raise ValueError(f"{path}: top level is a {type(rows).__name__}, not a list; {FORMAT_HELP}")
    return [_check_record(obj, f"record {i}", path) for i, obj in enumerate(rows)]


def _parse_jsonl(text: str, path: str) -> list[dict]:
    records = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue  # blank lines, e.g. a trailing newline, are not records
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON on line {lineno}: {e.msg}") from None
        records.append(_check_record(obj, f"record {len(records)} (line {lineno})", path))
    return records


def _parse_text(text: str, window_bytes: int) -> list[dict]:
    """Consecutive windows of at most window_bytes UTF-8 bytes, cut between characters (a byte is
    a token of the byte tokenizer, and every GPT-2 token is at least one byte, so a window never
    exceeds window_bytes tokens, whatever the script); the first quarter of a window's characters
    is the query. Raises ValueError when a single character does not fit."""
    raw, records, start = text.encode("utf-8"), [], 0
    while start < len(raw):
        end = min(start + window_bytes, len(raw))
        while end < len(raw) and raw[end] & 0xC0 == 0x80:  # a continuation byte: back to the character's start
            end -= 1
        if end == start:
            raise ValueError(f"a window of {window_bytes} bytes cannot hold one character; raise --block_size")
        window = raw[start:end].decode("utf-8")
        cut = len(window) // 4
        records.append({"query": window[:cut], "response": window[cut:]})
        start = end
    return records


def load_records(path: str, window_bytes: int = TEXT_WINDOW_BYTES) -> list[dict]:
    """
    A user's records from `path`, as {"query", "response", "module": file name, "name": index}.

    .json:  a JSON list of {"query": str, "response": str, ...} (the ReFusion release's format);
    .jsonl: one such object per line;
    other:  plain text, cut into windows of at most window_bytes UTF-8 bytes, each window's
            first quarter the query and the rest the response.
    Raises FileNotFoundError for a missing file and ValueError (naming the record, line, column
    or byte offset) for an empty file, bad UTF-8, bad JSON, or a malformed record.
    """
    text = _read_text(path)
    ext = os.path.splitext(path)[1].lower()
    if ext == ".json":
        records = _parse_json(text, path)
    elif ext == ".jsonl":
        records = _parse_jsonl(text, path)
    else:
        records = _parse_text(text, window_bytes)
    if not records:
        raise ValueError(f"{path}: holds no records; {FORMAT_HELP}")
    module = os.path.basename(path)
    return [dict(r, module=module, name=str(i)) for i, r in enumerate(records)]

# -----------------------------------------------------------------------------
# prepare: records -> token files on disk

# built-in corpora; anything else is a path. "arith-1m" holds 1,000,000 problems (116M byte tokens
# of training data) for GPU runs; its first 20,000 are "arith"'s, in the same splits.
DATASETS = {"stdlib": stdlib_records, "arith": arithmetic_records,
            "arith-1m": lambda: arithmetic_records(1_000_000)}


def _write_atomic(path: str, write) -> None:
    """Call write(file) on a temp file in path's directory, then rename it to `path`."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o644)  # mkstemp makes files private; these are ordinary data files
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _tokenize(records: list[dict], enc, block_size: int, too_long: str) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens (n,) uint16, samples (N, 3) int64, number of records skipped as too long).
    too_long: "skip" such records, or "fail" (ValueError naming the record and the limit)."""
    eos_id = special_ids(enc)[0]
    chunks, samples, skipped, start = [], [], 0, 0
    for r in records:
        prompt = encode(enc, r["query"])
        ids = prompt + encode(enc, r["response"]) + [eos_id]
        if len(ids) > block_size:
            if too_long == "fail":
                raise ValueError(f"record {r['module']}:{r['name']} is {len(ids)} tokens, longer than "
                                 f"block_size={block_size}; raise --block_size or pass --too_long=skip")
            skipped += 1
            continue
        chunks.append(np.array(ids, dtype=np.uint16))
        samples.append((start, len(prompt), len(ids)))
        start += len(ids)
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint16)
    return tokens, np.array(samples, dtype=np.int64).reshape(-1, 3), skipped


def _source_sha1(dataset: str) -> str | None:
    """Hash of a user's data file, so an edited file is prepared again; None for built-ins."""
    if dataset in DATASETS:
        return None
    with open(dataset, "rb") as f:
        return hashlib.sha1(f.read()).hexdigest()


def _damaged_file(data_dir: str, meta: dict, split: str) -> str | None:
    """The path of the first of a split's files that is missing or does not hold as many tokens or
    samples as meta.json counts (e.g. cut short by a full disk), or None when both are whole."""
    counts = meta.get("counts", {}).get(split, {})
    bin_path, samples_path = (os.path.join(data_dir, f"{split}{end}") for end in (".bin", "_samples.npy"))
    if not os.path.isfile(bin_path) or os.path.getsize(bin_path) != 2 * counts.get("tokens", -1):
        return bin_path
    try:
        if len(np.load(samples_path, mmap_mode="r", allow_pickle=False)) != counts.get("samples"):
            return samples_path
    except (OSError, ValueError):
        return samples_path
    return None


def _is_prepared(data_dir: str, expected: dict) -> bool:
    """True if data_dir holds a finished, whole preparation made with the same settings."""
    try:
        with open(os.path.join(data_dir, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError):
        return False
    return (all(meta.get(k) == v for k, v in expected.items())
            and not any(_damaged_file(data_dir, meta, split) for split in ("train", "val")))


def prepare(dataset: str, tokenizer: str, block_size: int, data_root: str = "data", too_long: str = "skip") -> str:
    """
    Tokenize `dataset` (a DATASETS name or a path for load_records) once and return the data dir,
    data_root/<name>-<tokenizer>-<block_size>, where a file's name is its base name and the first 8
    hex digits of its content's SHA-1 (e.g. data/qa-1f0c9e2a-bytes-384). A finished, matching
    preparation is reused.

    Samples longer than block_size tokens (EOS included) are skipped and counted (too_long="skip")
    or refused with a ValueError naming the first one (too_long="fail").
    Raises FileNotFoundError for an unknown dataset, ValueError if a split gets no samples.
    """
    if dataset not in DATASETS and not os.path.isfile(dataset):
        raise FileNotFoundError(f"no built-in dataset or file named {dataset!r}; "
                                f"built-ins: {sorted(DATASETS)}, or give a path to a data file")
    sha1 = _source_sha1(dataset)
    # a file's name carries its content's hash, so two files both called train.json never share a dir
    name = dataset if dataset in DATASETS else f"{os.path.splitext(os.path.basename(dataset))[0]}-{sha1[:8]}"
    data_dir = os.path.join(data_root, f"{name}-{tokenizer}-{block_size}")
    enc = get_tokenizer(tokenizer)
    expected = {"format": FORMAT, "tokenizer": tokenizer, "vocab_size": enc.n_vocab, "block_size": block_size,
                "python_version": platform.python_version(), "source_sha1": sha1, "too_long": too_long}
    if dataset in DATASETS:  # a file is known by its content (source_sha1), however its path is written
        expected["dataset"] = dataset
    if _is_prepared(data_dir, expected):
        return data_dir
    assert enc.n_vocab <= 2**16, "token ids are stored as uint16"
    os.makedirs(data_dir, exist_ok=True)
    with _exclusive(os.path.join(data_dir, ".lock")):  # torchrun's processes: one prepares, the rest wait
        if not _is_prepared(data_dir, expected):
            _write_splits(dataset, enc, data_dir, block_size, too_long, expected)
    return data_dir


@contextmanager
def _exclusive(lock_path: str):
    """Hold an exclusive lock on lock_path (an empty file) while the block runs; processes that ask
    for it meanwhile wait. Without fcntl (Windows), or on a file system without locks, there is no
    lock: start one process at a time."""
    with open(lock_path, "a") as f:
        if fcntl is not None:
            try:
                fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
            except OSError as e:  # a file system without locks (some network mounts)
                warnings.warn(f"cannot lock {lock_path} ({e}); start one process at a time")
        yield


def _write_splits(dataset, enc, data_dir, block_size, too_long, expected) -> None:
    """Tokenize the records into data_dir's train/val .bin and _samples.npy, then write meta.json last."""
    meta_path = os.path.join(data_dir, "meta.json")
    if os.path.exists(meta_path):
        os.remove(meta_path)  # a stale meta must not vouch for half-rewritten files
    if dataset in DATASETS:
        records = DATASETS[dataset]()
    else:  # a text window leaves room for EOS
        records = load_records(dataset, window_bytes=min(TEXT_WINDOW_BYTES, block_size - 1))
    splits = {split: [r for r in records if split_of(r) == split] for split in ("train", "val")}
    if not splits["val"] and len(splits["train"]) > 1:
        splits["val"] = [splits["train"].pop()]  # a small file: keep one record for validation
        print(f"{dataset}: no record hashed to the validation split; using the last one")
    counts = {}
    for split in ("train", "val"):
        tokens, samples, skipped = _tokenize(splits[split], enc, block_size, too_long)
        if len(samples) == 0 and skipped:
            raise ValueError(f"{dataset}: all {skipped} samples of the {split} split are longer than "
                             f"block_size={block_size} tokens; use a larger --block_size")
        if len(samples) == 0:
            raise ValueError(f"{dataset}: too few records for a {split} split ({len(records)} in all); "
                             "give at least two records")
        _write_atomic(os.path.join(data_dir, f"{split}.bin"), tokens.tofile)
        _write_atomic(os.path.join(data_dir, f"{split}_samples.npy"), lambda f: np.save(f, samples))
        counts[split] = {"samples": len(samples), "tokens": len(tokens), "skipped_too_long": skipped}
        print(f"{split}: {len(samples):,} samples, {len(tokens):,} tokens, "
              f"{skipped:,} skipped as longer than {block_size} tokens")
    eos_id, mask_id, pad_id = special_ids(enc)
    meta = dict(expected, dataset=dataset, eos_id=eos_id, mask_id=mask_id, pad_id=pad_id, counts=counts)
    _write_atomic(meta_path, lambda f: f.write(json.dumps(meta, indent=2).encode()))


# -----------------------------------------------------------------------------
# reading prepared data back


class TokenDataset:
    """One split of a prepared data dir: samples of prompt + response + EOS tokens."""

    def __init__(self, data_dir: str, split: str):
        names = ("meta.json", f"{split}.bin", f"{split}_samples.npy")
        paths = [os.path.join(data_dir, fn) for fn in names]
        for p in paths:
            if not os.path.isfile(p):
                raise FileNotFoundError(f"{p} not found; run data.prepare(...) or train.py "
                                        "first to prepare the data")
        with open(paths[0]) as f:
            self.meta = json.load(f)
        damaged = _damaged_file(data_dir, self.meta, split)
        if damaged:
            raise ValueError(f"{damaged} does not hold what {paths[0]} counts: the prepared data is damaged; "
                             "data.prepare() writes it anew, as train.py and sampler.py do when they start")
        self.tokens = np.memmap(paths[1], dtype=np.uint16, mode="r")
        self.samples = np.load(paths[2], allow_pickle=False)  # (N, 3): start, prompt_len, total_len
        self.pad_id = self.meta["pad_id"]

    def __len__(self) -> int:
        return len(self.samples)

    def sample(self, i: int) -> tuple[list[int], list[int]]:
        """(prompt_ids, response_ids) of sample i; the response ends with EOS."""
        start, prompt_len, total_len = (int(x) for x in self.samples[i])
        ids = self.tokens[start:start + total_len].tolist()
        return ids[:prompt_len], ids[prompt_len:]

    def get_batch(self, batch_size: int, rng: np.random.Generator, device="cpu"):
        """get_batch_at for `batch_size` sample indices drawn uniformly (with replacement) by rng."""
        return self.get_batch_at(rng.integers(0, len(self), size=batch_size), device)

    def get_batch_at(self, indices, device="cpu"):
        """
        The samples at `indices`, right-padded with pad_id to the longest of them (T tokens):
        tokens (B, T) int64, prompt_len (B,) int64, length (B,) int64 (tokens incl. EOS, no pad).
        """
        rows = self.samples[np.asarray(indices, dtype=np.int64)]  # (B, 3)
        tokens = np.full((len(rows), int(rows[:, 2].max())), self.pad_id, dtype=np.int64)
        for b, (start, _, total_len) in enumerate(rows):
            tokens[b, :total_len] = self.tokens[start:start + total_len]
        prompt_len, length = np.ascontiguousarray(rows[:, 1]), np.ascontiguousarray(rows[:, 2])
        return tuple(torch.from_numpy(a).to(device) for a in (tokens, prompt_len, length))


# -----------------------------------------------------------------------------
# training inputs: what each objective feeds the model and what it asks it to predict

IGNORE = -100  # label of a token that is not predicted (F.cross_entropy's ignore_index)


@dataclass
class Batch:
    """One training batch, in the order the model sees it.

    idx:          (B, T) int64 input tokens (mask ids where masked, pad_id after the sample).
    position_ids: (B, T) int64 true position of every token (RoPE).
    labels:       (B, T) int64 target at each input token, IGNORE where none.
    mdm_weight:   (B, T) float32 1 / (p_mask * response length) where the label is a masked token's
                  own token (masked-diffusion loss), 0 where it is a next token (autoregressive loss).
    key_mask:     (B, T) bool, False on padding (used by bidirectional attention), or None.
    """
    idx: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    mdm_weight: torch.Tensor
    key_mask: torch.Tensor | None = None


def _p_mask(batch_size, eps, generator, device):
    """p = (1 - eps) t + eps with t ~ U(0, 1): one masking probability per sample, (B,) float32."""
    t = torch.rand(batch_size, generator=generator).to(device)
    return (1 - eps) * t + eps


def reorganize_slots(tokens, prompt_len, length, slot_sizes, mask_id, generator, eps=1e-3):
    """ReFusion's slot reorganization of a batch (SPEC section 3; paper section 3.1).

    tokens: (B, T) int64, each row prompt + response (ending with EOS), right-padded;
    prompt_len, length: (B,) int64 (length counts EOS, not padding). Per sample, draws the slot size
    S uniformly from slot_sizes, p_mask = (1 - eps) t + eps with t ~ U(0, 1), which slots are masked
    (each with probability p_mask) and a random order of the clean slots, then lays the batch out
    with layout_slots. All randomness comes from `generator` (a CPU torch.Generator), in that order.
    Returns a Batch of the same (B, T). No Python loop over samples.
    """
    B, T = tokens.shape
    dev = tokens.device
    S = torch.tensor(slot_sizes)[torch.randint(len(slot_sizes), (B,), generator=generator)].to(dev)
    p = _p_mask(B, eps, generator, dev)
    slot_is_masked = torch.rand(B, T, generator=generator).to(dev) < p[:, None]      # indexed by slot id
    slot_rank = torch.rand(B, T, generator=generator).argsort(dim=1).argsort(dim=1).to(dev)
    return layout_slots(tokens, prompt_len, length, S, p, slot_is_masked, slot_rank, mask_id)


def layout_slots(tokens, prompt_len, length, S, p, slot_is_masked, slot_rank, mask_id):
    """The deterministic half of reorganize_slots: build the buffer, labels and loss weights.

    S: (B,) int64 slot size; p: (B,) float32 p_mask; slot_is_masked: (B, n) bool and slot_rank:
    (B, n) int64 (a permutation), indexed by slot id (n >= number of slots; T always suffices).
    Buffer: the prompt, then the clean slots in ascending slot_rank, then the masked slots (every
    token the mask id) in their original order, then padding; every token keeps its true position.
    Labels: a clean token's next token inside its own slot (none for the slot's last token); a masked
    token's own token, with mdm_weight 1 / (p * response length); none for prompt and padding.
    """
    B, T = tokens.shape
    pos = torch.arange(T, device=tokens.device).expand(B, T)
    rel = pos - prompt_len[:, None]                          # position inside the response
    in_response = (rel >= 0) & (pos < length[:, None])
    slot = torch.where(in_response, rel // S[:, None], 0)    # (B, T) slot id of every response token
    masked = in_response & slot_is_masked.gather(1, slot)
    clean = in_response & ~masked

    # physical order: prompt (group 0), clean slots by rank (1), masked slots (2), padding (3)
    group = torch.where(pos < prompt_len[:, None], 0, torch.where(clean, 1, torch.where(masked, 2, 3)))
    within = torch.where(clean, slot_rank.gather(1, slot) * T + pos, pos)
    order = (group * T * (T + 1) + within).argsort(dim=1)    # (B, T) original index at each buffer place

    next_in_slot = torch.zeros_like(in_response)
    next_in_slot[:, :-1] = (slot[:, 1:] == slot[:, :-1]) & in_response[:, 1:]
    next_tok = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)
    labels = torch.where(masked, tokens, torch.where(clean & next_in_slot, next_tok, IGNORE))
    weight = torch.where(masked, 1.0 / (p * (length - prompt_len))[:, None], 0.0)
    idx = torch.where(masked, mask_id, tokens)
    return Batch(*(x.gather(1, order) for x in (idx, pos, labels, weight)))


def autoregressive_batch(tokens, prompt_len, length):
    """The ARM baseline's batch: natural order, each token labelled with the next response token.

    tokens (B, T), prompt_len (B,), length (B,) int64 as for reorganize_slots. Returns a Batch.
    """
    B, T = tokens.shape
    pos = torch.arange(T, device=tokens.device).expand(B, T)
    predicts_response = (pos + 1 >= prompt_len[:, None]) & (pos + 1 < length[:, None])
    next_tok = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)
    labels = torch.where(predicts_response, next_tok, IGNORE)
    return Batch(tokens, pos, labels, torch.zeros(B, T, device=tokens.device))


def random_mask_batch(tokens, prompt_len, length, mask_id, generator, eps=1e-3):
    """The LLaDA-style MDM baseline's batch: each response token masked independently with p_mask.

    tokens (B, T), prompt_len (B,), length (B,) int64. Labels: a masked token's own token, weighted
    1 / (p_mask * response length). key_mask hides padding from bidirectional attention. Returns a Batch.
    """
    B, T = tokens.shape
    pos = torch.arange(T, device=tokens.device).expand(B, T)
    p = _p_mask(B, eps, generator, tokens.device)
    in_response = (pos >= prompt_len[:, None]) & (pos < length[:, None])
    masked = in_response & (torch.rand(B, T, generator=generator).to(tokens.device) < p[:, None])
    labels = torch.where(masked, tokens, IGNORE)
    weight = torch.where(masked, 1.0 / (p * (length - prompt_len))[:, None], 0.0)
    return Batch(torch.where(masked, mask_id, tokens), pos, labels, weight, key_mask=pos < length[:, None])
