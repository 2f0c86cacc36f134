"""Read Megatron's memory-mapped indexed dataset (``PREFIX.idx`` + ``PREFIX.bin``).

The format is Megatron-LM's and Megatron-DeepSpeed's ``MMIDIDX`` version 1, byte for byte, so
datasets made by either load here unchanged and ours load there. ``.idx`` layout, all
little-endian::

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    u64       version (1)
    u8        dtype code (see DTYPE_CODES)
    u64       n = number of sequences
    u64       d = number of document-index entries (documents + 1)
    int32[n]  sequence lengths in tokens
    int64[n]  byte offset of each sequence in .bin
    int64[d]  document index: first sequence of each document, starting at 0, ending at n

``.bin`` holds the tokens of all sequences back to back. Opening a dataset checks every size
against the file lengths and the offsets against the lengths, so a truncated, corrupt or
mismatched pair fails at start with a message naming the file instead of yielding garbage
tokens hours later. Reading is memory-mapped: opening costs O(1) memory in the data size.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

from megatron3d.errors import DataError
from megatron3d.log import get_logger

logger = get_logger(__name__)

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, doc-index entries

DTYPE_CODES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,  # Megatron-LM; old BigScience code reads 7 (and 6) as float64
    8: np.uint16,
}
CODE_OF_DTYPE: dict[np.dtype, int] = {np.dtype(t): c for c, t in DTYPE_CODES.items()}

_CHECK_CHUNK = 1 << 22  # entries per step when validating offsets: bounded memory on open


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


@dataclass(frozen=True)
class Index:
    """The arrays of one ``.idx`` file, memory-mapped and already validated."""

    dtype: np.dtype
    sizes: np.ndarray  # int32 [n] tokens per sequence
    pointers: np.ndarray  # int64 [n] byte offset of each sequence in .bin
    doc_idx: np.ndarray  # int64 [d] first sequence of each document, then n

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    @property
    def bin_nbytes(self) -> int:
        """Length the matching ``.bin`` must have."""
        if len(self.sizes) == 0:
            return 0
        return int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize


def _fail(path: str, what: str, fix: str) -> DataError:
    return DataError(f"{path}: {what}; {fix}")


def read_index(path: str, bin_nbytes: int | None = None) -> Index:
    """Map and validate ``path`` (an ``.idx`` file); ``bin_nbytes`` resolves dtype code 7.

    Raises ``DataError`` naming the file and the inconsistency.
    """
    if not os.path.isfile(path):
        raise _fail(path, "index file not found",
                    "give --data-path the prefix without .idx/.bin, or run "
                    "tools/preprocess_data.py to make it")
    file_size = os.path.getsize(path)
    if file_size < HEADER.size:
        raise _fail(path, f"truncated index: {file_size} bytes, the header alone needs "
                    f"{HEADER.size}", "re-create it with tools/preprocess_data.py")
    with open(path, "rb") as f:
        magic, version, code, n, d = HEADER.unpack(f.read(HEADER.size))
    _check_header(path, magic, version, code)
    expected = HEADER.size + 12 * n + 8 * d
    if file_size != expected:
        state = "truncated index" if file_size < expected else "index has trailing bytes"
        raise _fail(path, f"{state}: header says {n} sequences and {d} document-index entries "
                    f"({expected} bytes) but the file has {file_size} bytes",
                    "the file is corrupt or incomplete; re-create it with "
                    "tools/preprocess_data.py")
    buf = np.memmap(path, dtype=np.uint8, mode="r") if file_size else np.empty(0, np.uint8)
    sizes = np.frombuffer(buf, np.int32, count=n, offset=HEADER.size)
    pointers = np.frombuffer(buf, np.int64, count=n, offset=HEADER.size + 4 * n)
    doc_idx = np.frombuffer(buf, np.int64, count=d, offset=HEADER.size + 12 * n)
    dtype = _resolve_dtype(path, code, sizes, bin_nbytes)
    index = Index(dtype=dtype, sizes=sizes, pointers=pointers, doc_idx=doc_idx)
    _check_arrays(path, index)
    return index


def _check_header(path: str, magic: bytes, version: int, code: int) -> None:
    if magic != MAGIC:
        raise _fail(path, f"bad magic {magic!r}, expected {MAGIC!r}",
                    "this is not a Megatron mmap indexed dataset (legacy 'lazy'/'cached' "
                    "datasets are not supported); re-create it with tools/preprocess_data.py")
    if version != VERSION:
        raise _fail(path, f"unsupported index version {version}, expected {VERSION}",
                    "re-create it with tools/preprocess_data.py")
    if code not in DTYPE_CODES:
        raise _fail(path, f"unknown dtype code {code}, expected one of "
                    f"{sorted(DTYPE_CODES)}", "re-create it with tools/preprocess_data.py")


def _resolve_dtype(path: str, code: int, sizes: np.ndarray, bin_nbytes: int | None) -> np.dtype:
    """Code 7 is float32 in Megatron-LM but float64 in old BigScience code: ask the .bin size."""
    dtype = np.dtype(DTYPE_CODES[code])
    if code != 7 or bin_nbytes is None:
        return dtype
    tokens = int(sizes.sum(dtype=np.int64))
    if tokens and bin_nbytes == tokens * 8 and bin_nbytes != tokens * 4:
        logger.warning("%s: dtype code 7 with an 8-byte-per-token .bin: reading it as "
                       "float64, as old BigScience code wrote it", path)
        return np.dtype(np.float64)
    return dtype


def _check_arrays(path: str, index: Index) -> None:
    """Offsets must be the running sum of lengths; the document index must be sane."""
    n, doc_idx = len(index.sizes), index.doc_idx
    fix = "the file is corrupt; re-create it with tools/preprocess_data.py"
    if len(doc_idx) == 0 or doc_idx[0] != 0 or doc_idx[-1] != n:
        first = doc_idx[0] if len(doc_idx) else None
        last = doc_idx[-1] if len(doc_idx) else None
        raise _fail(path, f"document index must run from 0 to {n} (the number of sequences), "
                    f"got first={first} last={last}", fix)
    item = index.dtype.itemsize
    expected_next = 0
    for lo in range(0, n, _CHECK_CHUNK):
        sizes = index.sizes[lo:lo + _CHECK_CHUNK]
        if (sizes < 0).any():
            raise _fail(path, f"negative sequence length near sequence {lo}", fix)
        ends = np.cumsum(sizes, dtype=np.int64) * item + expected_next
        starts = np.concatenate(([expected_next], ends[:-1]))
        bad = np.flatnonzero(index.pointers[lo:lo + len(sizes)] != starts)
        if len(bad):
            i = lo + int(bad[0])
            raise _fail(path, f"byte offset of sequence {i} is {int(index.pointers[i])}, "
                        f"expected {int(starts[bad[0]])} from the sequence lengths", fix)
        expected_next = int(ends[-1])
    for lo in range(0, len(doc_idx), _CHECK_CHUNK):
        step = np.diff(doc_idx[max(lo - 1, 0):lo + _CHECK_CHUNK])
        if (step < 0).any():
            raise _fail(path, f"document index decreases near entry {lo}", fix)


class IndexedDataset:
    """Sequences of tokens from ``PREFIX.bin``, located by ``PREFIX.idx``.

    ``len(ds)`` is the number of sequences (what the GPT dataset calls documents); ``ds[i]``
    and ``ds.get(i, offset, length)`` return numpy views into the memory-mapped ``.bin``.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        bin_path = data_file_path(prefix)
        if not os.path.isfile(bin_path):
            raise _fail(bin_path, "data file not found",
                        "the .idx and .bin of a dataset must sit side by side with the same "
                        "prefix; re-create them with tools/preprocess_data.py")
        bin_nbytes = os.path.getsize(bin_path)
        self.index = read_index(index_file_path(prefix), bin_nbytes)
        if bin_nbytes != self.index.bin_nbytes:
            raise _fail(bin_path, f"size mismatch: {bin_nbytes} bytes, but "
                        f"{index_file_path(prefix)} describes {self.index.bin_nbytes} bytes "
                        f"({self.index.num_tokens} tokens of {self.index.dtype.name})",
                        "the .bin and .idx come from different runs or one is truncated; "
                        "re-create both with tools/preprocess_data.py")
        self._bin = (np.memmap(bin_path, dtype=np.uint8, mode="r") if bin_nbytes
                     else np.empty(0, np.uint8))

    @property
    def dtype(self) -> np.dtype:
        return self.index.dtype

    @property
    def sizes(self) -> np.ndarray:
        return self.index.sizes

    @property
    def doc_idx(self) -> np.ndarray:
        return self.index.doc_idx

    @property
    def num_documents(self) -> int:
        return len(self.index.doc_idx) - 1

    def __len__(self) -> int:
        return len(self.index.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset .. offset+length`` of sequence ``i`` (to its end by default)."""
        size = int(self.index.sizes[i])
        if length is None:
            length = size - offset
        assert offset >= 0 and offset + length <= size, (i, offset, length, size)
        start = int(self.index.pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, count=length, offset=start)
