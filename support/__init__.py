"""
What the scripts need that is not the method (the top level: model.py, kvcache.py, data.py,
train.py, sampler.py, of which only the command lines' main functions import this package).

    tokenizer      text <-> token ids: bytes and GPT-2 (tiktoken), a Hugging Face folder's
    corpora        the built-in data sets (records) and their checkers
    data_files     a user's data files (.json, .jsonl, plain text) -> records; read_utf8
    prepare        records -> memmapped token files, and TokenDataset reading them back
    files          files written whole or not at all; JSON files from elsewhere, read and checked
    checkpoint     code-free checkpoints: ckpt.pt written by train.py, read by everything else
    runs           train.py's plumbing: checks, out_dir lock, start modes, data, signals, saving
    progress       train.py's progress bar: loss, tokens/s and FLOP/s over the last interval
    hardware       the machine's matrix units, --dtype=auto's choice, what a figure ran on
    sampling       sampler.py's command line besides the decoders: models, prompts, trace, output
    batching       many prompts at once (SPEC 4.2): the decoders' passes run together
    compiled       compiled decoding (SPEC 4.3): torch.compile graphs, CUDA graphs on a GPU
    device_reads   what a decode makes a GPU wait for, counted on any device
    shard          FSDP: sharded training and sharded checkpoints
    hf_folder      Hugging Face model folders -> Transformer
    hf_tokenizer   tokenizer.json through the tokenizers library, and a folder's special ids
    hf_reference   transformers' own model and generate on our weights: the reference decoder
    chat           chat templates
    gguf_file      llama.cpp's GGUF -> a Hugging Face folder
    benchmark      what the benchmarks measure: models trained or reused, timed passes, points
    report         how the benchmarks report it: tables, the picture, a run's files
    drawing        the pictures of a decode and of the training layout (matplotlib)
"""

import sys

if "-m" in sys.orig_argv[:-1]:  # python -m support.prepare: a module, not a command
    _module = sys.orig_argv[sys.orig_argv.index("-m") + 1]
    if _module.startswith("support."):
        raise SystemExit(f"error: {_module} is a module of support/, not a command; the commands "
                         "are train.py, sampler.py and python -m tools.<name> (tools/__init__.py "
                         "lists them; python -m tools.prepare prepares a data set ahead)")
