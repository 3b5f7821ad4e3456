"""
train.py's command line besides the objective and the loop.

    take_resumed_settings(...) --init_from=resume: the checkpoint's settings, before the checks
    check_train_config(cfg)    refuse settings that cannot work, before any data is prepared
    hold_out_dir(out_dir)      one training run per out_dir at a time (a lock, and who holds it)
    process(cfg)               for the run: torchrun's process group, --deterministic's kernels
    where_to_start(cfg, ...)   scratch, resume or a pretrained model: the Start of a run
    load_data(cfg, ...)        the prepared splits
    place_model(cfg, model)    activation checkpointing, FSDP's shards, the device
    restore_optimizer(...)     a resumed run's optimizer state
    stop_requests(...)         Ctrl-C and SIGTERM end the run after its step, saved (before
                               the first step: at once)
    save(cfg, ...)             the resumable checkpoint
    diverged(cfg, error)       what a loss that stopped being finite says
    finish(cfg, ...)           the last words of a run
"""

import ctypes
import ctypes.util
import math
import os
import signal
import socket
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass

import torch
from filelock import FileLock, Timeout

from configurator import check_device, check_seed, require
from model import ModelConfig
from support.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint, sharded_info_path
from support.compiled import check_compile
from support.files import (STOP_SIGNALS, Stopped, abridged, link_target, remove_temporaries,
                           write_atomic)
from support.hf_folder import from_pretrained
from support.prepare import TokenDataset, prepare
from support.shard import (checkpoint_layers, load_sharded, load_sharded_info, save_sharded,
                           shard_model)
from support.tokenizer import TOKENIZERS, get_tokenizer, vocab_size

OBJECTIVES = ("refusion", "ar", "mdm")
# the model's shape, which --init_from=PATH takes from its checkpoint
MODEL_KEYS = ("block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "qk_norm", "rope_theta")
# what a resumed run keeps (a flag that contradicts one is refused): the model, its data, and what a
# label or an output means (the objective, its layouts, mdm_shift); data_root may move
RESUME_KEYS = MODEL_KEYS + ("objective", "dataset", "tokenizer", "slot_sizes", "slot_end_labels",
                            "ar_fraction", "gen_length", "mdm_shift")

# -----------------------------------------------------------------------------
# settings, checked once, where they enter

def check_train_config(cfg):
    """Refuse settings that cannot work, with the fix, before anything is prepared or trained
    (FSDP's: support.shard.check_sharding). Raises ValueError."""
    if cfg["objective"] not in OBJECTIVES:
        raise ValueError(f"--objective={cfg['objective']!r}: choose one of {', '.join(OBJECTIVES)}")
    if cfg["dtype"] not in ("auto", "bfloat16", "float32"):
        raise ValueError(f"--dtype={cfg['dtype']!r}: choose auto, bfloat16 or float32")
    if cfg["too_long"] not in ("skip", "fail"):
        raise ValueError(f"--too_long={cfg['too_long']!r}: choose skip or fail")
    if cfg["tokenizer"] not in TOKENIZERS and not cfg["tokenizer"].startswith("hf:"):
        raise ValueError(f"--tokenizer={cfg['tokenizer']!r}: choose one of "
                         f"{', '.join(TOKENIZERS)}, or hf:FOLDER for a Hugging Face model folder's "
                         "tokenizer.json")
    if not cfg["slot_sizes"] or any(not isinstance(s, int) or s <= 0 for s in cfg["slot_sizes"]):
        raise ValueError(f"--slot_sizes={cfg['slot_sizes']}: give positive integers, "
                         "e.g. --slot_sizes=(4,8)")
    require(cfg, ("batch_size", "gradient_accumulation_steps", "max_iters", "n_layer", "n_head",
                  "n_embd", "block_size", "eval_iters", "eval_interval", "log_interval"),
            "positive", lambda v: v > 0)
    require(cfg, ("learning_rate", "rope_theta", "peak_tflops"), "positive and finite",
            lambda v: 0 < v < math.inf)
    require(cfg, ("n_kv_head", "lr_decay_iters", "warmup_iters", "gen_length"), "0 or more",
            lambda v: v >= 0)
    if cfg["objective"] == "mdm" and cfg["pack"]:
        raise ValueError("--pack lays samples side by side for causal attention; an MDM's "
                         "bidirectional samples are not packed: drop --pack")
    if cfg["mdm_shift"] and cfg["objective"] != "mdm":
        raise ValueError(f"--mdm_shift shifts an MDM's labels; --objective={cfg['objective']} "
                         "is not an MDM: drop --mdm_shift or use --objective=mdm")
    if cfg["objective"] == "mdm" and cfg["gen_length"] >= cfg["block_size"]:
        raise ValueError(f"--gen_length={cfg['gen_length']}: an MDM's canvas must leave room for a "
                         f"prompt in its context of --block_size={cfg['block_size']}; lower "
                         "--gen_length or raise --block_size")
    require(cfg, ("min_lr", "weight_decay", "grad_clip"), "0 or more and finite",
            lambda v: 0 <= v < math.inf)
    require(cfg, ("beta1", "beta2", "mask_eps", "ar_fraction"), "in [0, 1)", lambda v: 0 <= v < 1)
    check_seed(cfg)
    check_device(cfg["device"])
    # raises for shapes that cannot work, before any data is prepared
    ModelConfig(n_layer=cfg["n_layer"], n_head=cfg["n_head"], n_kv_head=cfg["n_kv_head"] or None,
                n_embd=cfg["n_embd"])


# -----------------------------------------------------------------------------
# the out_dir a run holds, its processes and its signals


def reuse_freed_memory():
    """Keep the memory a training step frees for the next step instead of returning it to the
    operating system (glibc's mallopt: no mmap, a 1 GB trim threshold). Returns True when applied,
    False for a C library other than glibc."""
    # glibc returns each freed block over 32 MB and the next step faults it in page by page: a
    # SmolLM2 step on 2 CPU cores took 3.1 s, against 1.6 to 1.9 s with the memory kept
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4                # glibc's malloc.h
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**30))
    except (OSError, AttributeError, TypeError):             # no such library or function
        return False


