"""
Checkpoints: what train.py writes and sampler.py and the tools read.

    save_checkpoint, load_checkpoint   out_dir/ckpt.pt, written atomically, read checked
    model_from_checkpoint, decoder_ids the Transformer and the decoders' token ids of one

A checkpoint holds plain data only (tensors, numbers, strings, lists, dicts), loaded with
`torch.load(weights_only=True)`, so opening one never runs code. A run trained with --fsdp=True
has a sharded checkpoint instead (support/shard.py); `python -m tools.consolidate` makes a ckpt.pt.
"""

import dataclasses
import os
import sys

import torch

from support.files import check_kind, write_atomic
from model import ModelConfig, Transformer

FORMAT = 1  # the layout's version; a file of another one is refused
# what train.py always writes: a missing one would silently take ModelConfig's default (causal=True)
MODEL_ARGS = ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "rope_theta",
              "qk_norm", "causal")
META = ("tokenizer", "eos_id", "mask_id", "pad_id")


def checkpoint_path(out_dir):
    """out_dir/ckpt.pt, the one checkpoint file of a run."""
    return os.path.join(out_dir, "ckpt.pt")


def sharded_info_path(out_dir):
    """out_dir/ckpt_sharded.pt: a sharded checkpoint's plain data and the name of its shards'
    directory (support/shard.py)."""
    return os.path.join(out_dir, "ckpt_sharded.pt")


def save_checkpoint(out_dir, ckpt):
    """Write ckpt (a dict of plain data) to out_dir/ckpt.pt atomically. Raises files.DiskFull (a
    ValueError) when the disk, a quota or `ulimit -f` leaves no room; the previous checkpoint is
    kept."""
    os.makedirs(out_dir, exist_ok=True)
    write_atomic(checkpoint_path(out_dir), lambda f: torch.save(dict(ckpt, format=FORMAT), f),
                 "checkpoint")


def load_checkpoint(path_or_dir, device="cpu", settings_only=False):
    """The checkpoint dict in a file or an out_dir holding ckpt.pt, tensors on device
    (settings_only: mapped from the file unread, their finiteness unchecked). Warns on stderr when
    a sharded checkpoint beside it is newer. Raises FileNotFoundError when there is none;
    ValueError when the file is not a readable, consistent checkpoint of this FORMAT
    (check_consistent) or holds NaN or infinite weights (check_finite), and for a directory, a FIFO
    or a device where the file should be (never opened)."""
    # anything but a directory is meant as the file: a FIFO or /dev/zero is refused as one below
    is_file = path_or_dir.endswith(".pt") or (os.path.exists(path_or_dir)
                                              and not os.path.isdir(path_or_dir))
    path = path_or_dir if is_file else checkpoint_path(path_or_dir)
    out_dir = os.path.dirname(path) or "."
    sharded = sharded_info_path(out_dir)
    if not os.path.exists(path):
        if os.path.islink(path):
            raise FileNotFoundError(f"{path} is a symlink to {os.path.realpath(path)}, which is "
                                    "not there (an unmounted disk, or a moved file): mount or "
                                    "restore it, or remove the link")
        if os.path.lexists(sharded):
            raise FileNotFoundError(f"no checkpoint at {path}: {out_dir} holds a sharded "
                                    "checkpoint (--fsdp=True); consolidate it first with "
                                    f"`python -m tools.consolidate --out_dir={out_dir}`")
        raise FileNotFoundError(f"no checkpoint at {path}: train one first with "
                                f"`python train.py --out_dir={out_dir}`")
    check_kind(path, "a checkpoint is the file ckpt.pt that train.py writes: move this away, or "
                     "point to a run's out_dir or its ckpt.pt")
    if os.path.isfile(sharded) and os.path.getmtime(sharded) > os.path.getmtime(path):
        print(f"warning: {path} is older than the sharded checkpoint {sharded}; run "
              f"`python -m tools.consolidate --out_dir={out_dir}` to use the latest weights",
              file=sys.stderr)
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True, mmap=settings_only)
    except Exception as e:  # torch raises several types for truncated or unsafe files
        raise ValueError(f"{path} is not a readable checkpoint ({type(e).__name__}); it may be "
                         "truncated, from another program, or hold code (which is never "
                         "executed); retrain it or point to another file") from None
    if not isinstance(ckpt, dict) or not {"model", "model_args", "config"} <= ckpt.keys():
        raise ValueError(f"{path} is not a checkpoint written by train.py "
                         "(no model weights and config)")
    if ckpt.get("format") != FORMAT:
        raise ValueError(f"{path} has checkpoint format {ckpt.get('format')!r}, this code reads "
                         f"format {FORMAT}; retrain it with this version of train.py")
    check_consistent(ckpt, path)
    if not settings_only:
        check_finite(ckpt["model"], path)
    return upgrade(ckpt)


