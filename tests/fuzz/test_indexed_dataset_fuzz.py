"""Damaged ``.idx``/``.bin`` pairs: opened as training opens them, they fail with one
``DataError`` line (or open, only when still a valid dataset), never another exception.

Mutations start from one valid dataset: truncation of either file, overwritten bytes, header
fields (magic, version, dtype code, counts) and array entries set to edge values, random
garbage, appended bytes, swapped or missing files. A small independent reading of the format
(``_valid``, from docs/ARCHITECTURE.md §4) says which results are still valid, so the reader must
neither refuse a good pair nor accept a bad one.
"""

from __future__ import annotations

import os
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

import pretrain_gpt
from megatron3d.data.builder import build_datasets
from megatron3d.data.indexed_dataset import IndexedDataset
from megatron3d.data.prep.indexed_builder import IndexedDatasetBuilder
from megatron3d.errors import ConfigError, DataError
from tests.fuzz.common import assert_main_refuses, attempt, fuzz, tree_digest
from tests.helpers.tiny import train_argv

VOCAB = 600  # the dataset's ids stay below it; flipped .bin bytes may not
_HEADER = struct.Struct("<9sQBQQ")
_FIELDS = {"magic": (0, 9), "version": (9, 8), "code": (17, 1), "n": (18, 8), "d": (26, 8)}
_ITEMSIZE = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}
_EDGES = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 255, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63,
          2**64 - 1]


@pytest.fixture(scope="module")
def valid_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, bytes]:
    """A small uint16 dataset with empty and multi-sequence documents: (.idx, .bin) bytes."""
    prefix = str(tmp_path_factory.mktemp("valid") / "data")
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for n in (9, 0, 17, 4, 30, 12, 7, 25):
            builder.add_document(rng.integers(0, VOCAB, size=n))
        builder.add_document(rng.integers(0, VOCAB, size=10), lengths=[3, 7])
        builder.finalize()
    return Path(prefix + ".idx").read_bytes(), Path(prefix + ".bin").read_bytes()


def _valid(idx: bytes | None, bin_: bytes | None) -> bool:
    """Whether the pair is a dataset per the format spec (code 7 may be 8 bytes a token)."""
    if idx is None or bin_ is None or len(idx) < _HEADER.size:
        return False
    magic, version, code, n, d = _HEADER.unpack_from(idx)
    if magic != b"MMIDIDX\x00\x00" or version != 1 or code not in _ITEMSIZE:
        return False
    if len(idx) != _HEADER.size + 12 * n + 8 * d or d == 0:
        return False
    sizes = np.frombuffer(idx, "<i4", n, _HEADER.size).astype(np.int64)
    pointers = np.frombuffer(idx, "<i8", n, _HEADER.size + 4 * n)
    doc = np.frombuffer(idx, "<i8", d, _HEADER.size + 12 * n)
    if (sizes < 0).any() or doc[0] != 0 or doc[-1] != n or (np.diff(doc) < 0).any():
        return False
    tokens = int(sizes.sum())
    itemsizes = [_ITEMSIZE[code]]
    if code == 7 and tokens and len(bin_) == 8 * tokens:
        itemsizes = [8]  # old BigScience float64 files
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    return any(len(bin_) == tokens * item and np.array_equal(pointers, starts * item)
               for item in itemsizes)


def _set_field(data: bytearray, name: str, value: int | bytes) -> None:
    offset, width = _FIELDS[name]
    raw = value if isinstance(value, bytes) else (value % 2 ** (8 * width)).to_bytes(width,
                                                                                    "little")
    data[offset:offset + width] = raw[:width].ljust(width, b"\x00")


def _set_entry(data: bytearray, array: str, index: int, value: int) -> None:
    """Set entry ``index`` (mod its length) of the sizes, pointers or document index."""
    if len(data) < _HEADER.size:
        return
    _, _, _, n, d = _HEADER.unpack_from(data)
    start, width, count = {"sizes": (_HEADER.size, 4, n),
                           "pointers": (_HEADER.size + 4 * n, 8, n),
                           "doc_idx": (_HEADER.size + 12 * n, 8, d)}[array]
    if count == 0 or start + width * count > len(data):
        return
    at = start + width * (index % count)
    data[at:at + width] = (value % 2 ** (8 * width)).to_bytes(width, "little")


_WHICH = st.sampled_from(["idx", "bin"])
_MUTATION = st.one_of(
    st.tuples(st.just("truncate"), _WHICH, st.floats(0, 1)),
    st.tuples(st.just("overwrite"), _WHICH, st.floats(0, 1), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("field"), st.sampled_from(sorted(_FIELDS)),
              st.one_of(st.sampled_from(_EDGES), st.integers(0, 2**64 - 1),
                        st.binary(min_size=1, max_size=9))),
    st.tuples(st.just("entry"), st.sampled_from(["sizes", "pointers", "doc_idx"]),
              st.integers(0, 50), st.one_of(st.sampled_from(_EDGES), st.integers(-2**63, 2**63),
                                            st.integers(-3, 40))),
    st.tuples(st.just("garbage"), _WHICH, st.binary(max_size=200)),
    # changes a reader must accept: a same-width dtype, another token id (maybe too large)
    st.tuples(st.just("field"), st.just("code"), st.sampled_from([3, 8])),
    st.tuples(st.just("overwrite"), st.just("bin"), st.floats(0, 1),
              st.sampled_from([VOCAB - 1, VOCAB, 2**16 - 1]).map(
                  lambda token: token.to_bytes(2, "little"))),
    st.tuples(st.just("append"), _WHICH, st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("swap")),
    st.tuples(st.just("remove"), _WHICH),
)


