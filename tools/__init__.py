"""
The commands beside training and sampling, run from the repository's root as modules:

    python -m tools.bench            the side-by-side benchmark (docs/benchmark.md)
    python -m tools.eval_humaneval   HumanEval pass@1 and speed of any checkpoint or folder
    python -m tools.lm_eval_model    lm-evaluation-harness with our model `refusion` (GSM8K, ...)
    python -m tools.convert_gguf     a GGUF file -> a Hugging Face folder (docs/pretrained.md)
    python -m tools.consolidate      a sharded (FSDP) checkpoint -> one ckpt.pt
    python -m tools.figures          the pictures of docs/
    python -m tools.prepare          a data set tokenized once, ahead of training
    python -m tools.bench_pretrained the benchmark on a pretrained model (SmolLM2-135M)
    python -m tools.bench_length     each decoder's cost against the length of the answer
    python -m tools.bench_exact      verify="exact" beside next-token decoding and the paper's
    python -m tools.probe            what a forward pass costs here, and what that allows ReFusion
    python -m tools.gpu_report       the acceptance check on one GPU (docs/bench_gpu.md)
"""
