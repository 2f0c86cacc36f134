"""A failing rank's error, posted where every rank of the job can see it.

A rank that meets bad input during the run (a batch with token ids outside the vocabulary, a
``--save`` that fails at a save) stops with its one ``error:`` line. Its peers are then waiting
for it inside a collective: gloo ends that wait with "connection closed" (a traceback), NCCL
only at the backend timeout. So the failing rank first posts its rank under one key of the
job's store (the launcher's TCPStore under torchrun, which outlives any worker), and every
rank checks that key: the watchdog thread every few seconds, the main thread when a collective
fails. Peers then stop promptly with one line pointing at the failed rank, exit code 2.
"""

from __future__ import annotations

import contextlib
import sys
import threading

import torch.distributed as dist

_KEY = "megatron3d/failed_rank"
PEER_EXIT_CODE = 2


class FailureBoard:
    """``post`` on the failing rank; ``peer_failure`` on the others (any thread)."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        self._store, self.rank = store, rank
        self._lock = threading.Lock()
        self._announced = False
        self._posted = False

    def post(self) -> None:
        """Tell every peer that this rank stopped with an error (after printing it)."""
        self._posted = True  # from now on this rank's own exit path owns the output
        with contextlib.suppress(RuntimeError):  # a store gone: the launcher ends the job
            self._store.set(_KEY, str(self.rank))

    def failed_peer(self) -> int | None:
        """The rank that posted, when it is another one and this rank has not failed
        itself; None otherwise."""
        if self._posted:
            return None
        try:
            if not self._store.check([_KEY]):
                return None
            failed = int(self._store.get(_KEY))
        except (RuntimeError, ValueError):  # store unreachable: nothing to learn here
            return None
        return None if failed == self.rank else failed

    def stop_for_peer(self) -> bool:
        """True if another rank failed; the first caller (watchdog or main thread) prints the
        one line saying so, so it appears once per rank."""
        failed = self.failed_peer()
        if failed is None:
            return False
        with self._lock:
            if not self._announced:
                self._announced = True
                sys.stderr.write(f"rank {self.rank} stops: rank {failed} stopped with an error "
                                 "(its 'error:' line says what to fix)\n")
                sys.stderr.flush()
        return True
