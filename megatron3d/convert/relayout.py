"""Offline relayout: a checkpoint rewritten for another (TP, PP, DP, ZeRO) layout, in one
process and without a process group.

Any layout already loads any checkpoint (chunks are layout-free); what a relayout adds is a
checkpoint whose files are the ones a run at the target layout writes: ``meta.json`` names
that layout, there is one rank file per target rank, and each holds the chunks that rank
owns in training (``chunks.owns``): its TP slice of every tensor of its pipeline stage (the
stage found by the partitioner training uses), TP-replicated tensors on TP rank 0, a tied
copy only on the first stage; under ZeRO each slice is spread over the data-parallel ranks
in even ranges (not ZeRO's flat buckets: a chunk says what it holds, so loaders need no
more). So rank files keep the size the target run's ranks write, whatever the source was.

The whole run state is carried (weights, both Adam moments and step, iteration, consumed
samples and tokens, loss scaler, series), so the result continues the same run. The per-rank
RNG states are carried only to the same layout; another layout starts fresh dropout streams,
as a resharded load does. One target pipeline stage is in memory at a time.
"""

from __future__ import annotations

import copy
import math
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron3d.checkpoint import chunk_index, io, safety
from megatron3d.checkpoint.chunks import new_chunk, tp_slice
from megatron3d.checkpoint.reader import CheckpointReader
from megatron3d.config import ModelConfig, TrainingConfig
from megatron3d.config.ranges import BATCH
from megatron3d.convert.contents import Layout, Owned, check_contents, saved_kinds, stage_params
from megatron3d.convert.standalone import carried_files, saved_config
from megatron3d.convert.streaming import logical_tensors
from megatron3d.errors import ConfigError
from megatron3d.mpu.meta import ParamMeta
from megatron3d.mpu.topology import Topology


@dataclass(frozen=True)
class ReshapeReport:
    checkpoint: Path
    layout: Layout
    tensors: int  # logical tensors of every kind
    largest_stage_bytes: int  # the most chunk bytes held at once (one target stage)


def reshape(load: str, save: str, tp: int, pp: int, dp: int = 1, zero_stage: int | None = None,
            partition_method: str | None = None) -> ReshapeReport:
    """The newest checkpoint in ``load`` rewritten for the layout (``tp``, ``pp``, ``dp``,
    ``zero_stage``) as the only checkpoint of the new directory ``save``; stages are cut
    with ``partition_method``. The ZeRO stage and the method default to the saved run's.
    Everything is checked before anything is written."""
    reader = CheckpointReader.latest(load)
    cfg = saved_config(reader.meta)
    target = Layout(tp, pp, dp, cfg.parallel.zero_stage if zero_stage is None else zero_stage)
    _check_batch(cfg.training, reader.meta["layout"]["dp"], dp)  # bounds the rank files
    method = partition_method or cfg.parallel.pp_partition_method
    stages = stage_params(cfg.model, target, method)
    root = Path(save)
    _check_new_root(root)
    wanted = [[(p, kind) for p in stage for kind in saved_kinds(reader, p.meta.name)]
              for stage in stages]
    check_contents(reader, [pair for pairs in wanted for pair in pairs])
    meta = _target_meta(reader.meta, target, method)
    final = _write(root, meta, _rank_files(reader, cfg.model, wanted, target),
                   carried_files(reader))
    sizes = [sum(4 * math.prod(p.shape) for p, _ in pairs) for pairs in wanted]
    return ReshapeReport(final, target, sum(map(len, wanted)), max(sizes))


def _check_batch(training: TrainingConfig, saved_dp: int, dp: int) -> None:
    """At most as many data-parallel ranks as the saved run's global batch has samples (each
    rank takes at least one per step; a larger batch can be set when loading at any layout);
    for a converted checkpoint, which records no batch yet, the largest batch a run takes
    (``BATCH``). Each DP rank is a rank file per (TP, PP) rank: a typo must not write 10**5."""
    if training.micro_batch_size is None:
        most, what = int(BATCH.high), "the largest global batch a run takes"
    else:
        most = training.global_batch_size or training.micro_batch_size * saved_dp
        what = f"the saved run's global batch of {most} samples"
    if dp > most:
        raise ConfigError(f"--data-parallel-size {dp} exceeds {what} (each data-parallel rank "
                          f"takes at least one sample per step): give at most {most}, or load "
                          "the checkpoint directly at any layout with a larger "
                          "--global-batch-size; nothing was written")


