"""TensorBoard at Megatron's level: every series vs iterations, consumed samples and tokens,
at --tensorboard-log-interval; validation and test loss with perplexity; throughput, memory
and world size; --log-params-norm and --log-num-zeros-in-grad (padding rows left out)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import pretrain_gpt
from megatron3d import device as devices
from megatron3d.log import setup_logging
from tests.helpers.runs import build
from tests.helpers.tiny import train_argv

LOSS = re.compile(r"^ iteration +(\d+)/.*\| lm loss: (\S+) \|", re.MULTILINE)
FIELD = r"^ iteration +{it}/.*\| {name}: (\S+) \|"
GBS, SEQ, VOCAB, PADDED = 8, 16, 203, 208  # train_argv's tiny model
ITERS = 6


def _events(directory) -> EventAccumulator:
    events = EventAccumulator(str(directory))
    events.Reload()
    return events


def _series(events: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in events.Scalars(tag)]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> EventAccumulator:
    """TensorBoard every 2 iterations, log lines every 3, evaluation every 3."""
    tb = tmp_path_factory.mktemp("tb")
    assert pretrain_gpt.main(train_argv(
        "gpt2", ITERS, "--eval-interval", "3", "--log-params-norm", "--tensorboard-dir",
        str(tb), "--tensorboard-log-interval", "2", "--log-interval", "3")) == 0
    return _events(tb)


def test_series_follow_the_tensorboard_interval_vs_iterations_samples_and_tokens(run):
    events = run
    steps = [2, 4, 6]
    for vs, scale in (("", 1), (" vs samples", GBS), (" vs tokens", GBS * SEQ)):
        for name in ("lm loss", "learning-rate", "batch-size", "grad-norm", "loss-scale",
                     "params-norm", "world-size"):
            assert [s for s, _ in _series(events, name + vs)] == [i * scale for i in steps]
        for name in ("iteration-time", "samples-per-second", "TFLOPs", "mem-max-rss-bytes"):
            assert [s for s, _ in _series(events, name + vs)] == [3 * scale, 6 * scale]
    assert {v for _, v in _series(events, "world-size")} == {1.0}
    assert {v for _, v in _series(events, "batch-size vs tokens")} == {GBS}
    assert "num-zeros" not in events.Tags()["scalars"]  # only with --log-num-zeros-in-grad


def test_tensorboard_loss_is_the_mean_over_its_interval(run, capsys):
    """The same run printing every iteration's loss: TensorBoard holds each pair's mean."""
    argv = train_argv("gpt2", ITERS, "--eval-interval", "3", "--log-params-norm",
                      "--log-interval", "1")
    assert pretrain_gpt.main(argv) == 0
    per_iteration = {int(m[1]): float(m[2]) for m in LOSS.finditer(capsys.readouterr().out)}
    for step, value in _series(run, "lm loss"):
        mean = (per_iteration[step - 1] + per_iteration[step]) / 2
        assert value == pytest.approx(mean, rel=1e-5), step


def test_validation_and_test_loss_with_perplexity(run):
    validation = _series(run, "lm loss validation")
    assert [s for s, _ in validation] == [3, 6]  # the end-of-run validation reuses step 6's
    for (_, loss), (_, ppl) in zip(validation, _series(run, "lm loss validation ppl"),
                                   strict=True):
        assert ppl == pytest.approx(math.exp(loss), rel=1e-5)
    assert [s for s, _ in _series(run, "lm loss validation vs samples")] == [3 * GBS, 6 * GBS]
    (step, loss), = _series(run, "lm loss test")
    assert step == ITERS and _series(run, "lm loss test ppl")[0][1] == pytest.approx(
        math.exp(loss), rel=1e-5)


def test_params_norm_is_the_norm_of_every_logical_parameter_once(tmp_path, capsys):
    save = tmp_path / "ckpt"
    argv = train_argv("gpt2", 3, "--log-params-norm", "--save", str(save))
    assert pretrain_gpt.main(argv) == 0
    printed = float(re.search(FIELD.format(it=3, name="params norm"), capsys.readouterr().out,
                              re.MULTILINE)[1])
    from megatron3d.checkpoint.reader import CheckpointReader

    reader = CheckpointReader(save / "iter_0000003")
    weights = [reader.tensor(name, "weight") for name in reader.names()]
    expected = torch.sqrt(sum(w.double().square().sum() for w in weights)).item()
    assert printed == pytest.approx(expected, rel=1e-3)  # printed with 3 decimals


@pytest.mark.parametrize("untied", [False, True])
def test_num_zeros_leaves_out_the_padding_rows(capsys, untied):
    """Vocabulary 203 is padded to 208 rows, whose gradients are always zero: the printed
    count equals the zero elements of every parameter's own gradient, padding rows left out
    (a few more are zero by the math, e.g. key-bias gradients, which softmax cancels)."""
    extra = ["--untie-embeddings-and-output-weights"] if untied else []
    setup_logging(0, log_rank=0)
    devices.init_process_group(devices.LaunchEnv(0, 1, 0, launched=False))
    try:
        counted: list[int] = []
        trainer, _ = build(train_argv("gpt2", 1, "--log-num-zeros-in-grad", "--lr-warmup-iters",
                                      "0", *extra), on_step=lambda it, result: counted.append(sum(
            int((grad[:VOCAB] if p.shape[0] == PADDED else grad).eq(0).sum())
            for p in trainer.model.engine.stage.parameters()
            for grad in trainer.model.data_parallel.shard.grads_of([p])
            for grad in [grad.view(p.shape)])))
        trainer.run()
    finally:
        torch.distributed.destroy_process_group()
    zeros = float(re.search(FIELD.format(it=1, name="num zeros"), capsys.readouterr().out,
                            re.MULTILINE)[1])
    assert zeros == counted[0]
