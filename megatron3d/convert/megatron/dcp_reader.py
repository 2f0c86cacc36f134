"""Read global tensors, or slices of them, from a ``torch.distributed.checkpoint`` directory.

Megatron-Core's ``torch_dist`` checkpoints are DCP directories: ``.metadata`` (a pickle of
each tensor's global shape and the chunks that the saving ranks wrote) and ``*.distcp``
files. DCP itself unpickles ``.metadata`` with plain ``pickle``, which would run any code a
crafted file names; here it is read by an unpickler that resolves only DCP's own metadata
classes, torch sizes and dtypes, so such a file is refused before anything runs. Tensor
bytes are read by DCP (with torch's weights-only loader), one requested slice at a time, so
memory stays near the stored chunks that slice touches.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pathlib
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem, metadata, planner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron3d.convert.megatron.coverage import coverage_problem
from megatron3d.errors import CheckpointError

_DCP_MODULES = {m.__name__: m for m in (metadata, planner, filesystem)}
_PATHS = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves DCP's metadata classes, ``torch.Size``, dtypes, layouts and paths (values
    that run no code when made), nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        found = getattr(_DCP_MODULES.get(module), name, None)
        if isinstance(found, type) and found.__module__ == module and (
                dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
            return found  # plain records (not DCP's readers and writers, nor imports)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None),
                                                               torch.dtype)):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return torch.serialization._get_layout
        if module in ("pathlib", "pathlib._local") and name in _PATHS:  # a checkpoint_id
            return getattr(pathlib, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP metadata never holds")


class _SafeReader(filesystem.FileSystemReader):
    """DCP's file reader, with ``.metadata`` read once by ``_MetadataUnpickler``."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        try:
            with open(path / ".metadata", "rb") as file:
                self.metadata = _MetadataUnpickler(file).load()
        except FileNotFoundError:
            raise CheckpointError(f"{path} has no .metadata: it is not a torch.distributed."
                                  "checkpoint directory; pass a torch_dist checkpoint") from None
        except (pickle.UnpicklingError, OSError, EOFError, ValueError, TypeError,
                AttributeError, IndexError, KeyError, OverflowError, MemoryError,
                RecursionError) as err:  # the last three: a crafted length or nesting
            first = (str(err).strip() or type(err).__name__).splitlines()[0][:160]
            raise CheckpointError(f"{path / '.metadata'} cannot be read safely ({first}): it "
                                  "is damaged or crafted; save the checkpoint again") from None
        if not isinstance(self.metadata, metadata.Metadata):
            raise CheckpointError(f"{path / '.metadata'} holds a "
                                  f"{type(self.metadata).__name__}, not DCP metadata")

    def read_metadata(self, *args: Any, **kwargs: Any) -> metadata.Metadata:
        return self.metadata


class _SlicePlanner(planner.LoadPlanner):
    """Reads one region of one stored tensor into ``out`` (the region's shape)."""

    def __init__(self, name: str, offsets: Sequence[int], out: torch.Tensor) -> None:
        self.name, self.offsets, self.out = name, tuple(offsets), out

    def set_up_planner(self, state_dict: Any, metadata: Any = None,
                       is_coordinator: bool = False) -> None:
        self.stored = metadata.state_dict_metadata[self.name]

    def create_local_plan(self) -> planner.LoadPlan:
        wanted = ChunkStorageMetadata(torch.Size(self.offsets), self.out.shape)
        return planner.LoadPlan(create_read_items_for_chunk_list(self.name, self.stored,
                                                                 [wanted]))

    def create_global_plan(self, plans: list[planner.LoadPlan]) -> list[planner.LoadPlan]:
        return plans

    def finish_plan(self, plan: planner.LoadPlan) -> planner.LoadPlan:
        return plan

    def load_bytes(self, read_item: planner.ReadItem, value: io.BytesIO) -> None:
        raise AssertionError("only tensors are requested")

    def resolve_tensor(self, read_item: planner.ReadItem) -> torch.Tensor:
        region = self.out
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths,
                                                  strict=True)):
            region = region.narrow(dim, start, length)
        return region

    def commit_tensor(self, read_item: planner.ReadItem, tensor: torch.Tensor) -> None:
        """The tensor was copied into ``out`` in place."""


def _well_formed(name: object, md: TensorStorageMetadata) -> bool:
    """A name, a shape of whole numbers >= 0, a dtype and a list of chunks (checked by
    ``coverage_problem`` when the tensor is used)."""
    size, dtype = md.size, getattr(md.properties, "dtype", None)
    return (isinstance(name, str) and isinstance(size, tuple)
            and all(type(n) is int and n >= 0 for n in size)
            and isinstance(dtype, torch.dtype) and isinstance(md.chunks, list))


class DcpCheckpoint:
    """The tensors of one DCP directory, by name; bytes entries (Megatron's extra state)
    are not tensors and are left out."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._reader = _SafeReader(path)
        entries = getattr(self._reader.metadata, "state_dict_metadata", None)
        self.tensors: dict[str, TensorStorageMetadata] = {
            name: md for name, md in (entries.items() if isinstance(entries, dict) else ())
            if isinstance(md, TensorStorageMetadata)}
        odd = next((str(n)[:80] for n, md in self.tensors.items() if not _well_formed(n, md)),
                   None) if isinstance(entries, dict) else "its table of contents"
        if odd is not None:
            raise CheckpointError(f"{path / '.metadata'} describes {odd} in a form DCP never "
                                  "writes: it is damaged or crafted; save the checkpoint again")

    def shape(self, name: str) -> tuple[int, ...] | None:
        md = self.tensors.get(name)
        return None if md is None else tuple(md.size)

    def coverage_problem(self, name: str) -> str | None:
        """What is wrong with the stored chunks of ``name`` as an exact tiling of its global
        shape (``coverage.py``), in words; None when every element is stored once."""
        return coverage_problem(name, self.tensors[name].size, self.tensors[name].chunks)

    def read(self, name: str, offsets: Sequence[int] = (),
             shape: Sequence[int] | None = None) -> torch.Tensor:
        """``name``'s region at ``offsets`` of ``shape`` (default: the whole tensor), as fp32."""
        md = self.tensors[name]
        shape = tuple(md.size) if shape is None else tuple(shape)
        offsets = tuple(offsets) + (0,) * (len(shape) - len(offsets))
        out = torch.empty(shape, dtype=md.properties.dtype)
        try:
            dcp.load({}, storage_reader=self._reader,
                     planner=_SlicePlanner(name, offsets, out), no_dist=True)
        except CheckpointException as err:  # DCP wraps what went wrong, per rank
            cause = next(iter(err.failures.values()))[0]
            first = (str(cause).strip() or type(cause).__name__).splitlines()[0][:160]
            raise CheckpointError(f"{self.path} cannot give {name} ({first}): a .distcp file "
                                  "is missing or damaged; save the checkpoint again") from None
        if not torch.isfinite(out).all():
            raise CheckpointError(f"{self.path}: {name} holds a non-finite value (nan or inf): "
                                  "the checkpoint is damaged or its run diverged; import an "
                                  "earlier checkpoint")
        return out.to(torch.float32)
