"""Random numbers that do not depend on the parallel layout, and RNG streams for dropout.

``fill_normal`` draws the slices of a parameter's initial value that a rank owns, directly on
its device. The logical tensor is cut along one dimension into blocks of whole slabs (about
``BLOCK_NUMEL`` elements each), and block b is drawn from its own generator seeded by
(seed, logical name, b): a value depends only on the seed, the name, the logical shape and its
position, never on the layout, so a TP/PP/DP model starts identical to the single-process
model while each rank draws only the blocks its slices touch (``seeded_normal``: all of them).

``RNGStreams`` holds the dropout streams: the device's default generator is the "default"
stream (same seed on every TP rank, for dropout on replicated activations) and named extra
streams, such as "model-parallel" (offset by the TP rank, for dropout on TP-split
activations), are swapped in with ``fork()``. Both are offset by the pipeline rank, as in
Megatron, so stages do not draw the same masks in the same order, and by the
context-parallel rank, whose activations are other tokens of the sequence. Dropout
therefore depends on the layout (initialisation does not). The state is saved in
checkpoints and restored for activation recompute.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator, Sequence

import torch

MODEL_PARALLEL = "model-parallel"
_MODEL_PARALLEL_SEED_OFFSET = 2718  # keeps the TP stream away from the default seed
_PIPELINE_SEED_STRIDE = 100  # Megatron's per-stage offset of both streams' seeds
# Per context-parallel rank: above every pipeline and TP offset, so no two ranks share a seed
_CONTEXT_SEED_STRIDE = 1 << 20
# Elements of one independently seeded block of a logical weight (256 KiB in fp32): small
# enough that a slice wastes little at its ends, large enough that per-block overhead (a
# generator and a kernel launch) is negligible. Changing it changes every initial weight.
BLOCK_NUMEL = 2**16


def stable_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, name) that is the same in every process and Python run."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def seeded_normal(shape: Sequence[int], std: float, seed: int, name: str,
                  device: torch.device | str | None = None, dim: int = 0) -> torch.Tensor:
    """The whole logical N(0, std^2) fp32 tensor that ``fill_normal`` slices: what a single
    process holds. On the "meta" device it only has the shape (for counting parameters)."""
    out = torch.empty(tuple(shape), dtype=torch.float32, device=device or "cpu")
    return fill_normal(out, std, seed, name, shape, dim)


def fill_normal(out: torch.Tensor, std: float, seed: int, name: str, shape: Sequence[int],
                dim: int = 0, ranges: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
    """Fill ``out`` with the slices ``ranges`` (non-empty [start, end) along ``dim``,
    concatenated in order; default: all of it) of the logical N(0, std^2) tensor ``shape``
    named ``name``.

    ``dim`` also orients the blocks: a block is whole slabs along ``dim`` (rows for 0, columns
    for 1), so a caller passes the dimension its slices split. It draws exactly the blocks
    that ``ranges`` touch, each once, one at a time, on ``out``'s device (in fp32, rounded into
    ``out``'s dtype): the work is its slices plus at most one partial block at each end of a
    range, the transient memory one block. ``out`` has the logical shape except along ``dim``;
    it is left untouched on the "meta" device.
    """
    if out.is_meta:
        return out
    slab = math.prod(n for i, n in enumerate(shape) if i != dim)
    per_block = max(1, BLOCK_NUMEL // max(slab, 1))  # slabs along ``dim`` in one block
    pos, cached = 0, None
    for start, end in ranges or [(0, shape[dim])]:
        for block in range(start // per_block, -(-end // per_block)):
            lo, hi = block * per_block, min(shape[dim], (block + 1) * per_block)
            if cached is None or cached[0] != block:  # stride > 1: ranges may share a block
                cached = block, _block(std, seed, name, shape, dim, lo, hi, block, out.device)
            first, last = max(start, lo), min(end, hi)
            out.narrow(dim, pos, last - first).copy_(
                cached[1].narrow(dim, first - lo, last - first))
            pos += last - first
    assert pos == out.shape[dim], f"{name}: ranges cover {pos} of {out.shape[dim]} slabs"
    return out


def _block(std: float, seed: int, name: str, shape: Sequence[int], dim: int, lo: int, hi: int,
           block: int, device: torch.device) -> torch.Tensor:
    """Slabs [lo, hi) along ``dim``, drawn in fp32 in slab-major order from block ``block``'s
    own generator, created on ``device`` so the draw happens where the weight lives."""
    rest = [n for i, n in enumerate(shape) if i != dim]
    gen = torch.Generator(device=device).manual_seed(stable_seed(seed, f"{name}/{block}"))
    values = torch.empty((hi - lo, *rest), dtype=torch.float32, device=device)
    return values.normal_(0.0, std, generator=gen).movedim(0, dim)  # [..., hi - lo, ...]


def _get_device_state(dev: torch.device) -> torch.Tensor:
    if dev.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(dev.type).get_rng_state(dev)


def _set_device_state(dev: torch.device, state: torch.Tensor) -> None:
    if dev.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(dev.type).set_rng_state(state, dev)


def _seed_device(dev: torch.device, seed: int) -> None:
    if dev.type == "cpu":
        torch.manual_seed(seed)
    else:
        torch.get_device_module(dev.type).manual_seed(seed)


def _state_for_seed(dev: torch.device, seed: int) -> torch.Tensor:
    """The device generator state that ``seed`` produces, without disturbing the current one."""
    saved = _get_device_state(dev)
    _seed_device(dev, seed)
    state = _get_device_state(dev)
    _set_device_state(dev, saved)
    return state


class RNGStreams:
    """Named RNG streams on one device; the active one is the device's default generator.

    An explicit object (one per process, owned by the trainer), not a global. ``fork(name)``
    makes a named stream current for the ``with`` body, then stores where it got to and
    restores the default stream.
    """

    def __init__(self, dev: torch.device) -> None:
        self.device = dev
        self._states: dict[str, torch.Tensor] = {}

    @classmethod
    def create(cls, seed: int, tp_rank: int, pp_rank: int, dev: torch.device,
               cp_rank: int = 0) -> RNGStreams:
        """Seed the default stream (CPU and every device) from ``seed``, the pipeline stage
        and the context-parallel rank; add the TP stream, which also differs per TP rank."""
        seed += _PIPELINE_SEED_STRIDE * pp_rank + _CONTEXT_SEED_STRIDE * cp_rank
        torch.manual_seed(seed)
        streams = cls(dev)
        streams.add(MODEL_PARALLEL, seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank)
        return streams

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        self._states[name] = _state_for_seed(self.device, seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL) -> Iterator[None]:
        """Run the body on stream ``name``; the default stream is untouched by it."""
        default = _get_device_state(self.device)
        _set_device_state(self.device, self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_device_state(self.device)
            _set_device_state(self.device, default)

    def stream_states(self) -> dict[str, torch.Tensor]:
        """The named streams only (copies): what activation recompute must replay."""
        return {k: v.clone() for k, v in self._states.items()}

    def set_stream_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {k: v.clone() for k, v in states.items()}

    def get_state(self) -> dict[str, torch.Tensor]:
        """Every stream's state, plus the CPU and device default generators (copies)."""
        state = {f"stream:{k}": v.clone() for k, v in self._states.items()}
        state["cpu"] = torch.get_rng_state()
        if self.device.type != "cpu":
            state["device"] = _get_device_state(self.device)
        return state

    def set_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what ``get_state`` returned (for resume and activation recompute)."""
        torch.set_rng_state(state["cpu"])
        if self.device.type != "cpu":
            _set_device_state(self.device, state["device"])
        self._states = {k.removeprefix("stream:"): v.clone() for k, v in state.items()
                        if k.startswith("stream:")}
