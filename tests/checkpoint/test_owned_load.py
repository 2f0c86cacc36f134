"""Loading into another layout reads and holds only what each rank owns: a (2, 2, 2)
checkpoint loaded at (4, 1, 2) raises a rank's peak memory by at most 1.5x the bytes of its
own shard (weights and both Adam moments; the old loader, which built logical tensors, took
6-13x), each rank opening a rank file at most once; the chunk index only guides which files
are opened (a checkpoint without one, or with a damaged one, loads the same). The
same-layout case (only the rank's own file) is in ``test_resume.py``.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
from pathlib import Path

import pytest

from megatron3d.checkpoint import chunk_index, loading
from megatron3d.convert.streaming import PeakMemory
from tests.helpers.dist import run_distributed
from tests.helpers.files import opened_files
from tests.helpers.runs import build, train, train_single
from tests.helpers.tiny import train_argv

_LIBC = ctypes.CDLL(None)

# 29M parameters, most of them a padded vocabulary table (padded to 32016 rows at TP=2,
# 32032 at TP=4): a (4, 1, 2) rank's shard is 44 MB under ZeRO-1 and ZeRO-3, well above
# what a first load costs whatever the size (~4 MB: code pages).
MODEL = ("--hidden-size", "512", "--num-layers", "4", "--num-attention-heads", "8",
         "--vocab-size", "32003", "--seq-length", "32", "--global-batch-size", "4",
         "--lr-warmup-iters", "0")
SAVED = ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--zero-stage", "1", "--pp-partition-method", "uniform")
LOADED = ("--tensor-model-parallel-size", "4")
SHARD_FACTOR = 1.5  # the bound on a load's peak memory, in shard bytes
ZERO_STAGES = ("3", "1")


def _save(directory: str) -> None:
    """One step at (2, 2, 2), saved with its index."""
    train(train_argv("gpt2", 1, *MODEL, *SAVED, "--save", directory))


def _load_elsewhere(directory: str) -> dict[str, dict]:
    """A (4, 1, 2) trainer loading the checkpoint under each ZeRO stage, with this rank's
    peak memory growth, shard bytes and opened files measured inside ``loading.load``. The
    heap's free memory is given back first: reused, it would hide growth."""
    measured: dict[str, dict] = {}
    original = loading.load
    for zero in ZERO_STAGES:

        def load(*args, zero: str = zero, **kwargs):
            optimizer = args[4]
            _LIBC.malloc_trim(0)
            peak = PeakMemory()
            with opened_files() as opened:
                progress = original(*args, **kwargs)
            measured[zero] = {"growth": peak.growth, "opened": opened,
                              "shard_bytes": 12 * optimizer.shard.numel}
            return progress

        loading.load = load
        try:
            build(train_argv("gpt2", 1, *MODEL, *LOADED, "--zero-stage", zero, "--load",
                             directory))
        finally:
            loading.load = original
        gc.collect()
    return measured


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> list[dict[str, dict]]:
    directory = str(tmp_path_factory.mktemp("owned") / "ckpt")
    run_distributed(_save, 8, directory, timeout_s=300)
    return run_distributed(_load_elsewhere, 8, directory, timeout_s=300)


def _ratios(measured: list[dict[str, dict]], zero: str) -> list[float]:
    return [m[zero]["growth"] / m[zero]["shard_bytes"] for m in measured]


def test_a_resharded_zero3_load_holds_at_most_1_5x_the_ranks_shard(measured):
    assert max(_ratios(measured, "3")) <= SHARD_FACTOR, measured
    for m in measured:  # a file is opened at most once
        for zero in ZERO_STAGES:
            assert len(m[zero]["opened"]) == len(set(m[zero]["opened"])), m[zero]["opened"]


def test_a_resharded_zero1_load_holds_at_most_1_5x_the_ranks_shard(measured):
    assert max(_ratios(measured, "1")) <= SHARD_FACTOR, measured


def _losses_after_loading(root: Path) -> list[float]:
    return train_single(train_argv("gpt2", 4, "--load", str(root), "--zero-stage",
                                   "1")).losses


def test_the_index_only_guides_which_files_are_read(tmp_path, caplog):
    """A single process saved without ZeRO, loaded with ZeRO-1 (another layout, so the
    index is read): with the index, without it, with a damaged one or another checkpoint's,
    the same state loads; only an index that is there but unusable is reported."""
    root = tmp_path / "run"
    train_single(train_argv("gpt2", 4, "--save", str(root), "--exit-interval", "3"))
    checkpoint = root / "iter_0000003"
    assert (checkpoint / chunk_index.INDEX).exists()  # saving wrote it
    with opened_files() as opened:
        expected = _losses_after_loading(root)
    assert opened == ["rank_00000.pt"]
    index = checkpoint / chunk_index.INDEX
    saved = json.loads(index.read_text())
    for damaged in (None, "{", json.dumps({**saved, "iteration": 2}),
                    json.dumps({**saved, "tensors": [{**saved["tensors"][0], "stride": 0}]})):
        index.unlink(missing_ok=True)
        if damaged is not None:
            index.write_text(damaged)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert _losses_after_loading(root) == expected
        warned = [r for r in caplog.records if "is not usable" in r.getMessage()]
        assert len(warned) == (damaged is not None), caplog.text

