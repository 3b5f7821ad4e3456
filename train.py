"""
Train a ReFusion model (or one of the baselines) on prompt/response data.

    python train.py                                   # small ReFusion model, stdlib corpus, CPU
    python train.py config/train_stdlib.py --max_iters=500 --device=cuda

The ReFusion objective (SPEC section 3; paper section 3.1): each response is cut into slots, some
slots are masked, the clean ones are shuffled in front of the masked ones (keeping their true
position ids), and one causal forward pass gives two losses: next-token prediction inside every
clean slot (AR) and the masked tokens' own values, weighted by 1/p_mask (MDM).
"""

import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from filelock import FileLock, Timeout
from tqdm import tqdm

from checkpoint import checkpoint_path, load_checkpoint, save_checkpoint, sharded_info_path
from configurator import check_device, check_seed, explicit_keys, parse_args, require, run_cli, settings_in
from data import IGNORE, TOKENIZERS, TokenDataset, autoregressive_batch, get_tokenizer, pad_with_eos, \
    random_mask_batch, reorganize_slots, vocab_size
from files import write_atomic
from model import ModelConfig, Transformer
from prepare import prepare
from pretrained import from_pretrained
from shard import check_sharding, checkpoint_blocks, load_sharded, load_sharded_info, save_sharded, shard_model

