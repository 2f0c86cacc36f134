"""--rerun-on-bad-step: tell a bad batch from a faulty rank by running a bad step twice.

Why: a NaN or a loss spike is either in the data (every run of that batch gives it) or a
transient hardware fault (a flipped bit, a marginal chip), and the two need opposite answers:
skip the batch, or distrust the rank. Running the step again with the same micro-batches and
the same RNG states tells them apart, as Megatron's rerun state machine does.

Each step runs ``step.compute_gradients`` (forward, backward, every gradient reduction), is
measured (``MixedPrecisionOptimizer.measure``: the global grad norm) and judged before the
optimizer applies it: bad when its loss or grad norm is not finite (in fp16 a non-finite norm
is the loss scaler's overflow, not a bad step) or its loss is above ``--rerun-spike-factor``
times the mean of the last ``--rerun-spike-window`` finite losses (``LossWindow``). Every rank
judges alike from one world-wide MAX all-reduce of three numbers and one host read per step:
the flag's cost (besides the fingerprint below), as --check-for-nan-in-loss-and-grad's. A bad
step is run again from the same RNG states with its gradients zeroed, and the two runs are
compared on every rank:

- nothing differs (bitwise): the data. The step is skipped (no update; the data position
  still advances), its global sample ids are logged and recorded in ``Progress``, so in the
  checkpoint; a resumed run meets the batch again and skips it alike.
- something differs: a transient fault. The ranks whose own work differed are named (rank,
  node, iteration) in the log and TensorBoard; the re-run's result is applied if it is good
  (then the run goes on bitwise as a clean one), else the step is skipped. A rank named
  ``--rerun-max-faults-per-rank`` times stops the run (``RankFaultLimitError``: the loop saves the
  state before the step, and the run exits 1 naming the node to exclude).

Attribution: each rank fingerprints its own work at two points (``_Pass``). Before any
cross-rank reduction: the sum and sum of squares of every tensor it contributes to a
collective over its data-parallel group (its local gradients as the ZeRO-0/1 buckets or
ZeRO-3 units are reduced, its share of the loss, ZeRO-3's parameter shards), seen through a
``traffic`` observer as each is posted. After the reductions: the reported loss and the sum
and sum of squares of the gradients its optimizer reads. Ranks that differ before the
reductions are named; only if none does, those that differ after them (a fault in a rank's
copy of the reduced gradients). A fault in rank r's local gradients thus names r alone,
though the DP reduction spreads it to r's peers. A fault that travels through tensor- or
pipeline-parallel communication before the DP reduction (a corrupted activation all-reduced
over TP, sent to the next stage, or a gradient sent back) changes the local gradients of
every rank it reaches: all of them are named, its whole model-parallel group at worst, and
the rank at fault is among them (on its own node, usually). The fingerprint reads each
contributed tensor once more on the device: about one read of a rank's gradients per step.
"""

from __future__ import annotations

import socket
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron3d.checkpoint.progress import Progress
from megatron3d.config import ResilienceConfig
from megatron3d.device import ComputeSpans
from megatron3d.errors import TrainingError
from megatron3d.log import get_logger
from megatron3d.mpu import comm, traffic
from megatron3d.mpu.random import RNGStreams
from megatron3d.mpu.state import AxisGroup
from megatron3d.optim.mixed_precision import Measured, MixedPrecisionOptimizer
from megatron3d.pipeline.engine import Batch, PipelineEngine
from megatron3d.training.grad_sync import GradSync
from megatron3d.training.step import StepResult, compute_gradients
from megatron3d.training.tensorboard import TensorBoardWriter

logger = get_logger(__name__)
_NODE_BYTES = 256  # a host name (at most 253 characters), padded, for the stop line


class RankFaultLimitError(TrainingError):
    """A rank caused --rerun-max-faults-per-rank transient faults: the run stops (exit 1)."""


@dataclass
class LossWindow:
    """The recent finite losses (``losses``: the list ``Progress`` keeps, changed in place)
    and the spike rule: above ``factor`` times their mean, once ``size`` are known (the mean
    of fewer is noise); ``size`` 0 judges nothing."""

    factor: float
    size: int
    losses: list[float]

    def is_spike(self, loss: float) -> bool:
        return 0 < self.size <= len(self.losses) and loss > self.factor * self.mean()

    def mean(self) -> float:
        return statistics.fmean(self.losses)

    def add(self, loss: float) -> None:
        if self.size:
            self.losses.append(loss)
            del self.losses[:-self.size]


def attribute(differs: Sequence[Sequence[float]]) -> list[int]:
    """The ranks to name: ``differs[rank]`` flags, per fingerprint in the order the step takes
    them, whether the rank's two runs differed there; the ranks that differed at the first
    point where any did (later points also see what reductions spread from it)."""
    for point in range(len(differs[0]) if differs else 0):
        named = [rank for rank, flags in enumerate(differs) if flags[point]]
        if named:
            return named
    return []


