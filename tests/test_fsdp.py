"""Sharded training (support/shard.py; train.py --fsdp=True): FSDP2 over 2 processes with gloo on
CPU, sharded checkpoints and their consolidation, activation checkpointing, and the memory table."""

import contextlib
import errno
import json
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

import sampler
import train
from configurator import run_cli
from helpers import NOT_FILES, ROOT, never_blocks, tiny_model, tiny_run_flags
from model import ModelConfig, Transformer
from support import shard
from support.checkpoint import load_checkpoint, sharded_info_path
from support.shard import checkpoint_layers, consolidate, load_sharded, load_sharded_info, \
    memory_table, save_sharded, shard_model, training_memory, unit_sizes
from tools import consolidate as consolidate_cli
from train import flops_per_token, make_optimizer

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("FSDP on CPU needs torch.distributed with the gloo backend",
                allow_module_level=True)

# every FSDP run: 2 micro-batches per process per step, and a clip that is active on this model
STEPS = ["--gradient_accumulation_steps=4", "--grad_clip=0.1"]
# of a checkpoint's data
BYTES_META = {"tokenizer": "bytes", "eos_id": 256, "mask_id": 257, "pad_id": 258}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_as(rank, port):
    """Make this process rank `rank` of 2, as torchrun does (support.runs.setup_distributed reads
    these)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")


def _train_worker(rank, runs):
    """Run train.main for each (flags, log file, port) in turn; rank 0's printed lines go to the log
    file. Each run meets at its own port: the previous run's rendezvous may still be listening on
    its own."""
    for flags, log, port in runs:
        _join_as(rank, port)
        # only rank 0 opens the log: a second "w" open would truncate what rank 0 already wrote
        with open(log if rank == 0 else os.devnull, "w") as f, contextlib.redirect_stdout(f):
            train.main(flags)


def train_two_processes(*runs):
    """Train each (flags, log file) in turn in 2 processes (gloo), as `torchrun --nproc_per_node=2`
    would."""
    torch.multiprocessing.spawn(_train_worker, args=([(*run, _free_port()) for run in runs],),
                                nprocs=2)


def val_losses(log):
    """{iteration: validation loss} from a training run's printed lines."""
    with open(log) as f:
        return {int(it): float(loss)
                for it, loss in re.findall(r"iter (\d+): val loss ([\d.]+)", f.read())}


def assert_same_weights(a, b, atol):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0)


