"""One writer per ``--save`` directory, for the writer's whole life.

Two runs saving into one directory lose checkpoints: both pass the start-up series check
while it is empty, then each save's cleanup deletes the other's staging directory and
replaces its ``iter_N``. So rank 0 of a run holds an exclusive ``flock`` on ``SAVE/.lock``
from start-up to exit, and a second run is refused with one line naming the holder. The lock
belongs to the open file: the kernel drops it when the process exits however it ends, so a
crashed or killed run leaves no stale lock (only the file). A run removes the file while it
still holds the lock as it ends, and a run that locked a file checks that the name still
names it (else it locks the new one), so two runs never hold two files of one name.

Limits, as far as ``flock`` reaches: on a local disk and on NFS (Linux turns ``flock`` into a
whole-file NFS lock, seen by every client since kernel 2.6.12) it works across nodes; Lustre
honours it across nodes only when mounted with ``-o flock`` (``localflock`` locks one node);
a filesystem without locks (``ENOLCK``, ``ENOSYS``, ``EOPNOTSUPP``) gets a warning and the run
goes on unlocked, as before. The staging directories carry the series too
(``io.staging_dir``), so even unlocked, a save's cleanup removes only its own.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from pathlib import Path

from megatron3d.errors import ConfigError
from megatron3d.log import get_logger

logger = get_logger(__name__)

LOCK_NAME = ".lock"
_UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


class SaveLock:
    """``SaveLock.take(root)``, rank 0 only, before any work; ``release()`` (or leaving its
    ``with``) at exit."""

    def __init__(self, fd: int | None, path: Path, made_root: bool) -> None:
        self._fd = fd  # None: the filesystem has no locks
        self._path, self._made_root = path, made_root

    @classmethod
    def take(cls, root: Path) -> SaveLock:
        """Create ``root`` if needed and lock it, or raise ``ConfigError`` naming the run that
        holds it (the lock file is then left as it was)."""
        made_root = not root.exists()
        root.mkdir(parents=True, exist_ok=True)
        path = root / LOCK_NAME
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 200).decode(errors="replace").strip() or "another run"
                os.close(fd)
                raise ConfigError(f"--save is in use by {holder} ({root}): two runs saving "
                                  "into one directory delete each other's checkpoints; wait "
                                  "for it to end or choose another --save directory") from None
            except OSError as err:
                os.close(fd)
                if err.errno not in _UNSUPPORTED:
                    raise
                logger.warning("cannot lock --save %s (%s): this filesystem has no flock; make "
                               "sure no other run saves there", root, os.strerror(err.errno))
                return cls(None, path, made_root)
            if _same_file(fd, path):
                break
            os.close(fd)  # its holder removed it as we opened it: lock the new one
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        return cls(fd, path, made_root)

    def release(self) -> None:
        """Remove the lock file while holding it, then drop the lock: the directory is left
        as the run found it (and removed if the run made it and left nothing in it)."""
        if self._fd is not None:
            with contextlib.suppress(FileNotFoundError):
                self._path.unlink()
            os.close(self._fd)  # closing the last descriptor drops the lock
            self._fd = None
            if self._made_root:
                with contextlib.suppress(OSError):
                    self._path.parent.rmdir()  # only if empty

    def __enter__(self) -> SaveLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file ``fd`` locked: a run that ends removes its lock
    file, and a run that opened it just before then holds a lock on a file nobody else sees."""
    try:
        found = path.stat()
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (found.st_dev, found.st_ino)
