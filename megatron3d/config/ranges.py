"""What a numeric config field accepts: the ``Range`` type and the bounds shared by fields.

Kept apart from ``config.py`` so that the sections stay readable: a field names its bound
(``range=SIZE``) and ``validation.py`` checks it; ``--help`` shows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Range:
    """The values a numeric field accepts, checked by ``validation`` and shown in ``--help``.

    A bound of ``None`` is absent; ``*_open`` excludes the bound itself. NaN is never inside.
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        low, high = self.low, self.high
        above = low is None or (value > low if self.low_open else value >= low)
        return above and (high is None or (value < high if self.high_open else value <= high))

    def __str__(self) -> str:
        """``>= 1``, ``> 0`` or ``[0, 1)``: the ``--help`` and error-message spelling."""
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        return (f"{'(' if self.low_open else '['}{self.low}, "
                f"{self.high}{')' if self.high_open else ']'}")


AT_LEAST_ONE = Range(1)
NON_NEGATIVE = Range(0)
POSITIVE = Range(0, low_open=True)
PROBABILITY = Range(0, 1, high_open=True)
FRACTION = Range(0, 1)
SIZE = Range(1, 2**20)
"""Tensor sizes (sequence, hidden, batch): 2**20 is far beyond any run, while a per-head
[s, s] attention mask or a [b, s, h] activation of that size already fills a device."""
# Counts far beyond any run (a typo of a few extra digits stops at once), small enough that
# samples and tokens stay exact in int64: 2**32 steps of at most 2**24 samples; int32 ids.
LAYERS, VOCABULARY, BATCH = Range(1, 2**16), Range(1, 2**31 - 1), Range(1, 2**24)
ITERATIONS, SAMPLES = Range(1, 2**32), Range(1, 2**40)
# Bounds that keep a run runnable: past them every step after the first diverges (weights of
# 1e30 overflow fp32 activations) and the run only skips steps. AdamW moves each weight by
# about the learning rate per step, so 1 is far past any recipe (GPT-3 6e-4); init std 1 is 50
# times GPT-2's; 2**32 is Megatron's starting dynamic loss scale, the largest it uses.
LEARNING_RATE = Range(0, 1, low_open=True)
INIT_STD = Range(0, 1, low_open=True)
LOSS_SCALE = Range(0, 2**32, low_open=True)
SEED = Range(0, 2**32, high_open=True)
"""A 32-bit seed: torch and numpy take it with the per-stage and TP offsets added."""


def option(default, help: str, *, range: Range | None = None,  # noqa: A002 - argparse's names
         **extra):
    """A dataclass field whose ``help`` documents it and becomes the flag's help text;
    ``range``, when given, bounds its value (every float must also be finite)."""
    return field(default=default, metadata={"help": help, "range": range, **extra})
