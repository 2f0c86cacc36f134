"""Read a Hugging Face transformers model directory into a megatron3d checkpoint.

GPT-2, BLOOM, Llama 2/3.x, Mistral and Qwen2 directories with ``config.json`` and
safetensors weights (one file or shards with an index) or a ``pytorch_model.bin`` (read
with the weights-only unpickler, so it cannot run code). The result is iteration 0 of a new
series (``offline.py``) that ``pretrain_gpt.py --load DIR --use-checkpoint-args`` trains at
any layout; ``--tensor-model-parallel-size``/``--pipeline-model-parallel-size`` are checked
here so a layout the model cannot take is refused before anything is written.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from megatron3d.config import (
    DataConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    TrainingConfig,
)
from megatron3d.convert.contents import Layout, model_tensors, stage_params
from megatron3d.convert.hf import import_checks, mapping, numerics, tensor_map, tokenizer_files
from megatron3d.convert.offline import write_checkpoint
from megatron3d.errors import CheckpointError, ConfigError
from megatron3d.log import get_logger

logger = get_logger(__name__)


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


@dataclass(frozen=True)
class Weights:
    """A model directory's tensors by their names: ``shape`` from the files' headers,
    ``tensor`` read (as fp32) when asked."""

    shape: Callable[[str], tuple[int, ...]]
    tensor: Callable[[str], torch.Tensor]


def weights(directory: Path) -> Weights:
    """The directory's weight files, read lazily. Every file is opened here, so a missing
    package or an unreadable file is refused before any writing."""
    index = directory / "model.safetensors.index.json"
    single = directory / "model.safetensors"
    if index.exists() or single.exists():
        return _safetensors_weights(directory, _weight_map(index) if index.exists() else None,
                                    single)
    binary = directory / "pytorch_model.bin"
    if binary.exists():
        state = _load_binary(binary)
        return Weights(lambda name: tuple(_lookup(state, name, binary).shape),
                       lambda name: _lookup(state, name, binary).to(torch.float32))
    raise ConfigError(f"--hf {directory} has no model.safetensors, sharded safetensors or "
                      "pytorch_model.bin: pass a Hugging Face model directory")


def _safetensors() -> tuple[Callable[..., Any], type[Exception]]:
    """safetensors' ``safe_open`` and the error it raises for a damaged file."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:
        raise ConfigError("reading safetensors weights needs the safetensors package: "
                          "pip install -e '.[hf]'") from None
    return safe_open, SafetensorError


def _weight_map(index: Path) -> dict[str, Path]:
    """Tensor name -> shard file, from a sharded checkpoint's index; every file a plain
    name inside the model directory (an index must not make the import read elsewhere)."""
    try:
        mapping = json.loads(index.read_text())["weight_map"]
        files = {name: PurePosixPath(file) for name, file in mapping.items()}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        raise ConfigError(f"{index} is not a safetensors index (JSON with a weight_map of "
                          "tensor name -> file): the directory is damaged") from None
    for name, file in files.items():
        if file.is_absolute() or ".." in file.parts or "\\" in str(file):
            raise ConfigError(f"{index} names {str(file)!r} for {name}, outside the model "
                              "directory: an index may only name files beside it; fix the "
                              "index or save the model again")
    return {name: index.parent / file for name, file in files.items()}


def _safetensors_weights(directory: Path, files: dict[str, Path] | None,
                         single: Path) -> Weights:
    safe_open, damaged = _safetensors()
    handles: dict[Path, tuple[Any, set[str]]] = {}
    for path in sorted(set(files.values())) if files is not None else [single]:
        try:
            handle = safe_open(str(path), framework="pt")
        except (OSError, damaged) as err:
            raise ConfigError(f"{path} cannot be read as safetensors "
                              f"({str(err).splitlines()[0][:120]}): the file is missing or "
                              "damaged; download or save the model again") from None
        handles[path] = (handle, set(handle.keys()))

    def handle_of(name: str) -> Any:
        path = files.get(name) if files is not None else single
        handle, names = handles.get(path, (None, set()))
        if name not in names:
            raise CheckpointError(f"{path or directory} has no tensor {name}: the weights do "
                                  "not match config.json")
        return handle

    return Weights(lambda name: tuple(handle_of(name).get_slice(name).get_shape()),
                   lambda name: handle_of(name).get_tensor(name).to(torch.float32))


def _load_binary(path: Path) -> dict[str, torch.Tensor]:
    """A ``pytorch_model.bin`` through torch's weights-only unpickler: tensors and plain
    containers only, so a file that would run code is refused instead of executed."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, ValueError, EOFError) as err:
        first = (str(err).strip() or type(err).__name__).splitlines()[0][:120]
        raise ConfigError(f"{path} cannot be read with torch's weights-only loader ({first}): "
                          "it holds something other than tensors, or is damaged; save the "
                          "model as safetensors") from None
    if not isinstance(state, dict):
        raise ConfigError(f"{path} holds a {type(state).__name__}, not a state dict of "
                          "tensors: save the model again with save_pretrained")
    return state


def _lookup(state: dict[str, torch.Tensor], name: str, path: Path) -> torch.Tensor:
    if not isinstance(state.get(name), torch.Tensor):
        raise CheckpointError(f"{path} has no tensor {name}: the weights do not match "
                              "config.json")
    return state[name]


def import_hf(hf_dir: str, save: str, tp: int, pp: int,
              seq_length: int | None) -> tuple[Path, int]:
    """The checkpoint written and the most tensor bytes it held at once (one layer's).
    The config, the layout, the output and every weight file are checked first."""
    directory = Path(hf_dir)
    hf = read_config(directory)
    fields = mapping.model_fields(hf, seq_length)
    import_checks.check_sizes(fields)
    import_checks.check_positions(hf, seq_length)
    model = ModelConfig(**fields)
    mapping.flavour_of(model)
    stage_params(model, Layout(tp, pp, 1, 0), ParallelConfig().pp_partition_method)  # checks
    found = weights(directory)
    import_checks.check_shapes(import_checks.expected_shapes(model), found.shape)
    get = import_checks.finite(found.tensor)
    tokenizer = tokenizer_files.find(directory, model.vocab_size)
    cfg = TrainConfig(model=model, training=TrainingConfig(),
                      parallel=ParallelConfig(tensor_model_parallel_size=tp,
                                              pipeline_model_parallel_size=pp),
                      data=DataConfig(**tokenizer.data) if tokenizer else DataConfig())
    pieces = [tensor_map.from_hf(model, names, get)
              for names in tensor_map.pieces_by_layer([t.meta.name for t in model_tensors(model)])]
    notices = [*numerics.differences(hf), *([tokenizer.notice] if tokenizer else [])]
    for line in filter(None, notices):
        logger.info("notice: %s", line)
    logger.info("tokenizer: %s", f"{tokenizer.data['tokenizer_type']}, copied into the "
                "checkpoint" if tokenizer else "none beside the model (training names its own)")
    return write_checkpoint(Path(save), cfg, pieces, tokenizer.files if tokenizer else None)
