"""The end of a run, through pretrain_gpt.main: validation and test evaluation, --skip-train,
a checkpoint that already finished, and the summary line with its stop reason."""

from __future__ import annotations

import io
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import pretrain_gpt
from megatron3d import device as devices
from megatron3d.config import CheckpointConfig
from megatron3d.data.prep.indexed_builder import IndexedDatasetBuilder
from megatron3d.log import setup_logging
from megatron3d.mpu.state import AxisGroup
from megatron3d.training.exit_watch import ExitWatch
from tests.helpers.runs import build
from tests.helpers.tiny import train_argv

ITERS = 3
EVAL = re.compile(r"^ validation loss at iteration (\d+) on (validation|test) set \| "
                  r"lm loss value: (\S+) \| lm loss PPL: (\S+) \|$", re.MULTILINE)
SUMMARY = re.compile(r"^end of run: iteration (\d+) \| consumed samples: (\d+) \| "
                     r"last lm loss: (\S+) \| last validation lm loss: (\S+) \| "
                     r"saved checkpoint: (\S+) \| stop reason: (.+)$", re.MULTILINE)


def _run(capsys, *extra: str, iters: int = ITERS, mock: bool = True) -> str:
    """pretrain_gpt.main on the tiny model; its stdout (it must exit 0)."""
    argv = train_argv("gpt2", iters, "--log-interval", "2", *extra)
    if not mock:
        argv.remove("--mock-data")
    assert pretrain_gpt.main(argv) == 0
    return capsys.readouterr().out


def _evaluations(out: str) -> dict[str, tuple[int, float, float]]:
    """Split -> (iteration, loss, perplexity) of the end-of-run evaluation blocks."""
    return {m[2]: (int(m[1]), float(m[3]), float(m[4])) for m in EVAL.finditer(out)}


def _files(root: Path) -> dict[str, tuple[int, bytes]]:
    return {str(p): (p.stat().st_mtime_ns, p.read_bytes()) for p in root.rglob("*")
            if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, str]:
    """A checkpoint at --train-iters, and the output of the run that saved it."""
    save = tmp_path_factory.mktemp("finished") / "ckpt"  # TensorBoard beside it
    out = io.StringIO()  # a module fixture cannot use capsys
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.stdout", out)
        assert pretrain_gpt.main(train_argv("gpt2", ITERS, "--log-interval", "2",
                                            "--save", str(save), "--tensorboard-dir",
                                            str(save.parent / "tb"))) == 0
    return save, out.getvalue()


def test_every_run_ends_with_validation_test_and_summary(finished):
    save, out = finished
    evaluations = _evaluations(out)
    assert evaluations.keys() == {"validation", "test"}
    iteration, loss, ppl = evaluations["validation"]
    assert iteration == ITERS and ppl == pytest.approx(np.exp(loss), rel=1e-6)
    assert evaluations["test"][1] != loss  # another split, other samples
    summary = SUMMARY.findall(out)
    assert len(summary) == 1, out[-2000:]
    it, consumed, train_loss, valid_loss, saved, reason = summary[0]
    assert (int(it), int(consumed)) == (ITERS, 8 * ITERS)  # --log-interval 2 skipped step 3
    assert float(train_loss) > 0 and float(valid_loss) == loss
    assert saved == str(save / f"iter_{ITERS:07d}")
    assert reason == f"--train-iters {ITERS} reached"


def test_end_of_run_evaluation_reaches_tensorboard(finished):
    save, out = finished
    events = EventAccumulator(str(save.parent / "tb"))
    events.Reload()
    evaluations = _evaluations(out)
    for tag, value in (("lm loss validation", evaluations["validation"][1]),
                       ("lm loss test", evaluations["test"][1]),
                       ("lm loss test ppl", evaluations["test"][2])):
        assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in events.Scalars(tag)] == [
            (ITERS, value)], tag


def test_skip_train_evaluates_the_checkpoint_and_writes_nothing(finished, capsys):
    save, trained = finished
    before = _files(save)
    out = _run(capsys, "--load", str(save), "--save", str(save), "--skip-train")
    assert "skipping training (--skip-train is on)" in out
    assert not [line for line in out.splitlines() if line.startswith(" iteration ")]
    assert _evaluations(out) == _evaluations(trained)  # the saved weights, evaluated again
    assert SUMMARY.search(out)[6] == "--skip-train"
    assert SUMMARY.search(out)[5] == "none"
    assert _files(save) == before


def test_a_finished_checkpoint_says_so_and_still_evaluates(finished, capsys):
    save, trained = finished
    out = _run(capsys, "--load", str(save))
    assert (f"checkpoint at iteration {ITERS} already reached --train-iters {ITERS}: nothing "
            "to train") in out
    assert _evaluations(out) == _evaluations(trained)
    assert _evaluations(out).keys() == {"validation", "test"}
    assert SUMMARY.search(out)[6] == f"checkpoint already at --train-iters {ITERS}"


