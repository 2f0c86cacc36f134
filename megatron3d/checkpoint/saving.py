"""Save a run's state (``loading.py`` loads it into any layout).

What a checkpoint holds: the fp32 weights and Adam moments as layout-free chunks (see
``chunks.py``), Adam's step, the loss scaler, the iteration and consumed samples/tokens (which
fix the data position, batch size and learning rate), the resolved learning-rate schedule,
every rank's RNG states, the full configuration and the layout it was saved with. The state
goes to host memory straight from the optimizer's tensors (``snapshot.py``: no copy of it on
the device). A save blocks until the checkpoint is published, or with --async-save only until
the state is in host memory (``async_save.py`` writes and publishes it while training goes
on).
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from megatron3d.checkpoint import chunk_index, io
from megatron3d.checkpoint.async_save import BackgroundSave
from megatron3d.checkpoint.progress import Progress
from megatron3d.checkpoint.snapshot import HostSnapshot
from megatron3d.config import TrainConfig
from megatron3d.errors import TrainingError
from megatron3d.log import get_logger
from megatron3d.mpu import comm
from megatron3d.mpu.random import RNGStreams
from megatron3d.mpu.state import ParallelState
from megatron3d.optim.lr_schedule import LRSchedule
from megatron3d.optim.mixed_precision import MixedPrecisionOptimizer

logger = get_logger(__name__)
_SERIES_BYTES = 32  # a series: uuid4().hex, or "" for checkpoints older than series


def layout(cfg: TrainConfig, state: ParallelState) -> dict[str, int]:
    """How the run is laid out; saved RNG states are restored only into the same one. Model
    chunks per pipeline rank appear only with interleaving, the context-parallel size only
    above 1 (older checkpoints lack them)."""
    chunks = cfg.parallel.virtual_size(cfg.model.num_layers)
    return {"world_size": state.world_size, "tp": state.tp.size, "pp": state.pp.size,
            "dp": state.dp.size, "zero_stage": cfg.parallel.zero_stage,
            **({"virtual": chunks} if chunks > 1 else {}),
            **({"cp": state.cp.size} if state.cp.size > 1 else {})}


class Saver:
    """The run's saves into ``--save``, in its series: ``saver(progress)`` saves and returns
    the checkpoint's directory, ``wait()`` returns once the last save is published. Without
    --async-save each save is published before it returns; with it, saves finish in the
    background (``BackgroundSave``, whose host buffer lives as long as this)."""

    def __init__(self, cfg: TrainConfig, state: ParallelState, params: list[nn.Parameter],
                 optimizer: MixedPrecisionOptimizer, rng: RNGStreams, lr_schedule: LRSchedule,
                 series: str) -> None:
        assert cfg.checkpoint.save is not None
        self.root = cfg.checkpoint.save
        self.cfg, self.state, self.params, self.optimizer = cfg, state, params, optimizer
        self.rng, self.lr_schedule = rng, lr_schedule
        self.series = agreed_series(series, state, optimizer.shard.grads.device)
        self.background = (BackgroundSave(state, optimizer.shard.grads.device)
                           if cfg.checkpoint.async_save else None)
        self._snapshot: HostSnapshot | None = None  # allocated at the first save

    def __call__(self, progress: Progress) -> str:
        if self._snapshot is None:
            self._snapshot = HostSnapshot(self.params, self.optimizer.shard, self.state,
                                          self.optimizer.replica_axes)
        save(self.root, self.cfg, self.state, self.optimizer, progress, self.series, self.rng,
             self.lr_schedule, self._snapshot, self.background)
        return str(io.iteration_dir(Path(self.root), progress.iteration))

    @property
    def host_bytes(self) -> int:
        """Host memory the saver holds: its snapshot buffer, once the first save made it."""
        return 0 if self._snapshot is None else self._snapshot.nbytes

    def wait(self) -> None:
        """Every rank, at the same point: return once the last save is published."""
        if self.background is not None:
            self.background.wait()


def save(root: str, cfg: TrainConfig, state: ParallelState, optimizer: MixedPrecisionOptimizer,
         progress: Progress, series: str, rng: RNGStreams, lr_schedule: LRSchedule,
         snapshot: HostSnapshot, background: BackgroundSave | None = None) -> None:
    """Every rank writes its own file (its part of the optimizer state, copied through
    ``snapshot``); rank 0 publishes the checkpoint when all are done. Non-finite weights or
    moments are refused on every rank before anything is written; a write that fails (a full
    disk, a path that changed) is a ``CheckpointError`` on the rank that met it, and the
    checkpoints already published stay as they were. With ``background`` (--async-save) the
    save before is finished first, and this returns once the state is in host memory: the
    files are written and published while training goes on."""
    path = Path(root)
    staging = io.staging_dir(path, progress.iteration, series)
    if background is not None:
        background.wait()  # at most one save in flight: the snapshot is free again
    if _published(path, progress.iteration, series, state, optimizer.shard.grads.device):
        return
    _check_finite(optimizer.state_not_finite(), state, progress.iteration, path)
    snapshot.capture(optimizer.live_state)
    if state.world_rank == 0:
        with io.writing(path):
            io.clear_for_save(path, progress.iteration, series)
            staging.mkdir()
    comm.barrier(state.world)
    payload = rank_payload(cfg, state, snapshot, rng, progress.iteration)
    meta = (meta_of(cfg, state, optimizer, progress, series, lr_schedule)
            if state.world_rank == 0 else None)
    if background is not None:
        background.start(path, payload, meta, cfg.checkpoint.keep_last_n, series)
        return
    with io.writing(path):
        io.write_rank(staging, state.world_rank, payload)
    comm.barrier(state.world)
    if meta is not None:
        chunk_index.finish(path, meta, cfg.checkpoint.keep_last_n)
    comm.barrier(state.world)
    logger.info("saved checkpoint at iteration %d to %s", progress.iteration,
                io.iteration_dir(path, progress.iteration))


def agreed_series(series: str, state: ParallelState, device: torch.device) -> str:
    """Rank 0's series on every rank (each drew its own for a new run, and only rank 0's is
    written): every rank writes into the same ``iter_N.SERIES.tmp``. One broadcast, at
    build."""
    code = torch.tensor(list(series.encode().ljust(_SERIES_BYTES)), dtype=torch.uint8,
                        device=device)
    agreed = comm.broadcast(code, state.world, 0)
    return bytes(agreed.tolist()).decode().rstrip()


def rank_payload(cfg: TrainConfig, state: ParallelState, snapshot: HostSnapshot,
                 rng: RNGStreams, iteration: int) -> dict[str, Any]:
    """What a rank file holds (see ``payload.py`` and ``safety.py``): the captured chunks,
    this moment's RNG states, and whose file it is."""
    return {"chunks": snapshot.chunks, "rng": _capture_rng(rng), "iteration": iteration,
            "rank": state.world_rank, "layout": layout(cfg, state)}


