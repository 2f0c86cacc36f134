"""One DP rank of ``zero.py``: build every run, step them in turn, and return what it saw.

megatron3d runs are the trainer ``build_trainer`` makes, stepped by ``train_step`` exactly as
``Trainer.run`` does; the torch runs (DDP, DDP + ZeroRedundancyOptimizer, FSDP2) train the
model ``build_gpt`` makes on the same batches with the same AdamW groups, clipping and loss.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from benchmarks.zero_fsdp import FsdpRun, TorchCounter, clip_and_step, plain_gpt
from megatron3d import device as devices
from megatron3d.accounting import memory
from megatron3d.cli.arguments import parse_args
from megatron3d.config import TrainConfig
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.state import ParallelState
from megatron3d.mpu.traffic import CommCounter, observing
from megatron3d.training.build import build_trainer
from megatron3d.training.loop import Trainer
from megatron3d.training.step import train_step

M3D_FP32 = {"m3d ZeRO-0": (0, 0), "m3d ZeRO-1": (1, 0), "m3d ZeRO-3 pf0": (3, 0),
            "m3d ZeRO-3 pf1": (3, 1), "m3d ZeRO-3 pf2": (3, 2)}  # name -> (stage, prefetch)
M3D_BF16 = {"m3d ZeRO-0 bf16": (0, 0), "m3d ZeRO-1 bf16": (1, 0)}
TORCH = ["torch DDP", "torch ZeRO", "torch FSDP2"]
REFERENCE, BASELINE = "m3d ZeRO-0", "torch FSDP2"


def names(bf16: bool) -> list[str]:
    """Every run of one invocation, in the order the table shows them."""
    return [*M3D_FP32, *(M3D_BF16 if bf16 else ()), *TORCH]


@dataclass(frozen=True)
class Result:
    """One run on one rank."""

    times: list[float]  # seconds per timed step, barrier to end of the optimizer step
    losses: list[float]  # per step (megatron3d: DP mean; torch: this rank's)
    measured: memory.MemoryBytes  # after the first step
    analytic: memory.MemoryBytes
    calls: dict[str, int] | None  # collectives of the first step by kind; None: not counted
    bytes: dict[str, int] | None
    param_diff: float | None  # max |final parameter - ZeRO-0's|; None: not compared


def _argv(a: argparse.Namespace, dp: int, stage: int, depth: int, bf16: bool) -> list[str]:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
            "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
            "--micro-batch-size", str(a.micro_batch),
            "--global-batch-size", str(a.micro_batch * a.micro_batches * dp),
            "--train-iters", str(a.warmup + a.steps), "--lr", "1e-4",
            "--lr-decay-style", "constant", "--weight-decay", "0.1", "--clip-grad", "1.0",
            "--mock-data", "--vocab-size", str(a.vocab), "--hidden-dropout", "0",
            "--attention-dropout", "0", "--zero-stage", str(stage),
            "--zero3-prefetch-depth", str(depth), *(["--bf16"] if bf16 else [])]


class M3dRun:
    """The real trainer and one step of it, as ``Trainer._step`` runs it."""

    def __init__(self, a: argparse.Namespace, state: ParallelState, stage: int, depth: int,
                 bf16: bool) -> None:
        cfg = parse_args(_argv(a, state.dp.size, stage, depth, bf16))
        self.trainer: Trainer = build_trainer(cfg, state, torch.device("cpu"))
        self.trainer.model.engine.stage.train()

    def step(self, lr: float, batches: list) -> torch.Tensor:
        t = self.trainer
        return train_step(t.engine, t.optimizer, batches, lr, t.grad_sync, t.dp).loss

    def memory(self, dp: int) -> tuple[memory.MemoryBytes, memory.MemoryBytes]:
        t = self.trainer
        params = list(t.engine.stage.parameters())
        expected = memory.analytic(sum(p.numel() for p in params), params[0].element_size(),
                                   t.cfg.parallel.zero_stage, dp,
                                   memory.live_numel(t.data_parallel))
        return memory.measured(t.optimizer, t.data_parallel), expected

    def final_params(self) -> dict[str, torch.Tensor]:
        """Full values by name, unit by unit through ``materialize`` (ZeRO-3 keeps none)."""
        name_of = {id(p): n for n, p in self.trainer.model.engine.stage.named_parameters()}
        values: dict[str, torch.Tensor] = {}

        def read(params: list[nn.Parameter]) -> None:
            values.update({name_of[id(p)]: p.detach().clone() for p in params})

        self.trainer.model.data_parallel.materialize(read)
        return values


class TorchRun:
    """DDP around ``build_gpt``'s model with AdamW, or with ZeroRedundancyOptimizer(AdamW)."""

    def __init__(self, cfg: TrainConfig, zero: bool) -> None:
        model = plain_gpt(cfg)
        opt = cfg.optimizer
        groups = [{"params": [p for p in model.parameters() if not get_meta(p).no_weight_decay],
                   "weight_decay": opt.weight_decay},
                  {"params": [p for p in model.parameters() if get_meta(p).no_weight_decay],
                   "weight_decay": 0.0}]
        self.ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
        kwargs = {"lr": opt.lr, "betas": (opt.adam_beta1, opt.adam_beta2), "eps": opt.adam_eps,
                  "foreach": True}  # what megatron3d's AdamW uses on CPU
        self.zero = zero
        self.opt = (ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW,
                                            **kwargs) if zero else
                    torch.optim.AdamW(groups, **kwargs))
        self.clip, self.vocab = opt.clip_grad, cfg.model.vocab_size
        self.num_params = sum(p.numel() for p in model.parameters())

    def step(self, lr: float, batches: list) -> torch.Tensor:
        """Accumulate the mean micro-batch loss's gradients, all-reduce once, clip, step."""
        self.opt.zero_grad(set_to_none=False)  # keep the gradients as bucket views
        total = torch.zeros(())
        for i, b in enumerate(batches):
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last else self.ddp.no_sync():
                logits = self.ddp(b.tokens)[..., :self.vocab]  # [s, b, v]
                loss = F.cross_entropy(logits.float().flatten(0, 1), b.labels.t().flatten())
                (loss / len(batches)).backward()
            total += loss.detach()
        clip_and_step(self.ddp, self.opt, self.clip, lr)
        return total / len(batches)

    def memory(self, dp: int) -> tuple[memory.MemoryBytes, memory.MemoryBytes]:
        """Measured bytes on this rank, and the ideal (ZeRO: optimizer state / DP)."""
        params = list(self.ddp.parameters())
        state = self.opt.optim.state if self.zero else self.opt.state
        moments = sum(t.nbytes for s in state.values() for t in s.values()
                      if torch.is_tensor(t) and t.dim() > 0)
        measured = memory.MemoryBytes(params=sum(p.nbytes for p in params),
                                      grads=sum(p.grad.nbytes for p in params),
                                      optimizer_state=moments)
        return measured, memory.analytic(self.num_params, 4, int(self.zero), dp)


