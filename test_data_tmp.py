"""Tests of data.py: tokenizer, records, prepare and batches. Run: python -m pytest -q"""

import ast
import json
import json.decoder
import os
import textwrap

import numpy as np
import pytest
import torch

import data

# -----------------------------------------------------------------------------
# tokenizer


def test_byte_tokenizer_round_trips_any_text():
    enc = data.get_tokenizer("bytes")
    text = "def f(x):\n    return x  # naïve 😀 λ\t\r\n"
    ids = data.encode(enc, text)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    assert all(0 <= i < 256 for i in ids)
    assert data.decode(enc, ids) == text


def test_byte_tokenizer_special_ids_and_vocab():
    enc = data.get_tokenizer("bytes")
    assert data.special_ids(enc) == (256, 257, 258)
    assert enc.n_vocab == 259


def test_literal_mask_text_is_not_the_mask_id():
    enc = data.get_tokenizer("bytes")
    ids = data.encode(enc, "x = '<|mask|>' + '<|endoftext|>'")
    assert not set(ids) & set(data.special_ids(enc))
    assert data.decode(enc, ids) == "x = '<|mask|>' + '<|endoftext|>'"


def test_decode_tolerates_special_ids_and_broken_utf8():
    enc = data.get_tokenizer("bytes")
    eos, mask, pad = data.special_ids(enc)
    assert data.decode(enc, [104, 105, mask, eos, pad]) == "hi<|mask|><|endoftext|><|pad|>"
    assert data.decode(enc, [0xE2, 0x82]) == "\ufffd"  # first two bytes of the 3-byte "€"
    assert data.decode(enc, torch.tensor([104, 105])) == "hi"


def test_unknown_tokenizer_is_a_value_error_listing_the_choices():
    with pytest.raises(ValueError, match="bytes.*gpt2"):
        data.get_tokenizer("llama")


def test_gpt2_tokenizer_or_a_clear_offline_error():
    try:
        enc = data.get_tokenizer("gpt2")
    except RuntimeError as e:
        msg = str(e)
        assert "GPT-2 BPE" in msg and "TIKTOKEN_CACHE_DIR" in msg and "--tokenizer=bytes" in msg
        pytest.skip("GPT-2 BPE file not downloadable or cached here (offline); error message checked")
    assert enc.n_vocab == 50259
    assert data.special_ids(enc) == (50256, 50257, 50258)
    assert data.encode(enc, "hello world") == [31373, 995]  # GPT-2's own ids
    assert 50257 not in data.encode(enc, "<|mask|>")

# -----------------------------------------------------------------------------
# the built-in stdlib corpus


@pytest.fixture(scope="module")
def stdlib():
    return data.stdlib_records()


def test_stdlib_query_is_signature_and_docstring(stdlib):
    assert len(stdlib) > 1000
    for r in stdlib:
        assert r["query"].startswith(("def ", "async def ")), (r["module"], r["name"])
        fn = ast.parse(r["query"] + "    pass\n").body[0]  # the query alone is a complete header
        doc = ast.get_docstring(fn, clean=False)
        assert doc is not None and fn.name == r["name"].split(".")[-1]


def test_stdlib_query_plus_response_is_the_dedented_source(stdlib):
    lines = open(json.decoder.__file__, encoding="utf-8").read().split("\n")
    by_name = {r["name"]: r for r in stdlib if r["module"] == "json.decoder"}
    fn = by_name["JSONDecoder.raw_decode"]
    node = next(n for n in ast.walk(ast.parse("\n".join(lines)))
                if isinstance(n, ast.FunctionDef) and n.name == "raw_decode")
    indent = " " * node.col_offset  # a method: the def is indented once
    source = "".join(line.removeprefix(indent) + "\n" for line in lines[node.lineno - 1:node.end_lineno])
    assert fn["query"] + fn["response"] == source
    assert fn["response"].strip() and fn["response"].endswith("\n")
    for r in stdlib:  # in general: both parts end a line, and together they parse
        assert r["query"].endswith("\n") and r["response"].endswith("\n") and r["response"].strip()
        ast.parse(r["query"] + r["response"])


