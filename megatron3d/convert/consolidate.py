"""A whole checkpoint as one fp32 safetensors file under our logical names, written while
streaming.

safetensors' ``save_file`` needs every tensor in memory at once, and a model can be larger
than memory, so the file is written here from the format's specification: an 8-byte
little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets}, ...,
"__metadata__": {...}}`` padded with spaces to a multiple of 8, then every tensor's
little-endian bytes back to back. The shapes come from the chunk descriptions
(``CheckpointReader.shape``, checked against the model first), so the header goes first
and each tensor follows as it is assembled, one at a time (``streaming.logical_tensors``).
The file is written under a fresh name of its own (``OUTPUT.<pid>.<random>.tmp``, created
exclusively, so no file of the user's is replaced or removed) and renamed when complete: a
failure leaves nothing behind.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from megatron3d.checkpoint.reader import CheckpointReader
from megatron3d.convert.contents import check_contents, model_tensors
from megatron3d.convert.staging import staging_path
from megatron3d.convert.standalone import saved_config
from megatron3d.convert.streaming import logical_tensors
from megatron3d.errors import CheckpointError, ConfigError

_ALIGN = 8  # the header is padded so that the data starts 8-byte aligned


@dataclass(frozen=True)
class ConsolidateReport:
    output: Path
    tensors: int
    total_bytes: int  # of tensor data
    largest_bytes: int  # the largest single tensor


def consolidate(load: str, output: str) -> ConsolidateReport:
    """The newest checkpoint in ``load`` -> the new safetensors file ``output`` (fp32 weights,
    vocabulary padding dropped, each tied weight once)."""
    reader = CheckpointReader.latest(load)
    out = Path(output)
    if out.exists():
        raise ConfigError(f"--output {output} already exists: choose a new path, nothing was "
                          "written")
    owned = model_tensors(saved_config(reader.meta).model)
    check_contents(reader, [(p, "weight") for p in owned])
    shapes = {p.meta.name: reader.shape(p.meta.name) for p in owned}  # in layer order
    header = _header(shapes, {"format": "pt", "iteration": str(reader.meta["iteration"]),
                              "model": json.dumps(reader.meta["config"]["model"])})
    tmp = None
    try:
        staged = staging_path(out)
        handle = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        tmp = staged  # created by this run from here on
        with os.fdopen(handle, "wb") as f:
            f.write(header)
            for name, _, tensor in logical_tensors(reader, ((n, "weight") for n in shapes)):
                if tuple(tensor.shape) != shapes[name]:  # the header promised this shape
                    raise CheckpointError(f"{reader.directory}: the chunks of {name} disagree "
                                          "on its shape; the checkpoint is damaged")
                _write_tensor(f, tensor)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except OSError as err:
        _remove(tmp)
        raise CheckpointError(f"cannot write {out} ({err.strerror or err}): free space or "
                              "choose another --output; nothing was written") from None
    except BaseException:
        _remove(tmp)
        raise
    sizes = [4 * math.prod(shape) for shape in shapes.values()]
    return ConsolidateReport(out, len(shapes), sum(sizes), max(sizes))


def _remove(tmp: Path | None) -> None:
    """The file this run created, if it got that far."""
    if tmp is not None:
        tmp.unlink(missing_ok=True)


def _header(shapes: dict[str, tuple[int, ...]], metadata: dict[str, str]) -> bytes:
    """The length prefix and JSON header for fp32 tensors stored in ``shapes``' order."""
    entries: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, shape in shapes.items():
        end = offset + 4 * math.prod(shape)
        entries[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % _ALIGN)
    return struct.pack("<Q", len(text)) + text


def _write_tensor(f: BinaryIO, tensor: torch.Tensor) -> None:
    """The tensor's bytes, little-endian, without an extra copy on a little-endian host."""
    f.write(tensor.to(torch.float32).contiguous().numpy().astype("<f4", copy=False).data)
