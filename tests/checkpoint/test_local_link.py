"""The local checkpoints' peer link on 2 gloo ranks: a copy received straight into the
buffers its receiver places (the files of the held copy it replaces), or into fresh memory
where the receiver places none, byte for byte either way."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from megatron3d.checkpoint.local import pages, store
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
