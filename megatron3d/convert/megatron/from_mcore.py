"""Read a Megatron-Core GPT checkpoint (``torch_dist``) into a megatron3d checkpoint.

What Megatron-Core's ``dist_checkpointing`` writes, as checked against megatron-core 0.16.1
(tests/checkpoint/test_import_megatron.py saves one with it):

- ``ROOT/latest_checkpointed_iteration.txt`` names ``ROOT/iter_%07d`` (or ``release``),
  which holds ``metadata.json`` (``"sharded_backend": "torch_dist"``), DCP's ``.metadata``
  and ``*.distcp`` files, and ``common.pt`` (the run's arguments, see ``mcore_args``).
- Tensors are described by their global shapes (whatever TP/PP they were saved at) under
  GPTModel's names without a prefix. Transformer layers are stacked along a leading layer axis under
  ``decoder.layers.<name>`` ([num_layers, ...]), each layer's TP shard a chunk of its own
  (so one layer is read at a time without touching the others); a model saved with
  non-homogeneous layers has ``decoder.layers.<i>.<name>`` instead; both are read.
- The norm before attention and before the MLP are ``linear_qkv.layer_norm_weight/bias``
  and ``linear_fc1.layer_norm_weight/bias`` (the Transformer-Engine names, which the local
  spec also saves under); a checkpoint with ``input_layernorm``/``pre_mlp_layernorm`` is read
  too. ``linear_qkv`` is per query group [q heads, k, v], SwiGLU's ``linear_fc1`` is
  [gate; up], Linear weights are [out, in]: all as ours, so no tensor changes layout.
- The word embedding holds the padded vocabulary, whose rows Megatron's softmax covers;
  they all become real rows here, so the imported model computes what Megatron computed.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from megatron3d.checkpoint import io
from megatron3d.cli import arguments
from megatron3d.config import ModelConfig, ParallelConfig, TrainConfig, TrainingConfig
from megatron3d.convert.contents import Layout, Owned, model_tensors, stage_params
from megatron3d.convert.hf import tensor_map
from megatron3d.convert.megatron import args as mcore_args
from megatron3d.convert.megatron.dcp_reader import DcpCheckpoint
from megatron3d.convert.offline import write_checkpoint
from megatron3d.errors import CheckpointError, ConfigError

TRACKER = "latest_checkpointed_iteration.txt"
_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")
# Our module -> GPTModel's names for it, the first one Megatron-Core writes.
_LAYER = {"input_norm": ("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
          "attention.qkv": ("self_attention.linear_qkv.",),
          "attention.dense": ("self_attention.linear_proj.",),
          "post_attention_norm": ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."),
          "mlp.fc1": ("mlp.linear_fc1.",), "mlp.fc2": ("mlp.linear_fc2.",)}
_REQUIRED_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")


def iteration_dir(load: Path) -> Path:
    """The checkpoint directory to read: ``load`` itself when it holds ``metadata.json``,
    else the iteration its tracker file names."""
    if not load.is_dir():
        raise ConfigError(f"--load {load} is not a directory: pass a Megatron-LM checkpoint "
                          "directory (the one holding latest_checkpointed_iteration.txt)")
    if (load / "metadata.json").exists():
        return load
    try:
        text = (load / TRACKER).read_text().strip()
    except (OSError, UnicodeDecodeError):
        raise ConfigError(f"--load {load} has no readable {TRACKER} nor metadata.json: pass "
                          "a Megatron-LM checkpoint directory") from None
    iteration = io.parse_iteration(text)
    name = "release" if text == "release" else None if iteration is None \
        else f"iter_{iteration:07d}"
    if name is None or not (load / name).is_dir():
        raise ConfigError(f"{load / TRACKER} names {text[:40]!r}, which is not a checkpoint "
                          f"in {load}: the checkpoint is damaged; point --load at an iter_* "
                          "directory")
    return load / name


def check_backend(directory: Path) -> None:
    """``metadata.json`` says ``torch_dist``: other backends store tensors otherwise."""
    try:
        backend = json.loads((directory / "metadata.json").read_text()).get("sharded_backend")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        raise ConfigError(f"{directory} has no readable metadata.json: it is not a Megatron-"
                          "Core dist_checkpointing checkpoint (legacy torch checkpoints "
                          "are not read)") from None
    if backend != "torch_dist":
        raise ConfigError(f"{directory} is a {backend!r} checkpoint: only torch_dist is read; "
                          "convert it with Megatron-LM (--ckpt-format torch_dist)")


def _sources(name: str) -> list[tuple[str, int | None]]:
    """GPTModel's candidate (name, layer index in a stacked tensor or None) for ours."""
    if not name.startswith("layers."):
        renamed = name.replace("final_norm.", "decoder.final_layernorm.")
        return [(renamed, None)]
    _, index, rest = name.split(".", 2)
    module, _, leaf = rest.rpartition(".")
    found = []
    for theirs in _LAYER[module]:
        tail = theirs + leaf
        found += [(f"decoder.layers.{tail}", int(index)), (f"decoder.layers.{index}.{tail}",
                                                          None)]
    return found


