"""The PyTorch rows: the plain GPT-2 put under DDP, FSDP2 (flat or hybrid), DTensor tensor
parallelism or ``torch.distributed.pipelining``, each as a ``step(tokens) -> loss`` over one
global batch.

Each builder takes the whole model's megatron3d weights, keeps what its rank holds, and
returns the step; the loss it returns is the global batch's mean (None on a pipeline stage
that does not compute it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from benchmarks.peers.batches import rank_micro_batches
from benchmarks.peers.config import PeerConfig, Row
from benchmarks.peers.gpt2 import GPT2, lm_loss
from benchmarks.peers.names import stage_state
from benchmarks.peers.torch_optim import adamw, clip_grads

Step = Callable[[torch.Tensor], "torch.Tensor | None"]
Weights = dict[str, torch.Tensor]


def _loaded(model: GPT2, weights: Weights) -> GPT2:
    model.load_state_dict(stage_state(list(model.state_dict()), weights))
    return model


def _accumulate(model: torch.nn.Module, micro: list[tuple[torch.Tensor, torch.Tensor]],
                no_sync: Callable[[], contextlib.AbstractContextManager] | None = None
                ) -> torch.Tensor:
    """Forward and backward every micro-batch; gradients of their mean loss. ``no_sync``
    (DDP) holds the gradient reduction back until the last micro-batch."""
    total = torch.zeros(())
    for i, (tokens, labels) in enumerate(micro):
        last = i == len(micro) - 1
        with contextlib.nullcontext() if last or no_sync is None else no_sync():
            loss = lm_loss(model(tokens), labels) / len(micro)
            loss.backward()
        total += loss.detach()
    return total


@contextlib.contextmanager
def _all_reduce_held(model: FSDPModule) -> Iterator[None]:
    """HSDP without its all-reduce across replicas: gradients stay reduce-scattered (and
    accumulate) until a micro-batch outside the block."""
    model.set_requires_all_reduce(False)
    try:
        yield
    finally:
        model.set_requires_all_reduce(True)


def data_parallel(cfg: PeerConfig, row: Row, weights: Weights) -> Step:
    """DDP (replicas, gradients all-reduced in buckets) or FSDP2 (``fully_shard`` per block
    and at the root: parameters, gradients and optimizer state sharded). FSDP2 hybrid
    (HSDP): a (replicate, shard) mesh of the row's nodes, sharded within a node and
    replicated across; its best setting for accumulation: each micro-batch's gradients
    reduce-scattered in the node, the all-reduce across nodes only on the last one
    (``set_requires_all_reduce``)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    model = _loaded(GPT2(cfg), weights)
    if row.variant.startswith("FSDP2"):
        nodes = int(row.option("nodes", "1"))
        mesh = (init_device_mesh("cpu", (nodes, size // nodes),
                                 mesh_dim_names=("replicate", "shard"))
                if nodes > 1 else init_device_mesh("cpu", (size,)))
        for block in model.blocks.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        group = mesh.get_group("shard") if nodes > 1 else mesh.get_group()
        wrapped, no_sync = model, (lambda: _all_reduce_held(model)) if nodes > 1 else None
    else:
        ddp = DistributedDataParallel(model)
        wrapped, no_sync, group = ddp, ddp.no_sync, None
    params = list(model.parameters())
    optimizer = adamw(cfg, params)

    def step(tokens: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        micro = rank_micro_batches(tokens, rank, size, cfg.micro_batch_size)
        loss = _accumulate(wrapped, micro, no_sync)
        clip_grads(params, cfg.clip_grad, group)
        optimizer.step()
        dist.all_reduce(loss)
        return loss / size

    return step


def tensor_parallel(cfg: PeerConfig, row: Row, weights: Weights) -> Step:
    """DTensor TP in Megatron's pattern: QKV and fc1 split by columns (whole heads per rank),
    the attention and fc2 output projections by rows. Embeddings, norms and the tied head
    stay replicated, so every rank computes the whole loss."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _loaded(GPT2(cfg), weights)
    plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
            "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
    for block in model.blocks.values():
        parallelize_module(block, mesh, plan)
    params = list(model.parameters())
    optimizer = adamw(cfg, params)

    def step(tokens: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = _accumulate(model, rank_micro_batches(tokens, 0, 1, cfg.micro_batch_size))
        clip_grads(params, cfg.clip_grad, mesh.get_group(), replica_rank=mesh.get_local_rank())
        optimizer.step()
        return loss

    return step


def pipeline(cfg: PeerConfig, row: Row, weights: Weights) -> Step:
    """``torch.distributed.pipelining``: the layers cut into PP x v stages, rank r holding
    stages r, r + PP, ... (v = 2 for the interleaved schedule). The tied head on the last
    stage is a copy of the first stage's embedding: their gradients are summed each step,
    so both copies take the same update, and the norm counts the embedding once."""
    rank, pp = dist.get_rank(), dist.get_world_size()
    interleaved = "interleaved" in row.variant
    virtual = 2 if interleaved else 1
    num_stages = pp * virtual
    per_stage = cfg.num_layers // num_stages
    modules, stages = [], []
    for index in range(rank, num_stages, pp):
        module = _loaded(GPT2(cfg, range(index * per_stage, (index + 1) * per_stage),
                              first=index == 0, last=index == num_stages - 1), weights)
        modules.append(module)
        stages.append(PipelineStage(module, index, num_stages, torch.device("cpu")))
    n_micro = cfg.global_batch_size // cfg.micro_batch_size
    schedule = (ScheduleInterleaved1F1B(stages, n_micro, loss_fn=lm_loss) if interleaved
                else Schedule1F1B(stages[0], n_micro, loss_fn=lm_loss))
    firsts = [m.wte.weight for m in modules if m.first]
    copies = tuple(m.head.weight for m in modules if m.last and not m.first)
    tied = firsts + list(copies)
    assert len(tied) == 1, "PP = 2: the first and the last stage are on different ranks"
    params = [p for m in modules for p in m.parameters()]
    optimizer = adamw(cfg, params)
    holds_loss = any(m.last for m in modules)

    def step(tokens: torch.Tensor) -> torch.Tensor | None:
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        if rank == 0:
            schedule.step(inputs, target=labels, losses=losses)
        else:
            schedule.step(target=labels, losses=losses)
        dist.all_reduce(tied[0].grad)  # the embedding and its copy on the last stage
        clip_grads(params, cfg.clip_grad, dist.group.WORLD, copies=copies)
        optimizer.step()
        return torch.stack(losses).mean() if holds_loss else None

    return step


BUILDERS: dict[str, Callable[[PeerConfig, Row, Weights], Step]] = {
    "DDP": data_parallel, "FSDP2": data_parallel, "FSDP2 hybrid": data_parallel,
    "DTensor TP": tensor_parallel,
    "pipelining 1F1B": pipeline, "pipelining interleaved 1F1B": pipeline}
