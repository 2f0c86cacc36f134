"""What every fuzz family checks: one ``error:`` line, no traceback, files untouched.

The promise under test (see ``megatron3d/errors.py``): bad input stops with exit code 2 and
exactly one stderr line ``error: ...``, and whatever was on disk before is byte-identical
afterwards. Functions driven directly must raise the right ``Megatron3dError`` subclass with a
one-line message; whole entry points are checked on their exit code and stderr.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import settings

from megatron3d.cli.arguments import field_specs
from megatron3d.config import TrainConfig, flat_fields
from megatron3d.errors import Megatron3dError

PROFILE = "megatron3d-fuzz"  # registered in conftest.py
F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


def fuzz(max_examples: int) -> Callable[[F], F]:
    """The shared profile with this test's example budget."""
    return settings(settings.get_profile(PROFILE), max_examples=max_examples)


def tree_digest(root: Path) -> dict[str, str]:
    """Every path under ``root`` -> a digest of its bytes ("dir" for a directory), so a file
    changed, added, removed or turned into a directory all show as a difference."""
    digest: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            digest[rel] = "link:" + os.readlink(path)
        elif path.is_dir():
            digest[rel] = "dir"
        else:
            digest[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digest


def assert_one_line(message: str) -> None:
    """A user-facing message: non-empty, a single line, no traceback inside."""
    assert message.strip(), "empty error message"
    assert "\n" not in message and "\r" not in message, f"message spans lines: {message!r}"
    assert "Traceback" not in message, message


def attempt(call: Callable[[], T], *allowed: type[Megatron3dError]
            ) -> tuple[T | None, Megatron3dError | None]:
    """``(result, None)``, or ``(None, error)`` when ``call`` raised one of ``allowed`` with a
    one-line message. Any other exception propagates and fails the example (hypothesis then
    prints the input that caused it)."""
    try:
        return call(), None
    except allowed as err:
        assert_one_line(str(err))
        return None, err


def assert_main_refuses(code: int, capsys: pytest.CaptureFixture[str]) -> str:
    """An entry point's exit code 2 and exactly one ``error:`` line on stderr."""
    err = capsys.readouterr().err
    assert code == 2, f"exit code {code}, stderr: {err!r}"
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err, err
    return err


def assert_in_declared_ranges(cfg: TrainConfig) -> None:
    """What an accepted config promises: every float finite, every numeric value inside the
    ``range`` its field declares (``config.py``; fields without one are only finite)."""
    for name, value in flat_fields(cfg).items():
        spec = field_specs()[name]
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, float):
                assert math.isfinite(item), f"{spec.flag} accepted non-finite {item}"
            if spec.bounds is not None and isinstance(item, int | float):
                assert item in spec.bounds, f"{spec.flag} accepted {item}, outside {spec.bounds}"


class Labelled:
    """File contents with a short description, which is what hypothesis prints for a failing
    example (the bytes of a damaged checkpoint would run to megabytes)."""

    def __init__(self, label: str, data: bytes) -> None:
        self.label, self.data = label, data

    def __repr__(self) -> str:
        return self.label
