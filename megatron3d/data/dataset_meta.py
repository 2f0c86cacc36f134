"""What a dataset's token ids are, known before training reads a batch.

``tools/preprocess_data.py`` writes ``PREFIX.meta.json`` beside ``PREFIX.bin/.idx``: counts,
dtype, the smallest and largest token id and the tokenizer that made them. Training compares
that range with its own tokenizer at start, so data made with another tokenizer stops in the
first seconds with one line instead of at its first batch. The sidecar counts only while the
``.bin`` and ``.idx`` sizes it records still match; without a trusted sidecar (datasets from
Megatron itself, or rewritten ones) a bounded, evenly spaced sample of documents is read
instead: never a scan of the whole corpus. The per-batch check in ``GPTDataset`` stays as the
last line of defence for ids the sample missed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import numpy as np

from megatron3d.data.indexed_dataset import IndexedDataset, data_file_path, index_file_path
from megatron3d.errors import DataError
from megatron3d.log import get_logger

logger = get_logger(__name__)

META_VERSION = 1
SAMPLE_DOCUMENTS = 256  # documents read at start when no sidecar vouches for the ids
SAMPLE_TOKENS = 4096  # tokens read from the start of each sampled document


def meta_file_path(prefix: str) -> str:
    return prefix + ".meta.json"


@dataclass(frozen=True)
class DatasetMeta:
    """Facts about one written dataset; the sizes tie it to the files it describes."""

    documents: int
    tokens: int
    dtype: str
    min_token_id: int | None  # None: no tokens
    max_token_id: int | None
    vocab_size: int  # the tokenizer's, when the data was written
    tokenizer_type: str
    bin_bytes: int
    idx_bytes: int
    version: int = META_VERSION


def write_meta(prefix: str, meta: DatasetMeta) -> None:
    """Write the sidecar atomically, so a reader never sees half of it."""
    path = meta_file_path(prefix)
    with open(path + ".tmp", "w") as f:
        json.dump(dataclasses.asdict(meta), f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def describe(prefix: str, *, min_token_id: int | None, max_token_id: int | None,
             vocab_size: int, tokenizer_type: str) -> DatasetMeta:
    """The sidecar for the finished dataset at ``prefix`` (counts read from its ``.idx``)."""
    ds = IndexedDataset(prefix)
    return DatasetMeta(documents=ds.num_documents, tokens=ds.index.num_tokens,
                       dtype=ds.dtype.name, min_token_id=min_token_id,
                       max_token_id=max_token_id, vocab_size=vocab_size,
                       tokenizer_type=tokenizer_type,
                       bin_bytes=os.path.getsize(data_file_path(prefix)),
                       idx_bytes=os.path.getsize(index_file_path(prefix)))


def read_meta(prefix: str) -> DatasetMeta | None:
    """The sidecar of ``prefix`` if it exists and still matches its ``.bin``/``.idx``."""
    path = meta_file_path(prefix)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            meta = DatasetMeta(**json.load(f))
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("%s: unreadable (%s); sampling the data instead", path, exc)
        return None
    sizes = (os.path.getsize(data_file_path(prefix)), os.path.getsize(index_file_path(prefix)))
    if meta.version != META_VERSION or sizes != (meta.bin_bytes, meta.idx_bytes):
        logger.warning("%s does not describe the current .bin/.idx (written by another run); "
                       "sampling the data instead", path)
        return None
    return meta


def check_vocabulary(indexed: IndexedDataset, vocab_size: int, tokenizer_type: str) -> None:
    """``DataError`` when ``indexed`` holds ids outside ``[0, vocab_size)``, from its sidecar
    or, without one, from a bounded sample of documents."""
    meta = read_meta(indexed.prefix)
    if meta is not None:
        low, high, where = meta.min_token_id, meta.max_token_id, (
            f"{meta_file_path(indexed.prefix)} records ids written by {meta.tokenizer_type} "
            f"with {meta.vocab_size} ids")
    else:
        low, high = _sample_range(indexed)
        where = f"read in a sample of {min(len(indexed), SAMPLE_DOCUMENTS)} documents at start"
    if low is None or (low >= 0 and high < vocab_size):
        if meta is not None and meta.vocab_size != vocab_size:
            logger.warning("%s was written by %s with %d ids; this run's %s has %d: check that "
                           "the tokenizers match", indexed.prefix, meta.tokenizer_type,
                           meta.vocab_size, tokenizer_type, vocab_size)
        return
    raise DataError(f"token id {low if low < 0 else high} is outside the vocabulary of "
                    f"{vocab_size} in {indexed.prefix} ({where}; this run uses "
                    f"{tokenizer_type}): give the --tokenizer-type (and files) it was made "
                    "with, or re-run tools/preprocess_data.py with this one")


def _sample_range(indexed: IndexedDataset) -> tuple[int | None, int | None]:
    """Smallest and largest id in up to ``SAMPLE_DOCUMENTS`` evenly spaced sequences, the
    first ``SAMPLE_TOKENS`` of each: the same sample on every rank, O(1) in the corpus."""
    picks = np.unique(np.linspace(0, len(indexed) - 1, min(len(indexed), SAMPLE_DOCUMENTS),
                                  dtype=np.int64)) if len(indexed) else []
    low = high = None
    for i in picks:
        length = min(int(indexed.sizes[i]), SAMPLE_TOKENS)
        if length:
            tokens = indexed.get(int(i), 0, length)
            low = int(tokens.min()) if low is None else min(low, int(tokens.min()))
            high = int(tokens.max()) if high is None else max(high, int(tokens.max()))
    return low, high
