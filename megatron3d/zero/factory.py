"""One factory for data parallelism at any ZeRO stage.

It returns the object the optimizer and the training step talk to, whatever the stage:
``shard`` (what this rank's optimizer updates), ``gather_params`` (after the step),
``before_last_backward(chunk)`` / ``finish`` (gradient reduction from each model chunk's last
backward to the step's end), ``observer`` (told the pipeline program; ZeRO-3 plans its gathers
from it), ``values_of`` and ``materialize`` (parameter values for checks, tests and exports),
``flush`` (before reading parameters outside a forward), ``resident_bytes`` and
``secondary_numel`` (the memory report), and the axes the optimizer and checkpoints need:
``norm_axis`` (the DP ranks whose shards hold the stage once; None without ZeRO) and
``replica_axis`` (the ranks holding this rank's shard too: DP without ZeRO, the other nodes
under hybrid ZeRO-3; else None).
"""

from __future__ import annotations

import torch
from torch import nn

from megatron3d.config import ParallelConfig
from megatron3d.mpu.state import AxisGroup
from megatron3d.zero.layout import Counted
from megatron3d.zero.stage01 import Zero01
from megatron3d.zero.stage3.runtime import Zero3

DataParallel = Zero01 | Zero3


def build_data_parallel(params: list[nn.Parameter], layers: list[nn.Module], dp: AxisGroup,
                        parallel: ParallelConfig, counted: Counted,
                        device: torch.device, chunk_sizes: tuple[int, ...] = (),
                        nodes: tuple[AxisGroup, AxisGroup] | None = None) -> DataParallel:
    """Bind ``params`` (a pipeline stage's, in layer order) to the buffers of ZeRO stage
    ``parallel.zero_stage``; ``counted`` says which parameters this rank counts in the norm.
    ``chunk_sizes``: layers per model chunk under interleaving (default: one chunk);
    ``nodes``: ``dp`` cut by node, (dp_intra, dp_inter), for the node-aware ZeRO-3 (None: one
    node)."""
    wire = torch.bfloat16 if parallel.grad_reduce_in_bf16 else torch.float32
    chunk_sizes = chunk_sizes or (len(layers),)
    if parallel.zero_stage == 3:
        return Zero3(layers, dp, parallel, counted, wire, device, chunk_sizes, nodes)
    return Zero01(params, layers, dp, parallel, counted, wire, device, chunk_sizes)
