"""Megatron's GPT sample scheme as pure, vectorised numpy: documents -> fixed-length samples.

Think of the data as one stream: epoch after epoch, each epoch being every document of the
split once, in an order shuffled per epoch (``doc_idx``). Sample ``k`` is stream tokens
``[k*s, (k+1)*s]`` — ``s + 1`` tokens (inputs plus the shifted label) — so consecutive
samples share one token and samples run across document boundaries. ``sample_idx[k]`` is
where sample ``k`` starts as (position in ``doc_idx``, offset in that document); sample ``k``
ends on the token where sample ``k + 1`` starts. As many whole epochs are built as the
requested number of samples needs, and every sample of them is kept; ``shuffle_idx`` then
shuffles samples inside each epoch (by where they start), so epoch e is seen in full before
epoch e + 1 starts, and the arrays depend only on the number of epochs, not on the exact
number of samples asked for (which lets one cache serve runs of slightly different length).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron3d.data.shuffle import permute_rows, permute_within_blocks, stream_key
from megatron3d.errors import DataError

FORMAT_VERSION = 1
"""Bump when the arrays built here change for the same inputs: cached indices are keyed on it."""

_DOC_SALT, _SAMPLE_SALT = 1, 2


@dataclass(frozen=True)
class SampleIndex:
    doc_idx: np.ndarray  # [epochs * documents] document ids in stream order
    sample_idx: np.ndarray  # [num_samples + 1, 2] (doc_idx position, offset) of each start
    shuffle_idx: np.ndarray  # [num_samples] stream sample for each dataset sample

    def arrays(self) -> dict[str, np.ndarray]:
        return {"doc_idx": self.doc_idx, "sample_idx": self.sample_idx,
                "shuffle_idx": self.shuffle_idx}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> SampleIndex:
        return cls(arrays["doc_idx"], arrays["sample_idx"], arrays["shuffle_idx"])

    def __len__(self) -> int:
        return len(self.shuffle_idx)


def samples_in_epochs(tokens_per_epoch: int, seq_length: int, num_epochs: int) -> int:
    """Samples of ``s + 1`` tokens that fit in ``num_epochs`` epochs (they overlap by one)."""
    return max(num_epochs * tokens_per_epoch - 1, 0) // seq_length


def num_epochs_for(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest whole epochs that yield ``num_samples`` samples (at least one epoch)."""
    assert tokens_per_epoch > 0 and seq_length > 0
    epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
    assert samples_in_epochs(tokens_per_epoch, seq_length, epochs) >= num_samples
    return epochs


def index_peak_bytes(num_documents: int, num_epochs: int, num_samples: int) -> int:
    """Bytes ``build_sample_index`` holds at its peak, about: per epoch and document an id and
    a cumulative length, per sample six int64 working arrays."""
    return 16 * num_epochs * num_documents + 48 * num_samples


def build_sample_index(sizes: np.ndarray, documents: np.ndarray, seq_length: int,
                       num_epochs: int, seed: int) -> SampleIndex:
    """Index of every sample in ``num_epochs`` epochs over ``documents``.

    ``sizes`` holds the token count of every document of the dataset; ``documents`` the ids
    this split uses. Deterministic in its arguments.
    """
    doc_sizes = sizes[documents].astype(np.int64)
    tokens_per_epoch = int(doc_sizes.sum())
    if tokens_per_epoch == 0:
        raise DataError(f"the {len(documents)} documents of this split hold no tokens; "
                        "give the split more documents (--split) or a larger dataset")
    id_type = np.int32 if len(sizes) < 2**31 else np.int64
    doc_idx = permute_rows(documents.astype(id_type), num_epochs, stream_key(seed, _DOC_SALT))
    num_samples = samples_in_epochs(tokens_per_epoch, seq_length, num_epochs)
    ends = np.cumsum(sizes[doc_idx], dtype=np.int64)  # stream position after each document
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    position = np.searchsorted(ends, starts, side="right")  # skips empty documents
    offset = starts - (ends[position] - sizes[doc_idx[position]])
    del ends
    pos_type = np.int32 if len(doc_idx) < 2**31 else np.int64
    sample_idx = np.stack([position.astype(pos_type), offset.astype(pos_type)], axis=1)
    epoch = starts[:-1] // tokens_per_epoch
    shuffle_type = np.uint32 if num_samples < 2**32 else np.int64
    shuffle_idx = permute_within_blocks(epoch, stream_key(seed, _SAMPLE_SALT))
    return SampleIndex(doc_idx, sample_idx, shuffle_idx.astype(shuffle_type))


def gather_samples(index: SampleIndex, read, sample_ids: np.ndarray,
                   seq_length: int) -> np.ndarray:
    """Tokens of dataset samples ``sample_ids``: int64 [len, seq_length + 1].

    ``read(doc_id, offset, length)`` returns that slice of a document's tokens.
    """
    out = np.empty((len(sample_ids), seq_length + 1), dtype=np.int64)
    for row, k in enumerate(index.shuffle_idx[sample_ids]):
        (doc_pos, offset), (last_pos, last_offset) = index.sample_idx[k], index.sample_idx[k + 1]
        filled = 0
        for pos in range(int(doc_pos), int(last_pos) + 1):
            stop = int(last_offset) + 1 if pos == last_pos else None
            piece = read(int(index.doc_idx[pos]), int(offset), stop)
            out[row, filled:filled + len(piece)] = piece
            filled += len(piece)
            offset = 0
        assert filled == seq_length + 1, (k, filled)
    return out
