"""End to end through pretrain_gpt.main: learning, log lines, TensorBoard, rampup, precisions."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import pretrain_gpt
from megatron3d import device as devices
from megatron3d.cli.arguments import parse_args
from megatron3d.mpu.state import ParallelState
from megatron3d.training.build import Overrides, build_trainer
from megatron3d.training.loop import Hooks
from megatron3d.validation import validate
from tests.helpers.tiny import train_argv

REPO = Path(__file__).resolve().parents[2]
LINE = re.compile(
    r"^ iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \| consumed tokens: +(\d+) \| "
    r"elapsed time per iteration \(s\): [\d.]+ \| learning rate: (\S+) \| "
    r"global batch size: +(\d+) \| lm loss: (\d\.\d{6}E[+-]\d\d) \| loss scale: (\S+) \| "
    r"grad norm: [\d.]+ \| number of skipped iterations: +(\d+) \| "
    r"number of nan iterations: +(\d+) \| samples per second: [\d.]+ \| TFLOPs: [\d.]+ \|$")


def _losses(argv: list[str]) -> list[float]:
    """Train in this process and return every step's loss."""
    cfg = parse_args(argv)
    validate(cfg, 1)
    devices.init_process_group(devices.LaunchEnv(0, 1, 0, launched=False))
    try:
        losses: list[torch.Tensor] = []
        on_step = Hooks(on_step=lambda it, result: losses.append(result.loss))
        trainer = build_trainer(cfg, ParallelState.single(), torch.device("cpu"),
                                overrides=Overrides(hooks=on_step))
        trainer.run()
        return [x.item() for x in losses]
    finally:
        torch.distributed.destroy_process_group()


def test_loss_falls_on_mock_data():
    losses = _losses(train_argv("gpt2", 40, "--lr", "1e-2", "--min-lr", "1e-3"))
    assert len(losses) == 40
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, (first, last)


def test_log_lines_and_tensorboard_events(tmp_path, capsys):
    tb = tmp_path / "tb"
    assert pretrain_gpt.main(train_argv("bloom", 6, "--tensorboard-dir", str(tb))) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(" iteration")]
    assert len(lines) == 6
    parsed = [LINE.match(ln) for ln in lines]
    assert all(parsed), lines[0]
    assert [int(p[1]) for p in parsed] == list(range(1, 7))
    assert [int(p[3]) for p in parsed] == [8 * i for i in range(1, 7)]
    assert [int(p[4]) for p in parsed] == [8 * 16 * i for i in range(1, 7)]
    assert all(int(p[9]) == 0 and int(p[10]) == 0 for p in parsed)
    events = EventAccumulator(str(tb))
    events.Reload()
    scalars = events.Tags()["scalars"]
    for tag in ("lm loss", "learning-rate", "batch-size", "grad-norm", "loss-scale", "TFLOPs",
                "samples-per-second"):
        assert tag in scalars, tag
    tb_loss = [(e.step, e.value) for e in events.Scalars("lm loss")]
    assert [s for s, _ in tb_loss] == list(range(1, 7))
    for (_, value), p in zip(tb_loss, parsed, strict=True):
        assert value == pytest.approx(float(p[7]), rel=1e-6)


def test_rampup_with_train_iters(capsys):
    argv = train_argv("gpt2", 6, "--rampup-batch-size", "4", "4", "16")
    assert pretrain_gpt.main(argv) == 0
    lines = [LINE.match(ln) for ln in capsys.readouterr().out.splitlines()
             if ln.startswith(" iteration")]
    # START=4, INCR=4, 16 samples over (8-4)/4 = 1 increment: 4 until 16 consumed, then 8.
    assert [int(p[6]) for p in lines] == [4, 4, 4, 4, 8, 8]
    assert [int(p[3]) for p in lines] == [4, 8, 12, 16, 24, 32]


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
@pytest.mark.parametrize("precision", ["--bf16", "--fp16"])
def test_low_precision_training_runs(flavour, precision):
    losses = _losses(train_argv(flavour, 4, precision))
    assert all(torch.isfinite(torch.tensor(losses)))


def test_dropout_and_recompute_train():
    losses = _losses(train_argv("gpt2", 3, "--hidden-dropout", "0.1", "--attention-dropout",
                                "0.1", "--checkpoint-activations"))
    assert len(losses) == 3


def test_bad_flags_exit_2_with_one_line():
    run = subprocess.run([sys.executable, "pretrain_gpt.py", *train_argv(), "--num-layer", "2"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "--num-layer" in run.stderr, run.stderr
    assert pretrain_gpt.main([*train_argv(), "--hidden-size", "30"]) == 2  # 30 % 4 heads


def test_memory_report_is_printed_by_every_rank(capsys):
    assert pretrain_gpt.main(train_argv("gpt2", 3, "--memory-report", "--bf16")) == 0
    out = capsys.readouterr().out
    assert "[rank 0] memory (ZeRO-0, DP=1):" in out
    assert "[rank 0] memory after the first step:" in out
    analytic = [ln for ln in out.splitlines() if "analytic" in ln][-1]
    measured = [ln for ln in out.splitlines() if "measured" in ln][-1]
    # one process, bf16: the optimizer state is exactly the analytic 12 bytes per parameter
    assert analytic.split("optimizer state")[1] == measured.split("optimizer state")[1]
