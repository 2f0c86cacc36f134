"""Every cross-field check of a ``TrainConfig``, run before any process group exists.

A bad run should fail in the first second with one line saying what is wrong, the value and
the fix, not after minutes of start-up or, worse, train something other than what was asked.
Each problem raises ``ConfigError("<what is wrong> (<flag>=<value>): <how to fix>")``.
Checks run in order (required values, ranges, combinations, layout, batch), so a later check
may rely on an earlier one: e.g. ``hidden % heads`` runs after ``heads >= 1``. Rules that
have an owner (the batch schedule, the partitioner, the interleaved schedule, the data split)
are asked, not restated.

``--global-batch-size`` may be left unset: it then means micro batch size x data-parallel
size (Megatron's default). The data-parallel size depends on the world size, which is
unknown while parsing, so the config keeps ``None`` and ``resolved_global_batch_size``
gives the value once the world size is known.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from megatron3d.config import SECTIONS, ZERO_STAGES, Range, TrainConfig, flat_fields
from megatron3d.data.builder import parse_split
from megatron3d.errors import ConfigError
from megatron3d.pipeline.interleaved import check_interleaving
from megatron3d.pipeline.partition import layer_weights
from megatron3d.training.batch_schedule import BatchSchedule

_REQUIRED = (
    "num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "lr",
)


def flag(name: str) -> str:
    """Field name -> the flag users type: ``num_layers`` -> ``--num-layers``."""
    return "--" + name.replace("_", "-")


def _error(what: str, values: dict[str, Any], fix: str) -> ConfigError:
    """The one-line message every check raises: what, the offending values, the fix."""
    shown = ", ".join(f"{flag(name)}={value}" for name, value in values.items())
    return ConfigError(f"{what} ({shown}): {fix}")


def _help(name: str) -> str:
    for cls in SECTIONS.values():
        for field in dataclasses.fields(cls):
            if field.name == name:
                return field.metadata["help"].rstrip(".")
    raise KeyError(name)


def resolved_global_batch_size(cfg: TrainConfig, world_size: int) -> int:
    """``--global-batch-size``, or micro batch size x data-parallel size when it is unset."""
    if cfg.training.global_batch_size is not None:
        return cfg.training.global_batch_size
    return cfg.training.micro_batch_size * cfg.parallel.data_parallel_size(world_size)


def validate(cfg: TrainConfig, world_size: int) -> None:
    """Raise ``ConfigError`` for the first problem in ``cfg`` run on ``world_size`` ranks."""
    values = flat_fields(cfg)
    _check_required(values)
    _check_data(values)
    _check_ranges(cfg)
    _check_run_length(values)
    _check_model(values)
    _check_precision(values)
    _check_optimizer(values)
    _check_warmup(values)
    _check_layout(cfg, world_size)
    _check_batch(cfg, world_size)
    _check_checkpoint(values)
    _check_zero(cfg)
    _check_watchdog(values)


def _check_required(values: dict[str, Any]) -> None:
    for name in _REQUIRED:
        if values[name] is None:
            raise _error(
                "required value missing", {name: None},
                f"pass {flag(name)} ({_help(name).lower()})",
            )
    if (values["train_iters"] is None) == (values["train_samples"] is None):
        raise _error(
            "give exactly one run length",
            {"train_iters": values["train_iters"], "train_samples": values["train_samples"]},
            "pass either --train-iters (optimizer steps) or --train-samples, not both",
        )


def _check_data(values: dict[str, Any]) -> None:
    parse_split(values["split"])  # its owner's check, before any process starts
    sources = {n: values[n] for n in ("mock_data", "data_path", "data_path_file") if values[n]}
    if len(sources) != 1:
        raise _error(
            "give exactly one training data source", sources or {"mock_data": False},
            "pass one of --mock-data, --data-path PREFIX or --data-path-file FILE",
        )
    if values["mock_data"]:
        for name in ("tokenizer_type", "eod_mask_loss", "dry_run_data"):
            if values[name]:
                raise _error(f"--mock-data has no tokenizer, so {flag(name)} does not apply",
                             {name: values[name]}, f"drop {flag(name)} or use --data-path")
        if values["vocab_size"] is None:
            raise _error("--mock-data needs a vocabulary size", {"vocab_size": None},
                         "pass --vocab-size, e.g. --vocab-size 50257")
        return
    _check_tokenizer(values)


_TOKENIZER_FILES = {
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "PretrainedFromHF": ("tokenizer_name_or_path",),
    "NullTokenizer": ("vocab_size",),
}


def _check_tokenizer(values: dict[str, Any]) -> None:
    kind = values["tokenizer_type"]
    if kind is None:
        raise _error("real data needs the tokenizer it was made with", {"tokenizer_type": None},
                     f"pass --tokenizer-type (one of {', '.join(_TOKENIZER_FILES)})")
    for name in _TOKENIZER_FILES[kind]:
        if values[name] is None:
            raise _error(f"{kind} needs {flag(name)}", {name: None, "tokenizer_type": kind},
                         f"pass {flag(name)}")
    if kind != "NullTokenizer" and values["vocab_size"] is not None:
        raise _error("the tokenizer sets the vocabulary size", {
            "vocab_size": values["vocab_size"], "tokenizer_type": kind},
            "drop --vocab-size (--make-vocab-size-divisible-by controls the padding)")


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


def _check_run_length(values: dict[str, Any]) -> None:
    """Megatron keeps iteration-based and sample-based LR flags apart; so do we. The batch
    rampup works with either (it is a function of consumed samples)."""
    if values["train_samples"] is not None:
        mixed = {"lr_decay_iters": values["lr_decay_iters"] is not None,
                 "lr_warmup_iters": values["lr_warmup_iters"] > 0}
        other, kind = "train_samples", "sample"
    else:
        mixed = {"lr_decay_samples": values["lr_decay_samples"] is not None,
                 "lr_warmup_samples": values["lr_warmup_samples"] > 0}
        other, kind = "train_iters", "iteration"
    for name, given in mixed.items():
        if given:
            raise _error(
                f"{flag(name)} cannot be combined with {kind}-based training",
                {name: values[name], other: values[other]},
                f"use only {kind}-based flags with {flag(other)}",
            )


def _check_model(values: dict[str, Any]) -> None:
    hidden, heads = values["hidden_size"], values["num_attention_heads"]
    if hidden % heads:
        raise _error(
            "hidden size is not divisible by the attention heads",
            {"hidden_size": hidden, "num_attention_heads": heads},
            "pick a head count that divides --hidden-size",
        )
    if values["kv_channels"] not in (None, hidden // heads):
        raise _error(
            "--kv-channels must be hidden size / heads: every head here has that many channels",
            {"kv_channels": values["kv_channels"], "hidden_size": hidden,
             "num_attention_heads": heads},
            f"drop --kv-channels or set it to {hidden // heads}",
        )
    _check_query_groups(values)
    position = values["position_embedding_type"]
    if position == "rope" and (hidden // heads) % 2:
        raise _error(
            f"rotary embeddings need an even head dimension, got {hidden // heads}",
            {"hidden_size": hidden, "num_attention_heads": heads},
            "change --hidden-size or --num-attention-heads so hidden/heads is even",
        )
    seq = values["seq_length"]
    max_positions = values["max_position_embeddings"] or seq  # unset means --seq-length
    if position == "learned_absolute" and max_positions < seq:
        raise _error(
            "the learned position table is shorter than a sample",
            {"max_position_embeddings": max_positions, "seq_length": seq},
            "raise --max-position-embeddings to at least --seq-length",
        )
    if values["checkpoint_activations"] and values["recompute_granularity"] == "selective":
        raise _error("--checkpoint-activations is full recompute", {
            "checkpoint_activations": True, "recompute_granularity": "selective"},
            "keep one of the two")


def _check_query_groups(values: dict[str, Any]) -> None:
    groups, heads = values["num_query_groups"], values["num_attention_heads"]
    if not values["group_query_attention"]:
        if groups is not None:
            raise _error("--num-query-groups needs --group-query-attention",
                         {"num_query_groups": groups}, "add --group-query-attention or drop it")
        return
    if groups is None or heads % groups:
        raise _error("grouped-query attention needs a group count that divides the heads",
                     {"num_query_groups": groups, "num_attention_heads": heads},
                     "pass --num-query-groups G with G dividing --num-attention-heads")


def _check_precision(values: dict[str, Any]) -> None:
    if values["bf16"] and values["fp16"]:
        raise _error(
            "bf16 and fp16 are mutually exclusive", {"bf16": True, "fp16": True},
            "pass at most one of --bf16 and --fp16",
        )
    if values["loss_scale"] is not None and not values["fp16"]:
        raise _error(
            "a loss scale only applies to fp16 training",
            {"loss_scale": values["loss_scale"], "fp16": False},
            "drop --loss-scale or add --fp16",
        )
    if values["min_loss_scale"] > values["initial_loss_scale"]:
        raise _error(
            "the minimum loss scale exceeds the initial one",
            {"min_loss_scale": values["min_loss_scale"],
             "initial_loss_scale": values["initial_loss_scale"]},
            "lower --min-loss-scale or raise --initial-loss-scale",
        )


def _check_optimizer(values: dict[str, Any]) -> None:
    if values["min_lr"] > values["lr"]:
        raise _error(
            "the minimum learning rate exceeds the peak",
            {"min_lr": values["min_lr"], "lr": values["lr"]},
            "lower --min-lr to at most --lr",
        )


def _check_warmup(values: dict[str, Any]) -> None:
    given = {
        name: values[name]
        for name in ("lr_warmup_iters", "lr_warmup_samples", "lr_warmup_fraction")
        if values[name]  # 0 and None mean "not given"
    }
    if len(given) > 1:
        raise _error("more than one warmup length given", given, "keep only one of them")
    if values["train_iters"] is not None:
        warmup, decay_name = "lr_warmup_iters", "lr_decay_iters"
        decay_name = decay_name if values[decay_name] is not None else "train_iters"
    else:
        warmup, decay_name = "lr_warmup_samples", "lr_decay_samples"
        decay_name = decay_name if values[decay_name] is not None else "train_samples"
    if values[warmup] and values[warmup] >= values[decay_name]:
        raise _error(
            "warmup must be shorter than the learning-rate decay",
            {warmup: values[warmup], decay_name: values[decay_name]},
            f"shorten {flag(warmup)} to less than {flag(decay_name)}",
        )


def _check_layout(cfg: TrainConfig, world_size: int) -> None:
    parallel = cfg.parallel
    tp, mp = parallel.tensor_model_parallel_size, parallel.model_parallel_size
    if world_size < 1 or world_size % mp:
        raise _error(
            f"world size {world_size} is not a positive multiple of TP x PP = {mp}",
            {"tensor_model_parallel_size": tp,
             "pipeline_model_parallel_size": parallel.pipeline_model_parallel_size},
            "launch a multiple of TP x PP processes or change the parallel sizes",
        )
    sizes = [("num_attention_heads", cfg.model.num_attention_heads),
             ("num_query_groups", cfg.model.query_groups),
             ("ffn_hidden_size", cfg.model.ffn_size)]
    if parallel.sequence_parallel:  # activations are split along the sequence
        sizes.append(("seq_length", cfg.model.seq_length))
    for name, size in sizes:
        if size % tp:
            raise _error(
                f"{flag(name)} {size} is not divisible by the tensor-parallel size",
                {name: size, "tensor_model_parallel_size": tp},
                f"pick a --tensor-model-parallel-size that divides {size}",
            )
    if parallel.zero_stage not in ZERO_STAGES:
        raise _error(
            "unknown ZeRO stage", {"zero_stage": parallel.zero_stage},
            "use --zero-stage 0, 1 or 3",
        )
    layer_weights([], [], parallel.pp_partition_method)  # the partitioner's own check


def _check_batch(cfg: TrainConfig, world_size: int) -> None:
    training = cfg.training
    dp = cfg.parallel.data_parallel_size(world_size)
    unit = training.micro_batch_size * dp
    gbs = resolved_global_batch_size(cfg, world_size)
    if gbs % unit:
        raise _error(
            f"global batch size is not a multiple of micro batch size x DP = "
            f"{training.micro_batch_size} x {dp} = {unit}",
            {"global_batch_size": gbs, "micro_batch_size": training.micro_batch_size},
            f"use a multiple of {unit}, e.g. {_nearest_multiples(gbs, unit)}",
        )
    schedule = BatchSchedule(gbs, training.micro_batch_size, dp, training.rampup_batch_size)
    schedule.validate()
    check_interleaving(cfg.parallel, cfg.model.num_layers,  # the schedule's owner decides
                       [g // unit for g in schedule.ramp_sizes()])


def _nearest_multiples(value: int, unit: int) -> str:
    below = value // unit * unit
    return f"{below} or {below + unit}" if below else str(unit)


def _check_checkpoint(values: dict[str, Any]) -> None:
    needs = {"save_interval": "save", "keep_last_n": "save", "new_series": "save",
             "finetune": "load", "use_checkpoint_args": "load", "skip_train": "load",
             "no_load_optim": "load", "no_load_rng": "load",
             "exit_on_missing_checkpoint": "load"}
    for name, needed in needs.items():
        if values[name] and not values[needed]:
            raise _error(f"{flag(name)} needs {flag(needed)}", {name: values[name]},
                         f"pass {flag(needed)} DIR or drop {flag(name)}")
    both = ("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler")
    if all(values[name] for name in both):
        raise _error("the schedule follows either the flags or the checkpoint",
                     dict.fromkeys(both, True), "drop one of the two flags")


def _check_zero(cfg: TrainConfig) -> None:
    """Flags that belong to one ZeRO stage, and the ZeRO-3 pool sizes."""
    parallel = cfg.parallel
    stage = parallel.zero_stage
    if parallel.overlap_param_gather and stage != 1:
        raise _error("--overlap-param-gather is ZeRO-1's post-step parameter all-gather",
                     {"zero_stage": stage}, "pass --zero-stage 1 or drop the flag "
                     "(ZeRO-3 prefetches with --zero3-prefetch-depth)")
    if parallel.grad_reduce_in_bf16 and parallel.accumulate_allreduce_grads_in_fp32:
        raise _error("gradients cannot be reduced in both bf16 and fp32",
                     {"grad_reduce_in_bf16": True, "accumulate_allreduce_grads_in_fp32": True},
                     "drop one of the two flags")
    if parallel.zero3_prefetch_depth < 0:
        raise _error("must be >= 0", {"zero3_prefetch_depth": parallel.zero3_prefetch_depth},
                     "give 0 (no prefetch) or more units to fetch ahead")
    live = parallel.live_units
    if parallel.zero3_max_live_units < 0 or live < parallel.zero3_prefetch_depth + 1:
        raise _error("the ZeRO-3 pool must hold the unit computing plus every prefetched one",
                     {"zero3_max_live_units": parallel.zero3_max_live_units,
                      "zero3_prefetch_depth": parallel.zero3_prefetch_depth},
                     f"give --zero3-max-live-units >= {parallel.zero3_prefetch_depth + 1} "
                     "or 0 for that default")


def _check_watchdog(values: dict[str, Any]) -> None:
    """The watchdog must fire before the backend's own timeout, or no dump is ever written."""
    limit = values["distributed_timeout_minutes"] * 60
    if values["hang_timeout"] >= limit:
        raise _error("the hang watchdog would fire after the process group times out",
                     {"hang_timeout": values["hang_timeout"],
                      "distributed_timeout_minutes": values["distributed_timeout_minutes"]},
                     f"give --hang-timeout below {limit} seconds or raise "
                     "--distributed-timeout-minutes")
