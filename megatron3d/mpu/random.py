"""Random numbers that do not depend on the parallel layout, and RNG streams for dropout.

``seeded_normal`` draws every parameter's full initial value from a generator seeded by
(seed, logical name), so a TP/PP/DP model starts identical to the single-process model
whichever rank or pipeline stage builds it.

``RNGStreams`` holds the dropout streams: the device's default generator is the "default"
stream (same seed on every TP rank, for dropout on replicated activations) and named extra
streams, such as "model-parallel" (offset by the TP rank, for dropout on TP-split
activations), are swapped in with ``fork()``. Both are offset by the pipeline rank, as in
Megatron, so stages do not draw the same masks in the same order. Dropout therefore depends
on the layout (initialisation does not). The state is saved in checkpoints and restored for
activation recompute.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence

import torch

MODEL_PARALLEL = "model-parallel"
_MODEL_PARALLEL_SEED_OFFSET = 2718  # keeps the TP stream away from the default seed
_PIPELINE_SEED_STRIDE = 100  # Megatron's per-stage offset of both streams' seeds


def stable_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, name) that is the same in every process and Python run."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def seeded_normal(shape: Sequence[int], std: float, seed: int, name: str,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """N(0, std^2) fp32 CPU tensor that depends only on ``seed``, ``name`` and ``shape``.

    On the "meta" device it only has the shape: the pipeline partitioner builds layers there
    to count parameters without drawing or storing any weight.
    """
    if torch.device(device or "cpu").type == "meta":
        return torch.empty(tuple(shape), dtype=torch.float32, device="meta")
    gen = torch.Generator(device="cpu").manual_seed(stable_seed(seed, name))
    return torch.empty(tuple(shape), dtype=torch.float32).normal_(0.0, std, generator=gen)


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
    def create(cls, seed: int, tp_rank: int, pp_rank: int, dev: torch.device) -> RNGStreams:
        """Seed the default stream (CPU and every device) from ``seed`` and the pipeline
        stage; add the TP stream, which also differs per TP rank."""
        seed += _PIPELINE_SEED_STRIDE * pp_rank
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