def check_writable(out_dir):
    """Create out_dir and check that a checkpoint can be written there (and where a symlinked
    ckpt.pt points: support.files.link_target). Raises ValueError naming the directory and the
    fix."""
    try:
        target = os.path.dirname(link_target(checkpoint_path(out_dir)))
    except FileNotFoundError as e:  # a link into a missing directory: an unmounted disk?
        raise ValueError(f"{e} (nothing was trained)") from None
    try:
        os.makedirs(out_dir, exist_ok=True)
        for directory in {out_dir, target}:
            with tempfile.TemporaryFile(dir=directory) as probe:
                probe.write(b"probe")
                probe.flush()
    except OSError as e:
        raise ValueError(f"--out_dir={out_dir}: cannot write a checkpoint there "
                         f"({e.strerror or e}); choose a directory you can write to") from None


@contextmanager
def hold_out_dir(out_dir):
    """While the block runs, hold out_dir for one training run: a lock (released however the process
    ends) and who holds it (pid, host). Creates out_dir (check_writable), and removes it at the end
    when this run created it and wrote nothing there. Raises ValueError naming the directory and the
    run that holds it."""
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
        raise ValueError(f"--out_dir={out_dir} is in use by another training run ({holder}); "
                         "wait for it to end or choose another --out_dir "
                         "(nothing was written)") from None
    try:
        # what a run killed mid-save left (kill -9, a power cut): no save is under way while we hold
        # the lock
        names = [os.path.basename(p) for p in (checkpoint_path(out_dir),
                                               sharded_info_path(out_dir), holder_path)]
        removed = remove_temporaries(out_dir, names)
        if removed:
            print(f"note: removed {abridged(removed)} from {out_dir}, left by a run killed while "
                  "it saved", file=sys.stderr)
        write_atomic(holder_path, lambda f: f.write(
            f"pid {os.getpid()} on {socket.gethostname()}, "
            f"started {time.strftime('%Y-%m-%d %H:%M:%S')}".encode()))
        yield
    finally:
        if os.path.exists(holder_path):
            os.remove(holder_path)  # before the release: the next holder's note must not be removed
        lock.release()
        if created and os.listdir(out_dir) == [".lock"]:  # a run refused before writing anything
            os.remove(lock_path)
            os.rmdir(out_dir)


def live_progress():
    """True when stdout and stderr are both terminals, where a progress bar redraws in place; else
    progress is printed as plain lines."""
    return sys.stdout.isatty() and sys.stderr.isatty()


