"""The pipeline engine's start-up handshake: neighbours that disagree on the activations they
exchange both fail with both shapes, instead of one failing and the other waiting forever."""

from __future__ import annotations

import torch
from torch import nn

from megatron3d.errors import ConfigError
from megatron3d.mpu.state import ParallelState
from megatron3d.pipeline.engine import PipelineEngine
from tests.helpers.dist import run_distributed

SHAPE = (16, 2, 32)  # [s, b, h]


def _handshake(shapes: list[tuple[int, ...]], dtypes: list[torch.dtype]) -> str | None:
    """Build this rank's engine with its own activation shape and dtype; the error, if any."""
    state = ParallelState.build(1, len(shapes))
    rank = state.pp.rank
    try:
        PipelineEngine(nn.Identity(), state.pp, lambda out, batch: out.sum(),
                       activation_shape=shapes[rank], dtype=dtypes[rank],
                       device=torch.device("cpu"))
    except ConfigError as err:
        return str(err)
    return None


def test_matching_stages_pass():
    assert run_distributed(_handshake, 2, [SHAPE] * 2, [torch.float32] * 2) == [None, None]


def test_both_sides_of_a_mismatch_fail_with_both_shapes():
    errors = run_distributed(_handshake, 2, [SHAPE, (16, 2, 64)], [torch.float32] * 2,
                             timeout_s=60)
    expected = ("pipeline stage 0 sends activations [16, 2, 32] float32 but stage 1 expects "
                "[16, 2, 64] float32: launch every rank with the same model, batch and "
                "parallel flags")
    assert errors == [expected, expected]


def test_a_dtype_mismatch_fails_on_both_sides():
    errors = run_distributed(_handshake, 2, [SHAPE] * 2, [torch.float32, torch.bfloat16],
                             timeout_s=60)
    assert all(e is not None and "[16, 2, 32] float32 but stage 1 expects [16, 2, 32] "
               "bfloat16" in e for e in errors), errors


class _Batch:
    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens


def _kept_after_exchanges(chunks: int) -> tuple[list[int], torch.Tensor]:
    """Run 1F1B (or interleaved) over 4 micro-batches through a linear layer per chunk and
    record, after every exchange, the elements of the stage outputs still held; the first
    stage's gradient must be right."""
    from megatron3d.pipeline import engine as engine_module
    from megatron3d.pipeline.spec import VirtualStages

    state = ParallelState.build(1, 2)
    torch.manual_seed(0)
    layers = [nn.Linear(SHAPE[-1], SHAPE[-1]) for _ in range(2 * chunks)]
    mine = [nn.Sequential(layers[c * 2 + state.pp.rank]) for c in range(chunks)]
    stage = mine[0] if chunks == 1 else VirtualStages(mine)
    engine = PipelineEngine(stage, state.pp, lambda out, batch: out.square().mean(),
                            activation_shape=SHAPE, dtype=torch.float32,
                            device=torch.device("cpu"), chunks=chunks)
    held: list[int] = []
    original = engine_module.PipelineEngine._exchange

    def exchange(self, step, run) -> None:
        original(self, step, run)
        held.append(sum(t.numel() for key, t in run.outputs.items()
                        if not (self.last and key[1] == chunks - 1)))

    engine_module.PipelineEngine._exchange = exchange
    try:
        torch.manual_seed(1)
        engine.forward_backward([_Batch(torch.randn(SHAPE)) for _ in range(4)], 1.0)
    finally:
        engine_module.PipelineEngine._exchange = original
    return held, mine[0][0].weight.grad.clone()


def test_sent_outputs_keep_no_data_and_still_backpropagate():
    """After an exchange, an output that was sent holds one placeholder element: only its
    graph is kept. Gradients equal one process running the same layers in order."""
    for chunks in (1, 2):
        results = run_distributed(_kept_after_exchanges, 2, chunks, timeout_s=60)
        assert all(n <= 4 for held, _ in results for n in held), results  # 1 per output
        torch.manual_seed(0)
        layers = [nn.Linear(SHAPE[-1], SHAPE[-1]) for _ in range(2 * chunks)]
        torch.manual_seed(1)
        inputs = [torch.randn(SHAPE) for _ in range(4)]
        loss = sum(nn.Sequential(*layers)(x).square().mean() for x in inputs) / 4
        loss.backward()
        torch.testing.assert_close(results[0][1], layers[0].weight.grad)
