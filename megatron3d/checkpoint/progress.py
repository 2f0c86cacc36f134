"""Where a run is: the one position the training loop advances, a checkpoint records and
TensorBoard plots against. The data position, batch size and learning rate all follow from
``consumed_samples``, so a run is fully described by its ``Progress``.

A run's checkpoints form a series (``new_series``): a run that starts from scratch (or
fine-tunes) begins one, a resumed run continues the loaded one, and ``--keep-last-n`` prunes
only its own series.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


@dataclass
class Progress:
    iteration: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0
    # --rerun-on-bad-step's record, kept so that a resumed run judges its steps as the
    # uninterrupted run did: the batches skipped as bad data ({"iteration", "first_sample",
    # "samples"}) and the recent finite losses a spike is measured against.
    skipped_batches: list[dict[str, int]] = field(default_factory=list)
    recent_losses: list[float] = field(default_factory=list)


def new_series() -> str:
    """A new series id; only rank 0's is ever written (meta.json is rank 0's)."""
    return uuid.uuid4().hex