def resolve(ckpt: DcpCheckpoint, model: ModelConfig) -> list[tuple[Owned, str, int | None]]:
    """Each of our tensors with the stored tensor (and layer) it comes from, after checking
    that every one is stored, whole and of its shape, and that nothing else of a model is."""
    plan, used = [], set()
    for owned in model_tensors(model):
        for source, layer in _sources(owned.meta.name):
            stored = ckpt.shape(source)
            want = owned.shape if layer is None else (model.num_layers, *owned.shape)
            if stored is None:
                continue
            if stored != want:
                raise CheckpointError(f"{ckpt.path} stores {source} as {list(stored)}, but the "
                                      f"model needs {list(want)}: the model (its flags, or the "
                                      "stored arguments) does not match the checkpoint; "
                                      "nothing was written")
            problem = ckpt.coverage_problem(source)
            if problem is not None:
                raise CheckpointError(f"{ckpt.path}: {problem}: its .metadata is damaged or "
                                      "crafted; save the checkpoint again; nothing was written")
            plan.append((owned, source, layer))
            used.add(source)
            break
        else:
            wanted = _sources(owned.meta.name)[0][0]
            raise CheckpointError(f"{ckpt.path} has no tensor {wanted} (for {owned.meta.name})"
                                  ": the checkpoint is incomplete or is not of this model; "
                                  "nothing was written")
    extra = sorted(n for n in ckpt.tensors if n.startswith(_MODEL_PREFIXES) and n not in used)
    if extra:
        raise CheckpointError(f"{ckpt.path} holds {len(extra)} model tensors that this model "
                              f"does not have, e.g. {extra[0]}: the model (its flags, or the "
                              "stored arguments) does not match the checkpoint, or it uses a "
                              "feature megatron3d lacks; nothing was written")
    return plan


def check_layers(ckpt: DcpCheckpoint, model: ModelConfig) -> None:
    """The model has as many layers as the checkpoint stores: the leading axis of stacked
    layers, or the per-layer keys."""
    stacked = {shape[0] for name in ckpt.tensors if (shape := ckpt.shape(name))
               and name.startswith("decoder.layers.") and not name.split(".")[2].isdigit()}
    indices = {name.split(".")[2] for name in ckpt.tensors
               if name.startswith("decoder.layers.") and name.split(".")[2].isdigit()}
    stored = stacked | ({len(indices)} if indices else set())
    if stored and stored != {model.num_layers}:
        raise CheckpointError(f"{ckpt.path} stores {sorted(stored)[0]} transformer layers but "
                              f"the model has {model.num_layers}: the model (its flags, or the "
                              "stored arguments) does not match the checkpoint; nothing was "
                              "written")


def _read(ckpt: DcpCheckpoint, plan: list[tuple[Owned, str, int | None]],
          names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    by_name = {owned.meta.name: (source, layer) for owned, source, layer in plan}
    for name in names:
        source, layer = by_name[name]
        if layer is None:
            yield name, ckpt.read(source)
        else:
            shape = ckpt.shape(source)
            yield name, ckpt.read(source, (layer,), (1, *shape[1:]))[0]


def import_megatron(model: ModelConfig, directory: Path, save: str, tp: int,
                    pp: int) -> tuple[Path, int]:
    """The checkpoint written and the most tensor bytes it held at once (one layer's).
    The layout, the output and every stored tensor's presence and shape are checked first."""
    ckpt = DcpCheckpoint(directory)
    check_layers(ckpt, model)  # before the model's layers are built: their count is bounded
    stage_params(model, Layout(tp, pp, 1, 0), ParallelConfig().pp_partition_method)  # checks
    plan = resolve(ckpt, model)
    cfg = TrainConfig(model=model, training=TrainingConfig(),
                      parallel=ParallelConfig(tensor_model_parallel_size=tp,
                                              pipeline_model_parallel_size=pp))
    pieces = [_read(ckpt, plan, names)
              for names in tensor_map.pieces_by_layer([owned.meta.name for owned, _, _ in plan])]
    with warnings.catch_warnings():  # DCP's note that it reads without a process group
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return write_checkpoint(Path(save), cfg, pieces)


def model_config(directory: Path, flags: dict[str, Any]) -> ModelConfig:
    """The model: from ``flags`` (pretrain_gpt.py's model flags, raw) when any are given,
    the vocabulary then defaulting to the stored embedding's rows; else from the arguments
    stored in ``common.pt``."""
    if not flags:
        return ModelConfig(**mcore_args.model_fields(mcore_args.read_args(directory /
                                                                          "common.pt")))
    specs = arguments.field_specs()
    other = [specs[name].flag for name in flags if specs[name].section != "model"]
    if other:
        raise ConfigError(f"{other[0]} is not a model flag: the import takes only the model "
                          "flags of pretrain_gpt.py (and --load, --save, the layout)")
    missing = [specs[name].flag for name in _REQUIRED_FLAGS if name not in flags]
    if missing:
        raise ConfigError(f"the model flags given lack {', '.join(missing)}: give them all "
                          "(or no model flag, to read the model from common.pt)")
    if "vocab_size" not in flags:
        rows = DcpCheckpoint(directory).shape("embedding.word_embeddings.weight")
        flags = {**flags, "vocab_size": str(rows[0]) if rows else None}
    return arguments.config_from_dict(flags, "on the command line").model
