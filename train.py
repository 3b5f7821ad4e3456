"""
Train a ReFusion model, or a baseline, on prompt/response data (SPEC section 3).

    python train.py                                   # small ReFusion model, stdlib corpus, CPU
    python train.py config/train_stdlib.py --max_iters=500 --device=cuda

Top to bottom: the settings, the objective's batches and loss, the step, the loop, then main;
support/runs.py holds the plumbing main calls, support/progress.py the progress bar.
"""

import math
import os
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

from configurator import explicit_keys, parse_args, run_cli, settings_in
from data import (IGNORE, autoregressive_batch, label_slot_ends, mix_layouts, pack_rows,
                  pad_with_eos, random_mask_batch, reorganize_slots)
from model import ModelConfig, Transformer

# -----------------------------------------------------------------------------
# default config: a small ReFusion model on the Python standard library, 8 minutes on 2 CPU cores
out_dir = "out"           # where ckpt.pt is written (checked writable before anything else)
init_from = "scratch"     # 'scratch', 'resume' (continue out_dir), or a checkpoint path to start at
objective = "refusion"    # 'refusion' (slots, hybrid loss), 'ar' (next token), 'mdm' (masked diff.)
dataset = "stdlib"        # a built-in corpus name, or a path to a .json / .jsonl / text file
tokenizer = "bytes"       # 'bytes' (offline) or 'gpt2' (needs the BPE file, see docs/training.md)
data_root = "data"        # prepared data goes to data_root/<name>-<tokenizer>-<block_size>
too_long = "skip"         # samples longer than block_size: 'skip' them (counted) or 'fail'
slot_sizes = (4, 8)       # S is drawn per sample from these (the paper uses 4, 8, 16, 32)
slot_end_labels = False   # refusion: label each clean slot's last token, and the prompt's (SPEC 3)
ar_fraction = 0.0         # refusion: this share of samples is laid out as the ARM's (SPEC 3)
gen_length = 128          # mdm: responses padded with EOS to this many tokens (its canvas); 0: none
mdm_shift = False         # mdm: Dream's shifted prediction (output i predicts token i + 1; SPEC 3)
mask_eps = 1e-3           # p_mask = (1 - eps) t + eps
# model
n_layer = 4               # transformer layers
n_head = 4                # attention heads
n_kv_head = 0             # 0: same as n_head
n_embd = 128              # width of the residual stream
block_size = 384          # the context (prompt + response tokens); too_long says what longer do
qk_norm = True            # RMSNorm on each head's queries and keys, as in Qwen3
rope_theta = 10000.0      # base of the rotary position angles (finite, > 0)
# optimization
batch_size = 16           # samples per micro-batch (per process under torchrun)
pack = False              # several samples per row, each seeing itself: less padding (causal)
gradient_accumulation_steps = 1  # micro-batches per step, over all processes (divided among them)
max_iters = 1500          # optimizer steps of the whole run (a resumed run continues up to it)
learning_rate = 2e-3      # peak learning rate, reached after warm-up
min_lr = 2e-4             # learning rate at the end of the cosine decay
lr_decay_iters = 0        # the cosine reaches min_lr here and stays; 0: max_iters (kept on resume)
warmup_iters = 50         # steps of linear warm-up
weight_decay = 0.1        # AdamW's weight decay, on matrices only
beta1, beta2 = 0.9, 0.95  # AdamW's betas, each in [0, 1)
grad_clip = 1.0           # clip the gradient norm to this; 0: no clipping
# evaluation and logging
eval_interval = 250       # validation loss and a checkpoint every this many steps
eval_iters = 10           # validation batches per evaluation
log_interval = 50         # without a terminal (a log file, a pipe): a line every this many steps
seed = 1337               # seeds the initial weights and every micro-batch's samples and masks
device = "cpu"            # under torchrun with CUDA each process takes cuda:LOCAL_RANK
compile = False           # torch.compile the model (the same results, faster on a GPU)
deterministic = False     # the same bits every run on a GPU too: deterministic kernels, slower
dtype = "auto"            # matmuls in 'bfloat16' (autocast) or 'float32'; 'auto': bf16 if native
fsdp = False              # under torchrun: shard weights, gradients and AdamW state (support.shard)
activation_checkpointing = False  # recompute activations in backward: less memory, 1/3 more compute
peak_tflops = 312.0       # for the MFU estimate: bf16 peak of the GPU (A100: 312, H100 SXM: 989)
# -----------------------------------------------------------------------------
DEFAULTS = settings_in(globals())

