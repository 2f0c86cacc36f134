"""Single-GPU bf16 training speed: megatron3d against a plain PyTorch loop on the same shape,
weights and batches (transformers' GPT-2 with SDPA attention, bf16 autocast, fused AdamW;
eager and under ``torch.compile``), as TFLOP/s and MFU against the device's peak.

Targets (findings, not failures): megatron3d at least as fast as the eager loop, and MFU of
45% or more on an H100. The first step's losses must agree (the same model and batches).
"""

from __future__ import annotations

import gc
import time
import traceback

import torch

from benchmarks.gpu import hf_loop, single
from benchmarks.gpu.sections import Context, SectionResult
from megatron3d import device as devices
from megatron3d.accounting.flops import flops_per_iteration
from megatron3d.config import ModelConfig
from megatron3d.data.mock import MockGPTDataset

MFU_TARGET = 45.0


def megatron3d(shape: single.Shape, dev: torch.device, warmup: int, steps: int,
               *extra: str) -> tuple[hf_loop.Timed, dict[str, torch.Tensor], ModelConfig]:
    """megatron3d's run (``extra`` flags added) timed after ``warmup`` steps; its initial
    weights; its model."""
    losses: list[torch.Tensor] = []
    marks: dict[str, float] = {}

    def on_step(iteration: int, result) -> None:
        losses.append(result.loss)
        if iteration == warmup:
            devices.synchronize(dev)
            marks["start"] = time.perf_counter()

    with single.process_group():
        trainer, state = single.build(single.argv(shape, warmup + steps, *extra), dev,
                                      on_step)
        weights = single.host_weights(trainer, state)
        built = time.perf_counter()
        trainer.run()
        devices.synchronize(dev)
        end = time.perf_counter()
        model = trainer.cfg.model
    timed = hf_loop.Timed((end - marks["start"]) / steps, [x.item() for x in losses],
                          marks["start"] - built)
    return timed, weights, model


def _row(name: str, timed: hf_loop.Timed, flops: int, shape: single.Shape,
         peak: float | None) -> dict:
    tflops = flops / timed.step_s / 1e12
    return {"run": name, "step_s": timed.step_s, "warmup_s": timed.warmup_s,
            "tokens_per_s": shape.global_batch * shape.seq / timed.step_s, "tflops": tflops,
            "mfu_percent": None if peak is None else 100 * tflops / peak,
            "losses": timed.losses}


def _baselines(ctx: Context, model: ModelConfig, weights: dict[str, torch.Tensor],
               shape: single.Shape, warmup: int, steps: int) -> dict[str, hf_loop.Timed | str]:
    """The eager and compiled loops' timings, or each one's traceback."""
    dev = ctx.device()
    mock = MockGPTDataset(shape.vocab, shape.seq, single.SEED)
    batches = [mock.samples(i * shape.global_batch, shape.global_batch)
               for i in range(warmup + steps)]
    optim = hf_loop.Optim(single.LR, single.WEIGHT_DECAY, single.CLIP)
    found: dict[str, hf_loop.Timed | str] = {}
    for name, backend in (("PyTorch loop, eager", None),
                          ("PyTorch loop, torch.compile", "eager" if ctx.cpu else "inductor")):
        gc.collect()  # the previous run's model and optimizer back to the allocator
        try:
            hf = hf_loop.gpt2(model, weights, dev, backend)
            found[name] = hf_loop.train(hf, batches, shape.micro_batch, warmup, optim, dev)
        except Exception:  # one loop failing leaves the others' numbers
            found[name] = traceback.format_exc()
        hf = None
    return found


def run(ctx: Context) -> SectionResult:
    dev = ctx.device()
    shape, warmup, steps = (single.TINY, 1, 2) if ctx.cpu else (single.GPT_1_3B, 2, 5)
    peak = devices.peak_tflops(dev)
    ours, weights, model = megatron3d(shape, dev, warmup, steps)
    ours_flops = flops_per_iteration(model, shape.global_batch, model.padded_vocab_size(1))
    rows = [_row("megatron3d", ours, ours_flops.model, shape, peak)]
    theirs_flops = flops_per_iteration(model, shape.global_batch, model.vocab_size).model
    errors = {}
    for name, timed in _baselines(ctx, model, weights, shape, warmup, steps).items():
        if isinstance(timed, str):
            errors[name] = timed
        else:
            rows.append(_row(name, timed, theirs_flops, shape, peak))
    return SectionResult(_markdown(rows, errors, shape, dev, peak, warmup, ctx.cpu),
                         {"shape": shape.describe(), "device": devices.describe(dev),
                          "peak_tflops": peak, "rows": rows, "errors": errors,
                          "compile": "each transformer block, backend "
                          + ("eager (--cpu)" if ctx.cpu else "inductor")},
                         verdict=_verdict(rows))


def _verdict(rows: list[dict]) -> str:
    """megatron3d's MFU (or TFLOP/s) and its speed against each loop."""
    ours = rows[0]
    rate = (f"{ours['tflops']:.1f} TFLOP/s" if ours["mfu_percent"] is None
            else f"MFU {ours['mfu_percent']:.1f}% (target {MFU_TARGET:.0f}%)")
    against = [f"{r['step_s'] / ours['step_s']:.2f}x {r['run'].removeprefix('PyTorch loop, ')}"
               for r in rows[1:]]
    return "; ".join([rate, *against])


def _mfu(row: dict) -> str:
    return "n/a" if row["mfu_percent"] is None else f"{row['mfu_percent']:.1f}%"


def _markdown(rows: list[dict], errors: dict[str, str], shape: single.Shape,
              dev: torch.device, peak: float | None, warmup: int, cpu: bool) -> str:
    lines = [f"{devices.describe(dev)}; bf16; {shape.describe()}; {warmup} warm-up steps, "
             f"then timed; peak {peak or 'unknown'} TFLOP/s.", "",
             "| run | s/step | tokens/s | TFLOP/s | MFU | loss: first, last | warm-up s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['run']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
              f"{r['tflops']:.1f} | {_mfu(r)} | {r['losses'][0]:.4f}, {r['losses'][-1]:.4f} | "
              f"{r['warmup_s']:.1f} |" for r in rows]
    ours = rows[0]
    lines.append("")
    for r in rows[1:]:
        lines.append(f"- megatron3d / {r['run']}: {r['step_s'] / ours['step_s']:.2f}x the "
                     f"speed; first losses differ by {abs(r['losses'][0] - ours['losses'][0]):.4f}")
    eager = next((r for r in rows if r["run"] == "PyTorch loop, eager"), None)
    if eager is not None:
        lines.append(f"- target, at least the eager loop: "
                     f"{'met' if ours['step_s'] <= eager['step_s'] else 'MISSED'}")
    if ours["mfu_percent"] is not None:
        lines.append(f"- target, MFU >= {MFU_TARGET:.0f}% (H100): "
                     f"{'met' if ours['mfu_percent'] >= MFU_TARGET else 'MISSED'} "
                     f"({ours['mfu_percent']:.1f}%)")
    if cpu:
        lines.append("- --cpu: the numbers only show that the section runs; no targets apply")
    for name, text in errors.items():
        lines += ["", f"{name} failed:", "", "```", text.rstrip(), "```"]
    return "\n".join(lines)
