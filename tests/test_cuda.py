"""On a GPU (skipped where none is visible), in about 3 minutes: train.py in bf16 autocast, eager
and compiled; every decoder compiled (support.compiled, SPEC section 4.3) and batched
(support.batching, SPEC section 4.2) against its eager, one-prompt self; a checkpoint saved on the
GPU read on the CPU; DDP and FSDP under torchrun over NCCL.

    python -m pytest -q tests/test_cuda.py
    REFUSION_TEST_DEVICE=cpu python -m pytest -q tests/test_cuda.py   # the same logic on a CPU,
                                                                      # NCCL's runs skipped

A pass of another shape (padded, compiled, batched) sums in another order, so greedy decoding may
flip a near tie (SPEC section 4.2): a prompt whose tokens differ counts as such a flip only where
the two runs' top-2 logit gap at the first pass whose greedy choices differ is below TIE
(tie_where_runs_part), and at most a tenth of the prompts may flip.
"""

import json
import math
import os
import subprocess
import sys
from unittest.mock import patch

import pytest
import torch
import torch.distributed as dist

import sampler
import train
from helpers import ROOT, qa_rows, tiny_model, tiny_run_flags, write
from support.batching import generate_batch
from support.benchmark import Timed
from support.checkpoint import checkpoint_path, decoder_ids, load_checkpoint, model_from_checkpoint
from support.compiled import CompiledModel
from support.shard import consolidate

DEVICE = os.environ.get("REFUSION_TEST_DEVICE", "cuda")  # cpu: to try these tests without a GPU
pytestmark = pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(),
                                reason="no CUDA device visible")

