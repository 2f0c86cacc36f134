"""A Trainer is built whole by ``build_trainer`` and never changed afterwards: its parts are
frozen, and nothing in the repository (package, entry points, tools, tests, benchmarks)
assigns to an attribute of a trainer after construction."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from megatron3d.training.build import Overrides
from megatron3d.training.loop import Hooks, ModelParts, RunData, Trainer

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for folder in ("megatron3d", "tests", "benchmarks", "tools")
                 for p in (ROOT / folder).rglob("*.py")) + [ROOT / "pretrain_gpt.py"]


def _names_a_trainer(node: ast.expr) -> bool:
    """``trainer``, ``Trainer``, ``self.trainer``, ``x.trainer``: any name ending in it."""
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
    return name.lower().endswith("trainer")


def _assignments_to_a_trainer(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("setattr", "delattr") and node.args):
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        lines += [node.lineno for t in targets
                  if isinstance(t, ast.Attribute) and _names_a_trainer(t.value)]
    return lines


def test_nothing_assigns_to_a_trainer_attribute():
    found = [f"{path.relative_to(ROOT)}:{line}" for path in SOURCES
             for line in _assignments_to_a_trainer(ast.parse(path.read_text()))]
    assert not found, f"assigned after construction: {found}; pass it to build_trainer"


def test_the_check_sees_an_assignment():
    tree = ast.parse("trainer.on_step = f\nself.trainer.save = g\nsetattr(trainer, 'x', 1)\n"
                     "Trainer._step = h\nx = trainer.progress\ntrainer.run()\n")
    assert sorted(_assignments_to_a_trainer(tree)) == [1, 2, 3, 4]


@pytest.mark.parametrize("part", [Trainer, ModelParts, RunData, Hooks, Overrides])
def test_the_parts_are_frozen(part):
    assert dataclasses.is_dataclass(part) and part.__dataclass_params__.frozen
