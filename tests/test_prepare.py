"""Tokenizing a corpus once into memmapped splits (support/prepare.py)."""

import errno
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import time

import numpy as np
import pytest
from filelock import FileLock

from helpers import NOT_FILES, never_blocks, write
from support import corpora, data_files, tokenizer
from support.prepare import TokenDataset, prepare, split_of


def test_prepare_round_trips_tokens_and_skips_too_long(tmp_path, qa_file):
    path, rows = qa_file
    enc = tokenizer.get_tokenizer("bytes")
    data_dir = prepare(path, "bytes", 64, data_root=str(tmp_path / "data"))
    digest = hashlib.sha1(open(path, "rb").read()).hexdigest()[:8]
    assert data_dir == str(tmp_path / "data" / f"sums-{digest}-bytes-64")    # name + content hash
    meta = json.load(open(os.path.join(data_dir, "meta.json")))
    assert (meta["vocab_size"], meta["eos_id"], meta["mask_id"], meta["pad_id"]) == \
        (259, 256, 257, 258)
    counts = meta["counts"]
    assert counts["train"]["samples"] + counts["val"]["samples"] == 100
    assert counts["train"]["skipped_too_long"] + counts["val"]["skipped_too_long"] == 3
    records = data_files.load_records(path)
    for split in ("train", "val"):
        ds = TokenDataset(data_dir, split)
        expected = [r for r in records
                    if split_of(r, by_content=True) == split and len(r["query"]) < 50]
        assert len(ds) == len(expected) == counts[split]["samples"] > 0
        for i, r in enumerate(expected):
            prompt, response = ds.sample(i)
            assert prompt == tokenizer.encode(enc, r["query"])
            assert response == tokenizer.encode(enc, r["response"]) + [256]
        assert counts[split]["tokens"] == \
            sum(len(p) + len(q) for p, q in map(ds.sample, range(len(ds))))


def test_prepare_reuses_a_finished_preparation_and_redoes_an_unfinished_one(tmp_path, qa_file):
    path, _ = qa_file
    root = str(tmp_path / "data")
    data_dir = prepare(path, "bytes", 64, data_root=root)
    bin_path = os.path.join(data_dir, "train.bin")
    os.utime(bin_path, (0, 0))
    assert prepare(path, "bytes", 64, data_root=root) == data_dir
    assert prepare(os.path.relpath(path), "bytes", 64, data_root=root) == data_dir  # the same file
    assert os.stat(bin_path).st_mtime == 0  # not rewritten
    os.remove(os.path.join(data_dir, "meta.json"))  # as if interrupted before the last write
    prepare(path, "bytes", 64, data_root=root)
    assert os.stat(bin_path).st_mtime > 0
    assert not [f for f in os.listdir(data_dir) if f.endswith(".tmp")]


def test_prepare_waits_while_another_process_prepares_the_same_data(tmp_path, qa_file):
    """torchrun starts every process at once: while one holds the data dir's lock, another one's
    prepare() writes nothing, then finds the finished preparation and reuses it as it is."""
    path, _ = qa_file
    finished = prepare(path, "bytes", 64, data_root=str(tmp_path / "elsewhere"))
    root = str(tmp_path / "data")
    data_dir = os.path.join(root, os.path.basename(finished))         # data/sums-<hash>-bytes-64
    os.makedirs(data_dir)
    child = multiprocessing.get_context("spawn").Process(target=prepare,
                                                         args=(path, "bytes", 64, root))
    # as if another process were preparing
    with FileLock(os.path.join(data_dir, ".lock")):
        child.start()
        # time to start and reach the lock
        time.sleep(3)
        assert child.is_alive() and os.listdir(data_dir) == [".lock"]  # waiting, nothing written
        for name in os.listdir(finished):                             # the other process finishes
            shutil.copy2(os.path.join(finished, name), data_dir)
        stamps = {f: os.stat(os.path.join(data_dir, f)).st_mtime_ns for f in os.listdir(data_dir)}
    child.join(timeout=60)
    assert child.exitcode == 0
    assert stamps == {f: os.stat(os.path.join(data_dir, f)).st_mtime_ns
                      for f in os.listdir(data_dir)}