def setup_distributed(cfg):
    """Join the process group when launched by torchrun (RANK set): NCCL on CUDA (cfg["device"]
    becomes this process's GPU), gloo on CPU. Returns (rank, world_size). Raises ValueError unless
    world_size divides gradient_accumulation_steps."""
    if "RANK" not in os.environ:
        return 0, 1
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cfg["gradient_accumulation_steps"] % world:
        raise ValueError(f"--gradient_accumulation_steps={cfg['gradient_accumulation_steps']} must "
                         f"be a multiple of the {world} processes; each takes an equal share")
    if not cfg["device"].startswith("cuda"):
        torch.distributed.init_process_group("gloo")
        return rank, world
    cfg["device"] = f"cuda:{os.environ['LOCAL_RANK']}"
    torch.cuda.set_device(cfg["device"])
    # NCCL is told this process's GPU instead of guessing it from the rank
    torch.distributed.init_process_group("nccl", device_id=torch.device(cfg["device"]))
    return rank, world


@contextmanager
def deterministic_algorithms(compiled):
    """While the block runs, deterministic kernels only (--deterministic=True; compiled: Inductor's
    too), at some cost in speed; an operation without one raises RuntimeError naming it. The
    previous settings are back after the block, however it ends."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_benchmark = torch.backends.cudnn.benchmark
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    # cuBLAS reads it at its first call: split sums over a fixed workspace add in one order
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    # cuDNN's kernels are not chosen by timing them on each run
    torch.backends.cudnn.benchmark = False
    inductor = nullcontext()
    if compiled:  # nor are Inductor's, where that changes the numbers
        from torch._inductor import config as inductor_config
        inductor = inductor_config.patch(deterministic=True)
    try:
        with inductor:
            yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        torch.backends.cudnn.benchmark = was_benchmark
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG")


@contextmanager
def process(cfg):
    """While the block runs: --deterministic's kernels, on a CPU memory kept between steps
    (reuse_freed_memory), and under torchrun the process group (setup_distributed), left however the
    block ends. Yields (rank, world_size)."""
    if cfg["device"] == "cpu":
        reuse_freed_memory()
    with deterministic_algorithms(cfg["compile"]) if cfg["deterministic"] else nullcontext():
        rank, world = setup_distributed(cfg)
        try:
            yield rank, world
        finally:
            # only a group this run joined (setup_distributed joins under torchrun alone)
            if "RANK" in os.environ and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


@contextmanager
def stop_requests(cfg, optimizer, world):
    """While the block runs, STOP_SIGNALS do not end the process: each is appended to the list it
    yields, and the loop saves and stops after its step. Before the run's first optimizer step
    (its first --compile compiling, its first evaluation), with nothing new to save, a stop request
    ends the run at once: raises SystemExit saying what was kept. The previous handlers are back
    after the block, however it ends."""
    requested = []
    stepped = {"once": False}
    hook = optimizer.register_step_post_hook(lambda *args: stepped.update(once=True))

    def request(signum, frame):
        requested.append(signum)
        if not stepped["once"]:
            raise Stopped(signum)
    previous = {sig: signal.signal(sig, request) for sig in STOP_SIGNALS}
    try:
        yield requested
    except Stopped:
        raise stopped_early(cfg, world) from None
    finally:
        hook.remove()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stopped_early(cfg, world):
    """The SystemExit of a run stopped before its first step: what is kept, and how to go on."""
    if os.environ.get("RANK", "0") != "0":
        return SystemExit(1)
    if cfg["init_from"] != "resume":
        return SystemExit("interrupted before the first step; nothing was saved: run the same "
                          "command again to start")
    return SystemExit(f"interrupted before the first step; {saved_path(cfg)} is as it was. "
                      f"Continue with `{continue_command(cfg, world)}`")


def continue_command(cfg, world):
    """The command that resumes the run in cfg's out_dir, by hand or under torchrun."""
    launcher = "torchrun ... train.py" if world > 1 else "python train.py"
    return f"{launcher} --out_dir={cfg['out_dir']} --init_from=resume"


# -----------------------------------------------------------------------------
# where a run starts: one function per --init_from mode


@dataclass
class Start:
    """How a run begins: the model's shape, the checkpoint whose weights it loads, and when resuming
    the optimizer state (or the sharded checkpoint's shards directory), counters, the prepared
    data's SHA-1 and the minutes trained so far (None: the checkpoint does not record them)."""
    model_args: dict
    weights: dict | None = None
    optimizer: dict | None = None
    iter_num: int = 0
    best_val_loss: float = math.inf
    shards: str | None = None
    data_sha1: str | None = None
    train_minutes: float | None = 0.0