def _check_new_root(root: Path) -> None:
    """``root`` must be a writable directory holding no checkpoint (nothing is replaced)."""
    safety.check_save_dir(root)
    if io.has_checkpoints(root):
        raise ConfigError(f"--save {root} already holds checkpoints: choose a new directory, "
                          "nothing was written")


def _target_meta(meta: dict[str, Any], target: Layout, method: str) -> dict[str, Any]:
    """The source's run state and configuration, with the target layout."""
    result = copy.deepcopy(meta)
    result["layout"] = target.as_meta()
    result["config"].setdefault("parallel", {}).update(
        tensor_model_parallel_size=target.tp, pipeline_model_parallel_size=target.pp,
        zero_stage=target.zero_stage, pp_partition_method=method)
    return result


def _rank_files(reader: CheckpointReader, model: ModelConfig,
                wanted: list[list[tuple[Owned, str]]],
                target: Layout) -> Iterator[tuple[int, dict[str, Any]]]:
    """(rank, payload) for every target rank in order, one pipeline stage at a time."""
    grid = Topology(target.world_size, target.tp, target.pp)
    rows = model.padded_vocab_size(target.tp)
    same_layout = reader.meta["layout"] == target.as_meta()
    for stage, pairs in enumerate(wanted):
        metas = {p.meta.name: p.meta for p, _ in pairs}
        chunks: dict[int, list[dict]] = {grid.rank_of(t, d, stage): []  # in rank order
                                         for d in range(target.dp) for t in range(target.tp)}
        named = ((p.meta.name, kind) for p, kind in pairs)
        for name, kind, logical in logical_tensors(reader, named):
            for tp_rank, dp_rank, chunk in _pieces(logical, metas[name], kind, target, rows):
                chunks[grid.rank_of(tp_rank, dp_rank, stage)].append(chunk)
        for rank, mine in chunks.items():
            yield rank, {"chunks": mine,
                         "rng": reader.files[rank]["rng"] if same_layout else None,
                         "iteration": reader.meta["iteration"], "rank": rank,
                         "layout": target.as_meta()}


def _pieces(logical: torch.Tensor, meta: ParamMeta, kind: str, target: Layout,
            rows: int) -> Iterator[tuple[int, int, dict]]:
    """(tp rank, dp rank, chunk) for every piece of ``logical`` the target ranks write."""
    spread = target.dp if target.zero_stage else 1
    for tp_rank in range(target.tp if meta.tp_split_dim is not None else 1):
        local = tp_slice(logical, meta, tp_rank, target.tp, rows)
        flat = local.reshape(-1)
        for dp_rank in range(spread):
            start, end = flat.numel() * dp_rank // spread, flat.numel() * (dp_rank + 1) // spread
            if end > start:
                yield tp_rank, dp_rank, new_chunk(meta, kind, tp_rank, target.tp,
                                                  tuple(local.shape), start, end,
                                                  flat[start:end].clone())


def _write(root: Path, meta: dict[str, Any], files: Iterator[tuple[int, dict[str, Any]]],
           carried: dict[str, Path]) -> Path:
    """``root/iter_N``: the rank files as they come, copies of ``carried`` (name inside it
    -> source), ``meta.json``, the chunk index, then ``latest``. A failure part-way leaves
    nothing behind (``root`` itself, when this made it)."""
    final = io.iteration_dir(root, meta["iteration"])
    tmp = final.with_name(final.name + ".tmp")
    created = not root.exists()
    try:
        with io.writing(root):
            io.clear_for_save(root, meta["iteration"])
            tmp.mkdir()
            for rank, payload in files:
                io.write_rank(tmp, rank, payload)
            for name, source in carried.items():
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, tmp / name)
            io.write_meta(tmp, meta)
            chunk_index.write_index(tmp, meta)
            io.publish(root, meta["iteration"])
    except BaseException:
        shutil.rmtree(root if created else tmp, ignore_errors=True)
        raise
    return final