# -----------------------------------------------------------------------------
# the objective: its batches and the hybrid loss (SPEC section 3)


def make_batch(cfg, tokens, prompt_len, length, meta, generator):
    """The objective's Batch of tokens (B, T), prompt_len, length (B,) int64 (SPEC section 3). meta:
    the prepared data's meta.json (mask, EOS, pad ids); generator: the CPU torch.Generator."""
    # ReFusion: the paper's slot layout (SPEC section 3, steps 1-4)
    if cfg["objective"] == "refusion":
        batch = reorganize_slots(tokens, prompt_len, length, cfg["slot_sizes"],
                                 meta["mask_id"], generator, cfg["mask_eps"])
        # beyond the paper (SPEC section 3, opt-in): next-token labels at the slot ends too, so
        # the next-token pathway is trained at every position
        if cfg["slot_end_labels"]:
            batch = label_slot_ends(batch, tokens, prompt_len, length)
        # beyond the paper: a share of the samples in the ARM's layout, whole contexts in natural
        # order (its draw comes after the layout's)
        if cfg["ar_fraction"]:
            arm = autoregressive_batch(tokens, prompt_len, length)
            batch = mix_layouts(batch, arm, cfg["ar_fraction"], generator)
        return batch
    # the MDM baseline: responses padded with EOS to the decoder's canvas (gen_length), then each
    # response token masked independently
    if cfg["objective"] == "mdm":
        if cfg["gen_length"]:
            tokens, length = pad_with_eos(tokens, prompt_len, length, meta["eos_id"],
                                          meta["pad_id"], cfg["gen_length"], cfg["block_size"])
        return random_mask_batch(tokens, prompt_len, length, meta["mask_id"], generator,
                                 cfg["mask_eps"], cfg["mdm_shift"])
    # the ARM baseline: natural order, next-token labels
    return autoregressive_batch(tokens, prompt_len, length)


def hybrid_loss(logits, batch):
    """AR_loss + MDM_loss (SPEC section 3, step 5), the baselines' too. logits: (B, T, V) float32;
    batch: a data.Batch. Returns (loss, ar_loss, mdm_loss), scalar float32 tensors."""
    B, T, V = logits.shape
    # cross-entropy at every labelled place, 0 elsewhere: (B, T)
    ce = F.cross_entropy(logits.view(-1, V), batch.labels.view(-1), ignore_index=IGNORE,
                         reduction="none").view(B, T)
    # next-token labels (no loss weight): their mean
    is_ar = (batch.labels != IGNORE) & (batch.mdm_weight == 0)
    ar_loss = (ce * is_ar).sum() / is_ar.sum().clamp(min=1)
    # masked tokens' own labels: weighted by 1 / (p_mask * response length), summed, then
    # averaged over the samples (a packed batch holds more samples than rows)
    mdm_loss = (ce * batch.mdm_weight).sum() / (batch.n_samples or B)
    # one backward pass through both: the hybrid loss of step 5
    return ar_loss + mdm_loss, ar_loss, mdm_loss


# -----------------------------------------------------------------------------
# the model's start and its optimizer


