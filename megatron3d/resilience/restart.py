"""A worker that torchrun restarted after a failure (``--max-restarts``) says so.

torchrun tells its workers which restart of the group they are (``TORCHELASTIC_RESTART_COUNT``,
0 for the first start) and how many it allows (``TORCHELASTIC_MAX_RESTARTS``). A restarted run
resumes from the newest state it finds (the local checkpoints, else ``--load``), like any
resumed run; this is the one line that tells a reader of the log why it started again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Restart:
    count: int  # this is the count-th restart of the workers
    limit: int  # torchrun's --max-restarts

    @classmethod
    def from_env(cls) -> Restart | None:
        """The restart this worker belongs to, or None on a first start (or no torchrun)."""
        count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if count == 0:
            return None
        return cls(count, int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0))

    def line(self, iteration: int) -> str:
        """The log line, once the state to resume from (at ``iteration``) is loaded."""
        head = (f"restart {self.count} of {self.limit} (torchrun restarted the workers after "
                f"a failure): resuming from iteration {iteration}")
        if iteration == 0:
            return (head + ": nothing was saved to resume from (set --load to the --save "
                    "directory, or --non-persistent-save-interval)")
        return head + " (the state loaded above)"