def _build(a: argparse.Namespace, dp: int) -> tuple[dict, Trainer]:
    """Every run by name; the reference trainer gives the config, batches and LR."""
    state = ParallelState.build(1, 1)
    runs: dict[str, object] = {}
    for name, (stage, depth) in M3D_FP32.items():
        runs[name] = M3dRun(a, state, stage, depth, False)
    for name, (stage, depth) in (M3D_BF16 if a.bf16 else {}).items():
        runs[name] = M3dRun(a, state, stage, depth, True)
    ref = runs[REFERENCE].trainer
    runs["torch DDP"] = TorchRun(ref.cfg, zero=False)
    runs["torch ZeRO"] = TorchRun(ref.cfg, zero=True)
    runs["torch FSDP2"] = FsdpRun(ref.cfg, dp)
    return runs, ref


def _plan(a: argparse.Namespace, name: str) -> tuple[int, int]:
    """(warm-up steps, timed steps) of a run; the bf16 runs have their own counts."""
    return (a.bf16_warmup, a.bf16_steps) if name in M3D_BF16 else (a.warmup, a.steps)


def _counter(run: object) -> CommCounter | TorchCounter | None:
    """What counts a run's collectives: megatron3d's observers or the torch.distributed
    patch (FSDP2); DDP's all-reduces come from its C++ reducer, which neither sees."""
    if isinstance(run, M3dRun):
        return CommCounter()
    return TorchCounter() if isinstance(run, FsdpRun) else None


def _counting(run: object, counter: CommCounter | TorchCounter | None
              ) -> contextlib.AbstractContextManager:
    if counter is None:
        return contextlib.nullcontext()
    return counter.counting() if isinstance(counter, TorchCounter) else observing(counter)


def _param_diffs(runs: dict[str, object]) -> dict[str, float]:
    """Max |final parameter - ZeRO-0's| of each fp32 sharded run (same math, same steps)."""
    ref = runs[REFERENCE].final_params()
    diffs = {}
    for name in [*M3D_FP32, "torch FSDP2"]:
        values = ref if name == REFERENCE else runs[name].final_params()
        diffs[name] = max(float((values[n] - ref[n]).abs().max()) for n in ref)
    return diffs


def measure(a: argparse.Namespace, dp: int) -> tuple[str, dict[str, Result]]:
    """One DP rank: build the runs, step them in turn, return times, losses, memory, counts."""
    runs, ref = _build(a, dp)
    order = names(a.bf16)
    gbs = ref.batch_schedule.global_batch_size
    total = max(sum(_plan(a, n)) for n in order)
    batches = [ref.train_batches(i * gbs, gbs) for i in range(total)]
    assert all(bool((b.loss_mask == 1).all()) for step in batches for b in step), \
        "the torch loss is a plain mean: it assumes no masked tokens"
    times: dict[str, list[float]] = {n: [] for n in order}
    losses: dict[str, list[float]] = {n: [] for n in order}
    counters = {n: _counter(runs[n]) for n in order}
    mem = {}
    for i, step_batches in enumerate(batches):
        for name in order[i % len(order):] + order[:i % len(order)]:
            if i >= sum(_plan(a, name)):
                continue
            lr = ref.lr_schedule.lr_at(i * gbs)
            dist.barrier()
            with _counting(runs[name], counters[name] if i == 0 else None):
                start = time.perf_counter()
                loss = runs[name].step(lr, step_batches)
                elapsed = time.perf_counter() - start
            losses[name].append(float(loss))
            if i >= _plan(a, name)[0]:
                times[name].append(elapsed)
        if i == 0:
            mem = {n: runs[n].memory(dp) for n in order}
    diffs = _param_diffs(runs)
    return devices.describe(torch.device("cpu")), {
        n: Result(times[n], losses[n], *mem[n],
                  None if counters[n] is None else dict(counters[n].calls),
                  None if counters[n] is None else dict(counters[n].bytes), diffs.get(n))
        for n in order}
