"""How long one training step of a layout takes, and the TFLOPs per GPU that gives.

Per micro-batch and virtual stage (one model chunk of one pipeline rank):

- compute: the chunk's matmul FLOPs (``training.flops``, per operation: forward, backward
  twice the forward, recompute once more for full recompute or the attention core for
  selective) at ``Cluster.flops`` (the sustained share of the peak);
- tensor parallelism: Megatron's all-reduces of a [s, b, h] activation, not overlapped:
  two per layer forward, two backward, two more when the layer is recomputed; one for the
  input embedding (forward) and one for the LM head (backward). Sequence parallelism turns
  each into a reduce-scatter and an all-gather: the same bytes;
- pipeline: one [s, b, h] message (its 1/TP shard under sequence parallelism) sent with the
  forward and one with the backward; all GPUs of a node send at once;
- context parallelism: each rank computes s/C tokens of each sequence (the attention of its
  queries against the whole sequence: 1/C of the work, balanced by the chunk layout), and
  each layer's attention exchanges what ``accounting/context_parallel.exchange_bytes`` says
  over the CP ring (its ranks TP apart): the p2p ring overlapped with the attention core
  (only what exceeds it shows), all_gather and a2a not; a recomputed layer or attention
  core exchanges its forward again.

Every stage runs at the pace of the slowest, so the pipeline takes
``(m * v + p - 1) * (F + B)`` for m micro-batches, p ranks of v chunks and the slowest
chunk's F and B: the makespan ``pipeline.simulate`` gives for the real 1F1B, GPipe and
interleaved programs (``tests/planner/test_timing.py``). Then what is not hidden:

- ZeRO-0/1 (over DP x CP, the weights' replicas): the data-parallel gradient reduction
  (all-reduce, or reduce-scatter) starts during the last backward and hides behind it;
  ZeRO-1's parameter all-gather after the step unless ``--overlap-param-gather``;
- ZeRO-3: each chunk's parameters are all-gathered for the forward and again for the
  backward (once a step with ``--zero3-reshard-after-forward false``) and its gradients
  reduce-scattered, per micro-batch; with prefetch they overlap the compute. Across nodes
  (``accounting/nodes.py``) each hop runs over its own group's ring: the node's replicas on
  NVLink, one replica per node on the node's network share; the hybrid's per-step
  all-reduce across nodes is not hidden;
- the sum of the tied embedding copies of the first and last stages.

Hardware TFLOPs count recomputation, as the iteration line and BigScience's figures do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatron3d.accounting.context_parallel import Split, exchange_bytes
from megatron3d.accounting.flops import (
    attention_core_flops_per_token,
    flops_per_iteration,
    layer_forward_flops_per_token,
)
from megatron3d.accounting.nodes import Collective, Nodes, group_size, received, zero3_collectives
from megatron3d.accounting.placement import Placement
from megatron3d.config import TrainConfig
from megatron3d.model.gpt import layer_table
from megatron3d.optim.batch_schedule import BatchSchedule
from megatron3d.planner.hardware import Cluster
from megatron3d.planner.layout import Layout

FP32 = 4


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step at the final global batch size, and the rate it gives."""

    forward_s: float  # the slowest chunk, one micro-batch
    backward_s: float
    pipeline_s: float  # the whole 1F1B program, bubble included
    bubble_s: float
    exposed_comm_s: float  # data-parallel and tied-embedding traffic not hidden
    iteration_s: float
    tflops_per_gpu: float
    cross_node_bytes: float | None = None  # ZeRO-3's, per rank (accounting/nodes.py)


def head_flops_per_token(cfg: TrainConfig, padded_vocab: int) -> float:
    """Forward FLOPs of the LM head for one token: ``flops_per_iteration`` of the model
    without transformer layers."""
    model = cfg.model
    head = flops_per_iteration(dataclasses.replace(model, num_layers=0), 1, padded_vocab)
    return head.model / 3 / model.seq_length


