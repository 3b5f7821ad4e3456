"""Small builders shared by the tests under tests/."""

import collections
import json
import os
import signal
import socket
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import sampler
import train
from model import ModelConfig, Transformer
from support.checkpoint import decoder_ids, load_checkpoint, model_from_checkpoint

TOL = 1e-5
ROOT = Path(__file__).resolve().parent.parent  # the repository

# texts a tokenizer must encode as its reference does: prose, code, CJK, emoji, whitespace runs,
# digits, CRLF, NFC
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; they'll say I'M late!",
    ("def f(x):\n    if x:\n        return x * 2\n\treturn None\n\n\n"
     "class A_b(object):  # note\n    pass\n"),
    "量子计算机使用量子比特。日本語のテキストと、한국어 문장도 있습니다.",
    "emoji 🙂🚀 and a family 👩‍👩‍👧 and a flag 🇫🇷!",
    "a" + " " * 17 + "b\n\n\n   \n\t\t  x" + " " * 40,
    "12345 + 678 = 13023, pi is 3.14159 and 1e-5",
    "line one\r\nline two\r\n\r\n  indented\r\n",
    "café, cafe\u0301 and Å (A + ring) A\u030a",
    "URL: https://example.com/a_b?c=1&d=2 <b>bold</b> {\"k\": [1, 2]}",
    "ÀÉÎõü ß ΑΒΓ αβγ Привет, мир! שלום مرحبا नमस्ते",
    "version 3.10.12, 1,000,000 items at 99.5%  42\t7  \n 8x9 x 1st 2nd",
    "other digits: ١٢٣ ½ Ⅻ ² and spaces before them:   ١   Ⅻ",
    "",
]


def tiny_model(seed=0, causal=True, **overrides):
    """A 2-layer, 32-wide Transformer over 40 token ids (float32, eval mode), seeded."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=40, block_size=128, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
               causal=causal)
    cfg.update(overrides)
    return Transformer(ModelConfig(**cfg)).eval()


def qa_rows():
    """100 small query/response records plus 3 too long for block_size=64 with the byte
    tokenizer."""
    rows = [{"query": f"What is {i} + {i}?", "response": f" {2 * i}"} for i in range(100)]
    return rows + [{"query": "long " * 20, "response": "answer"} for _ in range(3)]


def write(tmp_path, name, content):
    """Write text (UTF-8) or bytes to tmp_path/name; returns the path as a str."""
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return str(path)


def free_port():
    """A TCP port of 127.0.0.1 that nothing listens on now, for a process group to meet at."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_run_flags(tmp_path, qa_file, out, objective="refusion"):
    """train.py flags for a 1-layer, 16-wide run on qa_file that takes a second or two."""
    # 6 steps inside warm-up: the learning rate does not depend on max_iters
    return [f"--dataset={qa_file[0]}", f"--data_root={tmp_path / 'data'}",
            f"--out_dir={tmp_path / out}", f"--objective={objective}", "--block_size=64",
            "--n_layer=1", "--n_head=2", "--n_embd=16", "--batch_size=4", "--eval_interval=2",
            "--eval_iters=1", "--slot_sizes=2,4", "--gen_length=16", "--warmup_iters=10"]


