"""
Tokenize a corpus once into files that training reads back as memmaps (as nanoGPT's prepare.py):

    prepare(dataset, tokenizer, block_size) -> data/<name>-<tokenizer>-<block_size>/ holding
        train.bin, val.bin                   every sample's tokens back to back, uint16 or uint32
        train_samples.npy, val_samples.npy   (N, 3) int64: [start in .bin, prompt_len, total_len]
        meta.json                            tokenizer, special ids, counts, data_sha1; written last
    TokenDataset(data_dir, split)            a split read back, in batches

A sample is the query's tokens (the prompt), the response's tokens and one EOS.
"""

import hashlib
import json
import os
import platform
import shutil

import numpy as np
import torch
from filelock import FileLock

from support.corpora import DATASETS
from support.data_files import TEXT_WINDOW_BYTES, load_records
from support.files import check_kind, remove_temporaries, write_atomic
from support.tokenizer import encode, encode_prompt, get_tokenizer, special_ids, vocab_size

VAL_PERCENT = 5  # share of records that go to the validation split
FORMAT = 3  # the prepared data's layout, in meta.json: another one is prepared anew


def split_of(record: dict, by_content: bool = False) -> str:
    """"train" or "val" for a record, the same on every machine: a hash (VAL_PERCENT% val) of
    f"{module}:{name}", or with by_content of its query and response (a user's file: identical
    records share a split)."""
    key = json.dumps(_content(record)) if by_content else f"{record['module']}:{record['name']}"
    digest = hashlib.sha1(key.encode()).digest()
    # 8 bytes, not 1: a single byte % 100 would favour 0..55 and give ~5.9% val
    return "val" if int.from_bytes(digest[:8], "big") % 100 < VAL_PERCENT else "train"


def _content(record: dict) -> tuple[str, str]:
    """What makes two records the same sample: (query, response)."""
    return record["query"], record["response"]


def token_dtype(enc) -> str:
    """"uint16" while the vocabulary (mask id included) fits, else "uint32"."""
    return "uint16" if vocab_size(enc) <= 2**16 else "uint32"


def _tokenize(records: list[dict], enc, block_size: int,
              too_long: str) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens (n,) uint16 or uint32, samples (N, 3) int64, records skipped as too long). too_long:
    "skip" or "fail" (ValueError naming the record). Raises ValueError for an empty query or
    response."""
    eos_id = special_ids(enc)[0]
    dtype = token_dtype(enc)
    chunks, samples, skipped, start = [], [], 0, 0
    for r in records:
        prompt = encode_prompt(enc, r["query"])
        ids = prompt + encode(enc, r["response"]) + [eos_id]
        # decoding needs a prompt, and training a response
        if not prompt or len(ids) == len(prompt) + 1:
            raise ValueError(f"record {r['module']}:{r['name']} has an empty "
                             f"{'response' if prompt else 'query'}; "
                             "every sample needs a prompt and a response")
        if len(ids) > block_size:
            if too_long == "fail":
                raise ValueError(f"record {r['module']}:{r['name']} is {len(ids)} tokens, longer "
                                 f"than block_size={block_size}; raise --block_size or pass "
                                 "--too_long=skip")
            skipped += 1
            continue
        chunks.append(np.array(ids, dtype=dtype))
        samples.append((start, len(prompt), len(ids)))
        start += len(ids)
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)
    return tokens, np.array(samples, dtype=np.int64).reshape(-1, 3), skipped


def _source_sha1(dataset: str) -> str | None:
    """Hash of a user's data file, so an edited file is prepared again; None for built-ins."""
    if dataset in DATASETS:
        return None
    with open(dataset, "rb") as f:
        return hashlib.file_digest(f, "sha1").hexdigest()  # in chunks, however large the file


def _is_prepared(data_dir: str, expected: dict) -> bool:
    """True if data_dir holds a finished, whole preparation made with the same settings."""
    try:
        with open(os.path.join(data_dir, "meta.json")) as f:
            meta = json.load(f)
    # missing, damaged or crafted: prepared anew
    except (OSError, json.JSONDecodeError, RecursionError):
        return False
    return (all(meta.get(k) == v for k, v in expected.items())
            and not any(damaged_file(data_dir, meta, split) for split in ("train", "val")))