def inherit_settings(cfg, explicit, source, keys, what, also=()):
    """Take `keys` from a checkpoint's config into cfg. Raises ValueError naming every flag set
    explicitly to another value (and the problems in also), with the fix."""
    def meant(key):  # the values the checkpoint's setting stands for: n_kv_head 0 is n_head's
        return {source[key]} | ({source["n_head"]} if key == "n_kv_head" and not source[key]
                                else set())
    wrong = [f"--{key}={cfg[key]} differs from the checkpoint's {source[key]!r}"
             + (f" (n_head's {source['n_head']})" if len(meant(key)) > 1 else "")
             for key in keys if key in explicit and cfg[key] not in meant(key)] + list(also)
    if wrong:
        raise ValueError(f"{'; '.join(wrong)}; {what}: drop the flag{'s' * (len(wrong) > 1)}")
    cfg |= {key: source[key] for key in keys}


def start_from_scratch(cfg, explicit):
    """--init_from=scratch: a new model of the configured shape, randomly initialised."""
    return Start(dict(vocab_size=vocab_size(get_tokenizer(cfg["tokenizer"])),
                      block_size=cfg["block_size"], n_layer=cfg["n_layer"], n_head=cfg["n_head"],
                      n_kv_head=cfg["n_kv_head"] or cfg["n_head"],
                      n_embd=cfg["n_embd"], qk_norm=cfg["qk_norm"], rope_theta=cfg["rope_theta"],
                      causal=cfg["objective"] != "mdm"))


def take_resumed_settings(cfg, explicit):
    """--init_from=resume, before the settings are checked: every setting not given explicitly
    comes from out_dir's checkpoint, a sharded one (ckpt_sharded.pt) first. Raises ValueError for
    flags that contradict RESUME_KEYS or its sharding (all at once), a weights-only checkpoint or a
    sharded run outside torchrun; FileNotFoundError without a checkpoint."""
    if cfg["init_from"] != "resume":
        return
    out_dir = cfg["out_dir"]
    sharded = os.path.lexists(sharded_info_path(out_dir))
    ckpt = load_sharded_info(out_dir) if sharded else load_checkpoint(out_dir, settings_only=True)
    # the optimizer state of one cannot be loaded into the other
    written = "sharded" if sharded else "whole"
    also = ([f"--fsdp={cfg['fsdp']} differs from the checkpoint, which was written {written}"]
            * ("fsdp" in explicit and cfg["fsdp"] != sharded))
    inherit_settings(cfg, explicit, ckpt["config"], RESUME_KEYS,
                     "a resumed run keeps its model, data, objective and sharding", also)
    cfg |= {k: v for k, v in ckpt["config"].items() if k in cfg and k not in explicit | {"device"}}
    cfg["fsdp"] = sharded
    if not sharded and "optimizer" not in ckpt:
        raise ValueError(f"{checkpoint_path(out_dir)} holds weights only (consolidated from "
                         "a sharded checkpoint); start a new run from it with "
                         f"--init_from={checkpoint_path(out_dir)}")
    if sharded and "RANK" not in os.environ:
        raise ValueError(f"the run in {out_dir} was sharded (--fsdp=True, its checkpoint "
                         f"{sharded_info_path(out_dir)}): resume it under torchrun, `torchrun "
                         f"--standalone --nproc_per_node=N train.py --init_from=resume "
                         f"--out_dir={out_dir}` (--fsdp=True comes from the checkpoint), or "
                         f"consolidate it (`python -m tools.consolidate --out_dir={out_dir}`) and "
                         f"start a new run from its weights with --init_from={out_dir} "
                         "--out_dir=ANOTHER")


def resume_from_checkpoint(cfg, explicit):
    """--init_from=resume: the run in out_dir continues exactly, with the settings
    take_resumed_settings took from its checkpoint (sharded when cfg["fsdp"])."""
    if cfg["fsdp"]:  # the shards are read once the model is sharded (support.shard.load_sharded)
        info = load_sharded_info(cfg["out_dir"])
        return Start(info["model_args"], iter_num=info["iter_num"],
                     best_val_loss=info["best_val_loss"], shards=info["shards"],
                     data_sha1=info["meta"].get("data_sha1"),
                     train_minutes=info.get("train_minutes"))
    ckpt = load_checkpoint(cfg["out_dir"], "cpu")
    return Start(ckpt["model_args"], ckpt, ckpt["optimizer"], ckpt["iter_num"],
                 ckpt["best_val_loss"], data_sha1=ckpt["meta"].get("data_sha1"),
                 train_minutes=ckpt.get("train_minutes"))


