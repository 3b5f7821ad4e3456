"""Checkpoints that never run code and never lose a run (checkpoint.py)."""

import pickle

import pytest
import torch

import train
from checkpoint import load_checkpoint
from helpers import tiny_run_flags



def test_bad_checkpoints_are_refused_and_never_run_code(tmp_path, qa_file):
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*ckpt.pt: train one first"):
        load_checkpoint(str(tmp_path / "missing"))
    train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=2"])
    good = (tmp_path / "run" / "ckpt.pt").read_bytes()
    marker = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    cases = {"garbage.pt": b"not a checkpoint at all", "truncated.pt": good[:len(good) // 2], "empty.pt": b"",
             "crafted.pt": pickle.dumps({"model": Payload(), "model_args": {}}, protocol=2)}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match="is not a readable checkpoint .*retrain it or point to another file"):
            load_checkpoint(str(tmp_path / name))
    assert not marker.exists()                                     # the crafted file's code never ran
    old = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)
    old["format"] = 0
    torch.save(old, tmp_path / "old.pt")
    with pytest.raises(ValueError, match="has checkpoint format 0, this code reads format 1; retrain"):
        load_checkpoint(str(tmp_path / "old.pt"))
    torch.save({"weights": torch.zeros(2)}, tmp_path / "foreign.pt")
    with pytest.raises(ValueError, match="not a checkpoint written by train.py"):
        load_checkpoint(str(tmp_path / "foreign.pt"))
    assert (tmp_path / "run" / "ckpt.pt").read_bytes() == good