def step_time(cfg: TrainConfig, layout: Layout, where: Placement, cluster: Cluster,
              padded_vocab: int, nodes: Nodes | None = None) -> StepTime:
    """The step of ``cfg`` (``layout`` applied) on ``cluster``; ``nodes``: where the weights'
    replicas sit (None: as if on one node, for a layout spreading them unevenly)."""
    model, parallel = cfg.model, cfg.parallel
    tp, pp, dp, v = layout.tp, layout.pp, layout.dp, layout.virtual
    nodes_or_one = nodes or Nodes(count=1, per_node=layout.replicas)
    schedule = BatchSchedule.from_config(cfg.training, dp)
    m = schedule.global_batch_size // schedule.samples_per_micro_batch_step
    tokens = layout.micro_batch_size * model.seq_length // layout.cp  # this rank's
    e = getattr(torch, cfg.precision.params_dtype_name).itemsize
    message = e * tokens * model.hidden_size  # one [s, b, h] activation
    all_reduce = 0.0 if tp == 1 else 2 * (tp - 1) / tp * message / cluster.ring_bandwidth(tp, 1)
    p2p = 0.0
    if pp > 1:
        senders = tp * layout.cp * dp
        p2p = (message / (tp if parallel.sequence_parallel else 1)
               / cluster.p2p_bandwidth(senders, senders * pp > cluster.gpus_per_node))
    layer = layer_forward_flops_per_token(model) * tokens / tp
    head = head_flops_per_token(cfg, padded_vocab) * tokens / tp
    extra = {"none": 0.0, "full": layer,
             "selective": attention_core_flops_per_token(model) * tokens / tp}[layout.recompute]
    recomputed = 2 if layout.recompute == "full" else 0
    cp_forward, cp_backward = _context_parallel(cfg, layout, cluster, e)
    zero3 = _Zero3Traffic(cfg, layout, cluster, e, nodes_or_one, m)
    forwards, backwards = [], []
    for names in where.virtual_stages:
        n, with_head = names.count("TransformerLayer"), "OutputEmbedding" in names
        work = n * layer + with_head * head
        fwd = (work / cluster.flops + (2 * n + ("InputEmbedding" in names)) * all_reduce + p2p
               + n * cp_forward)
        bwd = ((2 * work + n * extra) / cluster.flops
               + (2 * n + with_head + recomputed * n) * all_reduce + p2p + n * cp_backward)
        forwards.append(zero3.forward(fwd, names))
        backwards.append(zero3.backward(bwd, names))
    fwd, bwd = max(forwards), max(backwards)
    pipeline = pipeline_seconds(m, pp, v, fwd, bwd)
    after_step, across = zero3.after_step(where)
    exposed = _exposed_data_parallel(cfg, layout, where, cluster, e, bwd) + _tied(
        cfg, layout, cluster, padded_vocab) + after_step
    iteration = pipeline + exposed
    flops = flops_per_iteration(model, schedule.global_batch_size, padded_vocab).hardware
    return StepTime(fwd, bwd, pipeline, (pp - 1) * (fwd + bwd), exposed, iteration,
                    flops / (iteration * cluster.world_size * 1e12),
                    across if layout.zero_stage == 3 and nodes is not None else None)


def _context_parallel(cfg: TrainConfig, layout: Layout, cluster: Cluster,
                      param_bytes: int) -> tuple[float, float]:
    """Seconds one layer's CP exchange adds to its forward and to its backward (the forward
    exchange again when the attention core is recomputed)."""
    if layout.cp == 1:
        return 0.0, 0.0
    split = Split(cfg.model, layout.micro_batch_size, layout.tp, layout.cp,
                  cfg.parallel.cp_comm_type, param_bytes)
    bandwidth = cluster.ring_bandwidth(layout.cp, layout.tp)
    forward, backward = (size / bandwidth for size in exchange_bytes(split))
    if split.comm_type == "p2p":  # hidden behind the attention of the chunk in hand
        core = (attention_core_flops_per_token(cfg.model) * layout.micro_batch_size
                * split.local_tokens / layout.tp / cluster.flops)
        forward, backward = max(0.0, forward - core), max(0.0, backward - 2 * core)
    return forward, backward + (forward if layout.recompute != "none" else 0.0)


def pipeline_seconds(micro_batches: int, stages: int, chunks: int, forward: float,
                     backward: float) -> float:
    """The makespan of a pipeline program whose every chunk takes ``forward`` and
    ``backward`` per micro-batch: ``(m * v + p - 1) * (F + B)``."""
    return (micro_batches * chunks + stages - 1) * (forward + backward)