def start_from_pretrained(cfg, explicit):
    """--init_from=PATH: a checkpoint's or Hugging Face folder's model, trained on with this run's
    objective and a fresh optimizer. Raises FileNotFoundError for a missing path, ValueError for a
    contradicting flag."""
    if not os.path.exists(cfg["init_from"]):
        raise FileNotFoundError(f"--init_from={cfg['init_from']}: use 'scratch', 'resume', or the "
                                "path of an existing checkpoint (a ckpt.pt or the out_dir holding "
                                "it) or Hugging Face folder")
    if os.path.lexists(os.path.join(cfg["init_from"], "config.json")):  # whatever its kind
        return start_from_hf_folder(cfg, explicit)
    if os.path.isdir(cfg["init_from"]) and not os.path.lexists(checkpoint_path(cfg["init_from"])):
        raise FileNotFoundError(f"--init_from={cfg['init_from']} holds neither a checkpoint "
                                "(ckpt.pt) nor a Hugging Face model (config.json); point it at a "
                                "run's out_dir or a downloaded model folder")
    ckpt = load_checkpoint(cfg["init_from"], "cpu")
    inherit_settings(cfg, explicit, ckpt["config"], MODEL_KEYS,
                     "a fine-tune keeps the model's shape")
    if ckpt["meta"]["tokenizer"] != cfg["tokenizer"]:
        raise ValueError(f"--init_from={cfg['init_from']} was trained with the "
                         f"{ckpt['meta']['tokenizer']!r} tokenizer but this run uses "
                         f"{cfg['tokenizer']!r}; pass --tokenizer={ckpt['meta']['tokenizer']}")
    rows = max(ckpt["model_args"]["vocab_size"], vocab_size(get_tokenizer(cfg["tokenizer"])))
    return Start(dict(ckpt["model_args"], causal=cfg["objective"] != "mdm", vocab_size=rows), ckpt)


def start_from_hf_folder(cfg, explicit):
    """--init_from=FOLDER: a Qwen3 or Llama in Hugging Face's layout (float32 weights) with its own
    tokenizer (cfg["tokenizer"] becomes hf:FOLDER). Raises ValueError for a contradicting flag, and
    what from_pretrained raises."""
    # the checkpoint's tokenizer is found from any directory
    folder = os.path.abspath(cfg["init_from"])
    if "tokenizer" in explicit and cfg["tokenizer"] != f"hf:{folder}":
        raise ValueError(f"--tokenizer={cfg['tokenizer']}: a fine-tune of {folder} uses its own "
                         "tokenizer; drop the flag")
    cfg["tokenizer"] = f"hf:{folder}"
    model = from_pretrained(folder)
    c = model.config
    shape = dict(n_layer=c.n_layer, n_head=c.n_head, n_kv_head=c.n_kv_head, n_embd=c.n_embd,
                 qk_norm=c.qk_norm, rope_theta=c.rope_theta)
    inherit_settings(cfg, explicit, shape, shape, "a fine-tune keeps the model's shape")
    rows = max(c.vocab_size, vocab_size(get_tokenizer(cfg["tokenizer"])))
    return Start(dict(asdict(c), causal=cfg["objective"] != "mdm", vocab_size=rows),
                 {"model": model.state_dict()})


# anything else: a checkpoint's path
START_MODES = {"scratch": start_from_scratch, "resume": resume_from_checkpoint}


def where_to_start(cfg, explicit):
    """The Start of a run, once its settings are checked and out_dir is held; fills in
    lr_decay_iters and turns off a --compile that cannot run (check_compile). explicit: the
    settings given (configurator.explicit_keys). Raises ValueError for a checkpoint a new run
    would overwrite, or one trained to max_iters already."""
    existing = [f for f in (checkpoint_path(cfg["out_dir"]), sharded_info_path(cfg["out_dir"]))
                if os.path.exists(f)]
    if cfg["init_from"] != "resume" and existing:
        raise ValueError(f"{existing[0]} already exists: continue it with --init_from=resume, or "
                         "choose another --out_dir (nothing was overwritten)")
    start = START_MODES.get(cfg["init_from"], start_from_pretrained)(cfg, explicit)
    cfg["lr_decay_iters"] = cfg["lr_decay_iters"] or cfg["max_iters"]
    if start.iter_num >= cfg["max_iters"]:
        raise ValueError(f"{saved_path(cfg)} is already trained for {start.iter_num} iterations; "
                         f"raise --max_iters above {start.iter_num} to continue it")
    check_compile(cfg)
    return start


