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
