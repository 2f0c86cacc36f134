"""The package's floors (docs/ARCHITECTURE.md §1), checked by parsing every module's imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megatron3d"

# What each part of the package may import from megatron3d (besides itself), floor by floor.
ALLOWED: dict[str, set[str]] = {
    # the ground floor: errors, the config dataclasses, the device, optional kernels, logging
    "errors": set(),
    "config": set(),
    "rendezvous": {"errors"},
    "device": {"rendezvous", "errors"},
    "kernels": set(),
    "log": {"device", "errors"},
    # the parallel machinery: TP (mpu), PP (pipeline), DP and ZeRO (zero), precision (optim)
    "mpu": {"device", "errors"},
    # context parallelism: which tokens a rank holds, attention over a split sequence
    "cp": {"mpu", "device", "errors"},
    "pipeline": {"mpu", "config", "device", "errors"},
    "optim": {"mpu", "config", "kernels", "device", "errors"},
    # ZeRO-3 plans its gathers from the pipeline program (pure instruction lists).
    "zero": {"mpu", "pipeline", "config", "device", "errors"},
    "model": {"mpu", "cp", "pipeline", "config", "kernels", "device", "errors"},
    "data": {"cp", "config", "device", "errors", "log"},
    # the native format and a run's save/load: no model, data or pipeline code (cli: the
    # saved flags of --use-checkpoint-args are checked as flags)
    "checkpoint": {"mpu", "optim", "zero", "cli", "config", "device", "errors", "log"},
    # what a layout costs (memory, activations, FLOPs, model size): start-up checks, the log
    # line and the planner share it
    "accounting": {"mpu", "cp", "pipeline", "optim", "zero", "model", "config", "device", "errors"},
    # stalls and rank failures: the watchdog, flight recorder, hang dumps and reports
    "resilience": {"mpu", "pipeline", "config", "device", "log", "errors"},
    # validation asks the owners of rules: the rank grid, the batch and learning-rate
    # schedules, the data split and tokenizer, the pipeline schedules and the partitioner (on
    # the model's layer list).
    "validation": {"config", "cp", "errors", "data", "mpu", "optim", "pipeline", "model",
                   "resilience", "zero"},
    # the command line: Megatron's flags (compat), argparse and YAML (arguments), the tools'
    # shared front end (common)
    "cli": {"config", "errors"},
    # one process over a whole checkpoint: consolidation, relayout, Hugging Face and
    # Megatron-Core conversion (which reads Megatron's arguments through cli)
    "convert": {"checkpoint", "cp", "model", "pipeline", "mpu", "data", "cli", "config", "errors",
                "log"},
    "inference": {"convert", "data", "config", "errors"},
    # the run: builds everything below and trains it
    "training": {"mpu", "cp", "pipeline", "optim", "zero", "model", "data", "checkpoint",
                 "accounting", "config", "device", "kernels", "errors", "log"},
    # the topology planner judges layouts with validation and the run's own accounting, so
    # its numbers are the start-up check's
    "planner": {"accounting", "cp", "validation", "optim", "pipeline", "model", "mpu", "config",
                "errors"},
    # the command-line tools (tools/*.py and the console scripts run them): entry points, like
    # pretrain_gpt.py
    "tools": {"training", "cp", "planner", "inference", "convert", "resilience", "accounting",
              "checkpoint", "data", "optim", "mpu", "cli", "config", "errors", "log"},
}


def _part(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def _imported_parts(path: Path) -> set[str]:
    parts = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "megatron3d":
            names = [f"megatron3d.{a.name}" for a in node.names]  # from megatron3d import log
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            bits = name.split(".")
            if bits[0] == "megatron3d" and len(bits) > 1:
                parts.add(bits[1])
    return parts


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_respect_layers(path):
    part = _part(path)
    assert part in ALLOWED, f"new part {part!r}: add its layer to ALLOWED"
    illegal = _imported_parts(path) - ALLOWED[part] - {part}
    assert not illegal, f"{path.name} ({part}) imports {sorted(illegal)}"


def test_only_entry_points_import_training():
    """The run is the top floor: only entry points (pretrain_gpt.py, the tools) import it."""
    assert [part for part, allowed in ALLOWED.items() if "training" in allowed] == ["tools"]


def test_no_module_over_400_lines():
    long = [str(p) for p in PACKAGE.rglob("*.py") if len(p.read_text().splitlines()) > 400]
    assert not long


def test_cuda_is_only_mentioned_in_device_py():
    offenders = [p.name for p in MODULES if p.name != "device.py"
                 and (".cuda(" in p.read_text() or "torch.cuda." in p.read_text())]
    assert not offenders


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def _imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in modules}
    return found


def test_no_import_cycle():
    """Not even through a lazy import inside a function (data/tokenizer.py and
    data/gpt2_bpe.py once imported each other that way)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: _imported_modules(p, set(paths)) - {m} for m, p in paths.items()}
    done: set[str] = set()

    def visit(module: str, stack: list[str]) -> None:
        if module in stack:
            raise AssertionError(f"import cycle: {' -> '.join(stack[stack.index(module):])} "
                                 f"-> {module}")
        if module not in done:
            for imported in sorted(graph[module]):
                visit(imported, [*stack, module])
            done.add(module)

    for module in sorted(graph):
        visit(module, [])
