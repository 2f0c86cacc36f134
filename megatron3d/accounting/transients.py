"""What a rank allocates besides its states and the activations its micro-batches keep:
buffers the model holds for the whole run, the working set of the worst moment of a
backward and of an evaluation forward, and the pipeline messages in transit. Each is read
from the code that allocates it; ``tests/planner/test_transients.py`` measures them on the
CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron3d.accounting.activations import FP32
from megatron3d.accounting.in_flight import Activations


def mlp_width(sizes: Activations) -> int:
    """Columns per token of the MLP's widest activation on one TP rank: the fc1 output
    [M, f/t], or SwiGLU's stacked gate and up projections [M, 2f/t]."""
    model = sizes.model
    return model.ffn_size // sizes.tp * (2 if model.swiglu else 1)


def largest_weight(sizes: Activations) -> int:
    """Elements of a transformer layer's largest weight on one TP rank: the fused QKV
    projection [(n + 2G) d / t, h] or the MLP's fc1 [f/t (x2 for SwiGLU), h]."""
    model = sizes.model
    qkv = (model.num_attention_heads + 2 * model.query_groups) * model.head_dim // sizes.tp
    return model.hidden_size * max(qkv, mlp_width(sizes))


def model_buffers(sizes: Activations, names: Sequence[str]) -> dict[str, int]:
    """Tensors the rank's layers hold beside their parameters: the ALiBi bias [1, n/t, s, s]
    in the activation dtype, one per rank (``LayerContext.alibi``), and each attention
    layer's rotary tables, cos and sin [s, 1, 1, d] in fp32."""
    model, layers = sizes.model, names.count("TransformerLayer")
    s, heads = model.seq_length, model.num_attention_heads // sizes.tp
    alibi = sizes.dtype.itemsize * heads * s * s if layers else 0
    rotary = 2 * FP32 * s * model.head_dim * layers
    found = {"ALiBi bias": alibi if model.position_embedding_type == "alibi" else 0,
             "rotary tables": rotary if model.position_embedding_type == "rope" else 0}
    return {name: size for name, size in found.items() if size}


def backward_working_set(sizes: Activations, names: Sequence[str], padded_vocab: int) -> int:
    """The most a backward step of this rank allocates beyond the activations in flight, the
    largest of:

    - a transformer layer's: under full recompute the layer's activations rebuilt as if
      nothing were recomputed, and the gradient of its MLP activation [M, width]; without
      full recompute two such gradients (entering and leaving the activation function);
      either way the gradient of its largest weight, in the model dtype, before the
      gradient hook adds it into the fp32 buffer and frees it;
    - the input embedding's weight gradient [v/t, h] (dense, model dtype);
    - the LM head's logits [s, b, v/t] (or their gradient) and its weight gradient [v/t, h].
    """
    e, model = sizes.dtype.itemsize, sizes.model
    width = e * sizes.tokens * mlp_width(sizes)
    table = e * (padded_vocab // sizes.tp) * model.hidden_size
    candidates = [0]
    if "TransformerLayer" in names:
        grads = width + (sizes.layer(recompute=False) if model.recompute == "full" else width)
        candidates.append(grads + e * largest_weight(sizes))
    if "InputEmbedding" in names:
        candidates.append(table)
    if "OutputEmbedding" in names:
        candidates.append(sizes.logits(padded_vocab) + table)
    return max(candidates)


def forward_working_set(sizes: Activations, names: Sequence[str], padded_vocab: int) -> int:
    """The most an evaluation forward (no gradients, nothing kept) allocates at once: a
    layer's tensors, bounded by what it would keep for backward, or the head's logits and
    the loss's fp32 buffer of them."""
    candidates = [0]
    if "TransformerLayer" in names:
        candidates.append(sizes.layer(recompute=False))
    if "OutputEmbedding" in names:
        candidates.append(sizes.logits(padded_vocab) + sizes.loss(padded_vocab))
    return max(candidates)


def pipeline_messages(sizes: Activations, stages: int) -> int:
    """Pipeline transfers alive between two exchanges: the output being sent (its storage is
    held by the send until the next exchange) and the buffer posted for the next receive,
    each [s/t under SP, b, h] in the activation dtype."""
    if stages == 1:
        return 0
    return 2 * sizes.dtype.itemsize * sizes.outside * sizes.model.hidden_size
