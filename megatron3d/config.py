"""Typed, frozen configuration for a training run.

Every field name is the Megatron-DeepSpeed flag name with dashes turned into underscores, and
each name appears in exactly one section, so ``arguments.py`` maps flags and YAML keys to
fields without a hand-written table. The ``help`` metadata is the field's documentation and
the ``--help`` text; ``range`` bounds a numeric field's value next to its definition (checked
by ``validation.py``, shown in ``--help``). Values derived from several fields are properties,
never stored twice. Cross-field checks live in ``validation.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from megatron3d.ranges import (
    AT_LEAST_ONE,
    BATCH,
    FRACTION,
    ITERATIONS,
    LAYERS,
    NON_NEGATIVE,
    POSITIVE,
    PROBABILITY,
    SAMPLES,
    SEED,
    SIZE,
    VOCABULARY,
    Range,
    option,
)

PositionEmbeddingType = Literal["learned_absolute", "rope", "alibi"]
Normalization = Literal["layernorm", "rmsnorm"]
LRDecayStyle = Literal["constant", "linear", "cosine"]
ZERO_STAGES = (0, 1, 3)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The GPT family: GPT-2 by default, BLOOM and Llama-style through flags."""

    num_layers: int = option(None, "Number of transformer blocks.", range=LAYERS)
    hidden_size: int = option(None, "Transformer hidden size h.", range=SIZE)
    num_attention_heads: int = option(
        None, "Attention heads; must divide hidden size.", range=AT_LEAST_ONE)
    group_query_attention: bool = option(
        False, "Grouped-query attention: keys and values get --num-query-groups heads, each "
        "shared by a group of query heads (Llama-2-70B, Llama-3).")
    num_query_groups: int | None = option(
        None, "Key/value heads under --group-query-attention; divides the head count and is "
        "divisible by the tensor-parallel size.", range=AT_LEAST_ONE)
    ffn_hidden_size: int | None = option(
        None, "MLP inner size; default 4h, or 2/3 of 4h rounded down to 64 with --swiglu.",
        range=SIZE)
    seq_length: int = option(None, "Tokens per training sample.", range=SIZE)
    max_position_embeddings: int | None = option(
        None, "Learned position table size; default --seq-length.", range=SIZE)
    vocab_size: int | None = option(
        None, "Logical vocabulary size (the null/mock tokenizer's size).", range=VOCABULARY)
    make_vocab_size_divisible_by: int = option(
        128, "Pad the vocabulary to a multiple of this times the TP size.",
        range=Range(1, 2**16))
    position_embedding_type: PositionEmbeddingType = option(
        "learned_absolute", "learned_absolute (GPT-2), alibi (BLOOM) or rope (Llama).")
    rotary_base: float = option(10000.0, "Base of the rotary frequencies.", range=POSITIVE)
    normalization: Normalization = option("layernorm", "layernorm or rmsnorm.")
    layernorm_epsilon: float = option(1e-5, "Epsilon of every normalisation layer.",
                                      range=POSITIVE, aliases=("norm_epsilon",))
    swiglu: bool = option(False, "SwiGLU MLP (gate and up projections, SiLU).")
    embed_layernorm: bool = option(False, "LayerNorm right after the word embedding (BLOOM).")
    untie_embeddings_and_output_weights: bool = option(
        False, "Give the LM head its own weight instead of the input embedding's.")
    disable_bias_linear: bool = option(False, "No biases in linear layers (Llama-style).")
    init_method_std: float = option(0.02, "Std of the normal initialisation.", range=POSITIVE)
    hidden_dropout: float = option(0.1, "Dropout on attention and MLP outputs.", range=PROBABILITY)
    attention_dropout: float = option(0.1, "Dropout on attention probabilities.", range=PROBABILITY)
    checkpoint_activations: bool = option(
        False, "Recompute each transformer block in the backward pass to save memory.")

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:
            return int(4 * self.hidden_size * 2 / 3) // 64 * 64
        return 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads: one per query head without grouped-query attention."""
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    @property
    def add_bias(self) -> bool:
        return not self.disable_bias_linear

    @property
    def tie_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    def padded_vocab_size(self, tp_size: int) -> int:
        """Vocabulary rows actually allocated; the extra rows are zero and masked out."""
        multiple = self.make_vocab_size_divisible_by * tp_size
        return math.ceil(self.vocab_size / multiple) * multiple


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The parallel layout; the data-parallel size is derived from the world size."""

    tensor_model_parallel_size: int = option(1, "Tensor-parallel size (TP).", range=AT_LEAST_ONE)
    pipeline_model_parallel_size: int = option(
        1, "Pipeline-parallel size (PP).", range=AT_LEAST_ONE)
    zero_stage: int = option(0, "ZeRO stage for data parallelism (0, 1 or 3).")
    pp_partition_method: str = option(
        "parameters", "Pipeline partitioning: uniform, parameters or type:REGEX.")
    reduce_bucket_size: int = option(
        500_000_000, "Elements per data-parallel gradient bucket (reduced as backward runs).",
        range=Range(1, 2**40))
    pipeline_schedule: Literal["1f1b", "gpipe"] = option(
        "1f1b", "Pipeline schedule: 1f1b (at most PP micro-batches in flight) or gpipe.")
    sequence_parallel: bool = option(
        False, "Shard norms and dropout along the sequence inside TP groups (saves memory).")
    check_replicas_interval: int = option(
        1000, "Check TP-replicated parameters are identical every N steps (0: only at start).",
        range=NON_NEGATIVE)
    print_topology: bool = option(False, "Print the rank/group table for this layout and exit.")
    overlap_param_gather: bool = option(
        False, "ZeRO-1: all-gather updated parameters asynchronously after the step, each "
        "bucket awaited just before its first use in the next forward.")
    grad_reduce_in_bf16: bool = option(
        False, "Send data-parallel gradients in bf16 (half the traffic); they still "
        "accumulate in fp32. Default: reduce in fp32.")
    accumulate_allreduce_grads_in_fp32: bool = option(
        False, "Accepted for Megatron-DeepSpeed scripts: fp32 reduction is the default.")
    zero3_prefetch_depth: int = option(
        1, "ZeRO-3: how many units ahead to all-gather while the current one computes.")
    zero3_max_live_units: int = option(
        0, "ZeRO-3: gathered units resident at once (buffers allocated at start); "
        "0 means prefetch depth + 1.")
    zero3_allreduce_fetch: bool = option(
        False, "ZeRO-3: gather a unit by all-reducing a zero-filled full buffer instead of "
        "an all-gather (same bits; faster on some backends).")
    zero3_reshard_after_forward: Literal["true", "false"] = option(
        "true", "ZeRO-3: free gathered units after each use (true) or keep a stage's units "
        "gathered for the whole step (false: one gather per unit per step, more memory).")

    @property
    def reshard_after_forward(self) -> bool:
        return self.zero3_reshard_after_forward == "true"

    @property
    def live_units(self) -> int:
        """Pool slots for ZeRO-3 units (resolves the 0 default)."""
        return self.zero3_max_live_units or self.zero3_prefetch_depth + 1

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // self.model_parallel_size


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """Batch sizes, run length, evaluation cadence and the seed."""

    micro_batch_size: int = option(
        None, "Samples per micro-batch per data-parallel rank.", range=SIZE)
    global_batch_size: int | None = option(
        None, "Samples per optimizer step; default micro batch size x DP size.", range=BATCH)
    rampup_batch_size: tuple[int, int, int] | None = option(
        None, "START INCR SAMPLES: grow the global batch from START by INCR over SAMPLES.",
        nargs=3)
    train_iters: int | None = option(
        None, "Optimizer steps to run (or use --train-samples).", range=ITERATIONS)
    train_samples: int | None = option(
        None, "Samples to train on (or use --train-iters).", range=SAMPLES)
    eval_interval: int = option(1000, "Evaluate every this many iterations.", range=ITERATIONS)
    eval_iters: int = option(100, "Global batches per evaluation.", range=Range(0, 2**20))
    seed: int = option(1234, "Seed for initialisation, data and dropout.", range=SEED)


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW hyper-parameters and gradient clipping."""

    lr: float | None = option(None, "Peak learning rate.", range=POSITIVE)
    min_lr: float = option(0.0, "Learning rate at the end of decay.", range=NON_NEGATIVE)
    weight_decay: float = option(
        0.01, "Decoupled weight decay (biases and norms get none).", range=NON_NEGATIVE)
    clip_grad: float = option(
        1.0, "Clip the global gradient norm to this; 0 disables.", range=NON_NEGATIVE)
    adam_beta1: float = option(0.9, "Adam beta1.", range=PROBABILITY)
    adam_beta2: float = option(0.999, "Adam beta2.", range=PROBABILITY)
    adam_eps: float = option(1e-8, "Adam epsilon.", range=POSITIVE)


@dataclass(frozen=True, kw_only=True)
class LRScheduleConfig:
    """Warmup then decay, measured in samples (iteration flags are converted)."""

    lr_decay_style: LRDecayStyle = option("linear", "constant, linear or cosine.")
    lr_warmup_iters: int = option(0, "Warmup length in iterations.", range=Range(0, 2**32))
    lr_warmup_samples: int = option(0, "Warmup length in samples.", range=Range(0, 2**40))
    lr_warmup_fraction: float | None = option(
        None, "Warmup as a fraction of the decay length.", range=FRACTION)
    lr_decay_iters: int | None = option(
        None, "Decay length in iterations; default the run.", range=ITERATIONS)
    lr_decay_samples: int | None = option(
        None, "Decay length in samples; default the run.", range=SAMPLES)


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """fp32 (default), bf16 with fp32 master weights, or fp16 with loss scaling."""

    bf16: bool = option(False, "bf16 parameters and activations, fp32 master weights and grads.")
    fp16: bool = option(False, "fp16 parameters and activations with dynamic loss scaling.")
    loss_scale: float | None = option(
        None, "Static fp16 loss scale; default dynamic.", range=POSITIVE)
    initial_loss_scale: float = option(2.0**32, "Starting dynamic loss scale.", range=POSITIVE)
    min_loss_scale: float = option(1.0, "Smallest dynamic loss scale.", range=POSITIVE)
    loss_scale_window: int = option(
        1000, "Clean steps before the dynamic scale doubles.", range=AT_LEAST_ONE)
    hysteresis: int = option(
        2, "Overflows tolerated before the dynamic scale halves.", range=AT_LEAST_ONE)

    @property
    def params_dtype_name(self) -> str:
        return "bfloat16" if self.bf16 else "float16" if self.fp16 else "float32"


TokenizerType = Literal["SentencePieceTokenizer", "PretrainedFromHF", "GPT2BPETokenizer",
                        "NullTokenizer"]


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where training samples come from: Megatron .bin/.idx datasets, or mock data."""

    mock_data: bool = option(False, "Synthetic Markov-chain tokens; needs --vocab-size.")
    data_path: tuple[str, ...] | None = option(
        None, "Dataset prefix without .bin/.idx (e.g. data/corpus_text_document), or "
        "'W1 P1 W2 P2 ...' weight-prefix pairs blended by sampling proportion.")
    data_path_file: str | None = option(
        None, "File holding the --data-path words (for long blends); '#' starts a comment.")
    data_impl: Literal["mmap"] = option(
        "mmap", "Dataset format; the memory-mapped .bin/.idx format is the one supported.")
    split: str = option("969, 30, 1", "Train, valid, test shares of each dataset's documents.")
    tokenizer_type: TokenizerType | None = option(
        None, "Tokenizer the data was made with; its vocabulary sizes the model.")
    tokenizer_model: str | None = option(None, "SentencePiece model file (SentencePieceTokenizer).")
    vocab_file: str | None = option(None, "GPT-2 vocab.json (GPT2BPETokenizer).")
    merge_file: str | None = option(None, "GPT-2 merges.txt (GPT2BPETokenizer).")
    tokenizer_name_or_path: str | None = option(
        None, "Local Hugging Face tokenizer directory or tokenizer.json (PretrainedFromHF); "
        "never downloaded.")
    data_cache_path: str | None = option(
        None, "Directory for dataset index caches; default index-cache beside the first dataset.")
    dry_run_data: bool = option(
        False, "Print each source's weight, samples drawn and implied epochs, then exit.")
    eod_mask_loss: bool = option(
        False, "No loss on positions whose input token is end-of-document.")


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """The log line and TensorBoard."""

    log_interval: int = option(
        100, "Print the iteration line every this many iterations.", range=AT_LEAST_ONE)
    tensorboard_dir: str | None = option(None, "Write TensorBoard event files here.")
    peak_tflops: float | None = option(
        None, "Device peak TFLOP/s for MFU; default known for A100/H100.", range=POSITIVE)
    memory_report: bool = option(
        False, "After the first step, print each rank's measured parameter, gradient and "
        "optimizer-state bytes (and the device's allocated bytes).")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Saving, resuming and stopping early (preemption, time limits)."""

    save: str | None = option(None, "Directory to save checkpoints in (shared by all nodes).")
    save_interval: int | None = option(
        None, "Save every this many iterations (and at the end).", range=ITERATIONS)
    keep_last_n: int | None = option(
        None, "Keep only the newest N checkpoints of this run's series (never another's).",
        range=AT_LEAST_ONE)
    new_series: bool = option(
        False, "Let --save hold another run's checkpoints: this run starts a new series there "
        "and 'latest' follows it; the other checkpoints stay, except one at an iteration this "
        "run saves, which it replaces.")
    load: str | None = option(
        None, "Resume from the newest checkpoint here; an empty or missing directory starts "
        "from scratch, so a requeued job can rerun the same command.")
    finetune: bool = option(False, "Load only the weights: iteration, optimizer and data start "
                          "from zero.")
    use_checkpoint_args: bool = option(
        False, "Take the model flags from the checkpoint in --load.")
    exit_interval: int | None = option(
        None, "Save and stop at the first iteration divisible by N.", range=ITERATIONS)
    exit_duration_in_mins: float | None = option(
        None, "Save and stop once training has run this many minutes.", range=POSITIVE)


@dataclass(frozen=True, kw_only=True)
class ResilienceConfig:
    """What happens when a run hangs or diverges: watchdog, hang dumps, non-finite steps."""

    hang_timeout: float = option(
        300.0, "Seconds without a finished step after which every rank writes a hang dump "
        "(stacks, recent collectives, coordinates) and exits non-zero; 0 disables the watchdog.",
        range=NON_NEGATIVE)
    hang_startup_timeout: float = option(
        1800.0, "The watchdog's allowance during start-up, checkpoint load and save, "
        "evaluation, and until the first step finishes.", range=NON_NEGATIVE)
    hang_dump_dir: str | None = option(
        None, "Directory for hang dumps (rank-XXXXX.txt); default SAVE/hang, or ./hang "
        "without --save. SIGUSR2 writes a dump there without stopping the run.")
    flight_recorder_size: int = option(
        2048, "Collective and point-to-point operations each rank remembers for hang dumps.",
        range=Range(0, 2**24))
    distributed_timeout_minutes: int = option(
        10, "Timeout of every collective in the process group; keep it above --hang-timeout "
        "so the watchdog reports a hang before the backend aborts.",
        range=Range(1, 7 * 24 * 60))  # a week
    check_for_nan_in_loss_and_grad: bool = option(
        False, "Stop with an error when the global gradient norm is NaN or Inf (bf16, fp32; "
        "in fp16 that is an overflow for the loss scaler); by default such a step is skipped "
        "on every rank and counted in 'number of nan iterations'.")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The whole run; each section is one concern."""

    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "lr_schedule": LRScheduleConfig,
    "precision": PrecisionConfig,
    "data": DataConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
    "resilience": ResilienceConfig,
}
"""Section name -> dataclass, in the order flags are listed in ``--help``."""


def flat_fields(cfg: TrainConfig) -> dict[str, Any]:
    """Field name -> value over every section (field names are unique across sections)."""
    return {f.name: getattr(getattr(cfg, section), f.name)
            for section, cls in SECTIONS.items() for f in fields(cls)}
