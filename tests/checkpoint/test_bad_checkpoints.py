"""A bad checkpoint gives one clear error and changes nothing on disk; --finetune and
--use-checkpoint-args load what they say."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import pretrain_gpt
from megatron3d.checkpoint import io, loading
from megatron3d.mpu.random import RNGStreams
from tests.helpers.tiny import train_argv


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt") / "run"
    assert pretrain_gpt.main(train_argv("gpt2", 5, "--save", str(root), "--exit-interval",
                                        "3")) == 0  # a run of 5 stopped at 3: resumes go on
    assert (root / "latest").read_text().strip() == "3"
    return root


def _damage_missing_shard(root: Path) -> None:
    (root / "iter_0000003" / "rank_00000.pt").unlink()


def _damage_truncated(root: Path) -> None:
    path = root / "iter_0000003" / "rank_00000.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _damage_latest(root: Path) -> None:
    (root / "latest").unlink()


@pytest.mark.parametrize(("damage", "expected"), [
    (_damage_missing_shard, "rank_00000.pt is missing"),
    (_damage_truncated, "cannot be read"),
    (_damage_latest, "no 'latest' file"),
], ids=["missing shard", "truncated file", "missing latest"])
def test_damaged_checkpoint_fails_with_one_line(checkpoint, tmp_path, capsys, damage, expected):
    root = tmp_path / "copy"
    shutil.copytree(checkpoint, root)
    damage(root)
    before = _tree(root)
    assert pretrain_gpt.main(train_argv("gpt2", 5, "--load", str(root))) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and expected in err, err
    assert _tree(root) == before


def test_a_different_model_is_refused(checkpoint, capsys):
    before = _tree(checkpoint)
    assert pretrain_gpt.main(train_argv("gpt2", 5, "--load", str(checkpoint),
                                        "--hidden-size", "64")) == 2
    err = capsys.readouterr().err
    assert "different model" in err and "hidden_size" in err and err.count("\n") == 1, err
    assert _tree(checkpoint) == before


def test_use_checkpoint_args_needs_no_model_flags(checkpoint, capsys):
    argv = train_argv("gpt2", 5, "--load", str(checkpoint), "--use-checkpoint-args")
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads"):
        i = argv.index(flag)
        del argv[i:i + 2]
    assert pretrain_gpt.main(argv) == 0
    out = capsys.readouterr().out
    assert "loaded" in out and "iteration        4/" in out  # resumed after iteration 3


def _first_loss(out: str) -> float:
    line = next(ln for ln in out.splitlines() if ln.startswith(" iteration        1/"))
    return float(line.split("lm loss: ")[1].split()[0])


def test_finetune_loads_weights_and_starts_at_zero(checkpoint, capsys):
    assert pretrain_gpt.main(train_argv("gpt2", 3)) == 0
    scratch = _first_loss(capsys.readouterr().out)
    assert pretrain_gpt.main(train_argv("gpt2", 3, "--load", str(checkpoint),
                                        "--finetune")) == 0
    out = capsys.readouterr().out
    assert "loaded" in out
    assert _first_loss(out) < scratch  # same first batch, trained weights


def test_keep_last_n_prunes_old_checkpoints(tmp_path):
    root = tmp_path / "run"
    assert pretrain_gpt.main(train_argv("gpt2", 5, "--save", str(root), "--save-interval", "1",
                                        "--keep-last-n", "2")) == 0
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000004", "iter_0000005",
                                                      "latest"]  # no .lock: removed at exit


def _checkpoint_dir(root, iteration: int, series: str) -> None:
    directory = io.iteration_dir(root, iteration)
    directory.mkdir()
    layout = {"world_size": 1, "tp": 1, "pp": 1, "dp": 1, "zero_stage": 0}
    io.write_meta(directory, {"format_version": io.FORMAT_VERSION, "iteration": iteration,
                              "consumed_samples": 0, "consumed_tokens": 0, "adam_step": 0,
                              "layout": layout, "loss_scaler": None, "series": series,
                              "config": {"model": {}}})


def test_prune_orders_by_iteration_and_keeps_latest_and_other_series(tmp_path):
    """Past iteration 9999999 names no longer sort; directories past ``latest`` (a resumed
    run's abandoned future), unfinished saves, another series' checkpoints and unreadable
    ones are not pruning's to remove."""
    for iteration in (5, 9_999_999, 10_000_000, 10_000_001):
        _checkpoint_dir(tmp_path, iteration, "mine")
    _checkpoint_dir(tmp_path, 6, "theirs")
    io.iteration_dir(tmp_path, 8).mkdir()  # no meta.json: whose it is cannot be told
    (tmp_path / "iter_0000007.tmp").mkdir()
    (tmp_path / "latest").write_text("10000000\n")
    io.prune(tmp_path, 1, "mine")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000006", "iter_0000007.tmp", "iter_0000008", "iter_10000000", "iter_10000001",
        "latest"]


