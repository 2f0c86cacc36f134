"""The limited-bandwidth mode: rows run inside a network namespace whose loopback is
rate-limited, so communication-bound differences show as they would on a slower cluster
network instead of being hidden by the machine's memory-speed loopback.

The namespace is made for the run and removed after it. Its loopback gets a token-bucket
filter (``tc ... tbf``): netem, which could add delay, is not available on these kernels.
Every rank of a row runs in the namespace (one ``ip netns exec`` around its torchrun), so
all gloo traffic between ranks crosses the limited loopback. Making a namespace needs root
and the ``ip`` and ``tc`` tools; without them the mode is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator

NAMESPACE = "m3d-peers"
BURST = "256kb"  # tbf needs a bucket of at least one packet burst; 256 kB suits 2 Gbit/s
LATENCY = "50ms"  # how long a packet may wait for tokens before tbf drops it


def unavailable() -> str:
    """Why the mode cannot run here, or ``""``."""
    if os.geteuid() != 0:
        return "needs root (it creates a network namespace)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} (apt-get install iproute2)"
    return ""


def setup_commands(rate: str) -> list[list[str]]:
    """The commands that make the namespace with its loopback up and limited to ``rate``."""
    inside = ["ip", "netns", "exec", NAMESPACE]
    return [["ip", "netns", "add", NAMESPACE],
            [*inside, "ip", "link", "set", "lo", "up"],
            [*inside, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
             "burst", BURST, "latency", LATENCY]]


@contextlib.contextmanager
def limited_loopback(rate: str) -> Iterator[list[str]]:
    """Make the namespace, yield the prefix that runs a command inside it, remove it after.
    A namespace of that name left by an interrupted run is removed first."""
    subprocess.run(["ip", "netns", "delete", NAMESPACE], capture_output=True, check=False)
    try:
        for command in setup_commands(rate):
            subprocess.run(command, capture_output=True, check=True, text=True)
        yield ["ip", "netns", "exec", NAMESPACE]
    finally:
        subprocess.run(["ip", "netns", "delete", NAMESPACE], capture_output=True, check=False)
