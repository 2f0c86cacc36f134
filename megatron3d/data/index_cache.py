"""Cache index arrays on disk, keyed by a hash of everything they depend on; build each once.

Layout: ``DIR/NAME-HASH/`` holds one ``.npy`` per array plus ``key.json`` (the key in
readable form). Entries are written into a temp directory and renamed into place, so a
reader sees a whole entry or none. Loading memory-maps the arrays.

Who builds a missing entry: whoever first creates ``DIR/NAME-HASH.lock`` (``O_CREAT |
O_EXCL``, atomic on local and NFSv3+ filesystems); everyone else polls, backing off, until the
entry appears, and gives up after ``timeout_s`` with a message naming the lock. Why a lock file
rather than "global rank 0 builds, then barrier": it needs no process group (so
``tools/prepare_data_cache.py`` and tests share the code path), it is right when each node
has its own cache directory (rank 0 could not build another node's), and two jobs sharing a
directory never race. The builder touches its lock every few seconds while it works, so a
lock is stale, and is removed, when its holder was a process on this host that is gone, when
nobody refreshed it for ``STALE_S`` (its holder died on another host), or when it is empty or
garbled for longer than it takes to write one line (a crash between create and write).
A directory shared read-only (caches built offline) is only read; an entry missing from it is
one ``DataError`` line naming ``--data-cache-path``, not a fallback to another directory.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import socket
import threading
import time
import tokenize
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from megatron3d.data.indexed_dataset import data_file_path, index_file_path
from megatron3d.errors import DataError
from megatron3d.log import get_logger

logger = get_logger(__name__)

KEY_FILE = "key.json"
REFRESH_S = 5.0  # how often a builder touches its lock
STALE_S = 60.0  # a lock nobody touched for this long has no live builder
_GARBLED_S = 5.0  # an unreadable lock older than this will never be completed
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
                 poll_s: float = 0.1, max_poll_s: float = 2.0) -> None:
        """Waiters look again after ``poll_s``, doubling up to ``max_poll_s``: thousands of
        ranks must not stat a shared filesystem ten times a second while one rank builds."""
        self.directory, self.timeout_s, self.poll_s = directory, timeout_s, poll_s
        self.max_poll_s = max_poll_s
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
        entry = self.entry_path(name, key)
        lock = entry + ".lock"
        deadline = time.monotonic() + self.timeout_s
        announced, wait = False, self.poll_s
        while True:
            if os.path.isfile(os.path.join(entry, KEY_FILE)):
                return _load(entry, key)
            _check_not_damaged(entry, lock)
            if _try_lock(lock):
                try:
                    with _refreshing(lock):
                        if not os.path.isfile(os.path.join(entry, KEY_FILE)):
                            _write(entry, key, build())
                finally:
                    os.remove(lock)
                return _load(entry, key)
            if _remove_if_stale(lock):
                continue
            if time.monotonic() > deadline:
                raise DataError(f"{lock}: timed out after {self.timeout_s:.0f}s waiting for "
                                f"another process ({_holder(lock)}) to build {entry}; if no "
                                "such process is running, delete the lock file and restart")
            if not announced:
                logger.info("waiting for %s to be built by %s", entry, _holder(lock))
                announced = True
            time.sleep(min(wait, max(0.0, deadline - time.monotonic())))
            wait = min(2 * wait, self.max_poll_s)

    def entry_path(self, name: str, key: Mapping[str, Any]) -> str | None:
        """The directory ``get_or_build(name, key, ...)`` uses (None without a directory)."""
        if self.directory is None:
            return None
        return os.path.join(self.directory, f"{name}-{cache_key(key)}")


def _check_not_damaged(entry: str, lock: str) -> None:
    """An entry directory without its key file, or a lock that is no file, never goes away
    by itself (entries are renamed into place whole; locks are files): say what to delete."""
    if os.path.isdir(entry) and not os.path.isfile(os.path.join(entry, KEY_FILE)):
        raise DataError(f"{entry}: index cache entry without its {KEY_FILE}; delete the "
                        "directory and it will be rebuilt")
    if os.path.isdir(lock):
        raise DataError(f"{lock}: a directory where the index cache expects a lock file; "
                        "delete it and restart")


def _try_lock(lock: str) -> bool:
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        # A cache shared read-only is fine while it holds every entry a run needs; a missing
        # one cannot be built there. No fallback elsewhere: every node's ranks must find the
        # entries where their builder wrote them.
        raise DataError(f"{os.path.dirname(lock)}: the index cache directory is not writable "
                        f"({exc.strerror}) and lacks {os.path.basename(lock)[:-5]}: pass "
                        "--data-cache-path DIR with a writable directory every node sees, or "
                        "build the entries there with tools/prepare_data_cache.py") from None
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


@contextlib.contextmanager
def _refreshing(lock: str) -> Iterator[None]:
    """Touch ``lock`` every ``REFRESH_S`` while the block runs: proof that its builder lives."""
    done = threading.Event()

    def touch() -> None:
        while not done.wait(REFRESH_S):
            with contextlib.suppress(OSError):
                os.utime(lock)

    thread = threading.Thread(target=touch, name="index-cache-lock", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _remove_if_stale(lock: str) -> bool:
    """Remove ``lock`` if no live builder holds it (see the module docstring)."""
    why = _staleness(lock)
    if why is None:
        return False
    logger.warning("%s: removing a stale lock (%s)", lock, why)
    with contextlib.suppress(FileNotFoundError):
        os.remove(lock)
    return True


def _staleness(lock: str) -> str | None:
    try:
        age = time.time() - os.stat(lock).st_mtime
        with open(lock) as f:
            host, pid, _ = f.read().split()
        pid_number = int(pid)
        if not 0 < pid_number < 2**31:  # os.kill would signal a group, or overflow
            raise ValueError(pid)
    except FileNotFoundError:
        return None  # released meanwhile
    except (OSError, ValueError, UnicodeDecodeError):
        return f"empty or garbled for {age:.0f}s" if age > _GARBLED_S else None
    if age > STALE_S:
        return f"not refreshed for {age:.0f}s by pid {pid} on {host}"
    if host != socket.gethostname():
        return None
    try:
        os.kill(pid_number, 0)
    except ProcessLookupError:
        return f"left by pid {pid}, which no longer runs"
    except PermissionError:
        pass  # alive, owned by another user
    return None


def _write(entry: str, key: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
    tmp = f"{entry}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name, array in arrays.items():
        np.save(os.path.join(tmp, name + ".npy"), array, allow_pickle=False)
    shapes = {name: [array.dtype.str, list(array.shape)] for name, array in arrays.items()}
    with open(os.path.join(tmp, KEY_FILE), "w") as f:
        json.dump({"key": dict(key), "arrays": sorted(arrays), "shapes": shapes}, f, indent=1,
                  sort_keys=True)
    try:
        os.rename(tmp, entry)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # someone else's complete entry is in place
        if not os.path.isfile(os.path.join(entry, KEY_FILE)):
            raise


def _load(entry: str, key: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The arrays of ``entry``, checked against its key file: the key it was built for, and
    each array's dtype and shape (entries written before shapes were recorded skip that)."""
    try:
        with open(os.path.join(entry, KEY_FILE), encoding="utf-8") as f:
            saved = json.load(f)
        names, shapes = saved["arrays"], saved.get("shapes", {})
        if saved["key"] != json.loads(json.dumps(dict(key))):
            raise ValueError(f"{KEY_FILE} holds the key of another entry")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{KEY_FILE} lists {names!r}, not array names")
        arrays = {name: np.load(os.path.join(entry, name + ".npy"), mmap_mode="r",
                                allow_pickle=False) for name in names}
        for name, array in arrays.items():
            if name in shapes and shapes[name] != [array.dtype.str, list(array.shape)]:
                raise ValueError(f"{name}.npy is {array.dtype.str} {list(array.shape)}, "
                                 f"{KEY_FILE} says {shapes[name]}")
        return arrays
    except (OSError, ValueError, KeyError, TypeError, EOFError, SyntaxError,
            tokenize.TokenError) as exc:  # numpy's header parser raises the last three
        raise DataError(f"{entry}: unreadable index cache entry ({_first_line(exc)}); delete "
                        "the directory and it will be rebuilt") from None


def _first_line(exc: BaseException) -> str:
    text = (str(exc).splitlines() or [""])[0][:200]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
