"""
Checkpoints: what train.py writes and sampler.py / bench.py read.

A checkpoint is one `ckpt.pt` in out_dir holding plain data only (tensors, numbers, strings, lists,
dicts), loaded with `torch.load(weights_only=True)`, so opening one never runs code from it. It is
written to a temp file and renamed, so a crash mid-write leaves the previous checkpoint intact.
"""

import os

import torch

from model import ModelConfig, Transformer

FORMAT = 1  # bumped when the layout changes; older files are refused with a message


def checkpoint_path(out_dir):
    """out_dir/ckpt.pt, the one checkpoint file of a run."""
    return os.path.join(out_dir, "ckpt.pt")


def save_checkpoint(out_dir, ckpt):
    """Write ckpt (a dict of plain data) to out_dir/ckpt.pt atomically (temp file + rename)."""
    os.makedirs(out_dir, exist_ok=True)
    path = checkpoint_path(out_dir)
    tmp = path + ".tmp"
    torch.save(dict(ckpt, format=FORMAT), tmp)
    os.replace(tmp, path)


def load_checkpoint(path_or_dir, device="cpu"):
    """Read a checkpoint dict from a file or an out_dir holding ckpt.pt.

    Raises FileNotFoundError when there is none, ValueError when the file is not a readable
    checkpoint of this format (truncated, foreign, crafted to run code, or from another version).
    """
    is_file = path_or_dir.endswith(".pt") or os.path.isfile(path_or_dir)
    path = path_or_dir if is_file else checkpoint_path(path_or_dir)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}: train one first with "
                                f"`python train.py --out_dir={os.path.dirname(path) or '.'}`")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # torch raises several types for truncated or unsafe files
        raise ValueError(f"{path} is not a readable checkpoint ({type(e).__name__}); it may be truncated, "
                         "from another program, or hold code (which is never executed); retrain it or "
                         "point to another file") from None
    if not isinstance(ckpt, dict) or not {"model", "model_args", "config"} <= ckpt.keys():
        raise ValueError(f"{path} is not a checkpoint written by train.py (no model weights and config)")
    if ckpt.get("format") != FORMAT:
        raise ValueError(f"{path} has checkpoint format {ckpt.get('format')!r}, this code reads format "
                         f"{FORMAT}; retrain it with this version of train.py")
    return upgrade(ckpt)


def upgrade(ckpt):
    """Fill in the settings added since a checkpoint was written, with the values that reproduce its
    run: a checkpoint from before lr_decay_iters existed decayed to min_lr at its own max_iters."""
    ckpt["config"].setdefault("lr_decay_iters", ckpt["config"]["max_iters"])
    return ckpt


def model_from_checkpoint(ckpt, device="cpu"):
    """Rebuild the Transformer of a loaded checkpoint, in eval mode on device."""
    model = Transformer(ModelConfig(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval()