def test_fsdp_reaches_the_weights_of_ddp_on_the_same_global_batch(tmp_path, qa_file):
    """2 processes with --fsdp=True (and activation checkpointing) take the same steps as 2 with
    DDP: same data, hybrid loss, gradient accumulation and clipping. Each process writes its own
    shards."""
    flags = {name: tiny_run_flags(tmp_path, qa_file, name) + STEPS + ["--max_iters=3"]
             for name in ("ddp", "fsdp")}
    train_two_processes((flags["ddp"], tmp_path / "ddp.log"),
                        (flags["fsdp"] + ["--fsdp=True", "--activation_checkpointing=True"],
                         tmp_path / "fsdp.log"))
    shards = load_sharded_info(str(tmp_path / "fsdp"))["shards"]
    assert sorted(os.listdir(shards)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # no process wrote the whole model
    assert not (tmp_path / "fsdp" / "ckpt.pt").exists()
    consolidate(str(tmp_path / "fsdp"))
    ddp, fsdp = load_checkpoint(str(tmp_path / "ddp")), load_checkpoint(str(tmp_path / "fsdp"))
    assert ddp["iter_num"] == fsdp["iter_num"] == 3
    assert_same_weights(fsdp["model"], ddp["model"], atol=1e-5)


def test_a_sharded_checkpoint_resumes_exactly_and_consolidates_for_the_sampler(tmp_path, qa_file,
                                                                               capsys):
    flags = {name: tiny_run_flags(tmp_path, qa_file, name) + STEPS + ["--fsdp=True"]
             for name in ("straight", "resumed")}
    logs = {name: tmp_path / f"{name}.log" for name in ("straight", "first", "second")}
    train_two_processes((flags["straight"] + ["--max_iters=6"], logs["straight"]),
                        (flags["resumed"] + ["--max_iters=3"], logs["first"]),
                        (flags["resumed"] + ["--max_iters=6", "--init_from=resume"],
                         logs["second"]))
    losses = {name: val_losses(log) for name, log in logs.items()}
    # validation at iterations 0, 2, 4 and 5
    assert losses["straight"] == losses["first"] | losses["second"]
    assert sorted(losses["second"]) == [4, 5]
    with pytest.raises(ValueError,
                       match="ckpt_sharded.pt already exists: continue it with --init_from=resume"):
        train.main(tiny_run_flags(tmp_path, qa_file, "resumed"))
    for run in ("straight", "resumed"):
        consolidate(str(tmp_path / run))
    straight, resumed = load_checkpoint(str(tmp_path / "straight")), \
        load_checkpoint(str(tmp_path / "resumed"))
    assert straight["iter_num"] == resumed["iter_num"] == 6 and "optimizer" not in resumed
    assert_same_weights(resumed["model"], straight["model"], atol=0)

    capsys.readouterr()
    sampler.main([f"--out_dir={tmp_path / 'resumed'}", "--json", "--num_samples=1",
                  "--max_new_tokens=8", "--slot_size=4", "--serial_num_blocks=1"])
    assert json.loads(capsys.readouterr().out)["tokens"] > 0

    out = f"--out_dir={tmp_path / 'resumed'}"
    with pytest.raises(ValueError, match="--fsdp=False differs from the checkpoint, which was "
                       "written sharded; a resumed run keeps .* sharding: drop the flag"):
        train.main([out, "--init_from=resume", "--max_iters=8", "--fsdp=False"])
    # without torchrun: said plainly, with no flag to drop (--fsdp=True came from the checkpoint)
    with pytest.raises(ValueError) as refused:
        train.main([out, "--init_from=resume", "--max_iters=8"])
    assert re.match(r"the run in .*resumed was sharded \(--fsdp=True, its checkpoint "
                    r".*ckpt_sharded\.pt\): resume it under torchrun, `torchrun --standalone "
                    r"--nproc_per_node=N train\.py --init_from=resume --out_dir=.*` \(--fsdp=True "
                    r"comes from the checkpoint\), or consolidate it \(`python -m "
                    r"tools\.consolidate --out_dir=.*`\) and start a new run from its weights",
                    str(refused.value)) and "drop" not in str(refused.value)
    # only the consolidated copy is left
    os.remove(tmp_path / "resumed" / "ckpt_sharded.pt")
    with pytest.raises(ValueError,
                       match="holds weights only .* start a new run from it with --init_from="):
        train.main([out, "--init_from=resume", "--max_iters=8"])


def test_fsdp_is_refused_without_torchrun_before_anything_is_prepared(tmp_path, qa_file):
    with pytest.raises(ValueError,
                       match="--fsdp=True shards the model over the processes torchrun starts"):
        train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--fsdp=True"])
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()


@pytest.fixture
def one_process_group(tmp_path):
    """A process group of this process alone (gloo), enough for fully_shard and
    torch.distributed.checkpoint."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def _adamw_step(model, optimizer, seed):
    """One AdamW step on a random batch (the gradients are kept)."""
    idx = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(seed))
    optimizer.zero_grad(set_to_none=True)
    model(idx, torch.arange(16).expand(2, 16)).logsumexp(-1).mean().backward()
    optimizer.step()


def test_a_crash_mid_save_leaves_the_previous_sharded_checkpoint(tmp_path, one_process_group,
                                                                 monkeypatch):
    out = str(tmp_path / "run")
    model = shard_model(tiny_model(seed=1).train(), "cpu", bf16=False)
    optimizer = make_optimizer(train.DEFAULTS, model)
    info = {"model_args": asdict(model.config), "config": dict(train.DEFAULTS), "meta": BYTES_META,
            "data_dir": "", "best_val_loss": 1.0}
    _adamw_step(model, optimizer, seed=0)
    save_sharded(out, model, optimizer, dict(info, iter_num=1))
    saved = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
    _adamw_step(model, optimizer, seed=1)

    def crash(state_dict, checkpoint_id):                              # the disk fills up mid-write
        os.makedirs(checkpoint_id)
        open(os.path.join(checkpoint_id, "__0_0.distcp"), "wb").write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(shard.dcp, "save", crash)
        with pytest.raises(ValueError, match=r"^no space left on /\S* to write \S+ckpt_sharded.pt; "
                                             "the previous sharded checkpoint is kept: free some "
                                             "space there and run again$"):
            save_sharded(out, model, optimizer, dict(info, iter_num=2))
    assert load_sharded_info(out)["iter_num"] == 1
    # the incomplete shards are removed
    assert sorted(os.listdir(out)) == ["ckpt_sharded.pt", "ckpt_sharded_a"]
    fresh = shard_model(tiny_model(seed=2).train(), "cpu", bf16=False)
    fresh_optimizer = make_optimizer(train.DEFAULTS, fresh)
    load_sharded(load_sharded_info(out)["shards"], fresh, fresh_optimizer)
    for name, p in fresh.named_parameters():
        torch.testing.assert_close(p.full_tensor(), saved[name], atol=0, rtol=0)
    assert all(s["step"] == 1 for s in fresh_optimizer.state.values())

    save_sharded(out, model, optimizer, dict(info, iter_num=2))
    assert load_sharded_info(out)["iter_num"] == 2
    # the previous one is deleted
    assert sorted(os.listdir(out)) == ["ckpt_sharded.pt", "ckpt_sharded_b"]
    for name, p in load_checkpoint(consolidate(out))["model"].items():
        torch.testing.assert_close(p, model.get_parameter(name).full_tensor(), atol=0, rtol=0)


def test_activation_checkpointing_keeps_less_for_backward_and_changes_no_gradient():
    idx = torch.randint(0, 40, (3, 32), generator=torch.Generator().manual_seed(0))

    def train_step(checkpointed):
        model = tiny_model(seed=6).train()
        if checkpointed:
            checkpoint_layers(model)
        # bytes autograd keeps for backward
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t,
                                                      lambda t: t):
            loss = model(idx, torch.arange(32).expand(3, 32)).logsumexp(-1).mean()
        loss.backward()
        return sum(saved), {name: p.grad for name, p in model.named_parameters()}

    (plain_bytes, plain), (checkpointed_bytes, checkpointed) = train_step(False), train_step(True)
    assert checkpointed_bytes < plain_bytes / 2
    assert_same_weights(checkpointed, plain, atol=0)


def _shard_worker(rank, port, out):
    """Rank `rank` of 2: shard a tiny model with bf16 compute, take one AdamW step, and save what it
    holds."""
    _join_as(rank, port)
    dist.init_process_group("gloo")
    model = tiny_model(seed=3).train()
    idx = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(rank))
    position_ids = torch.arange(16).expand(2, 16)
    float32_loss = model(idx, position_ids).logsumexp(-1).mean().item()
    counts = (model.num_params(), flops_per_token(model, 16))
    shard_model(model, "cpu", bf16=True)
    compute_dtypes = []
    model.layers[0].mlp.register_forward_pre_hook(
        lambda m, args: compute_dtypes.append(m.up_proj.weight.dtype))
    optimizer = make_optimizer(train.DEFAULTS, model)
    loss = model(idx, position_ids).logsumexp(-1).mean()
    loss.backward()
    optimizer.step()
    held = [t.to_local() for p in model.parameters()
            for t in (p, p.grad, optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"])]
    torch.save(dict(counts=counts, sharded_counts=(model.num_params(), flops_per_token(model, 16)),
                    held_bytes=sum(t.nbytes for t in held), held_dtypes={t.dtype for t in held},
                    compute_dtypes=compute_dtypes, loss=loss.item(), float32_loss=float32_loss),
               out / f"{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_step(tmp_path_factory):
    """What each of 2 processes holds after one sharded AdamW step on tiny_model(seed=3): a list of
    2 dicts."""
    out = tmp_path_factory.mktemp("sharded_step")
    torch.multiprocessing.spawn(_shard_worker, args=(_free_port(), out), nprocs=2)
    return [torch.load(out / f"{rank}.pt", weights_only=True) for rank in range(2)]


def test_each_process_holds_its_share_of_the_memory_the_function_states(sharded_step):
    model = tiny_model(seed=3).train()
    n = model.num_params()
    optimizer = make_optimizer(train.DEFAULTS, model)
    _adamw_step(model, optimizer, seed=0)
    held = [t for p in model.parameters()
            for t in (p, p.grad, optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"])]
    # DDP: all of it on every GPU
    assert sum(t.nbytes for t in held) == training_memory(n) == 16 * n
    for rank in sharded_step:                                           # FSDP over 2: half each
        assert rank["held_bytes"] == training_memory(n, world=2, fsdp=True) == 8 * n
    assert training_memory(n, world=2, fsdp=True, gathered=max(unit_sizes(model))) > 8 * n
    assert sum(unit_sizes(model)) == n


def test_a_sharded_model_counts_its_full_size_and_computes_in_bf16(sharded_step):
    for rank in sharded_step:
        # num_params, flops_per_token
        assert rank["sharded_counts"] == rank["counts"]
        # the gathered weights, in the forward
        assert rank["compute_dtypes"] == [torch.bfloat16]
        # shards, gradients, AdamW state
        assert rank["held_dtypes"] == {torch.float32}
        assert rank["loss"] != rank["float32_loss"]
        assert abs(rank["loss"] - rank["float32_loss"]) < 0.01 * rank["float32_loss"]


def test_the_training_guides_memory_table_is_computed_from_the_models_shapes():
    """docs/training.md's table is memory_table()'s output, from parameter counts that match the
    ones Qwen publishes for its models (total, and without the embedding matrices)."""
    assert memory_table() in (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    for name, total, non_embedding in [("Qwen3-0.6B", 0.6, 0.44), ("Qwen3-8B", 8.2, 6.95)]:
        shape = shard.QWEN3_SHAPES[name]
        with torch.device("meta"):
            model = Transformer(ModelConfig(**shape))
        n = model.num_params()
        embeddings = shape["vocab_size"] * shape["n_embd"] * (1 if shape["tie_embeddings"] else 2)
        assert (round(n / 1e9, 1), round((n - embeddings) / 1e9, 2)) == (total, non_embedding)


class Payload:
    """Unpickled, it creates the file `marker`: the code a crafted checkpoint would run."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_crafted_sharded_checkpoint_runs_no_code_and_is_refused(tmp_path, one_process_group):
    """torch.distributed.checkpoint unpickles a checkpoint's index (.metadata) and the values stored
    beside its tensors with plain pickle; consolidation (tools.consolidate) and an FSDP resume
    (load_sharded) refuse either when it would construct anything else than plain data, and nothing
    in it runs."""
    marker = str(tmp_path / "code-ran")
    out = str(tmp_path / "run")
    model = shard_model(tiny_model(seed=1).train(), "cpu", bf16=False)
    optimizer = make_optimizer(train.DEFAULTS, model)
    _adamw_step(model, optimizer, seed=0)
    info = {"model_args": asdict(model.config), "config": dict(train.DEFAULTS), "meta": BYTES_META,
            "data_dir": "", "best_val_loss": 1.0, "iter_num": 1}
    save_sharded(out, model, optimizer, info)
    shards = load_sharded_info(out)["shards"]
    # a value beside the tensors: a learning rate
    model_state, optimizer_state = get_state_dict(model, optimizer)
    optimizer_state["param_groups"][0]["lr"] = Payload(marker)
    shutil.rmtree(shards)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=shards)
    with pytest.raises(ValueError, match=r"value optimizer.param_groups.\S*lr is not plain data "
                                         r".*nothing in it ran"):
        load_sharded(shards, model, make_optimizer(train.DEFAULTS, model))
    with open(os.path.join(shards, ".metadata"), "wb") as f:            # the index itself
        pickle.dump(Payload(marker), f)
    for load in (lambda: consolidate_cli.main([f"--out_dir={out}"]),
                 lambda: load_sharded(shards, model, optimizer)):
        with pytest.raises(ValueError, match=r"\.metadata is not a sharded checkpoint's index "
                                             r"\(UnpicklingError: it names io.open, which a "
                                             r"checkpoint.s index never holds.*nothing in it ran"):
            load()
    assert not os.path.exists(marker)
    torch.save(dict(torch.load(sharded_info_path(out), weights_only=True), shards=".."),
               sharded_info_path(out))
    with pytest.raises(ValueError, match=r"names the shards '\.\.', not one of "
                                         r"ckpt_sharded_a, ckpt_sharded_b"):
        # the next save would delete what it names
        load_sharded_info(out)


