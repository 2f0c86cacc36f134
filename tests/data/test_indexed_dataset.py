"""The Megatron mmap indexed format: exact bytes, round trips, merge, and corrupt files."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from megatron3d.data.indexed_dataset import IndexedDataset
from megatron3d.data.prep import indexed_builder
from megatron3d.data.prep.indexed_builder import IndexedDatasetBuilder, best_dtype, merge_datasets
from megatron3d.errors import DataError

DOCS = [[1, 2, 3], [4, 5]]


def golden_idx(dtype_code: int, sizes: list[int], itemsize: int, doc_idx: list[int]) -> bytes:
    """The .idx bytes, spelled out field by field as the format describes them."""
    pointers, offset = [], 0
    for size in sizes:
        pointers.append(offset)
        offset += size * itemsize
    return (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", dtype_code)
            + struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(doc_idx))
            + struct.pack(f"<{len(sizes)}i", *sizes) + struct.pack(f"<{len(sizes)}q", *pointers)
            + struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def write(prefix, docs, dtype=np.uint16):
    with IndexedDatasetBuilder(str(prefix), dtype) as builder:
        for doc in docs:
            builder.add_document(doc)
        builder.finalize()
    return str(prefix)


def test_golden_bytes(tmp_path):
    prefix = write(tmp_path / "tiny", DOCS)
    assert (tmp_path / "tiny.idx").read_bytes() == golden_idx(8, [3, 2], 2, [0, 1, 2])
    assert (tmp_path / "tiny.bin").read_bytes() == struct.pack("<5H", 1, 2, 3, 4, 5)
    ds = IndexedDataset(prefix)
    assert len(ds) == 2 and ds.num_documents == 2 and ds.dtype == np.uint16
    assert ds[0].tolist() == [1, 2, 3] and ds.get(1, 1, 1).tolist() == [5]


def test_reads_hand_made_files_with_multi_sequence_documents(tmp_path):
    """A file made without our writer (as another Megatron would write it) reads back."""
    (tmp_path / "hand.idx").write_bytes(golden_idx(4, [2, 1, 3], 4, [0, 2, 3]))
    (tmp_path / "hand.bin").write_bytes(struct.pack("<6i", 10, 11, 12, 13, 14, -15))
    ds = IndexedDataset(str(tmp_path / "hand"))
    assert [ds[i].tolist() for i in range(3)] == [[10, 11], [12], [13, 14, -15]]
    assert ds.doc_idx.tolist() == [0, 2, 3] and ds.num_documents == 2


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.int64,
                                   np.uint16, np.float64, np.float32])
def test_round_trip(tmp_path, dtype):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 100, size=n).astype(dtype) for n in (5, 0, 17, 1, 64)]
    ds = IndexedDataset(write(tmp_path / "rt", docs, dtype))
    assert ds.dtype == np.dtype(dtype) and len(ds) == len(docs)
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)


def test_documents_with_several_sequences_and_empty_output(tmp_path):
    with IndexedDatasetBuilder(str(tmp_path / "multi"), np.int32) as builder:
        builder.add_document([1, 2, 3, 4, 5], lengths=[2, 3])
        builder.add_sequence([6])
        builder.finalize()  # closes the pending document
    ds = IndexedDataset(str(tmp_path / "multi"))
    assert ds.sizes.tolist() == [2, 3, 1] and ds.doc_idx.tolist() == [0, 2, 3]
    empty = write(tmp_path / "empty", [])
    assert len(IndexedDataset(empty)) == 0


def test_streaming_spills_to_temp_files(tmp_path, monkeypatch):
    """Tiny buffers force many spills; the result equals the plain one."""
    monkeypatch.setattr(indexed_builder, "_BUFFER", 3)
    docs = [[i] * (i % 4) for i in range(50)]
    ds = IndexedDataset(write(tmp_path / "spill", docs, np.int64))
    assert [ds[i].tolist() for i in range(len(ds))] == docs
    with IndexedDatasetBuilder(str(tmp_path / "bulk"), np.int64) as builder:
        builder.add_documents(np.concatenate([np.asarray(d, np.int64) for d in docs]),
                              np.array([len(d) for d in docs]))
        builder.finalize()
    bulk = IndexedDataset(str(tmp_path / "bulk"))  # empty documents get no sequence
    assert [bulk[i].tolist() for i in range(len(bulk))] == [d for d in docs if d]
    assert bulk.num_documents == len(docs)
    assert sorted(os.listdir(tmp_path)) == ["bulk.bin", "bulk.idx", "spill.bin", "spill.idx"]


def test_failed_build_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), IndexedDatasetBuilder(str(tmp_path / "x"), np.int32) as b:
        b.add_document([1, 2])
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_token_that_does_not_fit_the_dtype(tmp_path):
    with pytest.raises(DataError, match="does not fit uint16.*wider --dtype"), \
            IndexedDatasetBuilder(str(tmp_path / "x"), np.uint16) as builder:
        builder.add_document([70000])
    assert best_dtype(50257) == np.uint16 and best_dtype(128000) == np.int32


def test_merge(tmp_path):
    a = write(tmp_path / "a", DOCS)
    with IndexedDatasetBuilder(str(tmp_path / "b"), np.uint16) as builder:
        builder.add_document([7, 8, 9], lengths=[1, 2])
        builder.finalize()
    merge_datasets([a, str(tmp_path / "b"), a], str(tmp_path / "m"))
    m = IndexedDataset(str(tmp_path / "m"))
    assert [m[i].tolist() for i in range(len(m))] == [[1, 2, 3], [4, 5], [7], [8, 9],
                                                      [1, 2, 3], [4, 5]]
    assert m.doc_idx.tolist() == [0, 1, 2, 4, 5, 6]
    write(tmp_path / "c", DOCS, np.int32)
    with pytest.raises(DataError, match="c: dtype int32 differs"):
        merge_datasets([a, str(tmp_path / "c")], str(tmp_path / "bad"))


def test_float32_warns_and_old_float64_code_7_is_read(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        write(tmp_path / "f", [np.array([1.5, 2.5], np.float32)], np.float32)
    assert "code 7" in caplog.text
    (tmp_path / "old.idx").write_bytes(golden_idx(7, [2], 8, [0, 1]))
    (tmp_path / "old.bin").write_bytes(struct.pack("<2d", 1.5, 2.5))
    old = IndexedDataset(str(tmp_path / "old"))
    assert old.dtype == np.float64 and old[0].tolist() == [1.5, 2.5]


def corrupt_cases(tmp_path):
    """(name, how to damage a valid pair, file named in the error, phrase in the error)."""
    good = golden_idx(8, [3, 2], 2, [0, 1, 2])
    idx, bin_ = tmp_path / "d.idx", tmp_path / "d.bin"
    return [
        ("bad magic", lambda: idx.write_bytes(b"NOTMAGIC!" + good[9:]), idx, "bad magic"),
        ("bad version", lambda: idx.write_bytes(good[:9] + struct.pack("<Q", 2) + good[17:]),
         idx, "unsupported index version 2"),
        ("bad dtype", lambda: idx.write_bytes(good[:17] + b"\x09" + good[18:]), idx,
         "unknown dtype code 9"),
        ("truncated header", lambda: idx.write_bytes(good[:20]), idx, "truncated index"),
        ("truncated arrays", lambda: idx.write_bytes(good[:-4]), idx, "truncated index"),
        ("trailing bytes", lambda: idx.write_bytes(good + b"\0"), idx, "trailing bytes"),
        ("bin too short", lambda: bin_.write_bytes(bin_.read_bytes()[:-2]), bin_,
         "size mismatch: 8 bytes.*describes 10 bytes"),
        ("bin too long", lambda: bin_.write_bytes(bin_.read_bytes() + b"\0\0"), bin_,
         "size mismatch"),
        ("missing idx", idx.unlink, idx, "index file not found"),
        ("missing bin", bin_.unlink, bin_, "data file not found"),
        ("bad pointer", lambda: idx.write_bytes(good[:50] + struct.pack("<q", 4) + good[58:]),
         idx, "byte offset of sequence 1 is 4, expected 6"),
        ("bad doc index", lambda: idx.write_bytes(good[:-8] + struct.pack("<q", 1)), idx,
         "document index must run from 0 to 2"),
    ]


@pytest.mark.parametrize("case", range(12))
def test_corrupt_files_fail_with_a_clear_message(tmp_path, case):
    name, damage, named, phrase = corrupt_cases(tmp_path)[case]
    write(tmp_path / "d", DOCS)
    damage()
    with pytest.raises(DataError, match=phrase) as info:
        IndexedDataset(str(tmp_path / "d"))
    message = str(info.value)
    assert message.startswith(str(named) + ":"), (name, message)
    assert "\n" not in message and ("re-create" in message or "preprocess" in message), message
