"""
Tokenize a data set once into the memmapped files training reads (support/prepare.py), ahead of
training, as nanoGPT's prepare.py does; train.py prepares what it needs itself when it starts.

    python -m tools.prepare --dataset=quotes
    python -m tools.prepare --dataset=my_data.jsonl --tokenizer=hf:smollm2 --block_size=512
"""

import os
import sys

if not __package__:  # run as a file (python tools/X.py): the repository's root holds the modules
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configurator import parse_args, require, run_cli, settings_in
from support.prepare import TokenDataset, prepare
from support.tokenizer import TOKENIZERS

# -----------------------------------------------------------------------------
# default config: as train.py's
dataset = "stdlib"         # a built-in corpus name, or a path to a .json / .jsonl / text file
tokenizer = "bytes"        # 'bytes', 'gpt2', or hf:FOLDER (a Hugging Face folder's tokenizer.json)
block_size = 384           # the context: longer samples are skipped or refused (too_long)
data_root = "data"         # the prepared data goes to data_root/<name>-<tokenizer>-<block_size>
too_long = "skip"          # samples longer than block_size: 'skip' them (counted) or 'fail'
# -----------------------------------------------------------------------------
DEFAULTS = settings_in(globals())


def main(argv):
    cfg = parse_args(DEFAULTS, argv)
    if cfg["tokenizer"] not in TOKENIZERS and not cfg["tokenizer"].startswith("hf:"):
        raise ValueError(f"--tokenizer={cfg['tokenizer']!r}: choose one of "
                         f"{', '.join(TOKENIZERS)}, or hf:FOLDER")
    if cfg["too_long"] not in ("skip", "fail"):
        raise ValueError(f"--too_long={cfg['too_long']!r}: choose skip or fail")
    require(cfg, ("block_size",), "positive", lambda v: v > 0)
    data_dir = prepare(cfg["dataset"], cfg["tokenizer"], cfg["block_size"], cfg["data_root"],
                       cfg["too_long"])
    counts = {split: len(TokenDataset(data_dir, split)) for split in ("train", "val")}
    print(f"prepared {data_dir}: {counts['train']:,} training and {counts['val']:,} validation "
          f"samples; train.py --dataset={cfg['dataset']} --tokenizer={cfg['tokenizer']} "
          f"--block_size={cfg['block_size']} reads them")


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
