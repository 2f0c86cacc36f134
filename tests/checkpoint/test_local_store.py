"""The non-persistent checkpoints' pure parts, in one process: the flags and their one-line
refusals, the peer ring, the store's copies and checksums, and the restore's choice."""

from __future__ import annotations

import math
from io import BytesIO
from pathlib import Path

import pytest
import torch

from megatron3d.checkpoint import io
from megatron3d.checkpoint.local import pages, store
from megatron3d.checkpoint.local.link import peer_of, source_of
from megatron3d.checkpoint.local.restore import choose, lost
from megatron3d.checkpoint.snapshot import HostSnapshot
from megatron3d.cli.arguments import parse_command_line
from megatron3d.config import CheckpointConfig
from megatron3d.errors import ConfigError
from megatron3d.validation import validate
from tests.helpers.tiny import train_argv

INTERVAL, TYPE, DIR = ("--non-persistent-save-interval", "--non-persistent-ckpt-type",
                       "--non-persistent-local-ckpt-dir")


def _config(*flags: str):
    cfg, _ = parse_command_line(train_argv("gpt2", 3, *flags))
    validate(cfg, 1)
    return cfg.checkpoint


def test_the_flags_and_megatrons_spelling():
    assert _config(INTERVAL, "2", TYPE, "in_memory").non_persistent_ckpt_type == "memory"
    local = _config(INTERVAL, "1", TYPE, "local", DIR, "/tmp/x")
    assert (local.non_persistent_save_interval, local.non_persistent_local_ckpt_dir) == (
        1, "/tmp/x")


@pytest.mark.parametrize(("flags", "says"), [
    ((INTERVAL, "1"), "--non-persistent-save-interval 1 needs --non-persistent-ckpt-type"),
    ((TYPE, "memory"), "--non-persistent-ckpt-type memory needs --non-persistent-save-interval"),
    ((INTERVAL, "1", TYPE, "local"), "local needs --non-persistent-local-ckpt-dir DIR"),
    ((DIR, "/tmp/x"), "is used only with --non-persistent-ckpt-type"),
    ((INTERVAL, "1", TYPE, "global"), "use --save-interval N instead"),
    ((INTERVAL, "0", TYPE, "memory"), "--non-persistent-save-interval"),
])
def test_combinations_that_cannot_work_are_one_line(flags, says):
    with pytest.raises(ConfigError) as info:
        _config(*flags)
    assert says in str(info.value) and "\n" not in str(info.value)


def test_each_rank_replicates_to_the_same_local_rank_of_the_next_node():
    assert [peer_of(r, 8, 4) for r in range(8)] == [4, 5, 6, 7, 0, 1, 2, 3]
    assert [peer_of(r, 4, 4) for r in range(4)] == [1, 2, 3, 0]  # one node: the next rank
    assert [peer_of(r, 6, 4) for r in range(6)] == [1, 2, 3, 4, 5, 0]  # not whole nodes
    assert all(source_of(peer_of(r, 8, 2), 8, 2) == r for r in range(8))
    assert peer_of(0, 1, 1) == 0


def test_the_store_is_the_jobs_own():
    ckpt = CheckpointConfig(non_persistent_ckpt_type="memory", non_persistent_save_interval=1)
    assert store.store_root(ckpt, {"TORCHELASTIC_RUN_ID": "a", "SLURM_JOB_ID": "7"}) == Path(
        "/dev/shm/megatron3d-a")
    assert store.store_root(ckpt, {"SLURM_JOB_ID": "7"}).name == "megatron3d-7"
    assert store.store_root(ckpt, {}).name == "megatron3d-local"


def test_a_copy_is_listed_only_when_complete_and_used_only_when_intact(tmp_path):
    saved = BytesIO()
    torch.save({"data": torch.arange(64.0)}, saved)  # a rank file: a zip with a CRC per record
    files = {"meta.json": b"{}", "rank_00001.pt": saved.getvalue()}
    directory = store.copy_dir(tmp_path, 1, 5)
    store.write_copy(directory, files, store.sidecar_of(1, 5, "h", files))
    (directory.parent / "iter_0000006.tmp").mkdir()  # a killed writer's
    [copy] = store.listed(tmp_path)
    assert (copy.owner, copy.iteration, copy.confirmed) == (1, 5, False)
    assert store.intact(directory, "h") == files
    assert store.intact(directory, "other config") is None
    tensor_at = files["rank_00001.pt"].find(torch.arange(64.0).numpy().tobytes())
    for at in (tensor_at + 100, 0):  # a tensor's bytes, the first record's header
        damaged = bytearray(files["rank_00001.pt"])
        damaged[at] ^= 0xFF
        (directory / "rank_00001.pt").write_bytes(bytes(damaged))
        assert store.intact(directory, "h") is None
    (directory / "rank_00001.pt").write_bytes(files["rank_00001.pt"])
    (directory / "meta.json").write_bytes(b"{ }")
    assert store.intact(directory, "h") is None
    assert store.unframe(store.frames(files, {"owner": 1})) == (files, {"owner": 1})


