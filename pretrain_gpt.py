"""Pre-train a GPT: parse -> validate -> join the process group -> build -> train.

Launch with ``python pretrain_gpt.py ...`` (one process) or ``torchrun ... pretrain_gpt.py``;
flags follow Megatron-DeepSpeed (``--help`` lists them). Bad input exits with code 2 and one
line saying what to fix, before any process group or model exists. ``--print-topology``
makes the same checks (all but the memory fit and the backend, which need the compute node's
devices) and prints the rank table instead of starting: ``LAUNCH_DRY_RUN=1`` of
``scripts/slurm/launch.sh`` runs it for the allocation's world size.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron3d import device as devices
from megatron3d.accounting import fit
from megatron3d.checkpoint.loading import with_checkpoint_args
from megatron3d.checkpoint.safety import check_output_dir, check_paths, check_series
from megatron3d.checkpoint.save_lock import SaveLock
from megatron3d.cli.arguments import format_config, parse_given
from megatron3d.config import TrainConfig
from megatron3d.errors import Megatron3dError, TrainingError
from megatron3d.log import get_logger, setup_logging
from megatron3d.mpu import traffic
from megatron3d.mpu.state import ParallelState
from megatron3d.mpu.topology import Topology
from megatron3d.optim.batch_schedule import BatchSchedule
from megatron3d.resilience import exit_record
from megatron3d.resilience.failure_board import PEER_EXIT_CODE, FailureBoard
from megatron3d.resilience.flight_recorder import FlightRecorder
from megatron3d.resilience.restart import Restart
from megatron3d.resilience.watchdog import Watchdog, default_dump_dir
from megatron3d.training.build import Overrides, build_trainer, run_length, valid_samples
from megatron3d.training.data_setup import check_data_exists, check_vocabulary_fits, dry_run
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
        validate(cfg, env.world_size)
        dry_run = cfg.parallel.print_topology  # LAUNCH_DRY_RUN: no launcher, no rendezvous
        if not dry_run:
            if _kill_switch_pressed(cfg, env.rank):
                return 0
            devices.check_rendezvous_env(env)
        if not cfg.data.mock_data:  # flags checked: now the files they name
            check_data_exists(cfg)
            check_vocabulary_fits(cfg)
        if cfg.data.dry_run_data:
            sys.stdout.write(_dry_run(cfg, env.world_size) + "\n")
            return 0
        check_paths(cfg.checkpoint, cfg.training.skip_train)  # before hang dumps go under --save
        _check_outputs(cfg)
        if dry_run:  # what follows needs the compute node's devices
            if env.rank == 0:
                parallel = cfg.parallel
                sys.stdout.write(Topology(env.world_size, parallel.tensor_model_parallel_size,
                                          parallel.pipeline_model_parallel_size,
                                          parallel.context_parallel_size).table() + "\n")
            return 0
        fit.check_fits(cfg, env.world_size, devices.memory_capacity(env),
                       "cuda" if devices.accelerator_available() else "cpu")
        backend = devices.resolve_backend(cfg.parallel.distributed_backend, env)
        lock = _lock_save(cfg, env.rank)
    except Megatron3dError as err:
        exit_record.report(2, f"error: {err}")
        return 2
    with lock:
        return _run(cfg, env, backend, started, notices)


def _run(cfg: TrainConfig, env: devices.LaunchEnv, backend: str, started: float,
         notices: list[str]) -> int:
    """Join the process group and train, with the hang watchdog and flight recorder on."""
    try:
        dev = devices.set_device(env.local_rank)
        store = devices.init_process_group(env, cfg.resilience.distributed_timeout_minutes,
                                           backend, cfg.resilience.rendezvous_timeout)
    except Megatron3dError as err:  # the ranks did not meet: one line naming the variable
        exit_record.report(2, f"error: {err}")
        return 2
    board = FailureBoard(store, env.rank)
    recorder = FlightRecorder(cfg.resilience.flight_recorder_size, devices.stream_marker(dev))
    with traffic.observing(recorder):
        state = ParallelState.for_config(cfg.parallel)
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
        trainer = build_trainer(cfg, state, dev, started, overrides)
        restart = Restart.from_env()  # torchrun --max-restarts started the workers again
        if restart is not None:
            logger.info(restart.line(trainer.progress.iteration))
        trainer.run()
    except Megatron3dError as err:
        code = 1 if isinstance(err, TrainingError) else 2
        exit_record.report(code, f"error: {err}")
        watchdog.board.post()
        return code
    except Exception as exc:  # a peer failed, or died, inside a collective
        if watchdog.board.stop_for_peer():
            return PEER_EXIT_CODE
        if not watchdog.fired:
            first = (str(exc).splitlines() or [""])[0][:160]
            path = watchdog.dump(f"exception: {type(exc).__name__}: {first}")
            logger.error("rank %d wrote %s", state.world_rank, path)
        raise
    return 0


def _kill_switch_pressed(cfg: TrainConfig, rank: int) -> bool:
    """A kill switch already there stops the job at once (said once, by rank 0), as the one
    met during training does, but before anything is loaded, trained or saved."""
    switch = cfg.checkpoint.kill_switch_path
    if not (switch and os.path.exists(switch)):
        return False
    if rank == 0:
        sys.stdout.write(f"kill switch {switch} exists at start-up: exiting without training "
                         "or saving anything; remove it to run\n")
    return True


def _check_outputs(cfg: TrainConfig) -> None:
    """The directories the run writes besides --save (checked with it) must be directories it
    can write, or the run would die in its first write: TensorBoard's on the logging rank,
    every rank's hang dump."""
    if cfg.logging.tensorboard_dir:
        check_output_dir(Path(cfg.logging.tensorboard_dir), "--tensorboard-dir")
    dumps = default_dump_dir(cfg.resilience.hang_dump_dir, cfg.checkpoint.save)
    check_output_dir(dumps, "--hang-dump-dir" if cfg.resilience.hang_dump_dir
                     else f"--hang-dump-dir (default {dumps})")


def _lock_save(cfg: TrainConfig, rank: int) -> contextlib.AbstractContextManager:
    """Rank 0 holds --save for the run's life (``save_lock.py``), then checks the series
    again: a run that ended between the first check and the lock may have saved there."""
    if not cfg.checkpoint.save or rank != 0:
        return contextlib.nullcontext()
    lock = SaveLock.take(Path(cfg.checkpoint.save))
    if not cfg.checkpoint.new_series:
        try:
            check_series(Path(cfg.checkpoint.save), cfg.checkpoint.load, cfg.checkpoint.finetune)
        except Megatron3dError:
            lock.release()
            raise
    return lock


def _dry_run(cfg: TrainConfig, world_size: int) -> str:
    """What --data-path would draw from each source over this run, without training."""
    schedule = BatchSchedule.from_config(cfg.training, cfg.parallel.data_parallel_size(world_size))
    _, samples = run_length(cfg, schedule)
    return dry_run(cfg, samples, valid_samples(cfg, schedule))


if __name__ == "__main__":
    sys.exit(main())
