"""A context in which every device -> host transfer raises: the hot-path rule of
docs/ARCHITECTURE.md §5 made checkable (``.item()``, ``.tolist()``, ``.cpu()``,
``bool(tensor)``, cuda synchronize)."""

from __future__ import annotations

import contextlib

import torch

SYNCS = ("item", "tolist", "cpu", "__bool__")


@contextlib.contextmanager
def no_host_sync():
    """Patch every device -> host transfer to raise."""
    real = {name: getattr(torch.Tensor, name) for name in SYNCS}
    real_sync = torch.cuda.synchronize

    def guard(name: str):
        def patched(self, *args, **kwargs):
            raise AssertionError(f"host sync via Tensor.{name} during a training step")
        return patched

    def no_synchronize(*_args, **_kwargs):
        raise AssertionError("torch.cuda.synchronize during a training step")

    for name in SYNCS:
        setattr(torch.Tensor, name, guard(name))
    torch.cuda.synchronize = no_synchronize
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(torch.Tensor, name, fn)
        torch.cuda.synchronize = real_sync
