"""Floating-point operations of one training iteration, counted per operation from the config.

Only matrix multiplies are counted (2 FLOPs per multiply-add); norms, softmax, activations and
the embedding lookup are negligible and left out. Per token, forward, per transformer layer,
with h = hidden size, s = sequence length, f = MLP inner size (``ffn_size``):

    QKV projection              2 * h * 3h
    attention scores  Q K^T     2 * s * h     (the full s x s matrix, not halved for causal)
    attention x values          2 * s * h
    output projection           2 * h * h
    MLP, GeLU (2 matrices)      2 * h * f * 2
    MLP, SwiGLU (3 matrices)    2 * h * f * 3

and once per token for the LM head 2 * h * V (V = padded vocabulary). Multiplied by the
B * s tokens of a global batch this is the forward count F = F_layers + F_head.

The backward pass costs twice the forward, so model FLOPs = 3 F. Full recompute (activation
checkpointing) runs each transformer layer's forward once more (the head is not recomputed),
so the hardware count is 4 F_layers + 3 F_head. Selective recompute re-runs only the attention
core: the scores and attention x values products, 4 * s * h per token and layer, once more
(its softmax and dropout are not matmuls). For a 4h GeLU MLP the full-recompute count equals
BigScience/Narayanan's ``96 B s L h^2 (1 + s/(6h) + V/(16 L h))`` exactly. Their formula with
c = 3 (no checkpointing) scales the head term too and gives 4.5 B s h V instead of the true
6 B s h V, which is why we count per operation rather than plug c into that formula.

With grouped-query attention (G key/value heads of size d) the QKV projection is
2 * h * (h + 2 G d); the score and value products stay as above (every query head attends).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron3d.config import ModelConfig


@dataclass(frozen=True)
class FlopsCount:
    """FLOPs of one iteration: ``hardware`` includes recomputation, ``model`` does not."""

    hardware: int
    model: int


@dataclass(frozen=True)
class Throughput:
    """Per-GPU rates of one iteration, ready for the log line.

    model_tflops is None when it equals ``tflops`` (no recomputation); mfu_percent is None
    when the device peak is unknown. MFU uses model FLOPs, by definition.
    """

    tflops: float
    model_tflops: float | None
    mfu_percent: float | None


def attention_core_flops_per_token(model_cfg: ModelConfig) -> int:
    """Forward matmul FLOPs of one layer's attention core for one token: the scores Q K^T
    and attention x values, 2 * s * h each (every query head attends, GQA or not)."""
    return 2 * (2 * model_cfg.seq_length * model_cfg.hidden_size)


def layer_forward_flops_per_token(model_cfg: ModelConfig) -> int:
    """Forward matmul FLOPs of one transformer layer for one token."""
    h, f = model_cfg.hidden_size, model_cfg.ffn_size
    kv = model_cfg.query_groups * model_cfg.head_dim  # = h without grouped-query attention
    qkv = 2 * h * (h + 2 * kv)
    projection = 2 * h * h
    mlp = 2 * h * f * (3 if model_cfg.swiglu else 2)
    return qkv + attention_core_flops_per_token(model_cfg) + projection + mlp


def flops_per_iteration(model_cfg: ModelConfig, global_batch_size: int,
                        padded_vocab_size: int) -> FlopsCount:
    """FLOPs of one optimizer step over ``global_batch_size`` samples (see module docstring)."""
    tokens = global_batch_size * model_cfg.seq_length
    layers = tokens * model_cfg.num_layers * layer_forward_flops_per_token(model_cfg)
    head = tokens * 2 * model_cfg.hidden_size * padded_vocab_size
    model = 3 * (layers + head)
    recomputed = {"full": layers, "selective": tokens * model_cfg.num_layers
                  * attention_core_flops_per_token(model_cfg), None: 0}
    return FlopsCount(hardware=model + recomputed[model_cfg.recompute], model=model)


def tflops_per_gpu(flops: float, seconds: float, world_size: int) -> float:
    """Achieved TFLOP/s per GPU for ``flops`` done by ``world_size`` GPUs in ``seconds``."""
    if seconds <= 0 or world_size <= 0:
        raise ValueError(f"need seconds > 0 and world_size > 0, got {seconds}, {world_size}")
    return flops / (seconds * world_size * 1e12)


def throughput(flops: FlopsCount, seconds_per_iteration: float, world_size: int,
               peak_tflops: float | None) -> Throughput:
    """Hardware TFLOP/s, model TFLOP/s when recomputation makes them differ, and MFU."""
    hardware = tflops_per_gpu(flops.hardware, seconds_per_iteration, world_size)
    model = tflops_per_gpu(flops.model, seconds_per_iteration, world_size)
    mfu = 100.0 * model / peak_tflops if peak_tflops else None
    return Throughput(tflops=hardware,
                      model_tflops=model if flops.hardware != flops.model else None,
                      mfu_percent=mfu)
