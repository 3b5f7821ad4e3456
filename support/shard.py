"""
Models larger than one GPU: sharded training with PyTorch FSDP2 (`fully_shard`), activation
checkpointing, sharded checkpoints, and the memory arithmetic that says when they are needed.

    torchrun --standalone --nproc_per_node=8 train.py config/finetune_qwen3_8b.py   # --fsdp=True
    python -m tools.consolidate --out_dir=out-qwen3-8b   # one ckpt.pt (weights only) for sampler.py

    training_memory, memory_table       model-state bytes per GPU, under DDP and under FSDP
    check_sharding, shard_model, checkpoint_layers     --fsdp's checks, its shards; recomputation
    save_sharded, load_sharded, load_sharded_info   sharded checkpoints, read as data (read_shards)
    consolidate                         a sharded checkpoint as one ckpt.pt
"""

import os
import pickle
import shutil
import warnings
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from model import ModelConfig, Transformer
from support.checkpoint import FORMAT, checkpoint_path, save_checkpoint, sharded_info_path
from support.files import check_kind, raise_if_disk_full, write_atomic
from support.report import markdown_table

# The shapes of the two Qwen3 models the configs fine-tune, from their releases' config.json
# (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
# intermediate_size, vocab_size, tie_word_embeddings); memory_table builds them on the meta device
# to count their parameters.
QWEN3_SHAPES = {
    "Qwen3-0.6B": dict(vocab_size=151936, n_embd=1024, n_layer=28, n_head=16, n_kv_head=8,
                       head_dim=128, intermediate_size=3072, tie_embeddings=True),
    "Qwen3-8B": dict(vocab_size=151936, n_embd=4096, n_layer=36, n_head=32, n_kv_head=8,
                     head_dim=128, intermediate_size=12288, tie_embeddings=False),
}


# -----------------------------------------------------------------------------
# memory: what each GPU holds


def training_memory(num_params, world=1, fsdp=False, gathered=0):
    """Estimated bytes of model state on each GPU when training num_params parameters with AdamW:
    16 per parameter under DDP (float32 weights 4, gradients 4, AdamW's moments 8); with fsdp over
    `world` GPUs 16 / world, plus 6 (bf16 weights, float32 gradients) per parameter of the unit of
    `gathered` parameters computing. Activations and buffers are not counted."""
    if not fsdp:
        return 16 * num_params
    return 16 * num_params / world + 6 * gathered


def unit_sizes(model):
    """Parameters in each unit shard_model all-gathers at once: every layer, then the root (the
    embedding, the final norm and lm_head)."""
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]
    return layers + [model.num_params() - sum(layers)]


def memory_table(world=8):
    """docs/training.md's table (markdown): parameters and model-state memory per GPU of each model
    in QWEN3_SHAPES under DDP and under FSDP over `world` GPUs (training_memory; GB = 1e9 bytes)."""
    header = ["model", "parameters", "largest FSDP unit", "DDP, each GPU",
              f"FSDP over {world} GPUs, each GPU"]
    rows = []
    for name, shape in QWEN3_SHAPES.items():
        with torch.device("meta"):  # shapes only: no memory, no values
            model = Transformer(ModelConfig(**shape))
        n, unit = model.num_params(), max(unit_sizes(model))
        rows.append([name, f"{n / 1e9:.2f}B", f"{unit / 1e9:.2f}B",
                     f"{training_memory(n) / 1e9:.1f} GB",
                     f"{training_memory(n, world, fsdp=True, gathered=unit) / 1e9:.1f} GB"])
    return markdown_table(header, rows, right=(1, 2, 3, 4))


# -----------------------------------------------------------------------------
# wrapping the model


def check_sharding(cfg, launched):
    """Refuse --fsdp settings that cannot work, before any weights are loaded. launched: whether
    torchrun started this process (RANK is set). Raises ValueError with the fix."""
    if cfg["fsdp"] and not launched:
        raise ValueError("--fsdp=True shards the model over the processes torchrun starts: launch "
                         "with `torchrun --standalone --nproc_per_node=N train.py ...`, or drop "
                         "the flag on one GPU")
    if cfg["fsdp"] and not cfg["device"].startswith(("cuda", "cpu")):
        raise ValueError(f"--fsdp=True runs on cuda (NCCL) or cpu (gloo), not "
                         f"--device={cfg['device']}")


