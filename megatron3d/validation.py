"""Every check of a ``TrainConfig`` that can run before any process group exists.

A bad run should fail in the first second with one line saying what is wrong, the value and
the fix, not after minutes of start-up or, worse, train something other than what was asked.
Each rule is made in one place. Range limits are field metadata (``config.Range``, shown in
``--help``) checked here generically; rules with an owner are asked, never restated: the rank
grid (``Topology``), the batch schedule and its whole rampup (``BatchSchedule``), the
learning-rate schedule (``LRSchedule``), the data split, the tokenizer's flags
(``TokenizerSpec``), the interleaved schedule and the pipeline partitioner (run on the real
layer list, so too many stages fail here, not after the processes started). What is left
below are the true cross-field rules nobody else owns. They raise
``ConfigError("<what is wrong> (<flag>=<value>): <how to fix>")``, in order, so a later check
may rely on an earlier one (``hidden % heads`` runs after ``heads >= 1``). The exception is
the layout: what the world size, TP, PP and the chunk count must fit is collected and reported
in one line, so a run resumed on another layout learns every flag to change in one launch.

``tools/plan_topology.py`` calls ``validate`` on every layout it considers, so a layout it
calls feasible is one ``pretrain_gpt.py`` accepts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, TypeVar

from megatron3d.config import (
    SECTIONS,
    ZERO_STAGES,
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    PrecisionConfig,
    Range,
    TrainConfig,
)
from megatron3d.cp.checks import check_context_parallel
from megatron3d.data.builder import parse_split
from megatron3d.data.documents import check_document_flags
from megatron3d.data.tokenizer import TokenizerSpec
from megatron3d.data.vocab_padding import check_vocab_padding
from megatron3d.errors import ConfigError
from megatron3d.model.gpt import stage_bounds
from megatron3d.mpu.topology import Topology
from megatron3d.optim.batch_schedule import BatchSchedule
from megatron3d.optim.lr_schedule import LRSchedule
from megatron3d.pipeline.interleaved import interleaving_conflicts
from megatron3d.resilience import local_flags, rerun_flags
from megatron3d.zero.checks import check_zero

T = TypeVar("T")


def flag(name: str) -> str:
    """Field name -> the flag users type: ``num_layers`` -> ``--num-layers``."""
    return "--" + name.replace("_", "-")


def _error(what: str, values: dict[str, Any], fix: str) -> ConfigError:
    """The one-line message every check here raises: what, the offending values, the fix."""
    shown = ", ".join(f"{flag(name)}={value}" for name, value in values.items())
    return ConfigError(f"{what} ({shown}): {fix}")


def validate(cfg: TrainConfig, world_size: int) -> None:
    """Raise ``ConfigError`` for the first problem in ``cfg`` run on ``world_size`` ranks
    (for the layout: every conflict it has, in one line)."""
    _check_required(cfg)
    _check_ranges(cfg)
    _check_data(cfg.data, cfg.model)
    _check_model(cfg.model)
    if cfg.checkpoint.compile_cache_dir and not cfg.model.compile:
        raise _error("the compile cache is only used by compiled layers",
                     {"compile_cache_dir": cfg.checkpoint.compile_cache_dir},
                     "add --compile or drop --compile-cache-dir")
    _check_precision(cfg.precision)
    if cfg.parallel.zero_stage not in ZERO_STAGES:
        raise _error("unknown ZeRO stage", {"zero_stage": cfg.parallel.zero_stage},
                     "use --zero-stage 0, 1 or 3")
    _check_layout(cfg, world_size)
    _check_lr_schedule(cfg, world_size)
    check_context_parallel(cfg.parallel, cfg.model)
    _check_checkpoint(cfg.checkpoint, cfg.lr_schedule.override_opt_param_scheduler,
                      cfg.lr_schedule.use_checkpoint_opt_param_scheduler, cfg.training.skip_train)
    local_flags.check_non_persistent(cfg.checkpoint)
    check_zero(cfg.parallel, world_size)
    _check_watchdog(cfg)
    rerun_flags.check_rerun_flags(cfg.resilience)


def _check_required(cfg: TrainConfig) -> None:
    model, training = cfg.model, cfg.training
    required = {"num_layers": model.num_layers, "hidden_size": model.hidden_size,
                "num_attention_heads": model.num_attention_heads,
                "seq_length": model.seq_length, "micro_batch_size": training.micro_batch_size,
                "lr": cfg.optimizer.lr}
    for name, value in required.items():
        if value is None:
            raise _error("required value missing", {name: None},
                         f"pass {flag(name)} ({_help(name).lower()})")
    if (training.train_iters is None) == (training.train_samples is None):
        raise _error("give exactly one run length", {"train_iters": training.train_iters,
                                                      "train_samples": training.train_samples},
                     "pass either --train-iters (optimizer steps) or --train-samples, not both")


def _help(name: str) -> str:
    """A field's help text, for "pass --flag (what it is)"."""
    return next(f.metadata["help"].rstrip(".") for cls in SECTIONS.values()
                for f in dataclasses.fields(cls) if f.name == name)