@torch.no_grad()
def load_weights(model, ckpt):
    """Copy ckpt's weights into model (the paper starts from a pretrained ARM). Raises ValueError
    when a shape differs, other than token rows the checkpoint lacks."""
    state = dict(ckpt["model"])
    # rows the checkpoint's vocabulary lacks (the mask token an ARM never had) start as the mean
    # of its token embeddings
    for name in ("embed_tokens.weight", "lm_head.weight"):
        target = model.state_dict()[name]
        if name in state and state[name].shape[0] < target.shape[0]:
            old = state[name]
            mean = old.mean(0, keepdim=True).expand(target.shape[0] - len(old), -1)
            state[name] = torch.cat([old, mean])
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError("--init_from checkpoint does not fit this model: "
                         f"{str(e).splitlines()[0]}") from None


def make_optimizer(cfg, model):
    """AdamW with weight decay on matrices only (not norms); fused on CUDA."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg["weight_decay"]},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg["learning_rate"], betas=(cfg["beta1"], cfg["beta2"]),
                             fused=cfg["device"].startswith("cuda"))

# -----------------------------------------------------------------------------
# the loop


def micro_batch_rng(cfg, iter_num, micro):
    """(numpy Generator for the samples, torch Generator for the layout's draws) of one micro-batch,
    seeded by (seed, iteration, global micro-batch index)."""
    # so a step's data does not depend on how many processes share it, and a resumed run continues
    # exactly
    key = [cfg["seed"], iter_num, micro]
    torch_seed = int(np.random.SeedSequence(key).generate_state(1)[0])
    return np.random.default_rng(key), torch.Generator().manual_seed(torch_seed)


def autocast_for(device, dtype):
    """The context of a training forward pass: bf16 autocast for dtype "bfloat16", else none."""
    # weights, gradients and AdamW's state stay float32 either way
    if dtype == "bfloat16":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return nullcontext()


def get_lr(it, cfg):
    """The learning rate of step it: linear warm-up, cosine decay to min_lr at lr_decay_iters."""
    warmup = cfg["warmup_iters"]
    lr = cfg["learning_rate"]
    min_lr = cfg["min_lr"]
    # linear warm-up: small steps while AdamW's averages are still young
    if it < warmup:
        return lr * (it + 1) / warmup
    # how far the decay has gone, 0 to 1 (1 from lr_decay_iters on)
    ratio = min(1.0, (it - warmup) / max(1, cfg["lr_decay_iters"] - warmup))
    return min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (lr - min_lr)


def flops_per_token(model, T):
    """Training FLOPs (forward + backward) per token of a T-token sequence, as nanoGPT estimates
    them (PaLM, appendix B)."""
    c = model.config
    # 6 per weight that multiplies an activation (an untied input embedding is a lookup, norm
    # weights are elementwise: neither counts), plus 12 L H D T for the attention scores and their
    # weighted sum, over all T keys as a dense kernel computes them
    weights = sum(p.numel() for name, p in model.named_parameters()
                  if p.dim() >= 2
                  and not (name.startswith("embed_tokens") and not c.tie_embeddings))
    return 6 * weights + 12 * c.n_layer * c.n_head * c.head_dim * T


@torch.no_grad()
def estimate_loss(model, cfg, val_data, autocast):
    """Mean validation loss over eval_iters fixed batches (same samples and masks every call)."""
    model.eval()
    # the same samples and the same masks at every evaluation: losses comparable across steps
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(cfg["eval_iters"]):
        # validation samples in the objective's layout, as training sees them
        tokens, prompt_len, length = val_data.get_batch(cfg["batch_size"], rng, cfg["device"])
        batch = make_batch(cfg, tokens, prompt_len, length, val_data.meta, gen)
        # one forward pass over the buffer; the loss in float32 under any autocast
        with autocast:
            logits = model(batch.idx, batch.position_ids, attn_mask=batch.attn_mask)
        losses.append(hybrid_loss(logits.float(), batch)[0].item())
    # back to training mode for the caller's next step
    model.train()
    return float(np.mean(losses))


class Diverged(ValueError):
    """A loss ("loss" or "validation loss") that stopped being finite, its value and iteration."""

    def __init__(self, what, value, iteration):
        super().__init__(f"{what} became {value} at iteration {iteration}")
        self.what = what
        self.value = value
        self.iteration = iteration


def train_step(cfg, model, forward, optimizer, train_data, it, rank, world, autocast):
    """One optimizer step at iteration it, this process's share of its micro-batches; forward:
    model, or its DDP and compiled wrapper. Returns the last micro-batch's (loss, ar_loss,
    mdm_loss), the step's tokens (no padding) and FLOPs. Raises Diverged."""
    # this process's share of the step's micro-batches
    micro_steps = cfg["gradient_accumulation_steps"] // world
    # The learning rate of this step (warmup, then cosine decay).
    for group in optimizer.param_groups:
        group["lr"] = get_lr(it, cfg)
    # the step's tokens (prompt and response) and FLOPs, for the progress bar's tokens/s and MFU
    n_tokens = 0
    flops = 0
    for micro in range(micro_steps):
        # This micro-batch's samples and random draws depend on (seed, step, micro-batch) alone,
        # so a resumed run sees the batches an unbroken run would.
        rng, gen = micro_batch_rng(cfg, it, rank * micro_steps + micro)
        tokens, prompt_len, length = train_data.get_batch(cfg["batch_size"], rng, cfg["device"])
        # The objective's layout: inputs, position ids, labels and loss weights.
        batch = make_batch(cfg, tokens, prompt_len, length, train_data.meta, gen)
        # beyond the paper (--pack): several samples per row, less padding computed
        if cfg["pack"]:
            batch = pack_rows(batch, length)
        # DDP averages gradients across processes only after the last micro-batch. FSDP
        # reduce-scatters after every one: holding them back would keep each process's full
        # unsharded gradients. The flag sits on the DDP wrapper, inside torch.compile's if any.
        if world > 1 and not cfg["fsdp"]:
            ddp = getattr(forward, "_orig_mod", forward)
            ddp.require_backward_grad_sync = micro == micro_steps - 1
        # Forward over the buffer, the hybrid loss, and its share of the step's gradient.
        with autocast:
            logits = forward(batch.idx, batch.position_ids, attn_mask=batch.attn_mask)
        losses = hybrid_loss(logits.float(), batch)
        # stop at the first loss that is not finite, before it reaches the weights
        if not torch.isfinite(losses[0]):
            raise Diverged("loss", losses[0].item(), it)
        # each micro-batch's share, so the step's gradient is the mean over micro-batches
        (losses[0] / micro_steps).backward()
        # count what this micro-batch computed
        n_tokens += int(length.sum())
        flops += flops_per_token(model, batch.idx.shape[1]) * batch.idx.numel()
    # Clip the gradient's norm, then one AdamW step.
    if cfg["grad_clip"] > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return losses, n_tokens, flops


