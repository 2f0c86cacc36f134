"""Write Megatron indexed datasets by streaming, and merge several into one.

Why temp files and not in-memory lists: a corpus can hold billions of sequences, and the
``.idx`` needs all lengths before the offsets and document index. Tokens go straight to
``.bin``; lengths (int32) and document boundaries (int64) are buffered in fixed-size arrays
and spilled to two temp files beside the output, so memory stays O(1) in the number of
documents (a few MiB of buffers). ``finalize`` streams the ``.idx`` out of the temp files
chunk by chunk (offsets are a running sum carried across chunks), then renames ``.bin`` and
``.idx`` into place, ``.idx`` last: a dataset whose ``.idx`` exists is complete.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from array import array
from collections.abc import Sequence

import numpy as np

from megatron3d.data.indexed_dataset import (
    CODE_OF_DTYPE,
    HEADER,
    MAGIC,
    VERSION,
    IndexedDataset,
    data_file_path,
    index_file_path,
)
from megatron3d.errors import DataError
from megatron3d.log import get_logger

logger = get_logger(__name__)

_BUFFER = 1 << 20  # entries buffered in memory before spilling to a temp file
_COPY = 1 << 24  # bytes per copy step when merging


def best_dtype(vocab_size: int) -> np.dtype:
    """The narrowest token dtype Megatron uses for a vocabulary: uint16 below 65500, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


class _Spill:
    """An append-only typed array kept in a temp file, with an in-memory tail."""

    def __init__(self, path: str, typecode: str) -> None:
        self.path, self.count = path, 0
        self._tail = array(typecode)
        self._dtype = np.dtype(np.int32 if typecode == "i" else np.int64)
        self._file = open(path, "wb")  # noqa: SIM115 - closed in discard

    def append(self, value: int) -> None:
        self._tail.append(value)
        self.count += 1
        if len(self._tail) >= _BUFFER:
            self._tail.tofile(self._file)
            del self._tail[:]

    def extend(self, values: np.ndarray) -> None:
        self.flush()
        values.astype(self._dtype, copy=False).tofile(self._file)
        self.count += len(values)

    def flush(self) -> None:
        if len(self._tail):
            self._tail.tofile(self._file)
            del self._tail[:]

    def chunks(self, size: int = _BUFFER):
        """Yield the whole array back, ``size`` entries at a time."""
        self.flush()
        self._file.flush()
        with open(self.path, "rb") as f:
            while chunk := f.read(size * self._tail.itemsize):
                yield np.frombuffer(chunk, self._dtype)

    def discard(self) -> None:
        self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)


