"""A GPT dataset: fixed-length samples over one document range of one indexed dataset.

Sample ``i`` is a pure function of (data, document range, seq_length, seed, epochs, i), so
``samples(consumed, n)`` gives exact resume and the same global batch on every layout. The
index arrays (see ``sample_index``) are cached through ``IndexCache``.
"""

from __future__ import annotations

import os
import time
import zlib

import numpy as np
import torch

from megatron3d import device as devices
from megatron3d.data.index_cache import IndexCache, dataset_identity
from megatron3d.data.indexed_dataset import IndexedDataset, index_file_path
from megatron3d.data.sample_index import (
    FORMAT_VERSION,
    SampleIndex,
    build_sample_index,
    gather_samples,
    index_peak_bytes,
    num_epochs_for,
    samples_in_epochs,
)
from megatron3d.data.sample_index_check import sample_index_problem
from megatron3d.errors import DataError
from megatron3d.log import get_logger

logger = get_logger(__name__)


def require_token_dtype(indexed: IndexedDataset) -> None:
    """Refuse a float dataset: its values are no token ids, and reading them as ids would
    silently truncate them. (The indexed format itself may hold floats.)"""
    if indexed.dtype.kind not in "iu":
        raise DataError(f"{index_file_path(indexed.prefix)}: dtype {indexed.dtype} is not a "
                        "token dtype (a GPT model reads integer token ids); re-create the "
                        "dataset from the text with tools/preprocess_data.py")


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens from documents ``[first, last)`` of ``indexed``.

    Holds at least ``num_samples`` samples (every sample of the whole epochs they need).
    ``name`` ("train", "valid", "test") names the split in logs and the cache, and salts the
    seed, so two splits of one dataset are shuffled independently. ``vocab_size``, when given,
    is checked on every batch: a token outside the vocabulary raises ``DataError``.
    """

    def __init__(self, indexed: IndexedDataset, documents: range, *, name: str,
                 seq_length: int, num_samples: int, seed: int, cache: IndexCache,
                 vocab_size: int | None = None) -> None:
        require_token_dtype(indexed)
        if not 0 <= documents.start <= documents.stop <= len(indexed):
            raise DataError(f"{indexed.prefix}: document range {documents} outside the "
                            f"dataset's {len(indexed)} documents")
        self.indexed, self.name, self.seq_length = indexed, name, seq_length
        self.documents, self.vocab_size = documents, vocab_size
        self.tokens_per_epoch = int(indexed.sizes[documents.start:documents.stop]
                                    .sum(dtype=np.int64))
        if self.tokens_per_epoch == 0:
            raise DataError(f"{indexed.prefix}: the {name} split (documents {documents.start}"
                            f"..{documents.stop}) holds no tokens; change --split or add data")
        self.num_epochs = num_epochs_for(self.tokens_per_epoch, seq_length, max(num_samples, 1))
        _check_index_fits(indexed.prefix, name, len(documents), self.num_epochs, num_samples)
        key = {"kind": "gpt", "format": FORMAT_VERSION, "data": dataset_identity(indexed.prefix),
               "documents": [documents.start, documents.stop], "seq_length": seq_length,
               "epochs": self.num_epochs, "seed": seed, "split": name}
        started = time.perf_counter()
        split_seed = seed + (zlib.crc32(name.encode()) << 32)  # splits shuffle apart
        entry = f"{os.path.basename(indexed.prefix)}_{name}_{seq_length}s_{self.num_epochs}ep"
        arrays = cache.get_or_build(
            entry, key,
            lambda: build_sample_index(indexed.sizes,
                                       np.arange(documents.start, documents.stop),
                                       seq_length, self.num_epochs, split_seed).arrays())
        wrong = sample_index_problem(arrays, indexed.sizes, documents, seq_length,
                                     self.num_epochs, samples_in_epochs(
                                         self.tokens_per_epoch, seq_length, self.num_epochs))
        if wrong is not None:  # a cache entry damaged since it was written
            raise DataError(f"{cache.entry_path(entry, key)}: damaged index cache entry "
                            f"({wrong}); delete the directory and it will be rebuilt")
        self.index = SampleIndex.from_arrays(arrays)
        assert len(self.index) == samples_in_epochs(self.tokens_per_epoch, seq_length,
                                                    self.num_epochs)
        logger.info(" > %s %s: %s documents, %s tokens per epoch, %d epoch(s), %s samples "
                    "(%.2fs)", name, os.path.basename(indexed.prefix), f"{len(documents):,}",
                    f"{self.tokens_per_epoch:,}", self.num_epochs, f"{len(self):,}",
                    time.perf_counter() - started)

    def __len__(self) -> int:
        return len(self.index)

    def samples(self, start: int, count: int) -> torch.Tensor:
        """Samples ``start .. start+count-1``: int64 [count, seq_length + 1]."""
        return torch.from_numpy(self.samples_at(np.arange(start, start + count)))

    def samples_at(self, ids: np.ndarray) -> np.ndarray:
        """Samples with the given ids (any order): int64 numpy [len(ids), seq_length + 1]."""
        if len(ids) and (ids.min() < 0 or ids.max() >= len(self)):
            raise DataError(f"{self.indexed.prefix}: {self.name} sample {int(ids.max())} asked "
                            f"for, but the dataset was built for {len(self)} samples; build it "
                            "for more samples (--train-samples/--train-iters, --eval-iters)")
        out = gather_samples(self.index, self._read, ids, self.seq_length)
        if self.vocab_size is not None and out.size:
            self._check_vocabulary(int(out.min()), int(out.max()))
        return out

    def _check_vocabulary(self, low: int, high: int) -> None:
        """An id outside [0, vocab) would crash the embedding with a traceback; the batch's
        min and max on the host are O(batch), where scanning the whole dataset is not."""
        if low >= 0 and high < self.vocab_size:
            return
        raise DataError(f"token id {low if low < 0 else high} is outside the vocabulary of "
                        f"{self.vocab_size} in {self.indexed.prefix}: the data was tokenized "
                        "with another tokenizer; give the --tokenizer-type (and files) it was "
                        "made with, or re-run tools/preprocess_data.py with this one")

    def _read(self, doc: int, start: int, stop: int | None) -> np.ndarray:
        length = None if stop is None else stop - start
        return self.indexed.get(doc, start, length)


def _check_index_fits(prefix: str, name: str, documents: int, epochs: int, samples: int) -> None:
    """A run length far beyond the data (``--train-samples 1e12``) would build an index of
    terabytes and die of memory; say so before building."""
    need, have = index_peak_bytes(documents, epochs, samples), devices.host_memory_bytes()
    if need > have:
        gib = 2.0**30
        raise DataError(f"{prefix}: the {name} split needs {samples:,} samples, {epochs:,} "
                        f"passes over its {documents:,} documents, whose index takes about "
                        f"{need / gib:,.1f} GiB, more than this machine's {have / gib:,.1f} "
                        "GiB: lower --train-samples/--train-iters (or --eval-iters) or add data")
