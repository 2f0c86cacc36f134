"""What ``import_hf`` checks before it trusts a Hugging Face model: sizes that training
accepts, a sequence the model has positions for, weights of the shapes its config gives, and
finite values. Each refusal is one ``ConfigError`` line naming the key or tensor.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from megatron3d.config import ModelConfig
from megatron3d.convert.contents import model_tensors
from megatron3d.convert.hf import tensor_map
from megatron3d.errors import ConfigError


def check_sizes(fields: dict[str, Any]) -> None:
    """Every ModelConfig field inside the range pretrain_gpt.py accepts for its flag, checked
    before anything is built from them (a size typo must not allocate or loop for long)."""
    for field in dataclasses.fields(ModelConfig):
        value, bounds = fields.get(field.name), field.metadata["range"]
        if isinstance(value, int | float) and bounds is not None and (
                value not in bounds or not math.isfinite(value)):
            flag = "--" + field.name.replace("_", "-")
            raise ConfigError(f"config.json gives {field.name}={value}, beyond what "
                              f"pretrain_gpt.py accepts ({flag} in {bounds}): this model "
                              "cannot be trained here")


def check_positions(hf: dict[str, Any], seq_length: int | None) -> None:
    """``--seq-length`` within the positions the model was made for (its learned table, or
    the RoPE range it was trained on); ALiBi models name none."""
    key = next((k for k in ("n_positions", "max_position_embeddings") if k in hf), None)
    positions = hf.get(key) if key else None
    if seq_length is not None and isinstance(positions, int) and seq_length > positions:
        raise ConfigError(f"--seq-length {seq_length} is above the model's {key}={positions}: "
                          f"pass --seq-length {positions} or less")


def expected_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Their tensor name -> the shape ``model``'s config gives it (computed on the meta
    device through the export mapping, so import and export agree by construction)."""
    shapes = {}
    for owned in model_tensors(model):
        empty = torch.empty(owned.shape, device="meta")
        shapes.update((name, tuple(t.shape))
                      for name, t in tensor_map.to_hf(model, owned.meta.name, empty))
    return shapes


def check_shapes(expected: dict[str, tuple[int, ...]],
                 shape_of: Callable[[str], tuple[int, ...]]) -> None:
    """Every tensor present with its config's shape, read from the files' headers only."""
    for name, shape in expected.items():
        found = tuple(shape_of(name))
        if found != shape:
            raise ConfigError(f"{name} is {list(found)} in the weights but config.json makes "
                              f"it {list(shape)}: the weights and config.json are of different "
                              "models; download or save the model again")


def finite(get: Callable[[str], torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """``get`` refusing a tensor that holds NaN or inf, as each is read."""
    def checked(name: str) -> torch.Tensor:
        tensor = get(name)
        if not bool(torch.isfinite(tensor).all()):
            raise ConfigError(f"{name} holds NaN or inf: the model is damaged (or was saved "
                              "after training diverged); nothing was written")
        return tensor
    return checked
