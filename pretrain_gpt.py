"""Pre-train a GPT: parse -> validate -> join the process group -> build -> train.

Launch with ``python pretrain_gpt.py ...`` (one process) or ``torchrun ... pretrain_gpt.py``;
flags follow Megatron-DeepSpeed (``--help`` lists them). Bad input exits with code 2 and one
line saying what to fix, before any process group or model exists.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from megatron3d import device as devices
from megatron3d.accounting import fit
from megatron3d.checkpoint.loading import with_checkpoint_args
from megatron3d.checkpoint.safety import check_paths
from megatron3d.cli.arguments import format_config, parse_given
from megatron3d.config import TrainConfig
from megatron3d.data.builder import check_sources_exist, parse_data_path
from megatron3d.errors import Megatron3dError, TrainingError
from megatron3d.log import get_logger, setup_logging
from megatron3d.mpu import traffic
from megatron3d.mpu.state import ParallelState
from megatron3d.mpu.topology import Topology
from megatron3d.optim.batch_schedule import BatchSchedule
from megatron3d.resilience.failure_board import PEER_EXIT_CODE, FailureBoard
from megatron3d.resilience.flight_recorder import FlightRecorder
from megatron3d.resilience.watchdog import Watchdog
from megatron3d.training.build import Overrides, build_trainer, run_length, valid_samples
from megatron3d.training.data_setup import dry_run
from megatron3d.training.loop import Hooks
from megatron3d.validation import validate

logger = get_logger("pretrain_gpt")


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()  # --exit-duration-in-mins counts start-up and loading too
    try:
        cfg, notices, given = parse_given(argv)
        cfg, checkpoint_notices = with_checkpoint_args(cfg, given)
        notices = notices + checkpoint_notices
        env = devices.launch_env()  # after parsing, so --help works under any launcher
        if cfg.parallel.print_topology:  # a planning aid: only the layout must be valid
            table = Topology(env.world_size, cfg.parallel.tensor_model_parallel_size,
                             cfg.parallel.pipeline_model_parallel_size).table()
            if env.rank == 0:
                sys.stdout.write(table + "\n")
            return 0
        validate(cfg, env.world_size)
        devices.check_rendezvous_env(env)
        if not cfg.data.mock_data:  # flags checked: now the files they name
            check_sources_exist(parse_data_path(cfg.data.data_path, cfg.data.data_path_file))
        if cfg.data.dry_run_data:
            sys.stdout.write(_dry_run(cfg, env.world_size) + "\n")
            return 0
        fit.check_fits(cfg, env.world_size, devices.memory_capacity(env),
                       "cuda" if devices.accelerator_available() else "cpu")
        check_paths(cfg.checkpoint, cfg.training.skip_train)  # before hang dumps go under --save
        backend = devices.resolve_backend(cfg.parallel.distributed_backend, env)
    except Megatron3dError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    dev = devices.set_device(env.local_rank)
    store = devices.init_process_group(env, cfg.resilience.distributed_timeout_minutes, backend)
    board = FailureBoard(store, env.rank)
    recorder = FlightRecorder(cfg.resilience.flight_recorder_size, devices.stream_marker(dev))
    with traffic.observing(recorder):
        state = ParallelState.build(cfg.parallel.tensor_model_parallel_size,
                                    cfg.parallel.pipeline_model_parallel_size)
        watchdog = Watchdog.for_run(cfg, state, recorder, board).start()
        try:
            return _train(cfg, state, dev, started, watchdog, notices)
        finally:
            watchdog.stop()
            dist.destroy_process_group()


def _train(cfg: TrainConfig, state: ParallelState, dev: torch.device, started: float,
           watchdog: Watchdog, notices: list[str]) -> int:
    """Build and run. Bad input met anywhere (set-up, a batch, a save) exits 2 and a run that
    went wrong (non-finite gradients or weights) exits 1, each with one line, and the peers
    are told to stop; a peer's failure exits 2 with one line saying so; anything unexpected
    leaves a hang dump and its traceback."""
    try:
        setup_logging(state.world_rank, log_rank=state.world_size - 1)
        for notice in notices:  # Megatron flags aliased or ignored (cli/compat.py), dropout
            # flags that differ from the checkpoint's (--use-checkpoint-args)
            logger.info("notice: %s", notice)
        logger.info(format_config(cfg, state.world_size))
        logger.info(state.topology.table())
        logger.info("device: %s", devices.describe(dev))
        overrides = Overrides(hooks=Hooks(heartbeat=watchdog), observers=(watchdog.recorder,))
        build_trainer(cfg, state, dev, started, overrides).run()
    except Megatron3dError as err:
        sys.stderr.write(f"error: {err}\n")
        sys.stderr.flush()
        watchdog.board.post()
        return 1 if isinstance(err, TrainingError) else 2
    except Exception as exc:  # a peer failed, or died, inside a collective
        if watchdog.board.stop_for_peer():
            return PEER_EXIT_CODE
        if not watchdog.fired:
            first = (str(exc).splitlines() or [""])[0][:160]
            path = watchdog.dump(f"exception: {type(exc).__name__}: {first}")
            logger.error("rank %d wrote %s", state.world_rank, path)
        raise
    return 0


def _dry_run(cfg: TrainConfig, world_size: int) -> str:
    """What --data-path would draw from each source over this run, without training."""
    schedule = BatchSchedule.from_config(cfg.training, cfg.parallel.data_parallel_size(world_size))
    _, samples = run_length(cfg, schedule)
    return dry_run(cfg, samples, valid_samples(cfg, schedule))


if __name__ == "__main__":
    sys.exit(main())
