"""When a SIGTERM ends a rank that is blocked on a peer that is gone.

torchrun stops the surviving workers with SIGTERM when one fails (and restarts them all under
``--max-restarts``); SLURM sends it before it kills a job. Under ``--save`` the signal means
"save after the next step" (``training/exit_watch.py``), which a healthy rank does in time. A
rank blocked in a collective with a dead peer never gets there: gloo raises once it notices
the closed connection (not always at once), NCCL waits until its timeout, and the Python
handler cannot run while the main thread is in C code. Such a rank could not save anyway:
every rank takes part in a save. So the watchdog thread, which sees the signal through its
wakeup pipe, asks ``TermGrace`` after every poll: since the signal, has this rank waited in a
collective for ``GRACE_S`` with nothing issued or finished (the flight recorder's activity)?
Then the process exits at once with ``TERM_EXIT_CODE``, the code of a process the signal
killed. A rank that computes, or that is saving (a save's writes issue no collectives for
long stretches), is left to its normal path; torchrun's own SIGKILL, 30 s after its SIGTERM,
bounds that.
"""

from __future__ import annotations

import signal

GRACE_S = 2.0  # longer than any healthy wait for a peer within a step (a pipeline bubble)
TERM_EXIT_CODE = 128 + signal.SIGTERM


class TermGrace:
    """``signalled`` when SIGTERM arrives; ``expired`` at every watchdog poll."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self._since: float | None = None  # when the signal came
        self._activity: tuple[int, int] | None = None
        self._still_since = 0.0  # when ``_activity`` last changed, or waiting began

    def signalled(self, now: float) -> None:
        if self._since is None:
            self._since = self._still_since = now

    def expired(self, now: float, activity: tuple[int, int], saving: bool) -> bool:
        """``activity``: (operations issued, operations in flight) from the flight recorder;
        ``saving``: the rank is inside a checkpoint save."""
        if self._since is None:
            return False
        waiting = activity[1] > 0 and not saving
        if not waiting or activity != self._activity:
            self._activity, self._still_since = activity, now
            return False
        return now - self._still_since >= self.grace_s