def _stage_params(cfg: TrainConfig, names: tuple[str, ...], tp: int) -> float:
    """Parameters of a chunk of layers ``names`` on one TP rank (split evenly); a tied head
    on the embedding's chunk is that same parameter, counted once."""
    all_names, counts = layer_table(cfg.model)
    per_type = dict(zip(all_names, counts, strict=True))
    tied = cfg.model.tie_embeddings and {"InputEmbedding", "OutputEmbedding"} <= set(names)
    return (sum(per_type[name] for name in names)
            - (per_type["OutputEmbedding"] if tied else 0)) / tp


@dataclass(frozen=True)
class _Zero3Traffic:
    """ZeRO-3's gathers and reductions of a chunk (``accounting/nodes.py``: flat, hybrid or
    with a secondary shard), each over its group's ring bandwidth: per micro-batch in the
    forward and backward, overlapped with their compute when prefetching (a step's one
    cross-node gather of the secondary shard spread over its micro-batches), and the
    hybrid's all-reduce across nodes after the last backward, not hidden."""

    cfg: TrainConfig
    layout: Layout
    cluster: Cluster
    param_bytes: int
    nodes: Nodes
    micro_batches: int

    def collectives(self, names: tuple[str, ...]) -> list[Collective]:
        if self.layout.zero_stage != 3:
            return []
        return zero3_collectives(_stage_params(self.cfg, names, self.layout.tp),
                                 self.cfg.parallel, self.nodes, self.micro_batches,
                                 self.param_bytes)

    def seconds(self, names: tuple[str, ...], phase: str) -> float:
        spread = 1 if phase == "step" else self.micro_batches
        return sum(c.times / spread * self._ring(c) for c in self.collectives(names)
                   if c.phase == phase)

    def _ring(self, c: Collective) -> float:
        size = group_size(c.group, self.nodes)
        stride = self.layout.tp * (self.nodes.per_node if c.group == "dp_inter" else 1)
        passes = 2 if c.kind == "all_reduce" else 1
        return passes * (size - 1) / size * c.nbytes / self.cluster.ring_bandwidth(size, stride)

    def _combine(self, compute: float, comm: float) -> float:
        overlap = self.cfg.parallel.zero3_prefetch_depth > 0
        return max(compute, comm) if overlap else compute + comm

    def forward(self, compute: float, names: tuple[str, ...]) -> float:
        return self._combine(compute, self.seconds(names, "forward"))

    def backward(self, compute: float, names: tuple[str, ...]) -> float:
        return self._combine(compute, self.seconds(names, "backward"))

    def after_step(self, where: Placement) -> tuple[float, float]:
        """(seconds of the per-step collectives, bytes a rank receives from other nodes per
        step), on the pipeline rank with the most of both."""
        ranks = range(self.layout.pp)
        return (max(sum(self.seconds(names, "step") for names in where.chunk_names(r))
                    for r in ranks),
                max(sum(received(self.collectives(names), self.nodes).inter
                        for names in where.chunk_names(r)) for r in ranks))


def _exposed_data_parallel(cfg: TrainConfig, layout: Layout, where: Placement,
                           cluster: Cluster, param_bytes: int, backward: float) -> float:
    """ZeRO-0/1's end-of-step traffic that the last backward does not hide, on the rank
    with the most parameters."""
    dp = layout.replicas
    if dp == 1 or layout.zero_stage == 3:
        return 0.0
    parallel = cfg.parallel
    wire = 2 if parallel.grad_reduce_in_bf16 else FP32
    params = max(sum(_stage_params(cfg, names, layout.tp) for names in where.chunk_names(r))
                 for r in range(layout.pp))
    bandwidth = cluster.ring_bandwidth(dp, layout.tp)
    share = (dp - 1) / dp * params / bandwidth
    if layout.zero_stage == 0:
        return max(0.0, 2 * share * wire - backward)
    gather = 0.0 if parallel.overlap_param_gather else share * param_bytes
    return max(0.0, share * wire - backward) + gather


def _tied(cfg: TrainConfig, layout: Layout, cluster: Cluster, padded_vocab: int) -> float:
    """The all-reduce of the tied word-embedding gradients (fp32, this rank's ZeRO share)
    between the first and the last pipeline stage."""
    if layout.pp == 1 or not cfg.model.tie_embeddings:
        return 0.0
    share = layout.replicas if layout.zero_stage else 1
    numel = padded_vocab // layout.tp * cfg.model.hidden_size / share
    stride = layout.tp * layout.replicas * (layout.pp - 1)
    return numel * FP32 / cluster.ring_bandwidth(2, stride)
