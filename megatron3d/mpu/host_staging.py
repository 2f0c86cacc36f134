"""Point-to-point transfers of device tensors over gloo, staged through host memory.

gloo sends and receives host tensors only (on CUDA tensors it runs just all-reduce and
broadcast), so when ranks share a GPU over gloo (tests, the GPU check) each send is copied to
the host before it is posted and each receive lands in a host buffer that is copied into its
device buffer when its work is waited for. NCCL never comes here. Kept apart from
``comm.start_exchange`` so that its posting order stays the only thing that function says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from megatron3d.mpu.state import AxisGroup


class Work(Protocol):
    def wait(self) -> object: ...


def needed(sends: list[tuple], recvs: list[tuple], axis: AxisGroup) -> bool:
    """Whether the transfers hold device tensors on a gloo group."""
    on_device = any(t.device.type != "cpu" for t, *_ in (*sends, *recvs))
    return on_device and dist.get_backend(axis.group) == "gloo"


def start(sends: list[tuple], recvs: list[tuple],
          post: Callable[[list[tuple], list[tuple]], list[Work]]) -> list[Work]:
    """``post`` (``start_exchange`` on host tensors) the host copies of ``sends`` and host
    buffers for ``recvs``; the receives' works fill the device buffers when waited for."""
    host_sends = [(t.detach().to("cpu", copy=True), *rest) for t, *rest in sends]
    host_recvs = [(torch.empty(t.shape, dtype=t.dtype), *rest) for t, *rest in recvs]
    works = post(host_sends, host_recvs)
    landings = [_Landing(work, buffer, host) for work, (buffer, *_), (host, *_)
                in zip(works[len(sends):], recvs, host_recvs, strict=True)]
    return [*works[:len(sends)], *landings]


class _Landing:
    """A posted receive into host memory, copied into its device buffer once done."""

    def __init__(self, work: Work, buffer: torch.Tensor, host: torch.Tensor) -> None:
        self._work: Work | None = work
        self._buffer, self._host = buffer, host

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._buffer.detach().copy_(self._host)  # a receive buffer may require grad
            self._work = None