def checkpoint_layers(model):
    """Activation checkpointing, in place: each layer's forward keeps only its input and runs again
    in the backward pass (torch.utils.checkpoint, non-reentrant), about a third more compute. Each
    layer's forward is wrapped, not the layer, so parameter names and FSDP's hooks stay."""
    for layer in model.layers:
        layer.forward = partial(checkpoint, layer.forward, use_reentrant=False)


def shard_model(model, device, bf16):
    """Shard model over the process group with FSDP2 (fully_shard), in place: each layer a unit
    all-gathered while it computes, the rest (embedding, final norm, lm_head) the root unit. Each
    process holds 1/world of dim 0 of every parameter (a DTensor; numel() counts the full one) on
    `device` ("cpu" or "cuda:N"); build the optimizer after. bf16: compute in bf16, reduce float32
    gradients. Needs the process group (support.runs.setup_distributed). Returns model."""
    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
              else MixedPrecisionPolicy())
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


# -----------------------------------------------------------------------------
# sharded checkpoints: out_dir/ckpt_sharded.pt (plain data) names the directory holding the shards
# save_sharded writes into the one that is not live
SHARD_DIRS = ("ckpt_sharded_a", "ckpt_sharded_b")
# what to do about a sharded checkpoint's file that is a directory, a FIFO or a device
RETRAIN = ("train.py writes regular files here: move this away, retrain, or point to another "
           "--out_dir")


def load_sharded_info(out_dir):
    """The plain data of out_dir's sharded checkpoint, "shards" its shards' directory's path.
    Raises FileNotFoundError when there is none, ValueError when the file is not readable."""
    path = sharded_info_path(out_dir)
    if not os.path.lexists(path):
        raise FileNotFoundError(f"no sharded checkpoint at {path}: train one with "
                                f"`torchrun ... train.py --fsdp=True --out_dir={out_dir}`")
    check_kind(path, RETRAIN)
    try:
        info = torch.load(path, weights_only=True)
    except Exception as e:  # torch raises several types for truncated or unsafe files
        raise ValueError(f"{path} is not a readable sharded checkpoint ({type(e).__name__}); it "
                         "may be truncated or from another program") from None
    if info.get("format") != FORMAT:
        raise ValueError(f"{path} has checkpoint format {info.get('format')!r}, this code reads "
                         f"format {FORMAT}")
    if info.get("shards") not in SHARD_DIRS:  # the next save deletes the directory it names
        raise ValueError(f"{path} names the shards {info.get('shards')!r}, not one of "
                         f"{', '.join(SHARD_DIRS)} in {out_dir}; it was not written by train.py: "
                         "retrain it or point to another --out_dir")
    return dict(info, shards=os.path.join(out_dir, info["shards"]))


# What a sharded checkpoint's index (torch.distributed.checkpoint's .metadata pickle) is built from;
# dcp reads it with plain pickle, which would run code: check_shards reads it first with these only
METADATA_CLASSES = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
    "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a sharded checkpoint's .metadata, constructing only METADATA_CLASSES and torch
    dtypes."""

    def find_class(self, module, name):
        if ((module, name) in METADATA_CLASSES
                or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, "
                                     "which a checkpoint's index never holds")


class PlainDataLoadPlanner(DefaultLoadPlanner):
    """dcp's default load planner, except that the values pickled beside the tensors (an optimizer's
    learning rate, betas, ...) must be plain data (torch.load's weights_only)."""

    def load_bytes(self, read_item, value):
        try:
            torch.load(value, weights_only=True)
        except Exception as e:
            raise ValueError(f"a sharded checkpoint's value {read_item.dest_index.fqn} is not "
                             f"plain data ({type(e).__name__}); it was not loaded and nothing in "
                             "it ran: retrain it") from None
        value.seek(0)
        super().load_bytes(read_item, value)  # the same bytes, now known to hold plain data only


def check_shards(shards):
    """Refuse a directory of shards whose index (.metadata) is not what
    torch.distributed.checkpoint writes; nothing in it is run. Raises FileNotFoundError without
    one, ValueError naming the file."""
    path = os.path.join(shards, ".metadata")
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{path} not found: the sharded checkpoint is incomplete; "
                                "retrain it")
    check_kind(path, RETRAIN)
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except Exception as e:  # pickle raises several types for truncated or foreign files
        raise ValueError(f"{path} is not a sharded checkpoint's index ({type(e).__name__}: {e}); "
                         "it was not loaded and nothing in it ran: retrain it or point to another "
                         "--out_dir") from None
    if type(metadata).__name__ != "Metadata":
        raise ValueError(f"{path} holds a {type(metadata).__name__}, "
                         "not a sharded checkpoint's index")


