"""Pre-flight: every rank must run the same configuration before any work starts.

A rank launched with other flags (a stale command on one node, a different code version)
would otherwise build another model and hang in its first collective, or silently train
something else. Each rank hashes every field of its config and the hashes are gathered over
the world, so every rank sees the same table and raises the same one-line ``ConfigError``
naming the differing flags; no rank goes on alone.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from megatron3d.config import TrainConfig, flat_fields
from megatron3d.errors import ConfigError
from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup

_SHOWN = 4  # differing flags named in the message; the rest are counted


def check_same_config(cfg: TrainConfig, world: AxisGroup, device: torch.device) -> None:
    """Raise ``ConfigError`` on every rank unless all ranks of ``world`` have equal configs.

    A collective over ``world``: every rank must call it. Tensors live on ``device`` because
    NCCL only moves device tensors.
    """
    values = flat_fields(cfg)
    hashes = torch.tensor([[_hash(k, v) for k, v in values.items()]], dtype=torch.int64,
                          device=device)  # [1, K]
    counts = torch.tensor([hashes.shape[1], -hashes.shape[1]], device=device)  # [K, -K]
    most, fewest = (abs(n) for n in comm.all_reduce(counts, world, op=comm.MAX).tolist())
    if most != fewest:  # the gather needs equal shapes: stop before it, on every rank
        raise ConfigError(f"ranks run different code versions (between {fewest} and {most} "
                          f"config fields, this rank {len(values)}): install the same "
                          "megatron3d on every node")
    table = comm.all_gather(hashes, world, dim=0).tolist()  # [world, K]
    names = list(values)
    wrong = [_describe(names[i], values[names[i]], [row[i] for row in table])
             for i in range(len(names)) if len({row[i] for row in table}) > 1]
    if wrong:
        more = f"; and {len(wrong) - _SHOWN} more" if len(wrong) > _SHOWN else ""
        raise ConfigError(f"ranks were launched with different flags: "
                          f"{'; '.join(wrong[:_SHOWN])}{more}: launch every rank with the "
                          "same command")


def _hash(name: str, value: Any) -> int:
    """A 63-bit hash that is the same in every process (Python's ``hash`` is salted)."""
    digest = hashlib.sha256(f"{name}={value!r}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _describe(name: str, value: Any, column: list[int]) -> str:
    """``--flag differs (this rank V; ranks 0-2 agree, rank 3 differs)``: the largest group
    of ranks with one value (lowest rank on ties) against all the others."""
    groups: dict[int, list[int]] = {}
    for r, h in enumerate(column):
        groups.setdefault(h, []).append(r)
    major = min(groups.values(), key=lambda g: (-len(g), g[0]))
    rest = [r for r in range(len(column)) if r not in major]
    agree = "agree" if len(major) > 1 else "has one value"
    differ = "differ" if len(rest) > 1 else "differs"
    flag = "--" + name.replace("_", "-")
    return (f"{flag} differs (this rank {value!r}; {_ranks(major)} {agree}, "
            f"{_ranks(rest)} {differ})")


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0-2`` or ``ranks 0, 2-3`` (sorted input)."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and runs[-1][-1] == r - 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(str(g[0]) if len(g) == 1 else f"{g[0]}-{g[-1]}" for g in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"
