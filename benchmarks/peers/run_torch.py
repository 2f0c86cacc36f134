"""Worker: one rank of a PyTorch row (DDP, FSDP2, DTensor TP, pipelining) on CPU/gloo."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from benchmarks.peers.batches import load_batches
from benchmarks.peers.record import write_rank
from benchmarks.peers.torch_parallel import BUILDERS
from benchmarks.peers.worker import parse_worker_args


def main() -> None:
    inputs = parse_worker_args()
    dist.init_process_group("gloo")
    batches = load_batches(inputs.batches)
    weights = torch.load(inputs.weights, weights_only=True)
    step = BUILDERS[inputs.row.variant](inputs.cfg, inputs.row, weights)
    losses: list[torch.Tensor | None] = []
    clock = inputs.clock(dist.get_rank())
    dist.barrier()
    clock.start()
    for tokens in batches:
        losses.append(step(tokens))
        clock.tick()
    held = None if losses[0] is None else [float(x) for x in losses]
    # one report per row: TP and DP ranks all hold the loss, rank 0 of them reports it
    reports = held is not None and not (dist.get_rank() > 0 and inputs.row.pp == 1)
    write_rank(inputs.out, dist.get_rank(), held if reports else None, clock)
    dist.barrier()
    # Not destroy_process_group: after FSDP2 rows it aborted now and then in C++ teardown
    # ("terminate called without an active exception", 1 of 5 runs here), failing a row
    # whose every rank had already reported. The reports are written: leave at once.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