# Qwen2/3's pre-tokenizer: the regex of the Split step of their tokenizer.json
QWEN2_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
             r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def byte_level_chars():
    """The 256 characters a byte-level BPE (GPT-2's, Qwen's, SmolLM2's) spells the bytes 0..255
    with, in byte order: the 188 printable Latin-1 bytes are themselves, the other 68 chr(256),
    chr(257), ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = iter(range(256, 256 + 68))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def save_tiny_hf_folder(folder, mask=True, seed=0, family="qwen3"):
    """A tiny random Qwen3 (or, with family "llama", a Llama as SmolLM2 is: no query/key norms) in
    Hugging Face's layout, as the releases ship it: config.json, model.safetensors and a byte-level
    tokenizer.json (one token per byte, ids 0..255, then <|endoftext|> 256, <|im_start|> 257,
    <|im_end|> 258 and, with mask, <|mask|> 259).
    Returns the Transformer whose weights were saved (vocab 300, 2 layers, width 32)."""
    import json
    import os

    import tokenizers
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=300, block_size=256, n_layer=2, n_head=4, n_kv_head=2,
                         n_embd=32, head_dim=8, intermediate_size=64, rope_theta=1e6,
                         qk_norm=family == "qwen3")
    model = Transformer(config).eval()
    os.makedirs(folder, exist_ok=True)
    hf_config = {"model_type": family, "vocab_size": 300, "max_position_embeddings": 256,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "hidden_size": 32, "head_dim": 8, "intermediate_size": 64, "rope_theta": 1e6,
                 "rope_scaling": None, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                 "attention_bias": False, "hidden_act": "silu"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config, f)
    save_file({"model." + n: t.clone() for n, t in model.state_dict().items()
               if n != "lm_head.weight"},
              os.path.join(folder, "model.safetensors"))
    vocab = {c: b for b, c in enumerate(byte_level_chars())}
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, []))
    bpe.normalizer = tokenizers.normalizers.NFC()
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Split(tokenizers.Regex(QWEN2_PAT), "isolated"),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = tokenizers.decoders.ByteLevel()
    added = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + ["<|mask|>"] * mask
    bpe.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t in added])
    bpe.save(os.path.join(folder, "tokenizer.json"))
    return model


# Prompts of 1 to 36 bytes: "W" ends after one token while the others have slots left.
PROMPTS = [list(f"What is {i} + {i}?".encode()) for i in (3, 41, 7)] + [
    list(("long " * 9).encode()), list(b"W"), list(("What is 12 + 12? " * 2).encode())]


def trained_model(tmp_path_factory, objective):
    """(model, ids) of a 2-layer, 32-wide model trained for 300 steps on qa_rows() (a few
    seconds): confident where the data is clear, unsure elsewhere, so decodes take every path."""
    tmp = tmp_path_factory.mktemp(objective)
    path = write(tmp, "sums.json", json.dumps(qa_rows()))
    train.main(tiny_run_flags(tmp, (path,), "run", objective) +
               ["--max_iters=300", "--n_layer=2", "--n_embd=32", "--eval_interval=1000",
                "--warmup_iters=20", "--learning_rate=3e-3", "--batch_size=16"])
    ckpt = load_checkpoint(str(tmp / "run"))
    return model_from_checkpoint(ckpt).eval(), decoder_ids(ckpt["meta"])


class PathCounter:
    """Counts the ReFusion paths decodes take, by wrapping sampler's verify and infill steps."""

    def __init__(self, monkeypatch):
        self.seen = collections.Counter()
        verify, infill = sampler.verify_drafts, sampler.infill_slots

        def counted_verify(state, *args):
            commit, accepted = verify(state, *args)
            if commit.starts:
                self.seen["verify ends at EOS" if commit.eos else "verify commits whole slots"] += 1
            return commit, accepted

        def counted_infill(state, starts, *args):
            commit = infill(state, starts, *args)
            self.seen["infill of several rows" if len(starts) > 1 else "infill of one row"] += 1
            if commit.eos:
                self.seen["infill ends at EOS"] += 1
            return commit

        monkeypatch.setattr(sampler, "verify_drafts", counted_verify)
        monkeypatch.setattr(sampler, "infill_slots", counted_infill)


# S, serial blocks, slot threshold, token threshold: together they take every path (asserted)
SETTINGS = [(4, 1, 0.9, 0.3), (4, 2, 0.9, 0.3), (4, 1, 0.5, 0.0), (8, 2, 0.0, 0.6),
            (2, 1, 0.7, 0.1), (4, 2, 0.0, 1.5), (1, 2, 0.5, 0.1), (2, 2, 0.0, 0.0)]


def trained_tokenizer(folder):
    """A `tokenizers` byte-level BPE of 600 tokens trained on TEXTS with SmolLM2's pre-tokenizer
    (every digit apart, then GPT-2's regex), special <|endoftext|>, <|im_start|>, <|im_end|>, and a
    non-special added token <think> matched in text; saved as folder/tokenizer.json.
    Returns the reference."""
    tokenizers = pytest.importorskip("tokenizers")
    reference = tokenizers.Tokenizer(tokenizers.models.BPE())
    reference.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Digits(individual_digits=True),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    reference.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    reference.train_from_iterator(TEXTS * 3, trainer)
    reference.add_tokens([tokenizers.AddedToken("<think>", special=False, normalized=False)])
    reference.save(str(folder / "tokenizer.json"))
    # special-token strings in text stay text, as in our encode
    reference.encode_special_tokens = True
    return reference


def give_ids(spec, ids):
    """Give a save_tiny_hf_folder tokenizer.json's added tokens these ids, each also in the model's
    vocabulary, as SmolLM2's tokenizer.json lists its special tokens: the `tokenizers` library
    (and so transformers) takes an added token's id from there, and numbers the others after the
    vocabulary whatever id the file gives them."""
    for token, new in zip(spec["added_tokens"], ids):
        token["id"] = new
        spec["model"]["vocab"][token["content"]] = new


def edit_json(path, edit):
    """Rewrite the JSON file at path with edit(its object), which changes it in place."""
    obj = json.loads(Path(path).read_text(encoding="utf-8"))
    edit(obj)
    Path(path).write_text(json.dumps(obj), encoding="utf-8")


@contextmanager
def never_blocks(seconds=60):
    """A block that must end within `seconds`: an open() or read() waiting on a FIFO fails the test
    (SIGALRM interrupts it) instead of hanging the run."""
    def blocked(signum, frame):
        raise AssertionError(f"blocked for {seconds} s: a FIFO was opened or read")
    previous = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def sparse(path, size):
    """Make the file at path (created if missing) `size` bytes of zeros without writing them: a
    sparse file, as large as a test needs and nothing on disk."""
    with open(path, "ab") as f:
        f.truncate(size)


def link_to_dev_zero(path):
    """A symlink at path to /dev/zero, a device that reads as endless zeros."""
    path.symlink_to("/dev/zero")


# what can stand where a regular file should: how to make it at a path, how a message names it
NOT_FILES = {"directory": (Path.mkdir, "is a directory"),
             "fifo": (os.mkfifo, r"is a FIFO \(named pipe\)"),
             "dev-zero": (link_to_dev_zero, r"\(a symlink to /dev/zero\) is a character device")}
