"""The run's non-persistent checkpoints as one object that ``training/build.py`` makes once:
the group they travel on, the store, the configuration hash; the restore at build and the
saver it hands the trainer."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from megatron3d.checkpoint.local import store
from megatron3d.checkpoint.local.link import PeerLink
from megatron3d.checkpoint.local.restore import restore
from megatron3d.checkpoint.local.saver import LocalSaver
from megatron3d.checkpoint.saving import layout
from megatron3d.config import TrainConfig
from megatron3d.mpu.random import RNGStreams
from megatron3d.mpu.state import ParallelState
from megatron3d.optim.lr_schedule import LRSchedule
from megatron3d.optim.mixed_precision import MixedPrecisionOptimizer


@dataclass(frozen=True)
class LocalCheckpoints:
    """``sees`` lists the copies visible from this rank (tests narrow it to one rank's
    directory, as if every rank were on a node of its own)."""

    link: PeerLink
    root: Path
    config_hash: str
    sees: Callable[[Path], list[store.Copy]] = store.listed

    def restore(self, global_dir: Path | None) -> Path | None:
        """Every rank: the checkpoint directory this rank loads: its restored local state
        when one is newer than ``global_dir`` (--load's newest), else ``global_dir``."""
        iteration = None if global_dir is None else int(global_dir.name[len("iter_"):])
        name = "" if global_dir is None else str(global_dir.parent)
        local = restore(self.link, self.root, self.config_hash, iteration, name, self.sees)
        return local or global_dir

    def saver(self, cfg: TrainConfig, state: ParallelState, params: list[nn.Parameter],
              optimizer: MixedPrecisionOptimizer, rng: RNGStreams, lr_schedule: LRSchedule,
              series: str) -> LocalSaver:
        return LocalSaver(cfg, state, params, optimizer, rng, lr_schedule, series, self.link,
                          self.root, self.config_hash)


def open_local(cfg: TrainConfig, state: ParallelState) -> LocalCheckpoints | None:
    """The run's local checkpoints, or None without --non-persistent-ckpt-type. Makes a
    process group: every rank calls it at the same point of the build."""
    if cfg.checkpoint.non_persistent_ckpt_type is None:
        return None
    digest = store.config_hash(dataclasses.asdict(cfg), layout(cfg, state))
    return LocalCheckpoints(PeerLink(state.world_rank, state.world_size),
                            store.store_root(cfg.checkpoint), digest)
