"""Non-persistent saves (``--non-persistent-save-interval``): every N steps each rank's state
goes to its node-local store and to a peer's, while training goes on.

On the training thread, at the save's step: the state is captured exactly as a global save
captures it (``snapshot.HostSnapshot``: the owned fp32 weights and Adam moments copied
straight from the optimizer's tensors into one host buffer, pinned on GPUs; on a GPU this is
a device-to-host copy and one device sync at the save point, as a global save's), with the
RNG streams and meta.json's fields (``saving``'s own functions). A thread (below the
training's CPU priority, ``priority.py``) then checks the host copy is finite (a
non-finite state is not kept), writes this rank's copy (the global format: a same-layout
``loading.load`` reads it; not flushed to disk, a CRC guards it) over the files of the
oldest copy it replaces (``store.reuse``, ``pages.py``), sends the written bytes to the peer
(``link.PeerLink``; the file mapped back, so no further copy) while receiving its source's
copy straight into the files of the oldest held copy, and meets every rank at a barrier,
after which its copy is marked confirmed: every rank then holds its own state and its
source's of that iteration.

At most one save is in flight: a save first waits for the one before. So when a rank
finishes step k+1 and saves, every rank's state of step k is held twice (its thread passed
that barrier); a failure at any later moment loses at most the step after the newest
complete state, which the restarted job runs again: at most one finished step re-executed.
The thread only writes host memory or a node-local disk, and it is the only user of its
gloo group. A failed local write is logged and the run goes on: the global checkpoints
remain.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

from torch import nn

from megatron3d.checkpoint import io
from megatron3d.checkpoint.local import pages, priority, store
from megatron3d.checkpoint.local.link import PeerLink
from megatron3d.checkpoint.progress import Progress
from megatron3d.checkpoint.saving import meta_of, rank_payload
from megatron3d.checkpoint.snapshot import HostSnapshot
from megatron3d.config import TrainConfig
from megatron3d.log import get_logger
from megatron3d.mpu.random import RNGStreams
from megatron3d.mpu.state import ParallelState
from megatron3d.optim.lr_schedule import LRSchedule
from megatron3d.optim.mixed_precision import MixedPrecisionOptimizer

logger = get_logger(__name__)


class LocalSaver:
    """``saver(progress)`` keeps this rank's state at ``progress``; ``wait()`` returns once
    that save is written and replicated; ``finish()`` (a run's normal end) removes the
    rank's store: nothing is left to restart from."""

    def __init__(self, cfg: TrainConfig, state: ParallelState, params: list[nn.Parameter],
                 optimizer: MixedPrecisionOptimizer, rng: RNGStreams, lr_schedule: LRSchedule,
                 series: str, link: PeerLink, root: Path, config_hash: str) -> None:
        self.cfg, self.state, self.params, self.optimizer = cfg, state, params, optimizer
        self.rng, self.lr_schedule, self.series = rng, lr_schedule, series
        self.link, self.root, self.config_hash = link, root, config_hash
        self._snapshot: HostSnapshot | None = None  # allocated at the first save
        self._thread: threading.Thread | None = None
        self._errors: list[str] = []

    def __call__(self, progress: Progress) -> None:
        self.wait()
        if self._snapshot is None:
            self._snapshot = HostSnapshot(self.params, self.optimizer.shard, self.state,
                                          self.optimizer.replica_axes)
        it = progress.iteration
        self._snapshot.capture(self.optimizer.live_state)
        payload = rank_payload(self.cfg, self.state, self._snapshot, self.rng, it)
        meta = meta_of(self.cfg, self.state, self.optimizer, progress, self.series,
                       self.lr_schedule)
        self._thread = threading.Thread(target=self._write,
                                        args=(it, payload, meta, self._snapshot),
                                        name=f"local-checkpoint-{it}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Return once the save in flight is written and replicated (its failures logged)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for error in self._errors:
            logger.warning("a local checkpoint was not kept: %s", error)
        self._errors.clear()

    def finish(self) -> None:
        """The run ended normally: wait for the last save, then remove this rank's store."""
        self.wait()
        self.link.barrier()  # every rank's thread is done with the others' directories
        shutil.rmtree(store.rank_dir(self.root, self.state.world_rank), ignore_errors=True)

    def _write(self, iteration: int, payload: dict, meta: dict,
               snapshot: HostSnapshot) -> None:
        """The thread: the finiteness check (of the host copy: nothing on the device), own
        copy, swap with the peer and source (the source's copy received straight into the
        files of the held copy it replaces), barrier, confirm. The swap and the barrier
        happen whatever failed, so that no rank waits forever."""
        priority.lower_this_thread()
        rank, source = self.state.world_rank, self.link.source
        outgoing: list[memoryview] = []
        own = store.own_dir(self.root, rank)
        if not snapshot.all_finite():
            logger.warning("local checkpoint at iteration %d: rank %d's weights are not "
                           "finite, not kept", iteration, rank)
        else:
            outgoing = self._attempt(lambda: self._write_own(own, iteration, payload,
                                                             meta)) or []
        held = store.held_dir(self.root, rank, source)
        staging: list[Path] = []  # where the source's copy was placed, if it was
        incoming = self.link.swap(outgoing, place=lambda header, sizes: self._attempt(
            lambda: _place(held, iteration, header, sizes, staging)))
        if incoming and staging and source != rank:
            names, sidecar = store.described(incoming[0])
            self._attempt(lambda: store.finish_copy(
                staging[0], io.iteration_dir(held, iteration), sidecar, names))
            self._attempt(lambda: store.prune(held))
        self.link.barrier()
        if outgoing:
            self._attempt(lambda: store.confirm(io.iteration_dir(own, iteration)))
            self._attempt(lambda: store.prune(own))

    def _write_own(self, parent: Path, iteration: int, payload: dict,
                   meta: dict) -> list[memoryview]:
        """This rank's copy (a global save's rank file and meta.json, written over the files
        of the copy it replaces) and its frames for the peer: the files mapped back (the
        pages written, not a copy of them)."""
        staging = store.reuse(parent, iteration)
        rank_file = io.rank_file(staging, self.state.world_rank)
        pages.overwrite(rank_file, lambda f: io.serialize_rank(payload, f))
        io.write_meta(staging, meta, sync=False)
        files = {name: pages.mapped(staging / name) for name in (rank_file.name, "meta.json")}
        sidecar = store.sidecar_of(self.state.world_rank, iteration, self.config_hash, files)
        store.finish_copy(staging, io.iteration_dir(parent, iteration), sidecar, files)
        return store.frames(files, sidecar)

    def _attempt(self, work):
        try:
            return work()
        except OSError as err:
            self._errors.append(f"{err.strerror or err} ({err.filename or self.root})")
        except ValueError as err:  # a malformed copy from the source
            self._errors.append(f"{err} ({self.root})")
        return None


def _place(held: Path, iteration: int, header: memoryview, sizes: list[int],
           staging: list[Path]) -> list[memoryview]:
    """Where the source's copy of ``iteration`` is received: its files in the staging
    directory of ``held`` (the oldest held copy's, reused), mapped at their new lengths."""
    names, _ = store.described(header)
    directory = store.reuse(held, iteration)
    views = [pages.mapped(directory / name, size)
             for name, size in zip(names, sizes, strict=True)]
    staging.append(directory)
    return views
