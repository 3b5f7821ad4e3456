"""Checkpoints that never run code and never lose a run (support/checkpoint.py)."""

import errno
import io
import os
import pickle
import re
import resource
import signal
import stat
import subprocess
import sys
import tempfile
from dataclasses import asdict

import pytest
import torch

import sampler
import train
from helpers import NOT_FILES, ROOT, never_blocks, tiny_model, tiny_run_flags, write
from support.checkpoint import load_checkpoint, save_checkpoint
from support.files import DiskFull, no_room, temporary_prefix, write_atomic
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
def test_a_ckpt_pt_that_is_no_file_is_named_not_called_missing(tmp_path, qa_file, make, said):
    """A directory, a FIFO or a link to /dev/zero where ckpt.pt should be, given by its out_dir or
    by itself, to the sampler's --out_dir or --init_from or to train.py's --init_from, is refused
    naming what is there and the fix (it was "no checkpoint at ...: train one first", or a folder
    without config.json), and never opened: a FIFO would block."""
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
        for flag in ("--out_dir", "--init_from"):
            with pytest.raises(SystemExit, match="error: " + message):
                run_cli(sampler.main, [f"{flag}={run}", "--prompt=hi"])
        with pytest.raises(SystemExit, match="error: " + message):
            run_cli(train.main, tiny_run_flags(tmp_path, qa_file, "ft") + [f"--init_from={run}"])
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