def test_exit_interval_is_the_stop_reason(tmp_path, capsys):
    out = _run(capsys, "--save", str(tmp_path), "--exit-interval", "2", iters=50)
    assert "stopping at iteration 2 (--exit-interval 2)" in out
    summary = SUMMARY.search(out)
    assert (summary[1], summary[5], summary[6]) == (
        "2", str(tmp_path / "iter_0000002"), "--exit-interval 2")
    assert _evaluations(out)["validation"][0] == 2


def test_train_samples_is_the_stop_reason(capsys):
    argv = train_argv("gpt2", ITERS)
    for old, new in (("--train-iters", "--train-samples"),
                     ("--lr-warmup-iters", "--lr-warmup-samples")):
        at = argv.index(old)
        argv[at:at + 2] = [new, str(8 * int(argv[at + 1]))]
    assert pretrain_gpt.main(argv) == 0
    summary = SUMMARY.search(capsys.readouterr().out)
    assert (summary[1], summary[6]) == (str(ITERS), f"--train-samples {8 * ITERS} reached")


def test_a_signal_stops_without_evaluation(tmp_path, capsys):
    """Preemption: save and go; the job is about to be killed, so no end-of-run evaluation.
    The signal comes during iteration 2's hooks: the ranks agree on it after step 3."""
    devices.init_process_group(devices.LaunchEnv(0, 1, 0, launched=False))
    try:
        setup_logging(0, log_rank=0)  # as pretrain_gpt.main, onto this test's stdout
        trainer, _ = build(train_argv("gpt2", 50, "--save", str(tmp_path)),
                           on_step=lambda it, _: it == 2 and os.kill(os.getpid(),
                                                                    signal.SIGUSR1))
        trainer.run()
    finally:
        torch.distributed.destroy_process_group()
    out = capsys.readouterr().out
    assert "stopping at iteration 3 (signal SIGUSR1)" in out
    assert "no end-of-run evaluation: stopped by signal SIGUSR1" in out
    assert not _evaluations(out)
    assert SUMMARY.search(out).groups()[4:] == (str(tmp_path / "iter_0000003"), "signal SIGUSR1")


def test_no_evaluation_with_eval_iters_0(capsys):
    out = _run(capsys, "--eval-iters", "0")
    assert not _evaluations(out)
    assert SUMMARY.search(out)[4] == "none"


def test_the_test_split_is_evaluated_only_when_it_has_documents(tmp_path, capsys):
    prefix = str(tmp_path / "corpus_text_document")
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for doc in range(60):
            builder.add_document([(doc + i) % 17 for i in range(40)] + [100])
        builder.finalize()
    data = ["--data-path", prefix, "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "100", "--data-cache-path", str(tmp_path / "cache")]
    assert _evaluations(_run(capsys, *data, "--split", "80,10,10", mock=False)).keys() == {
        "validation", "test"}
    only_valid = _run(capsys, *data, "--split", "90,10,0", mock=False)
    assert _evaluations(only_valid).keys() == {"validation"}


def _watch(**cfg: object) -> ExitWatch:
    return ExitWatch(CheckpointConfig(**cfg), AxisGroup.single(), torch.device("cpu"),
                     started=time.monotonic() - 120)


def test_should_stop_names_the_reason():
    """The flags a rank holds after a step are agreed after the next one (what is there as
    training starts, after the first step), after the last step at once; --exit-interval is
    exact."""
    with _watch(save="/ckpt") as watch:
        assert watch.should_stop(3) is None
        watch._on_signal(signal.SIGUSR1, None)
        assert watch.should_stop(4) is None and not watch.pressed
        assert watch.should_stop(5) == "signal SIGUSR1" and watch.pressed
    with _watch(save="/ckpt") as watch:
        watch._on_signal(signal.SIGTERM, None)
        assert watch.should_stop(7, last=True) == "signal SIGTERM" and watch.pressed
    with _watch(exit_interval=3) as watch:
        assert watch.should_stop(2) is None
        assert watch.should_stop(3) == "--exit-interval 3" and not watch.pressed
    with _watch(exit_duration_in_mins=1.5, exit_interval=2) as watch:  # started 2 min ago
        assert watch.should_stop(2) == "--exit-interval 2 and --exit-duration-in-mins 1.5"


def test_the_kill_switch_stops_a_step_after_it_appears(tmp_path, capsys):
    switch = tmp_path / "stop-now"
    with _watch(kill_switch_path=str(switch)) as watch:
        assert watch.should_stop(1) is None and not watch.pressed
        switch.touch()
        assert watch.should_stop(2) is None
        assert watch.should_stop(3) == f"kill switch {switch}" and watch.pressed
    out = _run(capsys, "--kill-switch-path", str(switch), "--save", str(tmp_path / "ckpt"))
    assert f"kill switch {switch} exists at start-up" in out  # there from the start: no step
    assert not (tmp_path / "ckpt").exists()
