"""Small builders shared by the tests under tests/."""

from pathlib import Path

import torch

from model import ModelConfig, Transformer

TOL = 1e-5
ROOT = Path(__file__).resolve().parent.parent  # the repository


def tiny_model(seed=0, causal=True, **overrides):
    """A 2-layer, 32-wide Transformer over 40 token ids (float32, eval mode), seeded."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=40, block_size=128, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, causal=causal)
    cfg.update(overrides)
    return Transformer(ModelConfig(**cfg)).eval()


def qa_rows():
    """100 small query/response records plus 3 too long for block_size=64 with the byte tokenizer."""
    rows = [{"query": f"What is {i} + {i}?", "response": f" {2 * i}"} for i in range(100)]
    return rows + [{"query": "long " * 20, "response": "answer"} for _ in range(3)]


def write(tmp_path, name, content):
    """Write text (UTF-8) or bytes to tmp_path/name; returns the path as a str."""
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return str(path)


def tiny_run_flags(tmp_path, qa_file, out, objective="refusion"):
    """train.py flags for a 1-layer, 16-wide run on qa_file that takes a second or two."""
    return [f"--dataset={qa_file[0]}", f"--data_root={tmp_path / 'data'}", f"--out_dir={tmp_path / out}",
            f"--objective={objective}", "--block_size=64", "--n_layer=1", "--n_head=2", "--n_embd=16",
            "--batch_size=4", "--eval_interval=2", "--eval_iters=1", "--slot_sizes=2,4",
            "--warmup_iters=10"]  # 6 steps inside warm-up: the learning rate does not depend on max_iters
