"""
Files written whole or not at all, and files from elsewhere: of the kind they must be, read within
bounds and checked.

    write_atomic(path, write)   replace a file atomically: a crash, a power cut or a full disk
                                leaves the previous file or the new one, never a mix
    raise_if_disk_full(e, path) one message for a write that found no room, whatever the writer
    remove_temporaries(dir, names)  the temp files a killed process left, under the caller's lock
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
import re
import resource
import signal
import stat
import sys
import tempfile
import threading
from contextlib import contextmanager


class DiskFull(ValueError):
    """A write found no room (a full disk or quota, a file over the size limit); the file at its
    path is as it was before."""


# the errors of a write that found no room: a full disk, a full quota, a file over the size limit
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# where a writer puts the errno in its message instead: Rust's io::Error (safetensors)
OS_ERROR = re.compile(r"\(os error (\d+)\)")


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


def no_room(error, written=None):
    """The errno (one of NO_ROOM) of a write that found no room behind error, else None: an
    OSError's, one a library raised while handling it (torch's "unexpected pos" over its file's
    ENOSPC), one its message names (safetensors' "(os error 28)", numpy's "Not enough free space").
    An errno-less OSError (numpy's "N requested and M written") is asked of `written`, the file or
    folder being written, while it is there (room_left)."""
    seen = set()
    silent = False
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in NO_ROOM:
            return error.errno
        named = OS_ERROR.search(str(error))
        if named and int(named[1]) in NO_ROOM:
            return int(named[1])
        if isinstance(error, OSError) and "Not enough free space" in str(error):
            return errno.ENOSPC   # numpy's words for its fallocate's ENOSPC
        silent = silent or (isinstance(error, OSError) and error.errno is None)
        error = error.__cause__ or error.__context__
    if silent and written is not None and os.path.exists(written):
        return room_left(written)
    return None


def room_left(written):
    """Why a write into `written` (a file or folder) failed when the writer did not say: EFBIG
    where the file has reached the size limit (`ulimit -f`), ENOSPC where its file system has no
    space left for this user, else None."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    limited = limit != resource.RLIM_INFINITY
    if limited and os.path.isfile(written) and os.path.getsize(written) >= limit:
        return errno.EFBIG
    if os.statvfs(written).f_bavail == 0:
        return errno.ENOSPC
    return None


def raise_if_disk_full(error, path, what=None, written=None):
    """Raise DiskFull for an error of a write that found no room (no_room, which asks `written`,
    the file or folder being written, when the writer gave no errno) while path was written,
    naming the file system, the fix and whether the previous `what` (default: path's base name)
    is kept; return for any other error."""
    reason = no_room(error, written)
    if reason is None:
        return
    if os.path.lexists(path):
        kept = f"the previous {what or os.path.basename(path)} is kept"
    else:
        kept = "nothing was written"
    mount = mount_point(os.path.dirname(os.path.abspath(path)))
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if reason != errno.EFBIG:
        message = f"no space left on {mount} to write {path}; {kept}: free some space there"
    elif limit != resource.RLIM_INFINITY:
        message = (f"writing {path} went over the file size limit of {limit} bytes (`ulimit -f`); "
                   f"{kept}: raise the limit (`ulimit -f unlimited`)")
    else:
        message = (f"writing {path} went over the largest file {mount} holds; {kept}: write to "
                   "another file system")
    raise DiskFull(f"{message} and run again") from None


def file_mode(path):
    """The permission bits of the regular file at path (not followed if a symlink), or for a new
    file 0666 less the process's umask (as open() gives)."""
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode):
            return stat.S_IMODE(st.st_mode)
    except FileNotFoundError:
        pass
    umask = os.umask(0)   # read by setting it; set back at once
    os.umask(umask)
    return 0o666 & ~umask


def follows_link(link):
    """Whether the symlink at link is one the kernel's protected_symlinks follows, whether that
    setting is on or off: outside a sticky world-writable directory (/tmp), or owned by this user
    or by the directory's owner; not one another user planted in /tmp."""
    owner = os.lstat(link).st_uid
    parent = os.stat(os.path.dirname(os.path.abspath(link)))
    shared = parent.st_mode & stat.S_ISVTX and parent.st_mode & stat.S_IWOTH
    return not shared or owner in (os.geteuid(), parent.st_uid)


def link_target(path):
    """The file write_atomic replaces for path: where its chain of symlinks leads, each link
    followed only where follows_link says; a link not followed is itself replaced. Raises
    FileNotFoundError for a link into a missing directory, ValueError for a link not followed that
    this user may not replace (another user's, in a sticky directory this user does not own)."""
    target = path
    for _ in range(40):   # the kernel's limit of links in a chain
        if not (os.path.islink(target) and follows_link(target)):
            break
        target = os.path.join(os.path.dirname(target), os.readlink(target))
    else:
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
    directory = os.path.realpath(os.path.dirname(target) or ".")
    if os.path.islink(target) and os.geteuid() not in (0, os.stat(directory).st_uid):
        raise ValueError(f"{target} is a symlink that another user (uid {os.lstat(target).st_uid}) "
                         f"made in the shared directory {directory}: it is not followed, and this "
                         "user may not replace it; write to another path")
    if target == path:
        return path
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{path} is a symlink to {os.path.realpath(path)}, whose directory "
                                "does not exist (an unmounted disk?): create it, or remove the "
                                "link")
    return os.path.join(directory, os.path.basename(target))


def temporary_prefix(path):
    """The start of the names of write_atomic's temp files for path: a dot and its base name."""
    return f".{os.path.basename(path)}."


def write_atomic(path, write, what=None):
    """Replace the file at path with what write(f) writes into a binary file f, atomically: a temp
    file beside it (mkstemp: O_EXCL | O_NOFOLLOW, an unpredictable name), fsynced, renamed over
    path, the directory fsynced. On any error the temp file is removed and path is as it was. A
    symlink at path is written through (the file it points to replaced, the link kept) when
    follows_link allows; else the link is replaced. what: how a message names the file
    ("checkpoint"; default its base name). Raises DiskFull (a ValueError) when the disk, a quota or
    the file size limit is reached, FileNotFoundError for a link into a missing directory, and what
    write raises."""
    path = link_target(path)
    directory = os.path.dirname(os.path.abspath(path))
    mode = file_mode(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=temporary_prefix(path), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # mkstemp makes files private (0600)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            raise_if_disk_full(e, path, what, written=tmp)  # asked while the temp file is there
        finally:
            if tmp is not None:
                os.unlink(tmp)
        raise
    fsync_directory(directory)


def remove_temporaries(directory, names):
    """Remove the temp files write_atomic left in directory for the files `names` (ckpt.pt, ...)
    when its process was killed mid-write (kill -9, a power cut); only while the caller holds
    directory (its lock), so that no write of them is under way. Returns the names removed."""
    # mkstemp's names: eight of a-z, 0-9 and _ between the prefix and the suffix
    ours = re.compile("|".join(re.escape(temporary_prefix(name)) + r"[a-z0-9_]{8}\.tmp"
                               for name in names))
    removed = []
    for entry in sorted(os.listdir(directory)):
        left = os.path.join(directory, entry)
        if ours.fullmatch(entry) and not os.path.isdir(left):
            os.unlink(left)  # a symlink planted at such a name goes, its target stays
            removed.append(entry)
    return removed


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