def test_the_newest_two_iterations_are_kept(tmp_path):
    for it in (8, 9, 10, 11):
        store.write_copy(store.copy_dir(tmp_path, 0, it), {}, {})
    store.prune(store.own_dir(tmp_path, 0))
    assert sorted(p.name for p in store.own_dir(tmp_path, 0).iterdir()) == [
        "iter_0000010", "iter_0000011"]


def test_a_save_overwrites_the_files_of_the_copy_it_replaces(tmp_path):
    """The oldest of ``KEEP`` copies leaves the listing (renamed to the new staging name)
    before any byte changes, its files are rewritten in place (the same inodes: pages reused,
    not freed and allocated again), cut to their new length, and what the new copy does not
    name is removed; the newer copy stays whole throughout."""
    parent = store.own_dir(tmp_path, 0)
    for it in (8, 9):
        files = {"rank_00000.pt": bytes([it]) * 4096, "meta.json": b"{}", "stale": b"x"}
        store.write_copy(io.iteration_dir(parent, it), files, store.sidecar_of(0, it, "h", {}))
    store.confirm(io.iteration_dir(parent, 8))
    inodes = {p.name: p.stat().st_ino for p in io.iteration_dir(parent, 8).iterdir()}
    staging = store.reuse(parent, 10)
    assert [c.iteration for c in store.listed(tmp_path)] == [9]
    assert sorted(p.name for p in staging.iterdir()) == ["meta.json", "rank_00000.pt", "stale"]
    pages.overwrite(staging / "rank_00000.pt", lambda f: f.write(b"new"))
    pages.mapped(staging / "meta.json", 4)[:] = b'{"a"'[:4]
    store.finish_copy(staging, io.iteration_dir(parent, 10), store.sidecar_of(0, 10, "h", {}),
                      ["rank_00000.pt", "meta.json"])
    done = io.iteration_dir(parent, 10)
    assert sorted(p.name for p in done.iterdir()) == ["local.json", "meta.json", "rank_00000.pt"]
    assert [(done / n).read_bytes() for n in ("rank_00000.pt", "meta.json")] == [b"new", b'{"a"']
    assert all((done / n).stat().st_ino == inodes[n] for n in ("rank_00000.pt", "meta.json"))
    assert [(c.iteration, c.confirmed) for c in store.listed(tmp_path)] == [(9, False),
                                                                           (10, False)]
    assert (io.iteration_dir(parent, 9) / "rank_00000.pt").read_bytes() == bytes([9]) * 4096
    assert store.reuse(store.own_dir(tmp_path, 1), 3).name == "iter_0000003.tmp"  # no copy yet


def _own(owner: int, it: int, confirmed: bool = True) -> tuple:
    return (owner, it, confirmed, f"/s/rank{owner}/own/iter_{it:07d}")


def _held(holder: int, owner: int, it: int) -> tuple:
    return (owner, it, True, f"/s/rank{holder}/held/rank{owner}/iter_{it:07d}")


def test_the_newest_iteration_with_every_state_is_restored_each_read_by_its_owner_if_seen():
    # rank 1's own copy of 7 is gone; rank 2 holds its replica; 8 is incomplete (in flight)
    listings = [[_own(0, 7), _held(0, 2, 7), _own(0, 8, False)],
                [],
                [_own(2, 7), _held(2, 1, 7)]]
    choice = choose(listings, set(), 3, floor=-1)
    assert choice is not None and choice.iteration == 7
    assert choice.sources == {0: (0, _own(0, 7)[3]), 1: (2, _held(2, 1, 7)[3]),
                              2: (2, _own(2, 7)[3])}
    assert lost(listings, set(), 3, resumed=7) is None  # 8 was never confirmed
    assert choose(listings, set(), 3, floor=7) is None  # --load holds 7 already
    bad = {(2, _held(2, 1, 7)[3])}  # the replica's checksum failed
    assert choose(listings, bad, 3, floor=-1) is None
    assert lost(listings, bad, 3, resumed=-1) == (7, [1])


@pytest.mark.parametrize(("values", "finite"), [
    ([1.0, 2.0], True), ([3e38, 3e38], True),  # finite values whose sum overflows
    ([1.0, math.nan], False), ([math.inf, 1.0], False), ([math.inf, -math.inf], False)])
def test_the_writer_threads_finiteness_check_is_exact(values, finite):
    """A local save keeps a state only if its host copy is finite (``HostSnapshot.all_finite``,
    a sum first, element by element only when the sum is not finite)."""
    snapshot = HostSnapshot.__new__(HostSnapshot)  # just the buffer: [kind, element]
    snapshot._buffer = torch.tensor([[0.0, 0.0], values])
    assert snapshot.all_finite() is finite
