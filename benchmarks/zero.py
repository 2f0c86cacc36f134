"""What does ZeRO-1 save per rank, and what does it cost per step, against ZeRO-0 and PyTorch?

For each DP in ``--dp``, DP gloo processes (one thread each, TP = PP = 1) train the same
small GPT on the same batches in six ways, one step of each in turn (the order rotates every
step, so machine noise hits all of them alike):

- megatron3d ZeRO-0 and ZeRO-1 (``--zero-stage 0|1``), fp32 and ``--bf16``: the trainer
  ``build_trainer`` makes, stepped by ``train_step`` exactly as ``Trainer.run`` does;
- torch DDP + ``ZeroRedundancyOptimizer(AdamW)`` and plain torch DDP + AdamW, fp32: the model
  from ``build_gpt`` (identical initial weights: init depends only on seed and names), the
  same two weight-decay groups (from the parameters' metadata, which ZeroRedundancyOptimizer
  accepts as param groups), ``no_sync()`` on all but the last micro-batch,
  ``clip_grad_norm_``, ``F.cross_entropy`` on the logits, ``gradient_as_bucket_view=True``
  so the gradients live in DDP's buckets as ours live in one flat buffer.

Step time: every rank leaves a barrier, runs one step, and takes its wall time; a step's time
is the slowest rank's, and the table shows the median over the timed steps. Memory per rank
after the first step (Adam's moments exist then): megatron3d from
``training.memory.measured`` next to ``memory.analytic``; torch from the tensors themselves
(optimizer state = the state tensors of this rank's optimizer, the scalar step counts left
out as megatron3d leaves them out). ZeroRedundancyOptimizer shards whole parameters
(greedily by size), megatron3d shards flat buckets evenly, so the largest rank is shown.

Sanity: megatron3d ZeRO-0 and ZeRO-1 in fp32 must give the same losses on the timed steps
(asserted: reduce-scatter + sharded norm reorder sums, so within DESIGN's fp32 rtol; whether
they are bitwise equal is printed); the torch losses are printed next to them (same math).

The torch baseline runs in fp32 only: a bf16 DDP model with a bf16 AdamW would not be the
same recipe as fp32 master weights and fp32 gradient reduction, so the bf16 rows compare
megatron3d with itself. A CPU without native bf16 matmuls (AVX512-BF16/AMX) runs them tens of
times slower than fp32 (the header measures by how much), so by default each bf16 run takes
one step: enough for its memory after the first step and an indicative time; on a CPU with
native bf16 ask for more with ``--bf16-warmup 2 --bf16-steps 6``.

Everything runs on the CPU with gloo: the DP processes share a few cores, and gloo's
reduce-scatter and all-gather are much slower than its ring all-reduce at DP >= 4 (NCCL's
are not), which ZeRO-1 pays and torch's ZeRO (all-reduce + broadcast) does not. The timings
are indicative only; the byte counts do not depend on the machine.

    python benchmarks/zero.py
    python benchmarks/zero.py --dp 2 4 8 --steps 10 --hidden 512
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import add_model_args, spawn  # noqa: E402
from megatron3d import device as devices  # noqa: E402
from megatron3d.arguments import parse_args  # noqa: E402
from megatron3d.config import TrainConfig  # noqa: E402
from megatron3d.model.context import LayerContext  # noqa: E402
from megatron3d.model.gpt import build_gpt  # noqa: E402
from megatron3d.mpu.meta import get_meta  # noqa: E402
from megatron3d.mpu.state import AxisGroup, ParallelState  # noqa: E402
from megatron3d.training import memory  # noqa: E402
from megatron3d.training.build import build_trainer  # noqa: E402
from megatron3d.training.loop import Trainer  # noqa: E402
from megatron3d.training.step import train_step  # noqa: E402
from megatron3d.validation import validate  # noqa: E402

FP32_RTOL, FP32_ATOL = 1e-5, 1e-6
"""DESIGN.md section 3: fp32 runs that only reorder reductions agree within rtol 1e-5."""

M3D = {"m3d ZeRO-0 fp32": (0, False), "m3d ZeRO-1 fp32": (1, False),
       "m3d ZeRO-0 bf16": (0, True), "m3d ZeRO-1 bf16": (1, True)}
TORCH = {"torch DDP fp32": False, "torch ZeRO fp32": True}  # name -> ZeroRedundancyOptimizer
NAMES = [*M3D, *TORCH]


@dataclass(frozen=True)
class Result:
    """One configuration on one rank."""

    times: list[float]  # seconds per timed step, barrier to end of the optimizer step
    losses: list[float]  # per timed step (megatron3d: DP mean; torch: this rank's)
    measured: memory.MemoryBytes  # after the first step
    analytic: memory.MemoryBytes


def _argv(a: argparse.Namespace, dp: int, zero_stage: int, bf16: bool) -> list[str]:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
            "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
            "--micro-batch-size", str(a.micro_batch),
            "--global-batch-size", str(a.micro_batch * a.micro_batches * dp),
            "--train-iters", str(a.warmup + a.steps), "--lr", "1e-4",
            "--lr-decay-style", "constant", "--weight-decay", "0.1", "--clip-grad", "1.0",
            "--mock-data", "--vocab-size", str(a.vocab), "--hidden-dropout", "0",
            "--attention-dropout", "0", "--zero-stage", str(zero_stage),
            *(["--bf16"] if bf16 else [])]


def _megatron(a: argparse.Namespace, state: ParallelState, zero_stage: int,
              bf16: bool) -> tuple[Trainer, Callable[[int, list], torch.Tensor]]:
    """The real trainer and one step of it, as ``Trainer._step`` runs it."""
    cfg = parse_args(_argv(a, state.dp.size, zero_stage, bf16))
    validate(cfg, state.world_size)
    trainer = build_trainer(cfg, state, torch.device("cpu"))
    trainer.engine.stage.train()

    def step(consumed: int, batches: list) -> torch.Tensor:
        lr = trainer.lr_schedule.lr_at(consumed)
        return train_step(trainer.engine, trainer.optimizer, batches, lr, trainer.grad_sync,
                          trainer.dp).loss

    return trainer, step


def _m3d_memory(trainer: Trainer) -> tuple[memory.MemoryBytes, memory.MemoryBytes]:
    params = list(trainer.engine.stage.parameters())
    expected = memory.analytic(sum(p.numel() for p in params), params[0].element_size(),
                               trainer.cfg.parallel.zero_stage, trainer.dp.size)
    return memory.measured(trainer.optimizer), expected


class TorchRun:
    """The PyTorch baseline: DDP around ``build_gpt``'s model, AdamW or ZeRO(AdamW)."""

    def __init__(self, cfg: TrainConfig, zero: bool) -> None:
        ctx = LayerContext(cfg.model, AxisGroup.single(), cfg.training.seed, torch.float32,
                           torch.device("cpu"))
        model = build_gpt(ctx)
        model.train()
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
        torch.nn.utils.clip_grad_norm_(self.ddp.parameters(), self.clip, foreach=True)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
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


