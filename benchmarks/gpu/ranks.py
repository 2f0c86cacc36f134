"""Several ranks on the GPU(s) train the model the single-GPU run trains, in fp32.

With fewer GPUs than ranks the ranks share them round robin over gloo (which carries CUDA
tensors: all-reduce and broadcast on the device, the rest built from those or staged through
host memory by ``mpu/comm.py``); with a GPU per rank they use NCCL. Each layout is compared
with the single-GPU run as the CPU suite compares layouts (``tests/helpers``: losses, grad
norms, every final parameter and the validation loss, fp32 rtol 1e-5).
"""

from __future__ import annotations

import os

from benchmarks.gpu.sections import Context, SectionResult
from megatron3d import device as devices
from tests.helpers.device import ENV
from tests.helpers.dist import run_distributed
from tests.helpers.runs import assert_same_run, merge_ranks, train, train_single
from tests.helpers.tiny import train_argv
from tests.helpers.tolerances import EQUIVALENCE_FLAGS, FP32

UNIFORM = ("--pp-partition-method", "uniform")
LAYOUTS: dict[str, tuple[int, tuple[str, ...]]] = {  # (TP, PP, DP) -> world, flags
    "(2, 1, 1)": (2, ("--tensor-model-parallel-size", "2")),
    "(1, 2, 1)": (2, ("--pipeline-model-parallel-size", "2", *UNIFORM)),
    "(1, 1, 2) ZeRO-1": (2, ("--zero-stage", "1")),
    "(1, 1, 2) ZeRO-3": (2, ("--zero-stage", "3")),
    "(2, 2, 1) interleaved, v=2": (4, ("--tensor-model-parallel-size", "2",
                                       "--pipeline-model-parallel-size", "2", *UNIFORM,
                                       "--virtual-pipeline-model-parallel-size", "2")),
}


CPU_WORLDS = (2,)  # --cpu: one spawn (CI's 2 cores); the CPU suite runs the others


def argv(cpu: bool, *layout: str) -> list[str]:
    """4 layers (interleaving needs PP x v of them), wider on the GPU."""
    steps, width = (3, "32") if cpu else (6, "64")
    return train_argv("gpt2", steps, *EQUIVALENCE_FLAGS, "--num-layers", "4", "--hidden-size",
                      width, "--seq-length", "32", *layout)


def _train_each(argvs: list[list[str]]) -> list:
    """One rank: every layout of its world size in turn (one spawn for all of them)."""
    return [train(a) for a in argvs]


def _difference(actual, expected) -> float:
    """The largest relative difference of the losses (for the report; the check is
    ``assert_same_run``'s)."""
    return max(abs(a - e) / max(abs(e), 1e-12)
               for a, e in zip(actual.losses, expected.losses, strict=True))


def run(ctx: Context) -> SectionResult:
    device = ctx.device()
    os.environ[ENV] = device.type  # before the first spawn: the ranks' device switch
    reference = train_single(argv(ctx.cpu))
    rows, data = [], {}
    worlds = sorted({w for w, _ in LAYOUTS.values()})
    for world in [w for w in worlds if w in CPU_WORLDS] if ctx.cpu else worlds:
        names = [n for n, (w, _) in LAYOUTS.items() if w == world]
        gpus = devices.gpu_count() if device.type == "cuda" else 0
        backend = "nccl" if gpus >= world else "gloo"
        per_rank = run_distributed(_train_each, world, [argv(ctx.cpu, *LAYOUTS[n][1])
                                                        for n in names],
                                   backend=backend, timeout_s=300)
        for index, name in enumerate(names):
            merged = merge_ranks([results[index] for results in per_rank])
            try:
                assert_same_run(merged, reference, FP32)
                verdict = "equal"
            except AssertionError as err:
                verdict = "DIFFERENT: " + " ".join(str(err).split())[:300]
            data[name] = {"world": world, "backend": backend, "verdict": verdict,
                          "max_loss_rel_diff": _difference(merged, reference)}
            rows.append(f"| {name} | {world} | {backend} | {verdict} | "
                        f"{data[name]['max_loss_rel_diff']:.1e} |")
    table = ["| (TP, PP, DP) | ranks | backend | against the single-device run (fp32, "
             f"rtol {FP32['rtol']}) | max rel. loss diff |", "| --- | --- | --- | --- | --- |",
             *rows]
    skipped = [n for n in LAYOUTS if n not in data]
    if skipped:
        table.append(f"\n--cpu: {', '.join(skipped)} only on the GPU (the CPU suite runs them)")
    all_equal = all(d["verdict"] == "equal" for d in data.values())
    data["all_equal"] = all_equal
    summary = (f"Device {device}, {len(reference.losses)} steps; reference losses "
               f"{', '.join(f'{x:.4f}' for x in reference.losses)}.")
    different = [n for n, d in data.items() if isinstance(d, dict) and d["verdict"] != "equal"]
    verdict = ("all equal" if all_equal else f"DIFFERENT: {', '.join(different)}")
    return SectionResult("\n".join([summary, "", *table]), data, verdict=verdict)
