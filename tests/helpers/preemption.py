"""What the preemption tests share: ``pretrain_gpt.py`` command lines of a few model sizes,
the log lines they parse (``--log-interval 1``) and the checkpoint directory they inspect."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers.tiny import train_argv

REPO = Path(__file__).resolve().parents[2]
ITER_LINE = re.compile(
    r"^ iteration +(\d+)/ *\d+ \| consumed samples: +(\d+) \| .*\| learning rate: (\S+) \| "
    r".*\| lm loss: (\S+) \| loss scale: \S+ \| grad norm: (\S+) \|")
LOADED = re.compile(r"loaded (\S+) \(iteration (\d+)\)")
START_TIMEOUT_S = 60.0  # import, build and the first steps on a loaded 2-core machine
# Model sizes (flags appended to the tiny command line; later flags win).
MEDIUM = ["--hidden-size", "128", "--seq-length", "64"]  # ~40 ms a step, 5 MB checkpoints
LARGE = ["--hidden-size", "256", "--seq-length", "64"]  # ~100 ms a step, 19 MB checkpoints
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def argv(iters: int, *extra: str) -> list[str]:
    """The tiny command line; one warm-up step, so that two-iteration runs are valid."""
    return train_argv("gpt2", iters, "--lr-warmup-iters", "1", *extra)


def latest(root: Path) -> int | None:
    path = root / "latest"
    return int(path.read_text().strip()) if path.exists() else None


def iter_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"
