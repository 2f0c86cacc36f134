"""The training loop: steps, the Megatron log line, TensorBoard, periodic evaluation, and the
end of a run: the final save, validation and test evaluation, and one summary line.

Everything per step stays on the device; the loop syncs with the device only at log,
evaluation and save boundaries (the exit watch reads its agreement a step late, without one).
The data position, batch size and learning rate are pure functions of ``consumed_samples``,
so a run is fully described by its ``Progress``. A ``Trainer`` is built whole by
``training.build.build_trainer`` from named parts and never changed afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from megatron3d.accounting import memory
from megatron3d.checkpoint.local.saver import LocalSaver
from megatron3d.checkpoint.progress import Progress
from megatron3d.config import TrainConfig
from megatron3d.data.sampler import MicroBatch
from megatron3d.log import every_rank_logger, get_logger
from megatron3d.mpu.state import AxisGroup
from megatron3d.optim.batch_schedule import BatchSchedule
from megatron3d.optim.lr_schedule import LRSchedule
from megatron3d.optim.mixed_precision import MixedPrecisionOptimizer
from megatron3d.pipeline.engine import PipelineEngine
from megatron3d.training.divergence import SkipWatch
from megatron3d.training.evaluate import evaluate, format_eval_line, perplexity
from megatron3d.training.exit_watch import ExitWatch
from megatron3d.training.grad_sync import GradSync
from megatron3d.training.reporting import Reporter
from megatron3d.training.rerun import BadStepRerun, RankFaultLimitError
from megatron3d.training.step import StepResult, check_grad_norm, train_step
from megatron3d.training.straggler import StragglerWatch
from megatron3d.zero.factory import DataParallel

logger = get_logger(__name__)


class Heartbeat(Protocol):
    """Told when a step finishes and when slower work runs (the hang watchdog listens)."""

    def starting(self, iteration: int) -> None: ...
    def beat(self, iteration: int) -> None: ...
    def allowance(self, phase: str) -> contextlib.AbstractContextManager: ...


class Saver(Protocol):
    """Saves a checkpoint at ``progress`` and returns its directory; ``wait`` returns once the
    saves started are published (with --async-save they are written in the background)."""

    def __call__(self, progress: Progress) -> str: ...
    def wait(self) -> None: ...


class _NoHeartbeat:
    def starting(self, iteration: int) -> None:
        pass

    def beat(self, iteration: int) -> None:
        pass

    @contextlib.contextmanager
    def allowance(self, phase: str) -> Iterator[None]:
        yield


@dataclass
class _Outcome:
    """What the summary line reports, kept as the run goes."""

    train_loss: torch.Tensor | None = None  # the last step's loss, on the device
    valid_loss: float | None = None
    valid_at: int | None = None  # the iteration of ``valid_loss``
    checkpoint: str | None = None  # the directory this run saved last

    def summary(self, progress: Progress, reason: str) -> str:
        """The run's last line: where it ended, its last losses, what it saved, and why."""
        train = "none" if self.train_loss is None else f"{float(self.train_loss):.6E}"
        valid = "none" if self.valid_loss is None else f"{self.valid_loss:.6E}"
        return (f"end of run: iteration {progress.iteration} | consumed samples: "
                f"{progress.consumed_samples} | last lm loss: {train} | last validation lm "
                f"loss: {valid} | saved checkpoint: {self.checkpoint or 'none'} | stop "
                f"reason: {reason}")


@dataclass(frozen=True)
class RunData:
    """This rank's micro-batches of the run's three splits."""

    train: Callable[[int, int], list[MicroBatch]]  # (consumed samples, global batch size)
    valid: Callable[[int], list[MicroBatch]]  # evaluation iteration -> micro-batches
    test: Callable[[int], list[MicroBatch]] | None  # None: the split has no samples


@dataclass(frozen=True)
class ModelParts:
    """The pipeline stage this rank trains and what one step runs on it."""

    engine: PipelineEngine
    optimizer: MixedPrecisionOptimizer
    data_parallel: DataParallel  # buffers and shards of this rank's ZeRO stage
    grad_sync: GradSync  # reductions between backward and the optimizer step
    check_replicas: Callable[[], None]  # raises if TP-replicated parameters drifted
    dp: AxisGroup  # the reported loss is the mean over it