def saved_path(cfg):
    """out_dir's ckpt.pt, or with --fsdp its ckpt_sharded.pt."""
    return sharded_info_path(cfg["out_dir"]) if cfg["fsdp"] else checkpoint_path(cfg["out_dir"])


def load_data(cfg, start, rank):
    """The prepared splits: (train_data, val_data) TokenDatasets. Raises ValueError when a resumed
    run's data changed."""
    data_dir = prepare(cfg["dataset"], cfg["tokenizer"], cfg["block_size"], cfg["data_root"],
                       cfg["too_long"])
    train_data, val_data = TokenDataset(data_dir, "train"), TokenDataset(data_dir, "val")
    if start.data_sha1 not in (None, train_data.meta.get("data_sha1")):
        raise ValueError(f"the prepared data {data_dir} is not the data {saved_path(cfg)} was "
                         f"trained on (its SHA-1 differs: --dataset={cfg['dataset']} was edited, "
                         "or prepared with another tokenizer or Python); resume with that data, "
                         f"or start a new run from its weights with --init_from={cfg['out_dir']} "
                         "--out_dir=ANOTHER (the checkpoint is as it was)")
    if len(train_data) < cfg["batch_size"] and rank == 0:
        print(f"warning: the training split has {len(train_data)} samples, fewer than one batch of "
              f"{cfg['batch_size']}; batches draw samples with replacement, so they repeat",
              file=sys.stderr)
    return train_data, val_data


def place_model(cfg, model):
    """Put the model where it trains, before the optimizer is built: activation checkpointing,
    FSDP's shards, the device. Returns the model."""
    if cfg["activation_checkpointing"]:
        checkpoint_layers(model)
    if cfg["fsdp"]:
        shard_model(model, cfg["device"], bf16=cfg["device"].startswith("cuda"))
    return model.to(cfg["device"])


def restore_optimizer(start, model, optimizer):
    """A resumed run's optimizer state (moved to the parameters' device), or its shards."""
    if start.optimizer is not None:
        optimizer.load_state_dict(start.optimizer)
    if start.shards is not None:
        load_sharded(start.shards, model, optimizer)


def save(cfg, model, optimizer, model_args, train_data, iter_num, best_val_loss, rank,
         train_minutes=None):
    """Write the resumable checkpoint atomically: ckpt.pt by rank 0, or with --fsdp every process
    its shards. Call on every process. iter_num: the steps completed; train_minutes: the
    wall-clock minutes of every run that trained it (None: not known)."""
    info = {"model_args": model_args, "iter_num": iter_num, "best_val_loss": best_val_loss,
            "config": cfg, "meta": train_data.meta, "data_dir": train_data.data_dir,
            "train_minutes": train_minutes}
    if cfg["fsdp"]:
        save_sharded(cfg["out_dir"], model, optimizer, info)
    elif rank == 0:
        save_checkpoint(cfg["out_dir"], dict(info, model=model.state_dict(),
                                             optimizer=optimizer.state_dict()))


def diverged(cfg, error):
    """The SystemExit for a loss that stopped being finite (train.Diverged), saying whether a
    checkpoint to go back to exists."""
    ckpt_file = saved_path(cfg)
    if os.path.exists(ckpt_file):
        then = (f"the last good checkpoint {ckpt_file} is kept: lower --learning_rate (or check "
                "the data), then continue it with --init_from=resume")
    else:
        then = ("no checkpoint was written yet: lower --learning_rate (or check the data) and "
                "start again")
    return SystemExit(f"error: {error}; {then}")


def finish(cfg, rank, world, iter_num, best_val_loss, interrupted):
    """After the last save: every process waits for rank 0's; rank 0 says where the checkpoint is.
    Raises SystemExit for an interrupted run, with the command that continues it."""
    if world > 1:
        torch.distributed.barrier()  # no process exits (ending the others) before rank 0 has saved
    if interrupted:
        raise SystemExit(f"interrupted after {iter_num} iterations; saved {saved_path(cfg)}. "
                         f"Continue with `{continue_command(cfg, world)}`" if rank == 0 else 1)
    if rank == 0:
        print(f"saved {saved_path(cfg)} (best val loss {best_val_loss:.4f})")
