"""Write a run's report into ``benchmarks/README.md``, between two markers, so the numbers
there are always a whole run's, with the command, date, machine and versions that made it.

The prose around the markers (what the rows mean, the adapters, why a target is missed) is
written by hand and stays."""

from __future__ import annotations

from pathlib import Path

BEGIN = "<!-- peers:begin: written by python -m benchmarks.peers.compare --write-readme -->"
END = "<!-- peers:end -->"


def replace_section(readme: Path, body: str) -> None:
    """Put ``body`` between the markers of ``readme``, replacing what was there."""
    text = readme.read_text()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{readme} has no '{BEGIN}' ... '{END}' section: add the two "
                         "markers where the peers report belongs")
    readme.write_text(f"{text[:start]}{BEGIN}\n{body.strip()}\n{text[end:]}")