def test_two_data_files_with_the_same_name_never_share_a_prepared_dir(tmp_path, qa_file):
    """Runs on a/train.json and b/train.json keep their own prepared data: a sampler reading one
    run's validation prompts never gets the other file's."""
    rows = qa_file[1]
    dirs = []
    for sub, text in (("a", "first"), ("b", "second")):
        (tmp_path / sub).mkdir()
        path = write(tmp_path / sub, "train.json",
                     json.dumps([dict(r, response=f" {text}") for r in rows]))
        dirs.append(prepare(path, "bytes", 64, data_root=str(tmp_path / "data")))
    assert dirs[0] != dirs[1]
    first = TokenDataset(dirs[0], "val")
    assert tokenizer.decode(tokenizer.get_tokenizer("bytes"),
                            first.sample(0)[1]).startswith(" first")


@pytest.mark.parametrize("name", ["train.bin", "val_samples.npy"])
def test_damaged_prepared_data_is_named_and_prepared_anew(tmp_path, qa_file, name):
    """A prepared file cut short (a full disk, a copy stopped half-way): reading it names the file
    and the fix, and prepare() sees the damage and writes the data again."""
    root = str(tmp_path / "data")
    data_dir = prepare(qa_file[0], "bytes", 64, data_root=root)
    path = os.path.join(data_dir, name)
    whole = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(whole[:-6])
    split = name.split(".")[0].split("_")[0]
    with pytest.raises(ValueError, match=f"{re.escape(path)} does not hold what .*meta.json "
                                         "counts: .*writes it anew"):
        TokenDataset(data_dir, split)
    assert prepare(qa_file[0], "bytes", 64, data_root=root) == data_dir
    assert open(path, "rb").read() == whole and len(TokenDataset(data_dir, split)) > 0


def test_prepare_with_block_size_too_small_says_what_to_change(tmp_path, qa_file):
    with pytest.raises(ValueError, match="block_size"):
        prepare(qa_file[0], "bytes", 8, data_root=str(tmp_path / "data"))


def test_prepare_unknown_dataset_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="stdlib"):
        prepare(str(tmp_path / "nope.json"), "bytes", 64, data_root=str(tmp_path))


@pytest.mark.parametrize("make, said", NOT_FILES.values(), ids=NOT_FILES)
def test_a_data_file_that_is_no_file_is_named_not_called_missing(tmp_path, make, said):
    """A directory, a FIFO or a link to /dev/zero given as --dataset is refused naming what is
    there (it was "no built-in dataset or file named"), never opened: a FIFO would block, and
    /dev/zero would be hashed without end."""
    make(tmp_path / "data.json")
    with never_blocks(), pytest.raises(ValueError, match=f"data.json {said}, not a regular file; "
                                                         "--dataset names a data file"):
        prepare(str(tmp_path / "data.json"), "bytes", 64, data_root=str(tmp_path / "data"))
    assert not (tmp_path / "data").exists()


def test_a_data_file_is_hashed_as_its_bytes_are(tmp_path, qa_file):
    """The prepared dir's name carries the first 8 hex digits of the data file's SHA-1 (read in
    chunks, so a large file is never held whole)."""
    data_dir = prepare(qa_file[0], "bytes", 384, data_root=str(tmp_path / "data"))
    with open(qa_file[0], "rb") as f:
        sha1 = hashlib.sha1(f.read()).hexdigest()
    stem = os.path.splitext(os.path.basename(qa_file[0]))[0]
    assert os.path.basename(data_dir) == f"{stem}-{sha1[:8]}-bytes-384"


def test_stdlib_split_is_deterministic_and_about_5_percent_val(stdlib):
    splits = [split_of(r) for r in stdlib]
    assert splits == [split_of(dict(r)) for r in stdlib]
    assert set(splits) == {"train", "val"}
    assert 0.02 < splits.count("val") / len(splits) < 0.08
    assert split_of({"module": "json.decoder", "name": "JSONDecoder.raw_decode"}) == \
        split_of({"module": "json.decoder", "name": "JSONDecoder.raw_decode", "query": "x"})


def test_arith_is_deterministic_distinct_and_about_5_percent_val(arith):
    assert corpora.arithmetic_records(n=300, seed=1) == corpora.arithmetic_records(n=300, seed=1)
    assert corpora.arithmetic_records(n=300, seed=1) != corpora.arithmetic_records(n=300, seed=2)
    # a prefix: arith-1m starts with arith's records, and split_of depends on the record alone, so
    # they keep their splits there
    assert corpora.arithmetic_records(n=300) == arith[:300]
    assert len({r["name"] for r in arith}) == len({r["query"] for r in arith}) == len(arith)
    assert {r["module"] for r in arith} == {"arith"}
    assert 0.03 < [split_of(r) for r in arith].count("val") / len(arith) < 0.07


