"""A network namespace whose loopback is rate-limited, for benchmarks that need a slow link.

The DP ranks run inside it (``ip netns exec``) and talk over its loopback, the only interface
there, through a token-bucket filter (``tc ... tbf``): every byte any rank sends passes that
one bucket, like ranks sharing one link of ``rate_gbit``. Needs root and iproute2; the
namespace is deleted on the way out, also on failure.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


@contextlib.contextmanager
def limited_namespace(rate_gbit: float) -> Iterator[str]:
    """Create ``m3d_bench_<pid>`` with its loopback up and limited to ``rate_gbit``; yield
    its name; delete it at the end."""
    if os.geteuid() != 0:
        raise PermissionError("--limit-gbit needs root (ip netns add, tc qdisc add)")
    name = f"m3d_bench_{os.getpid()}"
    _ip("netns", "add", name)
    try:
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        _ip("netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
            f"{rate_gbit:g}gbit", "burst", "256kb", "latency", "50ms")
        yield name
    finally:
        _ip("netns", "delete", name)


def qdisc_stats(name: str) -> str:
    """The namespace's loopback qdisc line with its counters (bytes sent, overlimits)."""
    text = _ip("netns", "exec", name, "tc", "-s", "qdisc", "show", "dev", "lo")
    return " ".join(" ".join(text.split()).split(" backlog")[0].split())


def run_inside(name: str, argv: list[str], timeout_s: float) -> None:
    """Run ``argv`` in namespace ``name``; gloo there must use its loopback, the only link
    (a file:// rendezvous needs no network)."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    subprocess.run(["ip", "netns", "exec", name, *argv], check=True, env=env,
                   timeout=timeout_s)
