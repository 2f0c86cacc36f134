"""What do ZeRO-1 and ZeRO-3 save per rank, and what do they cost per step, against PyTorch?

For each DP in ``--dp``, DP gloo processes (one thread each, TP = PP = 1) train the same
small GPT on the same batches in these ways, one step of each in turn (the order rotates
every step, so machine noise hits all of them alike):

- megatron3d ZeRO-0, ZeRO-1 and ZeRO-3 with ``--zero3-prefetch-depth`` 0, 1 and 2, fp32
  (``--bf16`` adds ZeRO-0/1 in bf16): the trainer ``build_trainer`` makes, stepped by
  ``train_step`` exactly as ``Trainer.run`` does (``zero_runs.py``);
- torch DDP + AdamW, DDP + ``ZeroRedundancyOptimizer(AdamW)`` and FSDP2 (``fully_shard`` per
  transformer block and on the root, ``zero_fsdp.py``), fp32: the model from ``build_gpt``
  (identical initial weights), the same weight-decay groups, clipping and loss. FSDP2 is the
  baseline every time ratio is taken against.

Step time: every rank leaves a barrier, runs one step, and takes its wall time; a step's time
is the slowest rank's, and the table shows the median over the timed steps. Memory per rank
after the first step (Adam's moments exist then): megatron3d from ``training.memory.measured``
(ZeRO-3's includes its preallocated slot buffers), torch from the tensors themselves (FSDP2:
the local shards; its all-gather buffers are allocated per use and not counted). Collectives
per step: those of the first step, by kind; megatron3d through ``mpu.traffic`` observers,
FSDP2 by wrapping torch.distributed's entry points for that step; DDP's come from its C++
reducer, which neither sees (n/a).

Sanity (asserted): megatron3d ZeRO-0, ZeRO-1 and ZeRO-3 (fp32) give the same losses on every
step within the suite's fp32 rtol; the torch losses and everyone's final parameters (read through
``materialize`` / ``full_tensor``) are printed against ZeRO-0's.

``--limit-gbit R`` also runs everything again inside a network namespace whose loopback is a
token bucket of R Gbit/s shared by all ranks (``netns.py``; needs root): the benchmark
re-executes itself there with ``GLOO_SOCKET_IFNAME=lo`` and a file:// rendezvous, and deletes
the namespace at the end. That is where prefetching gathers can hide transfer time.

Everything runs on the CPU with gloo: the DP processes share a few cores, so the timings are
indicative only; byte counts and memory do not depend on the machine.

    python -m benchmarks.zero
    python -m benchmarks.zero --limit-gbit 2
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import netns
from benchmarks.common import add_model_args, spawn
from benchmarks.zero_runs import (
    BASELINE,
    M3D_BF16,
    M3D_FP32,
    REFERENCE,
    TORCH,
    Result,
    measure,
    names,
)

FP32_RTOL, FP32_ATOL = 1e-5, 1e-6
"""docs/ARCHITECTURE.md §5: fp32 runs that only reorder reductions agree within rtol 1e-5."""
TARGET_VS_FSDP2, TARGET_VS_ZERO1 = 0.8, 1.15
KINDS = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC"}
Measured = dict[int, tuple[str, list[dict[str, Result]]]]  # dp -> (machine, per rank)


def _step_ms(per_rank: list[dict[str, Result]], name: str) -> float:
    """Median over the timed steps of the slowest rank's time, in ms."""
    steps = zip(*(rank[name].times for rank in per_rank), strict=True)
    return statistics.median(max(ranks) for ranks in steps) * 1e3


def _max_rank(per_rank: list[dict[str, Result]], name: str) -> tuple[int, int, int]:
    """(params, grads, optimizer state) bytes of the rank holding the most in total."""
    m = max((r[name].measured for r in per_rank),
            key=lambda x: x.params + x.grads + x.optimizer_state)
    return m.params, m.grads, m.optimizer_state


def _comm(result: Result) -> str:
    if result.calls is None:
        return "n/a (DDP's C++ reducer)"
    calls = " ".join(f"{KINDS.get(k, k)} {n}" for k, n in sorted(result.calls.items()))
    return f"{calls}; {sum(result.bytes.values()) / 2 ** 20:.1f} MiB"


def _table(per_rank: list[dict[str, Result]], order: list[str]) -> list[str]:
    base = _step_ms(per_rank, BASELINE)
    lines = [f"  {'run':<16}{'step ms':>9}{'/FSDP2':>8}{'params B':>12}{'grads B':>12}"
             f"{'opt. B':>12}{'total B':>12}{'analytic':>12}  collectives/step (rank 0)"]
    for name in order:
        p, g, o = _max_rank(per_rank, name)
        e = per_rank[0][name].analytic
        ms = _step_ms(per_rank, name)
        lines.append(f"  {name:<16}{ms:>9.1f}{ms / base:>8.3f}{p:>12,}{g:>12,}{o:>12,}"
                     f"{p + g + o:>12,}{e.params + e.grads + e.optimizer_state:>12,}  "
                     f"{_comm(per_rank[0][name])}")
    lines.append("  bytes: the rank holding the most; analytic: accounting/memory.py's formula "
                 "(torch rows: the same formula, FSDP2 as ZeRO-3 without slot buffers)")
    return lines


