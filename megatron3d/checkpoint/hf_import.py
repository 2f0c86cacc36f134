"""Read a Hugging Face transformers model directory into a megatron3d checkpoint.

GPT-2, BLOOM and Llama (with grouped-query attention) directories with ``config.json`` and
safetensors weights (one file or shards with an index) or a ``pytorch_model.bin`` (read
with the weights-only unpickler, so it cannot run code). The result is iteration 0 of a new
series (``offline.py``) that ``pretrain_gpt.py --load DIR --use-checkpoint-args`` trains at
any layout; ``--tensor-model-parallel-size``/``--pipeline-model-parallel-size`` are checked
here so a layout the model cannot take is refused before anything is written.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatron3d.checkpoint import hf
from megatron3d.checkpoint.contents import Layout, model_tensors, stage_params
from megatron3d.checkpoint.offline import write_checkpoint
from megatron3d.config import ModelConfig, ParallelConfig, TrainConfig, TrainingConfig
from megatron3d.errors import CheckpointError, ConfigError


def read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--hf {directory} has no config.json: pass a Hugging Face model "
                          "directory (what save_pretrained writes)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path} cannot be read as JSON ({type(err).__name__}): the "
                          "directory is damaged") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} holds a JSON {type(config).__name__}, not an object")
    return config


def weights(directory: Path) -> Callable[[str], torch.Tensor]:
    """Tensor name -> tensor, read lazily from the directory's weight files."""
    index = directory / "model.safetensors.index.json"
    single = directory / "model.safetensors"
    if index.exists() or single.exists():
        from safetensors import safe_open  # an hf extra; present whenever such files are
        files = ({n: directory / f for n, f in json.loads(index.read_text())["weight_map"]
                  .items()} if index.exists() else None)
        handles: dict[Path, Any] = {}

        def get(name: str) -> torch.Tensor:
            path = files.get(name) if files is not None else single
            if path is None:
                raise CheckpointError(f"{directory} has no tensor {name}: the weights do not "
                                      "match config.json")
            if path not in handles:
                handle = safe_open(str(path), framework="pt")
                handles[path] = (handle, set(handle.keys()))
            handle, names = handles[path]
            if name not in names:
                raise CheckpointError(f"{path} has no tensor {name}: the weights do not "
                                      "match config.json")
            return handle.get_tensor(name).to(torch.float32)
        return get
    binary = directory / "pytorch_model.bin"
    if binary.exists():
        state = torch.load(binary, map_location="cpu", weights_only=True, mmap=True)
        return lambda name: _lookup(state, name, binary)
    raise ConfigError(f"--hf {directory} has no model.safetensors, sharded safetensors or "
                      "pytorch_model.bin: pass a Hugging Face model directory")


def _lookup(state: dict[str, torch.Tensor], name: str, path: Path) -> torch.Tensor:
    if name not in state:
        raise CheckpointError(f"{path} has no tensor {name}: the weights do not match "
                              "config.json")
    return state[name].to(torch.float32)


def import_hf(hf_dir: str, save: str, tp: int, pp: int,
              seq_length: int | None) -> tuple[Path, int]:
    """The checkpoint written and its peak tensor bytes (one layer's)."""
    directory = Path(hf_dir)
    model = ModelConfig(**hf.model_fields(read_config(directory), seq_length))
    hf.flavour_of(model)
    stage_params(model, Layout(tp, pp, 1, 0), ParallelConfig().pp_partition_method)  # checks
    get = weights(directory)
    cfg = TrainConfig(model=model, training=TrainingConfig(),
                      parallel=ParallelConfig(tensor_model_parallel_size=tp,
                                              pipeline_model_parallel_size=pp))
    pieces = [hf.from_hf(model, names, get)
              for names in hf.pieces_by_layer([t.meta.name for t in model_tensors(model)])]
    return write_checkpoint(Path(save), cfg, pieces)