@pytest.mark.parametrize("block_size", [64, 384])
def test_text_in_any_script_prepares_into_windows_that_fit_the_context(tmp_path, block_size):
    """Windows are measured in UTF-8 bytes, so Chinese or Cyrillic text (3 or 2 bytes a character)
    fits block_size as well as ASCII does, and no character is split."""
    phrases = ("漢字の文章", "Кириллица", "ascii text", "emoji \U0001f600")
    # numbered: no two windows alike
    text = "".join(f"{phrases[i % 4]} {i}. " for i in range(400))
    data_dir = prepare(write(tmp_path, "mixed.txt", text), "bytes", block_size,
                       data_root=str(tmp_path))
    meta = json.load(open(os.path.join(data_dir, "meta.json")))
    assert meta["counts"]["train"]["skipped_too_long"] == \
        meta["counts"]["val"]["skipped_too_long"] == 0
    records = data_files.load_records(str(tmp_path / "mixed.txt"), window_bytes=block_size - 1)
    assert "".join(r["query"] + r["response"] for r in records) == text
    assert all(len((r["query"] + r["response"]).encode()) <= block_size - 1 for r in records)


def test_identical_records_of_a_file_share_a_split_and_are_counted(tmp_path, qa_file, capsys):
    """A user's records are split by their content: a record repeated under another index cannot be
    trained on and validated against at once. The built-in corpora keep their splits by name."""
    path, rows = qa_file
    doubled = write(tmp_path, "doubled.json", json.dumps(rows[:100] + rows[:100][::-1]))
    data_dir = prepare(doubled, "bytes", 64, data_root=str(tmp_path / "data"))
    assert "doubled.json: 100 duplicate records" in capsys.readouterr().out
    enc = tokenizer.get_tokenizer("bytes")
    seen = {split: {tokenizer.decode(enc, TokenDataset(data_dir, split).sample(i)[0])
                    for i in range(len(TokenDataset(data_dir, split)))}
            for split in ("train", "val")}
    assert seen["train"] and seen["val"] and not seen["train"] & seen["val"]
    assert len(seen["train"]) + len(seen["val"]) == 100
    # built-ins: by name
    assert split_of({"module": "m", "name": "1", "query": "q", "response": "r"}) == \
        split_of({"module": "m", "name": "1", "query": "other", "response": "other"})


def test_a_record_that_would_make_an_empty_prompt_or_response_is_refused(tmp_path, monkeypatch):
    for field in ("query", "response"):
        records = [dict(query=f"q{i}", response=f"r{i}", module="made", name=str(i))
                   for i in range(40)]
        records[7][field] = ""
        monkeypatch.setitem(corpora.DATASETS, "made", lambda records=records: records)
        with pytest.raises(ValueError, match=f"record made:7 has an empty {field}; every sample "
                                             "needs a prompt"):
            prepare("made", "bytes", 64, data_root=str(tmp_path / "data"))


@pytest.mark.parametrize("content, message", [
    ('[{"query": "a",\n "response": }]', "invalid JSON at line 2"),
    ('[{"query": "a"}]', "record 0 has no 'response' field"),
    ('[{"query": "a", "response": "b"}]',
     r"too few records for a train split \(1 in all, 1 different\)"),
], ids=["bad-json", "missing-field", "one-record"])
def test_a_failed_preparation_leaves_no_directory_behind(tmp_path, content, message):
    """A failed first preparation: the error, and no prepared directory holding only its lock
    file."""
    root = tmp_path / "data"
    with pytest.raises(ValueError, match=message):
        prepare(write(tmp_path, "bad.json", content), "bytes", 64, data_root=str(root))
    assert list(root.iterdir()) == []


def test_a_full_disk_while_preparing_is_refused_and_leaves_nothing_behind(tmp_path, qa_file,
                                                                          monkeypatch):
    """ENOSPC while a split is written: one line naming the file system and the file, the temp file
    removed, and no half-prepared directory left to keep the disk full."""
    def fill_disk(f, array):
        f.write(b"\x93NUMPY partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(np, "save", fill_disk)
    root = tmp_path / "data"
    with pytest.raises(ValueError, match=r"^no space left on /\S* to write \S+/train_samples.npy; "
                                         r"nothing was written: free some space there and run "
                                         r"again$"):
        prepare(qa_file[0], "bytes", 64, data_root=str(root))
    assert list(root.iterdir()) == []
