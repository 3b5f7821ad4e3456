r"""
Draw the pictures of docs/ from the code's own output (support/drawing.py; needs matplotlib).

    python -m tools.figures            # docs/layout.png: reorganize_slots of one transform sample
    python -m tools.figures --out_dir=bench/transform-refusion-ft \
        --sampler_flags="--slot_size=8 --serial_num_blocks=1"  # ... and decode.png of that model

docs/decode.png and the README's docs/decode.gif are sampler.py --plot of the quick start's model on
one validation line, the gif in slots of 8, two serial blocks:

    python sampler.py config/sample_quotes.py --plot=docs/decode.png \
        --prompt="('urllib', 'urlcleanup'): ('urllib.request', 'urlcleanup'),"
    python sampler.py config/sample_quotes.py --plot=docs/decode.gif --slot_size=8 \
        --serial_num_blocks=2 --prompt="('urllib', 'urlcleanup'): ('urllib.request', 'urlcleanup'),"
"""

import os
import shlex
import sys

import torch

if not __package__:  # run as a file (python tools/X.py): the repository's root holds the modules
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sampler
from configurator import parse_args, run_cli, settings_in
from data import IGNORE, reorganize_slots
from support.drawing import cell_text, plot_layout, picture_path, pyplot
from support.prepare import TokenDataset, prepare
from support.tokenizer import get_tokenizer

# -----------------------------------------------------------------------------
# default config
dataset = "transform"  # data set (built-in name or file) whose validation sample layout.png shows
tokenizer = "bytes"            # its tokenizer
block_size = 200  # its context (the prepared data: data_root/<dataset>-<tokenizer>-<block_size>)
data_root = "data"             # where prepared data sets live
sample = 2  # the validation sample drawn (2: a short "copy:" one; seed 16 shuffles its slots)
slot_size = 4                  # the slot size S of the layout
seed = 16  # reorganize_slots' generator: p_mask, the masked slots, the clean slots' order
layout_png = "docs/layout.png" # where the layout figure goes
out_dir = ""  # a checkpoint (train.py's out_dir) to draw the decode figure with; empty: none
decode_png = "docs/decode.png" # where the decode figure goes
sampler_flags = ""  # more sampler.py flags for decoding, e.g. "--slot_size=8 --serial_num_blocks=1"
# -----------------------------------------------------------------------------
DEFAULTS = settings_in(globals())


def draw_layout(cfg):
    """Draw reorganize_slots of validation sample cfg["sample"] (slot_size, seed) in layout_png."""
    data_dir = prepare(cfg["dataset"], cfg["tokenizer"], cfg["block_size"], cfg["data_root"])
    val = TokenDataset(data_dir, "val")
    if not 0 <= cfg["sample"] < len(val):
        raise ValueError(f"--sample={cfg['sample']}: the validation split holds {len(val)} samples "
                         f"(0..{len(val) - 1})")
    tokens, prompt_len, length = val.get_batch_at([cfg["sample"]])
    enc, eos_id, mask_id = get_tokenizer(cfg["tokenizer"]), val.meta["eos_id"], val.meta["mask_id"]
    batch = reorganize_slots(tokens, prompt_len, length, (cfg["slot_size"],), mask_id,
                             torch.Generator().manual_seed(cfg["seed"]))
    texts = ([cell_text(enc, t, (eos_id,), mask_id) for t in batch.idx[0].tolist()],
             [cell_text(enc, t, (eos_id,)) if t != IGNORE else ""
              for t in batch.labels[0].tolist()])
    title = (f"reorganize_slots of validation sample {cfg['sample']} of {cfg['dataset']}: "
             f"slot size {cfg['slot_size']}, generator seed {cfg['seed']} "
             "(■: EOS, ░: the mask id, ↵: newline)")
    fig = plot_layout(batch, prompt_len, length, cfg["slot_size"], mask_id, cfg["layout_png"],
                      texts, title)
    pyplot().close(fig)
    print(f"wrote {cfg['layout_png']}")


def main(argv):
    cfg = parse_args(DEFAULTS, argv)
    pyplot()
    if cfg["slot_size"] <= 0:
        raise ValueError(f"--slot_size={cfg['slot_size']}: a slot holds at least one token")
    for key in ("layout_png", "decode_png"):   # both checked before any work
        if cfg[key]:
            cfg[key] = picture_path(cfg[key], f"--{key}")
    if cfg["layout_png"]:
        draw_layout(cfg)
    if cfg["out_dir"]:
        # the command line that decodes and draws
        sampler.main([f"--out_dir={cfg['out_dir']}", "--num_samples=1",
                      f"--plot={cfg['decode_png']}", *shlex.split(cfg["sampler_flags"])])
        print(f"wrote {cfg['decode_png']}")


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
