"""Cache index arrays on disk, keyed by a hash of everything they depend on; build each once.

Layout: ``DIR/NAME-HASH/`` holds one ``.npy`` per array plus ``key.json`` (the key in
readable form). Entries are written into a temp directory and renamed into place, so a
reader sees a whole entry or none. Loading memory-maps the arrays.

Who builds a missing entry: whoever first creates ``DIR/NAME-HASH.lock`` (``O_CREAT |
O_EXCL``, atomic on local and NFSv3+ filesystems); everyone else polls until the entry
appears, and gives up after ``timeout_s`` with a message naming the lock. Why a lock file
rather than "global rank 0 builds, then barrier": it needs no process group (so
``tools/prepare_data_cache.py`` and tests share the code path), it is right when each node
has its own cache directory (rank 0 could not build another node's), and two jobs sharing a
directory never race. A lock left by a dead process on this host is detected and removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from megatron3d.data.indexed_dataset import data_file_path, index_file_path
from megatron3d.errors import DataError
from megatron3d.log import get_logger

logger = get_logger(__name__)

KEY_FILE = "key.json"
_SAMPLE_BYTES = 1 << 20  # bytes hashed from each end of an .idx to identify its content


def cache_key(fields: Mapping[str, Any]) -> str:
    """A short stable hash of JSON-able ``fields``."""
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def dataset_identity(prefix: str) -> dict[str, Any]:
    """What identifies a dataset's content without reading all of it.

    The sizes of both files plus a hash of the ``.idx``'s first and last MiB (the header,
    the first lengths, the document index). Paths and times are left out so a copied or
    moved dataset keeps its caches.
    """
    idx = index_file_path(prefix)
    idx_bytes = os.path.getsize(idx)
    digest = hashlib.sha256()
    with open(idx, "rb") as f:
        digest.update(f.read(_SAMPLE_BYTES))
        if idx_bytes > _SAMPLE_BYTES:
            f.seek(max(_SAMPLE_BYTES, idx_bytes - _SAMPLE_BYTES))
            digest.update(f.read())
    return {"idx_bytes": idx_bytes, "bin_bytes": os.path.getsize(data_file_path(prefix)),
            "idx_sha256_ends": digest.hexdigest()}


class IndexCache:
    """Get-or-build of named index arrays in ``directory``; ``None`` builds in memory only."""

    def __init__(self, directory: str | None, timeout_s: float = 1800.0,
                 poll_s: float = 0.1) -> None:
        self.directory, self.timeout_s, self.poll_s = directory, timeout_s, poll_s
        if directory is not None:
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as exc:
                raise DataError(f"{directory}: cannot create the index cache directory "
                                f"({exc.strerror}); pass --data-cache-path DIR with a "
                                "writable directory") from None

    def get_or_build(self, name: str, key: Mapping[str, Any],
                     build: Callable[[], Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The arrays for ``key``: loaded if cached, else built by exactly one process."""
        if self.directory is None:
            return dict(build())
        entry = os.path.join(self.directory, f"{name}-{cache_key(key)}")
        lock = entry + ".lock"
        deadline = time.monotonic() + self.timeout_s
        announced = False
        while True:
            if os.path.isfile(os.path.join(entry, KEY_FILE)):
                return _load(entry)
            if _try_lock(lock):
                try:
                    if not os.path.isfile(os.path.join(entry, KEY_FILE)):
                        _write(entry, key, build())
                finally:
                    os.remove(lock)
                return _load(entry)
            if _remove_if_stale(lock):
                continue
            if time.monotonic() > deadline:
                raise DataError(f"{lock}: timed out after {self.timeout_s:.0f}s waiting for "
                                f"another process ({_holder(lock)}) to build {entry}; if no "
                                "such process is running, delete the lock file and restart")
            if not announced:
                logger.info("waiting for %s to be built by %s", entry, _holder(lock))
                announced = True
            time.sleep(self.poll_s)


def _try_lock(lock: str) -> bool:
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{socket.gethostname()} {os.getpid()} {time.time():.0f}\n")
    return True


def _holder(lock: str) -> str:
    try:
        with open(lock) as f:
            host, pid, _ = f.read().split()
    except (OSError, ValueError):
        return "unknown process"
    return f"pid {pid} on {host}"


def _remove_if_stale(lock: str) -> bool:
    """Remove ``lock`` if its holder was a process on this host that no longer exists."""
    try:
        with open(lock) as f:
            host, pid, _ = f.read().split()
    except (OSError, ValueError):
        return False  # gone already, or being written right now
    if host != socket.gethostname():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        logger.warning("%s: removing a lock left by pid %s, which no longer runs", lock, pid)
        with contextlib.suppress(FileNotFoundError):
            os.remove(lock)
        return True
    except PermissionError:
        pass  # alive, owned by another user
    return False


def _write(entry: str, key: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
    tmp = f"{entry}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name, array in arrays.items():
        np.save(os.path.join(tmp, name + ".npy"), array, allow_pickle=False)
    with open(os.path.join(tmp, KEY_FILE), "w") as f:
        json.dump({"key": dict(key), "arrays": sorted(arrays)}, f, indent=1, sort_keys=True)
    try:
        os.rename(tmp, entry)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # someone else's complete entry is in place
        if not os.path.isfile(os.path.join(entry, KEY_FILE)):
            raise


def _load(entry: str) -> dict[str, np.ndarray]:
    with open(os.path.join(entry, KEY_FILE)) as f:
        names = json.load(f)["arrays"]
    try:
        return {name: np.load(os.path.join(entry, name + ".npy"), mmap_mode="r",
                              allow_pickle=False) for name in names}
    except (OSError, ValueError) as exc:
        raise DataError(f"{entry}: unreadable index cache entry ({exc}); delete the directory "
                        "and it will be rebuilt") from None
