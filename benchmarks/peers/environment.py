"""The lines above the tables: the configuration, the machine and the package versions, so
a pasted table says what made it."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import platform
import sys

from benchmarks.peers.config import PeerConfig

PACKAGES = ("torch", "megatron-core", "deepspeed", "transformers")


def versions() -> dict[str, str]:
    """Installed version of each package that matters, or ``not installed``."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def describe(cfg: PeerConfig) -> str:
    settings = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items())
    packages = ", ".join(f"{k} {v}" for k, v in versions().items())
    machine = (f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} "
               f"{platform.release()}, Python {sys.version.split()[0]}")
    return (f"config: {settings}\nmachine: {machine}\npackages: {packages}\n"
            "step time: median after warm-up of the slowest rank; collectives and MiB: one "
            "step's collectives and p2p messages on the busiest rank, each counted at its "
            "largest buffer; loss diff: max over steps of |loss - megatron3d (1,1,1) loss|")