def test_the_sharded_info_file_never_follows_a_symlink_at_its_old_temp_name(tmp_path,
                                                                            one_process_group):
    out = tmp_path / "run"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.symlink(victim, out / "ckpt_sharded.pt.tmp")
    model = shard_model(tiny_model(seed=1).train(), "cpu", bf16=False)
    optimizer = make_optimizer(train.DEFAULTS, model)
    save_sharded(str(out), model, optimizer, {"model_args": asdict(model.config), "iter_num": 0})
    assert victim.read_text() == "precious" and load_sharded_info(str(out))["iter_num"] == 0
    assert sorted(os.listdir(out)) == ["ckpt_sharded.pt", "ckpt_sharded.pt.tmp", "ckpt_sharded_a"]


# in a child process that may write no file past argv[2] bytes (`ulimit -f`): a sharded save into
# the run argv[1], then its consolidation; each prints its message
SAVES_PAST_THE_LIMIT = """
import os, resource, signal, sys
import torch.distributed as dist
from dataclasses import asdict
import train
from helpers import tiny_model
from support.files import DiskFull
from support.shard import consolidate, save_sharded, shard_model
out, limit = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{out}-rendezvous", rank=0, world_size=1)
model = shard_model(tiny_model(seed=1).train(), "cpu", bf16=False)
optimizer = train.make_optimizer(train.DEFAULTS, model)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
saves = [lambda: save_sharded(out, model, optimizer, {"iter_num": 2}), lambda: consolidate(out)]
for save in saves:
    try:
        save()
        print("written")
    except DiskFull as e:
        print(e)
dist.destroy_process_group()
"""


