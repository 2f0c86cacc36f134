"""The model and its parallel layout: what is built and how it is split over ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from megatron3d.config.ranges import (
    AT_LEAST_ONE,
    INIT_STD,
    LAYERS,
    NON_NEGATIVE,
    POSITIVE,
    PROBABILITY,
    SIZE,
    VOCABULARY,
    Range,
    option,
)

PositionEmbeddingType = Literal["learned_absolute", "rope", "alibi"]
Normalization = Literal["layernorm", "rmsnorm"]
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
    kv_channels: int | None = option(
        None, "Channels per attention head; must be hidden size / heads (the default).",
        range=SIZE)
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
    pad_vocab_size_to: int | None = option(
        None, "Pad the vocabulary to exactly this many rows instead (BLOOM: 250880); at least "
        "the tokenizer's vocabulary and divisible by the TP size.", range=VOCABULARY)
    position_embedding_type: PositionEmbeddingType = option(
        "learned_absolute", "learned_absolute (GPT-2), alibi (BLOOM) or rope (Llama).")
    rotary_base: float = option(10000.0, "Base of the rotary frequencies.", range=POSITIVE)
    use_rope_scaling: bool = option(
        False, "Llama 3.x RoPE frequency scaling: frequencies whose wavelength exceeds the "
        "original context / --rope-scaling-low-freq-factor are divided by "
        "--rope-scaling-factor, those under context / --rope-scaling-high-freq-factor kept, "
        "the ones between blended.")
    rope_scaling_factor: float = option(
        8.0, "Llama 3.x RoPE scaling: what the low frequencies are divided by (8 for Llama "
        "3.1, 32 for 3.2); at least 1, as scaling only slows rotations.", range=AT_LEAST_ONE)
    rope_scaling_low_freq_factor: float = option(
        1.0, "Llama 3.x RoPE scaling: wavelengths above original context / this are scaled.",
        range=POSITIVE)
    rope_scaling_high_freq_factor: float = option(
        4.0, "Llama 3.x RoPE scaling: wavelengths below original context / this are kept; "
        "must exceed the low-frequency factor.", range=POSITIVE)
    rope_scaling_original_max_position_embeddings: int = option(
        8192, "Llama 3.x RoPE scaling: the context the model was first trained at.",
        range=SIZE)
    normalization: Normalization = option("layernorm", "layernorm or rmsnorm.")
    layernorm_epsilon: float = option(1e-5, "Epsilon of every normalisation layer.",
                                      range=POSITIVE, aliases=("norm_epsilon",))
    swiglu: bool = option(False, "SwiGLU MLP (gate and up projections, SiLU).")
    embed_layernorm: bool = option(False, "LayerNorm right after the word embedding (BLOOM).")
    untie_embeddings_and_output_weights: bool = option(
        False, "Give the LM head its own weight instead of the input embedding's.")
    disable_bias_linear: bool = option(False, "No biases in linear layers (Llama-style).")
    add_qkv_bias: bool = option(
        False, "A bias on the QKV projection even with --disable-bias-linear (Qwen2).")
    init_method_std: float = option(0.02, "Std of the normal initialisation.",
                                    range=INIT_STD)
    hidden_dropout: float = option(0.1, "Dropout on attention and MLP outputs.", range=PROBABILITY)
    attention_dropout: float = option(0.1, "Dropout on attention probabilities.", range=PROBABILITY)
    checkpoint_activations: bool = option(
        False, "Recompute each transformer block in the backward pass to save memory (the "
        "same as --recompute-granularity full).")
    recompute_granularity: Literal["full", "selective"] | None = option(
        None, "Activation recompute in backward, Megatron's names: full re-runs each "
        "transformer block and keeps only its input; selective re-runs only the attention "
        "core (QK^T, softmax, dropout, @V), whose s x s scores would cost the most memory, "
        "for a few percent more compute.")
    compile: bool = option(
        False, "Compile each transformer layer with torch.compile (inductor): its elementwise "
        "work is fused between the tensor-parallel collectives, which stay eager; the "
        "embedding and the head stay eager too. Dropout masks differ from an eager run's but "
        "come from the same saved random states, so a resume stays bitwise.")

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:
            return int(4 * self.hidden_size * 2 / 3) // 64 * 64
        return 4 * self.hidden_size

    @property
    def recompute(self) -> Literal["full", "selective"] | None:
        """The recompute in effect: --checkpoint-activations is full recompute."""
        return "full" if self.checkpoint_activations else self.recompute_granularity

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
    def qkv_bias(self) -> bool:
        """Whether the QKV projection has a bias: with every linear layer's, or alone."""
        return self.add_bias or self.add_qkv_bias

    @property
    def tie_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    def padded_vocab_size(self, tp_size: int) -> int:
        """Vocabulary rows actually allocated; the extra rows are zero and masked out."""
        if self.pad_vocab_size_to is not None:
            return self.pad_vocab_size_to
        multiple = self.make_vocab_size_divisible_by * tp_size
        return math.ceil(self.vocab_size / multiple) * multiple


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The parallel layout; the data-parallel size is derived from the world size."""

    tensor_model_parallel_size: int = option(1, "Tensor-parallel size (TP).", range=AT_LEAST_ONE)
    pipeline_model_parallel_size: int = option(
        1, "Pipeline-parallel size (PP).", range=AT_LEAST_ONE)
    context_parallel_size: int = option(
        1, "Context-parallel size (CP): each sequence is split over this many ranks, which "
        "exchange keys and values in attention (for sequences one rank cannot hold); their "
        "gradients are averaged with data parallelism's.", range=AT_LEAST_ONE)
    cp_comm_type: Literal["p2p", "all_gather", "a2a"] = option(
        "p2p", "How context-parallel attention exchanges the sequence: p2p (a ring passing "
        "key/value chunks, overlapped with compute), all_gather (gather every key and value) "
        "or a2a (Ulysses all-to-all from sequence to head shards; heads and query groups per "
        "TP rank must divide by CP).")
    zero_stage: int = option(0, "ZeRO stage for data parallelism (0, 1 or 3).")
    distributed_backend: Literal["nccl", "gloo"] | None = option(
        None, "Collective backend: nccl (GPUs, one rank per GPU) or gloo (CPUs; on GPUs it "
        "lets several ranks share one GPU, slowly: for tests). Default: nccl where there are "
        "GPUs, else gloo.")
    pp_partition_method: str = option(
        "parameters", "Pipeline partitioning: uniform, parameters or type:REGEX.")
    reduce_bucket_size: int = option(
        500_000_000, "Elements per data-parallel gradient bucket (reduced as backward runs).",
        range=Range(1, 2**40))
    pipeline_schedule: Literal["1f1b", "gpipe"] = option(
        "1f1b", "Pipeline schedule: 1f1b (at most PP micro-batches in flight) or gpipe.")
    virtual_pipeline_model_parallel_size: int | None = option(
        None, "Interleaved 1F1B: model chunks per pipeline rank (v); the layers are split "
        "into PP x v virtual stages by --pp-partition-method and rank r holds virtual stages "
        "r, r + PP, ...; the bubble shrinks to (PP-1)/(v x micro-batches).",
        range=AT_LEAST_ONE)
    num_layers_per_virtual_pipeline_stage: int | None = option(
        None, "Interleaved 1F1B, Megatron's other spelling: transformer layers per virtual "
        "stage (v = layers / (PP x this)), in Megatron's layout whatever "
        "--pp-partition-method says: the embedding with the first layers, the final norm and "
        "output layer with the last.", range=AT_LEAST_ONE)
    sequence_parallel: bool = option(
        False, "Shard norms and dropout along the sequence inside TP groups (saves memory).")
    check_replicas_interval: int = option(
        1000, "Check TP-replicated parameters are identical every N steps (0: only at start).",
        range=NON_NEGATIVE)
    print_topology: bool = option(
        False, "Check the run as a launch would before its processes meet (every flag, the "
        "data and checkpoint paths; not the memory fit or backend, which need the compute "
        "node's devices), print the rank/group table for this layout and exit: 0, or 2 with "
        "the error.")
    memory_headroom: float = option(
        0.10, "Share of device memory the predicted peak must leave free: a layout needing "
        "more than (1 - this) x the device's memory is refused at start (and not feasible "
        "in tools/plan_topology.py).", range=PROBABILITY)
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

    zero3_shard_group: Literal["world", "node"] = option(
        "world", "ZeRO-3: shard parameters, gradients and optimizer states over every "
        "data-parallel rank (world), or only over the data-parallel ranks of one node and "
        "replicate across nodes (node: hybrid sharding; gradients reduce-scattered in the "
        "node, the shards all-reduced across nodes once per step).")
    zero3_secondary_shard: Literal["none", "node"] = option(
        "none", "ZeRO-3: keep a second, node-local shard of the parameters (node: ZeRO++ "
        "hpZ): the step's first gather of a unit reads the world shards, every re-gather "
        "(backward, later micro-batches) reads the node's copy, so only the first crosses "
        "nodes; gradients are reduced in two levels (in the node, then across nodes).")
    zero3_quantize_weights: bool = option(
        False, "ZeRO-3: send the parameter all-gathers that read the world shards as int8 "
        "with a scale per block (error per element at most the block's largest magnitude "
        "/ 254).")
    zero3_quantize_grads: bool = option(
        False, "ZeRO-3: send the gradient reductions that cross nodes as int8 with a scale "
        "per block, summed in fp32 on the receiver.")
    gpus_per_node: int = option(
        0, "Ranks per node, for the node-aware layouts (ZeRO-3's node groups; tensor "
        "parallelism kept inside a node). 0: LOCAL_WORLD_SIZE as torchrun sets it, or the "
        "whole world when not launched.", range=NON_NEGATIVE)

    @property
    def node_aware_zero3(self) -> bool:
        """Whether ZeRO-3 needs the data-parallel ranks split by node."""
        return self.zero3_shard_group == "node" or self.zero3_secondary_shard == "node"

    @property
    def reshard_after_forward(self) -> bool:
        return self.zero3_reshard_after_forward == "true"

    @property
    def live_units(self) -> int:
        """Pool slots for ZeRO-3 units (resolves the 0 default)."""
        return self.zero3_max_live_units or self.zero3_prefetch_depth + 1

    def virtual_size(self, num_layers: int) -> int:
        """Model chunks per pipeline rank: 1 without interleaving."""
        if self.virtual_pipeline_model_parallel_size is not None:
            return self.virtual_pipeline_model_parallel_size
        per = self.num_layers_per_virtual_pipeline_stage
        return 1 if per is None else num_layers // (self.pipeline_model_parallel_size * per)

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """Ranks reading different samples: the world over TP x CP x PP."""
        return world_size // (self.model_parallel_size * self.context_parallel_size)