def _check_ranges(cfg: TrainConfig) -> None:
    """Every float set must be finite (``--lr 1e400`` parses as inf) and every value inside
    its field's ``range`` (``config.Range``); NaN fails both."""
    for section in SECTIONS:
        part = getattr(cfg, section)
        for field in dataclasses.fields(part):
            name, value, bounds = field.name, getattr(part, field.name), field.metadata["range"]
            if isinstance(value, float) and not math.isfinite(value):
                raise _error(f"{flag(name)} must be a finite number", {name: value},
                             "give a finite value (not inf or nan)")
            if value is not None and bounds is not None and value not in bounds:
                whole = "whole " if isinstance(value, int) else ""
                raise _error(f"{flag(name)} must be {_words(bounds)}", {name: value},
                             f"use a {whole}number {_words(bounds, symbols=True)}")


def _words(bounds: Range, symbols: bool = False) -> str:
    """``at least 1`` (``>= 1`` with ``symbols``), ``greater than 0`` or ``in [0, 1)``."""
    if bounds.high is not None:
        return f"in {bounds}"
    if symbols:
        return str(bounds)
    return f"{'greater than' if bounds.low_open else 'at least'} {bounds.low}"


def _check_data(data: DataConfig, model: ModelConfig) -> None:
    parse_split(data.split)  # its owner's check, before any process starts
    check_document_flags(data)  # --eod-mask-loss and the reset flags need an EOD token
    sources = {name: getattr(data, name) for name in ("mock_data", "data_path", "data_path_file",
                                                      "train_data_path")
               if getattr(data, name)}
    if len(sources) != 1:
        raise _error("give exactly one training data source", sources or {"mock_data": False},
                     "pass one of --mock-data, --data-path PREFIX, --data-path-file FILE or "
                     "--train-data-path PREFIX")
    for name in ("valid_data_path", "test_data_path"):
        if getattr(data, name) and not data.train_data_path:
            raise _error(f"{flag(name)} needs --train-data-path", {name: getattr(data, name)},
                         f"give the training datasets with --train-data-path, or drop "
                         f"{flag(name)} and cut every split from --data-path with --split")
    if not data.mock_data:
        _check_tokenizer(data, model)
        return
    null = data.tokenizer_type == "NullTokenizer"  # Megatron's mock runs name it: harmless
    for name, value in (("tokenizer_type", None if null else data.tokenizer_type),
                        ("dry_run_data", data.dry_run_data)):
        if value:
            raise _error(f"--mock-data has no tokenizer, so {flag(name)} does not apply",
                         {name: value}, f"drop {flag(name)} or use --data-path")
    if model.vocab_size is None:
        raise _error("--mock-data needs a vocabulary size", {"vocab_size": None},
                     "pass --vocab-size, e.g. --vocab-size 50257")


