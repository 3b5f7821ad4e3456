"""
Consolidate a sharded checkpoint (train.py --fsdp=True) into one ckpt.pt, weights only, that
sampler.py and tools read; training continues from the sharded one (support/shard.py).

    python -m tools.consolidate --out_dir=out-qwen3-8b
"""

import os
import sys

if not __package__:  # run as a file (python tools/X.py): the repository's root holds the modules
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configurator import Defaults, parse_args, run_cli
from support.shard import consolidate

out_dir = "out"  # run whose sharded checkpoint becomes DIR/ckpt.pt (weights only, for sampler.py)


def main(argv):
    cfg = parse_args(Defaults({"out_dir": out_dir}, __file__), argv)
    path = consolidate(cfg["out_dir"])
    print(f"wrote {path}: weights only, for `python sampler.py --out_dir={cfg['out_dir']}`")


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