def _ratios(per_rank: list[dict[str, Result]]) -> list[str]:
    def ratio(num: str, den: str) -> str:
        value = _step_ms(per_rank, num) / _step_ms(per_rank, den)
        return f"  {num + ' / ' + den:<36} time {value:6.3f}"

    def mem(num: str, den: str) -> str:
        return f"{sum(_max_rank(per_rank, num)) / sum(_max_rank(per_rank, den)):.3f}"

    zero3 = [n for n in M3D_FP32 if "ZeRO-3" in n]
    return ["  ratios (median step times):",
            *(ratio(n, BASELINE) + f" (target <= {TARGET_VS_FSDP2})" for n in zero3),
            *(ratio(n, "m3d ZeRO-1") + f" (target <= {TARGET_VS_ZERO1}, unlimited)"
              for n in zero3),
            *(ratio(n, "m3d ZeRO-3 pf0") + " (prefetch: < 1 hides transfers)"
              for n in zero3[1:]),
            ratio("m3d ZeRO-1", "torch ZeRO"), ratio("m3d ZeRO-0", "torch DDP"),
            f"  memory (params+grads+opt., largest rank): ZeRO-1/ZeRO-0 "
            f"{mem('m3d ZeRO-1', REFERENCE)}, ZeRO-3 pf1/ZeRO-0 "
            f"{mem('m3d ZeRO-3 pf1', REFERENCE)}, ZeRO-3 pf1/FSDP2 "
            f"{mem('m3d ZeRO-3 pf1', BASELINE)}"]


def _loss_check(per_rank: list[dict[str, Result]], order: list[str]) -> list[str]:
    """Assert megatron3d's fp32 runs agree; show how close bf16, torch and parameters are."""
    ref = per_rank[0][REFERENCE].losses

    def worst(other: list[float]) -> float:
        return max(abs(x - y) / abs(x) for x, y in zip(ref, other, strict=False))

    lines = [f"  losses, {REFERENCE}, steps 1..{len(ref)}: "
             + ", ".join(f"{x:.6f}" for x in ref)]
    disagree = []
    for name in order[1:]:
        other = per_rank[0][name].losses
        if name in TORCH:  # this rank's loss: average over the DP ranks as megatron3d does
            other = [statistics.fmean(r[name].losses[j] for r in per_rank)
                     for j in range(len(other))]
        text = f"  {name:<16} vs {REFERENCE}: max rel. loss diff {worst(other):.2e}"
        if name in M3D_FP32:
            close = all(abs(x - y) <= FP32_ATOL + FP32_RTOL * abs(x)
                        for x, y in zip(ref, other, strict=True))
            text += f", within rtol {FP32_RTOL:g}: {'yes' if close else 'NO'}"
            disagree += [] if close else [name]
        diff = per_rank[0][name].param_diff
        lines.append(text + ("" if diff is None else f"; final params max abs diff {diff:.1e}"))
    assert not disagree, f"megatron3d fp32 runs disagree with {REFERENCE}: {disagree}"
    return lines


def _measure_all(a: argparse.Namespace) -> Measured:
    out: Measured = {}
    for dp in a.dp:
        replies = spawn(measure, dp, a, dp, timeout_s=a.timeout)
        out[dp] = (replies[0][0], [r for _, r in replies])
    return out


def _limited(a: argparse.Namespace) -> tuple[Measured, str]:
    """Re-run this benchmark's measurements inside a rate-limited namespace."""
    with tempfile.TemporaryDirectory(prefix="m3d_zero_") as tmp, \
            netns.limited_namespace(a.limit_gbit) as name:
        path = Path(tmp) / "results.pkl"
        netns.run_inside(name, [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:],
                                "--results", str(path)], a.timeout * len(a.dp))
        stats = netns.qdisc_stats(name)
        with path.open("rb") as f:
            return pickle.load(f), stats


def _report(title: str, measured: Measured, order: list[str]) -> list[str]:
    lines = [f"== {title} =="]
    for dp, (_, per_rank) in measured.items():
        lines += [f"DP={dp} (world size {dp}, TP=PP=1):", *_table(per_rank, order),
                  *_ratios(per_rank), *_loss_check(per_rank, order)]
    return lines