def _plan(a: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """(warm-up steps, timed steps) of each run; the bf16 runs have their own counts."""
    return {name: (a.bf16_warmup, a.bf16_steps) if M3D.get(name, (0, False))[1]
            else (a.warmup, a.steps) for name in NAMES}


def _build(a: argparse.Namespace, dp: int) -> tuple[dict, dict, Trainer]:
    """Every run's step function (consumed, batches) -> loss, and its memory reader."""
    state = ParallelState.build(1, 1)
    steps: dict[str, Callable[[int, list], torch.Tensor]] = {}
    readers: dict[str, Callable[[], tuple[memory.MemoryBytes, memory.MemoryBytes]]] = {}
    for name, (zero_stage, bf16) in M3D.items():
        trainer, steps[name] = _megatron(a, state, zero_stage, bf16)
        readers[name] = lambda trainer=trainer: _m3d_memory(trainer)
        if name == NAMES[0]:
            ref = trainer
    for name, zero in TORCH.items():
        run = TorchRun(ref.cfg, zero)
        steps[name] = lambda consumed, batches, run=run: run.step(
            ref.lr_schedule.lr_at(consumed), batches)
        readers[name] = lambda run=run: run.memory(dp)
    return steps, readers, ref


def _measure(a: argparse.Namespace, dp: int) -> tuple[str, dict[str, Result]]:
    """One DP rank: build the six runs, step them in turn, return times, losses, memory."""
    steps, readers, ref = _build(a, dp)
    plan = _plan(a)
    gbs = ref.batch_schedule.global_batch_size
    batches = [ref.train_batches(i * gbs, gbs) for i in range(max(map(sum, plan.values())))]
    assert all(bool((b.loss_mask == 1).all()) for step in batches for b in step), \
        "the torch loss is a plain mean: it assumes no masked tokens"
    times: dict[str, list[float]] = {name: [] for name in NAMES}
    losses: dict[str, list[float]] = {name: [] for name in NAMES}
    mem = {}
    for i, step_batches in enumerate(batches):
        for name in NAMES[i % len(NAMES):] + NAMES[:i % len(NAMES)]:
            if i >= sum(plan[name]):
                continue
            dist.barrier()
            start = time.perf_counter()
            loss = steps[name](i * gbs, step_batches)
            elapsed = time.perf_counter() - start
            losses[name].append(float(loss))
            if i >= plan[name][0]:
                times[name].append(elapsed)
        if i == 0:
            mem = {name: read() for name, read in readers.items()}
    return devices.describe(torch.device("cpu")), {
        name: Result(times[name], losses[name], *mem[name]) for name in NAMES}


def _step_ms(per_rank: list[dict[str, Result]], name: str) -> float:
    """Median over the timed steps of the slowest rank's time, in ms."""
    steps = zip(*(rank[name].times for rank in per_rank), strict=True)
    return statistics.median(max(ranks) for ranks in steps) * 1e3


def _state_bytes(per_rank: list[dict[str, Result]], name: str) -> tuple[int, int]:
    """(min, max) over ranks of the measured optimizer-state bytes."""
    values = [rank[name].measured.optimizer_state for rank in per_rank]
    return min(values), max(values)


def _table(per_rank: list[dict[str, Result]]) -> list[str]:
    mine = per_rank[0]
    lines = [f"  {'run':<17}{'step ms':>9}{'timed':>6}{'params B':>13}{'grads B':>13}"
             f"{'opt. state B (max rank)':>25}{'min rank':>13}{'analytic':>13}"]
    for name in NAMES:
        low, high = _state_bytes(per_rank, name)
        m, e = mine[name].measured, mine[name].analytic
        lines.append(f"  {name:<17}{_step_ms(per_rank, name):>9.1f}{len(mine[name].times):>6}"
                     f"{m.params:>13,}{m.grads:>13,}{high:>25,}{low:>13,}"
                     f"{e.optimizer_state:>13,}")
    lines.append("  analytic (megatron3d memory.analytic) params/grads, rank 0: " + "; ".join(
        f"{n.removeprefix('m3d ')} {mine[n].analytic.params:,}/{mine[n].analytic.grads:,}"
        for n in M3D) + "; torch rows: the same formula with params in fp32 (ideal ZeRO shard)")
    return lines


def _ratio(per_rank: list[dict[str, Result]], num: str, den: str, memory_too: bool,
           theory: str = "") -> str:
    time_ratio = _step_ms(per_rank, num) / _step_ms(per_rank, den)
    text = f"  {num + ' / ' + den:<36} time {time_ratio:6.3f}"
    if memory_too:
        mem_ratio = _state_bytes(per_rank, num)[1] / _state_bytes(per_rank, den)[1]
        text += f" | opt. state (max rank) {mem_ratio:6.3f}"
        text += f" (ideal {theory})" if theory else ""
    return text


def _ratios(per_rank: list[dict[str, Result]], dp: int) -> list[str]:
    ideal = f"1/DP = {1 / dp:.3f}"
    return ["  ratios (median step times; optimizer-state bytes of the largest rank):",
            _ratio(per_rank, "m3d ZeRO-1 fp32", "m3d ZeRO-0 fp32", True, ideal),
            _ratio(per_rank, "m3d ZeRO-1 bf16", "m3d ZeRO-0 bf16", True, ideal),
            _ratio(per_rank, "m3d ZeRO-1 fp32", "torch ZeRO fp32", True, "1.000"),
            _ratio(per_rank, "m3d ZeRO-0 fp32", "torch DDP fp32", False)]


def _loss_check(per_rank: list[dict[str, Result]], warmup: int) -> list[str]:
    """Assert ZeRO-0 == ZeRO-1 (fp32) on the timed steps; show how close the others are."""
    ref = per_rank[0]["m3d ZeRO-0 fp32"].losses
    zero1 = per_rank[0]["m3d ZeRO-1 fp32"].losses

    def worst(other: list[float], first: int = 0) -> float:
        pairs = zip(ref[first:], other[first:], strict=False)  # bf16: its first steps only
        return max(abs(x - y) / abs(x) for x, y in pairs)

    close = all(abs(x - y) <= FP32_ATOL + FP32_RTOL * abs(x)
                for x, y in zip(ref[warmup:], zero1[warmup:], strict=True))
    lines = [f"  losses, m3d ZeRO-0 fp32, timed steps {warmup + 1}..{len(ref)}: "
             + ", ".join(f"{x:.6f}" for x in ref[warmup:]),
             f"  m3d ZeRO-1 fp32 vs ZeRO-0 fp32 (timed steps): max rel. diff "
             f"{worst(zero1, warmup):.2e}, bitwise "
             f"{'yes' if zero1[warmup:] == ref[warmup:] else 'no'}, within rtol {FP32_RTOL:g}:"
             f" {'yes' if close else 'NO'}"]
    for name in ("m3d ZeRO-0 bf16", "m3d ZeRO-1 bf16", *TORCH):
        other = per_rank[0][name].losses
        if name in TORCH:  # this rank's loss: average over the DP ranks as megatron3d does
            other = [statistics.fmean(r[name].losses[j] for r in per_rank)
                     for j in range(len(other))]
        lines.append(f"  {name} vs m3d ZeRO-0 fp32, steps 1..{len(other)}: max rel. diff "
                     f"{worst(other):.2e}")
    assert close, "megatron3d ZeRO-0 and ZeRO-1 (fp32) disagree on the timed steps' losses"
    return lines


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    add_model_args(p)
    p.add_argument("--micro-batches", type=int, default=2, help="per rank per step")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="timed steps per run")
    p.add_argument("--bf16-warmup", type=int, default=0)
    p.add_argument("--bf16-steps", type=int, default=1,
                   help="timed steps of the bf16 runs (CPU bf16 matmuls are slow: see above)")
    a = p.parse_args()
    if min(a.steps, a.bf16_steps) < 1 or min(a.warmup, a.bf16_warmup) < 0:
        p.error("--steps and --bf16-steps must be >= 1, the warm-ups >= 0")
    return a


