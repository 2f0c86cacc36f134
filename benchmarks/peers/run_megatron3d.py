"""Worker: one rank of a megatron3d row, driven as ``pretrain_gpt.py`` would be.

Weights come from the seed (every layout draws the same logical weights) and batches from
``--mock-data`` (the same samples ``batches.py`` writes). Each rank counts the bytes it
receives from other nodes (``CrossNodeCounter``; nodes as ``--gpus-per-node`` or the launch
says) and reports its last step's. The reference row also writes its
initial logical weights: the file every peer loads.
"""

from __future__ import annotations

import torch

from benchmarks.peers.config import FLAG_OPTIONS, REFERENCE, PeerConfig, Row
from benchmarks.peers.record import write_rank
from benchmarks.peers.worker import parse_worker_args
from megatron3d import device as devices
from megatron3d.cli.arguments import parse_args
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.sharding import gather_logical
from megatron3d.mpu.state import ParallelState
from megatron3d.mpu.traffic import CrossNodeCounter, observing
from megatron3d.training.build import Overrides, build_trainer
from megatron3d.training.loop import Hooks, Trainer
from megatron3d.training.step import StepResult
from megatron3d.validation import validate


def megatron3d_argv(cfg: PeerConfig, row: Row) -> list[str]:
    """The ``pretrain_gpt.py`` flags of ``row`` (no evaluation, no logging between steps)."""
    argv = ["--num-layers", cfg.num_layers, "--hidden-size", cfg.hidden_size,
            "--num-attention-heads", cfg.num_heads, "--seq-length", cfg.seq_length,
            "--max-position-embeddings", cfg.seq_length, "--vocab-size", cfg.vocab_size,
            "--make-vocab-size-divisible-by", 128, "--mock-data", "--seed", cfg.seed,
            "--micro-batch-size", cfg.micro_batch_size,
            "--global-batch-size", cfg.global_batch_size, "--train-iters", cfg.steps,
            "--lr", cfg.lr, "--min-lr", cfg.lr, "--lr-decay-style", "constant",
            "--lr-warmup-iters", 0, "--adam-beta1", cfg.beta1, "--adam-beta2", cfg.beta2,
            "--adam-eps", cfg.eps, "--weight-decay", cfg.weight_decay,
            "--clip-grad", cfg.clip_grad, "--init-method-std", cfg.init_std,
            "--layernorm-epsilon", cfg.layernorm_eps, "--hidden-dropout", 0,
            "--attention-dropout", 0, "--eval-iters", 0, "--eval-interval", 10**6,
            "--log-interval", 10**6,
            "--tensor-model-parallel-size", row.tp, "--pipeline-model-parallel-size", row.pp,
            "--zero-stage", row.option("zero", "0")]
    if row.option("virtual"):
        argv += ["--virtual-pipeline-model-parallel-size", row.option("virtual")]
    for name, value in row.options:
        if name in FLAG_OPTIONS:
            argv += [f"--{name}", *([value] if FLAG_OPTIONS[name] else [])]
    return [str(a) for a in argv]


def initial_weights(trainer: Trainer, state: ParallelState) -> dict[str, torch.Tensor]:
    """Every logical weight of this (whole-model) rank, before any step."""
    weights: dict[str, torch.Tensor] = {}

    def grab(group: list) -> None:
        weights.update((get_meta(p).name, gather_logical(p, state.tp).clone()) for p in group)

    trainer.model.data_parallel.materialize(grab)
    return weights


def main() -> None:
    inputs = parse_worker_args()
    env = devices.launch_env()
    devices.init_process_group(env)
    cfg = parse_args(megatron3d_argv(inputs.cfg, inputs.row))
    validate(cfg, env.world_size)
    state = ParallelState.for_config(cfg.parallel)
    losses: list[torch.Tensor] = []
    clock = inputs.clock(env.rank)
    across = CrossNodeCounter(state.ranks_per_node, env.rank)
    per_step: list[int] = []  # bytes this rank received from other nodes, each step

    def on_step(_: int, result: StepResult) -> None:
        losses.append(result.loss)
        per_step.append(across.total_bytes())
        across.reset()
        clock.tick()

    trainer = build_trainer(cfg, state, torch.device("cpu"),
                            overrides=Overrides(hooks=Hooks(on_step=on_step)))
    if inputs.row == REFERENCE:
        torch.save(initial_weights(trainer, state), inputs.weights)
    torch.distributed.barrier()
    clock.start()
    with observing(across):
        trainer.run()
    holds_loss = state.is_last_stage and state.tp.rank == 0 and state.dp.rank == 0
    write_rank(inputs.out, env.rank, [float(x) for x in losses] if holds_loss else None,
               clock, per_step[-1] if per_step else None)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