def test_stdlib_has_methods_and_no_test_packages(stdlib):
    modules = {r["module"] for r in stdlib}
    assert "json.decoder" in modules and "json" in modules  # json/__init__.py is "json"
    assert not any(part in ("test", "tests", "idle_test") or part.startswith("test_")
                   for m in modules for part in m.split("."))
    assert any("." in r["name"] for r in stdlib)  # methods are qualified: Class.method


def test_stdlib_split_is_deterministic_and_about_5_percent_val(stdlib):
    splits = [data.split_of(r) for r in stdlib]
    assert splits == [data.split_of(dict(r)) for r in stdlib]
    assert set(splits) == {"train", "val"}
    assert 0.02 < splits.count("val") / len(splits) < 0.08
    assert data.split_of({"module": "json.decoder", "name": "JSONDecoder.raw_decode"}) == \
        data.split_of({"module": "json.decoder", "name": "JSONDecoder.raw_decode", "query": "x"})


def test_function_records_skip_docstring_only_and_too_long():
    source = textwrap.dedent('''\
        @decorator
        def kept(a):
            """Doc
            on two lines."""
            return a

        def only_doc():
            """Nothing else."""

        def undocumented():
            return 1

        class C:
            async def m(self):
                "Doc."
                await self.x()

            def n(self):
                """Doc."""
                return """
        column 0"""
        ''')
    records = data.function_records(source, "mod")
    assert [r["name"] for r in records] == ["kept", "C.m", "C.n"]
    assert records[0]["query"] == 'def kept(a):\n    """Doc\n    on two lines."""\n'
    assert records[0]["response"] == "    return a\n"
    assert records[1]["query"] == 'async def m(self):\n    "Doc."\n'
    assert records[2]["response"] == '    return """\ncolumn 0"""\n'  # the def's indent only
    assert [r["name"] for r in data.function_records(source, "mod", max_chars=50)] == ["C.m"]

# -----------------------------------------------------------------------------
# a user's own records


