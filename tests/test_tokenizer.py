"""The tokenizers (support/tokenizer.py) and reading prepared data back (support/prepare.py's
TokenDataset)."""

import json

import numpy as np
import pytest
import torch

from support import tokenizer
from support.prepare import TokenDataset, prepare



def test_byte_tokenizer_round_trips_any_text():
    enc = tokenizer.get_tokenizer("bytes")
    text = "def f(x):\n    return x  # naïve 😀 λ\t\r\n"
    ids = tokenizer.encode(enc, text)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    assert all(0 <= i < 256 for i in ids)
    assert tokenizer.decode(enc, ids) == text


def test_a_long_run_of_whitespace_is_encoded_without_crashing_the_tokenizer():
    """tiktoken's regex panics on about 500,000 whitespace characters in a row; encode() cuts longer
    runs than MAX_SPACE_RUN and gets the very tokens an uncut encoding gives (one per byte), and
    text without such a run is encoded whole."""
    enc = tokenizer.get_tokenizer("bytes")
    for text in (" " * 1_000_000 + "x", "a" + " \n" * 600_000 + "b"):
        assert tokenizer.encode(enc, text) == list(text.encode())
    # runs tiktoken still takes whole
    text = "def f(x):\n" + " " * 25_000 + "return x\n" + "\t" * 10_001
    assert tokenizer.encode(enc, text) == enc.encode_ordinary(text)
    source = open(json.decoder.__file__, encoding="utf-8").read()
    assert tokenizer._pieces(source) == [source] and \
        tokenizer.encode(enc, source) == enc.encode_ordinary(source)


def test_byte_tokenizer_special_ids_and_vocab():
    enc = tokenizer.get_tokenizer("bytes")
    assert tokenizer.special_ids(enc) == (256, 257, 258)
    assert enc.n_vocab == 259


def test_literal_mask_text_is_not_the_mask_id():
    enc = tokenizer.get_tokenizer("bytes")
    ids = tokenizer.encode(enc, "x = '<|mask|>' + '<|endoftext|>'")
    assert not set(ids) & set(tokenizer.special_ids(enc))
    assert tokenizer.decode(enc, ids) == "x = '<|mask|>' + '<|endoftext|>'"


def test_decode_tolerates_special_ids_and_broken_utf8():
    enc = tokenizer.get_tokenizer("bytes")
    eos, mask, pad = tokenizer.special_ids(enc)
    assert tokenizer.decode(enc, [104, 105, mask, eos, pad]) == "hi<|mask|><|endoftext|><|pad|>"
    assert tokenizer.decode(enc, [0xE2, 0x82]) == "\ufffd"  # first two bytes of the 3-byte "€"
    assert tokenizer.decode(enc, torch.tensor([104, 105])) == "hi"


def test_unknown_tokenizer_is_a_value_error_listing_the_choices():
    with pytest.raises(ValueError, match="bytes.*gpt2"):
        tokenizer.get_tokenizer("llama")


def test_gpt2_tokenizer_or_a_clear_offline_error():
    try:
        enc = tokenizer.get_tokenizer("gpt2")
    except FileNotFoundError as e:
        msg = str(e)
        assert "GPT-2 BPE" in msg and "TIKTOKEN_CACHE_DIR" in msg and "--tokenizer=bytes" in msg
        pytest.skip("GPT-2 BPE file not downloadable or cached here (offline); "
                    "error message checked")
    assert enc.n_vocab == 50259
    assert tokenizer.special_ids(enc) == (50256, 50257, 50258)
    assert tokenizer.encode(enc, "hello world") == [31373, 995]  # GPT-2's own ids
    assert 50257 not in tokenizer.encode(enc, "<|mask|>")


def test_token_dataset_without_preparation_says_to_prepare(tmp_path):
    with pytest.raises(FileNotFoundError, match="prepare"):
        TokenDataset(str(tmp_path / "nothing"), "train")


def test_get_batch_pads_right_to_longest_sample(tmp_path, qa_file):
    data_dir = prepare(qa_file[0], "bytes", 64, data_root=str(tmp_path / "data"))
    ds = TokenDataset(data_dir, "train")
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