TIE = 1e-2                 # a top-2 logit gap below this is a near tie (logits spread over ~10)
# the random models' token ids: the EOS lies outside the vocabulary, so no decode ends early and
# every one runs to max_new_tokens
VOCAB, MASK, PAD = 64, 63, 62
IDS = {"eos_ids": (VOCAB,), "mask_id": MASK, "pad_id": PAD}
# 20 prompts of 3 to 22 random tokens
PROMPTS = [torch.randint(0, PAD, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in range(3, 23)]

# -----------------------------------------------------------------------------
# telling a near tie from a difference


class Recording:
    """A model as the decoders call it, each forward pass's inputs and logits kept on the CPU
    (copied at once: a CUDA graph writes its next output over this one): passes, a list of
    (idx, position_ids, logits float32)."""

    def __init__(self, model):
        self.model, self.config, self.parameters = model, model.config, model.parameters
        self.new_kv_cache = model.new_kv_cache
        self.passes = []

    def __call__(self, idx, position_ids, **kwargs):
        logits = self.model(idx, position_ids, **kwargs)
        self.passes.append((idx.cpu(), position_ids.cpu(), logits.float().cpu()))
        return logits


def recorded(decode, recordings):
    """decode, each call's model wrapped in a Recording kept in recordings[tuple(prompt)]."""
    def wrapped(model, prompt, **kwargs):
        recordings[tuple(prompt)] = Recording(model)
        return decode(recordings[tuple(prompt)], prompt, **kwargs)
    return wrapped


def allowed(logits, banned):
    """(..., V) logits, the banned ids (the decoders' mask and pad ids) at -inf."""
    return logits.index_fill(-1, torch.tensor(banned), -math.inf)


def top2_gap(logits, banned):
    """(..., V) logits -> (...,) the largest allowed logit minus the second largest."""
    top = allowed(logits, banned).topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def tie_where_runs_part(passes_a, passes_b, banned):
    """The top-2 logit gap (the larger of the two runs') at the first forward pass where the two
    runs' greedy choices differ, or None when their passes part before any choice differs (their
    inputs differ first: a probability against a threshold decided, not a greedy tie)."""
    for (idx_a, pos_a, a), (idx_b, pos_b, b) in zip(passes_a, passes_b):
        if not (torch.equal(idx_a, idx_b) and torch.equal(pos_a, pos_b)):
            return None
        differ = allowed(a, banned).argmax(-1) != allowed(b, banned).argmax(-1)
        if differ.any():
            gaps = torch.maximum(top2_gap(a, banned), top2_gap(b, banned))
            return float(gaps[differ].max())
    return None


def assert_same_up_to_ties(run_a, run_b, decode, prompts, what, banned=(MASK, PAD)):
    """run_a(decode) and run_b(decode) (-> the Generations of prompts, in order) give every prompt
    the same tokens, trace and NFE, but for near-tie flips (tie_where_runs_part below TIE, printed)
    in at most a tenth of the prompts: those are run again, recorded, to find where they part.
    banned: the ids the decoders never choose."""
    a, b = run_a(decode), run_b(decode)
    parted = [i for i, (x, y) in enumerate(zip(a, b)) if x.tokens != y.tokens]
    for x, y in zip(a, b):
        if x.tokens == y.tokens:
            assert (y.trace, y.nfe) == (x.trace, x.nfe), what
    if not parted:
        return
    recordings_a, recordings_b = {}, {}
    run_a(recorded(decode, recordings_a))
    run_b(recorded(decode, recordings_b))
    for i in parted:
        key = tuple(prompts[i])
        gap = tie_where_runs_part(recordings_a[key].passes, recordings_b[key].passes, banned)
        print(f"{what}: prompt {i} flips where the top-2 logit gap is {gap}")
        assert gap is not None and gap < TIE, f"{what}: prompt {i} differs, not at a near tie"
    assert len(parted) <= len(prompts) // 10, f"{what}: {len(parted)} near-tie flips"


def one_at_a_time(model, prompts=PROMPTS):
    """A run (for assert_same_up_to_ties): each prompt decoded alone on model."""
    return lambda decode: [decode(model, p) for p in prompts]

# -----------------------------------------------------------------------------
# training, and its checkpoint


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """train.py on qa_rows() on DEVICE in bf16 autocast, 40 iterations of a 2-layer, 32-wide model,
    eager and compiled: {mode: (out_dir, each step's training loss)}."""
    tmp = tmp_path_factory.mktemp("trained")
    data = write(tmp, "sums.json", json.dumps(qa_rows()))
    runs = {}
    for mode in ("eager", "compiled"):
        flags = tiny_run_flags(tmp, (data,), mode) + [
            f"--device={DEVICE}", "--dtype=bfloat16", f"--compile={mode == 'compiled'}",
            "--max_iters=40", "--eval_interval=20", "--n_layer=2", "--n_embd=32",
            "--batch_size=16", "--learning_rate=3e-3"]
        steps = Timed(train.train_step, DEVICE, keep=True)         # each step's result
        with patch.object(train, "train_step", steps):
            train.main(flags)
        runs[mode] = (str(tmp / mode), [result[0][0].item() for result in steps.results])
    return runs


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_training_in_bf16_lowers_the_loss_and_saves_a_checkpoint(trained, mode):
    out, losses = trained[mode]
    assert len(losses) == 40 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5]), losses
    ckpt = load_checkpoint(out)
    assert ckpt["iter_num"] == 40 and math.isfinite(ckpt["best_val_loss"])
    assert (ckpt["config"]["dtype"], ckpt["config"]["compile"]) == ("bfloat16", mode == "compiled")


def test_a_checkpoint_saved_on_the_gpu_decodes_on_the_cpu_alike(trained):
    out = trained["eager"][0]
    saved = torch.load(checkpoint_path(out), weights_only=True)   # where its tensors were
    assert {t.device.type for t in saved["model"].values()} == {torch.device(DEVICE).type}
    ckpt = load_checkpoint(out, "cpu")
    on_cpu = model_from_checkpoint(ckpt, "cpu")
    on_device = model_from_checkpoint(saved, DEVICE)
    prompts = [list(f"What is {i} + {i}?".encode()) for i in (3, 17, 41, 90)]
    # one forward pass: the same logits within float32's rounding
    with torch.inference_mode():
        x = torch.tensor([prompts[0]])
        positions = torch.arange(x.shape[1])[None]
        torch.testing.assert_close(on_device(x.to(DEVICE), positions.to(DEVICE)).cpu(),
                                   on_cpu(x, positions), atol=1e-4, rtol=1e-4)
    # greedy decoding: the same tokens
    ids = decoder_ids(ckpt["meta"])
    for method in ("next_token", "refusion"):
        decode = sampler.make_decoder(dict(sampler.DEFAULTS, method=method, max_new_tokens=16,
                                          slot_size=4), ids, None)[0]
        assert_same_up_to_ties(one_at_a_time(on_device, prompts), one_at_a_time(on_cpu, prompts),
                               decode, prompts, f"{method}, GPU against CPU",
                               (ids["mask_id"], ids["pad_id"]))