def test_a_sharded_save_or_a_consolidation_past_the_file_size_limit_keeps_the_previous_one(
        tmp_path, one_process_group):
    """`ulimit -f` reached by a sharded save (torch.distributed.checkpoint's writers) or by
    tools.consolidate: the one message of every save that found no room
    (support.files.raise_if_disk_full), and the previous sharded checkpoint and ckpt.pt kept."""
    out = tmp_path / "run"
    model = shard_model(tiny_model(seed=1).train(), "cpu", bf16=False)
    optimizer = make_optimizer(train.DEFAULTS, model)
    _adamw_step(model, optimizer, seed=0)
    save_sharded(str(out), model, optimizer, {"model_args": asdict(model.config), "iter_num": 1,
                                              "config": dict(train.DEFAULTS), "meta": BYTES_META})
    consolidate(str(out))
    before = (out / "ckpt.pt").read_bytes()
    limit = 4096
    done = subprocess.run([sys.executable, "-c", SAVES_PAST_THE_LIMIT, str(out), str(limit)],
                          cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}",
                                   OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr
    over = f"went over the file size limit of {limit} bytes (`ulimit -f`)"
    fix = "raise the limit (`ulimit -f unlimited`) and run again"
    assert done.stdout.splitlines() == [
        f"writing {out / 'ckpt_sharded.pt'} {over}; the previous sharded checkpoint is kept: {fix}",
        f"writing {out / 'ckpt.pt'} {over}; the previous checkpoint is kept: {fix}"]
    assert load_sharded_info(str(out))["iter_num"] == 1 and (out / "ckpt.pt").read_bytes() == before
    assert sorted(os.listdir(out)) == ["ckpt.pt", "ckpt_sharded.pt", "ckpt_sharded_a"]


