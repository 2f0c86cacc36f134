"""BigScience Megatron-DeepSpeed's ``--{train,valid,test}-weighted-split-paths-path FILE``,
read as megatron3d's ``--{train,valid,test}-data-path``.

The file holds one line: double-quoted dataset groups ``"NAME: W1 START:END P1, W2 START:END
P2"``. START:END is the fraction of each dataset's documents taken, and BigScience evaluated
each validation group on its own. What maps with certainty is one group of whole datasets
(``0:1``): it becomes ``W1 P1 W2 P2``, the blend ``--data-path`` also reads. Anything else is
refused with what to give instead.
"""

from __future__ import annotations

import re

from megatron3d.errors import ConfigError

_ENTRY = re.compile(r"^(\S+)\s+([0-9.]+):([0-9.]+)\s+(\S+)$")


def data_path_words(path: str) -> list[str]:
    """The ``--*-data-path`` words of the groups file ``path``; ConfigError (without the
    flag, which the caller names) for a file that does not map."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f.read().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path!r} ({exc}): give the dataset groups file") from None
    text = lines[0].strip() if len(lines) == 1 else ""
    if not (len(text) > 1 and text[0] == text[-1] == '"'):
        raise ConfigError(f"{path} must be one line holding one double-quoted group "
                          '"NAME: W1 0:1 PREFIX1, W2 0:1 PREFIX2"; fix the file')
    groups = text[1:-1].split('" "')
    if len(groups) != 1:
        raise ConfigError(f"{path} holds {len(groups)} groups, evaluated apart by BigScience; "
                          "megatron3d reads one dataset group per split: keep one group, or "
                          "give the blend with --valid-data-path")
    words: list[str] = []
    for entry in groups[0].partition(":")[2].split(","):
        match = _ENTRY.match(entry.strip())
        if match is None:
            raise ConfigError(f"{path}: entry {entry.strip()!r} is not WEIGHT START:END PREFIX; "
                              "fix the file")
        weight, start, end, prefix = match.groups()
        if float(start) != 0 or float(end) != 1:
            raise ConfigError(f"{path}: {prefix} takes documents {start}:{end}; megatron3d reads "
                              "only whole datasets (0:1) per split: give 0:1 with a dataset "
                              "made for the split, or use --data-path with --split")
        words += [weight, prefix]
    return words