def meta_of(cfg: TrainConfig, state: ParallelState, optimizer: MixedPrecisionOptimizer,
          progress: Progress, series: str, lr_schedule: LRSchedule) -> dict[str, Any]:
    """meta.json: the run's position and series, Adam's step, the loss scaler, the resolved
    learning-rate schedule, the configuration and the layout."""
    return {"format_version": io.FORMAT_VERSION, **dataclasses.asdict(progress), "series": series,
            "adam_step": optimizer.adam_step(), "layout": layout(cfg, state),
            "loss_scaler": optimizer.scaler.state_dict() if optimizer.scaler else None,
            "lr_schedule": dataclasses.asdict(lr_schedule), "config": dataclasses.asdict(cfg)}


def _published(root: Path, iteration: int, series: str, state: ParallelState,
               device: torch.device) -> bool:
    """Whether this checkpoint is already saved (the save interval and the end of the run
    met). Rank 0 decides, since only its series is ever written, and tells the others."""
    mine = state.world_rank == 0 and io.is_published(root, iteration, series)
    return comm.any_rank(mine, state.world, device)


def _check_finite(bad: torch.Tensor, state: ParallelState, iteration: int, root: Path) -> None:
    """Raise on every rank if any rank's fp32 weights or Adam moments hold a NaN/Inf
    (``bad``: this rank's flag), so a save never replaces a good checkpoint with a poisoned
    one (one sync, at save time)."""
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


