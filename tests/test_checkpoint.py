"""Checkpoints that never run code and never lose a run (support/checkpoint.py)."""

import errno
import os
import pickle
import re
import stat
from dataclasses import asdict

import pytest
import torch

import sampler
import train
from helpers import NOT_FILES, never_blocks, tiny_model, tiny_run_flags, write
from support import checkpoint
from support.checkpoint import load_checkpoint, save_checkpoint
from support.files import DiskFull, write_atomic
from support.prepare import prepare



def test_bad_checkpoints_are_refused_and_never_run_code(tmp_path, qa_file):
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*ckpt.pt: train one first"):
        load_checkpoint(str(tmp_path / "missing"))
    train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=2"])
    good = (tmp_path / "run" / "ckpt.pt").read_bytes()
    marker = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    cases = {"garbage.pt": b"not a checkpoint at all", "truncated.pt": good[:len(good) // 2],
             "empty.pt": b"",
             "crafted.pt": pickle.dumps({"model": Payload(), "model_args": {}}, protocol=2)}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match="is not a readable checkpoint .*retrain it or point "
                                             "to another file"):
            load_checkpoint(str(tmp_path / name))
    # the crafted file's code never ran
    assert not marker.exists()
    old = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)
    old["format"] = 0
    torch.save(old, tmp_path / "old.pt")
    with pytest.raises(ValueError,
                       match="has checkpoint format 0, this code reads format 1; retrain"):
        load_checkpoint(str(tmp_path / "old.pt"))
    torch.save({"weights": torch.zeros(2)}, tmp_path / "foreign.pt")
    with pytest.raises(ValueError, match="not a checkpoint written by train.py"):
        load_checkpoint(str(tmp_path / "foreign.pt"))
    assert (tmp_path / "run" / "ckpt.pt").read_bytes() == good


@pytest.mark.parametrize("make, said", NOT_FILES.values(), ids=NOT_FILES)
def test_a_ckpt_pt_that_is_no_file_is_named_not_called_missing(tmp_path, make, said):
    """A directory, a FIFO or a link to /dev/zero where ckpt.pt should be, given by its out_dir or
    by itself, is refused naming what is there and the fix (it was "no checkpoint at ...: train
    one first"), and never opened: a FIFO would block."""
    from configurator import run_cli
    run = tmp_path / "run"
    run.mkdir()
    make(run / "ckpt.pt")
    message = (f"{re.escape(str(run / 'ckpt.pt'))} {said}, not a regular file; a checkpoint is "
               "the file ckpt.pt that train.py writes: move this away")
    with never_blocks():
        for given in (run, run / "ckpt.pt"):
            with pytest.raises(ValueError, match=message):
                load_checkpoint(str(given))
        with pytest.raises(SystemExit, match="error: " + message):
            run_cli(sampler.main, [f"--out_dir={run}", "--prompt=hi"])
        with pytest.raises(ValueError, match="/dev/zero is a character device, not a regular"):
            load_checkpoint("/dev/zero")


def tiny_checkpoint():
    """A checkpoint dict as train.py writes it, of tiny_model() with the byte tokenizer's ids."""
    model = tiny_model()
    return {"model": model.state_dict(), "model_args": asdict(model.config),
            "config": dict(train.DEFAULTS),
            "meta": {"tokenizer": "bytes", "eos_id": 39, "mask_id": 38, "pad_id": 37},
            "iter_num": 0, "best_val_loss": 1.0}


def test_an_inconsistent_checkpoint_is_refused_naming_the_file(tmp_path):
    """model_args with a key ModelConfig does not know or without one train.py always writes (a
    missing `causal` would silently decode an MDM as causal), weights another shape than model_args
    build, a meta without its tokenizer: refused with the file named, before any model is built."""
    good = tiny_checkpoint()
    save_checkpoint(str(tmp_path / "good"), good)
    assert load_checkpoint(str(tmp_path / "good"))["model_args"] == good["model_args"]
    args, meta = good["model_args"], good["meta"]
    cases = {
        "extra-arg": (dict(good, model_args=dict(args, n_experts=8)),
                      r"model_args has unknown keys \['n_experts'\]"),
        "missing-arg": (dict(good, model_args={k: v for k, v in args.items() if k != "causal"}),
                        r"model_args lacks \['causal'\]"),
        "bad-arg": (dict(good, model_args=dict(args, n_head=3)), "model_args do not make a model"),
        "wrong-shape": (dict(good, model_args=dict(args, n_embd=64, head_dim=16)),
                        r"the weights do not fit its model_args \(\d+ tensors differ; "
                        r"embed_tokens.weight: \(40, 32\) in the file, \(40, 64\) "
                        r"from model_args\)"),
        "no-tokenizer": (dict(good, meta={k: v for k, v in meta.items() if k != "tokenizer"}),
                         "its meta lacks tokenizer"),
        "no-objective": (dict(good, config={"max_iters": 2}), "its config lacks the objective"),
    }
    for name, (ckpt, message) in cases.items():
        save_checkpoint(str(tmp_path / name), ckpt)
        path = re.escape(str(tmp_path / name / "ckpt.pt"))
        with pytest.raises(ValueError, match=rf"{path} is inconsistent: {message}.*retrain it"):
            load_checkpoint(str(tmp_path / name))
    with pytest.raises(ValueError, match="is inconsistent: its meta lacks tokenizer"):
        # an error line, no KeyError
        sampler.main([f"--out_dir={tmp_path / 'no-tokenizer'}", "--prompt=x"])