def _mutate(files: dict[str, bytearray | None], mutation: tuple) -> None:
    kind, *args = mutation
    if kind == "swap":
        files["idx"], files["bin"] = files["bin"], files["idx"]
        return
    if kind in ("field", "entry"):
        if files["idx"] is not None:
            (_set_field if kind == "field" else _set_entry)(files["idx"], *args)
        return
    which, *rest = args
    data = files[which]
    if kind == "remove" or data is None:
        files[which] = None
    elif kind == "truncate":
        del data[int(rest[0] * len(data)):]
    elif kind == "overwrite":
        at = int(rest[0] * len(data))
        data[at:at + len(rest[1])] = rest[1]
    elif kind == "garbage":
        files[which] = bytearray(rest[0])
    else:  # append
        data.extend(rest[0])


def _write_pair(directory: str, files: dict[str, bytearray | None]) -> str:
    prefix = os.path.join(directory, "data")
    for ext, data in files.items():
        if data is not None:
            Path(f"{prefix}.{ext}").write_bytes(bytes(data))
    return prefix


def _check_opened(ds: IndexedDataset, idx: bytes, bin_: bytes) -> None:
    """An accepted pair reads back exactly the bytes the spec says it holds."""
    _, _, _, n, _ = _HEADER.unpack_from(idx)
    assert len(ds) == n
    sizes = np.frombuffer(idx, "<i4", n, _HEADER.size)
    pointers = np.frombuffer(idx, "<i8", n, _HEADER.size + 4 * n)
    for i in range(n):
        got = ds[i]
        assert len(got) == sizes[i]
        start = int(pointers[i])
        assert got.tobytes() == bin_[start:start + got.nbytes]


@fuzz(max_examples=600)
@given(mutations=st.lists(_MUTATION, min_size=1, max_size=3))
def test_a_damaged_dataset_is_refused_with_one_data_error(valid_pair: tuple[bytes, bytes],
                                                          mutations: list[tuple]) -> None:
    files: dict[str, bytearray | None] = {"idx": bytearray(valid_pair[0]),
                                          "bin": bytearray(valid_pair[1])}
    for mutation in mutations:
        _mutate(files, mutation)
    idx, bin_ = (None if files[k] is None else bytes(files[k]) for k in ("idx", "bin"))
    with tempfile.TemporaryDirectory() as directory:
        prefix = _write_pair(directory, files)
        before = tree_digest(Path(directory))
        ds, err = attempt(lambda: IndexedDataset(prefix), DataError)
        assert (err is None) == _valid(idx, bin_), f"valid={_valid(idx, bin_)}, error={err}"
        event("opened" if err is None else "refused: " + str(err).partition(": ")[2][:30])
        if ds is not None:
            _check_opened(ds, idx, bin_)
            _build_and_read(prefix, os.path.join(directory, "cache"))
        after = tree_digest(Path(directory))
        assert {k: v for k, v in after.items() if not k.startswith("cache")} == before


def _build_and_read(prefix: str, cache: str) -> None:
    """The training path: datasets built (index cached) and every sample read."""
    sets, _ = attempt(lambda: build_datasets(
        data_path=prefix, seq_length=8, seed=5, train_samples=12, valid_samples=4,
        data_cache_path=cache, vocab_size=VOCAB), DataError, ConfigError)
    for split in (sets.train, sets.valid) if sets is not None else ():
        if split is not None:
            attempt(lambda split=split: split.samples(0, len(split)), DataError)


# A handful of damaged pairs through the whole entry point: exit 2, one line, files kept.
_ENTRY_CASES = {
    "truncated idx": [("truncate", "idx", 0.5)],
    "bad magic": [("field", "magic", b"NOTMMIDX\x00")],
    "unknown dtype": [("field", "code", 9)],
    "huge count": [("field", "n", 2**63)],
    "pointer off by one": [("entry", "pointers", 3, 1)],
    "short bin": [("truncate", "bin", 0.9)],
}


@pytest.mark.parametrize("mutations", list(_ENTRY_CASES.values()), ids=list(_ENTRY_CASES))
def test_pretrain_refuses_a_damaged_dataset(valid_pair: tuple[bytes, bytes],
                                            mutations: list[tuple], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # a stray hang dump would land here, not in the repository
    files: dict[str, bytearray | None] = {"idx": bytearray(valid_pair[0]),
                                          "bin": bytearray(valid_pair[1])}
    for mutation in mutations:
        _mutate(files, mutation)
    prefix = _write_pair(str(tmp_path), files)
    before = tree_digest(tmp_path)
    argv = [a for a in train_argv("gpt2", 3) if a != "--mock-data"]
    argv += ["--data-path", prefix, "--tokenizer-type", "NullTokenizer",
             "--vocab-size", str(VOCAB)]
    assert_main_refuses(pretrain_gpt.main(argv), capsys)
    assert tree_digest(tmp_path) == before
