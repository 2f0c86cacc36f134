"""Typed, frozen configuration for a training run.

Every field name is the Megatron-DeepSpeed flag name with dashes turned into underscores, and
each name appears in exactly one section, so ``arguments.py`` maps flags and YAML keys to
fields without a hand-written table. The ``help`` metadata is the field's documentation and
the ``--help`` text; ``range`` bounds a numeric field's value next to its definition (checked
by ``validation.py``, shown in ``--help``). Values derived from several fields are properties,
never stored twice. Cross-field checks live in ``validation.py``.

The sections live in three modules (``model``: what is built and its layout; ``training``: how
it is trained; ``run``: data, logs, checkpoints, resilience); this one joins them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from megatron3d.config.model import (
    ZERO_STAGES,
    ModelConfig,
    Normalization,
    ParallelConfig,
    PositionEmbeddingType,
)
from megatron3d.config.ranges import Range
from megatron3d.config.run import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    ResilienceConfig,
    TokenizerType,
)
from megatron3d.config.training import (
    LRDecayStyle,
    LRScheduleConfig,
    OptimizerConfig,
    PrecisionConfig,
    TrainingConfig,
)

__all__ = [
    "SECTIONS", "ZERO_STAGES", "CheckpointConfig", "DataConfig", "LRDecayStyle",
    "LRScheduleConfig", "LoggingConfig", "ModelConfig", "Normalization", "OptimizerConfig",
    "ParallelConfig", "PositionEmbeddingType", "PrecisionConfig", "Range", "ResilienceConfig",
    "TokenizerType", "TrainConfig", "TrainingConfig", "flat_fields",
]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The whole run; each section is one concern."""

    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "lr_schedule": LRScheduleConfig,
    "precision": PrecisionConfig,
    "data": DataConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
    "resilience": ResilienceConfig,
}
"""Section name -> dataclass, in the order flags are listed in ``--help``."""


def flat_fields(cfg: TrainConfig) -> dict[str, Any]:
    """Field name -> value over every section (field names are unique across sections)."""
    return {f.name: getattr(getattr(cfg, section), f.name)
            for section, cls in SECTIONS.items() for f in fields(cls)}
