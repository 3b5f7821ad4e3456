"""
Files written whole or not at all, and files from elsewhere: of the kind they must be, read within
bounds and checked.

    write_atomic(path, write)   replace a file atomically: a crash, a power cut or a full disk
                                leaves the previous file or the new one, never a mix
    writable_folder(path)       path, or a temporary folder where path cannot be written
    signals_unwind()            a block that SIGTERM or SIGHUP ends as Ctrl-C does, cleanup first
    check_kind(path, fix)       refuse a directory, a FIFO or a device where a file must be
    read_bounded(path, limit)   a model folder's file, refused unread when larger than any real one
    read_text(path, limit)      the same as UTF-8 text
    read_json(path)             a Hugging Face folder's JSON file, errors naming the file
    expect, is_int, abridged    checks of such a file's fields, and the lists their messages name
"""

import errno
import json
import os
import signal
import stat
import sys
import tempfile
import threading
from contextlib import contextmanager


class DiskFull(ValueError):
    """The disk filled up while a file was written; the file at its path is as it was before."""


def mount_point(path):
    """The mount point of the file system holding path (e.g. "/" or "/data"), for messages."""
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def fsync_directory(directory):
    """Make a rename in directory durable; a file system that cannot sync a directory (EINVAL,
    ENOTSUP: some network and FUSE ones) is left as it is."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def raise_if_disk_full(error, path, what=None):
    """Raise DiskFull, naming the file system and whether the previous `what` (default: path's base
    name) is kept, for an OSError of a full disk or quota (ENOSPC, EDQUOT) while path was written;
    return for any other error."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        kept = f"the previous {what or os.path.basename(path)} is kept" if os.path.exists(path) \
            else "nothing was written"
        raise DiskFull(f"no space left on {mount_point(os.path.dirname(os.path.abspath(path)))} "
                       f"to write {path}; {kept}: free some space there and run again") from None


def file_mode(path):
    """The permission bits of the file at path, or for a new file 0666 less the process's umask (as
    open() gives)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)   # read by setting it; set back at once
        os.umask(umask)
        return 0o666 & ~umask


def write_atomic(path, write, what=None):
    """Replace the file at path with what write(f) writes into a binary file f, atomically: a temp
    file beside it (mkstemp: O_EXCL, an unpredictable name), fsynced, renamed over path, the
    directory fsynced. On any error the temp file is removed and path is as it was. A symlink at
    path is written through (the file it points to replaced, the link kept). what: how a message
    names the file ("checkpoint"; default its base name). Raises DiskFull (a ValueError) when the
    disk is full, FileNotFoundError for a link into a missing directory, and what write raises."""
    if os.path.islink(path):
        link, path = path, os.path.realpath(path)
        if not os.path.isdir(os.path.dirname(path)):
            raise FileNotFoundError(f"{link} is a symlink to {path}, whose directory does not "
                                    "exist; create it, or remove the link to write a file there")
    directory = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.",
                                   suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, file_mode(path))  # mkstemp makes files private (0600)
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            os.unlink(tmp)
        raise_if_disk_full(e, path, what)
        raise
    fsync_directory(directory)


if __name__ == "__main__":  # python support/files.py
    raise SystemExit("error: support/files.py is a module of support/, not a command; the "
                     "commands are train.py, sampler.py and python -m tools.<name> "
                     "(tools/__init__.py lists them)")


_TEMPORARY = []  # the folders writable_folder made, each removed when the process ends


def writable_folder(path, prefix="refusion-"):
    """path (made if missing) where a file can be created in it; else a new temporary folder named
    prefix..., removed when this process ends, with a note on stderr (the course's notebooks)."""
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        return path
    except OSError as e:
        folder = tempfile.TemporaryDirectory(prefix=prefix)
        _TEMPORARY.append(folder)
        print(f"note: {path} cannot be written ({e.strerror}); using {folder.name} instead, "
              "removed when this process ends", file=sys.stderr)
        return folder.name


# the signals whose default action ends a process and that a run may get (SIGTERM: Slurm, `docker
# stop`, torchrun; SIGUSR1/2: schedulers' warnings); SIGPIPE is Python's BrokenPipeError
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1",
                                                        "SIGUSR2", "SIGXCPU", "SIGALRM")
                     if hasattr(signal, name))


class Stopped(BaseException):
    """A stop signal (STOP_SIGNALS) arrived inside signals_unwind's block."""

    def __init__(self, signum):
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


