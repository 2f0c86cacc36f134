"""Worker: one rank of a Megatron-Core row: GPTModel under its DDP, (distributed) optimizer
and pipeline schedules, on CPU/gloo through ``mcore_cpu``."""

from __future__ import annotations

from benchmarks.peers import mcore_cpu

mcore_cpu.apply()  # before megatron.core is imported anywhere

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

from benchmarks.peers import mcore_model  # noqa: E402
from benchmarks.peers.batches import load_batches, rank_micro_batches  # noqa: E402
from benchmarks.peers.record import write_rank  # noqa: E402
from benchmarks.peers.worker import parse_worker_args  # noqa: E402


def _forward_step(data_iterator, model):
    """One micro-batch through a chunk; the loss function Megatron's schedule calls on the
    last stage. The schedule divides the returned loss in place by the number of
    micro-batches, so the reported value is a clone."""
    tokens, labels = next(data_iterator)
    s = tokens.shape[1]
    positions = torch.arange(s).unsqueeze(0).expand_as(tokens)
    # given explicitly: the default causal mask would be made with device="cuda"
    future = torch.ones(1, 1, s, s, dtype=torch.bool).triu(diagonal=1)  # True: masked out
    output = model(tokens, positions, future, labels=labels)  # [b, s] per-token loss

    def loss_func(per_token: torch.Tensor):
        loss = per_token.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def main() -> None:
    inputs = parse_worker_args()
    cfg, row = inputs.cfg, inputs.row
    dist.init_process_group("gloo")
    virtual = int(row.option("virtual", "0")) or None
    ps.initialize_model_parallel(row.tp, row.pp, virtual_pipeline_model_parallel_size=virtual)
    mcore_cpu.patch_rng_tracker()
    config = mcore_model.transformer_config(cfg, row)
    weights = torch.load(inputs.weights, weights_only=True)
    distributed = row.option("distributed-optimizer") == "1"
    models = mcore_model.wrap(config, mcore_model.build_chunks(cfg, row, config, weights),
                              distributed)
    opt = mcore_model.optimizer(cfg, models, distributed)
    batches = load_batches(inputs.batches)
    forward_backward = get_forward_backward_func()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    n_micro = cfg.global_batch_size // dp // cfg.micro_batch_size
    losses, clock = [], inputs.clock(dist.get_rank())
    dist.barrier()
    clock.start()
    for tokens in batches:
        micro = rank_micro_batches(tokens, dp_rank, dp, cfg.micro_batch_size)
        for model in models:
            model.zero_grad_buffer()
        opt.zero_grad()
        reports = forward_backward(
            forward_step_func=_forward_step, data_iterator=[iter(micro) for _ in models],
            model=models, num_microbatches=n_micro, seq_length=cfg.seq_length,
            micro_batch_size=cfg.micro_batch_size, forward_only=False)
        opt.step()
        if reports:
            loss = torch.stack([r["lm loss"] for r in reports]).mean()
            dist.all_reduce(loss, group=ps.get_data_parallel_group())
            losses.append(float(loss) / dp)
        clock.tick()
    holds = bool(losses) and ps.get_tensor_model_parallel_rank() == 0 and dp_rank == 0
    write_rank(inputs.out, dist.get_rank(), losses if holds else None, clock)
    dist.barrier()  # no rank may leave while another still waits in a collective
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
