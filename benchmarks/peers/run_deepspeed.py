"""Worker: one rank of a DeepSpeed row (ZeRO-1, ZeRO-3 or PipelineModule) on CPU/gloo;
DeepSpeed picks its CPU accelerator and gloo by itself."""

from __future__ import annotations

import deepspeed
import torch
import torch.distributed as dist

from benchmarks.peers import ds_model
from benchmarks.peers.batches import load_batches, rank_micro_batches
from benchmarks.peers.gpt2 import lm_loss
from benchmarks.peers.record import write_rank
from benchmarks.peers.worker import parse_worker_args


def main() -> None:
    inputs = parse_worker_args()
    cfg, row = inputs.cfg, inputs.row
    deepspeed.init_distributed(dist_backend="gloo")
    weights = torch.load(inputs.weights, weights_only=True)
    batches = load_batches(inputs.batches)
    rank, size = dist.get_rank(), dist.get_world_size()
    pipelined = row.pp > 1
    engine = (ds_model.pipeline_engine if pipelined else ds_model.zero_engine)(cfg, row, weights)
    losses, clock = [], inputs.clock(rank)
    dist.barrier()
    clock.start()
    for tokens in batches:
        if pipelined:  # the whole batch: the engine draws its micro-batches from the iterator
            micro = rank_micro_batches(tokens, 0, 1, cfg.micro_batch_size)
            losses.append(float(engine.train_batch(iter(micro))))
        else:
            total = torch.zeros(())
            micro = rank_micro_batches(tokens, rank, size, cfg.micro_batch_size)
            for inputs_, labels in micro:
                loss = lm_loss(engine(inputs_), labels)
                engine.backward(loss)  # scaled by 1/accumulation steps inside
                engine.step()  # a no-op until the last micro-batch of the step
                total += loss.detach() / len(micro)
            dist.all_reduce(total)
            losses.append(float(total) / size)
        clock.tick()
    write_rank(inputs.out, rank, losses if rank == size - 1 else None, clock)
    dist.barrier()  # DeepSpeed's exit needs every rank past its last collective
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