def test_a_symlink_at_the_old_temp_name_is_never_followed(tmp_path, monkeypatch):
    """The temp file of an atomic save is created exclusively, under a new unpredictable name in the
    destination directory: a symlink planted at the fixed name out/ckpt.pt.tmp is not written
    through."""
    out = tmp_path / "out"
    out.mkdir()
    victim = write(tmp_path, "victim.txt", "precious")
    os.symlink(victim, out / "ckpt.pt.tmp")
    renamed = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace",
                        lambda src, dst: renamed.append(src) or real_replace(src, dst))
    for _ in range(2):
        save_checkpoint(str(out), tiny_checkpoint())
    assert open(victim).read() == "precious"
    assert load_checkpoint(str(out))["iter_num"] == 0
    assert [os.path.dirname(t) for t in renamed] == [str(out)] * 2 and renamed[0] != renamed[1]
    # the planted link, untouched
    assert sorted(os.listdir(out)) == ["ckpt.pt", "ckpt.pt.tmp"]


def test_a_symlinked_checkpoint_is_written_through_and_the_link_kept(tmp_path, qa_file):
    """A ckpt.pt that links to a file elsewhere (a bigger disk): resuming writes the new weights
    into that file, in its own directory, and leaves the link as it was; a chain of links too."""
    flags = tiny_run_flags(tmp_path, qa_file, "run")
    train.main(flags + ["--max_iters=2"])
    store = tmp_path / "store"
    store.mkdir()
    os.replace(tmp_path / "run" / "ckpt.pt", store / "weights.pt")
    os.symlink("../store/weights.pt", tmp_path / "run" / "ckpt.pt")
    train.main(flags + ["--init_from=resume", "--max_iters=4"])
    assert os.readlink(tmp_path / "run" / "ckpt.pt") == "../store/weights.pt"
    assert load_checkpoint(str(store / "weights.pt"))["iter_num"] == 4
    assert os.listdir(store) == ["weights.pt"]
    os.symlink(tmp_path / "run" / "ckpt.pt", tmp_path / "chain.pt")
    write_atomic(str(tmp_path / "chain.pt"), lambda f: f.write(b"through two links"))
    assert (store / "weights.pt").read_bytes() == b"through two links"
    assert os.path.islink(tmp_path / "chain.pt") and os.path.islink(tmp_path / "run" / "ckpt.pt")
    os.symlink(tmp_path / "gone" / "ckpt.pt", tmp_path / "dangling.pt")
    with pytest.raises(FileNotFoundError, match=r"dangling.pt is a symlink to \S+gone/ckpt.pt, "
                                                "whose directory does not exist"):
        write_atomic(str(tmp_path / "dangling.pt"), lambda f: f.write(b"x"))
    # a new run whose ckpt.pt links into a missing directory stops before it trains, and a resume
    # through a link whose file is gone says so instead of offering to train anew
    (tmp_path / "new").mkdir()
    os.symlink(tmp_path / "unmounted" / "ckpt.pt", tmp_path / "new" / "ckpt.pt")
    os.remove(tmp_path / "run" / "ckpt.pt")
    os.symlink(store / "moved.pt", tmp_path / "run" / "ckpt.pt")
    for out, init, message in [
            ("new", [], r"new/ckpt.pt is a symlink to \S+unmounted/ckpt.pt, whose directory does "
                        "not exist .*nothing was trained"),
            ("run", ["--init_from=resume"], r"run/ckpt.pt is a symlink to \S+store/moved.pt, "
                                            r"which is not there \(an unmounted disk")]:
        flags = tiny_run_flags(tmp_path, qa_file, out) + ["--max_iters=6"] + init
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            train.main(flags)