def read_shards(state, shards, **kwargs):
    """dcp.load(state, checkpoint_id=shards, **kwargs), read as data only (check_shards,
    PlainDataLoadPlanner). Raises ValueError for a file that would run code, and what dcp.load
    raises."""
    check_shards(shards)
    try:
        dcp.load(state, checkpoint_id=shards, planner=PlainDataLoadPlanner(), **kwargs)
    except CheckpointException as e:  # dcp gathers every process's error; ours say what to do
        refused = [error for error, _ in e.failures.values() if isinstance(error, ValueError)]
        if refused:
            raise refused[0] from None
        raise


def save_sharded(out_dir, model, optimizer, info):
    """Write a resumable sharded checkpoint; call on every process. Each writes its shards of the
    weights and AdamW's state beside the live ones, then rank 0 points ckpt_sharded.pt at them and
    deletes the old: a crash leaves a complete checkpoint. A full disk (or quota, or `ulimit -f`)
    raises files.DiskFull (a ValueError). out_dir: on a file system every node sees. info: the plain
    data saved beside (model_args, iter_num, config, meta, ...)."""
    path = sharded_info_path(out_dir)
    live = load_sharded_info(out_dir)["shards"] if os.path.isfile(path) else None
    shards = ("ckpt_sharded_b" if live == os.path.join(out_dir, "ckpt_sharded_a")
              else "ckpt_sharded_a")
    if dist.get_rank() == 0:
        # what a crash mid-save left
        shutil.rmtree(os.path.join(out_dir, shards), ignore_errors=True)
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    # returns once every process's shards and rank 0's index are written
    try:
        dcp.save({"model": model_state, "optimizer": optimizer_state},
                 checkpoint_id=os.path.join(out_dir, shards))
    # e.g. a full disk: the incomplete shards go, the live ones stay
    except (OSError, CheckpointException) as e:
        if dist.get_rank() == 0:
            shutil.rmtree(os.path.join(out_dir, shards), ignore_errors=True)
        for error in ([error for error, _ in e.failures.values()]
                      if isinstance(e, CheckpointException) else [e]):
            raise_if_disk_full(error, path, "sharded checkpoint")
        raise
    if dist.get_rank() == 0:
        write_atomic(path, lambda f: torch.save(dict(info, shards=shards, format=FORMAT), f),
                     "sharded checkpoint")
        if live is not None:
            shutil.rmtree(live, ignore_errors=True)
    dist.barrier()  # no process reads ckpt_sharded.pt for the next save before it names this one


def load_sharded(shards, model, optimizer):
    """Fill the sharded model and its optimizer (built after shard_model) from the directory
    `shards` save_sharded wrote, each process its own. Call on every process. Raises what
    read_shards raises."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    read_shards({"model": model_state, "optimizer": optimizer_state}, shards)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)


def consolidate(out_dir):
    """Write out_dir/ckpt.pt, the single-file checkpoint sampler.py reads, from out_dir's sharded
    one: the full float32 weights (one process, 4 bytes of memory per parameter) and the plain
    data, no optimizer state. Returns the path. Raises what load_sharded_info and read_shards do."""
    info = load_sharded_info(out_dir)
    with torch.device("meta"):  # names and shapes only
        shapes = Transformer(ModelConfig(**info["model_args"])).state_dict()
    weights = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in shapes.items()}
    # DCP warns that no process group is set up: reading in one process is the point
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        read_shards({"model": weights}, info.pop("shards"), no_dist=True)
    save_checkpoint(out_dir, dict(info, model=weights))
    return checkpoint_path(out_dir)