@contextmanager
def signals_unwind():
    """While the block runs, each of STOP_SIGNALS but SIGINT raises Stopped in the main thread, so
    the block's except and finally clauses run; then the signal's default action ends the process
    (exit status 128 + its number). Off the main thread the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Stopped(signum)
    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS if sig != signal.SIGINT}
    try:
        yield
    except Stopped as e:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.signal(e.signum, signal.SIG_DFL)
        os.kill(os.getpid(), e.signum)
        raise SystemExit(128 + e.signum) from None   # a signal whose default ends nothing here
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# -----------------------------------------------------------------------------
# files a user names: of the kind they must be, a model folder's read within bounds and checked

# how messages name what is at a path, by the stat module's test of its mode
KINDS = ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
         (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
         (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def check_kind(path, fix, want=stat.S_ISREG, mode=None):
    """Raise ValueError when something is at path (symlinks followed) that is not of the kind
    `want` (stat.S_ISREG: a regular file; stat.S_ISDIR: a directory): "PATH is a FIFO (named pipe),
    not a regular file; FIX". Nothing there passes: the caller names a missing file. mode: the
    st_mode of an open file, else path is stat'ed, never opened (a FIFO would block)."""
    if mode is None:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return
    if not want(mode):
        kind = next((name for is_kind, name in KINDS if is_kind(mode)), "a special file")
        link = f" (a symlink to {os.path.realpath(path)})" if os.path.islink(path) else ""
        raise ValueError(f"{path}{link} is {kind}, not {dict(KINDS)[want]}; {fix}")


MB = 2**20
# the most bytes read of a model folder's file, far above any real one's: a larger file is refused
# unread (a tokenizer.json of 3 GB was read whole, 3.4 GB, then a MemoryError)
JSON_LIMIT = 16 * MB        # config.json, tokenizer_config.json, a chat template: KB, at most a MB
INDEX_LIMIT = 64 * MB       # model.safetensors.index.json: a few MB for 100k tensors
TOKENIZER_LIMIT = 512 * MB  # tokenizer.json: Qwen3's 11 MB, a 262k-token vocabulary's about 33 MB
DAMAGED = "the file is damaged or not from a Hugging Face model: download it again"
# what to do about a folder's file that is a directory, a FIFO, a device
NOT_A_FILE = "a model folder holds regular files: move this away and download the file again"


def read_bounded(path, limit):
    """The bytes of the regular file at path, at most `limit` of them. Raises ValueError naming the
    file when it is not a regular file (check_kind: a FIFO is never waited on), is larger than limit
    (its size; nothing read) or cannot be read."""
    check_kind(path, NOT_A_FILE)   # a socket, which cannot be opened, named too
    try:
        # O_NONBLOCK: a FIFO put there since the check opens at once, and is refused below
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({e.strerror}); check its permissions") from None
    with open(fd, "rb") as f:
        info = os.fstat(fd)
        check_kind(path, NOT_A_FILE, mode=info.st_mode)
        size = info.st_size
        if size <= limit:
            # a byte past the limit: a file that grew since is refused too
            raw = f.read(limit + 1)
            size = len(raw)
    if size > limit:
        raise ValueError(f"{path} is {size:,} bytes, larger than any real one (this reads at most "
                         f"{limit:,}); {DAMAGED}")
    return raw


def read_text(path, limit=JSON_LIMIT):
    """The text of a model folder's file (UTF-8) of at most `limit` bytes. Raises ValueError naming
    the file when read_bounded refuses it or it is not UTF-8."""
    try:
        return read_bounded(path, limit).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 (byte offset {e.start}); {DAMAGED}") from None


def read_json(path, limit=JSON_LIMIT):
    """The JSON object (a dict) in the file at `path` (config.json, an index, tokenizer_config.json)
    of at most `limit` bytes. Raises ValueError naming the file when read_text refuses it, or it
    starts with a byte order mark, is not JSON, is nested too deep for Python's parser, or holds no
    object."""
    text = read_text(path, limit)
    if text.startswith("\ufeff"):
        raise ValueError(f"{path} starts with a byte order mark, which JSON does not allow "
                         "(transformers refuses it too); "
                         "save it as UTF-8 without one, or download it again")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno} ({e.msg}); "
                         f"it may be truncated; {DAMAGED}") from None
    except RecursionError:
        raise ValueError(f"{path} is nested deeper than Python's JSON parser can read; "
                         f"{DAMAGED}") from None
    expect(isinstance(obj, dict), path, f"its top level is a {type(obj).__name__}, not an object")
    return obj


def expect(ok, path, problem):
    """Raise ValueError naming the file `path` and its `problem` (a field's type or value) unless
    ok."""
    if not ok:
        raise ValueError(f"{path}: {problem}; {DAMAGED}")


def is_int(value, low=0):
    """Whether value is a whole number (not a bool) of at least `low`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def abridged(names):
    """At most five names, then how many more."""
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