def test_saving_removes_what_killed_saves_left(checkpoint, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(checkpoint, root)
    (root / "iter_0000006.tmp").mkdir()  # a save of another iteration, killed
    (root / "iter_0000004").mkdir()  # renamed, but its save never reached 'latest'
    assert pretrain_gpt.main(train_argv("gpt2", 4, "--load", str(root), "--save",
                                        str(root), "--override-opt-param-scheduler")) == 0
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000003", "iter_0000004",
                                                      "latest"]
    assert (root / "iter_0000004" / "meta.json").exists()
    assert (root / "latest").read_text().strip() == "4"


class _Payload:
    """Unpickling this creates ``marker``: what a crafted checkpoint would do, harmlessly."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_a_crafted_rank_file_runs_no_code(checkpoint, tmp_path, capsys):
    root = tmp_path / "copy"
    shutil.copytree(checkpoint, root)
    marker = tmp_path / "payload-ran"
    path = root / "iter_0000003" / "rank_00000.pt"
    payload = torch.load(path, weights_only=True)
    payload["rng"]["extra"] = _Payload(marker)
    torch.save(payload, path)
    before = _tree(root)
    assert pretrain_gpt.main(train_argv("gpt2", 5, "--load", str(root))) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "could run code, so it is not loaded" in err and "(io.open)" in err, err
    assert not marker.exists()
    assert _tree(root) == before


def test_checkpoints_with_numpy_rng_state_still_load(checkpoint, tmp_path):
    """Rank files written before the numpy RNG state was stored as plain data hold numpy's
    own (kind, uint32 array, ...) tuple: they load and restore the same state."""
    root = tmp_path / "copy"
    shutil.copytree(checkpoint, root)
    path = root / "iter_0000003" / "rank_00000.pt"
    payload = torch.load(path, weights_only=True)
    saved = payload["rng"]["numpy"]
    legacy = (saved["kind"], saved["keys"].numpy().astype(np.uint32), saved["pos"],
              saved["has_gauss"], saved["cached_gaussian"])
    payload["rng"]["numpy"] = legacy
    torch.save(payload, path)
    legacy_read = io.read_rank(root / "iter_0000003", 0)["rng"]
    assert isinstance(legacy_read["numpy"][1], np.ndarray)
    rng = RNGStreams.create(1, 0, 0, torch.device("cpu"))
    np.random.seed(1)  # different states before each restore: equal after means restored
    loading._restore_rng(rng, legacy_read)
    from_legacy = np.random.get_state()
    np.random.seed(2)
    loading._restore_rng(rng, io.read_rank(checkpoint / "iter_0000003", 0)["rng"])
    from_plain = np.random.get_state()
    assert from_legacy[0] == from_plain[0] and (from_legacy[1] == from_plain[1]).all()
    assert from_legacy[2:] == from_plain[2:]
    assert pretrain_gpt.main(train_argv("gpt2", 4, "--load", str(root),
                                        "--override-opt-param-scheduler")) == 0
