"""Does straggler naming name the slow rank quickly, and nobody on a healthy run?

Two runs of pretrain_gpt.py's trainer on 4 gloo ranks (DP=4, a tiny GPT), each comparing the
ranks every ``--interval`` steps (``--straggler-interval``, at that log interval): a clean run
of ``--clean-steps`` (target: nobody named), and a run where one rank computes ``--delay-ms``
more (a busy loop) at the start of each step's forward/backward passes (an engine observer,
as the test does; target: that rank, and only it, named within 20 steps). For each it prints
what was named and when and, from the TensorBoard series the logging rank writes, each rank's
largest slowdown against its peers' median, how many comparisons were above
``--straggler-threshold`` and the longest run of them: the margin to a false report.

    python -m benchmarks.straggler
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import spawn
from megatron3d import device as devices
from megatron3d.cli.arguments import parse_args
from megatron3d.mpu.state import ParallelState
from megatron3d.training.build import Overrides, build_trainer
from megatron3d.training.loop import Hooks
from megatron3d.training.straggler import PERSISTENCE
from megatron3d.validation import validate

WORLD = 4


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clean-steps", type=int, default=500)
    p.add_argument("--slow-steps", type=int, default=40)
    p.add_argument("--interval", type=int, default=5)
    p.add_argument("--threshold", type=float, default=0.2)
    p.add_argument("--delay-ms", type=float, default=150.0)
    p.add_argument("--slow-rank", type=int, default=2)
    return p.parse_args()


def _argv(steps: int, interval: int, threshold: float, board: str) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", str(steps), "--lr", "1e-3", "--mock-data", "--vocab-size", "512",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-interval", "100000",
            "--eval-iters", "0", "--log-interval", str(interval), "--straggler-interval",
            str(interval), "--straggler-threshold", str(threshold), "--tensorboard-dir", board]


class SlowCompute:
    """Engine observer: spins for ``seconds`` of CPU at the start of each step's passes (the
    injected slowness, outside core objects: on CPU the processor is the device, and a sleep
    is no compute). The straggler test injects its fault with it too."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def begin(self, program) -> None:
        start = time.thread_time()  # busy: the CPU is the device, and it is slow
        while time.thread_time() - start < self.seconds:
            pass

    def after(self, instruction) -> None:
        pass

    def end(self) -> None:
        pass


class StragglerWarnings(logging.Handler):
    """The straggler warnings of this rank, with the iteration each was logged at."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.iteration = 0
        self.lines: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((self.iteration + 1, record.getMessage()))  # before its on_step


def _rank(argv: list[str], slow_rank: int, delay_s: float) -> tuple[list, float]:
    """One rank's run: its straggler warnings, and its seconds per step."""
    state = ParallelState.build(1, 1)
    cfg = parse_args(argv)
    validate(cfg, state.world_size)
    named = StragglerWarnings()
    observers = (SlowCompute(delay_s),) if state.world_rank == slow_rank and delay_s else ()

    def seen(iteration: int, _result) -> None:
        named.iteration = iteration

    logger = logging.getLogger("megatron3d.training.straggler")
    logger.addHandler(named)
    trainer = build_trainer(cfg, state, devices.device(), overrides=Overrides(
        observers=observers, hooks=Hooks(on_step=seen)))
    start = time.perf_counter()
    trainer.run()
    seconds = time.perf_counter() - start
    logger.removeHandler(named)
    return named.lines, seconds / cfg.training.train_iters


def _slowdowns(board: Path) -> dict[int, list[float]]:
    """Each rank's slowdown at each comparison, as the logging rank wrote it to TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(board))
    events.Reload()
    return {rank: [e.value for e in events.Scalars(f"straggler slowdown rank {rank}")]
            for rank in range(WORLD)}


def _longest_streak(series: list[float], threshold: float) -> int:
    longest = streak = 0
    for by in series:
        streak = streak + 1 if by > threshold else 0
        longest = max(longest, streak)
    return longest


def _report(title: str, per_rank: list[tuple[list, float]], board: Path,
            threshold: float) -> str:
    lines = [f"{title}: {per_rank[-1][1] * 1000:.1f} ms per step (wall, logging rank)"]
    named = [(it, rank, line) for rank, (taken, _) in enumerate(per_rank) for it, line in taken]
    lines += [f"  iteration {it}, rank {rank}: {line}" for it, rank, line in sorted(named)]
    lines += [] if named else ["  named: nobody"]
    lines.append(f"  per rank: largest slowdown vs peers' median, comparisons above "
                 f"{threshold:g}, longest run of them (named at {PERSISTENCE})")
    for rank, series in _slowdowns(board).items():
        above = sum(by > threshold for by in series)
        lines.append(f"    rank {rank}: {100 * max(series):+.1f}%, {above} of {len(series)}, "
                     f"{_longest_streak(series, threshold)}")
    return "\n".join(lines) + "\n"


def main() -> None:
    a = _args()
    with tempfile.TemporaryDirectory(prefix="m3d_straggler_") as tmp:
        runs = [("clean", a.clean_steps, 0.0), (f"rank {a.slow_rank} slowed by {a.delay_ms:g} "
                                                  "ms per step", a.slow_steps, a.delay_ms)]
        for index, (title, steps, delay_ms) in enumerate(runs):
            board = Path(tmp) / f"tb{index}"
            argv = _argv(steps, a.interval, a.threshold, str(board))
            per_rank = spawn(_rank, WORLD, argv, a.slow_rank, delay_ms / 1000.0,
                             timeout_s=1800.0)
            sys.stdout.write(_report(f"{title}, {steps} steps, comparisons every "
                                     f"{a.interval}", per_rank, board, a.threshold))


if __name__ == "__main__":
    main()
