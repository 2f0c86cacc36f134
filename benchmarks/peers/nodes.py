"""The emulated-nodes mode: rows of N x K ranks run as N nodes of K ranks on this machine,
each node a network namespace whose link to the others is rate-limited while its own ranks
talk over an unlimited loopback (``scripts/local_nodes.sh``: a torchrun per node, a c10d
rendezvous at the first), so traffic between nodes costs what it would on a slow network
and traffic inside a node does not. Needs root, the ``ip``, ``tc`` and ``unshare`` tools
and the script; without them the mode is skipped with the reason.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers import bandwidth
from benchmarks.peers.config import Row

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "local_nodes.sh"


@dataclass(frozen=True)
class EmulatedNodes:
    nodes: int
    link_rate: str  # each node's link, each direction, in tc's units (2gbit)

    def fits(self, row: Row) -> bool:
        """Whether ``row`` splits into the nodes with at least 2 ranks on each (a node of
        one rank has no traffic inside it to tell apart)."""
        return row.world_size % self.nodes == 0 and row.world_size >= 2 * self.nodes

    def command(self, row: Row, module: str, worker_args: list[str]) -> list[str]:
        """The launch of ``row``'s worker ``module`` on the nodes."""
        return ["bash", str(SCRIPT), "--nodes", str(self.nodes),
                "--ranks-per-node", str(row.world_size // self.nodes),
                "--link-rate", self.link_rate, "--", "-m", module, *worker_args]

    @staticmethod
    def env() -> dict[str, str]:
        """The script runs torchrun with ``PYTHON``: this interpreter, as the rows' own."""
        return {"PYTHON": sys.executable}

    def title(self) -> str:
        return (f"{self.nodes} emulated nodes, links of {self.link_rate} between them "
                "(scripts/local_nodes.sh)")


def unavailable() -> str:
    """Why the mode cannot run here, or ``""``."""
    if not SCRIPT.exists():
        return f"{SCRIPT.relative_to(SCRIPT.parents[1])} is not in this checkout"
    missing = "" if shutil.which("unshare") else "needs unshare (apt-get install util-linux)"
    return bandwidth.unavailable() or missing