# -----------------------------------------------------------------------------
# default config: a small ReFusion model on the Python standard library, about 8 minutes on 2 CPU cores
out_dir = "out"           # where ckpt.pt is written (checked writable before anything else)
init_from = "scratch"     # 'scratch', 'resume' (continue out_dir), or a checkpoint path to start from
objective = "refusion"    # 'refusion' (slots, hybrid loss), 'ar' (next token), 'mdm' (LLaDA-style)
dataset = "stdlib"        # a built-in corpus name, or a path to a .json / .jsonl / text file
tokenizer = "bytes"       # 'bytes' (offline) or 'gpt2' (needs the BPE file, see docs/training.md)
data_root = "data"        # prepared data goes to data_root/<name>-<tokenizer>-<block_size>
too_long = "skip"         # samples longer than block_size: 'skip' them (counted) or 'fail'
slot_sizes = (4, 8)       # S is drawn per sample from these (the paper uses 4, 8, 16, 32)
slot_end_labels = False   # refusion: also label each clean slot's last token (and the prompt's) with the next one (SPEC 3)
ar_fraction = 0.0         # refusion: this share of samples is laid out as the ARM's, natural order (SPEC 3); 0: none
gen_length = 128          # mdm: responses padded with EOS to this many tokens, the canvas the MDM decodes; 0: none
mask_eps = 1e-3           # p_mask = (1 - eps) t + eps
# model
n_layer = 4               # transformer blocks
n_head = 4                # attention heads
n_kv_head = 0             # 0: same as n_head
n_embd = 128              # width of the residual stream
block_size = 384          # context (prompt + response tokens); longer samples are skipped
qk_norm = True            # RMSNorm on each head's queries and keys, as in Qwen3
rope_theta = 10000.0      # base of the rotary position angles (finite, > 0)
# optimization
batch_size = 16           # samples per micro-batch (per process under torchrun)
gradient_accumulation_steps = 1  # micro-batches per step, over all processes (divided among them)
max_iters = 1500          # optimizer steps of the whole run (a resumed run continues up to it)
learning_rate = 2e-3      # peak learning rate, reached after warm-up
min_lr = 2e-4             # learning rate at the end of the cosine decay
lr_decay_iters = 0        # the cosine reaches min_lr here and stays; 0: max_iters (a resumed run keeps it)
warmup_iters = 50         # steps of linear warm-up
weight_decay = 0.1        # AdamW's weight decay, on matrices only
beta1, beta2 = 0.9, 0.95  # AdamW's betas, each in [0, 1)
grad_clip = 1.0           # clip the gradient norm to this; 0: no clipping
# evaluation and logging
eval_interval = 250       # validation loss and a checkpoint every this many steps
eval_iters = 10           # validation batches per evaluation
log_interval = 50         # without a terminal (a log file, a pipe): one plain line every this many steps
seed = 1337               # seeds the initial weights and every micro-batch's samples and masks
device = "cpu"            # under torchrun with CUDA each process takes cuda:LOCAL_RANK
compile = False           # torch.compile the model (the same results, faster on a GPU)
fsdp = False              # under torchrun: shard weights, gradients and AdamW state over the processes (shard.py)
activation_checkpointing = False  # recompute each block's activations in backward: less memory, 1/3 more compute
peak_tflops = 312.0       # for the MFU estimate: bf16 peak of the GPU (A100: 312, H100 SXM: 989)
# -----------------------------------------------------------------------------
DEFAULTS = settings_in(globals())
OBJECTIVES = ("refusion", "ar", "mdm")
# the model's shape, which --init_from=PATH takes from its checkpoint
MODEL_KEYS = ("block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "qk_norm", "rope_theta")
# settings a resumed run cannot change (a flag that contradicts one is refused)
RESUME_KEYS = MODEL_KEYS + ("objective", "dataset", "tokenizer", "slot_sizes", "slot_end_labels", "ar_fraction",
                             "gen_length")  # data_root may move


def make_batch(cfg, tokens, prompt_len, length, meta, generator):
    """The objective's Batch (inputs, position ids, labels, loss weights) for raw samples (B, T);
    meta: the prepared data's meta.json (its mask, EOS and pad ids)."""
    if cfg["objective"] == "refusion":
        return reorganize_slots(tokens, prompt_len, length, cfg["slot_sizes"], meta["mask_id"], generator,
                                cfg["mask_eps"], cfg["slot_end_labels"], cfg["ar_fraction"])
    if cfg["objective"] == "mdm":
        if cfg["gen_length"]:
            tokens, length = pad_with_eos(tokens, prompt_len, length, meta["eos_id"], meta["pad_id"],
                                          cfg["gen_length"], cfg["block_size"])
        return random_mask_batch(tokens, prompt_len, length, meta["mask_id"], generator, cfg["mask_eps"])
    return autoregressive_batch(tokens, prompt_len, length)


def hybrid_loss(logits, batch):
    """ReFusion's loss, AR_loss + MDM_loss (SPEC section 3, step 5); also serves both baselines.

    logits: (B, T, V) float32. AR_loss: mean cross-entropy over next-token labels (0 if none).
    MDM_loss: sum over masked tokens of CE * mdm_weight (= CE / (p_mask * response length)),
    divided by B. Returns (loss, ar_loss, mdm_loss), scalar tensors.
    """
    B, T, V = logits.shape
    ce = F.cross_entropy(logits.view(-1, V), batch.labels.view(-1), ignore_index=IGNORE,
                         reduction="none").view(B, T)
    is_ar = (batch.labels != IGNORE) & (batch.mdm_weight == 0)
    ar_loss = (ce * is_ar).sum() / is_ar.sum().clamp(min=1)
    mdm_loss = (ce * batch.mdm_weight).sum() / B
    return ar_loss + mdm_loss, ar_loss, mdm_loss


def micro_batch_rng(cfg, iter_num, micro):
    """The random streams of one micro-batch: (numpy Generator for sampling, torch Generator for
    masking and slot order), seeded by (seed, iteration, global micro-batch index). So the data a
    step sees does not depend on how many processes share it, and a resumed run continues exactly."""
    key = [cfg["seed"], iter_num, micro]
    torch_seed = int(np.random.SeedSequence(key).generate_state(1)[0])
    return np.random.default_rng(key), torch.Generator().manual_seed(torch_seed)


def autocast_for(device):
    """The mixed-precision context of a training forward pass: bf16 autocast on CUDA (weights,
    gradients and optimizer state stay float32), nothing on CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else nullcontext()


def compile_model(model):
    """torch.compile(model), or model itself with a warning where the compiler cannot run (it needs
    a C compiler on CPU and a supported Python)."""
    device = next(model.parameters()).device.type
    if not torch._dynamo.is_dynamo_supported() or (device == "cpu" and not (shutil.which("cc") or shutil.which("gcc"))):
        warnings.warn("--compile=True: torch.compile cannot run here (unsupported Python or no C compiler); "
                      "training without it, which gives the same results more slowly")
        return model
    return torch.compile(model)


def check_writable(out_dir):
    """Create out_dir if needed, then write and remove a file in it, so that a directory that cannot
    hold the checkpoint is refused before the data is prepared and the model trained.
    Raises ValueError naming the directory and the fix."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir) as probe:
            probe.write(b"probe")
            probe.flush()
    except OSError as e:
        raise ValueError(f"--out_dir={out_dir}: cannot write a checkpoint there ({e.strerror or e}); "
                         "choose a directory you can write to") from None


@contextmanager
def hold_out_dir(out_dir):
    """Hold out_dir for one training run while the block runs: a lock (filelock; the operating system
    releases it when the process ends, however it ends) and, beside it, who holds it (pid and host).
    A second run into the same out_dir is refused, naming the first, instead of both writing
    checkpoints there and one run being lost. out_dir is created (check_writable) and, when this
    run created it and wrote nothing in it, removed again at the end.
    Raises ValueError naming the directory and the run that holds it."""
    created = not os.path.exists(out_dir)
    check_writable(out_dir)
    lock_path, holder_path = os.path.join(out_dir, ".lock"), os.path.join(out_dir, ".lock.holder")
    lock = FileLock(lock_path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        try:
            with open(holder_path, encoding="utf-8") as f:
                holder = f.read().strip()
        except OSError:
            holder = "another process"
        raise ValueError(f"--out_dir={out_dir} is in use by another training run ({holder}); wait for it to end "
                         "or choose another --out_dir (nothing was written)") from None
    try:
        write_atomic(holder_path, lambda f: f.write(
            f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}".encode()))
        yield
    finally:
        if os.path.exists(holder_path):
            os.remove(holder_path)  # before the release: the next holder's note must not be removed
        lock.release()
        if created and os.listdir(out_dir) == [".lock"]:  # a run refused before writing anything
            os.remove(lock_path)
            os.rmdir(out_dir)


def live_progress():
    """True when stdout and stderr are both terminals, where tqdm redraws its progress bar in place.
    Elsewhere (a log file, a pipe, a batch job) every frame of a bar would be kept, so progress is
    printed as plain lines instead."""
    return sys.stdout.isatty() and sys.stderr.isatty()


def diverged(cfg, what, value, it):
    """The SystemExit for a loss that stopped being finite, saying whether a checkpoint to go back to
    exists (a run stopped before its first evaluation has written none)."""
    ckpt_file = checkpoint_path(cfg["out_dir"])
    if os.path.exists(ckpt_file):
        then = (f"the last good checkpoint {ckpt_file} is kept: lower --learning_rate (or check the data), then "
                "continue it with --init_from=resume")
    else:
        then = "no checkpoint was written yet: lower --learning_rate (or check the data) and start again"
    return SystemExit(f"error: {what} became {value} at iteration {it}; {then}")


def setup_distributed(cfg):
    """Join the process group when launched by torchrun (RANK set); returns (rank, world_size).

    NCCL on CUDA, gloo on CPU. Each process handles gradient_accumulation_steps / world_size
    micro-batches per step. Raises ValueError when they do not divide evenly.
    """
    if "RANK" not in os.environ:
        return 0, 1
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cfg["gradient_accumulation_steps"] % world:
        raise ValueError(f"--gradient_accumulation_steps={cfg['gradient_accumulation_steps']} must be a multiple "
                         f"of the {world} processes; each takes an equal share")
    if cfg["device"].startswith("cuda"):
        cfg["device"] = f"cuda:{os.environ['LOCAL_RANK']}"
        torch.cuda.set_device(cfg["device"])
    torch.distributed.init_process_group("nccl" if cfg["device"].startswith("cuda") else "gloo")
    return rank, world


def flops_per_token(model, T):
    """
    Training FLOPs (forward + backward) per token of a T-token sequence, as nanoGPT estimates them
    (PaLM paper, appendix B): 6 per weight that multiplies an activation, plus 12 L H D T for the
    attention scores and their weighted sum (counted over all T keys, as a dense kernel computes
    them). An untied input embedding is a lookup and norm weights are elementwise; neither counts.
    """
    c = model.config
    weights = sum(p.numel() for name, p in model.named_parameters()
                  if p.dim() >= 2 and not (name.startswith("embed_tokens") and not c.tie_embeddings))
    return 6 * weights + 12 * c.n_layer * c.n_head * c.head_dim * T


def get_lr(it, cfg):
    """Linear warm-up, then cosine decay from learning_rate to min_lr at lr_decay_iters, then min_lr."""
    if it < cfg["warmup_iters"]:
        return cfg["learning_rate"] * (it + 1) / cfg["warmup_iters"]
    ratio = min(1.0, (it - cfg["warmup_iters"]) / max(1, cfg["lr_decay_iters"] - cfg["warmup_iters"]))
    return cfg["min_lr"] + 0.5 * (1 + math.cos(math.pi * ratio)) * (cfg["learning_rate"] - cfg["min_lr"])


def check_config(cfg):
    """Refuse settings that cannot work, with the fix. Raises ValueError."""
    if cfg["objective"] not in OBJECTIVES:
        raise ValueError(f"--objective={cfg['objective']!r}: choose one of {', '.join(OBJECTIVES)}")
    if cfg["too_long"] not in ("skip", "fail"):
        raise ValueError(f"--too_long={cfg['too_long']!r}: choose skip or fail")
    if cfg["tokenizer"] not in TOKENIZERS and not cfg["tokenizer"].startswith("hf:"):
        raise ValueError(f"--tokenizer={cfg['tokenizer']!r}: choose one of {', '.join(TOKENIZERS)}, or "
                         "hf:FOLDER for a Hugging Face model folder's tokenizer.json")
    if not cfg["slot_sizes"] or any(not isinstance(s, int) or s <= 0 for s in cfg["slot_sizes"]):
        raise ValueError(f"--slot_sizes={cfg['slot_sizes']}: give positive integers, e.g. --slot_sizes=(4,8)")
    require(cfg, ("batch_size", "gradient_accumulation_steps", "max_iters", "n_layer", "n_head", "n_embd",
                  "block_size", "eval_iters", "eval_interval", "log_interval"), "positive", lambda v: v > 0)
    require(cfg, ("learning_rate", "rope_theta", "peak_tflops"), "positive and finite", lambda v: 0 < v < math.inf)
    require(cfg, ("n_kv_head", "lr_decay_iters", "warmup_iters", "gen_length"), "0 or more", lambda v: v >= 0)
    if cfg["objective"] == "mdm" and cfg["gen_length"] >= cfg["block_size"]:
        raise ValueError(f"--gen_length={cfg['gen_length']}: an MDM's canvas must leave room for a prompt in its "
                         f"context of --block_size={cfg['block_size']}; lower --gen_length or raise --block_size")
    require(cfg, ("min_lr", "weight_decay", "grad_clip"), "0 or more and finite", lambda v: 0 <= v < math.inf)
    require(cfg, ("beta1", "beta2", "mask_eps", "ar_fraction"), "in [0, 1)", lambda v: 0 <= v < 1)
    check_seed(cfg)
    check_device(cfg["device"])
    ModelConfig(n_layer=cfg["n_layer"], n_head=cfg["n_head"], n_kv_head=cfg["n_kv_head"] or None,
                n_embd=cfg["n_embd"])  # raises for shapes that cannot work, before any data is prepared


@torch.no_grad()
def load_weights(model, ckpt):
    """Copy a checkpoint's weights into model. Rows the checkpoint's vocabulary lacks (e.g. a mask
    token a pretrained ARM never had) start as the mean of its token embeddings.
    Raises ValueError when any other shape differs."""
    state = dict(ckpt["model"])
    for name in ("embed_tokens.weight", "lm_head.weight"):
        target = model.state_dict()[name]
        if name in state and state[name].shape[0] < target.shape[0]:
            old = state[name]
            state[name] = torch.cat([old, old.mean(0, keepdim=True).expand(target.shape[0] - len(old), -1)])
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"--init_from checkpoint does not fit this model: {str(e).splitlines()[0]}") from None


@torch.no_grad()
def estimate_loss(model, cfg, val_data, autocast):
    """Mean validation loss over eval_iters fixed batches (same samples and masks every call)."""
    model.eval()
    rng, gen = np.random.default_rng(0), torch.Generator().manual_seed(0)
    losses = []
    for _ in range(cfg["eval_iters"]):
        tokens, prompt_len, length = val_data.get_batch(cfg["batch_size"], rng, cfg["device"])
        batch = make_batch(cfg, tokens, prompt_len, length, val_data.meta, gen)
        with autocast:
            logits = model(batch.idx, batch.position_ids, key_mask=batch.key_mask)
        losses.append(hybrid_loss(logits.float(), batch)[0].item())
    model.train()
    return float(np.mean(losses))


# -----------------------------------------------------------------------------
# where a run starts: one function per --init_from mode


@dataclass
class Start:
    """How a run begins: the model's shape, the checkpoint whose weights it loads (load_weights),
    and, when resuming, the optimizer state and counters to continue from (or, from a sharded
    checkpoint, the directory of its shards: shard.load_sharded) and the SHA-1 of the prepared data
    it was trained on (prepare.py's data_sha1; None in a checkpoint from before it was recorded)."""
    model_args: dict
    weights: dict | None = None
    optimizer: dict | None = None
    iter_num: int = 0
    best_val_loss: float = math.inf
    shards: str | None = None
    data_sha1: str | None = None


def inherit_settings(cfg, explicit, source, keys, what):
    """Take `keys` from a checkpoint's config; a key set explicitly to another value is refused.
    Raises ValueError naming the flag and the fix."""
    for key in keys:
        if key in explicit and source[key] != cfg[key]:
            raise ValueError(f"--{key}={cfg[key]} differs from the checkpoint's {source[key]!r}; {what}: drop the flag")
        cfg[key] = source[key]


def start_from_scratch(cfg, explicit):
    """--init_from=scratch: a new model of the configured shape, randomly initialised."""
    return Start(dict(vocab_size=vocab_size(get_tokenizer(cfg["tokenizer"])), block_size=cfg["block_size"],
                      n_layer=cfg["n_layer"], n_head=cfg["n_head"], n_kv_head=cfg["n_kv_head"] or cfg["n_head"],
                      n_embd=cfg["n_embd"], qk_norm=cfg["qk_norm"], rope_theta=cfg["rope_theta"],
                      causal=cfg["objective"] != "mdm"))


def resume_from_checkpoint(cfg, explicit):
    """--init_from=resume: the run in out_dir continues exactly. Every setting comes from its
    checkpoint unless a flag says otherwise; the model, data and objective cannot change. A sharded
    checkpoint (ckpt_sharded.pt, from --fsdp=True) comes first: a ckpt.pt beside it is its
    consolidated copy for the sampler. Raises ValueError for a run that cannot be resumed as asked."""
    sharded = os.path.isfile(sharded_info_path(cfg["out_dir"]))
    ckpt = load_sharded_info(cfg["out_dir"]) if sharded else load_checkpoint(cfg["out_dir"], "cpu")
    inherit_settings(cfg, explicit, ckpt["config"], RESUME_KEYS, "a resumed run keeps its model, data and objective")
    cfg |= {k: v for k, v in ckpt["config"].items() if k in DEFAULTS and k not in explicit | {"device"}}
    if not sharded and "optimizer" not in ckpt:
        raise ValueError(f"{checkpoint_path(cfg['out_dir'])} holds weights only (consolidated from a sharded "
                         f"checkpoint); start a new run from it with --init_from={checkpoint_path(cfg['out_dir'])}")
    if cfg["fsdp"] != sharded:  # the optimizer state of one cannot be loaded into the other
        raise ValueError(f"--fsdp={cfg['fsdp']}: the checkpoint in {cfg['out_dir']} was written "
                         f"{'sharded' if sharded else 'whole'}; resume it with --fsdp={sharded}")
    check_sharding(cfg, launched="RANK" in os.environ)  # again: --fsdp may have come from the checkpoint
    data_sha1 = ckpt["meta"].get("data_sha1")
    if sharded:  # the shards are read once the model is sharded (shard.load_sharded)
        return Start(ckpt["model_args"], iter_num=ckpt["iter_num"], best_val_loss=ckpt["best_val_loss"],
                     shards=ckpt["shards"], data_sha1=data_sha1)
    return Start(ckpt["model_args"], ckpt, ckpt["optimizer"], ckpt["iter_num"], ckpt["best_val_loss"],
                 data_sha1=data_sha1)


def start_from_pretrained(cfg, explicit):
    """--init_from=PATH, the paper's recipe: a pretrained model (e.g. an ARM) of the same shape and
    tokenizer, trained on with this run's objective and a fresh optimizer.
    Raises FileNotFoundError for a missing path, ValueError for a contradicting flag."""
    if not os.path.exists(cfg["init_from"]):
        raise FileNotFoundError(f"--init_from={cfg['init_from']}: use 'scratch', 'resume', or the path of an "
                                "existing checkpoint (a ckpt.pt or the out_dir holding it) or Hugging Face folder")
    if os.path.isfile(os.path.join(cfg["init_from"], "config.json")):
        return start_from_hf_folder(cfg, explicit)
    if os.path.isdir(cfg["init_from"]) and not os.path.isfile(checkpoint_path(cfg["init_from"])):
        raise FileNotFoundError(f"--init_from={cfg['init_from']} holds neither a checkpoint (ckpt.pt) nor a Hugging "
                                "Face model (config.json); point it at a run's out_dir or a downloaded model folder")
    ckpt = load_checkpoint(cfg["init_from"], "cpu")
    inherit_settings(cfg, explicit, ckpt["config"], MODEL_KEYS, "a fine-tune keeps the model's shape")
    if ckpt["meta"]["tokenizer"] != cfg["tokenizer"]:
        raise ValueError(f"--init_from={cfg['init_from']} was trained with the {ckpt['meta']['tokenizer']!r} "
                         f"tokenizer but this run uses {cfg['tokenizer']!r}; pass "
                         f"--tokenizer={ckpt['meta']['tokenizer']}")
    rows = max(ckpt["model_args"]["vocab_size"], vocab_size(get_tokenizer(cfg["tokenizer"])))
    return Start(dict(ckpt["model_args"], causal=cfg["objective"] != "mdm", vocab_size=rows), ckpt)


def start_from_hf_folder(cfg, explicit):
    """--init_from=FOLDER, the paper's recipe at full size: a pretrained Qwen3 or Llama (SmolLM2) in
    Hugging Face's layout (pretrained.from_pretrained, float32 weights), its own tokenizer (hf:FOLDER), trained
    on with this run's objective. A folder without a mask token gets one (special_ids) and, if its
    embedding lacks the row, the row (load_weights). block_size stays the length of the longest
    sample prepared; the model keeps the folder's context. Raises ValueError for a contradicting
    --tokenizer, and what from_pretrained raises."""
    folder = os.path.abspath(cfg["init_from"])  # the checkpoint's tokenizer is found from any directory
    if "tokenizer" in explicit and cfg["tokenizer"] != f"hf:{folder}":
        raise ValueError(f"--tokenizer={cfg['tokenizer']}: a fine-tune of {folder} uses its own tokenizer; "
                         "drop the flag")
    cfg["tokenizer"] = f"hf:{folder}"
    model = from_pretrained(folder)
    c = model.config
    shape = dict(n_layer=c.n_layer, n_head=c.n_head, n_kv_head=c.n_kv_head, n_embd=c.n_embd, qk_norm=c.qk_norm,
                 rope_theta=c.rope_theta)
    inherit_settings(cfg, explicit, shape, shape, "a fine-tune keeps the model's shape")
    rows = max(c.vocab_size, vocab_size(get_tokenizer(cfg["tokenizer"])))
    return Start(dict(asdict(c), causal=cfg["objective"] != "mdm", vocab_size=rows), {"model": model.state_dict()})


START_MODES = {"scratch": start_from_scratch, "resume": resume_from_checkpoint}  # anything else: a checkpoint's path

# -----------------------------------------------------------------------------
# the run


def make_optimizer(cfg, model):
    """AdamW with weight decay on matrices only (not norms); fused on CUDA."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg["weight_decay"]},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg["learning_rate"], betas=(cfg["beta1"], cfg["beta2"]),
                             fused=cfg["device"].startswith("cuda"))


@dataclass
class Run:
    """What a training run carries from step to step; iter_num counts the steps completed."""
    cfg: dict
    model: Transformer
    optimizer: torch.optim.Optimizer
    model_args: dict
    train_data: TokenDataset
    val_data: TokenDataset
    data_dir: str
    rank: int
    world: int
    iter_num: int
    best_val_loss: float

    def save(self):
        """Write the resumable checkpoint atomically: ckpt.pt by rank 0 (checkpoint.save_checkpoint), or
        under --fsdp each process its shards (shard.save_sharded). Call on every process."""
        info = {"model_args": self.model_args, "iter_num": self.iter_num, "best_val_loss": self.best_val_loss,
                "config": self.cfg, "meta": self.train_data.meta, "data_dir": os.path.abspath(self.data_dir)}
        if self.cfg["fsdp"]:
            save_sharded(self.cfg["out_dir"], self.model, self.optimizer, info)
        elif self.rank == 0:
            save_checkpoint(self.cfg["out_dir"], dict(info, model=self.model.state_dict(),
                                                      optimizer=self.optimizer.state_dict()))


@contextmanager
def stop_requests():
    """While the block runs, Ctrl-C (SIGINT) and SIGTERM (Slurm, `docker stop`, torchrun) do not end
    the process: each is noted in the list the block gets (train finishes its step and saves); the
    previous handlers are back after the block, however it ends."""
    requested = []
    previous = {sig: signal.signal(sig, lambda signum, frame: requested.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield requested
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def train(run, stop_requested=()):
    """The training loop from run.iter_num to max_iters: evaluate and save every eval_interval
    steps, then one optimizer step of gradient_accumulation_steps micro-batches (shared among the
    processes). When stop_requested (stop_requests' list) is not empty on any process after a step,
    every process stops there and saves. Returns True when so interrupted.
    Without a terminal (live_progress), one plain line every log_interval steps replaces the bar.
    Raises SystemExit when a loss stops being finite (the last checkpoint, if any, is kept)."""
    cfg, model, optimizer, world = run.cfg, run.model, run.optimizer, run.world
    if world > 1 and not cfg["fsdp"]:  # a sharded model (shard.shard_model) synchronizes its own gradients
        model = torch.nn.parallel.DistributedDataParallel(model)
    forward_model = compile_model(model) if cfg["compile"] else model
    autocast = autocast_for(cfg["device"])
    micro_steps = cfg["gradient_accumulation_steps"] // world      # this process's share of each step
    model.train()
    live = live_progress()
    bar = tqdm(range(run.iter_num, cfg["max_iters"]), initial=run.iter_num, total=cfg["max_iters"], desc="train",
               mininterval=1.0, disable=run.rank != 0 or not live)
    t0, n_tokens, flops, start_iter = time.perf_counter(), 0, 0, run.iter_num
    interrupted = False
    for it in bar:
        run.iter_num = it
        if it % cfg["eval_interval"] == 0 or it == cfg["max_iters"] - 1:
            val_loss = estimate_loss(forward_model, cfg, run.val_data, autocast)
            if not math.isfinite(val_loss):
                raise diverged(cfg, "validation loss", val_loss, it)
            run.best_val_loss = min(run.best_val_loss, val_loss)
            if run.rank == 0:
                tqdm.write(f"iter {it}: val loss {val_loss:.4f}")
            if it > start_iter:  # nothing new to save at the first step of a run
                run.save()
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it, cfg)
        for micro in range(micro_steps):
            rng, gen = micro_batch_rng(cfg, it, run.rank * micro_steps + micro)
            tokens, prompt_len, length = run.train_data.get_batch(cfg["batch_size"], rng, cfg["device"])
            batch = make_batch(cfg, tokens, prompt_len, length, run.train_data.meta, gen)
            # DDP averages gradients across processes only after the last micro-batch. FSDP reduce-scatters
            # after every one: holding them back would keep each process's full unsharded gradients.
            if world > 1 and not cfg["fsdp"]:
                model.require_backward_grad_sync = micro == micro_steps - 1
            with autocast:
                logits = forward_model(batch.idx, batch.position_ids, key_mask=batch.key_mask)
            loss, ar_loss, mdm_loss = hybrid_loss(logits.float(), batch)
            if not torch.isfinite(loss):
                raise diverged(cfg, "loss", loss.item(), it)
            (loss / micro_steps).backward()
            n_tokens += int(length.sum())
            flops += flops_per_token(run.model, batch.idx.shape[1]) * batch.idx.numel()
        if cfg["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        tflops = flops * world / dt / 1e12
        mfu = {"mfu": f"{tflops / (cfg['peak_tflops'] * world):.1%}"} if "cuda" in cfg["device"] else {}
        bar.set_postfix(loss=f"{loss.item():.3f}", ar=f"{ar_loss.item():.3f}", mdm=f"{mdm_loss.item():.3f}",
                        tok_s=f"{n_tokens * world / dt:.0f}", tflops=f"{tflops:.3f}", **mfu)
        if not live and run.rank == 0 and it % cfg["log_interval"] == 0:
            print(f"iter {it}: loss {loss.item():.4f} (ar {ar_loss.item():.4f}, mdm {mdm_loss.item():.4f}), "
                  f"{n_tokens * world / dt:.0f} tok/s, {tflops:.3f} TFLOP/s"
                  + (f", MFU {mfu['mfu']}" if mfu else ""), flush=True)
        stop = bool(stop_requested)
        if world > 1:  # every process stops after the same step, even if only one saw the Ctrl-C
            flag = torch.tensor(float(stop), device=cfg["device"])
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            stop = bool(flag.item())
        if stop:
            interrupted = True
            break
    run.iter_num += 1  # steps completed
    run.save()
    bar.close()
    return interrupted


def main(argv):
    cfg = parse_args(DEFAULTS, argv)
    explicit = explicit_keys(cfg, DEFAULTS, argv)
    check_config(cfg)
    check_sharding(cfg, launched="RANK" in os.environ)
    # the process that writes checkpoints (RANK 0 under torchrun) holds out_dir from here to the end
    with hold_out_dir(cfg["out_dir"]) if os.environ.get("RANK", "0") == "0" else nullcontext():
        start_and_train(cfg, explicit)


def start_and_train(cfg, explicit):
    """The run main() starts once its settings are checked and out_dir is held: where it starts
    (START_MODES), the data, the model, then train() until max_iters or a Ctrl-C / SIGTERM."""
    ckpt_file = checkpoint_path(cfg["out_dir"])
    existing = [f for f in (ckpt_file, sharded_info_path(cfg["out_dir"])) if os.path.exists(f)]
    if cfg["init_from"] != "resume" and existing:
        raise ValueError(f"{existing[0]} already exists: continue it with --init_from=resume, or choose another "
                         "--out_dir (nothing was overwritten)")
    start = START_MODES.get(cfg["init_from"], start_from_pretrained)(cfg, explicit)
    if cfg["fsdp"]:  # known only now: a resumed run takes it from its checkpoint
        ckpt_file = sharded_info_path(cfg["out_dir"])
    cfg["lr_decay_iters"] = cfg["lr_decay_iters"] or cfg["max_iters"]
    if start.iter_num >= cfg["max_iters"]:
        raise ValueError(f"{ckpt_file} is already trained for {start.iter_num} iterations; "
                         f"raise --max_iters above {start.iter_num} to continue it")
    rank, world = setup_distributed(cfg)
    torch.manual_seed(cfg["seed"])
    data_dir = prepare(cfg["dataset"], cfg["tokenizer"], cfg["block_size"], cfg["data_root"], cfg["too_long"])
    train_data, val_data = TokenDataset(data_dir, "train"), TokenDataset(data_dir, "val")
    if start.data_sha1 not in (None, train_data.meta.get("data_sha1")):  # the data file changed since
        raise ValueError(f"the prepared data {data_dir} is not the data {ckpt_file} was trained on (its SHA-1 "
                         f"differs: --dataset={cfg['dataset']} was edited, or prepared with another tokenizer or "
                         "Python); resume with that data, or start a new run from its weights with "
                         f"--init_from={cfg['out_dir']} --out_dir=ANOTHER (the checkpoint is as it was)")
    if len(train_data) < cfg["batch_size"] and rank == 0:
        print(f"warning: the training split has {len(train_data)} samples, fewer than one batch of "
              f"{cfg['batch_size']}; batches draw samples with replacement, so they repeat", file=sys.stderr)
    model = Transformer(ModelConfig(**start.model_args))
    if start.weights is not None:
        load_weights(model, start.weights)
    if cfg["activation_checkpointing"]:
        checkpoint_blocks(model)
    if cfg["fsdp"]:  # before the optimizer, which must see the shards; each moves to the device as it is cut
        shard_model(model, cfg["device"], bf16=cfg["device"].startswith("cuda"))
    model.to(cfg["device"])
    optimizer = make_optimizer(cfg, model)
    if start.optimizer is not None:
        optimizer.load_state_dict(start.optimizer)  # moves its state to the parameters' device
    if start.shards is not None:
        load_sharded(start.shards, model, optimizer)
    run = Run(cfg, model, optimizer, start.model_args, train_data, val_data, data_dir, rank, world,
              start.iter_num, start.best_val_loss)
    del start  # free the loaded checkpoint for the whole run
    if rank == 0:
        print(f"{cfg['objective']} model: {model.num_params() / 1e6:.2f}M parameters, "
              f"{len(train_data):,} training samples, device {cfg['device']}, {world} process(es)")
    with stop_requests() as requested:
        interrupted = train(run, requested)
    if world > 1:
        torch.distributed.barrier()  # no process exits (ending the others) before rank 0 has saved
        torch.distributed.destroy_process_group()
    if interrupted:
        launcher = "torchrun ... train.py" if world > 1 else "python train.py"
        raise SystemExit(f"interrupted after {run.iter_num} iterations; saved {ckpt_file}. Continue with "
                         f"`{launcher} --out_dir={cfg['out_dir']} --init_from=resume`" if rank == 0 else 1)
    if rank == 0:
        print(f"saved {ckpt_file} (best val loss {run.best_val_loss:.4f})")


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