def _fail_mid_write(error):
    """A stand-in for torch.save that writes part of the file, then fails with error."""
    def save(obj, f):
        (open(f, "wb") if isinstance(f, (str, os.PathLike)) else f).write(b"partial")
        raise error
    return save


def test_a_full_disk_keeps_the_previous_checkpoint_and_no_temp_file(tmp_path, monkeypatch):
    save_checkpoint(str(tmp_path), tiny_checkpoint())
    before = (tmp_path / "ckpt.pt").read_bytes()
    monkeypatch.setattr(checkpoint.torch, "save",
                        _fail_mid_write(OSError(errno.ENOSPC, "No space left on device")))
    path = re.escape(str(tmp_path / "ckpt.pt"))
    with pytest.raises(DiskFull, match=rf"^no space left on /\S* to write {path}; the previous "
                                       "checkpoint is kept: free some space there and run again$"):
        save_checkpoint(str(tmp_path), dict(tiny_checkpoint(), iter_num=5))
    assert (tmp_path / "ckpt.pt").read_bytes() == before and os.listdir(tmp_path) == ["ckpt.pt"]
    with pytest.raises(DiskFull, match=r"to write \S+new/ckpt.pt; nothing was written"):
        save_checkpoint(str(tmp_path / "new"), tiny_checkpoint())
    assert os.listdir(tmp_path / "new") == []


def test_an_atomic_save_syncs_the_file_before_the_rename_and_the_directory_after(tmp_path, qa_file,
                                                                                 monkeypatch):
    """So that a power cut never loses a checkpoint (or prepared data) that was reported saved:
    fsync(file), rename, fsync(directory), for every file written."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace",
                        lambda src, dst: events.append("rename") or real_replace(src, dst))
    save_checkpoint(str(tmp_path / "out"), tiny_checkpoint())
    assert events == ["fsync file", "rename", "fsync directory"]
    events.clear()
    # 2 splits x 2 files, then meta.json
    prepare(qa_file[0], "bytes", 64, data_root=str(tmp_path / "data"))
    assert events == ["fsync file", "rename", "fsync directory"] * 5


def test_a_nan_weight_is_refused_at_load_naming_the_file_for_every_source(tmp_path, qa_file):
    """One NaN in one MLP weight makes every logit NaN, and a decode of it writes "\\u0000" over
    and over with normal statistics: a checkpoint (sampler, resume, --init_from) or a Hugging Face
    folder holding one is refused when it is read, naming the file and the weight."""
    from helpers import save_tiny_hf_folder
    from safetensors.torch import load_file, save_file
    train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=2"])
    ckpt = load_checkpoint(str(tmp_path / "run"))
    ckpt["model"]["layers.0.mlp.up_proj.weight"][3, 5] = float("nan")
    save_checkpoint(str(tmp_path / "run"), ckpt)
    message = r"ckpt.pt: the weight layers.0.mlp.up_proj.weight holds 1 NaN or infinite value"
    with pytest.raises(ValueError, match=message):
        sampler.main([f"--out_dir={tmp_path / 'run'}", "--prompt=hi", "--max_new_tokens=4"])
    with pytest.raises(ValueError, match=message):
        train.main([f"--out_dir={tmp_path / 'run'}", "--init_from=resume", "--max_iters=4"])
    with pytest.raises(ValueError, match=message):
        train.main(tiny_run_flags(tmp_path, qa_file, "ft") + [f"--init_from={tmp_path / 'run'}"])
    save_tiny_hf_folder(tmp_path / "folder")
    weights = load_file(tmp_path / "folder" / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][0, 0] = float("inf")
    save_file(weights, tmp_path / "folder" / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors: the weight layers.1.mlp.down_proj"
                                         r".weight holds 1 NaN or infinite"):
        sampler.main([f"--init_from={tmp_path / 'folder'}", "--prompt=hi", "--method=next_token"])


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_a_replaced_file_keeps_its_mode_and_a_new_one_follows_the_umask(tmp_path, umask):
    """write_atomic gives a file it replaces that file's permission bits (a private ckpt.pt stays
    private), and a new file what open() would under the umask."""
    old = os.umask(umask)
    try:
        new = tmp_path / "new.pt"
        write_atomic(str(new), lambda f: f.write(b"new"))
        assert stat.S_IMODE(new.stat().st_mode) == 0o666 & ~umask
        for mode in (0o600, 0o640, 0o444):
            private = tmp_path / f"kept-{mode:o}.pt"
            private.write_bytes(b"old")
            private.chmod(mode)
            write_atomic(str(private), lambda f: f.write(b"replaced"))
            assert stat.S_IMODE(private.stat().st_mode) == mode
            assert private.read_bytes() == b"replaced"
    finally:
        os.umask(old)