def train(cfg, model, optimizer, train_data, val_data, progress, iter_num, best_val_loss=math.inf,
          rank=0, world=1, stop_requested=()):
    """The loop from iter_num to max_iters over progress (support/progress.py's Progress). Yields
    (steps done, best validation loss, stopped) whenever a checkpoint is due; stops every process
    after the step where stop_requested (a list) is non-empty on one. Raises Diverged."""
    # What runs the forward pass: the model, in DDP's wrapper across processes (a sharded model,
    # support.shard, syncs its own gradients), compiled if asked.
    forward = model
    if world > 1 and not cfg["fsdp"]:
        forward = torch.nn.parallel.DistributedDataParallel(model)
    if cfg["compile"]:
        forward = torch.compile(forward)
    # bf16 autocast or nothing, the same for every forward pass of the run
    autocast = autocast_for(cfg["device"], cfg["dtype"])
    model.train()
    for it in progress:
        # Evaluate every eval_interval steps and at the last one; a checkpoint is then due.
        if it % cfg["eval_interval"] == 0 or it == cfg["max_iters"] - 1:
            val_loss = estimate_loss(forward, cfg, val_data, autocast)
            if not math.isfinite(val_loss):
                raise Diverged("validation loss", val_loss, it)
            best_val_loss = min(best_val_loss, val_loss)
            progress.write(f"iter {it}: val loss {val_loss:.4f}")
            # the caller saves a checkpoint here, except at the run's first step (nothing new)
            if it > iter_num:
                yield it, best_val_loss, False
            # evaluating and saving are not training: left out of tokens/s
            progress.skip()
        # One optimizer step.
        progress.step_begins()
        losses, step_tokens, step_flops = train_step(cfg, model, forward, optimizer, train_data,
                                                     it, rank, world, autocast)
        # reading the losses waits for the device to end the step, so the clock reads its end
        losses = [x.item() for x in losses]
        progress.step_ends(it, losses, step_tokens, step_flops)
        # Every process stops after the same step, even if only one saw the Ctrl-C.
        stop = bool(stop_requested)
        if world > 1:
            flag = torch.tensor(float(stop), device=cfg["device"])
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            stop = bool(flag.item())
        if stop:
            break
    # the last checkpoint: every step run, or those before the stop
    progress.close()
    yield it + 1, best_val_loss, stop


