"""Activation memory: what a transformer layer keeps for backward, counted and measured.

Three numbers per layer and TP rank, compared by ``benchmarks/activation_memory.py`` and the
tests:

- ``paper_layer_bytes``: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models"), 16-bit activations with dropout: s b h (34 + 5 a s / h) bytes without
  parallelism, s b h (10 + 24/t + 5 a s / (h t)) with TP, all of it / t with sequence
  parallelism; selective recompute drops the 5 a s / h score terms, full recompute keeps the
  2 s b h (/ t) layer input.
- ``layer_activation_bytes``: our own exact count, term by term, from the code as built.
- ``saved_bytes``: the distinct storages autograd really saves (saved-tensor hooks), per layer
  in ``measured_layer_bytes``.

``PeakMemory`` measures the peak of the bytes allocated while it is active (on any device):
``cross_entropy_peak`` for the loss at a large vocabulary.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron3d.accounting.context_parallel import Split, kept_bytes
from megatron3d.config import ModelConfig
from megatron3d.model.context import LayerContext
from megatron3d.model.transformer import TransformerLayer
from megatron3d.mpu.cross_entropy import vocab_parallel_cross_entropy
from megatron3d.mpu.random import RNGStreams
from megatron3d.mpu.state import AxisGroup

FP32 = 4


def paper_layer_bytes(cfg: ModelConfig, micro_batch: int, tp: int,
                      sequence_parallel: bool) -> float:
    """Korthikanti et al.'s bytes per layer and TP rank (16-bit activations, dropout on)."""
    s, h, a, t = cfg.seq_length, cfg.hidden_size, cfg.num_attention_heads, tp
    sbh = s * micro_batch * h
    scores = 0.0 if cfg.recompute == "selective" else 5 * a * s / h
    if cfg.recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    if sequence_parallel:
        return sbh * (34 + scores) / t
    return sbh * (10 + (24 + scores) / t)


def layer_activation_bytes(cfg: ModelConfig, micro_batch: int, tp: int,
                           sequence_parallel: bool, dtype: torch.dtype,
                           device_type: str = "cuda", cp: int = 1,
                           cp_comm_type: str = "p2p") -> dict[str, int]:
    """Bytes one transformer layer keeps for backward on one TP (and CP) rank, term by term.

    Assumes SDPA's flash kernel (on the CPU: without attention dropout), which keeps q, k, v,
    its output and the fp32 log-sum-exp, and the torch norms (not apex). ``M`` tokens of the
    whole sequence are inside the TP region (split over heads or the MLP width), ``N`` tokens
    outside it (M / t under SP):

    - norm: each of the 2 norms keeps its input; LayerNorm also its mean and rstd (in the
      activation dtype on the CPU, fp32 on CUDA); our RMSNorm keeps an fp32 copy of its input,
      the fp32 rstd and the normalised activation.
    - qkv input / fc1 input: the column-parallel linears keep their input, [N, h] (under SP
      the shard: backward gathers it again).
    - q, k, v: [M, (n + 2G) d / t] for n query and G key/value heads of size d: the fused
      QKV output kept whole by its views (multi-head attention without rotary embeddings),
      or as many bytes in three tensors of their own (rotated, or q gathered from its
      groups); the keys and values are never copied per query head (``grouped_attention``).
    - attention output: [M, h/t], kept by the output projection (the kernel's output shares
      its storage); without recompute the kernel's log-sum-exp [b, n/t, s] fp32 too.
    - the CPU's math kernel instead (attention dropout on the CPU, without recompute): fp32
      copies of q, k, v and three fp32 [b, n/t, s, s] tensors (the probabilities, the dropout
      mask and the dropped probabilities), quadratic in the sequence.
    - MLP: GeLU keeps its input and the output projection the activation, [M, f/t] each;
      SwiGLU the stacked gate/up [M, 2f/t], silu(gate) and the product.
    - dropout masks: one byte per element of the [N, h] attention and MLP outputs.

    Full recompute keeps only the layer input [N, h].

    Under context parallelism (``cp`` > 1) every term counts the rank's s/C tokens, its
    queries see the whole sequence (the scores are [s/C, s]), and the exchange keeps what
    ``context_parallel.kept_bytes`` says (a recomputed attention core keeps none of it).
    """
    e = dtype.itemsize
    s, b, h, t = cfg.seq_length // cp, micro_batch, cfg.hidden_size, tp
    big = s * b  # M: tokens inside the TP region
    small = big // t if sequence_parallel else big  # N: tokens outside it
    if cfg.recompute == "full":
        return {"layer input": e * small * h}
    heads, groups = cfg.num_attention_heads // t, cfg.query_groups // t
    d, f = cfg.head_dim, cfg.ffn_size // t
    stat = e if device_type == "cpu" else FP32
    norm = (FP32 * small * h + FP32 * small + e * small * h if cfg.normalization == "rmsnorm"
            else e * small * h + 2 * stat * small)
    math = device_type == "cpu" and cfg.attention_dropout > 0 and cfg.recompute is None
    terms = {
        "norms": 2 * norm,
        "qkv input": e * small * h,
        "q, k, v": (FP32 if math else e) * big * (heads + 2 * groups) * d,
        "attention output": e * big * heads * d,
        "log-sum-exp": FP32 * b * heads * s if cfg.recompute is None and not math else 0,
        "attention scores": 3 * FP32 * b * heads * s * cfg.seq_length if math else 0,
        "fc1 input": e * small * h,
        "MLP": e * big * f * (4 if cfg.swiglu else 2),
        "dropout masks": 2 * small * h if cfg.hidden_dropout > 0 else 0,
        **(kept_bytes(Split(cfg, b, t, cp, cp_comm_type, e)) if cfg.recompute is None else {}),
    }
    return {name: size for name, size in terms.items() if size}