def _matmul_ms(dtype: torch.dtype, m: int, k: int, n: int, repeats: int = 3) -> float:
    """Median time of one [m, k] @ [k, n] matmul in ``dtype`` on this process's threads."""
    x, w = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    torch.mm(x, w)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(x, w)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _bf16_note(a: argparse.Namespace) -> str:
    """How much slower bf16 matmuls are than fp32 here (an MLP-sized one, 1 thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    shape = (a.micro_batch * a.seq, a.hidden, 4 * a.hidden)
    fp32, bf16 = (_matmul_ms(dt, *shape) for dt in (torch.float32, torch.bfloat16))
    torch.set_num_threads(threads)
    return (f"bf16 vs fp32 matmul here ([{shape[0]}, {shape[1]}] @ [{shape[1]}, {shape[2]}], "
            f"1 thread): {bf16:.1f} ms vs {fp32:.1f} ms = {bf16 / fp32:.1f}x; a CPU without "
            "native bf16 dominates the bf16 step times, which say nothing about ZeRO there")


def main() -> None:
    a = _args()
    out, start = sys.stdout, time.perf_counter()
    out.write(f"model: GPT layers={a.layers} hidden={a.hidden} heads={a.heads} seq={a.seq} "
              f"vocab={a.vocab} dropout 0, tied embeddings; micro-batch {a.micro_batch} x "
              f"{a.micro_batches} per rank (global batch {a.micro_batch * a.micro_batches} x "
              f"DP); AdamW lr 1e-4 wd 0.1 clip 1.0\n"
              f"steps: fp32 runs {a.warmup} warm-up + {a.steps} timed, bf16 runs "
              f"{a.bf16_warmup} warm-up + {a.bf16_steps} timed; the runs take turns step by "
              "step (rotating order); step time = slowest rank, median over timed steps\n"
              f"{_bf16_note(a)}\n")
    for dp in a.dp:
        replies = spawn(_measure, dp, a, dp, timeout_s=900.0)
        per_rank = [r for _, r in replies]
        if dp == a.dp[0]:
            out.write(f"machine (each DP rank, gloo on CPU): {replies[0][0]}; up to "
                      f"{max(a.dp)} processes share {os.cpu_count()} cores: CPU gloo timings "
                      "are indicative only\n")
        out.write(f"DP={dp} (world size {dp}, TP=PP=1):\n")
        lines = _table(per_rank) + _ratios(per_rank, dp) + _loss_check(per_rank, a.warmup)
        out.write("\n".join(lines) + "\n")
        out.flush()
    out.write(f"wall time: {time.perf_counter() - start:.1f} s\n")


if __name__ == "__main__":
    main()
