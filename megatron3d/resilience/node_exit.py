"""A node's launcher says when and how its workers failed, for the job script that blames a node.

The SLURM scripts run one ``tools/launch.py`` per node. When the job step fails, the batch
shell must tell the node whose workers failed first (the one to count against the hardware)
from the nodes that were only torn down with it. Each launcher whose torchrun gave up on its
own workers therefore writes one line into the directory named by ``NODE_EXIT_DIR_ENV``:
``TIME_US NODE CODE RANK`` (microseconds since the epoch, so ``sort -n`` orders the nodes).
A launcher stopped by a signal writes nothing: it did not fail, it was stopped.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

NODE_EXIT_DIR_ENV = "MEGATRON3D_NODE_EXIT_DIR"


def node_name() -> str:
    """Slurm's name for this node (what ``--exclude`` takes), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def record(code: int, rank: int | str) -> None:
    """Note that this node's workers failed with ``code`` (``rank`` first), when asked to."""
    directory = os.environ.get(NODE_EXIT_DIR_ENV)
    if not directory or code == 0:
        return
    node = node_name()
    line = f"{time.time_ns() // 1000} {node} {code} {rank}\n"
    path = Path(directory) / f"{node}.{os.getpid()}"
    try:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(line)
        tmp.replace(path)  # the job script reads whole lines only
    except OSError:
        pass  # a directory gone: the job script then blames every node of the step
