"""A checkpoint as a plain model: ``load_model(dir)`` in one process, from any saved layout.

For evaluation, generation and export, without process groups or internals: the whole model
is built on one device (fp32 unless asked otherwise) and each parameter is filled from the
checkpoint's logical tensor, read one at a time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megatron3d.checkpoint.reader import CheckpointReader
from megatron3d.config import SECTIONS, TrainConfig
from megatron3d.data.tokenizer import TokenizerSpec
from megatron3d.model.context import LayerContext
from megatron3d.model.gpt import build_gpt
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.state import AxisGroup


@dataclass(frozen=True)
class LoadedModel:
    """``model``: token ids [b, s] -> logits [s, b, padded vocabulary], in eval mode;
    ``config``: the saved run's configuration; ``tokenizer``: its tokenizer settings."""

    model: nn.Module
    config: TrainConfig
    iteration: int
    tokenizer: TokenizerSpec | None

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """[b, s] token ids (on any device) -> [b, s, vocabulary] logits (padding columns
        dropped), on the model's device."""
        device = next(self.model.parameters()).device
        out = self.model(tokens.to(device))  # [s, b, Vpad]
        return out.transpose(0, 1)[..., : self.config.model.vocab_size].float()


def saved_config(meta: dict[str, Any]) -> TrainConfig:
    """The run configuration stored in ``meta.json``; fields this version does not know are
    left out and fields it added take their defaults."""
    saved = meta["config"]
    sections = {}
    for name, cls in SECTIONS.items():
        known = {f.name for f in dataclasses.fields(cls)}
        values = saved.get(name, {})
        sections[name] = cls(**{k: tuple(v) if isinstance(v, list) else v
                                for k, v in values.items() if k in known})
    return TrainConfig(**sections)


def checkpoint_config(reader: CheckpointReader) -> TrainConfig:
    """``saved_config`` of the checkpoint ``reader`` has open, with each relative tokenizer
    path that names a file inside the checkpoint (what import_hf copied there) made a real
    path: the checkpoint keeps its tokenizer wherever it is moved."""
    cfg = saved_config(reader.meta)
    inside = {f: str(reader.directory / getattr(cfg.data, f)) for f in _TOKENIZER_PATHS
              if getattr(cfg.data, f) is not None and not Path(getattr(cfg.data, f)).is_absolute()
              and (reader.directory / getattr(cfg.data, f)).exists()}
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **inside))


_TOKENIZER_PATHS = ("tokenizer_model", "vocab_file", "merge_file", "tokenizer_name_or_path")


def carried_files(reader: CheckpointReader) -> dict[str, Path]:
    """The tokenizer files inside the checkpoint ``reader`` has open (what import_hf copied
    there), by their name in it: a tool that rewrites the checkpoint copies them along, or
    the new one would name files it does not have."""
    cfg, found = saved_config(reader.meta), {}
    for field in _TOKENIZER_PATHS:
        name = getattr(cfg.data, field)
        if name is None or Path(name).is_absolute():
            continue
        path = reader.directory / name
        if ".." in Path(name).parts:  # a crafted meta.json must not name files elsewhere
            continue
        if path.is_file():
            found[name] = path
        elif path.is_dir():
            found.update((f"{name}/{f.name}", f) for f in path.iterdir() if f.is_file())
    return found


def load_model(checkpoint_dir: str | Path, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> LoadedModel:
    """The newest checkpoint under ``checkpoint_dir`` (a --save directory) as one model."""
    return model_of(CheckpointReader.latest(checkpoint_dir), dtype, device)


def model_of(reader: CheckpointReader, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> LoadedModel:
    """The checkpoint ``reader`` has open as one model (a tool that already checked it)."""
    cfg = checkpoint_config(reader)
    eager = dataclasses.replace(cfg.model, compile=False)  # generation's lengths vary
    model = build_gpt(LayerContext(eager, AxisGroup.single(), cfg.training.seed, dtype,
                                   torch.device(device)))
    with torch.no_grad():
        for p in model.parameters():
            meta = get_meta(p)
            logical = reader.tensor(meta.name)
            p.zero_()  # vocabulary padding rows stay zero
            p[: logical.shape[0]].copy_(logical)
    return LoadedModel(model.eval(), cfg, reader.meta["iteration"], tokenizer_spec(cfg))


def tokenizer_spec(cfg: TrainConfig) -> TokenizerSpec | None:
    """The tokenizer the run trained with, as it recorded it (None on mock data)."""
    data = cfg.data
    return None if data.tokenizer_type is None else TokenizerSpec(
        tokenizer_type=data.tokenizer_type, tokenizer_model=data.tokenizer_model,
        vocab_file=data.vocab_file, merge_file=data.merge_file,
        tokenizer_name_or_path=data.tokenizer_name_or_path,
        vocab_size=cfg.model.vocab_size - 1 if data.tokenizer_type == "NullTokenizer" else None)
