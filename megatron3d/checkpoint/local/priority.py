"""The local checkpoints' threads run below the training's CPU priority.

Linux schedules each thread alone and a new thread starts at its creator's niceness. The
save thread lowers its own; the threads gloo starts for the local-checkpoint group (the TCP
loop that copies a received copy into place, the workers) are started by a thread that
lowered its niceness first. Where the host's cores are all busy the training then gets them
first, and the save takes the gaps (a save still unfinished at the next one is waited for).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import TypeVar

NICE = 19  # the lowest: about 1.5% of a core where the training wants it too; the rest in its gaps
T = TypeVar("T")


def lower_this_thread() -> None:
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)


def made_below_training(make: Callable[[], T]) -> T:
    """``make()`` run in a thread of lowered priority (so are the threads it starts)."""
    made: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        lower_this_thread()
        try:
            made.append(make())
        except BaseException as err:  # re-raised in the caller
            failed.append(err)

    thread = threading.Thread(target=run, name="local-checkpoint-setup")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return made[0]