def saved_bytes(run: Callable[[], Any], constants: Iterable[torch.Tensor] = ()) -> tuple[int, Any]:
    """(bytes, ``run()``'s result): the distinct storages autograd saves for backward while
    ``run`` executes, whole (a saved view keeps its storage alive), leaving out ``constants``
    (parameters, buffers, a shared ALiBi bias): what the activations cost until backward."""
    skip = {c.untyped_storage().data_ptr() for c in constants}
    sizes: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            sizes[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = run()
    return sum(sizes.values()), result


def measured_layer_bytes(cfg: ModelConfig, micro_batch: int, tp: AxisGroup,
                         sequence_parallel: bool, dtype: torch.dtype = torch.bfloat16,
                         device: torch.device | None = None, seed: int = 1234) -> list[int]:
    """``saved_bytes`` of each of ``cfg.num_layers`` transformer layers run in turn in training
    mode on a random micro-batch, on this TP rank (every rank of ``tp`` calls it: backward runs
    at the end, with its collectives). Parameters and buffers are left out."""
    device = device or torch.device("cpu")
    ctx = LayerContext(cfg, tp, seed, dtype, device, RNGStreams.create(seed, tp.rank, 0, device),
                       sequence_parallel=sequence_parallel)
    rows = cfg.seq_length // tp.size if sequence_parallel else cfg.seq_length
    x = torch.randn(rows, micro_batch, cfg.hidden_size, dtype=dtype, device=device,
                    requires_grad=True)  # [s or s/tp, b, h]
    y, per_layer = x, []
    for number in range(cfg.num_layers):
        layer = TransformerLayer(ctx, number).train()
        constants = [*layer.parameters(), *layer.buffers()]
        if cfg.position_embedding_type == "alibi":
            constants.append(ctx.alibi.get(cfg.seq_length, dtype, device))
        size, y = saved_bytes(functools.partial(layer, y), constants)
        per_layer.append(size)
    y.float().sum().backward()
    return per_layer


def cross_entropy_peak(logits: torch.Tensor, labels: torch.Tensor, tp: AxisGroup,
                       logical_vocab_size: int) -> int:
    """Peak bytes the vocab-parallel cross entropy allocates over its forward and backward
    (the logits' gradient included; the logits, made beforehand, not) on this TP rank."""
    grad = torch.full(labels.shape, 1.0 / labels.numel(), device=logits.device)
    with PeakMemory() as peak:
        vocab_parallel_cross_entropy(logits, labels, tp, logical_vocab_size).backward(grad)
    return peak.peak


class PeakMemory(TorchDispatchMode):
    """The most bytes of tensor storage alive at once among those created while active.

    Every storage an operator returns is counted until it is freed, on any device (the CPU has
    no allocator statistics); storages that existed before are not counted. Backward runs
    inside the mode too when it is called inside it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = self.peak = 0
        self._live: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):  # views and in-place results are not new storage
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self._track(t.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._live or storage.device.type == "meta":
            return
        self._live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key)

    def new_window(self) -> None:
        """Start counting the peak afresh from what is alive now."""
        self.peak = self.current