def prepare(dataset: str, tokenizer: str, block_size: int, data_root: str = "data",
            too_long: str = "skip") -> str:
    """Tokenize `dataset` (a DATASETS name or a data file's path) once; return its data dir,
    data_root/<name>-<tokenizer>-<block_size> (a file's name: its base name and its SHA-1's first 8
    hex digits, e.g. data/qa-1f0c9e2a-bytes-384). A finished, matching preparation is reused.
    too_long: samples over block_size tokens (EOS included) are skipped ("skip") or refused
    ("fail"). Raises FileNotFoundError for an unknown dataset, ValueError if a split gets no
    samples, files.DiskFull (a ValueError) when the disk fills up (nothing half-written is left)."""
    if dataset not in DATASETS and not os.path.lexists(dataset):
        raise FileNotFoundError(f"no built-in dataset or file named {dataset!r}; "
                                f"built-ins: {sorted(DATASETS)}, or give a path to a data file")
    if dataset not in DATASETS:
        check_kind(dataset, "--dataset names a data file (.json, .jsonl or text) or a built-in")
    sha1 = _source_sha1(dataset)
    # two files both called train.json never share a dir
    name = dataset if dataset in DATASETS \
        else f"{os.path.splitext(os.path.basename(dataset))[0]}-{sha1[:8]}"
    # a Hugging Face tokenizer (hf:FOLDER) is named by its folder's base name
    tag = f"hf-{os.path.basename(os.path.normpath(tokenizer[3:]))}" if tokenizer.startswith("hf:") \
        else tokenizer
    data_dir = os.path.join(data_root, f"{name}-{tag}-{block_size}")
    enc = get_tokenizer(tokenizer)
    expected = {"format": FORMAT, "tokenizer": tokenizer, "vocab_size": vocab_size(enc),
                "block_size": block_size, "python_version": platform.python_version(),
                "source_sha1": sha1, "too_long": too_long}
    # a file is known by its content (source_sha1), however its path is written
    if dataset in DATASETS:
        expected["dataset"] = dataset
    else:  # a user's file: its records split by content (split_of)
        expected["split"] = "content"
    if _is_prepared(data_dir, expected):
        return data_dir
    created = not os.path.isdir(data_dir)
    try:
        os.makedirs(data_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create {data_dir} for the prepared data ({e.strerror}); "
                         "choose a --data_root you can write to") from None
    try:
        # torchrun's processes: one prepares, the rest wait
        with FileLock(os.path.join(data_dir, ".lock")):
            if not _is_prepared(data_dir, expected):
                _write_splits(dataset, enc, data_dir, block_size, too_long, expected)
    except BaseException:
        if created:  # a failed first preparation (a bad record, Ctrl-C) leaves no directory behind
            shutil.rmtree(data_dir, ignore_errors=True)
        raise
    return data_dir


def _write_splits(dataset, enc, data_dir, block_size, too_long, expected) -> None:
    """Write data_dir's .bin and _samples.npy files, then meta.json, with data_sha1: the SHA-1 of
    both splits' tokens and sample tables."""
    meta_path = os.path.join(data_dir, "meta.json")
    # what a preparation killed mid-write left (kill -9, a power cut); the caller holds the lock
    files = [f"{split}{end}" for split in ("train", "val") for end in (".bin", "_samples.npy")]
    remove_temporaries(data_dir, files + ["meta.json"])
    if os.path.exists(meta_path):
        os.remove(meta_path)  # a stale meta must not vouch for half-rewritten files
    if dataset in DATASETS:
        records = DATASETS[dataset]()
    else:  # a text window leaves room for EOS
        records = load_records(dataset, window_bytes=min(TEXT_WINDOW_BYTES, block_size - 1))
    by_content = dataset not in DATASETS
    splits = {split: [r for r in records if split_of(r, by_content) == split]
              for split in ("train", "val")}
    if by_content:
        duplicates = len(records) - len(set(map(_content, records)))
        print(f"{dataset}: {duplicates:,} duplicate records (the query and response of an earlier "
              "one), each in the split of its first copy")
    if not splits["val"] and len(splits["train"]) > 1:
        # a small file: keep one record, with its copies, for validation
        last = _content(splits["train"][-1])
        splits["val"] = [r for r in splits["train"] if _content(r) == last]
        splits["train"] = [r for r in splits["train"] if _content(r) != last]
        print(f"{dataset}: no record hashed to the validation split; using the last one")
    counts, digest = {}, hashlib.sha1()
    for split in ("train", "val"):
        tokens, samples, skipped = _tokenize(splits[split], enc, block_size, too_long)
        if len(samples) == 0 and skipped:
            raise ValueError(f"{dataset}: all {skipped} samples of the {split} split are longer "
                             f"than block_size={block_size} tokens; use a larger --block_size")
        if len(samples) == 0:
            raise ValueError(f"{dataset}: too few records for a {split} split ({len(records)} in "
                             f"all, {len(set(map(_content, records)))} different); give at least "
                             "two different records")
        write_atomic(os.path.join(data_dir, f"{split}.bin"), tokens.tofile)
        write_atomic(os.path.join(data_dir, f"{split}_samples.npy"), lambda f: np.save(f, samples))
        digest.update(tokens)
        digest.update(samples)
        counts[split] = {"samples": len(samples), "tokens": len(tokens),
                         "skipped_too_long": skipped}
        print(f"{split}: {len(samples):,} samples, {len(tokens):,} tokens, "
              f"{skipped:,} skipped as longer than {block_size} tokens")
    eos_id, mask_id, pad_id = special_ids(enc)
    # what a checkpoint records, so that a run is never resumed on other data (train.py)
    meta = dict(expected, dataset=dataset, eos_id=eos_id, mask_id=mask_id, pad_id=pad_id,
                counts=counts, token_dtype=token_dtype(enc), data_sha1=digest.hexdigest())
    write_atomic(meta_path, lambda f: f.write(json.dumps(meta, indent=2).encode()))

