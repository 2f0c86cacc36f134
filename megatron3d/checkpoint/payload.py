"""What a rank file must hold, checked as it is read, before anything uses it.

A rank file is a ``torch.save`` of ``{"chunks": [...], "rng": {...}, "iteration", "rank",
"layout"}`` (see ``saving.save`` and ``snapshot.HostSnapshot``). The weights-only unpickler
guarantees tensors and plain data only; a damaged or hand-edited file can still hold a chunk
whose ``tp_rank`` is out of range or whose ``data`` is no float32 tensor of ``end - start``
elements, or RNG states that ``random``, numpy or torch refuse with a traceback (or accept,
and fail later); ``rng`` may be None (converted and re-laid-out checkpoints hold none).
``problem`` names the first such defect so ``io.read_rank`` refuses the file in one line.
Whether the file is a rank file at all, and this checkpoint's (iteration, rank, layout), is
``safety.check_rank_file``'s question.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from typing import Any

import numpy as np
import torch

from megatron3d.mpu.random import MODEL_PARALLEL

CHUNK_KEYS = ("name", "kind", "tp_size", "tp_rank", "split_dim", "stride", "logical_rows",
              "local_shape", "start", "end", "data")
# Fields every chunk of one logical tensor shares (its layout), whatever its kind.
_SHARED = ("tp_size", "split_dim", "stride", "logical_rows", "local_shape")
_MAX_TP = 2**16  # far beyond any tensor-parallel size
_MAX_NUMEL = 2**40  # elements of one rank's slice of one tensor: far beyond any model


def problem(payload: Any) -> str | None:
    """The first defect of a rank file's contents, worded to follow the file name."""
    if not isinstance(payload, dict):
        return None
    for key in ("iteration", "rank"):
        if key in payload and not _is_int(payload[key]):
            return f"has {key} {_show(payload[key])}, not a whole number"
    layout = payload.get("layout", {})
    if not isinstance(layout, dict) or not all(_is_int(v) for v in layout.values()):
        return f"has layout {_show(layout)}, not a mapping of sizes"
    if "chunks" in payload and (found := _chunks_problem(payload["chunks"])):
        return found
    if payload.get("rng") is not None and (found := _rng_problem(payload["rng"])):
        return found
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value: Any) -> str:
    """A short one-line spelling of any value (a tensor's repr spans lines)."""
    text = " ".join(repr(value).split()) if not isinstance(value, torch.Tensor) else (
        f"a {value.dtype} tensor of shape {tuple(value.shape)}")
    return text if len(text) <= 40 else text[:37] + "..."


def _chunks_problem(chunks: Any) -> str | None:
    if not isinstance(chunks, list | tuple):
        return f"has chunks {_show(chunks)}, not a list"
    first_of: dict[str, dict] = {}
    spans: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    for i, chunk in enumerate(chunks):
        if (found := _chunk_problem(chunk)) is not None:
            return f"has a damaged chunk {i} ({found})"
        first = first_of.setdefault(chunk["name"], chunk)
        differs = [k for k in _SHARED if _plain(chunk[k]) != _plain(first[k])]
        if differs:
            return (f"has chunks of {chunk['name']} that disagree on {', '.join(differs)} "
                    f"(chunk {i})")
        spans[(chunk["name"], chunk["kind"], chunk["tp_rank"])].append(
            (chunk["start"], chunk["end"]))
    for (name, kind, rank), ranges in spans.items():
        ranges.sort()
        if any(end > start for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False)):
            return f"has overlapping chunks of {name} ({kind}, TP rank {rank})"
    return None


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _chunk_problem(chunk: Any) -> str | None:
    """What is wrong with one chunk, or None."""
    if not isinstance(chunk, dict) or not set(CHUNK_KEYS) <= chunk.keys():
        return f"{_show(chunk)} lacks some of the keys {', '.join(CHUNK_KEYS)}"
    if (found := description_problem(chunk)) is not None:
        return found
    start, end, data = chunk["start"], chunk["end"], chunk["data"]
    if not (isinstance(data, torch.Tensor) and data.dtype == torch.float32
            and data.layout == torch.strided and data.dim() == 1
            and data.numel() == end - start):
        return f"data is {_show(data)}, not {end - start} float32 values"
    return None


