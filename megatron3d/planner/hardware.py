"""The cluster a plan is made for, and every constant of the planner's time and memory model
with where it comes from.

The user states the hardware (``Cluster``, the ``tools/plan_topology.py`` flags; the defaults
are an A100-SXM4-80GB node with NVLink 3 and eight 200 Gb/s HDR InfiniBand links, a DGX A100).
What no datasheet states is measured by others and cited here:

- ``COMPUTE_EFFICIENCY``: the share of the peak a GPU sustains on a transformer layer's
  matmul FLOPs, the kernels between them (norms, softmax, GeLU, dropout) included, in bf16
  with full recompute. Calibrated on one published single-node run, no network involved:
  BigScience's "max possible TFLOPs" check for hidden 14336 (tr11-176B-ml
  chronicles-prequel.md: one node of 8 x A100-80GB, TP 8, 6 layers, 64 heads, 250k
  vocabulary, micro-batch 2, GBS 2048, measured 143.48 and 157.02 TFLOPs). With this value
  the planner gives that run 150 TFLOPs, their mean (``tests/planner/test_bloom.py``); the
  48-node BLOOM figure is then a prediction, not a fit.
- ``NVLINK_EFFICIENCY``: NCCL all-reduce bus bandwidth over the nominal one-direction NVLink
  bandwidth: about 200 GB/s of 300 GB/s on an HPE Apollo 6500 with 8 x A100-80GB (the node
  BLOOM trained on), NVIDIA/nccl-tests issue #149.
- ``NETWORK_EFFICIENCY``: the same between nodes: 84.8 GB/s average bus bandwidth of the
  100 GB/s of four 200 Gb/s HDR links per node, 3 nodes of 8 x A100, nccl-tests issue #119.

The memory model's constants are shared with the start-up fit check, so they live with it,
each with its source, in ``megatron3d/accounting/overheads.py``: the CUDA context (1573 MiB,
BigScience's ``nvidia-smi`` on an A100), an NCCL communicator (688 MiB, 544 MiB for two
ranks: NVIDIA/nccl issue #964, A100 with NVLink), the caching allocator's fragmentation (15%
of reserved memory: GMLake, ASPLOS 2024, eight LLMs on A100-80GB) and a save's staging
(64 MiB, assumed).

Left out, as small at the scales a planner is for: the optimizer step's time (memory-bound,
well under 1% of a step of a 100B+ model), collective latency, and the per-step all-reduces
of sequence-parallel norm gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

COMPUTE_EFFICIENCY = 0.55
NVLINK_EFFICIENCY = 200 / 300
NETWORK_EFFICIENCY = 84.8 / 100

GIB = 2**30
A100_80GB = {"gpu_memory_gb": 80.0, "gpu_peak_tflops": 312.0, "intra_node_gbps": 2400.0,
             "inter_node_gbps": 1600.0}
"""NVIDIA A100 datasheet: 80 GiB, 312 TFLOP/s dense bf16, NVLink 3 600 GB/s both directions
(2400 Gb/s each way); DGX A100: eight 200 Gb/s HDR InfiniBand links for compute traffic."""


@dataclass(frozen=True)
class Cluster:
    """``nodes`` of ``gpus_per_node`` GPUs. gpu_memory_gb: GiB per GPU as ``nvidia-smi``
    lists it; gpu_peak_tflops: dense bf16/fp16 peak; intra_node_gbps: one GPU's NVLink
    bandwidth to the others of its node, one direction, Gb/s; inter_node_gbps: one node's
    network bandwidth, all its links together, one direction, Gb/s."""

    nodes: int
    gpus_per_node: int
    gpu_memory_gb: float = A100_80GB["gpu_memory_gb"]
    gpu_peak_tflops: float = A100_80GB["gpu_peak_tflops"]
    intra_node_gbps: float = A100_80GB["intra_node_gbps"]
    inter_node_gbps: float = A100_80GB["inter_node_gbps"]

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def capacity_bytes(self) -> int:
        return int(self.gpu_memory_gb * GIB)

    @property
    def flops(self) -> float:
        """FLOP/s one GPU sustains on transformer layers."""
        return self.gpu_peak_tflops * 1e12 * COMPUTE_EFFICIENCY

    def ring_bandwidth(self, size: int, stride: int) -> float:
        """Bytes/s each rank of a ring of ``size`` ranks ``stride`` apart in rank order moves
        (Megatron's order: TP ranks adjacent, stride 1; DP ranks stride TP). Inside one node
        NVLink carries it; across nodes the node's links are shared by every group with
        members on the node, and each group's ring crosses them once."""
        per_node = self.gpus_per_node
        if size * stride <= per_node:
            return self.intra_node_gbps / 8 * 1e9 * NVLINK_EFFICIENCY
        members_here = min(size, max(1, per_node // stride))
        return self.inter_node_gbps / 8 * 1e9 * NETWORK_EFFICIENCY * members_here / per_node

    def p2p_bandwidth(self, senders_per_node: int, across_nodes: bool) -> float:
        """Bytes/s of one point-to-point message while ``senders_per_node`` GPUs of a node
        send at once."""
        if not across_nodes:
            return self.intra_node_gbps / 8 * 1e9 * NVLINK_EFFICIENCY
        return (self.inter_node_gbps / 8 * 1e9 * NETWORK_EFFICIENCY
                / min(self.gpus_per_node, senders_per_node))
