"""Load a checkpoint into any layout, and the checks made before: the model it holds, the
learning-rate schedule it recorded, ``--use-checkpoint-args``.

The RNG states are restored only into the same layout; a resharded run continues with fresh
dropout streams, which it reports. ``--no-load-optim`` and ``--no-load-rng`` skip what they
name. A resumed run whose flags give another learning-rate curve than the saved one (a new
``--train-iters``, warmup, decay or learning rate) would jump to another learning rate; as in
Megatron it is refused unless ``--override-opt_param-scheduler`` or
``--use-checkpoint-opt_param-scheduler`` says which to follow.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from megatron3d.checkpoint import io, shard_reader
from megatron3d.checkpoint.chunks import KINDS
from megatron3d.checkpoint.progress import Progress, new_series
from megatron3d.checkpoint.reader import find
from megatron3d.checkpoint.saving import layout
from megatron3d.cli.arguments import coerce, field_specs
from megatron3d.config import ModelConfig, TrainConfig
from megatron3d.errors import CheckpointError, ConfigError
from megatron3d.log import get_logger
from megatron3d.mpu.random import RNGStreams
from megatron3d.mpu.state import ParallelState
from megatron3d.optim.lr_schedule import LRSchedule
from megatron3d.optim.mixed_precision import MixedPrecisionOptimizer

logger = get_logger(__name__)

# Model fields that may differ from the checkpoint's: they change how the model runs, not
# which model it is.
RUN_ONLY_MODEL_FIELDS = {"checkpoint_activations", "recompute_granularity", "hidden_dropout",
                         "attention_dropout"}
_DROPOUTS = ("hidden_dropout", "attention_dropout")
# Sections about how this run is operated, not what it trains: never reported as changed.
_RUN_SECTIONS = {"checkpoint", "resilience"}

_OVERRIDE = "--override-opt_param-scheduler"
_USE_SAVED = "--use-checkpoint-opt_param-scheduler"


def checkpoint_config(directory: Path) -> dict[str, Any]:
    return io.read_meta(directory)["config"]


def with_checkpoint_args(cfg: TrainConfig,
                         given: Collection[str] = ()) -> tuple[TrainConfig, list[str]]:
    """--use-checkpoint-args: the model flags of the checkpoint in --load, and the notices
    to log. ``given``: the fields set on the command line or in YAML. Activation
    checkpointing stays this run's choice; dropout is the checkpoint's unless given (an
    imported model's is its source config's). The vocabulary is the checkpoint's only on
    mock data (and its --vocab-size for the NullTokenizer, which adds the eod): a real
    tokenizer sets it, and a tokenizer of another size is refused when the model is built."""
    if not cfg.checkpoint.use_checkpoint_args:
        return cfg, []
    directory = find(cfg.checkpoint.load) if cfg.checkpoint.load else None
    if directory is None:
        raise ConfigError(f"--use-checkpoint-args needs a checkpoint in --load, found none in "
                          f"{cfg.checkpoint.load!r}: drop the flag or point --load at one")
    saved = dict(checkpoint_config(directory)["model"])
    notices = [f"--{k.replace('_', '-')} {getattr(cfg.model, k)} differs from the "
               f"checkpoint's {saved[k]}: the flag is used"
               for k in _DROPOUTS if k in given and k in saved
               and getattr(cfg.model, k) != saved[k]]
    saved.update({k: getattr(cfg.model, k) for k in RUN_ONLY_MODEL_FIELDS
                  if k in given or k not in _DROPOUTS or k not in saved})
    saved["vocab_size"] = _vocabulary(cfg, saved.get("vocab_size"))
    known = {f.name for f in dataclasses.fields(ModelConfig)}  # older checkpoints lack new ones
    source = f"in {directory / 'meta.json'}, read by --use-checkpoint-args"
    try:
        values = {k: coerce(field_specs()[k], v, source) for k, v in saved.items() if k in known}
    except ConfigError as err:  # json gives any type: checked as a YAML value would be
        raise CheckpointError(f"{err}; the file is damaged: load an earlier checkpoint, or "
                              "drop --use-checkpoint-args and pass the model flags") from None
    return dataclasses.replace(cfg, model=ModelConfig(**values)), notices


def _vocabulary(cfg: TrainConfig, saved: int | None) -> int | None:
    """--vocab-size under --use-checkpoint-args: what gives the checkpoint's vocabulary."""
    if cfg.data.mock_data or saved is None:
        return saved
    if cfg.data.tokenizer_type == "NullTokenizer":
        return saved - 1
    return None


def check_model_matches(cfg: TrainConfig, saved: dict[str, Any]) -> None:
    """Fail on model differences; print the allowed differences that will be applied."""
    _refuse_other_model(cfg, saved)
    mine = dataclasses.asdict(cfg)
    changed = [f"{section}.{k}: {saved.get(section, {}).get(k)!r} -> {v!r}"
               for section, values in mine.items() if section not in _RUN_SECTIONS
               for k, v in values.items() if _norm(saved.get(section, {}).get(k)) != _norm(v)]
    if changed:
        logger.info("applying settings that differ from the checkpoint's: %s", "; ".join(changed))


