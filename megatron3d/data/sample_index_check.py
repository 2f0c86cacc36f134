"""A sample index read back from the index cache is checked against its dataset before use.

The cache keeps the arrays ``sample_index.build_sample_index`` made; a file damaged since (a
bad disk, a hand edit, an entry copied from elsewhere) would otherwise send
``gather_samples`` out of bounds with a traceback hours into a run or, worse, quietly train
on other samples. ``sample_index_problem`` checks what the build guarantees, vectorised and
in bounded chunks (time linear in the index, memory in the documents): every document of
the split appears once per epoch in ``doc_idx``; sample ``k`` starts ``k * seq_length``
tokens into that stream, inside a non-empty document; ``shuffle_idx`` is a permutation of
the samples. It cannot tell one permutation from another.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

_CHUNK = 1 << 22  # samples per step: bounded temporaries for any index size


def sample_index_problem(arrays: Mapping[str, np.ndarray], sizes: np.ndarray,
                         documents: range, seq_length: int, num_epochs: int,
                         num_samples: int) -> str | None:
    """How ``arrays`` differ from an index of ``num_samples`` samples of ``seq_length``
    tokens over ``num_epochs`` epochs of ``documents`` (whose lengths are ``sizes``), or None.
    """
    names = ("doc_idx", "sample_idx", "shuffle_idx")
    shapes = ((num_epochs * len(documents),), (num_samples + 1, 2), (num_samples,))
    for name, shape in zip(names, shapes, strict=True):
        array = arrays.get(name)
        if array is None or array.shape != shape or array.dtype.kind not in "iu":
            found = "missing" if array is None else f"{array.dtype} {list(array.shape)}"
            return f"{name} is {found}, expected integers of shape {list(shape)}"
    doc_idx = arrays["doc_idx"].astype(np.int64)
    return (_doc_idx_problem(doc_idx, documents, num_epochs)
            or _sample_idx_problem(arrays["sample_idx"], sizes[doc_idx].astype(np.int64),
                                   seq_length)
            or _shuffle_idx_problem(arrays["shuffle_idx"], num_samples))


def _doc_idx_problem(doc_idx: np.ndarray, documents: range, num_epochs: int) -> str | None:
    if len(doc_idx) and (doc_idx.min() < documents.start or doc_idx.max() >= documents.stop):
        return f"doc_idx holds documents outside {documents.start}..{documents.stop - 1}"
    if (np.bincount(doc_idx - documents.start, minlength=len(documents)) != num_epochs).any():
        return f"doc_idx does not hold each document once per epoch ({num_epochs} epochs)"
    return None


def _sample_idx_problem(sample_idx: np.ndarray, doc_sizes: np.ndarray,
                        seq_length: int) -> str | None:
    """Sample ``k`` starts at stream token ``k * seq_length``, inside a non-empty document
    (``doc_sizes``: the length of each ``doc_idx`` entry)."""
    doc_starts = np.cumsum(doc_sizes) - doc_sizes  # stream position of each document
    for lo in range(0, len(sample_idx), _CHUNK):
        part = sample_idx[lo:lo + _CHUNK].astype(np.int64)
        position, offset = part[:, 0], part[:, 1]
        if (position < 0).any() or (position >= len(doc_sizes)).any():
            return f"sample_idx points outside doc_idx near sample {lo}"
        if (offset < 0).any() or (offset >= doc_sizes[position]).any():
            return f"sample_idx has an offset outside its document near sample {lo}"
        starts = np.arange(lo, lo + len(part), dtype=np.int64) * seq_length
        if not np.array_equal(doc_starts[position] + offset, starts):
            return f"sample_idx does not step {seq_length} tokens a sample near sample {lo}"
    return None


def _shuffle_idx_problem(shuffle_idx: np.ndarray, num_samples: int) -> str | None:
    seen = np.zeros(num_samples, dtype=bool)
    for lo in range(0, num_samples, _CHUNK):
        part = shuffle_idx[lo:lo + _CHUNK].astype(np.int64)
        if part.min() < 0 or part.max() >= num_samples:
            return f"shuffle_idx holds samples outside 0..{num_samples - 1} near {lo}"
        seen[part] = True
    if not seen.all():
        return "shuffle_idx repeats some samples and drops others"
    return None