def check_finite(weights, path):
    """Raise ValueError naming the file `path` and the first of weights ({name: tensor}) that holds
    NaN or infinity."""
    for name, t in weights.items():
        floats = isinstance(t, torch.Tensor) and t.is_floating_point()
        if floats and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f"{path}: the weight {name} holds {bad} NaN or infinite value(s); the "
                             "file is damaged, or the run that wrote it diverged: use an earlier "
                             "checkpoint or another file")


def check_consistent(ckpt, path):
    """Raise ValueError naming the file and the problem when a checkpoint's parts disagree:
    model_args unknown to ModelConfig or lacking one of MODEL_ARGS, weights not those model_args
    build, a meta lacking one of META, a config without objective or max_iters."""
    def refuse(problem):
        raise ValueError(f"{path} is inconsistent: {problem}; it was not written by this train.py "
                         "or was edited: retrain it or point to another file")
    args, known = ckpt["model_args"], {f.name for f in dataclasses.fields(ModelConfig)}
    if not isinstance(args, dict):
        refuse(f"model_args is a {type(args).__name__}, not a dict")
    unknown, missing = sorted(args.keys() - known), sorted(set(MODEL_ARGS) - args.keys())
    if unknown or missing:
        refuse("model_args " + " and ".join(
            part for part in (unknown and f"has unknown keys {unknown}",
                              missing and f"lacks {missing}") if part))
    try:
        with torch.device("meta"):  # names and shapes only
            shapes = {name: tuple(t.shape)
                      for name, t in Transformer(ModelConfig(**args)).state_dict().items()}
    except (TypeError, ValueError) as e:
        refuse(f"model_args do not make a model ({e})")
    weights = ckpt["model"]
    found = {name: tuple(t.shape) for name, t in weights.items() if isinstance(t, torch.Tensor)} \
        if isinstance(weights, dict) else {}
    if found != shapes:
        wrong = sorted(name for name in shapes.keys() | found.keys()
                       if shapes.get(name) != found.get(name))
        refuse(f"the weights do not fit its model_args ({len(wrong)} tensors differ; {wrong[0]}: "
               f"{found.get(wrong[0], 'missing')} in the file, {shapes.get(wrong[0], 'none')} "
               "from model_args)")
    meta = ckpt.get("meta")
    if not isinstance(meta, dict) or set(META) - meta.keys():
        refuse("its meta lacks "
               f"{', '.join(k for k in META if not isinstance(meta, dict) or k not in meta)}")
    if not isinstance(ckpt["config"], dict) or \
            not {"objective", "max_iters"} <= ckpt["config"].keys():
        refuse("its config lacks the objective or max_iters")


def upgrade(ckpt):
    """ckpt with lr_decay_iters, where it lacks it, set to max_iters: the decay it trained with."""
    ckpt["config"].setdefault("lr_decay_iters", ckpt["config"]["max_iters"])
    return ckpt


def model_from_checkpoint(ckpt, device="cpu"):
    """Rebuild the Transformer of a loaded checkpoint, in eval mode on device."""
    model = Transformer(ModelConfig(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval()


def decoder_ids(meta):
    """The token ids a decoder takes, from a checkpoint's meta: {"eos_ids": (eos_id,), "mask_id",
    "pad_id"}."""
    return {"eos_ids": (meta["eos_id"],), "mask_id": meta["mask_id"], "pad_id": meta["pad_id"]}
