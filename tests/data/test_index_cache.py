"""Index caches: keyed by content, written atomically, built once under concurrency."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from megatron3d.data import index_cache
from megatron3d.data.builder import build_datasets
from megatron3d.data.index_cache import IndexCache, cache_key, dataset_identity
from megatron3d.data.prep.indexed_builder import IndexedDatasetBuilder
from megatron3d.errors import DataError
from tests.helpers.dist import run_distributed


def _build_counted(log_path: str, delay_s: float = 0.0):
    """A build function that records each call; ``delay_s`` lets racers pile up."""
    def build():
        with open(log_path, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(delay_s)
        return {"a": np.arange(10), "b": np.ones((3, 2), np.int32)}
    return build


def _race(directory: str, data_prefix: str) -> tuple[int, list, list]:
    """One rank: the same cache entry and the same dataset, from four processes at once."""
    cache = IndexCache(directory, timeout_s=60)
    dist.barrier()  # start together, so three ranks really find the entry being built
    build = _build_counted(os.path.join(directory, "log"), delay_s=0.5)
    arrays = cache.get_or_build("race", {"x": 1}, build)
    dist.barrier()
    sets = build_datasets(data_path=data_prefix, seq_length=8, seed=3, train_samples=50,
                          data_cache_path=directory)
    return os.getpid(), arrays["a"].tolist(), sets.train.samples(0, 50).tolist()


def test_four_processes_build_each_entry_once(tmp_path):
    prefix = str(tmp_path / "data")
    with IndexedDatasetBuilder(prefix, np.int32) as builder:
        for d in range(30):
            builder.add_document(np.arange(d * 10, d * 10 + 7))
        builder.finalize()
    directory = str(tmp_path / "cache")
    results = run_distributed(_race, 4, directory, prefix, timeout_s=120)
    builders = Path(directory, "log").read_text().split()
    assert len(builders) == 1 and int(builders[0]) in {pid for pid, _, _ in results}
    assert all(r[1] == list(range(10)) for r in results)
    assert all(r[2] == results[0][2] for r in results)
    leftovers = [n for n in os.listdir(directory) if n.endswith(".lock") or ".tmp" in n]
    assert leftovers == []


def test_hit_miss_and_key(tmp_path):
    cache = IndexCache(str(tmp_path))
    log = str(tmp_path / "log")
    first = cache.get_or_build("n", {"k": 1}, _build_counted(log))
    second = cache.get_or_build("n", {"k": 1}, _build_counted(log))
    cache.get_or_build("n", {"k": 2}, _build_counted(log))
    assert len(Path(log).read_text().split()) == 2
    np.testing.assert_array_equal(first["b"], second["b"])
    assert cache_key({"a": 1, "b": [1, 2]}) == cache_key({"b": [1, 2], "a": 1})
    assert cache_key({"a": 1}) != cache_key({"a": 2})


def test_identity_follows_content_not_path(tmp_path):
    for name in ("x", "y"):
        with IndexedDatasetBuilder(str(tmp_path / name), np.uint16) as builder:
            builder.add_document([1, 2, 3])
            builder.finalize()
    assert dataset_identity(str(tmp_path / "x")) == dataset_identity(str(tmp_path / "y"))
    with IndexedDatasetBuilder(str(tmp_path / "z"), np.uint16) as builder:
        builder.add_document([1, 2, 4, 5])
        builder.finalize()
    assert dataset_identity(str(tmp_path / "x")) != dataset_identity(str(tmp_path / "z"))


def test_waiting_on_a_live_lock_times_out_with_the_fix(tmp_path):
    cache = IndexCache(str(tmp_path), timeout_s=0.3, poll_s=0.05)
    entry = os.path.join(str(tmp_path), f"n-{cache_key({'k': 1})}")
    with open(entry + ".lock", "w") as f:
        f.write(f"{socket.gethostname()} {os.getpid()} 0\n")  # held by us: alive
    with pytest.raises(DataError, match=r"n-\w+\.lock: timed out .*delete the lock file"):
        cache.get_or_build("n", {"k": 1}, lambda: {"a": np.zeros(1)})


def test_waiters_back_off_up_to_a_bound(tmp_path, monkeypatch):
    """A waiter looks again after 0.1 s, then 0.2, 0.4 ... capped at max_poll_s: many ranks
    waiting on a shared filesystem do not stat it ten times a second each."""
    from megatron3d.data import index_cache

    slept: list[float] = []
    monkeypatch.setattr(index_cache.time, "sleep", slept.append)
    cache = IndexCache(str(tmp_path), timeout_s=3600, poll_s=0.1, max_poll_s=1.0)
    entry = os.path.join(str(tmp_path), f"n-{cache_key({'k': 1})}")
    with open(entry + ".lock", "w") as f:
        f.write(f"{socket.gethostname()} {os.getpid()} 0\n")  # held by us: alive
    monkeypatch.setattr(index_cache, "_remove_if_stale", lambda lock: len(slept) >= 8 and (
        os.remove(lock) or True))  # the holder "dies" after 8 waits: then we build
    cache.get_or_build("n", {"k": 1}, lambda: {"a": np.zeros(1)})
    assert slept == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0])


def test_a_lock_of_a_dead_process_is_taken_over(tmp_path):
    cache = IndexCache(str(tmp_path), timeout_s=5, poll_s=0.05)
    entry = os.path.join(str(tmp_path), f"n-{cache_key({'k': 1})}")
    with open(entry + ".lock", "w") as f:
        f.write(f"{socket.gethostname()} {2**22 + 12345} 0\n")  # no such pid
    arrays = cache.get_or_build("n", {"k": 1}, lambda: {"a": np.arange(3)})
    assert arrays["a"].tolist() == [0, 1, 2] and not os.path.exists(entry + ".lock")


def test_failed_build_releases_the_lock(tmp_path):
    cache = IndexCache(str(tmp_path))
    def broken():
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError):
        cache.get_or_build("n", {"k": 1}, broken)
    assert os.listdir(tmp_path) == []


def test_unwritable_cache_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(DataError, match="--data-cache-path"):
        IndexCache(str(blocker / "cache"))


def _lock_of(cache_dir: Path, content: str, age_s: float = 0.0) -> str:
    entry = os.path.join(str(cache_dir), f"n-{cache_key({'k': 1})}")
    with open(entry + ".lock", "w") as f:
        f.write(content)
    then = time.time() - age_s
    os.utime(entry + ".lock", (then, then))
    return entry


def test_an_empty_lock_delays_a_run_only_seconds(tmp_path, monkeypatch):
    """A process that died between creating its lock and writing it left an empty file."""
    monkeypatch.setattr(index_cache, "_GARBLED_S", 1.0)
    entry = _lock_of(tmp_path, "")
    start = time.monotonic()
    arrays = IndexCache(str(tmp_path), poll_s=0.05).get_or_build(
        "n", {"k": 1}, lambda: {"a": np.arange(2)})
    assert arrays["a"].tolist() == [0, 1] and not os.path.exists(entry + ".lock")
    assert 1.0 <= time.monotonic() - start < 3.0


def test_a_lock_nobody_refreshes_is_taken_over(tmp_path):
    """Its holder died on another host: no pid to check, but it stopped touching the lock."""
    entry = _lock_of(tmp_path, "elsewhere 123 0\n", age_s=index_cache.STALE_S + 1)
    start = time.monotonic()
    IndexCache(str(tmp_path), poll_s=0.05).get_or_build("n", {"k": 1},
                                                        lambda: {"a": np.arange(2)})
    assert time.monotonic() - start < 2.0 and not os.path.exists(entry + ".lock")


def test_a_live_builder_keeps_its_lock_fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(index_cache, "REFRESH_S", 0.05)
    entry = os.path.join(str(tmp_path), f"n-{cache_key({'k': 1})}")
    ages = []

    def build() -> dict:
        os.utime(entry + ".lock", (0, 0))  # as if untouched since 1970
        time.sleep(0.5)
        ages.append(time.time() - os.stat(entry + ".lock").st_mtime)
        return {"a": np.arange(2)}

    IndexCache(str(tmp_path)).get_or_build("n", {"k": 1}, build)
    assert ages[0] < 1.0


def test_a_corrupt_cache_key_is_one_clear_error(tmp_path):
    cache = IndexCache(str(tmp_path))
    cache.get_or_build("n", {"k": 1}, lambda: {"a": np.arange(2)})
    entry = os.path.join(str(tmp_path), f"n-{cache_key({'k': 1})}")
    for text in ("{not json", '{"arrays": 3}', "[]"):
        with open(os.path.join(entry, "key.json"), "w") as f:
            f.write(text)
        with pytest.raises(DataError, match=r"unreadable index cache entry .*delete the "
                                            "directory") as err:
            cache.get_or_build("n", {"k": 1}, lambda: {"a": np.arange(2)})
        assert "\n" not in str(err.value)


def _read_only(directory: Path, monkeypatch) -> None:
    """``directory`` made read-only; as root (who writes anyway) creating a file in it fails
    as it would for a user."""
    directory.chmod(0o555)
    if os.geteuid() == 0:
        real = os.open

        def refusing(path, flags, *args, **kwargs):
            if flags & os.O_CREAT and Path(path).parent == directory:
                raise PermissionError(13, "Permission denied", str(path))
            return real(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", refusing)


def test_a_read_only_cache_directory_is_one_line_naming_the_flag(tmp_path, monkeypatch):
    """Not a traceback from the lock file; no fallback elsewhere either: the ranks of every
    node must find the entries where the builder wrote them."""
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    _read_only(cache_dir, monkeypatch)
    with pytest.raises(DataError) as caught:
        IndexCache(str(cache_dir)).get_or_build("n", {"k": 1}, _build_counted(
            str(tmp_path / "log")))
    message = str(caught.value)
    assert "\n" not in message and "not writable" in message, message
    assert "--data-cache-path" in message and "prepare_data_cache" in message, message
    assert not (tmp_path / "log").exists() and os.listdir(cache_dir) == []


def test_a_read_only_cache_directory_holding_the_entry_is_read(tmp_path, monkeypatch):
    """Caches built offline and shared read-only are only read."""
    cache_dir = tmp_path / "cache"
    IndexCache(str(cache_dir)).get_or_build("n", {"k": 1}, _build_counted(str(tmp_path / "a")))
    _read_only(cache_dir, monkeypatch)
    arrays = IndexCache(str(cache_dir)).get_or_build("n", {"k": 1},
                                                     _build_counted(str(tmp_path / "b")))
    assert arrays["a"].tolist() == list(range(10)) and not (tmp_path / "b").exists()
