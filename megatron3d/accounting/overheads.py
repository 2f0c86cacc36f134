"""What a CUDA rank holds besides its tensors, each a named constant with its source: the
device overheads of the memory model (``peak.py``), shared by the planner and the start-up
fit check.

- ``CUDA_CONTEXT_BYTES``: what a process shows in ``nvidia-smi`` before allocating anything
  (the CUDA context and the kernels loaded with it): 1573 MiB on an A100 (BigScience,
  bigscience-workshop/bigscience train/tr11-176B-ml/chronicles-prequel.md: one tensor put on
  the GPU, then ``nvidia-smi``).
- ``NCCL_GROUP_BYTES`` and ``NCCL_PAIR_BYTES``: the device memory one NCCL communicator
  takes once it has run a collective: its per-channel, per-peer buffers of three protocols
  (``NCCL_BUFFSIZE`` 4 MiB for Simple, 4.69 MiB for LL128, 512 KiB for LL: NCCL's
  src/init.cc ``DEFAULT_*BUFFSIZE``) times the channels and ring/tree peers it connects.
  Measured with PyTorch on 4 x A100 with NVLink, one all-reduce per group: 688 MiB for a
  group of more than two GPUs, 544 MiB for two (NVIDIA/nccl issue #964). Every process group
  a rank runs NCCL collectives or batched point-to-point on is one communicator
  (``nccl_groups``); PyTorch creates each at its first use and keeps it. Every phase counts
  them all (the build has used only some: a margin there).
- ``ALLOCATOR_FRAGMENTATION``: PyTorch's caching allocator keeps what ``nvidia-smi`` shows
  (reserved memory), more than the tensors alive at the peak (allocated): freed blocks that
  later requests of other sizes cannot reuse. Over eight LLM training workloads on
  A100-80GB (recompute, ZeRO, LoRA) the reserved memory no tensor used was 15% of it on
  average, up to 33% (GMLake, Guo et al., ASPLOS 2024: the fragmentation its virtual-memory
  stitching removes). The model reserves allocated / (1 - 0.15).
- ``SAVE_STAGING_BYTES``: what a checkpoint save adds on the device: at most 64 MiB, the save
  path streaming each rank's chunks to host memory (an assumption of the model, not a
  measurement).

On the CPU (gloo, the tests) none of these apply: no CUDA context, no NCCL, and glibc's
allocator returns large freed blocks to the system.
"""

from __future__ import annotations

MIB = 2**20
CUDA_CONTEXT_BYTES = 1573 * MIB
NCCL_GROUP_BYTES = 688 * MIB
NCCL_PAIR_BYTES = 544 * MIB
ALLOCATOR_FRAGMENTATION = 0.15
SAVE_STAGING_BYTES = 64 * MIB


def nccl_groups(tp: int, pp: int, dp: int, tied: bool, pp_rank: int,
                cp: int = 1) -> dict[str, int]:
    """The process groups pipeline rank ``pp_rank`` of a layout runs NCCL on, name -> size:
    the world (the config check at start, the exit watch each step), TP (the layers'
    collectives), PP (activations, batched point-to-point), DP (gradients, the loss),
    model-parallel (the gradient norm) and, with tied embeddings, the embedding group of the
    first and last stage; with context parallelism also CP (attention's exchange) and DP x CP
    (the gradients of the weights' replicas; DP keeps the loss). A group of one rank runs
    nothing."""
    groups = {"world": tp * pp * dp * cp, "tp": tp, "pp": pp, "dp": dp, "cp": cp,
              "dp-cp": dp * cp if cp > 1 else 1, "model-parallel": tp * pp,
              "embedding": 2 if tied and pp > 1 and pp_rank in (0, pp - 1) else 1}
    return {name: size for name, size in groups.items() if size > 1}


def nccl_bytes(groups: dict[str, int]) -> int:
    """Device memory of the communicators of ``groups`` (``nccl_groups``)."""
    return sum(NCCL_PAIR_BYTES if size == 2 else NCCL_GROUP_BYTES for size in groups.values())


def reserved(allocated: int, device_type: str) -> int:
    """What the allocator holds when ``allocated`` bytes of tensors are alive at the peak:
    their bytes and the fragmentation on top (CUDA's caching allocator; none on the CPU)."""
    if device_type != "cuda":
        return allocated
    return round(allocated / (1 - ALLOCATOR_FRAGMENTATION))