def _check_tokenizer(data: DataConfig, model: ModelConfig) -> None:
    """Real data needs its tokenizer and exactly the flags that tokenizer reads (the
    tokenizer's own table, ``TokenizerSpec.unused_flags``)."""
    kind = data.tokenizer_type
    if kind is None:
        raise _error("real data needs the tokenizer it was made with", {"tokenizer_type": None},
                     "pass --tokenizer-type")
    spec = TokenizerSpec(kind, tokenizer_model=data.tokenizer_model,
                         vocab_file=data.vocab_file, merge_file=data.merge_file,
                         tokenizer_name_or_path=data.tokenizer_name_or_path,
                         vocab_size=model.vocab_size)
    for name in _tokenizer_fields():
        value = getattr(spec, name)
        if flag(name) in spec.unused_flags():
            raise _error(f"{kind} does not use {flag(name)}", {name: value, "tokenizer_type": kind},
                         f"drop {flag(name)} or pick the tokenizer type it belongs to")
        if value is None and flag(name) not in _unused_when_all_given(kind):
            raise _error(f"{kind} needs {flag(name)}", {name: None, "tokenizer_type": kind},
                         f"pass {flag(name)}")


def _tokenizer_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(TokenizerSpec) if f.name != "tokenizer_type"]


def _unused_when_all_given(kind: str) -> list[str]:
    """The flags tokenizer ``kind`` never reads: what ``unused_flags`` names when every flag
    is given, so the tokenizer's table is read, not copied."""
    return TokenizerSpec(kind, **dict.fromkeys(_tokenizer_fields(), "given")).unused_flags()