def _targets(modes: dict[str, Measured]) -> list[str]:
    """Each target of the ZeRO-3 work, met or not, per mode and DP."""
    lines = ["== targets (ZeRO-3 at the default prefetch depth 1; best depth in brackets) =="]
    for mode, measured in modes.items():
        for dp, (_, per_rank) in measured.items():
            ms = {n: _step_ms(per_rank, n) for n in per_rank[0]}
            zero3 = {n: ms[n] for n in M3D_FP32 if "ZeRO-3" in n}
            best = min(zero3, key=zero3.__getitem__)
            vs_fsdp, vs_best = ms["m3d ZeRO-3 pf1"] / ms[BASELINE], zero3[best] / ms[BASELINE]
            checks = [f"ZeRO-3/FSDP2 {vs_fsdp:.3f} ({best.split()[-1]} {vs_best:.3f}) "
                      f"<= {TARGET_VS_FSDP2}: {'met' if vs_fsdp <= TARGET_VS_FSDP2 else 'MISSED'}"]
            if mode == "unlimited":
                vs1 = ms["m3d ZeRO-3 pf1"] / ms["m3d ZeRO-1"]
                checks.append(f"ZeRO-3/ZeRO-1 {vs1:.3f} <= {TARGET_VS_ZERO1}: "
                              f"{'met' if vs1 <= TARGET_VS_ZERO1 else 'MISSED'}")
            else:
                gains = [ms[n] / ms["m3d ZeRO-3 pf0"] for n in ("m3d ZeRO-3 pf1",
                                                                  "m3d ZeRO-3 pf2")]
                checks.append("prefetch pf1, pf2 / pf0 " + ", ".join(f"{g:.3f}" for g in gains)
                              + f" < 1: {'met' if max(gains) < 1 else 'MISSED'}")
            lines.append(f"  {mode:<9} DP={dp}: " + " | ".join(checks))
    return lines


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    add_model_args(p)
    p.add_argument("--micro-batches", type=int, default=2, help="per rank per step")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=6, help="timed steps per fp32 run")
    p.add_argument("--bf16", action="store_true", help="add megatron3d ZeRO-0/1 in bf16 (slow "
                   "on a CPU without native bf16 matmuls: only their memory means much there)")
    p.add_argument("--bf16-warmup", type=int, default=0)
    p.add_argument("--bf16-steps", type=int, default=1)
    p.add_argument("--limit-gbit", type=float, default=None,
                   help="also measure in a namespace whose loopback carries this many Gbit/s")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per DP size")
    p.add_argument("--results", type=Path, default=None,
                   help=argparse.SUPPRESS)  # inside the namespace: pickle the measurements
    a = p.parse_args()
    if min(a.steps, a.bf16_steps) < 1 or min(a.warmup, a.bf16_warmup) < 0:
        p.error("--steps and --bf16-steps must be >= 1, the warm-ups >= 0")
    if a.limit_gbit is not None and a.limit_gbit <= 0:
        p.error(f"--limit-gbit must be > 0, got {a.limit_gbit}")
    return a


def main() -> None:
    a = _args()
    if a.results is not None:  # the re-executed copy inside the namespace
        measured = _measure_all(a)
        with a.results.open("wb") as f:
            pickle.dump(measured, f)
        return
    out, start, order = sys.stdout, time.perf_counter(), names(a.bf16)
    out.write(f"model: GPT layers={a.layers} hidden={a.hidden} heads={a.heads} seq={a.seq} "
              f"vocab={a.vocab} dropout 0, tied embeddings; micro-batch {a.micro_batch} x "
              f"{a.micro_batches} per rank (global batch {a.micro_batch * a.micro_batches} x "
              f"DP); AdamW lr 1e-4 wd 0.1 clip 1.0\n"
              f"steps: fp32 runs {a.warmup} warm-up + {a.steps} timed"
              + (f", bf16 runs {a.bf16_warmup} + {a.bf16_steps}" if a.bf16 else "")
              + "; the runs take turns step by step (rotating order); step time = slowest "
              "rank, median over timed steps; collectives counted on step 1\n")
    out.flush()
    modes = {"unlimited": _measure_all(a)}
    machine = next(iter(modes["unlimited"].values()))[0]
    out.write(f"machine (each DP rank, gloo on CPU): {machine}; up to {max(a.dp)} processes "
              f"share {os.cpu_count()} cores: CPU gloo timings are indicative only\n")
    out.write("\n".join(_report("unlimited: host loopback", modes["unlimited"], order)) + "\n")
    out.flush()
    if a.limit_gbit is not None:
        modes["limited"], stats = _limited(a)
        out.write("\n".join(_report(f"limited: namespace loopback at {a.limit_gbit:g} Gbit/s "
                                    "(tbf, shared by all ranks)", modes["limited"], order))
                  + f"\n  qdisc at the end: {stats}\n")
    out.write("\n".join(_targets(modes)) + "\n")
    if M3D_BF16.keys() & set(order):
        out.write("bf16 rows: CPU bf16 matmuls without native support dominate their times\n")
    out.write(f"wall time: {time.perf_counter() - start:.1f} s\n")


if __name__ == "__main__":
    main()
