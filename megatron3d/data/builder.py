"""From data flags to train/valid/test datasets: the one entry point training calls.

Parses ``--data-path`` (one prefix, or weight-prefix pairs) or ``--data-path-file``, cuts
every source into train/valid/test document ranges by ``--split``, and builds a
``GPTDataset`` per (source, split), blended when there are several sources. Takes plain
arguments so it needs nothing but the flag values.
"""

from __future__ import annotations

import difflib
import glob
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron3d.data.blended_dataset import (
    BlendedDataset,
    SourceReport,
    blending_index,
    cached_blending_index,
    draws_per_source,
    normalise_weights,
)
from megatron3d.data.dataset_meta import check_vocabulary
from megatron3d.data.gpt_dataset import GPTDataset, require_token_dtype
from megatron3d.data.index_cache import IndexCache
from megatron3d.data.indexed_dataset import IndexedDataset, index_file_path
from megatron3d.errors import ConfigError, DataError
from megatron3d.log import get_logger

logger = get_logger(__name__)

SPLITS = ("train", "valid", "test")
DEFAULT_SPLIT = "969, 30, 1"


@dataclass(frozen=True)
class DataSources:
    """Dataset prefixes and their normalised sampling weights."""

    prefixes: tuple[str, ...]
    weights: tuple[float, ...]


@dataclass(frozen=True)
class SplitDatasets:
    """The three splits; a split is ``None`` when it gets no documents or no samples."""

    train: GPTDataset | BlendedDataset | None
    valid: GPTDataset | BlendedDataset | None
    test: GPTDataset | BlendedDataset | None


def parse_data_path(data_path: Sequence[str] | str | None,
                    data_path_file: str | None = None) -> DataSources:
    """``PATH`` or ``W1 P1 W2 P2 ...`` from the flag, or the same words from a file.

    In a ``--data-path-file``, words are separated by any whitespace and ``#`` starts a comment.
    A prefix given with its ``.bin`` or ``.idx`` suffix means the prefix.
    """
    if (data_path is None) == (data_path_file is None):
        raise ConfigError("give exactly one of --data-path and --data-path-file "
                          f"(got --data-path={data_path!r}, --data-path-file={data_path_file!r})")
    if data_path_file is not None:
        try:
            with open(data_path_file) as f:
                words = [w for line in f for w in line.split("#", 1)[0].split()]
        except OSError as exc:
            raise ConfigError(f"cannot read --data-path-file {data_path_file!r} "
                              f"({exc.strerror}); give an existing file") from None
        where = f"in --data-path-file {data_path_file}"
    else:
        words = data_path.split() if isinstance(data_path, str) else \
            [w for item in data_path for w in str(item).split()]
        where = "in --data-path"
    if len(words) == 1:
        return DataSources((_strip_suffix(words[0]),), (1.0,))
    pairs = list(zip(words[0::2], words[1::2], strict=False))
    if len(words) % 2 or not words or not all(_is_number(w) for w, _ in pairs):
        raise ConfigError(f"invalid dataset list {where}: {' '.join(words)!r}; write one "
                          "prefix, or weight-prefix pairs such as '0.3 data/a 0.7 data/b'")
    weights = normalise_weights([float(w) for w, _ in pairs])
    return DataSources(tuple(_strip_suffix(p) for _, p in pairs),
                       tuple(float(x) for x in weights))


def _strip_suffix(path: str) -> str:
    root, ext = os.path.splitext(path)
    return root if ext in (".bin", ".idx") else path


