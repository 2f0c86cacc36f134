"""One rank of ``context_parallel.py``: what a layer keeps for backward at CP=C, the step
times of CP=2 and DP=2 (transformer layers, and the real trainer), and PyTorch's own context
parallelism on the same attention."""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

from megatron3d import device as devices
from megatron3d.accounting.activations import saved_bytes
from megatron3d.accounting.context_parallel import COMM_TYPES
from megatron3d.cli.arguments import parse_args
from megatron3d.config import ModelConfig
from megatron3d.cp.attention import context_attention
from megatron3d.cp.layout import rank_index
from megatron3d.cp.tokens import TokenInfo
from megatron3d.model.context import LayerContext
from megatron3d.model.transformer import TransformerLayer
from megatron3d.mpu.random import RNGStreams
from megatron3d.mpu.state import AxisGroup, ParallelState
from megatron3d.training.build import Overrides, build_trainer
from megatron3d.training.loop import Hooks

__all__ = ["COMM_TYPES", "layer_saved_bytes", "time_layers", "time_trainers",
           "torch_context_parallel"]
DTYPE, CPU, SEED = torch.bfloat16, torch.device("cpu"), 1234


def _config(a: argparse.Namespace) -> ModelConfig:
    return ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                       seq_length=a.seq, vocab_size=a.vocab, hidden_dropout=0.0,
                       attention_dropout=0.0)


def _layers(cfg: ModelConfig, cp: AxisGroup, comm: str) -> list[TransformerLayer]:
    """``cfg.num_layers`` layers (the same weights on every rank and for every run)."""
    ctx = LayerContext(cfg, AxisGroup.single(), SEED, DTYPE, CPU,
                       RNGStreams.create(SEED, 0, 0, CPU), cp=cp, cp_comm_type=comm)
    return [TransformerLayer(ctx, n).train() for n in range(cfg.num_layers)]


def _shard(cfg: ModelConfig, cp: AxisGroup, micro_batch: int) -> tuple[torch.Tensor,
                                                                       TokenInfo | None]:
    """This rank's tokens of a micro-batch, [s/C, b, h], and where they sit (None at C=1:
    the path a run without CP takes)."""
    x = torch.randn(cfg.seq_length // cp.size, micro_batch, cfg.hidden_size, dtype=DTYPE,
                    generator=torch.Generator().manual_seed(cp.rank))
    info = None if cp.size == 1 else TokenInfo(rank_index(cfg.seq_length, cp.size, cp.rank))
    return x.requires_grad_(), info


def layer_saved_bytes(a: argparse.Namespace, cp_size: int, comm: str) -> list[int]:
    """(a) on one of ``cp_size`` ranks: each layer's saved bytes (parameters and buffers
    left out), then the backward, with its exchanges."""
    cp = ParallelState.build(1, 1, cp_size=cp_size).cp if cp_size > 1 else AxisGroup.single()
    cfg = _config(a)
    y, info = _shard(cfg, cp, a.micro_batch)
    sizes = []
    for layer in _layers(cfg, cp, comm):
        size, y = saved_bytes(functools.partial(layer, y, info),
                              [*layer.parameters(), *layer.buffers()])
        sizes.append(size)
    y.float().sum().backward()
    return sizes


def _layer_step(layers: list[TransformerLayer], x: torch.Tensor,
                info: TokenInfo | None) -> None:
    """Forward and backward through ``layers``, then the gradients summed over the ranks
    (DP and CP ranks alike hold replicas of the weights)."""
    y = x
    for layer in layers:
        y = layer(y, info)
    y.float().square().mean().backward()
    grads = torch.cat([p.grad.flatten() for layer in layers for p in layer.parameters()])
    dist.all_reduce(grads)
    for layer in layers:
        layer.zero_grad(set_to_none=True)


