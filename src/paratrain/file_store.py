"""`init="file:///path"`: a process group over a shared file, with a crashed run's file told from a live one.

torch's FileStore removes its file when the last worker destroys its process group. A run that crashed,
or whose script ended without destroying it, leaves the file behind, and a new run that reads the old
keys rendezvouses wrongly or hangs. Neither the file's contents nor its mtime can tell "left by a dead
run" from "my peers are already in it", so each worker also holds a POSIX lock on a sidecar
`<path>.lock` for as long as its process group lives. The kernel drops the locks of a process however it
dies, so a lock held means a live user:

    join:   try the lock exclusively, without waiting
              got it -> nobody alive uses the file: a non-empty store file is stale -> error naming the fix;
                        otherwise create the store, then downgrade to shared (atomic: no gap a peer could see)
              busy   -> live peers: wait (bounded) for a shared lock and join their store
    leave:  unlock, then try the lock exclusively: whoever gets it is the last one out and removes the
            store file if torch did not (a script that exited without destroying its process group).

The `.lock` file itself stays (deleting a lock file races with its next user); it is empty. Needs a
filesystem with POSIX locks, as torch's FileStore itself does (local disks, NFS with locking).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
from datetime import datetime
from typing import TYPE_CHECKING

from .errors import ParatrainError

if TYPE_CHECKING:
    import torch.distributed as dist

try:
    import fcntl
except ImportError:  # Windows: torch locks the store file itself; stale files are not detected there
    fcntl = None  # type: ignore[assignment]

_held: dict[str, int] = {}
"""Store path -> descriptor of its lock file, while this process's process group uses the store. POSIX locks
belong to the process and vanish when it closes *any* descriptor of the file, so a held path is never
opened a second time here."""
_JOIN_WAIT_S = 60.0


def path_of(init: str) -> str | None:
    """The store path of a `file://` init method, else None ("file:///f:/dir/x" is "f:/dir/x" on Windows)."""
    if not init.startswith("file://"):
        return None
    path = init[len("file://"):]
    if os.name == "nt" and path[:1] == "/" and path[2:3] == ":":
        path = path[1:]
    return os.path.abspath(path)


def open_store(path: str, world_size: int) -> dist.Store:
    """The FileStore at `path` for this process's process group, after the stale and writability checks."""
    import torch.distributed as dist

    path = os.path.abspath(path)
    release(path)  # a process group of ours on it that was destroyed behind runtime's back
    fd = _open_lock(path)
    if fd is None:
        return dist.FileStore(path, world_size)
    try:
        if _try_lock(fd, exclusive=True):
            _refuse_stale(path)
            store = dist.FileStore(path, world_size)
            fcntl.lockf(fd, fcntl.LOCK_SH)
        else:
            _wait_shared(fd, path)
            store = dist.FileStore(path, world_size)
    except BaseException:
        os.close(fd)
        raise
    _held[path] = fd
    return store


def release(only: str | None = None) -> None:
    """Let go of the stores this process joined (or of `only`); the last user of a store removes its file.
    Also runs at exit, for scripts that never destroy their process group."""
    for path, fd in list(_held.items()):
        if only is not None and path != only:
            continue
        try:
            # Unlock first, then probe: of peers leaving together, at least the last to probe gets through.
            fcntl.lockf(fd, fcntl.LOCK_UN)
            if _try_lock(fd, exclusive=True):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        finally:
            os.close(fd)
            del _held[path]


def preflight(path: str, *, expect_idle: bool) -> None:
    """Check a store path before starting workers, so a bad one fails in the launcher rather than in each
    worker. `expect_idle`: the caller starts every worker itself, so live users mean another job."""
    path = os.path.abspath(path)
    fd = None if path in _held else _open_lock(path)
    if fd is None:
        if path in _held and expect_idle:
            raise ParatrainError(f"file store {path!r} is in use by this process's own process group; "
                                 "give each job its own path")
        return
    try:
        if _try_lock(fd, exclusive=True):
            _refuse_stale(path)
        elif expect_idle:
            raise ParatrainError(
                f"file store {path!r} is in use by another running job (it holds {path + '.lock'!r}); "
                "give each job its own path"
            )
    finally:
        os.close(fd)


def remove_if_unused(path: str) -> bool:
    """Delete the store file when no live process uses it (a launcher whose workers have all ended)."""
    path = os.path.abspath(path)
    fd = None if path in _held else _open_lock(path)
    if fd is None:
        return False
    try:
        if _try_lock(fd, exclusive=True) and os.path.exists(path):
            os.unlink(path)
            return True
        return False
    finally:
        os.close(fd)


def _open_lock(path: str) -> int | None:
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise ParatrainError(
            f"file store {path!r}: directory {parent!r} does not exist; create it, or use a path on a "
            "writable filesystem that every worker sees"
        )
    if os.path.isdir(path):
        raise ParatrainError(f"file store {path!r} is a directory; give a file path inside it, e.g. file://{path}/store")
    if fcntl is None:
        return None
    try:
        return os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        raise ParatrainError(
            f"file store {path!r}: cannot write in {parent!r} ({exc.strerror}); use a path on a writable "
            "filesystem that every worker sees"
        ) from None


def _try_lock(fd: int, *, exclusive: bool) -> bool:
    try:
        fcntl.lockf(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _wait_shared(fd: int, path: str) -> None:
    """The exclusive holder is a peer creating the store; it downgrades within milliseconds."""
    deadline = time.monotonic() + _JOIN_WAIT_S
    while not _try_lock(fd, exclusive=False):
        if time.monotonic() > deadline:
            raise ParatrainError(
                f"file store {path!r}: a process has held {path + '.lock'!r} exclusively for "
                f"{_JOIN_WAIT_S:.0f}s; is the filesystem hung? Use a local path or tcp:// init"
            )
        time.sleep(0.01)


def _refuse_stale(path: str) -> None:
    """Called holding the exclusive lock, i.e. with no live user: any content is a dead run's."""
    try:
        size, mtime = os.path.getsize(path), os.path.getmtime(path)
    except FileNotFoundError:
        return
    if size == 0:
        return  # torch accepts an empty file as a fresh store
    when = datetime.fromtimestamp(mtime).strftime("%Y-%m-%d %H:%M:%S")
    raise ParatrainError(
        f"file store {path!r} is left over from an earlier run ({size} bytes, last written {when}) that did "
        f"not shut down cleanly; no running process uses it. Delete it (rm {path}) or use a new path"
    )


atexit.register(release)