# -----------------------------------------------------------------------------
# reading prepared data back

class TokenDataset:
    """One split of a prepared data dir: samples of prompt + response + EOS tokens. Raises
    FileNotFoundError for a missing file, ValueError for damaged data (damaged_file)."""

    def __init__(self, data_dir: str, split: str):
        names = ("meta.json", f"{split}.bin", f"{split}_samples.npy")
        paths = [os.path.join(data_dir, fn) for fn in names]
        for p in paths:
            if not os.path.isfile(p):
                raise FileNotFoundError(f"{p} not found; run support.prepare.prepare(...) or "
                                        "train.py first to prepare the data")
        with open(paths[0]) as f:
            self.meta = json.load(f)
        damaged = damaged_file(data_dir, self.meta, split)
        if damaged:
            raise ValueError(f"{damaged} does not hold what {paths[0]} counts: the prepared data "
                             "is damaged; support.prepare.prepare() writes it anew, as train.py "
                             "and sampler.py do when they start")
        self.tokens = np.memmap(paths[1], dtype=self.meta.get("token_dtype", "uint16"), mode="r")
        self.samples = np.load(paths[2], allow_pickle=False)  # (N, 3): start, prompt_len, total_len
        self.pad_id = self.meta["pad_id"]
        self.data_dir = os.path.abspath(data_dir)  # a checkpoint records it: the sampler's data

    def __len__(self) -> int:
        return len(self.samples)

    def sample(self, i: int) -> tuple[list[int], list[int]]:
        """(prompt_ids, response_ids) of sample i; the response ends with EOS."""
        start, prompt_len, total_len = (int(x) for x in self.samples[i])
        ids = self.tokens[start:start + total_len].tolist()
        return ids[:prompt_len], ids[prompt_len:]

    def first_fitting(self, n: int, room: int, block_size: int):
        """The first n (prompt_ids, response_ids), in split order, whose prompt leaves room for
        `room` new tokens in block_size (fewer when fewer fit): the prompts commands decode."""
        fits = []
        for i in range(len(self)):
            if len(fits) == n:
                break
            prompt, response = self.sample(i)
            if len(prompt) + room <= block_size:
                fits.append((prompt, response))
        return fits

    def get_batch(self, batch_size: int, rng: np.random.Generator, device="cpu"):
        """get_batch_at of `batch_size` indices drawn uniformly, with replacement, by rng."""
        return self.get_batch_at(rng.integers(0, len(self), size=batch_size), device)

    def get_batch_at(self, indices, device="cpu"):
        """The samples at `indices`, right-padded with pad_id to the longest (T): tokens (B, T),
        prompt_len (B,), length (B,) (EOS included), int64 tensors on device."""
        rows = self.samples[np.asarray(indices, dtype=np.int64)]  # (B, 3)
        tokens = np.full((len(rows), int(rows[:, 2].max())), self.pad_id, dtype=np.int64)
        for b, (start, _, total_len) in enumerate(rows):
            tokens[b, :total_len] = self.tokens[start:start + total_len]
        prompt_len, length = np.ascontiguousarray(rows[:, 1]), np.ascontiguousarray(rows[:, 2])
        return tuple(torch.from_numpy(a).to(device) for a in (tokens, prompt_len, length))


def damaged_file(data_dir: str, meta: dict, split: str) -> str | None:
    """The path of the first of a split's files that is missing or holds other counts than
    meta.json's (cut short by a full disk), or None when both are whole."""
    counts = meta.get("counts", {}).get(split, {})
    bin_path, samples_path = (os.path.join(data_dir, f"{split}{end}")
                              for end in (".bin", "_samples.npy"))
    itemsize = np.dtype(meta.get("token_dtype", "uint16")).itemsize
    if not os.path.isfile(bin_path) or \
            os.path.getsize(bin_path) != itemsize * counts.get("tokens", -1):
        return bin_path
    try:
        if len(np.load(samples_path, mmap_mode="r", allow_pickle=False)) != counts.get("samples"):
            return samples_path
    except (OSError, ValueError):
        return samples_path
    return None
