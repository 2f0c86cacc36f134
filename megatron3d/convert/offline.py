"""Write a checkpoint without a training run: converted weights as iteration 0.

The result is an ordinary checkpoint in the layout-free chunk format: every logical tensor is
one whole chunk, with no Adam moments (zero before the first step) and no RNG states (the
loading run starts fresh streams). Any (TP, PP, DP, ZeRO) layout loads it, as it loads any
checkpoint; a run resuming from it continues its series. The tensors come in pieces (a layer
each), one rank file per piece, so only one piece is in memory at a time; the layout says
so: as many data-parallel "ranks" as pieces, which only a run of exactly that layout would
match (and it, too, starts fresh RNG streams).
"""

from __future__ import annotations

import dataclasses
import shutil
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch

from megatron3d.checkpoint import io, safety
from megatron3d.config import TrainConfig
from megatron3d.errors import ConfigError


def whole_chunk(name: str, tensor: torch.Tensor) -> dict:
    """One logical tensor as the single chunk that holds all of it."""
    flat = tensor.detach().to(torch.float32).contiguous().reshape(-1).clone()
    return {"name": name, "kind": "weight", "tp_size": 1, "tp_rank": 0, "split_dim": None,
            "stride": 1, "logical_rows": None, "local_shape": tuple(tensor.shape), "start": 0,
            "end": flat.numel(), "data": flat}


def write_checkpoint(root: Path, cfg: TrainConfig,
                     pieces: Sequence[Iterable[tuple[str, torch.Tensor]]],
                     files: Mapping[str, Path] | None = None) -> tuple[Path, int]:
    """``root/iter_0000000`` holding the tensors of ``pieces`` (each a lazy iterable, read
    in turn), ``cfg`` and copies of ``files`` (name inside it -> source, e.g. a tokenizer);
    ``root`` must hold no checkpoint (nothing saved is replaced). A failure while reading a
    piece removes what was written. Returns the checkpoint and the most tensor bytes held
    at once (the largest piece)."""
    safety.check_save_dir(root)
    if io.has_checkpoints(root):
        raise ConfigError(f"--save {root} already holds checkpoints: choose a new directory, "
                          "nothing was written")
    layout = {"world_size": len(pieces), "tp": 1, "pp": 1, "dp": len(pieces), "zero_stage": 0}
    final = io.iteration_dir(root, 0)
    tmp = final.with_name(final.name + ".tmp")
    created = not root.exists()
    with io.writing(root):
        io.clear_for_save(root, 0)
        tmp.mkdir()
    peak = 0
    try:
        for rank, piece in enumerate(pieces):
            chunks = [whole_chunk(name, t) for name, t in piece]
            peak = max(peak, sum(c["data"].numel() * 4 for c in chunks))
            with io.writing(root):
                io.write_rank(tmp, rank, {"chunks": chunks, "rng": None, "iteration": 0,
                                          "rank": rank, "layout": layout})
        for name, source in (files or {}).items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, tmp / name)
    except BaseException:  # bad input met part-way: leave nothing behind
        shutil.rmtree(root if created else tmp, ignore_errors=True)
        raise
    with io.writing(root):
        io.write_meta(tmp, {
            "format_version": io.FORMAT_VERSION, "iteration": 0, "consumed_samples": 0,
            "consumed_tokens": 0, "adam_step": 0, "layout": layout, "loss_scaler": None,
            "series": uuid.uuid4().hex, "config": dataclasses.asdict(cfg)})
        io.publish(root, 0)
    return final, peak
