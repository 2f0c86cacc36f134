"""What a rank allocates besides its states and the activations its micro-batches keep:
buffers the model holds for the whole run, the working set of the worst moment of a
backward and of an evaluation forward, and the pipeline messages in transit. Each is read
from the code that allocates it; ``tests/planner/test_transients.py`` measures them on the
CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron3d.accounting.activations import FP32
from megatron3d.accounting.context_parallel import backward_buffers, forward_buffers
from megatron3d.accounting.in_flight import Activations


def mlp_widths(sizes: Activations) -> tuple[int, int]:
    """Columns per token of the MLP on one TP rank: (its activation's output, the fc2 input:
    f/t; fc1's output: f/t, or SwiGLU's stacked gate and up projections, 2f/t)."""
    model = sizes.model
    inner = model.ffn_size // sizes.tp
    return inner, inner * (2 if model.swiglu else 1)


def model_buffers(sizes: Activations, names: Sequence[str]) -> dict[str, int]:
    """Tensors the rank's layers hold beside their parameters: the ALiBi bias [1, n/t, s, s]
    in the activation dtype, one per rank (``LayerContext.alibi``; under context parallelism
    each layer builds its own for its tokens instead, an activation), and each attention
    layer's rotary tables, cos and sin [s, 1, 1, d] in fp32."""
    model, layers = sizes.model, names.count("TransformerLayer")
    s, heads = model.seq_length, model.num_attention_heads // sizes.tp
    alibi = sizes.dtype.itemsize * heads * s * s if layers else 0
    rotary = 2 * FP32 * s * model.head_dim * layers
    shared = model.position_embedding_type == "alibi" and sizes.cp == 1
    found = {"ALiBi bias": alibi if shared else 0,
             "rotary tables": rotary if model.position_embedding_type == "rope" else 0}
    return {name: size for name, size in found.items() if size}


def backward_working_set(sizes: Activations, names: Sequence[str], padded_vocab: int) -> int:
    """The most a backward step of this rank allocates beyond the activations in flight, the
    largest of:

    - a transformer layer's, beside the gradient of the residual stream [N, h] that arrives
      at it and lives through its backward. In its MLP (its widest part), under full
      recompute: the layer's activations rebuilt as if nothing were recomputed, and fc2's
      input and weight gradients [M, f/t] and [h, f/t]. Otherwise: fc1's output gradient
      [M, w] (w: f/t, or 2f/t for SwiGLU's gate and up) beside either a second one (the
      activation function's input and output gradients) or fc1's weight and input
      gradients [h, w] and [N, h]; or an RMSNorm's backward (torch's, computed in fp32, as
      ``kernels.rms_norm`` falls back without apex): four fp32 and three model-dtype
      tensors [N, h]. Weight gradients are in the model dtype until the gradient hook adds
      them into the fp32 buffer and frees them;
    - the input embedding's weight gradient [v/t, h] (dense, model dtype) beside the
      gradient reaching it [N, h] (and, with hidden dropout, the dropout's input gradient);
    - the LM head's logits [s, b, v/t] (or their gradient) and its weight gradient [v/t, h];
    - under context parallelism, an attention backward's exchange buffers
      (``context_parallel.backward_buffers``) beside the residual stream's gradient.
    """
    e, model = sizes.dtype.itemsize, sizes.model
    h, tokens = model.hidden_size, sizes.tokens
    stream = e * sizes.outside * h
    inner, fc1 = mlp_widths(sizes)
    table = e * (padded_vocab // sizes.tp) * h
    candidates = [0]
    if "TransformerLayer" in names and model.recompute == "full":
        candidates.append(stream + sizes.layer(recompute=False) + e * inner * (tokens + h))
    elif "TransformerLayer" in names:
        gradient = e * tokens * fc1
        candidates.append(stream + gradient + max(gradient, e * fc1 * h + stream))
        if model.normalization == "rmsnorm":
            candidates.append(stream + (4 * FP32 + 3 * e) * sizes.outside * h)
    if "TransformerLayer" in names and sizes.cp > 1:
        candidates.append(stream + backward_buffers(sizes.split))
    if "InputEmbedding" in names:
        candidates.append(table + stream * (2 if model.hidden_dropout > 0 else 1))
    if "OutputEmbedding" in names:
        candidates.append(sizes.logits(padded_vocab) + table)
    return max(candidates)


def forward_working_set(sizes: Activations, names: Sequence[str], padded_vocab: int) -> int:
    """The most an evaluation forward (no gradients, nothing kept) allocates at once: a
    layer's tensors, bounded by what it would keep for backward (and the ring's K/V chunks
    in flight under context parallelism), or the head's logits and the loss's fp32 buffer
    of them."""
    candidates = [0]
    if "TransformerLayer" in names:
        candidates.append(sizes.layer(recompute=False) + forward_buffers(sizes.split))
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