def test_a_symlink_another_user_planted_in_a_shared_directory_is_never_followed(tmp_path,
                                                                               monkeypatch):
    """In a sticky world-writable directory (/tmp), a symlink another user made at the checkpoint's
    path is not written through, as the kernel's protected_symlinks would not follow it (here that
    setting may be off): the file it points to is untouched and the link is replaced by the
    checkpoint, a regular file. A link planted at the temp file's name is skipped (O_EXCL |
    O_NOFOLLOW). Where this user may not replace the link, the save is refused naming it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    victim = write(tmp_path, "victim.txt", "precious")
    planted = shared / "ckpt.pt"
    os.symlink(victim, planted)
    os.symlink(victim, shared / ".ckpt.pt.planted1.tmp")
    # the links are another user's
    real_lstat = os.lstat

    def lstat(path, *args, **kwargs):
        found = real_lstat(path, *args, **kwargs)
        if os.fspath(path) in (str(planted), str(shared / ".ckpt.pt.planted1.tmp")):
            return os.stat_result(tuple(found)[:4] + (os.getuid() + 1,) + tuple(found)[5:])
        return found
    monkeypatch.setattr(os, "lstat", lstat)
    # the first name mkstemp tries is the planted one (tempfile's own sequence of names)
    monkeypatch.setattr(tempfile, "_get_candidate_names", lambda: iter(["planted1", "fresh123"]))
    save_checkpoint(str(shared), tiny_checkpoint())
    assert open(victim).read() == "precious"
    assert not os.path.islink(planted) and load_checkpoint(str(shared))["iter_num"] == 0
    assert os.readlink(shared / ".ckpt.pt.planted1.tmp") == victim
    assert sorted(os.listdir(shared)) == [".ckpt.pt.planted1.tmp", "ckpt.pt"]
    # a user who neither owns /tmp nor is root may not replace the link: refused, nothing written
    os.remove(planted)
    os.symlink(victim, planted)
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 2)
    with pytest.raises(ValueError, match=rf"{re.escape(str(planted))} is a symlink that another "
                                         r"user \(uid \d+\) made in the shared directory \S+: it "
                                         "is not followed, and this user may not replace it"):
        save_checkpoint(str(shared), tiny_checkpoint())
    assert open(victim).read() == "precious"


def test_the_temp_files_of_a_save_killed_mid_write_go_when_the_next_run_holds_out_dir(
        tmp_path, qa_file, capsys):
    """A run killed outright (kill -9) while it saved leaves its temp file; the next run into that
    out_dir removes it once it holds the lock, and only the temp files of the project's own
    names there (a link at such a name goes, its target stays). A preparation's, the next
    preparation of that data."""
    flags = tiny_run_flags(tmp_path, qa_file, "run")
    train.main(flags + ["--max_iters=2"])
    out = tmp_path / "run"
    # as write_atomic names them
    left = [tempfile.mkstemp(dir=out, prefix=temporary_prefix(name), suffix=".tmp")
            for name in ("ckpt.pt", "ckpt_sharded.pt", ".lock.holder")]
    for fd, _ in left:
        os.close(fd)
    victim = write(tmp_path, "victim.txt", "precious")
    os.symlink(victim, out / ".ckpt.pt.k1lled_9.tmp")
    others = [".ckpt.pt.tmp", "ckpt.pt.abcdefgh.tmp", ".ckpt.pt.TOOLONG12.tmp", "notes.tmp"]
    for name in others:
        write(out, name, "not ours")
    # and a preparation killed mid-write: a split's temp file, no meta.json yet
    data_dir = next((tmp_path / "data").iterdir())
    os.remove(data_dir / "meta.json")
    fd, _ = tempfile.mkstemp(dir=data_dir, prefix=temporary_prefix("train.bin"), suffix=".tmp")
    os.close(fd)
    train.main(flags + ["--init_from=resume", "--max_iters=4"])
    assert sorted(os.listdir(out)) == sorted([".lock", "ckpt.pt"] + others)
    assert open(victim).read() == "precious"
    assert not [name for name in os.listdir(data_dir) if name.endswith(".tmp")]
    assert re.search(r"note: removed \.\.lock\.holder\.\w{8}\.tmp, \.ckpt\.pt\.\w{8}\.tmp, "
                     r"\.ckpt\.pt\.\w{8}\.tmp, \.ckpt_sharded\.pt\.\w{8}\.tmp from \S+run, left by "
                     "a run killed while it saved", capsys.readouterr().err)


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


class FillsUp(io.FileIO):
    """A file on a disk that fills up after its first 1000 bytes (ENOSPC)."""

    def write(self, data):
        if self.tell() + len(data) > 1000:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(data)


def test_a_full_disk_keeps_the_previous_checkpoint_and_no_temp_file(tmp_path, monkeypatch):
    """torch.save's own words for a full disk ("unexpected pos", over the file's ENOSPC) become the
    one message of every save (support.files.raise_if_disk_full); the previous checkpoint is kept
    and no temp file is left."""
    save_checkpoint(str(tmp_path), tiny_checkpoint())
    before = (tmp_path / "ckpt.pt").read_bytes()
    monkeypatch.setattr(os, "fdopen", lambda fd, mode: io.BufferedWriter(FillsUp(fd, "wb")))
    path = re.escape(str(tmp_path / "ckpt.pt"))
    with pytest.raises(DiskFull, match=rf"^no space left on /\S* to write {path}; the previous "
                                       "checkpoint is kept: free some space there and run again$"):
        save_checkpoint(str(tmp_path), dict(tiny_checkpoint(), iter_num=5))
    assert (tmp_path / "ckpt.pt").read_bytes() == before and os.listdir(tmp_path) == ["ckpt.pt"]
    with pytest.raises(DiskFull, match=r"to write \S+new/ckpt.pt; nothing was written"):
        save_checkpoint(str(tmp_path / "new"), tiny_checkpoint())
    assert os.listdir(tmp_path / "new") == []


def under_file_size_limit(limit):
    """For subprocess's preexec_fn: the child may write no file past `limit` bytes (`ulimit -f`),
    and a write past it fails with EFBIG instead of ending the process (SIGXFSZ ignored)."""
    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return limited


def test_a_training_save_over_the_file_size_limit_keeps_the_previous_checkpoint(tmp_path,
                                                                                qa_file):
    """`ulimit -f` reached while train.py saves: the one message of a save that found no room,
    not torch's "unexpected pos"; the previous checkpoint is kept, no temp file is left, and the
    run resumes from it once the limit is raised."""
    flags = tiny_run_flags(tmp_path, qa_file, "run")
    train.main(flags + ["--max_iters=2"])
    ckpt = tmp_path / "run" / "ckpt.pt"
    before = ckpt.read_bytes()
    limit = len(before) // 2
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *flags, "--init_from=resume",
                           "--max_iters=4"], capture_output=True, text=True,
                          preexec_fn=under_file_size_limit(limit),
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        f"error: writing {ckpt} went over the file size limit of {limit} bytes (`ulimit -f`); "
        "the previous checkpoint is kept: raise the limit (`ulimit -f unlimited`) and run again")
    assert ckpt.read_bytes() == before and sorted(os.listdir(ckpt.parent)) == [".lock", "ckpt.pt"]
    train.main(flags + ["--init_from=resume", "--max_iters=4"])
    assert load_checkpoint(str(ckpt))["iter_num"] == 4


# Each writer the project saves with, past a file size limit of LIMIT bytes, in a child process:
# the message it ends with, or "written" (support.files.raise_if_disk_full)
LIMIT = 4096
WRITERS = """
import json, os, sys
import numpy as np, torch
from safetensors.numpy import save_file
from support.drawing import pyplot
from support.files import DiskFull, raise_if_disk_full, write_atomic
out = sys.argv[1]
weights = np.zeros(4096, dtype=np.float32)
plt = pyplot()
figure = plt.figure(figsize=(8, 8))
plt.imshow(np.random.default_rng(0).random((400, 400)))
writers = {
    "ckpt.pt": lambda f: torch.save({"w": torch.from_numpy(weights)}, f),
    "train.bin": weights.tofile,
    "train_samples.npy": lambda f: np.save(f, weights),
    "report.json": lambda f: f.write(json.dumps(weights.tolist()).encode()),
    "figure.png": lambda f: figure.savefig(f, format="png"),
}
for name, write in writers.items():
    try:
        write_atomic(os.path.join(out, name), write)
        print("written")
    except DiskFull as e:
        print(e)
