"""Damaged index caches: building the datasets either refuses them with one ``DataError``
line or yields exactly the samples a sound cache gives; no cached file is changed.

Mutations of one cache entry made by a real build: ``key.json`` (random JSON, random bytes,
truncated, deleted), a cached ``.npy`` array (truncated, random bytes, bytes overwritten,
replaced by another array, deleted, a directory) and lock files left beside a missing entry
(random content, any age, a directory). A lock may be removed when stale and a missing entry
rebuilt: that is the cache's job; every other file must stay byte-identical. Most examples
build the datasets in-process; a handful go through ``pretrain_gpt.main``.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import pretrain_gpt
from megatron3d.data.builder import build_datasets
from megatron3d.data.prep.indexed_builder import IndexedDatasetBuilder
from megatron3d.errors import DataError
from tests.fuzz.common import assert_main_refuses, attempt, fuzz, tree_digest
from tests.helpers.tiny import train_argv

_BUILD = {"seq_length": 8, "seed": 7, "train_samples": 40, "valid_samples": 6,
          "split": "80, 20, 0"}


def _build(directory: Path, timeout_s: float = 1800.0) -> dict[str, torch.Tensor]:
    """Every train and valid sample, through the cache in ``directory/cache``."""
    sets = build_datasets(data_path=str(directory / "data"), data_cache_path=str(
        directory / "cache"), cache_timeout_s=timeout_s, **_BUILD)
    return {name: ds.samples(0, len(ds)) for name, ds in
            (("train", sets.train), ("valid", sets.valid))}


class Sound:
    """A dataset with its cache as a real run leaves it, and the samples it gives."""

    def __init__(self, root: Path, samples: dict[str, torch.Tensor]) -> None:
        self.root, self.samples = root, samples

    def __repr__(self) -> str:  # hypothesis prints the fixtures of a failing example
        return f"Sound({self.root})"


@pytest.fixture(scope="module")
def sound(tmp_path_factory: pytest.TempPathFactory) -> Sound:
    root = tmp_path_factory.mktemp("cache")
    rng = np.random.default_rng(1)
    with IndexedDatasetBuilder(str(root / "data"), np.int32) as builder:
        for n in rng.integers(1, 30, size=25):
            builder.add_document(rng.integers(0, 1000, size=n))
        builder.finalize()
    return Sound(root, _build(root))


def _entries(root: Path) -> list[Path]:
    return sorted(p for p in (root / "cache").iterdir() if p.is_dir())


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


_ARRAYS = st.builds(
    lambda dtype, shape, fill: np.full(shape, fill).astype(dtype),
    st.sampled_from([np.int32, np.int64, np.uint32, np.float64, np.int8]),
    st.lists(st.integers(0, 60), max_size=2).map(tuple),
    st.integers(-5, 2**31 - 1))
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=12),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)


@st.composite
def _damage(draw: st.DrawFn) -> tuple:
    """A description of one mutation; applied by ``_apply`` to a copy of the cache."""
    target = draw(st.sampled_from(["key", "array", "array", "lock"]))
    entry = draw(st.integers(0, 10))
    if target == "key":
        content = draw(_JSON.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=40)
                       | st.sampled_from([b"", b'{"arrays": ["doc_idx"]}', b"\xff\xfe",
                                          b'{"key": {}, "arrays": []}']) | st.none())
        return ("key", entry, content)
    if target == "array":
        how = draw(st.sampled_from(["truncate", "random", "overwrite", "replace", "delete",
                                    "directory"]))
        detail = {"truncate": st.floats(0, 1), "random": st.binary(max_size=200),
                  "overwrite": st.tuples(st.floats(0, 1), st.binary(min_size=1, max_size=8)),
                  "replace": _ARRAYS, "delete": st.none(), "directory": st.none()}[how]
        return ("array", entry, draw(st.integers(0, 2)), how, draw(detail))
    content = draw(st.binary(max_size=40) | st.sampled_from([
        b"", f"{os.uname().nodename} {2**70} 0\n".encode(), f"{os.uname().nodename} -1 0\n"
        .encode(), b"elsewhere 1 0\n", f"{os.uname().nodename} {os.getpid()} 0\n".encode()])
        | st.none())
    return ("lock", entry, content, draw(st.sampled_from([0.0, 10.0, 120.0])))


def _apply(root: Path, damage: tuple) -> None:
    entries = _entries(root)
    kind, index, *rest = damage
    entry = entries[index % len(entries)]
    if kind == "key":
        (entry / "key.json").unlink()
        if rest[0] is not None:
            (entry / "key.json").write_bytes(rest[0])
    elif kind == "array":
        _damage_array(sorted(entry.glob("*.npy")), *rest)
    else:
        content, age = rest
        shutil.rmtree(entry)  # a missing entry, so the lock decides who builds it
        lock = Path(f"{entry}.lock")
        if content is None:
            lock.mkdir()
        else:
            lock.write_bytes(content)
        then = time.time() - age
        os.utime(lock, (then, then))


def _damage_array(arrays: list[Path], which: int, how: str, detail: object) -> None:
    path = arrays[which % len(arrays)]
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[:int(detail * len(data))])
    elif how == "random":
        path.write_bytes(detail)
    elif how == "overwrite":
        at = int(detail[0] * len(data))
        path.write_bytes(data[:at] + detail[1] + data[at + len(detail[1]):])
    elif how == "replace":
        path.write_bytes(_npy_bytes(detail))
    else:
        path.unlink()
        if how == "directory":
            path.mkdir()


def _kept(before: dict[str, str], after: dict[str, str]) -> dict[str, str]:
    """``after`` restricted to what existed before, except locks (removed when stale)."""
    return {k: after.get(k, "<removed>") for k in before if not k.endswith(".lock")}


@fuzz(max_examples=300)
@given(damage=_damage())
def test_a_damaged_index_cache_is_refused_or_rebuilt(sound: Sound, damage: tuple) -> None:
    root, expected = sound.root, sound.samples
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch)
        shutil.copy(root / "data.idx", copy)
        shutil.copy(root / "data.bin", copy)
        shutil.copytree(root / "cache", copy / "cache")
        _apply(copy, damage)
        before = tree_digest(copy)
        got, _ = attempt(lambda: _build(copy, timeout_s=0.3), DataError)
        if got is not None:
            for name, samples in expected.items():
                assert torch.equal(got[name], samples), f"{name} samples differ"
        after = tree_digest(copy)
        assert _kept(before, after) == {k: v for k, v in before.items()
                                        if not k.endswith(".lock")}


def _train_argv(root: Path) -> list[str]:
    """The tiny run on the fixture's dataset, its index cache in ``root/cache``."""
    argv = [a for a in train_argv("gpt2", 3) if a != "--mock-data"]
    return [*argv, "--data-path", str(root / "data"), "--data-cache-path", str(root / "cache"),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]


@pytest.fixture(scope="module")
def trained(sound: Sound, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dataset and the index cache a real training run left beside it."""
    root = tmp_path_factory.mktemp("trained")
    for name in ("data.idx", "data.bin"):
        shutil.copy(sound.root / name, root)
    assert pretrain_gpt.main(_train_argv(root)) == 0
    return root


_ENTRY_CASES = {
    "key.json garbage": ("key", 0, b"{"),
    "array truncated": ("array", 0, 1, "truncate", 0.5),
    "lock a directory": ("lock", 0, None, 0.0),
}


@pytest.mark.parametrize("case", list(_ENTRY_CASES))
def test_pretrain_refuses_a_damaged_index_cache(trained: Path, case: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # a stray hang dump would land here, not in the repository
    root = tmp_path / "copy"
    shutil.copytree(trained, root)
    _apply(root, _ENTRY_CASES[case])
    before = tree_digest(root)
    capsys.readouterr()
    assert_main_refuses(pretrain_gpt.main(_train_argv(root)), capsys)
    assert tree_digest(root) == before