def check_sources_exist(sources: DataSources) -> None:
    """``DataError`` for the first prefix with no ``.idx``, naming the nearest existing ones
    in its directory (a mistyped name is the usual cause)."""
    for prefix in sources.prefixes:
        if os.path.isfile(index_file_path(prefix)):
            continue
        directory, name = os.path.split(prefix)
        folder = directory or "."
        existing = sorted(os.path.basename(p)[:-len(".idx")] for p in glob.glob(
            os.path.join(glob.escape(folder), "*.idx")))
        near = [os.path.join(directory, n) for n in
                difflib.get_close_matches(name, existing, n=3, cutoff=0.6) or existing[:3]]
        hint = (f"nearest existing: {', '.join(near)}" if near
                else f"{folder} holds no .idx file" if os.path.isdir(folder)
                else f"there is no directory {folder}")
        raise DataError(f"no dataset at data prefix {prefix!r} ({index_file_path(prefix)} not "
                        f"found; {hint}): give the prefix of an existing .bin/.idx pair, or "
                        "make it with tools/preprocess_data.py")


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def parse_split(split: str) -> tuple[float, float, float]:
    """``"969, 30, 1"`` or ``"949/50/1"`` -> fractions of (train, valid, test).

    Quotes around the value are dropped: Megatron-LM's example scripts keep ``--split '99,1,0'``
    in a string variable, so the quotes reach us literally.
    """
    bare = split.strip().strip("'\"")
    try:
        parts = [float(p) for p in bare.replace("/", ",").split(",") if p.strip()]
    except ValueError:
        parts = []
    if (not 1 <= len(parts) <= 3 or not all(p >= 0 for p in parts)  # nan fails too
            or not 0 < sum(parts) < math.inf):
        raise ConfigError(f"invalid split (--split={split!r}): give up to three finite, "
                          "non-negative weights for train, valid, test, e.g. '969, 30, 1'")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return (parts[0] / total, parts[1] / total, parts[2] / total)


def split_ranges(num_documents: int, fractions: Sequence[float]) -> list[range]:
    """Consecutive document ranges, one per fraction; boundaries are rounded cumulative sums."""
    bounds = [0] + [round(c * num_documents) for c in np.cumsum(fractions)]
    bounds[-1] = num_documents
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def default_cache_dir(sources: DataSources) -> str:
    """``index-cache`` beside the first dataset, as Megatron keeps its indices by the data."""
    return os.path.join(os.path.dirname(os.path.abspath(sources.prefixes[0])), "index-cache")


def _open_token_datasets(sources: DataSources, vocab_size: int | None = None,
                         tokenizer_type: str = "the tokenizer") -> list[IndexedDataset]:
    """Every source, opened and checked to hold token ids (inside ``vocab_size`` when given,
    see ``dataset_meta``), before any index is built."""
    check_sources_exist(sources)
    datasets = [IndexedDataset(p) for p in sources.prefixes]
    for ds in datasets:
        require_token_dtype(ds)
        if vocab_size is not None:
            check_vocabulary(ds, vocab_size, tokenizer_type)
    return datasets


@dataclass(frozen=True)
class SplitPaths:
    """Where the splits come from: ``data_path`` (or ``data_path_file``) cut by ``split``, or
    each split's own datasets read whole (Megatron-LM's --train/valid/test-data-path)."""

    data_path: Sequence[str] | str | None = None
    data_path_file: str | None = None
    split: str = DEFAULT_SPLIT
    train_data_path: Sequence[str] | None = None
    valid_data_path: Sequence[str] | None = None
    test_data_path: Sequence[str] | None = None

    def sources(self) -> list[DataSources | None]:
        """The shared sources once, or each split's own (``None``: that split has none)."""
        if self.train_data_path is None:
            return [parse_data_path(self.data_path, self.data_path_file)]
        return [None if words is None else parse_data_path(words)
                for words in (self.train_data_path, self.valid_data_path, self.test_data_path)]


@dataclass(frozen=True)
class _Split:
    """One split's datasets, their weights and the documents each gives it."""

    sources: DataSources
    datasets: list[IndexedDataset]
    documents: list[range]


def _plan(paths: SplitPaths, vocab_size: int | None = None,
          tokenizer_type: str = "the tokenizer") -> list[_Split | None]:
    """Train, valid, test: every dataset opened and checked before any index is built."""
    opened = [None if s is None else (s, _open_token_datasets(s, vocab_size, tokenizer_type))
              for s in paths.sources()]
    if len(opened) == 3:
        return [None if o is None else _Split(o[0], o[1], [range(len(d)) for d in o[1]])
                for o in opened]
    sources, datasets = opened[0]
    ranges = [split_ranges(len(ds), parse_split(paths.split)) for ds in datasets]
    return [_Split(sources, datasets, [r[i] for r in ranges]) for i in range(len(SPLITS))]