def main(argv):
    """python train.py [config/*.py] [--key=value ...]: train until max_iters or a stop request
    (Ctrl-C, SIGTERM), saving a checkpoint whenever the loop yields."""
    from support import hardware, runs, shard
    from support.progress import Progress
    t0 = time.perf_counter()  # a checkpoint's train_minutes: its earlier runs' and this one's
    cfg = parse_args(DEFAULTS, argv)
    explicit = explicit_keys(cfg, DEFAULTS, argv)
    runs.take_resumed_settings(cfg, explicit)        # --init_from=resume: the checkpoint's
    runs.check_train_config(cfg)
    shard.check_sharding(cfg, launched="RANK" in os.environ)
    # the process that writes checkpoints (RANK 0 under torchrun) holds out_dir from here to the end
    held = nullcontext()
    if os.environ.get("RANK", "0") == "0":
        held = runs.hold_out_dir(cfg["out_dir"])
    # and every process its place under torchrun and its kernels, however the run ends
    with held, runs.process(cfg) as (rank, world):
        start = runs.where_to_start(cfg, explicit)   # scratch, resume, a checkpoint, a HF folder
        train_data, val_data = runs.load_data(cfg, start, rank)
        torch.manual_seed(cfg["seed"])               # the initial weights
        model = Transformer(ModelConfig(**start.model_args))
        if start.weights is not None:                # the paper's start: a pretrained model
            load_weights(model, start.weights)
        model = runs.place_model(cfg, model)
        optimizer = make_optimizer(cfg, model)
        runs.restore_optimizer(start, model, optimizer)
        # the counters to go on from; the checkpoint's weights and optimizer state are let go
        model_args = start.model_args
        steps = start.iter_num
        best_val_loss = start.best_val_loss
        stopped = False
        minutes = start.train_minutes
        del start
        # auto: bf16 where the device multiplies it natively, the same rule on every rank
        dtype, why = hardware.pick_dtype(cfg["dtype"], cfg["device"], model.config)
        if rank == 0:
            print(f"{cfg['objective']} model: {model.num_params() / 1e6:.2f}M parameters, "
                  f"{len(train_data):,} training samples, device {cfg['device']}, "
                  f"{world} process(es), " + (why or f"matmuls in {dtype}"))
        progress = Progress(cfg, steps, rank, world)  # the bar, or a line every log_interval
        with runs.stop_requests(cfg, optimizer, world) as requested:
            try:
                for steps, best_val_loss, stopped in train(
                        dict(cfg, dtype=dtype), model, optimizer, train_data, val_data, progress,
                        steps, best_val_loss, rank, world, requested):
                    # the training minutes so far: the checkpoint's earlier runs' and this one's
                    # (unknown when the checkpoint did not record them)
                    trained = None if minutes is None else minutes + (time.perf_counter() - t0) / 60
                    runs.save(cfg, model, optimizer, model_args, train_data, steps,
                              best_val_loss, rank, trained)
            except Diverged as e:
                raise runs.diverged(cfg, e) from None
        runs.finish(cfg, rank, world, steps, best_val_loss, stopped)


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
