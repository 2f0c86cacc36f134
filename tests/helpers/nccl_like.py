"""gloo made to post pipeline transfers as NCCL does, so tests on CPU run NCCL's path.

On NCCL, ``batch_isend_irecv`` coalesces a batch into one group with one work, and the
pipeline axis gets its ``reverse`` group (``ParallelState.build``), so ``comm`` posts each
transfer alone. ``coalescing_batches()`` gives gloo the first (one work for the whole batch,
done once every operation is); build the state with ``directed_links=True`` for the second.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist


class _AllOf:
    """One work for a whole batch, as NCCL returns: waiting for it waits for every op."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True


@contextlib.contextmanager
def coalescing_batches() -> Iterator[None]:
    """Inside, ``dist.batch_isend_irecv`` returns one work for the whole batch."""
    batch = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: [_AllOf(batch(ops))]
    try:
        yield
    finally:
        dist.batch_isend_irecv = batch