def build_datasets(*, data_path: Sequence[str] | str | None, seq_length: int, seed: int,
                   train_samples: int, valid_samples: int = 0, test_samples: int = 0,
                   data_path_file: str | None = None, split: str = DEFAULT_SPLIT,
                   data_cache_path: str | None = None, vocab_size: int | None = None,
                   tokenizer_type: str = "the tokenizer", cache_timeout_s: float = 1800.0,
                   **per_split: Sequence[str] | None) -> SplitDatasets:
    """Train/valid/test datasets holding at least the requested numbers of samples.
    ``per_split``: ``train_data_path``, ``valid_data_path``, ``test_data_path`` (``SplitPaths``).

    Every rank calls this; index caches missing from ``data_cache_path`` (default
    ``index-cache`` beside the first dataset) are built by one process while the others
    wait up to ``cache_timeout_s``. ``vocab_size`` (of ``tokenizer_type``, named in errors)
    enables the token-range checks: at start, then on every batch.
    """
    paths = SplitPaths(data_path, data_path_file, split, **per_split)
    plan = _plan(paths, vocab_size, tokenizer_type)
    first = plan[0].sources
    cache = IndexCache(data_cache_path or default_cache_dir(first), timeout_s=cache_timeout_s)
    logger.info("building datasets: %d train, %d valid, %d test samples of %d tokens, seed %d, "
                "%s, index cache %s", train_samples, valid_samples, test_samples,
                seq_length, seed, f"split {paths.split!r}" if len(paths.sources()) == 1
                else "a dataset list per split", cache.directory)
    built = []
    for name, wanted, part in zip(SPLITS, (train_samples, valid_samples, test_samples), plan,
                                  strict=True):
        if name == "train" and wanted > 0 and all(len(r) == 0 for r in part.documents):
            raise ConfigError(f"--split {paths.split!r} gives the train split none of the "
                              f"{len(part.datasets[0])} documents of {first.prefixes[0]}; "
                              "give train a larger share")
        if wanted <= 0 or part is None or all(len(r) == 0 for r in part.documents):
            logger.info(" > %s: not built (%d samples wanted, %d documents)", name, wanted,
                        0 if part is None else sum(len(r) for r in part.documents))
            built.append(None)
            continue
        def make(d: int, count: int, part: _Split = part, name: str = name) -> GPTDataset:
            return GPTDataset(part.datasets[d], part.documents[d], name=name,
                              seq_length=seq_length, num_samples=count, seed=seed, cache=cache,
                              vocab_size=vocab_size)
        if len(part.datasets) == 1:
            built.append(make(0, wanted))
            continue
        blend = cached_blending_index(part.sources.weights, wanted, name, cache)
        counts = draws_per_source(blend, len(part.datasets))
        built.append(BlendedDataset([make(d, int(c)) if c else None
                                     for d, c in enumerate(counts)], blend))
    return SplitDatasets(*built)


def dry_run_report(*, data_path: Sequence[str] | str | None, seq_length: int,
                   train_samples: int, valid_samples: int = 0, test_samples: int = 0,
                   data_path_file: str | None = None, split: str = DEFAULT_SPLIT,
                   **per_split: Sequence[str] | None) -> dict[str, list[SourceReport]]:
    """Per split and source: weight, samples drawn and implied epochs. Writes no files."""
    report = {}
    plan = _plan(SplitPaths(data_path, data_path_file, split, **per_split))
    for name, wanted, part in zip(SPLITS, (train_samples, valid_samples, test_samples), plan,
                                  strict=True):
        if part is None:
            continue
        datasets = part.datasets
        if all(len(r) == 0 for r in part.documents):
            counts = np.zeros(len(datasets), dtype=np.int64)  # not built: no documents
        elif len(datasets) == 1:
            counts = np.array([wanted])
        else:
            counts = draws_per_source(blending_index(part.sources.weights, wanted),
                                      len(datasets))
        rows = []
        for d, ds in enumerate(datasets):
            docs = part.documents[d]
            tokens = int(ds.sizes[docs.start:docs.stop].sum(dtype=np.int64))
            epochs = counts[d] * seq_length / tokens if tokens else (
                float("inf") if counts[d] else 0.0)
            rows.append(SourceReport(ds.prefix, part.sources.weights[d], int(counts[d]),
                                     len(docs), tokens, float(epochs)))
        report[name] = rows
    return report
