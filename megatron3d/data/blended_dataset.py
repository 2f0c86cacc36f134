"""Blend several datasets by weight: ``--data-path 0.3 A 0.7 B``.

The blending index maps each blended sample ``i`` to (source ``d``, the source's own sample
``k``), and source ``d`` is drawn in order: its ``k``-th draw is its sample ``k``. It is
built greedily, like Megatron's helper, but with a criterion that vectorises: source ``d``'s
``k``-th draw is due at time ``(k + 1/2) / w_d`` and draws are served in order of due time
(ties to the lower source). After any prefix of ``n`` samples each source has drawn
``w_d * n`` samples within ``1/2 + w_d * K/2`` (K sources): proportions hold at every prefix,
not just on average. It depends on nothing but the weights and the length, so no seed.
Serving due times window by window keeps memory bounded for very long runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megatron3d.data.gpt_dataset import GPTDataset
from megatron3d.data.index_cache import IndexCache
from megatron3d.errors import ConfigError, DataError

BLEND_FORMAT_VERSION = 1
_WINDOW = float(1 << 20)  # time units (about that many samples) served per step


def normalise_weights(weights: Sequence[float]) -> np.ndarray:
    """Weights as sampling proportions summing to 1; each must be positive."""
    w = np.asarray(weights, dtype=np.float64)
    if len(w) == 0 or not np.all(np.isfinite(w)) or (w <= 0).any():
        raise ConfigError(f"invalid --data-path weights {list(weights)}: each must be a "
                          "positive number, e.g. --data-path 0.3 A 0.7 B")
    return w / w.sum()


def blending_index(weights: Sequence[float], num_samples: int) -> dict[str, np.ndarray]:
    """``dataset_index`` int16 [N] (source of each sample), ``dataset_sample`` [N] (its id)."""
    w = normalise_weights(weights)
    if len(w) >= 2**15:
        raise ConfigError(f"--data-path lists {len(w)} datasets; at most 32767 can be blended")
    source = np.empty(num_samples, dtype=np.int16)
    sample = np.empty(num_samples, dtype=np.uint32 if num_samples < 2**32 else np.int64)
    next_draw = np.zeros(len(w), dtype=np.int64)
    filled, window_end = 0, 0.0
    while filled < num_samples:
        window_end += _WINDOW
        times, sources, draws = [], [], []
        for d, weight in enumerate(w):
            k = next_draw[d] + np.arange(int(np.ceil(weight * _WINDOW)) + 2, dtype=np.int64)
            due = (k + 0.5) / weight
            keep = int(np.searchsorted(due, window_end, side="left"))  # due < window_end
            times.append(due[:keep])
            sources.append(np.full(keep, d, dtype=np.int16))
            draws.append(k[:keep])
            next_draw[d] += keep
        order = np.argsort(np.concatenate(times), kind="stable")[:num_samples - filled]
        source[filled:filled + len(order)] = np.concatenate(sources)[order]
        sample[filled:filled + len(order)] = np.concatenate(draws)[order]
        filled += len(order)
    return {"dataset_index": source, "dataset_sample": sample}


def cached_blending_index(weights: Sequence[float], num_samples: int, name: str,
                          cache: IndexCache) -> dict[str, np.ndarray]:
    key = {"kind": "blend", "format": BLEND_FORMAT_VERSION,
           "weights": [float(x) for x in normalise_weights(weights)],
           "num_samples": num_samples}
    return cache.get_or_build(f"blend_{name}_{len(weights)}x_{num_samples}n", key,
                              lambda: blending_index(weights, num_samples))


def draws_per_source(blend: dict[str, np.ndarray], num_sources: int) -> np.ndarray:
    """How many samples each source gives to the blend: int64 [num_sources]."""
    return np.bincount(blend["dataset_index"], minlength=num_sources).astype(np.int64)


class BlendedDataset:
    """Samples drawn from ``datasets`` by a blending index (see ``blending_index``).

    A source the blend never draws from may be ``None`` (it need not be built).
    """

    def __init__(self, datasets: Sequence[GPTDataset | None],
                 blend: dict[str, np.ndarray]) -> None:
        self.datasets = list(datasets)
        self.dataset_index, self.dataset_sample = blend["dataset_index"], blend["dataset_sample"]
        lengths = {ds.seq_length for ds in self.datasets if ds is not None}
        assert len(lengths) == 1, lengths
        self.seq_length = lengths.pop()

    def __len__(self) -> int:
        return len(self.dataset_index)

    def samples(self, start: int, count: int) -> torch.Tensor:
        """Samples ``start .. start+count-1``: int64 [count, seq_length + 1]."""
        if start < 0 or start + count > len(self):
            raise DataError(f"blended samples {start}..{start + count - 1} asked for, but the "
                            f"blend was built for {len(self)}; build it for more samples "
                            "(--train-samples/--train-iters, --eval-iters)")
        source = np.asarray(self.dataset_index[start:start + count])
        sample = np.asarray(self.dataset_sample[start:start + count], dtype=np.int64)
        out = np.empty((count, self.seq_length + 1), dtype=np.int64)
        for d in np.unique(source):
            rows = source == d
            out[rows] = self.datasets[d].samples_at(sample[rows])
        return torch.from_numpy(out)


@dataclass(frozen=True)
class SourceReport:
    """One source of a blend, for ``--dry-run-data``."""

    prefix: str
    weight: float  # normalised sampling proportion
    samples: int  # samples this source gives to the split
    documents: int  # documents of this source in the split
    tokens: int  # tokens of this source in the split (one epoch)
    epochs: float  # implied passes over the source's split: samples * seq_length / tokens


def format_report(split: str, reports: Sequence[SourceReport]) -> str:
    """A table: one line per source, then the total."""
    lines = [f"{split + ':':<7}{'weight':>8} {'samples':>12} {'documents':>11} {'tokens':>14} "
             f"{'epochs':>8}  path"]
    for r in reports:
        lines.append(f"{'':7}{r.weight:8.4f} {r.samples:12,d} {r.documents:11,d} "
                     f"{r.tokens:14,d} {r.epochs:8.3f}  {r.prefix}")
    total = sum(r.samples for r in reports)
    lines.append(f"{'':7}{'total':>8} {total:12,d}")
    return "\n".join(lines)