@dataclass(frozen=True)
class Hooks:
    """Who hears from the run as it goes: the hang watchdog (``heartbeat``), and a callback
    after every step (tests and benchmarks)."""

    heartbeat: Heartbeat = field(default_factory=_NoHeartbeat)
    on_step: Callable[[int, StepResult], None] | None = None


@dataclass(frozen=True)
class Trainer:
    """Runs ``total_iters`` steps from ``progress``; built by ``training.build``."""

    cfg: TrainConfig
    model: ModelParts
    data: RunData
    batch_schedule: BatchSchedule
    lr_schedule: LRSchedule
    total_iters: int
    reporter: Reporter  # the log line and TensorBoard
    save: Saver | None  # checkpoint.saving.Saver under --save
    exit_watch: ExitWatch
    progress: Progress  # advanced in place as the run goes
    skips: SkipWatch  # stops a run whose steps are all skipped (divergence.py)
    stragglers: StragglerWatch  # names a rank whose compute is persistently slow
    hooks: Hooks = field(default_factory=Hooks)
    local_save: LocalSaver | None = None  # --non-persistent-save-interval
    rerun: BadStepRerun | None = None  # --rerun-on-bad-step judges each step before it applies
    _last: _Outcome = field(init=False, default_factory=_Outcome)

    def run(self) -> Progress:
        """Train to ``total_iters`` (or until an exit condition) and save; then evaluate on
        the validation and test splits (not after a signal or --exit-duration-in-mins: time
        is short) and log the summary line. With --skip-train, or from a checkpoint that
        already reached the end, only evaluate."""
        if self.cfg.training.skip_train:
            logger.info("skipping training (--skip-train is on) ...")
            reason = "--skip-train"
        elif self.progress.iteration >= self.total_iters:
            reason = self._nothing_to_train()
        else:
            reason = self._train()
        if self.exit_watch.pressed:  # as Megatron: the job is about to be killed
            logger.info("no end-of-run evaluation: stopped by %s", reason)
        else:
            with self.hooks.heartbeat.allowance("evaluation"):
                self._final_evaluation()
        logger.info(self._last.summary(self.progress, reason))
        self.reporter.writer.flush()
        if self.local_save is not None:  # a normal end: nothing to restart from
            self.local_save.finish()
        return self.progress

    def _train(self) -> str:
        """The steps and the final save; why they stopped."""
        reason = self._run_length_reached()
        self.model.engine.stage.train()
        reporter = self.reporter
        reporter.start()
        self.stragglers.start(self.progress.iteration)
        self.hooks.heartbeat.starting(self.progress.iteration)
        with self.exit_watch:
            while self.progress.iteration < self.total_iters:
                result, lr, gbs = self._step()
                self.hooks.heartbeat.beat(self.progress.iteration)
                self.skips.add(result.stats.skipped, result.loss)
                if reporter.step(self.progress, result, lr, gbs):  # the log line synced
                    self.skips.check(self.progress.iteration)
                    self.stragglers.at_log_line(self.progress)
                self._after_step(result)
                it = self.progress.iteration
                stop = self.exit_watch.should_stop(it, last=it >= self.total_iters)
                if stop is not None:
                    logger.info("stopping at iteration %d (%s)", it, stop)
                    reason = stop
                    break
            reporter.finish()
            self._last.train_loss = result.loss  # stays on the device until the summary
            # Still under the signal handlers: the launcher forwards the preemption SIGTERM a
            # moment after the job's own, and it must not kill the final save half-way.
            self.skips.check(self.progress.iteration, saving=True)  # with or without --save
            self._save(final=True)
        return reason

    def _run_length(self) -> str:
        """The flag that sets the run's length, with its value."""
        if self.cfg.training.train_iters is not None:
            return f"--train-iters {self.total_iters}"
        return f"--train-samples {self.cfg.training.train_samples}"

    def _run_length_reached(self) -> str:
        """The stop reason of a run that trains to its end."""
        return f"{self._run_length()} reached"

    def _nothing_to_train(self) -> str:
        """A loaded checkpoint is already at the end: say so (no silent exit 0)."""
        logger.info("checkpoint at iteration %d already reached %s: nothing to train; "
                    "evaluating only", self.progress.iteration, self._run_length())
        return f"checkpoint already at {self._run_length()}"

    def _after_step(self, result: StepResult) -> None:
        """Hooks, evaluation, checks and saving."""
        it = self.progress.iteration
        if self.hooks.on_step is not None:
            self.hooks.on_step(it, result)
        if it == 1 and self.cfg.logging.memory_report:
            self._memory_report()
        if it % self.cfg.training.eval_interval == 0 and self.cfg.training.eval_iters > 0:
            with self.hooks.heartbeat.allowance("evaluation"):
                self._evaluate()
        replicas_every = self.cfg.parallel.check_replicas_interval
        if replicas_every and it % replicas_every == 0:
            self.model.check_replicas()
        save_every = self.cfg.checkpoint.save_interval
        if save_every and it % save_every == 0:
            self._save()
        local_every = self.cfg.checkpoint.non_persistent_save_interval
        if self.local_save is not None and local_every and it % local_every == 0:
            with self.hooks.heartbeat.allowance("checkpoint save"):
                self.local_save(self.progress)

    def _save(self, final: bool = False) -> None:
        """Save at this iteration; the final save returns only once it is published (an
        earlier one may still be written in the background while training goes on)."""
        if self.save is not None:
            with self.hooks.heartbeat.allowance("checkpoint save"):
                if not final:  # the final save was checked by ``_train``
                    self.skips.check(self.progress.iteration, saving=True)
                self._last.checkpoint = self.save(self.progress)
                if final:
                    self.save.wait()

    def _step(self) -> tuple[StepResult, float, int]:
        consumed = self.progress.consumed_samples
        gbs = self.batch_schedule.global_batch_size_at(consumed)
        lr = self.lr_schedule.lr_at(consumed)
        model, batches = self.model, self.data.train(consumed, gbs)
        if self.rerun is None:
            result = train_step(model.engine, model.optimizer, batches, lr, model.grad_sync,
                                model.dp, self.stragglers.spans)
        else:
            result = self._judged_step(batches, lr, gbs)
        self.progress.iteration += 1
        if self.cfg.resilience.check_for_nan_in_loss_and_grad:
            check_grad_norm(result.stats, self.progress.iteration)
        self.progress.consumed_samples += gbs
        self.progress.consumed_tokens += gbs * self.cfg.model.seq_length
        return result, lr, gbs

    def _judged_step(self, batches: list[MicroBatch], lr: float, gbs: int) -> StepResult:
        """A step under --rerun-on-bad-step; a rank at its fault limit stops the run, and the
        state before the step is saved first (with --save) so that nothing is lost."""
        assert self.rerun is not None
        try:
            return self.rerun.step(batches, lr, gbs, self.progress, self.stragglers.spans)
        except RankFaultLimitError:
            self._save(final=True)
            raise

    def _memory_report(self) -> None:
        model = self.model
        params = list(model.engine.stage.parameters())
        expected = memory.expected(params, self.cfg.parallel.zero_stage, model.data_parallel)
        every_rank_logger().info(memory.report("memory after the first step:", expected,
                                               memory.measured(model.optimizer,
                                                               model.data_parallel)))

    def _evaluate(self) -> None:
        it = self.progress.iteration
        loss = evaluate(self.model.engine, self.data.valid, self.cfg.training.eval_iters,
                        self.model.dp)
        logger.info(format_eval_line(f"iteration {it}", loss))
        self._write_evaluation("validation", loss)
        self._last.valid_loss, self._last.valid_at = loss, it

    def _final_evaluation(self) -> None:
        """Megatron's end of a run: validation (reusing this iteration's periodic one), then
        the test split; skipped where --eval-iters is 0 or the split has no samples."""
        iters, it = self.cfg.training.eval_iters, self.progress.iteration
        if iters == 0:
            return
        valid = self._last.valid_loss
        if valid is None or self._last.valid_at != it:
            valid = evaluate(self.model.engine, self.data.valid, iters, self.model.dp)
            self._last.valid_loss, self._last.valid_at = valid, it
            self._write_evaluation("validation", valid)
        logger.info(format_eval_line(f"iteration {it} on validation set", valid))
        if self.data.test is not None:
            loss = evaluate(self.model.engine, self.data.test, iters, self.model.dp)
            logger.info(format_eval_line(f"iteration {it} on test set", loss))
            self._write_evaluation("test", loss)

    def _write_evaluation(self, split: str, loss: float) -> None:
        """``lm loss validation`` (or ``test``) and its perplexity, Megatron's names; an
        evaluation-only run (--skip-train) leaves the training curves alone, as Megatron's."""
        if not self.cfg.training.skip_train:
            self.reporter.writer.write({f"lm loss {split}": loss,
                                        f"lm loss {split} ppl": perplexity(loss)}, self.progress)
