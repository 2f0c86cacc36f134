"""Collect what a logger prints, in-process (the tests of start-up and per-step lines)."""

from __future__ import annotations

import logging


class LogLines(logging.Handler):
    """A handler keeping every INFO-or-above message of the loggers it is added to."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