class Fingerprint:
    """A ``traffic`` observer: the sum and sum of squares, on the device, of every tensor
    this rank contributes to a collective over ``dp`` while attached."""

    def __init__(self, dp: AxisGroup, device: torch.device) -> None:
        self.dp = dp
        self.values = torch.zeros(2, dtype=torch.float32, device=device)

    def __call__(self, kind: str, tensor: torch.Tensor, axis: AxisGroup,
                 peer: int | None = None, tag: object = None) -> None:
        if axis != self.dp:
            return
        flat = tensor.detach().reshape(-1)
        flat = flat if flat.dtype == torch.float32 else flat.float()
        self.values += torch.stack([flat.sum(), torch.dot(flat, flat)])


@dataclass(frozen=True)
class _Pass:
    """One run of a step's gradients: the global loss, the measured gradients, and this
    rank's fingerprint before the reductions (``Fingerprint.values``)."""

    loss: torch.Tensor
    measured: Measured
    before: torch.Tensor


@dataclass(frozen=True)
class _Judgement:
    """What every rank agreed about a pass, on the host."""

    loss_bad: bool
    norm_bad: bool
    loss: float  # the global loss if finite, else 0

    def reasons(self, window: LossWindow) -> str:
        bad = [what for what, flag in (("loss not finite", self.loss_bad),
                                       ("grad norm not finite", self.norm_bad)) if flag]
        if not bad and window.is_spike(self.loss):
            bad.append(f"loss spike: {self.loss:.6E} above {window.factor:g} times the mean "
                       f"{window.mean():.6E} of the last {len(window.losses)} losses")
        return ", ".join(bad)