def write(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return str(path)


def test_load_records_json_and_jsonl(tmp_path):
    rows = [{"query": "2+2?", "response": "4", "extra": 1}, {"query": "", "response": "é"}]
    for path in (write(tmp_path, "a.json", json.dumps(rows)),
                 write(tmp_path, "a.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")):
        records = data.load_records(path)
        assert [(r["query"], r["response"]) for r in records] == [("2+2?", "4"), ("", "é")]
        assert [r["name"] for r in records] == ["0", "1"]
        assert {r["module"] for r in records} == {os.path.basename(path)}


def test_load_records_plain_text_windows(tmp_path):
    text = "abcdefgh" * 300  # 2400 characters -> windows of 1024, 1024, 352
    records = data.load_records(write(tmp_path, "notes.txt", text))
    assert [len(r["query"]) + len(r["response"]) for r in records] == [1024, 1024, 352]
    assert [len(r["query"]) for r in records] == [256, 256, 88]
    assert "".join(r["query"] + r["response"] for r in records) == text


@pytest.mark.parametrize("name, content, error, message", [
    ("missing.json", None, FileNotFoundError, "does not exist"),
    ("empty.json", "", ValueError, "empty"),
    ("empty.txt", "  \n", ValueError, "empty"),
    ("bad.json", '[{"query": "a",\n "response": }]', ValueError, "line 2, column"),
    ("bad.jsonl", '{"query": "a", "response": "b"}\n{"query": \n', ValueError, "line 2"),
    ("dict.json", '{"query": "a", "response": "b"}', ValueError, "not a list"),
    ("str.json", '[{"query": "a", "response": "b"}, "c"]', ValueError, "record 1 is a str"),
    ("noresp.json", '[{"query": "a"}]', ValueError, "record 0 has no 'response'"),
    ("int.jsonl", '{"query": 3, "response": "b"}', ValueError, "record 0 .*'query' must be a string"),
    ("emptyresp.json", '[{"query": "a", "response": "b"}, {"query": "a", "response": ""}]',
     ValueError, "record 1 has an empty response"),
    ("latin1.txt", b"ok caf\xe9", ValueError, "byte offset 6"),
])
def test_load_records_errors_say_what_is_wrong(tmp_path, name, content, error, message):
    path = str(tmp_path / name) if content is None else write(tmp_path, name, content)
    with pytest.raises(error, match=message):
        data.load_records(path)

# -----------------------------------------------------------------------------
# prepare and TokenDataset


@pytest.fixture
def qa_file(tmp_path):
    """100 small records plus 3 too long for block_size=64 with the byte tokenizer."""
    rows = [{"query": f"What is {i} + {i}?", "response": f" {2 * i}"} for i in range(100)]
    rows += [{"query": "long " * 20, "response": "answer"} for _ in range(3)]
    return write(tmp_path, "sums.json", json.dumps(rows)), rows


def test_prepare_round_trips_tokens_and_skips_too_long(tmp_path, qa_file):
    path, rows = qa_file
    enc = data.get_tokenizer("bytes")
    data_dir = data.prepare(path, "bytes", 64, data_root=str(tmp_path / "data"))
    assert data_dir == str(tmp_path / "data" / "sums-bytes-64")
    meta = json.load(open(os.path.join(data_dir, "meta.json")))
    assert (meta["vocab_size"], meta["eos_id"], meta["mask_id"], meta["pad_id"]) == (259, 256, 257, 258)
    counts = meta["counts"]
    assert counts["train"]["samples"] + counts["val"]["samples"] == 100
    assert counts["train"]["skipped_too_long"] + counts["val"]["skipped_too_long"] == 3
    records = data.load_records(path)
    for split in ("train", "val"):
        ds = data.TokenDataset(data_dir, split)
        expected = [r for r in records if data.split_of(r) == split and len(r["query"]) < 50]
        assert len(ds) == len(expected) == counts[split]["samples"] > 0
        for i, r in enumerate(expected):
            prompt, response = ds.sample(i)
            assert prompt == data.encode(enc, r["query"])
            assert response == data.encode(enc, r["response"]) + [256]
        assert counts[split]["tokens"] == sum(len(p) + len(q) for p, q in map(ds.sample, range(len(ds))))


def test_prepare_reuses_a_finished_preparation_and_redoes_an_unfinished_one(tmp_path, qa_file):
    path, _ = qa_file
    root = str(tmp_path / "data")
    data_dir = data.prepare(path, "bytes", 64, data_root=root)
    bin_path = os.path.join(data_dir, "train.bin")
    os.utime(bin_path, (0, 0))
    assert data.prepare(path, "bytes", 64, data_root=root) == data_dir
    assert os.stat(bin_path).st_mtime == 0  # not rewritten
    os.remove(os.path.join(data_dir, "meta.json"))  # as if interrupted before the last write
    data.prepare(path, "bytes", 64, data_root=root)
    assert os.stat(bin_path).st_mtime > 0
    assert not [f for f in os.listdir(data_dir) if f.startswith(".tmp")]


def test_prepare_with_block_size_too_small_says_what_to_change(tmp_path, qa_file):
    with pytest.raises(ValueError, match="block_size"):
        data.prepare(qa_file[0], "bytes", 8, data_root=str(tmp_path / "data"))


def test_prepare_unknown_dataset_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="stdlib"):
        data.prepare(str(tmp_path / "nope.json"), "bytes", 64, data_root=str(tmp_path))


def test_token_dataset_without_preparation_says_to_prepare(tmp_path):
    with pytest.raises(FileNotFoundError, match="prepare"):
        data.TokenDataset(str(tmp_path / "nothing"), "train")


def test_get_batch_pads_right_to_longest_sample(tmp_path, qa_file):
    data_dir = data.prepare(qa_file[0], "bytes", 64, data_root=str(tmp_path / "data"))
    ds = data.TokenDataset(data_dir, "train")
    indices = [0, 11, 99 % len(ds), 0]
    tokens, prompt_len, length = ds.get_batch_at(indices)
    assert tokens.dtype == prompt_len.dtype == length.dtype == torch.int64
    assert tokens.shape == (4, int(length.max()))
    for b, i in enumerate(indices):
        prompt, response = ds.sample(i)
        assert prompt_len[b] == len(prompt) and length[b] == len(prompt) + len(response)
        assert tokens[b, :length[b]].tolist() == prompt + response
        assert (tokens[b, length[b]:] == 258).all()
        assert tokens[b, length[b] - 1] == 256  # every sample ends with EOS
    batch = ds.get_batch(8, np.random.default_rng(0))
    again = ds.get_batch(8, np.random.default_rng(0))
    assert batch[0].shape[0] == 8 and all(torch.equal(a, b) for a, b in zip(batch, again))