class IndexedDatasetBuilder:
    """Stream sequences into ``PREFIX.bin``/``PREFIX.idx``.

    ``add_sequence`` appends one sequence to the current document, ``end_document`` closes it;
    ``add_document`` does both. Use as a context manager: leaving the block without
    ``finalize`` (an exception) removes the partial files. Token ids must fit ``dtype``.
    """

    def __init__(self, prefix: str, dtype: np.dtype | type) -> None:
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise DataError(f"{prefix}: token dtype {self.dtype} has no indexed-dataset code; "
                            f"use one of {sorted(str(d) for d in CODE_OF_DTYPE)}")
        if self.dtype == np.float32:
            logger.warning("%s: writing float32 as dtype code 7 (Megatron-LM); old BigScience "
                           "readers take code 7 for float64", prefix)
        self._limits = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        self._tmp = f"{prefix}.tmp{os.getpid()}"
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._bin = open(self._tmp + ".bin", "wb")  # noqa: SIM115 - closed in finalize/abort
        self._sizes = _Spill(self._tmp + ".sizes", "i")
        self._docs = _Spill(self._tmp + ".docs", "q")
        self._docs.append(0)
        self._last_doc_end = 0
        self._done = False

    def add_sequence(self, tokens: Sequence[int] | np.ndarray) -> None:
        values = np.asarray(tokens)
        self._check_range(values)
        self._bin.write(values.astype(self.dtype, copy=False).tobytes())
        self._sizes.append(len(values))

    def _check_range(self, values: np.ndarray) -> None:
        if self._limits is None or not values.size:
            return
        low, high = values.min(), values.max()
        if low < self._limits.min or high > self._limits.max:
            bad = high if high > self._limits.max else low
            raise DataError(f"{self.prefix}: token id {bad} does not fit {self.dtype}; choose "
                            "a wider --dtype (int32 for vocabularies of 65500 or more)")

    def end_document(self) -> None:
        self._docs.append(self._sizes.count)
        self._last_doc_end = self._sizes.count

    def add_document(self, tokens: Sequence[int] | np.ndarray,
                     lengths: Sequence[int] | None = None) -> None:
        """One document: ``tokens`` as one sequence, or cut into sequences of ``lengths``."""
        values = np.asarray(tokens)
        if lengths is None:
            self.add_sequence(values)
        else:
            assert sum(lengths) == len(values), "lengths must add up to the tokens"
            start = 0
            for length in lengths:
                self.add_sequence(values[start:start + length])
                start += length
        self.end_document()

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Many one-sequence documents at once: ``tokens`` concatenated, ``lengths`` each.

        An empty document gets no sequence, only a document boundary (as Megatron does).
        """
        assert int(lengths.sum()) == len(tokens), "lengths must add up to the tokens"
        self._check_range(tokens)
        self._close_open_document()
        self._bin.write(np.asarray(tokens).astype(self.dtype, copy=False).tobytes())
        nonempty = lengths > 0
        base = self._sizes.count
        self._sizes.extend(lengths[nonempty])
        self._docs.extend(base + np.cumsum(nonempty, dtype=np.int64))
        self._last_doc_end = self._sizes.count

    def append_dataset(self, prefix: str) -> None:
        """Append every document of an existing dataset (same dtype) in order."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise DataError(f"{prefix}: dtype {other.dtype} differs from the output's "
                            f"{self.dtype}; merge only datasets made with the same --dtype")
        self._close_open_document()
        base = self._sizes.count
        self._sizes.extend(np.asarray(other.sizes))
        self._docs.extend(np.asarray(other.doc_idx[1:]) + base)
        self._last_doc_end = self._sizes.count
        self._bin.flush()
        with open(data_file_path(prefix), "rb") as src:
            shutil.copyfileobj(src, self._bin, _COPY)

    def finalize(self) -> None:
        """Write the ``.idx`` and move both files into place (a pending document is closed)."""
        self._close_open_document()
        self._bin.close()
        with open(self._tmp + ".idx", "wb") as out:
            code = CODE_OF_DTYPE[self.dtype]
            out.write(HEADER.pack(MAGIC, VERSION, code, self._sizes.count, self._docs.count))
            for chunk in self._sizes.chunks():
                out.write(chunk.tobytes())
            offset = 0
            for chunk in self._sizes.chunks():
                ends = np.cumsum(chunk, dtype=np.int64) * self.dtype.itemsize + offset
                out.write(np.concatenate(([offset], ends[:-1])).astype(np.int64).tobytes())
                offset = int(ends[-1])
            for chunk in self._docs.chunks():
                out.write(chunk.tobytes())
        os.replace(self._tmp + ".bin", data_file_path(self.prefix))
        os.replace(self._tmp + ".idx", index_file_path(self.prefix))
        self._sizes.discard()
        self._docs.discard()
        self._done = True

    def abort(self) -> None:
        """Remove every partial file; the output prefix is left untouched."""
        self._bin.close()
        self._sizes.discard()
        self._docs.discard()
        for suffix in (".bin", ".idx"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._tmp + suffix)
        self._done = True

    def _close_open_document(self) -> None:
        """Sequences added since the last ``end_document`` form one more document."""
        if self._sizes.count != self._last_doc_end:
            self.end_document()

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._done:
            self.abort()


def merge_datasets(prefixes: Sequence[str], output_prefix: str) -> None:
    """Concatenate datasets (documents in the given order) into ``output_prefix``."""
    if not prefixes:
        raise DataError(f"{output_prefix}: nothing to merge; give at least one input prefix")
    dtype = IndexedDataset(prefixes[0]).dtype
    with IndexedDatasetBuilder(output_prefix, dtype) as builder:
        for prefix in prefixes:
            builder.append_dataset(prefix)
        builder.finalize()