class BadStepRerun:
    """Runs each training step under --rerun-on-bad-step (``step``); built once per run."""

    def __init__(self, settings: ResilienceConfig, engine: PipelineEngine,
                 optimizer: MixedPrecisionOptimizer, grad_sync: GradSync, dp: AxisGroup,
                 world: AxisGroup, rng: RNGStreams, writer: TensorBoardWriter, *,
                 logs: bool, fp16: bool, seq_length: int, save: str | None) -> None:
        """``logs``: this rank writes the run's lines (the logging rank); ``save``: --save."""
        self.engine, self.optimizer, self.grad_sync, self.dp = engine, optimizer, grad_sync, dp
        self.world, self.rng, self.writer, self.logs = world, rng, writer, logs
        self.factor, self.size = settings.rerun_spike_factor, settings.rerun_spike_window
        self.max_faults = settings.rerun_max_faults_per_rank
        self.fp16, self.seq_length, self.save = fp16, seq_length, save
        self.device = optimizer.shard.grads.device
        self.faults: Counter[int] = Counter()  # transient faults per rank, in this process

    def step(self, batches: list[Batch], lr: float, gbs: int, progress: Progress,
             spans: ComputeSpans | None = None) -> StepResult:
        """Step ``progress.iteration + 1`` on the global batch of ``gbs`` samples starting at
        ``progress.consumed_samples`` (not advanced here); raises ``RankFaultLimitError``."""
        window = LossWindow(self.factor, self.size, progress.recent_losses)
        before = self.rng.get_state()
        first = self._pass(batches, spans)
        judged = self._agree(first)
        why = judged.reasons(window)
        if not why:
            window.add(judged.loss)
            return StepResult(first.loss, self.optimizer.apply(lr, first.measured))
        iteration = progress.iteration + 1
        logger.info("rerun: iteration %d is bad (%s): re-running it with the same data and RNG "
                    "states", iteration, why)
        first_after = self._after_reductions(first)  # before the re-run overwrites them
        self.rng.set_state(before)
        second = self._pass(batches, None)
        again, differs = self._compare(first, first_after, second)
        named = attribute(differs)
        if not named:
            self._skip_data(progress, gbs, why)
            return StepResult(second.loss, self.optimizer.not_applied(second.measured))
        good = not again.reasons(window)
        self._name(named, iteration, good, progress, gbs, before)
        if good:
            window.add(again.loss)
            return StepResult(second.loss, self.optimizer.apply(lr, second.measured))
        return StepResult(second.loss, self.optimizer.not_applied(second.measured))

    def _pass(self, batches: list[Batch], spans: ComputeSpans | None) -> _Pass:
        fingerprint = Fingerprint(self.dp, self.device)
        with traffic.observing(fingerprint):
            loss = compute_gradients(self.engine, self.optimizer, batches, self.grad_sync,
                                     self.dp, spans)
        return _Pass(loss, self.optimizer.measure(), fingerprint.values)

    def _after_reductions(self, run: _Pass) -> torch.Tensor:
        """The pass's fingerprint after the reductions: the loss this rank reports, the sum
        and sum of squares of the gradients its optimizer reads."""
        grads = self.optimizer.shard.grads
        return torch.stack([run.loss.float().reshape(()), grads.sum(), torch.dot(grads, grads)])

    def _bad(self, run: _Pass) -> torch.Tensor:
        """This rank's view of a pass: [loss not finite, norm not finite, loss or 0]."""
        loss = run.loss.float().reshape(())
        finite = torch.isfinite(loss)
        norm_bad = (torch.zeros_like(loss) if self.fp16
                    else (~torch.isfinite(run.measured.norm.float().reshape(()))).float())
        return torch.stack([(~finite).float(), norm_bad, torch.where(finite, loss, 0.0)])

    def _agree(self, run: _Pass) -> _Judgement:
        """One MAX all-reduce over every rank and one host read: the documented cost."""
        loss_bad, norm_bad, loss = comm.all_reduce(self._bad(run), self.world,
                                                   op=comm.MAX).tolist()
        return _Judgement(loss_bad > 0, norm_bad > 0, loss)

    def _compare(self, first: _Pass, first_after: torch.Tensor,
                 second: _Pass) -> tuple[_Judgement, list[tuple[float, float]]]:
        """Every rank's verdict on the re-run and whether its own two runs differed before and
        after the reductions (NaN equal to NaN): one all-gather, one host read."""
        def differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            same = (a == b) | (torch.isnan(a) & torch.isnan(b))
            return (~same.all()).float().reshape(1)

        mine = torch.cat([self._bad(second), differ(first.before, second.before),
                          differ(first_after, self._after_reductions(second))])
        rows = comm.all_gather(mine, self.world, 0).view(self.world.size, 5).tolist()
        agreed = _Judgement(any(r[0] > 0 for r in rows), any(r[1] > 0 for r in rows),
                            max(r[2] for r in rows))
        return agreed, [(r[3], r[4]) for r in rows]

    def _skip_data(self, progress: Progress, gbs: int, why: str) -> None:
        first = progress.consumed_samples
        progress.skipped_batches.append({"iteration": progress.iteration + 1,
                                         "first_sample": first, "samples": gbs})
        if self.logs:
            logger.warning("rerun: iteration %d gave the same result on its re-run (%s): bad "
                           "data; the batch is skipped (training samples %d-%d, recorded in "
                           "the checkpoint)", progress.iteration + 1, why, first,
                           first + gbs - 1)
        self.writer.write({"rerun skipped batches": len(progress.skipped_batches)},
                          self._after(progress, gbs))

    def _name(self, named: list[int], iteration: int, good: bool, progress: Progress,
              gbs: int, before: dict[str, torch.Tensor]) -> None:
        """Count, log and plot a transient fault on ``named``; stop the run at the limit."""
        self.faults.update(named)
        then = ("training goes on with the re-run's result" if good
                else "the re-run is bad too, so the step is skipped")
        me = self.world.rank
        if me in named:
            logger.warning("rank %d on node %s computed iteration %d differently on its "
                           "re-run: a transient fault (%d of --rerun-max-faults-per-rank %d); "
                           "%s", me, socket.gethostname(), iteration, self.faults[me],
                           self.max_faults, then)
        logger.info("rerun: iteration %d: a transient fault on rank(s) %s; %s", iteration,
                    named, then)
        self.writer.write({f"rerun transient faults rank {r}": self.faults[r] for r in named},
                          self._after(progress, gbs))
        over = [r for r in named if self.faults[r] >= self.max_faults]
        if over:
            self.rng.set_state(before)  # the state saved is the one before this step
            self.writer.flush()  # the run ends with an exception, not at its summary
            raise RankFaultLimitError(self._stop_line(over[0], iteration))

    def _stop_line(self, rank: int, iteration: int) -> str:
        node = self._node_of(rank)
        saved = (f"iteration {iteration - 1} is saved in {self.save}" if self.save
                 else "nothing is saved (no --save)")
        return (f"rank {rank} on node {node} computed iteration {iteration} differently on "
                f"its re-run: its {_ordinal(self.faults[rank])} transient fault, "
                f"--rerun-max-faults-per-rank {self.max_faults} reached: training stopped; "
                f"{saved}; exclude node {node} (e.g. sbatch --exclude={node}) and resume with "
                "--load")

    def _node_of(self, rank: int) -> str:
        """``rank``'s host name, which only it knows: one broadcast, when the run stops."""
        name = socket.gethostname().encode()[:_NODE_BYTES] if self.world.rank == rank else b""
        code = torch.tensor(list(name.ljust(_NODE_BYTES)), dtype=torch.uint8,
                            device=self.device)
        return bytes(comm.broadcast(code, self.world, rank).tolist()).decode().rstrip()

    def _after(self, progress: Progress, gbs: int) -> Progress:
        """Where the run is once this step is done: what TensorBoard plots it against."""
        return Progress(progress.iteration + 1, progress.consumed_samples + gbs,
                        progress.consumed_tokens + gbs * self.seq_length)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