try:
    save_file({"w": weights}, os.path.join(out, "model.safetensors"))
    print("written")
except Exception as e:
    try:
        raise_if_disk_full(e, os.path.join(out, "model.safetensors"))
    except DiskFull as e:
        print(e)
"""


def test_every_writer_past_the_file_size_limit_gives_the_one_message(tmp_path):
    """torch.save, numpy's tofile and save, a JSON report, a matplotlib PNG and safetensors (the
    converted folder) each say in their own words that a file went past `ulimit -f` (torch:
    "unexpected pos"; numpy: "N requested and M written", no errno): each becomes the one
    message, and no temp file is left. Their words for a full disk (ENOSPC, measured on a full
    tmpfs and ext4) are known too."""
    from safetensors import SafetensorError
    done = subprocess.run([sys.executable, "-c", WRITERS, str(tmp_path)], cwd=ROOT, text=True,
                          capture_output=True, preexec_fn=under_file_size_limit(LIMIT),
                          env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr
    names = ["ckpt.pt", "train.bin", "train_samples.npy", "report.json", "figure.png",
             "model.safetensors"]
    assert done.stdout.splitlines() == [
        f"writing {tmp_path / name} went over the file size limit of {LIMIT} bytes (`ulimit -f`); "
        "nothing was written: raise the limit (`ulimit -f unlimited`) and run again"
        for name in names]
    assert os.listdir(tmp_path) in ([], ["model.safetensors"])  # safetensors writes in place
    for words in (OSError("Not enough free space to write 40000000 bytes after offset 0"),
                  SafetensorError("Error while serializing: I/O error: No space left on device "
                                  "(os error 28)")):
        assert no_room(words) == errno.ENOSPC
    assert no_room(OSError("Input/output error")) is None


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