def load(directory: Path, cfg: TrainConfig, state: ParallelState, params: list[nn.Parameter],
         optimizer: MixedPrecisionOptimizer, rng: RNGStreams,
         weights_only: bool) -> tuple[Progress, str]:
    """Install the checkpoint into this rank's parameters and optimizer shard (only the
    weights with ``weights_only`` or --no-load-optim), reading only what the rank owns
    (``shard_reader.py``). Returns where the run continues and the series it continues (a
    ``weights_only`` load starts at zero, in a new series)."""
    meta = io.read_meta(directory)
    check_model_matches(cfg, meta["config"])
    no_optim = weights_only or cfg.checkpoint.no_load_optim
    # Adam's moments are zero before its first step: converted checkpoints do not store them.
    kinds = ("weight",) if no_optim or meta["adam_step"] == 0 else KINDS
    same_layout = meta["layout"] == layout(cfg, state)
    target = shard_reader.targets(optimizer.shard, moments=not no_optim)
    saved_rng = shard_reader.read(directory, meta, state, params, optimizer.shard, target, kinds,
                                  optimizer.replica_axes, same_layout)
    target["step"] = torch.tensor(meta["adam_step"])
    optimizer.load_local_state(target, no_optim)
    optimizer.shard.grads.zero_()  # it held the weights
    if weights_only:
        return Progress(), new_series()
    if cfg.checkpoint.no_load_optim:
        logger.info("--no-load-optim: not loading the optimizer state (Adam moments and step, "
                    "loss scale): Adam starts from zero moments, the fp32 master weights are "
                    "the loaded weights")
    elif optimizer.scaler is not None and meta["loss_scaler"] is not None:
        optimizer.scaler.load_state_dict(meta["loss_scaler"])
    if cfg.checkpoint.no_load_rng:
        logger.info("--no-load-rng: not restoring the saved RNG states; the random streams "
                    "start from --seed %d", cfg.training.seed)
    elif saved_rng is not None:
        _restore_rng(rng, saved_rng)
    else:  # another layout, or a converted checkpoint (no RNG states)
        logger.info("the checkpoint (layout %s) holds no RNG states for this run's layout %s: "
                    "weights and optimizer state are resharded, dropout RNG streams start "
                    "fresh", meta["layout"], layout(cfg, state))
    return (Progress(meta["iteration"], meta["consumed_samples"], meta["consumed_tokens"],
                     list(meta.get("skipped_batches", [])), list(meta.get("recent_losses", []))),
            io.series_of(meta))


def resume_schedule(cfg: TrainConfig, flags: LRSchedule) -> LRSchedule:
    """The schedule a run follows: the flags' unless it resumes (not --finetune, not
    --skip-train) from a checkpoint whose recorded schedule gives another learning-rate
    curve, which is an error unless --override-opt_param-scheduler (the flags') or
    --use-checkpoint-opt_param-scheduler (the checkpoint's) decides. Reads only meta.json
    (a different model is reported first), so every rank decides alike before the model is
    built; checkpoints older than the record follow the flags."""
    ckpt, chosen = cfg.checkpoint, cfg.lr_schedule
    if not ckpt.load or ckpt.finetune or cfg.training.skip_train:
        return flags
    directory = find(ckpt.load)
    if directory is None:
        return flags
    _refuse_other_model(cfg, checkpoint_config(directory))
    saved = _saved_schedule(directory)
    if saved is None:
        if chosen.use_checkpoint_opt_param_scheduler:
            raise ConfigError(f"{_USE_SAVED}: {directory} was saved before checkpoints "
                              "recorded the learning-rate schedule; drop the flag to follow "
                              "the flags' schedule")
        return flags
    differs = "; ".join(saved.differences(flags))
    if not differs:
        return flags
    if chosen.override_opt_param_scheduler:
        logger.info("%s: following the flags' learning-rate schedule (checkpoint vs flags: "
                    "%s)", _OVERRIDE, differs)
        return flags
    if chosen.use_checkpoint_opt_param_scheduler:
        logger.info("%s: keeping the checkpoint's learning-rate schedule (checkpoint vs "
                    "flags: %s)", _USE_SAVED, differs)
        return saved
    raise ConfigError(f"the learning-rate schedule differs from the one saved in {directory} "
                      f"(checkpoint vs flags: {differs}): pass {_OVERRIDE} to follow the flags "
                      f"or {_USE_SAVED} to keep the checkpoint's")


def _saved_schedule(directory: Path) -> LRSchedule | None:
    """The schedule recorded in ``directory``'s meta.json; None before it was recorded."""
    record = io.read_meta(directory).get("lr_schedule")
    if record is None:
        return None
    try:
        return LRSchedule(**record)
    except (TypeError, ConfigError) as err:
        raise CheckpointError(f"{directory / 'meta.json'} holds an unusable lr_schedule "
                              f"({str(err)[:120]}); the file is damaged: load an earlier "
                              "checkpoint") from None


def _refuse_other_model(cfg: TrainConfig, saved: dict[str, Any]) -> None:
    wrong = [f"{k}: checkpoint {saved['model'].get(k)!r} vs {v!r}"
             for k, v in dataclasses.asdict(cfg.model).items()
             if k not in RUN_ONLY_MODEL_FIELDS and saved["model"].get(k) != v]
    if wrong and cfg.checkpoint.use_checkpoint_args:  # only the tokenizer's size can differ
        raise CheckpointError(f"the tokenizer has {cfg.model.vocab_size} tokens but the "
                              f"checkpoint's model {saved['model'].get('vocab_size')}: give the "
                              "tokenizer the model was made with (import_hf names the one it "
                              "found beside the model)")
    if wrong:
        raise CheckpointError("the checkpoint is of a different model (" + "; ".join(wrong)
                              + "): change these flags or pass --use-checkpoint-args")


def _norm(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _restore_rng(rng: RNGStreams, saved: dict[str, Any]) -> None:
    random.setstate(saved["python"])
    state = saved["numpy"]
    if isinstance(state, dict):  # older checkpoints hold numpy's own tuple
        state = (state["kind"], state["keys"].numpy().astype(np.uint32), state["pos"],
                 state["has_gauss"], state["cached_gaussian"])
    np.random.set_state(state)
    rng.set_state({k: v.clone() for k, v in saved["torch"].items()})
