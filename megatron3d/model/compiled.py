"""``--compile``: each transformer layer's computation through ``torch.compile`` (inductor).

What is compiled is ``TransformerLayer._block``, the layer's arithmetic, not the module: the
module's forward stays eager around it, with ZeRO-3's pre/post hooks and the hook on its
output, torch's checkpoint under full recompute, and the pipeline engine's calls. The
embedding and the head stay eager.

Some calls must not be traced; they run eagerly (``eager``) and the layer is compiled as the
regions between them:

- tensor- and sequence-parallel collectives (``mpu/mappings.py``): every collective goes
  through ``mpu/comm.py`` (the traffic observers and flight recorder, gloo's staging of
  device tensors); dynamo would trace them into functional collectives, and the observers
  would then run once at trace time, not at each call;
- a switch of dropout stream (``LayerContext.on_tp_stream``): a stream is the device's
  default generator swapped on the host, which dynamo cannot trace. Inductor draws a graph's
  random numbers from the default generator, so at TP = 1, where no other rank's masks need
  to differ, attention dropout draws from the default stream and needs no switch;
- context-parallel attention (its exchanges are collectives).

At TP = 1 without CP a layer is therefore one graph, with no break (``tests/model/
test_compile.py`` asks ``torch._dynamo.explain``). Masks come from the saved generator states
(a graph draws from the default generator), so a compiled run resumes bitwise. On the CPU
inductor calls torch's own random ops (``fallback_random``): its generated random numbers
cost more there (``benchmarks/README.md``: 3 profiled steps of the large model with dropout
0.1 took 11.7 s with them, 10.4 s with torch's, 10.3 s eager), and hidden dropout's masks
are then eager's. On a GPU its fused Philox numbers are kept: masks differ from eager's.

Shapes are static: a layer sees [s, b, h] with b the micro-batch size, which batch-size
rampup never changes (it changes how many micro-batches a step runs), so nothing recompiles
during a run; evaluation (no grad, eval mode) compiles once more. The layers of a stage
share their graphs (dynamo takes a module's parameters as inputs), so the recompile limit
never falls a deep model back to eager.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def compiled(fn: F) -> F:
    """``fn`` compiled by inductor with static shapes (see the module docstring)."""
    return torch.compile(fn, dynamic=False)


def eager(fn: F) -> F:
    """``fn`` runs eagerly inside compiled code: a boundary between compiled regions."""
    return torch.compiler.disable(fn)


def cache_dir(given: str | None, save: str | None) -> str | None:
    """Where compiled artefacts go: ``--compile-cache-dir``, else TORCHINDUCTOR_CACHE_DIR, else
    SAVE/compile-cache, else None (torch's temporary default)."""
    if given:
        return given
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    return str(Path(save) / "compile-cache") if save else None


def configure(cache: str | None, device: torch.device) -> None:
    """Set the process's inductor up for a run on ``device``: its caches (kernels, FX and
    AOT graphs) in ``cache`` (inductor reads the variable whenever it looks a cache up, so
    this holds from the first compile on), torch's random ops on the CPU (docstring above)."""
    if cache is not None:
        Path(cache).mkdir(parents=True, exist_ok=True)
        os.environ[CACHE_ENV] = cache
    import torch._inductor.config as inductor  # here: importing inductor takes seconds

    inductor.fallback_random = device.type == "cpu"
