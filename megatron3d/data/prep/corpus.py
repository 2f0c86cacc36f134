"""A text corpus that exists on every machine: the Python standard library's own sources.

The quickstart needs real text without a download. The ``.py`` files under
``sysconfig.get_paths()["stdlib"]`` are plenty (tens of MB), and Python code is a fine
language-modelling target for a tiny model. Test suites and site-packages are left out.

Files are taken in an order shuffled with a fixed seed: Megatron's ``--split`` cuts the
document sequence into consecutive train/valid/test parts, and in path order the validation
part would be one package (``encodings/cp8xx.py`` code-page tables) whose loss says nothing
about the rest. The same seed gives the same corpus on every run of one Python version.
"""

from __future__ import annotations

import json
import os
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3",
              "__pycache__"}
DEFAULT_SEED = 1234


def stdlib_documents(max_bytes: int | None = None,
                     seed: int = DEFAULT_SEED) -> Iterator[dict[str, str]]:
    """``{"text": source, "path": relative path}`` per stdlib ``.py`` file in the order
    ``seed`` shuffles them to, up to ``max_bytes`` of text in total (the file that crosses the
    limit and all after it are left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p.relative_to(root) for p in root.rglob("*.py"))
    random.Random(seed).shuffle(paths)
    total = 0
    for rel in paths:
        if _SKIP_DIRS & set(rel.parts[:-1]):
            continue
        path = root / rel
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # unreadable or not UTF-8: skip it rather than guess its encoding
        if not text.strip():
            continue
        total += len(text.encode("utf-8"))
        if max_bytes is not None and total > max_bytes:
            return
        yield {"text": text, "path": rel.as_posix()}


def write_jsonl(documents: Iterator[dict[str, str]], output: str) -> tuple[int, int]:
    """Write one JSON object per line (atomically); return (documents, bytes written)."""
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp = f"{output}.tmp{os.getpid()}"
    count = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for doc in documents:
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")
            count += 1
    os.replace(tmp, output)
    return count, os.path.getsize(output)
