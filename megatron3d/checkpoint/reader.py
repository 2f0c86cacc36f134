"""A saved checkpoint as logical tensors, read one at a time by any process.

Rank files are memory-mapped (``io.read_rank``), so opening a checkpoint reads only its
metadata and chunk descriptions; a tensor's bytes are read when ``tensor`` assembles it. The
offline tools (export, generation, relayout) read through this, so a checkpoint from any
(TP, PP, DP, ZeRO) layout looks the same to them; training, which needs only each rank's
part, loads through ``shard_reader.py`` instead.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from megatron3d.checkpoint import io, safety
from megatron3d.checkpoint.chunks import assemble, index_chunks
from megatron3d.checkpoint.overlap import logical_shape
from megatron3d.config import ModelConfig
from megatron3d.errors import CheckpointError


def find(root: str) -> Path | None:
    """The newest complete checkpoint under ``root``, or None for an empty or missing dir
    (never for an iteration directory or a file: those are refused)."""
    path = Path(root)
    safety.check_load_root(path)
    if not io.has_checkpoints(path):
        return None
    return io.iteration_dir(path, io.read_latest(path))


class CheckpointReader:
    """One checkpoint directory (``iter_XXXXXXX``): its metadata, rank files and chunks."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.meta: dict[str, Any] = io.read_meta(directory)
        self.files = [io.read_rank(directory, r)
                      for r in range(self.meta["layout"]["world_size"])]
        for rank, payload in enumerate(self.files):  # before anything is used
            safety.check_rank_file(directory, rank, payload, self.meta)
        self._index = index_chunks(c for f in self.files for c in f["chunks"])

    @classmethod
    def latest(cls, root: str | Path) -> CheckpointReader:
        """The newest complete checkpoint under the checkpoint root ``root``."""
        directory = find(str(root))
        if directory is None:
            raise CheckpointError(f"no checkpoint in {root}: pass the --save directory of a "
                                  "run that saved one")
        return cls(directory)

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig(**self.meta["config"]["model"])

    def names(self, kind: str = "weight") -> list[str]:
        """Logical tensor names, in the order the saving ranks wrote them."""
        return [name for name, k in self._index if k == kind]

    def has(self, name: str, kind: str = "weight") -> bool:
        return (name, kind) in self._index

    def tensor(self, name: str, kind: str = "weight") -> torch.Tensor:
        """The whole logical fp32 tensor (vocabulary padding dropped). Saving refuses NaN and
        Inf, so one found here means a damaged file, refused before it is trained on."""
        logical = assemble(name, kind, self._chunks(name, kind))
        if not torch.isfinite(logical).all():
            raise CheckpointError(f"{self.directory} holds NaN or Inf in {name} ({kind}), which "
                                  "no save writes: the checkpoint is damaged, load an earlier "
                                  "one")
        return logical

    def shape(self, name: str, kind: str = "weight") -> tuple[int, ...]:
        """The logical tensor's shape from its chunk descriptions alone, reading no data (so
        a streaming writer can lay out its file before any tensor is assembled)."""
        first = self._chunks(name, kind)[0]
        return logical_shape(tuple(first["local_shape"]), first["split_dim"], first["tp_size"],
                             first["logical_rows"])

    def complete(self, name: str, kind: str = "weight") -> bool:
        """Whether the chunks of ``name`` cover every saving TP rank's whole slice, judged
        from their descriptions alone (no data read): a lost rank file leaves a gap that
        ``tensor`` would meet only when assembling it."""
        chunks = self._chunks(name, kind)
        numel = math.prod(chunks[0]["local_shape"])
        covered = [0] * chunks[0]["tp_size"]
        for c in chunks:
            covered[c["tp_rank"]] += c["end"] - c["start"]
        return all(n == numel for n in covered)

    def _chunks(self, name: str, kind: str) -> list[dict]:
        if (name, kind) not in self._index:
            raise CheckpointError(f"{self.directory} has no {kind} of {name}: a shard file is "
                                  "missing, or the model differs")
        return self._index[(name, kind)]
