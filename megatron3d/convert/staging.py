"""Where a tool writes its output before renaming it into place: a name of its own.

A fixed staging name (``OUTPUT.tmp``) can be a user's file or directory, which the tool would
then overwrite, rename or delete. A name with this process's id and a random part is one no
one else holds; the caller creates it exclusively (``os.open`` with ``O_EXCL``, or ``mkdir``
without ``exist_ok``), so on failure it removes only what it created in this run. The mode
is the usual one (the umask's), unlike ``tempfile``'s owner-only files.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def staging_path(output: Path) -> Path:
    """``OUTPUT.<pid>.<random>.tmp`` beside ``output``: a fresh name, not yet created."""
    return output.with_name(f"{output.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