def _rotating(runs: dict[str, Callable[[], None]], warmup: int, steps: int
              ) -> dict[str, list[float]]:
    """Each run stepped in turn, the order rotating every step, each step timed from a
    barrier; the first ``warmup`` steps of each are not kept."""
    names, times = list(runs), {name: [] for name in runs}
    for i in range(warmup + steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            runs[name]()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def time_layers(a: argparse.Namespace) -> tuple[str, dict[str, list[float]]]:
    """(c) at layer level on one of 2 ranks: DP=2 takes ``micro_batch`` whole sequences,
    CP=2 twice as many halves (the same tokens), with each comm type."""
    cp = ParallelState.build(1, 1, cp_size=2).cp
    cfg = _config(a)
    whole, _ = _shard(cfg, AxisGroup.single(dist.get_rank()), a.micro_batch)
    half, info = _shard(cfg, cp, 2 * a.micro_batch)
    single = AxisGroup.single(dist.get_rank())
    runs = {"DP=2": functools.partial(_layer_step, _layers(cfg, single, "p2p"), whole, None)}
    for comm in COMM_TYPES:
        runs[f"CP=2 {comm}"] = functools.partial(_layer_step, _layers(cfg, cp, comm), half, info)
    return devices.describe(CPU), _rotating(runs, a.warmup, a.steps)


def trainer_argv(a: argparse.Namespace, cp: int, comm: str, iters: int) -> list[str]:
    """The run at DP=2 (``cp`` 1) or CP=2 on 2 ranks: the same global batch, one
    micro-batch per rank and step, the same tokens per rank."""
    micro_batch = a.micro_batch * cp
    context = ["--context-parallel-size", str(cp), "--cp-comm-type", comm] if cp > 1 else []
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
            "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
            "--micro-batch-size", str(micro_batch), "--global-batch-size",
            str(2 * a.micro_batch), "--train-iters", str(iters), "--lr", "1e-4",
            "--lr-decay-style", "constant", "--mock-data", "--vocab-size", str(a.vocab),
            "--hidden-dropout", "0", "--attention-dropout", "0", "--bf16",
            "--log-interval", "1000000", "--eval-iters", "0", *context]


def _trainer_times(a: argparse.Namespace, cp: int, comm: str) -> list[float] | str:
    """Seconds of each step after the warmup of one trainer run, or why CP did not run."""
    iters = a.warmup + a.steps // 2
    cfg = parse_args(trainer_argv(a, cp, comm, iters))
    stamps: list[float] = []
    hooks = Hooks(on_step=lambda _i, _r: stamps.append(time.perf_counter()))
    trainer = build_trainer(cfg, ParallelState.build(1, 1, cp_size=cp), CPU,
                            overrides=Overrides(hooks=hooks))
    splits = {m.ctx.cp.size for m in trainer.model.engine.stage.modules()
              if isinstance(getattr(m, "ctx", None), LayerContext)}
    if splits != {cp}:
        return (f"build_trainer ran --context-parallel-size {cp} with attention over "
                f"{sorted(splits)} ranks: the CP integration is not in this build")
    dist.barrier()
    trainer.run()
    return [t1 - t0 for t0, t1 in zip(stamps, stamps[1:], strict=False)][a.warmup - 1:]


def time_trainers(a: argparse.Namespace) -> dict[str, list[float]] | str:
    """(c) through ``build_trainer`` on one of 2 ranks: DP=2 and CP=2 per comm type, in two
    rounds of rotating order; or why CP=2 did not run."""
    runs = [("DP=2", 1, "p2p"), *((f"CP=2 {comm}", 2, comm) for comm in COMM_TYPES)]
    times: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for round_ in range(2):
        for name, cp, comm in runs[round_:] + runs[:round_]:
            got = _trainer_times(a, cp, comm)
            if isinstance(got, str):
                return got
            times[name] += got
    return times


def _ms(step: Callable[[], None], repeats: int) -> float:
    """Median ms of ``step`` over ``repeats`` runs after one warmup, from a barrier."""
    step()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def torch_context_parallel(a: argparse.Namespace) -> str:
    """(d) on one of 2 ranks: causal attention [b, heads, s, d] forward and backward under
    PyTorch's ``context_parallel`` (its ring, its load balancing) next to ours (p2p), fp32;
    or the exception that stops PyTorch's on this machine."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    d = a.hidden // a.heads
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(a.micro_batch, a.heads, a.seq, d, generator=gen) for _ in range(3))
    cp = ParallelState.build(1, 1, cp_size=2).cp
    index = rank_index(a.seq, 2, cp.rank)
    mine = [t.index_select(2, index).requires_grad_() for t in (q, k, v)]

    def ours() -> None:
        context_attention(*mine, TokenInfo(index), cp, comm_type="p2p").sum().backward()

    ours_ms = _ms(ours, a.steps)
    mesh = init_device_mesh("cpu", (2,))
    buffers = [t.clone() for t in (q, k, v)]
    try:
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
            local = [t.clone().requires_grad_() for t in buffers]

            def theirs() -> None:
                F.scaled_dot_product_attention(*local, is_causal=True).sum().backward()

            torch_ms = _ms(theirs, a.steps)
    except Exception as exc:  # noqa: BLE001 - the reason is the result
        reason = str(exc).splitlines()[0]
        return (f"ours (p2p) {ours_ms:.2f} ms; PyTorch's does not run on CPU/gloo: "
                f"{type(exc).__name__}: {reason}")
    return f"ours (p2p) {ours_ms:.2f} ms, PyTorch's {torch_ms:.2f} ms ({ours_ms / torch_ms:.3f} x)"
