"""A user's data files read as records (support/data_files.py)."""

import json
import os
import re

import pytest

from helpers import write
from support import data_files


def test_load_records_json_and_jsonl(tmp_path):
    rows = [{"query": "2+2?", "response": "4", "extra": 1}, {"query": "π", "response": "é"}]
    for path in (write(tmp_path, "a.json", json.dumps(rows)),
                 write(tmp_path, "a.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")):
        records = data_files.load_records(path)
        assert [(r["query"], r["response"]) for r in records] == [("2+2?", "4"), ("π", "é")]
        assert [r["name"] for r in records] == ["0", "1"]
        assert {r["module"] for r in records} == {os.path.basename(path)}


def test_load_records_plain_text_windows(tmp_path):
    text = "abcdefgh" * 300  # 2400 characters -> windows of 1024, 1024, 352
    records = data_files.load_records(write(tmp_path, "notes.txt", text))
    assert [len(r["query"]) + len(r["response"]) for r in records] == [1024, 1024, 352]
    assert [len(r["query"]) for r in records] == [256, 256, 88]
    assert "".join(r["query"] + r["response"] for r in records) == text


@pytest.mark.parametrize("text, window_bytes, lengths", [
    # a last window of one character takes one from before
    ("abcdefgh" * 128 + "x", 1024, [1023, 2]),
    ("ab" * 512 + "é", 1024, [1023, 2]),
    # windows of 2 and 3 characters: a query of one
    ("abc", 1024, [3]),
    ("ab" * 3, 2, [2, 2, 2]),
], ids=["lone-last-ascii", "lone-last-2-bytes", "3-characters", "2-byte-windows"])
def test_no_text_window_has_an_empty_query_or_response(tmp_path, text, window_bytes, lengths):
    records = data_files.load_records(write(tmp_path, "notes.txt", text), window_bytes=window_bytes)
    assert [len(r["query"] + r["response"]) for r in records] == lengths
    assert all(r["query"] and r["response"] for r in records)
    assert "".join(r["query"] + r["response"] for r in records) == text
    assert all(len((r["query"] + r["response"]).encode()) <= window_bytes for r in records)
    for text, window_bytes, message in [
            ("x", 1024, "holds a single character; a sample needs a query and a response"),
            ("ab€", 4, "windows of 4 bytes cannot hold two characters .* --block_size")]:
        with pytest.raises(ValueError, match=message):
            data_files.load_records(write(tmp_path, "short.txt", text), window_bytes=window_bytes)


@pytest.mark.parametrize("name, content, error, message", [
    ("missing.json", None, FileNotFoundError, "missing.json: no such file"),
    ("empty.json", "", ValueError, "empty"),
    ("empty.txt", "  \n", ValueError, "empty"),
    ("bad.json", '[{"query": "a",\n "response": }]', ValueError, "line 2, column"),
    ("bad.jsonl", '{"query": "a", "response": "b"}\n{"query": \n', ValueError, "line 2"),
    ("dict.json", '{"query": "a", "response": "b"}', ValueError, "not a list"),
    ("str.json", '[{"query": "a", "response": "b"}, "c"]', ValueError, "record 1 is a str"),
    ("noresp.json", '[{"query": "a"}]', ValueError, "record 0 has no 'response'"),
    ("int.jsonl", '{"query": 3, "response": "b"}', ValueError,
     "record 0 .*'query' must be a string"),
    ("emptyresp.json", '[{"query": "a", "response": "b"}, {"query": "a", "response": ""}]',
     ValueError, "record 1 has an empty response"),
    ("emptyquery.jsonl", '{"query": "", "response": "b"}', ValueError,
     "record 0 .*has an empty query"),
    ("latin1.txt", b"ok caf\xe9", ValueError, "byte offset 6"),
])
def test_load_records_errors_say_what_is_wrong(tmp_path, name, content, error, message):
    path = str(tmp_path / name) if content is None else write(tmp_path, name, content)
    with pytest.raises(error, match=message):
        data_files.load_records(path)


def test_deeply_nested_json_is_refused_naming_the_file_and_line(tmp_path):
    """JSON nested deeper than Python's parser recurses (a RecursionError) is a malformed data
    file."""
    deep = "[" * 100_000 + "]" * 100_000
    path = write(tmp_path, "deep.json", deep)
    with pytest.raises(ValueError, match=rf"^{re.escape(path)}: nested deeper than Python's JSON "
                                         r"parser can read"):
        data_files.load_records(path)
    path = write(tmp_path, "deep.jsonl", '{"query": "a", "response": "b"}\n' + deep + "\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(path)}: line 2 is nested deeper than "
                                         r"Python's JSON parser"):
        data_files.load_records(path)