def description_problem(chunk: dict) -> str | None:  # noqa: C901 - one check per field
    """What is wrong with a chunk's description (every key of ``CHUNK_KEYS`` but its data,
    all present), or None: shared by rank files and the chunk index (``chunk_index.py``)."""
    if not isinstance(chunk["name"], str) or not isinstance(chunk["kind"], str):
        return f"name {_show(chunk['name'])} or kind {_show(chunk['kind'])} is not a string"
    shape, tp_size, split = chunk["local_shape"], chunk["tp_size"], chunk["split_dim"]
    if not isinstance(shape, list | tuple) or not all(_is_int(n) and n >= 0 for n in shape):
        return f"local_shape {_show(shape)} is not a list of sizes"
    numel = math.prod(shape)
    if not (_is_int(tp_size) and 1 <= tp_size <= _MAX_TP and tp_size * numel <= _MAX_NUMEL):
        return f"tp_size {_show(tp_size)} with local_shape {_show(shape)} is no layout"
    if not (_is_int(chunk["tp_rank"]) and 0 <= chunk["tp_rank"] < tp_size):
        return f"tp_rank {_show(chunk['tp_rank'])} is outside [0, {tp_size})"
    if split is not None and not (_is_int(split) and 0 <= split < len(shape)):
        return f"split_dim {_show(split)} is no dimension of {_show(shape)}"
    stride = chunk["stride"]
    if not (_is_int(stride) and stride >= 1 and (split is None or shape[split] % stride == 0)):
        return f"stride {_show(stride)} does not divide the split dimension"
    rows, full_rows = chunk["logical_rows"], (shape[0] * (tp_size if split == 0 else 1)
                                              if shape else 0)
    if rows is not None and not (_is_int(rows) and 0 <= rows <= full_rows):
        return f"logical_rows {_show(rows)} is outside [0, {full_rows}]"
    start, end = chunk["start"], chunk["end"]
    if not (_is_int(start) and _is_int(end) and 0 <= start <= end <= numel):
        return f"range [{_show(start)}, {_show(end)}) is outside [0, {numel}]"
    return None


def _rng_problem(rng: Any) -> str | None:
    if not isinstance(rng, dict):
        return f"has rng {_show(rng)}, not a mapping"
    for key, usable in (("python", _python_state_ok), ("numpy", _numpy_state_ok),
                        ("torch", _torch_states_ok)):
        if key not in rng or not usable(rng[key]):
            return f"has no usable {key} RNG state ({_show(rng.get(key))})"
    return None


def _python_state_ok(state: Any) -> bool:
    try:  # a scratch generator: the real one is restored only once everything checked out
        random.Random().setstate(state)
    except Exception:  # whatever restoring this state would raise
        return False
    return True


def _numpy_state_ok(state: Any) -> bool:
    """The plain-data dict ``saving`` writes, or numpy's own tuple (older checkpoints)."""
    try:
        if isinstance(state, dict):
            keys = state["keys"]
            if not isinstance(keys, torch.Tensor) or keys.is_floating_point():
                return False
            state = (state["kind"], keys.numpy().astype(np.uint32), state["pos"],
                     state["has_gauss"], state["cached_gaussian"])
        np.random.RandomState().set_state(state)
    except Exception:  # whatever restoring this state would raise
        return False
    return True


def _torch_states_ok(states: Any) -> bool:
    """The CPU generator's state, the device's (if not a CPU run) and the named streams,
    which are states of the device's generator."""
    if not isinstance(states, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) and v.dtype == torch.uint8
            and v.dim() == 1 for k, v in states.items()):
        return False
    if "cpu" not in states or f"stream:{MODEL_PARALLEL}" not in states:
        return False
    device = states.get("device", states["cpu"])
    if any(v.numel() != device.numel() for k, v in states.items() if k.startswith("stream:")):
        return False
    try:
        torch.Generator().set_state(states["cpu"])
    except Exception:  # whatever restoring this state would raise
        return False
    return True
