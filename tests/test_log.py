"""The iteration line, rank-aware logging setup and the TensorBoard writer."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron3d.checkpoint.progress import Progress
from megatron3d.log import IterationStats, format_iteration_line, get_logger, setup_logging
from megatron3d.training.tensorboard import TensorBoardWriter

STATS = IterationStats(
    iteration=10, train_iters=100, consumed_samples=160, consumed_tokens=163840,
    elapsed_s=0.1234, learning_rate=3.787e-6, global_batch_size=16, lm_loss=63.84045,
    loss_scale=1.0, grad_norm=2.7634, num_zeros=0.0, skipped_iterations=0, nan_iterations=0,
    samples_per_second=129.6, tflops=12.34,
)

EXPECTED = (
    " iteration       10/     100 |"
    " consumed samples:          160 |"
    " consumed tokens:       163840 |"
    " elapsed time per iteration (s): 0.1234 |"
    " learning rate: 3.787E-06 |"
    " global batch size:    16 |"
    " lm loss: 6.384045E+01 |"
    " loss scale: 1.0 |"
    " grad norm: 2.763 |"
    " num zeros: 0.0 |"
    " number of skipped iterations:   0 |"
    " number of nan iterations:   0 |"
    " samples per second: 129.600 |"
    " TFLOPs: 12.34 |"
)


def keys(line: str) -> list[str]:
    return [part.split(":")[0].strip() for part in line.split("|")[1:-1]]


def test_iteration_line_exact():
    assert format_iteration_line(STATS) == EXPECTED


def test_params_norm_follows_num_zeros():
    line = format_iteration_line(dataclasses.replace(STATS, params_norm=12.34567))
    assert " num zeros: 0.0 | params norm: 12.346 | number of skipped" in line


def test_field_order():
    assert keys(format_iteration_line(STATS)) == [
        "consumed samples", "consumed tokens", "elapsed time per iteration (s)",
        "learning rate", "global batch size", "lm loss", "loss scale", "grad norm",
        "num zeros", "number of skipped iterations", "number of nan iterations",
        "samples per second", "TFLOPs"]


def test_loss_in_e_notation_with_six_decimals():
    line = format_iteration_line(dataclasses.replace(STATS, lm_loss=2.0))
    assert " lm loss: 2.000000E+00 |" in line


def test_widths_of_counts():
    stats = dataclasses.replace(STATS, iteration=123456, train_iters=1000000,
                                global_batch_size=2048, skipped_iterations=12, nan_iterations=3)
    line = format_iteration_line(stats)
    assert line.startswith(" iteration   123456/ 1000000 |")
    assert " global batch size:  2048 |" in line
    assert " number of skipped iterations:  12 |" in line
    assert " number of nan iterations:   3 |" in line


def test_model_tflops_and_mfu_only_when_known():
    assert "model TFLOPs" not in EXPECTED and "MFU" not in EXPECTED
    line = format_iteration_line(dataclasses.replace(STATS, model_tflops=9.25, mfu_percent=41.23))
    assert line == EXPECTED + " model TFLOPs: 9.25 | MFU: 41.2% |"
    mfu_only = format_iteration_line(dataclasses.replace(STATS, mfu_percent=5.0))
    assert mfu_only == EXPECTED + " MFU: 5.0% |"


def test_absent_fields_are_left_out_not_zeroed():
    stats = dataclasses.replace(STATS, lm_loss=None, grad_norm=None, num_zeros=None)
    found = keys(format_iteration_line(stats))
    assert "lm loss" not in found and "grad norm" not in found and "num zeros" not in found
    assert "loss scale" in found


@pytest.fixture
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_only_the_logging_rank_prints_info(capsys, restore_root_logger):
    setup_logging(rank=1, log_rank=0)
    log = get_logger("megatron3d.test")
    log.info("hidden")
    log.warning("visible")
    out, err = capsys.readouterr()
    assert "hidden" not in out + err
    assert err == "[rank 1] WARNING megatron3d.test: visible\n"


def test_logging_rank_prints_bare_info_once(capsys, restore_root_logger):
    setup_logging(rank=3, log_rank=3)
    setup_logging(rank=3, log_rank=3)  # idempotent: no duplicate handlers
    get_logger("megatron3d.test").info(EXPECTED)
    out, err = capsys.readouterr()
    assert out == EXPECTED + "\n"
    assert err == ""


def test_unknown_level(restore_root_logger):
    with pytest.raises(ValueError, match="unknown log level"):
        setup_logging(rank=0, log_rank=0, level="LOUD")


def scalars(log_dir) -> EventAccumulator:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return events


def test_tensorboard_scalars_round_trip_vs_iterations_samples_and_tokens(tmp_path):
    writer = TensorBoardWriter(str(tmp_path), enabled=True)
    for step, loss in [(10, 6.5), (20, 5.25), (30, 4.0)]:
        writer.write({"lm loss": loss, "batch-size": 16, "grad-norm": None},
                     Progress(step, step * 16, step * 16 * 1024))
    writer.flush()
    writer.close()
    events = scalars(tmp_path)
    tags = set(events.Tags()["scalars"])
    assert tags == {f"{name}{vs}" for name in ("lm loss", "batch-size")
                    for vs in ("", " vs samples", " vs tokens")}  # None: not written
    series = {vs: [(e.step, e.value) for e in events.Scalars(f"lm loss{vs}")]
              for vs in ("", " vs samples", " vs tokens")}
    assert series[""] == [(10, 6.5), (20, 5.25), (30, 4.0)]
    assert series[" vs samples"] == [(160, 6.5), (320, 5.25), (480, 4.0)]
    assert series[" vs tokens"] == [(163840, 6.5), (327680, 5.25), (491520, 4.0)]
    assert events.Scalars("batch-size")[0].value == 16


@pytest.mark.parametrize(("enabled", "with_dir"), [(False, True), (True, False)])
def test_disabled_writer_is_a_no_op(tmp_path, enabled, with_dir):
    log_dir = tmp_path / "tb"
    writer = TensorBoardWriter(str(log_dir) if with_dir else None, enabled=enabled)
    assert not writer.active
    writer.write({"lm loss": 1.0}, Progress(1, 1, 1))
    writer.flush()
    writer.close()
    assert not log_dir.exists()
    assert list(tmp_path.iterdir()) == []
