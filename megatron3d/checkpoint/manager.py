"""Save a run's state (``loading.py`` loads it into any layout).

What a checkpoint holds: the fp32 weights and Adam moments as layout-free chunks (see
``chunks.py``), Adam's step, the loss scaler, the iteration and consumed samples/tokens (which
fix the data position, batch size and learning rate), the resolved learning-rate schedule,
every rank's RNG states, the full configuration and the layout it was saved with.
"""

from __future__ import annotations

import dataclasses
import random
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from megatron3d.checkpoint import io
from megatron3d.checkpoint.chunks import KINDS, make_chunks
from megatron3d.config import TrainConfig
from megatron3d.errors import TrainingError
from megatron3d.log import get_logger
from megatron3d.mpu import comm
from megatron3d.mpu.random import RNGStreams
from megatron3d.mpu.state import ParallelState
from megatron3d.optim.lr_schedule import LRSchedule
from megatron3d.optim.mixed_precision import MixedPrecisionOptimizer

logger = get_logger(__name__)


@dataclass(frozen=True)
class Progress:
    """Where the run is, and which series of checkpoints it continues: a run that starts
    from scratch (or fine-tunes) begins a new series, a resumed run continues the loaded one;
    ``--keep-last-n`` prunes only its own series."""

    iteration: int
    consumed_samples: int
    consumed_tokens: int
    series: str

    @staticmethod
    def new_series() -> str:
        """Only rank 0's choice is ever written (meta.json is rank 0's)."""
        return uuid.uuid4().hex


def layout(cfg: TrainConfig, state: ParallelState) -> dict[str, int]:
    """How the run is laid out; saved RNG states are restored only into the same one. Model
    chunks per pipeline rank appear only with interleaving (older checkpoints lack them)."""
    chunks = cfg.parallel.virtual_size(cfg.model.num_layers)
    return {"world_size": state.world_size, "tp": state.tp.size, "pp": state.pp.size,
            "dp": state.dp.size, "zero_stage": cfg.parallel.zero_stage,
            **({"virtual": chunks} if chunks > 1 else {})}


def save(root: str, cfg: TrainConfig, state: ParallelState, params: list[nn.Parameter],
         optimizer: MixedPrecisionOptimizer, progress: Progress, rng: RNGStreams,
         lr_schedule: LRSchedule) -> None:
    """Every rank writes its own file; rank 0 publishes the checkpoint when all are done.
    Non-finite weights or moments are refused on every rank before anything is written; a
    write that fails (a full disk, a path that changed) is a ``CheckpointError`` on the rank
    that met it, and the checkpoints already published stay as they were."""
    path = Path(root)
    final = io.iteration_dir(path, progress.iteration)
    tmp = final.with_name(final.name + ".tmp")
    if _published(path, progress, state, optimizer.shard.grads.device):
        return
    local = optimizer.local_state()
    _check_finite(local, state, progress.iteration, path)
    if state.world_rank == 0:
        with io.writing(path):
            io.clear_for_save(path, progress.iteration)
            tmp.mkdir()
    comm.barrier(state.world)
    chunks = make_chunks(params, optimizer.shard, local, state, cfg.parallel.zero_stage, KINDS)
    with io.writing(path):
        io.write_rank(tmp, state.world_rank, {  # iteration, rank, layout: see safety.py
            "chunks": chunks, "rng": _capture_rng(rng), "iteration": progress.iteration,
            "rank": state.world_rank, "layout": layout(cfg, state)})
    comm.barrier(state.world)
    if state.world_rank == 0:
        with io.writing(path):
            io.write_meta(tmp, {
                "format_version": io.FORMAT_VERSION, **dataclasses.asdict(progress),
                "adam_step": float(local["step"]), "layout": layout(cfg, state),
                "loss_scaler": optimizer.scaler.state_dict() if optimizer.scaler else None,
                "lr_schedule": dataclasses.asdict(lr_schedule), "config": dataclasses.asdict(cfg)})
            io.publish(path, progress.iteration)
            if cfg.checkpoint.keep_last_n:
                io.prune(path, cfg.checkpoint.keep_last_n, progress.series)
    comm.barrier(state.world)
    logger.info("saved checkpoint at iteration %d to %s", progress.iteration, final)


def _published(root: Path, progress: Progress, state: ParallelState,
               device: torch.device) -> bool:
    """Whether this checkpoint is already saved (the save interval and the end of the run
    met). Rank 0 decides, since only its series is ever written, and tells the others."""
    mine = state.world_rank == 0 and io.is_published(root, progress.iteration, progress.series)
    flag = torch.tensor([float(mine)], device=device)
    return bool(comm.all_reduce(flag, state.world, op=comm.MAX).item())


def _check_finite(local: dict[str, torch.Tensor], state: ParallelState, iteration: int,
                  root: Path) -> None:
    """Raise on every rank if any rank's fp32 weights or Adam moments hold a NaN/Inf, so a
    save never replaces a good checkpoint with a poisoned one (one sync, at save time)."""
    bad = torch.stack([~torch.isfinite(local[k]).all() for k in KINDS]).any().float()
    if comm.all_reduce(bad.reshape(1), state.world, op=comm.MAX).item():
        raise TrainingError(
            f"the weights at iteration {iteration} are not finite (NaN/Inf in the fp32 weights "
            f"or Adam moments): nothing was written and the previous checkpoints in {root} "
            "are kept; resume from the last good one with --load and a lower --lr")


def _capture_rng(rng: RNGStreams) -> dict[str, Any]:
    """Every RNG state as tensors and plain data (what the weights-only loader accepts)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                   "has_gauss": has_gauss, "cached_gaussian": gauss}
    return {"python": random.getstate(), "numpy": numpy_state, "torch": rng.get_state()}


