"""The local checkpoints' peer link on 2 gloo ranks: a copy received straight into the
buffers its receiver places (the files of the held copy it replaces), or into fresh memory
where the receiver places none, byte for byte either way; the group's gloo threads run
below the training's CPU priority."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron3d.checkpoint.local import pages, priority, store
from megatron3d.checkpoint.local.link import PeerLink
from tests.helpers.dist import run_distributed


def _swap(root: str) -> tuple[list[bytes], list[bytes], list[tuple[str, list[int]]]]:
    rank = dist.get_rank()
    link = PeerLink(rank, 2)
    files = {"rank.pt": bytes(range(256)) * (rank + 3), "empty": b"", "meta.json": b"{}"}
    asked: list[tuple[str, list[int]]] = []

    def place(header, sizes):
        names, _ = store.described(header)
        asked.append((",".join(names), sizes))
        if rank == 1:
            return None  # fresh memory
        return [pages.mapped(Path(root) / name, size)
                for name, size in zip(names, sizes, strict=True)]

    incoming = link.swap(store.frames(files, {"owner": rank}), place=place)
    received = [bytes(part) for part in incoming[1:]]
    written = [(Path(root) / n).read_bytes() for n in files] if rank == 0 else []
    return received, written, asked


def test_a_copy_lands_where_its_receiver_places_it(tmp_path):
    (zero, written, asked0), (one, _, asked1) = run_distributed(_swap, 2, str(tmp_path))
    sent = [{"rank.pt": bytes(range(256)) * (r + 3), "empty": b"", "meta.json": b"{}"}
            for r in (0, 1)]
    assert zero == list(sent[1].values()) and written == zero  # in rank 0's files
    assert one == list(sent[0].values())
    assert asked0 == [("rank.pt,empty,meta.json", [256 * 4, 0, 2])]
    assert asked1 == [("rank.pt,empty,meta.json", [256 * 3, 0, 2])]


def _gloo_niceness() -> list[int]:
    """The niceness of each gloo TCP loop thread of this process (Linux's /proc)."""
    found = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            stat = f.read()
        if stat[stat.index("(") + 1:stat.rindex(")")] == "gloo_tcp_loop":
            found.append(int(stat[stat.rindex(")") + 2:].split()[16]))
    return sorted(found)


def _niceness() -> tuple[list[int], list[int]]:
    before = _gloo_niceness()  # the default group's, made by the training thread
    PeerLink(dist.get_rank(), 2)
    return before, _gloo_niceness()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux's /proc")
def test_the_groups_gloo_threads_run_below_the_training():
    for before, after in run_distributed(_niceness, 2):
        assert before and set(before) == {0}
        assert sorted(set(after) - set(before)) == [priority.NICE], after