@pytest.mark.parametrize("make, said", NOT_FILES.values(), ids=NOT_FILES)
def test_a_sharded_checkpoint_s_file_that_is_no_file_is_named_not_called_missing(
        tmp_path, one_process_group, make, said):
    """ckpt_sharded.pt or its shards' index (.metadata) that is a directory, a FIFO or a link to
    /dev/zero: a resume, a consolidation and load_sharded name what is there (ckpt_sharded.pt was
    "no sharded checkpoint", .metadata "not found: incomplete"), never opening it."""
    out = tmp_path / "run"
    model = shard_model(tiny_model(seed=1).train(), "cpu", bf16=False)
    optimizer = make_optimizer(train.DEFAULTS, model)
    save_sharded(str(out), model, optimizer, {"model_args": asdict(model.config), "iter_num": 1,
                                              "config": dict(train.DEFAULTS), "meta": BYTES_META})
    shards = load_sharded_info(str(out))["shards"]
    index = os.path.join(shards, ".metadata")
    os.remove(index)
    make(Path(index))
    message = f"{re.escape(index)} {said}, not a regular file; train.py writes regular files here"
    with never_blocks():
        with pytest.raises(ValueError, match=message):
            load_sharded(shards, model, optimizer)
        with pytest.raises(ValueError, match=message):
            consolidate_cli.main([f"--out_dir={out}"])
        info = sharded_info_path(str(out))
        os.remove(info)
        make(Path(info))
        message = f"{re.escape(info)} {said}, not a regular file; train.py writes regular files"
        with pytest.raises(ValueError, match=message):
            consolidate_cli.main([f"--out_dir={out}"])
        with pytest.raises(SystemExit, match="error: " + message):
            run_cli(train.main, [f"--out_dir={out}", "--init_from=resume"])