# -----------------------------------------------------------------------------
# every decoder: compiled and batched against eager, one prompt at a time


def random_model(causal):
    """A random 2-layer, 32-wide model over VOCAB ids on DEVICE, its output layer (untied) scaled
    so that the logits spread over several units: greedy choices mostly far from ties, and
    probabilities on both sides of the thresholds."""
    model = tiny_model(seed=5, causal=causal, vocab_size=VOCAB, tie_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(100)
    return model.to(DEVICE)


def decoders(causal):
    """{label: decoder} of every decoder of a causal model (ReFusion with each infill, next-token)
    or of a bidirectional one (the MDM, two semi-autoregressive blocks), 32 new tokens."""
    knobs = dict(sampler.DEFAULTS, max_new_tokens=32, slot_size=8, serial_num_blocks=2,
                 slot_threshold=0.9, token_threshold=0.3, steps=16, block_length=16)
    methods = {"ReFusion, paper infill": dict(method="refusion", infill="paper"),
               "ReFusion, speculative infill": dict(method="refusion", infill="speculative"),
               "next-token": dict(method="next_token")} if causal else {"MDM": dict(method="mdm")}
    return {label: sampler.make_decoder(dict(knobs, **m), IDS, None)[0]
            for label, m in methods.items()}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "mdm"])
def test_every_decoder_compiled_gives_the_eager_tokens(causal):
    model = random_model(causal)
    compiled = CompiledModel(model)               # one for all the decoders of the model
    for label, decode in decoders(causal).items():
        assert_same_up_to_ties(one_at_a_time(model), one_at_a_time(compiled), decode, PROMPTS,
                               f"{label}, compiled against eager")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "mdm"])
def test_every_decoder_batched_gives_its_one_prompt_tokens(causal):
    model = random_model(causal)
    for label, decode in decoders(causal).items():
        assert_same_up_to_ties(one_at_a_time(model),
                               lambda d: generate_batch(model, d, PROMPTS, 4), decode, PROMPTS,
                               f"{label}, batch 4 against one prompt at a time")

# -----------------------------------------------------------------------------
# torchrun over NCCL


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="NCCL runs on GPUs")
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_torchrun_trains_over_nccl_on_every_visible_gpu(tmp_path, qa_file, sharding):
    """torchrun, a process per visible GPU, over NCCL. On one GPU train.py wraps no DDP (it does
    for 2 processes or more), but the process group is NCCL's, and FSDP shards over it."""
    if not dist.is_nccl_available():
        pytest.skip("this build of torch has no NCCL")
    n = torch.cuda.device_count()
    flags = tiny_run_flags(tmp_path, qa_file, sharding) + [
        "--device=cuda", "--dtype=bfloat16", "--max_iters=4", f"--gradient_accumulation_steps={n}"]
    flags += ["--fsdp=True"] if sharding == "fsdp" else []
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          f"--nproc_per_node={n}", str(ROOT / "train.py"), *flags], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert f"{n} process(es)" in run.stdout
    if sharding == "fsdp":                           # each process wrote its shard
        consolidate(str(tmp_path / sharding))
    ckpt = load_checkpoint(str(tmp_path / sharding))
    assert ckpt["iter_num"] == 4 and math.isfinite(ckpt["best_val_loss"])
