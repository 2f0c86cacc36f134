"""``--mock-data``: synthetic token sequences with structure a model can learn.

Each token is followed by one of a few fixed successors (a sparse random Markov chain), with
an occasional uniformly random token. A model that learns the chain drops its loss from
ln(vocab) towards ln(branching), so a falling loss shows learning. Sample ``i`` is a pure
function of (seed, i), computed with a counter-based hash, so any rank can produce any slice of
any global batch without shared state: the same seed gives the same batches whatever the
parallel layout.
"""

from __future__ import annotations

import numpy as np
import torch

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return x ^ (x >> np.uint64(31))


class MockGPTDataset:
    """Sequences of ``seq_length + 1`` tokens (inputs plus the shifted label)."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int, branching: int = 4,
                 noise: float = 0.05) -> None:
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.branching = branching
        self._key = _mix(np.array([seed], dtype=np.uint64))[0]
        rng = np.random.default_rng(seed)
        self._successors = rng.integers(0, vocab_size, size=(vocab_size, branching))
        self._noise_threshold = np.uint64(int(noise * 2**16))

    def samples(self, start: int, count: int) -> torch.Tensor:
        """Samples ``start .. start+count-1`` as int64 [count, seq_length + 1]."""
        index = np.arange(start, start + count, dtype=np.uint64)
        positions = np.arange(self.seq_length + 1, dtype=np.uint64)
        with np.errstate(over="ignore"):
            sample_key = _mix(index ^ self._key)
            u = _mix(sample_key[:, None] + positions[None, :] * np.uint64(0x632BE59BD9B4E019))
        vocab = np.uint64(self.vocab_size)
        random_token = (u % vocab).astype(np.int64)
        choice = ((u >> np.uint64(20)) % np.uint64(self.branching)).astype(np.int64)
        noisy = ((u >> np.uint64(40)) & np.uint64(0xFFFF)) < self._noise_threshold
        tokens = np.empty((count, self.seq_length + 1), dtype=np.int64)
        tokens[:, 0] = random_token[:, 0]
        for t in range(1, self.seq_length + 1):
            follow = self._successors[tokens[:, t - 1], choice[:, t]]
            tokens[:, t] = np.where(noisy[:, t], random_token[:, t], follow)
        return torch.from_numpy(tokens)
