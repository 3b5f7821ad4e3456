"""
A user's data files as records: {"query", "response", "module": the file's name, "name": index}.

    load_records(path)   .json: a list of objects with string "query" and "response" fields (the
                         ReFusion release's format); .jsonl: one such object a line; other: plain
                         text, cut into windows of at most TEXT_WINDOW_BYTES UTF-8 bytes
    read_utf8(path)      the text of any file a user names (a data file, --prompt_file)
"""

import json
import os
import sys

TEXT_WINDOW_BYTES = 1024  # plain-text files are cut into windows of at most this many UTF-8 bytes

FORMAT_HELP = ("expected a .json file holding a JSON list of objects with string 'query' and "
               "'response' fields, a .jsonl file with one such object per line, or plain text")

TOO_DEEP = "nested deeper than Python's JSON parser can read; a record is an object of strings"


def read_utf8(path: str, name: str, limit: int | None = None) -> str:
    """The text of the file at `path` ("-": standard input; a pipe is read once), decoded as UTF-8
    as it is, a leading byte order mark removed with a note on stderr. limit: the most bytes read
    (None: all); name: the file in messages ("--prompt_file=p.txt"). Raises FileNotFoundError, or
    ValueError for a directory, a file over `limit` bytes, or bytes not UTF-8 (their offset)."""
    if path == "-":
        raw = sys.stdin.buffer.read(-1 if limit is None else limit + 1)
    elif not os.path.exists(path):
        raise FileNotFoundError(f"{name}: no such file; check the path")
    elif os.path.isdir(path):
        raise ValueError(f"{name}: is a directory; name a file")
    else:
        with open(path, "rb") as f:
            raw = f.read(-1 if limit is None else limit + 1)
    if limit is not None and len(raw) > limit:
        raise ValueError(f"{name}: longer than {limit:,} bytes, more than the model's context can "
                         "hold as a prompt (read no further); give a shorter text")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{name}: not valid UTF-8 at byte offset {e.start}; "
                         "re-save the file as UTF-8") from None
    if text.startswith("\ufeff"):
        print(f"note: {name}: removed the UTF-8 byte order mark at its start", file=sys.stderr)
    return text.removeprefix("\ufeff")


def _read_text(path: str) -> str:
    """read_utf8 of a data file. Raises ValueError also for an empty one."""
    text = read_utf8(path, f"data file {path}")
    if not text.strip():
        raise ValueError(f"{path}: the file is empty; {FORMAT_HELP}")
    return text


def _check_record(obj, where: str, path: str) -> dict:
    """{"query", "response"} of one JSON record. Raises ValueError naming it (`where`) when it is
    not an object with two non-empty strings."""
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
    """The records of a .json file's text. Raises ValueError naming where the JSON or a record is
    wrong."""
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON at line {e.lineno}, "
                         f"column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise ValueError(f"{path}: {TOO_DEEP}; {FORMAT_HELP}") from None
    if not isinstance(rows, list):
        raise ValueError(f"{path}: top level is a {type(rows).__name__}, not a list; {FORMAT_HELP}")
    return [_check_record(obj, f"record {i}", path) for i, obj in enumerate(rows)]


def _parse_jsonl(text: str, path: str) -> list[dict]:
    """The records of a .jsonl file's text, blank lines skipped. Raises ValueError naming the line
    or the record that is wrong."""
    records = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue  # blank lines, e.g. a trailing newline, are not records
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON on line {lineno}: {e.msg}") from None
        except RecursionError:
            raise ValueError(f"{path}: line {lineno} is {TOO_DEEP}") from None
        records.append(_check_record(obj, f"record {len(records)} (line {lineno})", path))
    return records


def _parse_text(text: str, path: str, window_bytes: int) -> list[dict]:
    """The records of plain text: consecutive windows of at most window_bytes UTF-8 bytes (so at
    most as many tokens), cut between characters, each window's first quarter of characters (at
    least one) the query. Raises ValueError when the text is one character or a window cannot hold
    two."""
    if len(text) == 1:
        raise ValueError(f"{path}: holds a single character; a sample needs a query and a response")
    too_small = ValueError(f"{path}: windows of {window_bytes} bytes cannot hold two characters "
                           "(a query and a response); raise --block_size")
    raw = text.encode("utf-8")

    # cut the bytes into windows, each cut at the start of a character
    cuts = [0]
    while cuts[-1] < len(raw):
        end = min(cuts[-1] + window_bytes, len(raw))
        # a continuation byte: back to the character's start
        while end < len(raw) and raw[end] & 0xC0 == 0x80:
            end -= 1
        if end == cuts[-1]:
            raise too_small
        cuts.append(end)
    windows = [raw[a:b].decode("utf-8") for a, b in zip(cuts, cuts[1:])]

    # a last window of one character could not be split: it takes one from the window before
    if len(windows[-1]) == 1:
        windows[-2:] = [windows[-2][:-1], windows[-2][-1] + windows[-1]]
    if any(len(w) < 2 or len(w.encode("utf-8")) > window_bytes for w in windows):
        raise too_small

    # the query is a quarter of the window, at least one character
    records = []
    for window in windows:
        cut = max(1, len(window) // 4)
        records.append({"query": window[:cut], "response": window[cut:]})
    return records


def load_records(path: str, window_bytes: int = TEXT_WINDOW_BYTES) -> list[dict]:
    """The records of the data file at `path` (the module's docstring; plain text in windows of
    window_bytes). Raises FileNotFoundError for a missing file, ValueError (naming the record, line,
    column or byte offset) for an empty file, bad UTF-8, bad JSON or a malformed record."""
    text = _read_text(path)
    ext = os.path.splitext(path)[1].lower()
    if ext == ".json":
        records = _parse_json(text, path)
    elif ext == ".jsonl":
        records = _parse_jsonl(text, path)
    else:
        records = _parse_text(text, path, window_bytes)
    if not records:
        raise ValueError(f"{path}: holds no records; {FORMAT_HELP}")
    module = os.path.basename(path)
    return [dict(r, module=module, name=str(i)) for i, r in enumerate(records)]
