"""Restore the newest complete non-persistent state at build, before the model is made.

Every rank lists the copies it can see in the store (on one machine every rank's, across
nodes its node's), and the lists are gathered on the local-checkpoint group. The restored
iteration is the newest one newer than the global checkpoint in --load at which every
rank's state has an intact copy somewhere. Each state is read by its owner when the owner
sees a copy (its own, or on one machine its peer's replica), else sent by the lowest rank
that holds one. The copies chosen are checked first by whoever reads them (CRC-32 of each
file and the configuration hash, ``store.intact``) and the verdicts gathered: a bad copy is
dropped and the choice made again, down to an older iteration, else the global checkpoint.
The owner then writes its state into its own store and the run loads it with
``loading.load`` (the same layout: a bitwise resume, RNG streams included). A state that
every rank had confirmed and that is now lost everywhere is one ``notice:`` line.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megatron3d.checkpoint import io
from megatron3d.checkpoint.local import store
from megatron3d.checkpoint.local.link import PeerLink
from megatron3d.errors import CheckpointError
from megatron3d.log import get_logger

logger = get_logger(__name__)

Listing = list[tuple[int, int, bool, str]]  # (owner, iteration, confirmed, path) per copy


@dataclass(frozen=True)
class Choice:
    """The iteration restored and, per owner, (the rank that reads its copy, the path)."""

    iteration: int
    sources: dict[int, tuple[int, str]]


def choose(listings: list[Listing], bad: set[tuple[int, str]], world_size: int,
           floor: int) -> Choice | None:
    """The newest iteration above ``floor`` with a usable copy of every owner's state (a
    copy is usable unless (its reader, path) is in ``bad``); None if there is none."""
    by_iteration: dict[int, dict[int, list[tuple[int, str]]]] = defaultdict(
        lambda: defaultdict(list))
    for holder, copies in enumerate(listings):
        for owner, iteration, _, path in copies:
            if iteration > floor and (holder, path) not in bad:
                by_iteration[iteration][owner].append((holder, path))
    for iteration in sorted(by_iteration, reverse=True):
        owners = by_iteration[iteration]
        if len(owners) == world_size:
            return Choice(iteration, {owner: _reader(owner, owners[owner])
                                      for owner in range(world_size)})
    return None


def _reader(owner: int, holders: list[tuple[int, str]]) -> tuple[int, str]:
    """The owner itself when it sees a copy (its own first), else the lowest holder."""
    mine = [h for h in holders if h[0] == owner]
    own = [h for h in mine if store.is_own(h[1], owner)]
    return (own or mine or sorted(holders))[0]


def lost(listings: list[Listing], bad: set[tuple[int, str]], world_size: int,
         resumed: int) -> tuple[int, list[int]] | None:
    """The newest state confirmed by every rank after ``resumed`` that lacks some owner's
    intact copy: (iteration, those owners). An unconfirmed one was still being saved."""
    confirmed = {it for copies in listings for _, it, ok, _ in copies if ok and it > resumed}
    if not confirmed:
        return None
    newest = max(confirmed)
    present = {owner for holder, copies in enumerate(listings)
               for owner, it, _, path in copies if it == newest and (holder, path) not in bad}
    return newest, sorted(set(range(world_size)) - present)


def restore(link: PeerLink, root: Path, config_hash: str, global_iteration: int | None,
            global_name: str, sees: Callable[[Path], list[store.Copy]]) -> Path | None:
    """Every rank: the directory of this rank's own copy of the restored state, or None to
    load the global checkpoint (``global_iteration`` in ``global_name``) or start afresh."""
    hashes = link.gather(config_hash)
    if len(set(hashes)) > 1:
        logger.warning("the ranks' configurations differ (hashes %s): local checkpoints "
                       "are not used", sorted(set(hashes)))
        return None
    floor = -1 if global_iteration is None else global_iteration
    listings: list[Listing] = link.gather(
        [(c.owner, c.iteration, c.confirmed, c.path) for c in sees(root)
         if c.config_hash == config_hash])
    bad: set[tuple[int, str]] = set()
    read: dict[str, dict[str, bytes]] = {}
    while (choice := choose(listings, bad, link.world_size, floor)) is not None:
        mine = {path for reader, path in choice.sources.values() if reader == link.rank}
        for path in mine - read.keys():
            files = store.intact(Path(path), config_hash)
            if files is not None:
                read[path] = files
        found = link.gather(sorted(mine - read.keys()))
        bad |= {(reader, path) for reader, paths in enumerate(found) for path in paths}
        if not any(found):
            break
    gone = lost(listings, bad, link.world_size, max(floor, choice.iteration if choice else -1))
    resumed = (f"the local checkpoint at iteration {choice.iteration}" if choice else
               f"the global checkpoint at iteration {global_iteration} in {global_name}"
               if global_iteration is not None else "scratch (no global checkpoint)")
    if gone is not None and gone[1]:
        logger.info("notice: the local checkpoint at iteration %d lost rank(s) %s's state "
                    "(no intact copy: its own and its replica are both gone or damaged); "
                    "resuming from %s", gone[0], ", ".join(map(str, gone[1])), resumed)
    if choice is None:
        return None
    _move(link, root, choice, read)
    logger.info("resuming from the local checkpoint at iteration %d (%s)", choice.iteration,
                "; ".join(_origin(o, r, p) for o, (r, p) in sorted(choice.sources.items())))
    return store.copy_dir(root, link.rank, choice.iteration)


def _origin(owner: int, reader: int, path: str) -> str:
    where = "its own copy" if store.is_own(path, owner) else f"the replica {path}"
    sent = "" if reader == owner else f", sent by rank {reader}"
    return f"rank {owner}'s state from {where}{sent}"


def _move(link: PeerLink, root: Path, choice: Choice, read: dict[str, dict[str, bytes]]) -> None:
    """Each owner's chosen copy into its own store: written there by the owner that read a
    replica, sent point-to-point by the holder otherwise (in owner order on every rank, so
    the transfers cannot wait on each other in a cycle)."""
    target = store.copy_dir(root, link.rank, choice.iteration)
    for owner, (reader, path) in sorted(choice.sources.items()):
        if reader == link.rank and owner == link.rank:
            if Path(path) != target:
                store.write_copy(target, read[path], store.read_sidecar(Path(path)))
        elif reader == link.rank:
            link.send(store.pack(read[path], store.read_sidecar(Path(path))), to=owner)
        elif owner == link.rank:
            files, sidecar = store.unpack(link.receive(reader))
            store.write_copy(target, files, sidecar)
    iterations = link.gather(io.read_meta(target)["iteration"])
    if set(iterations) != {choice.iteration}:
        raise CheckpointError(f"the restored local checkpoints disagree on the iteration "
                              f"({iterations}): remove {root} and resume from --load")