def _check_model(model: ModelConfig) -> None:
    hidden, heads = model.hidden_size, model.num_attention_heads
    if hidden % heads:
        raise _error("hidden size is not divisible by the attention heads",
                     {"hidden_size": hidden, "num_attention_heads": heads},
                     "pick a head count that divides --hidden-size")
    if model.kv_channels not in (None, hidden // heads):
        raise _error(
            "--kv-channels must be hidden size / heads: every head here has that many channels",
            {"kv_channels": model.kv_channels, "hidden_size": hidden, "num_attention_heads": heads},
            f"drop --kv-channels or set it to {hidden // heads}")
    _check_query_groups(model)
    if model.position_embedding_type == "rope" and model.head_dim % 2:
        raise _error(f"rotary embeddings need an even head dimension, got {model.head_dim}",
                     {"hidden_size": hidden, "num_attention_heads": heads},
                     "change --hidden-size or --num-attention-heads so hidden/heads is even")
    if model.use_rope_scaling:
        _check_rope_scaling(model)
    if (model.position_embedding_type == "learned_absolute"
            and model.max_positions < model.seq_length):
        raise _error("the learned position table is shorter than a sample",
                     {"max_position_embeddings": model.max_positions,
                      "seq_length": model.seq_length},
                     "raise --max-position-embeddings to at least --seq-length")
    if model.checkpoint_activations and model.recompute_granularity == "selective":
        raise _error("--checkpoint-activations is full recompute", {
            "checkpoint_activations": True, "recompute_granularity": "selective"},
            "keep one of the two")


def _check_rope_scaling(model: ModelConfig) -> None:
    """Llama 3.x's scaling acts on rotary frequencies, and blends between two wavelengths."""
    if model.position_embedding_type != "rope":
        raise _error("--use-rope-scaling scales rotary embeddings", {
            "use_rope_scaling": True, "position_embedding_type": model.position_embedding_type},
            "add --position-embedding-type rope or drop --use-rope-scaling")
    low, high = model.rope_scaling_low_freq_factor, model.rope_scaling_high_freq_factor
    if high <= low:
        raise _error("the high-frequency factor of RoPE scaling must exceed the low one", {
            "rope_scaling_high_freq_factor": high, "rope_scaling_low_freq_factor": low},
            "Llama 3.x uses 4 and 1")


def _check_query_groups(model: ModelConfig) -> None:
    groups, heads = model.num_query_groups, model.num_attention_heads
    if not model.group_query_attention:
        if groups is not None:
            raise _error("--num-query-groups needs --group-query-attention",
                         {"num_query_groups": groups}, "add --group-query-attention or drop it")
        return
    if groups is None or heads % groups:
        raise _error("grouped-query attention needs a group count that divides the heads",
                     {"num_query_groups": groups, "num_attention_heads": heads},
                     "pass --num-query-groups G with G dividing --num-attention-heads")


def _check_precision(precision: PrecisionConfig) -> None:
    if precision.bf16 and precision.fp16:
        raise _error("bf16 and fp16 are mutually exclusive", {"bf16": True, "fp16": True},
                     "pass at most one of --bf16 and --fp16")
    if precision.loss_scale is not None and not precision.fp16:
        raise _error("a loss scale only applies to fp16 training",
                     {"loss_scale": precision.loss_scale, "fp16": False},
                     "drop --loss-scale or add --fp16")
    if precision.min_loss_scale > precision.initial_loss_scale:
        raise _error("the minimum loss scale exceeds the initial one",
                     {"min_loss_scale": precision.min_loss_scale,
                      "initial_loss_scale": precision.initial_loss_scale},
                     "lower --min-loss-scale or raise --initial-loss-scale")


def _check_layout(cfg: TrainConfig, world_size: int) -> None:
    """Every conflict of the layout with the model and batch flags, in one line: the rank
    grid (``Topology``), the sizes TP splits, the batch schedule over its whole ramp
    (``BatchSchedule``), the interleaved schedule and the partitioner. A check that needs
    what an earlier one refused (DP needs the grid) is left out."""
    parallel, conflicts = cfg.parallel, []
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    grid = _collect(conflicts, lambda: Topology(world_size, tp, pp, parallel.context_parallel_size))
    conflicts += [str(_error(f"{what} is not divisible by the tensor-parallel size",
                             {**shown, "tensor_model_parallel_size": tp},
                             f"pick a --tensor-model-parallel-size that divides {size}"))
                  for what, size, shown in _tp_split_sizes(cfg) if size % tp]
    if cfg.model.pad_vocab_size_to is not None:
        _collect(conflicts, lambda: check_vocab_padding(
            cfg.model.pad_vocab_size_to, tp, cfg.model.vocab_size if cfg.data.mock_data else None))
    schedule = None if grid is None else _collect(conflicts, lambda: BatchSchedule.from_config(
        cfg.training, parallel.data_parallel_size(world_size)))
    micro = ([size // schedule.samples_per_micro_batch_step for size in schedule.ramp_sizes()]
             if schedule else None)
    chunk_conflicts = interleaving_conflicts(parallel, cfg.model.num_layers, micro)
    conflicts += chunk_conflicts
    if not chunk_conflicts:  # the partitioner needs a chunk count that makes sense
        _collect(conflicts, lambda: stage_bounds(
            cfg.model, pp, parallel.pp_partition_method,
            parallel.virtual_size(cfg.model.num_layers),
            parallel.num_layers_per_virtual_pipeline_stage))
    if len(conflicts) == 1:
        raise ConfigError(conflicts[0])
    if conflicts:
        listed = "; ".join(f"({i}) {text}" for i, text in enumerate(conflicts, 1))
        raise ConfigError(f"{len(conflicts)} settings conflict with the layout "
                          f"(world size {world_size}): {listed}")


def _collect(conflicts: list[str], check: Callable[[], T]) -> T | None:
    """``check()``'s result, or None with its ConfigError's line added to ``conflicts``."""
    try:
        return check()
    except ConfigError as err:
        conflicts.append(str(err))
        return None


def _tp_split_sizes(cfg: TrainConfig) -> list[tuple[str, int, dict[str, Any]]]:
    """(what, size, the flags it comes from) of every size TP splits, named by the flags the
    user sets: the query groups only with grouped-query attention, the MLP width by
    --hidden-size when it is derived from it."""
    model, heads = cfg.model, cfg.model.num_attention_heads
    sizes = [(f"--num-attention-heads {heads}", heads, {"num_attention_heads": heads})]
    if model.group_query_attention:
        groups = model.num_query_groups
        sizes.append((f"--num-query-groups {groups}", groups, {"num_query_groups": groups}))
    if model.ffn_hidden_size is not None:
        sizes.append((f"--ffn-hidden-size {model.ffn_size}", model.ffn_size,
                      {"ffn_hidden_size": model.ffn_size}))
    else:
        sizes.append((f"the MLP width {model.ffn_size} (from --hidden-size)", model.ffn_size,
                      {"hidden_size": model.hidden_size}))
    if cfg.parallel.sequence_parallel:  # activations are split along the sequence
        sizes.append((f"--seq-length {model.seq_length}", model.seq_length,
                      {"seq_length": model.seq_length}))
    return sizes


def _check_lr_schedule(cfg: TrainConfig, world_size: int) -> None:
    """The learning-rate schedule's owner decides, over the batch schedule's samples."""
    training = cfg.training
    schedule = BatchSchedule.from_config(training, cfg.parallel.data_parallel_size(world_size))
    iteration_based = training.train_iters is not None
    samples = (schedule.samples_for_iters(training.train_iters) if iteration_based
               else training.train_samples)
    LRSchedule.from_config(cfg.optimizer, cfg.lr_schedule, samples, schedule.samples_for_iters,
                           iteration_based)


def _check_checkpoint(checkpoint: CheckpointConfig, override: bool, keep: bool,
                      skip_train: bool) -> None:
    needs = {"save_interval": (checkpoint.save_interval, "save"),
             "keep_last_n": (checkpoint.keep_last_n, "save"),
             "new_series": (checkpoint.new_series, "save"),
             "async_save": (checkpoint.async_save, "save"),
             "finetune": (checkpoint.finetune, "load"),
             "use_checkpoint_args": (checkpoint.use_checkpoint_args, "load"),
             "skip_train": (skip_train, "load"),
             "no_load_optim": (checkpoint.no_load_optim, "load"),
             "no_load_rng": (checkpoint.no_load_rng, "load"),
             "exit_on_missing_checkpoint": (checkpoint.exit_on_missing_checkpoint, "load")}
    for name, (value, needed) in needs.items():
        if value and not getattr(checkpoint, needed):
            raise _error(f"{flag(name)} needs {flag(needed)}", {name: value},
                         f"pass {flag(needed)} DIR or drop {flag(name)}")
    if override and keep:
        raise _error("the schedule follows either the flags or the checkpoint",
                     {"override_opt_param_scheduler": True,
                      "use_checkpoint_opt_param_scheduler": True}, "drop one of the two flags")


def _check_watchdog(cfg: TrainConfig) -> None:
    """The watchdog must fire before the backend's own timeout, or no dump is ever written:
    every budget given (unset ones default below it) under --distributed-timeout-minutes."""
    resilience = cfg.resilience
    if resilience.hang_timeout == 0:  # the watchdog never fires
        return
    limit = resilience.distributed_timeout_minutes * 60
    budgets = [f.name for f in dataclasses.fields(resilience)
               if f.name.startswith("hang_") and f.name.endswith("_timeout")]
    for name in budgets:  # --hang-timeout (steps) first, then the phases' in field order
        seconds = getattr(resilience, name)
        if seconds is not None and seconds >= limit:
            raise _error("the hang watchdog would fire after the process group times out",
                         {name: seconds,
                          "distributed_timeout_minutes": resilience.distributed_timeout_minutes},
                         f"give {flag(name)} below {limit} seconds or raise "
                         "--distributed-timeout-minutes")
