"""The command-line tools (``megatron3d/tools/``, run by ``tools/*.py``) as modules, so tests
call their ``main(argv)`` in-process (fast, and the exit code and output are the tool's own)."""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(relative: str) -> ModuleType:
    """The module ``tools/<relative>`` (e.g. ``checkpoint/export_hf.py``) runs."""
    assert (TOOLS / relative).is_file(), f"no tools/{relative}"
    return importlib.import_module(f"megatron3d.tools.{Path(relative).stem}")


@contextlib.contextmanager
def tool_logging() -> Iterator[None]:
    """Drop the root-logger handlers a tool's ``setup_logging`` adds inside: they hold the
    test's captured streams, which are closed once the test ends."""
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        yield
    finally:
        for handler in [h for h in root.handlers if h not in before]:
            root.removeHandler(handler)
