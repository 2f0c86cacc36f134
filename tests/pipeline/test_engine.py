"""The pipeline engine: its start-up handshake (neighbours that disagree on the activations
they exchange both fail with both shapes, instead of one failing and the other waiting
forever), what it keeps of sent outputs and received activations, and when it waits for a
transfer."""

from __future__ import annotations

import contextlib
import weakref

import pytest
import torch
from torch import nn

from megatron3d.errors import ConfigError
from megatron3d.mpu.state import ParallelState
from megatron3d.pipeline.engine import PipelineEngine
from tests.helpers.dist import run_distributed
from tests.helpers.nccl_like import coalescing_batches

SHAPE = (16, 2, 32)  # [s, b, h]


def _handshake(shapes: list[tuple[int, ...]], dtypes: list[torch.dtype], chunks: int = 1,
               directed_links: bool | None = None) -> str | None:
    """Build this rank's engine with its own activation shape and dtype; the error, if any."""
    from megatron3d.pipeline.spec import VirtualStages

    state = ParallelState.build(1, len(shapes), directed_links=directed_links)
    rank = state.pp.rank
    stage = nn.Identity() if chunks == 1 else VirtualStages([nn.Identity()] * chunks)
    try:
        PipelineEngine(stage, state.pp, lambda out, batch: out.sum(),
                       activation_shape=shapes[rank], dtype=dtypes[rank],
                       device=torch.device("cpu"), chunks=chunks)
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


def test_interleaving_checks_the_link_from_the_last_rank_to_the_first():
    """With chunks, the last rank feeds the first: a mismatch there fails on both, named
    alike, also when each transfer is posted alone (NCCL's path)."""
    shapes = [(16, 2, 64), SHAPE, SHAPE]
    for directed_links in (False, True):
        errors = run_distributed(_handshake, 3, shapes, [torch.float32] * 3, 2, directed_links,
                                 timeout_s=60)
        ring = ("pipeline stage 2 sends activations [16, 2, 32] float32 but stage 0 expects "
                "[16, 2, 64] float32")
        assert errors[2] is not None and errors[2].startswith(ring), errors
        assert all(e is not None and "stage 0 sends activations [16, 2, 64]" in e
                   for e in errors[:2]), errors


class _Batch:
    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens


def _linear_pipeline(chunks: int, directed_links: bool | None = None,
                     ) -> tuple[PipelineEngine, list[nn.Sequential]]:
    """Two pipeline ranks with a linear layer per chunk (1F1B, or interleaved for
    ``chunks`` > 1): this rank's engine and chunks."""
    from megatron3d.pipeline.spec import VirtualStages

    state = ParallelState.build(1, 2, directed_links=directed_links)
    torch.manual_seed(0)
    layers = [nn.Linear(SHAPE[-1], SHAPE[-1]) for _ in range(2 * chunks)]
    mine = [nn.Sequential(layers[c * 2 + state.pp.rank]) for c in range(chunks)]
    stage = mine[0] if chunks == 1 else VirtualStages(mine)
    engine = PipelineEngine(stage, state.pp, lambda out, batch: out.square().mean(),
                            activation_shape=SHAPE, dtype=torch.float32,
                            device=torch.device("cpu"), chunks=chunks)
    return engine, mine


def _kept_after_exchanges(chunks: int) -> tuple[list[int], torch.Tensor]:
    """Run 1F1B (or interleaved) over 4 micro-batches through a linear layer per chunk and
    record, after every exchange, the elements of the stage outputs still held; the first
    stage's gradient must be right."""
    from megatron3d.pipeline import engine as engine_module

    engine, mine = _linear_pipeline(chunks)
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


class _LoggedWork:
    """A transfer's work that logs when it is waited for."""

    def __init__(self, work, label: tuple, events: list) -> None:
        self.work, self.label, self.events = work, label, events

    def wait(self) -> None:
        self.events.append(("wait", self.label))
        self.work.wait()


def _waits_and_computations(chunks: int, nccl_like: bool) -> list[tuple]:
    """This rank's log of one batch: ("post", labels, distinct works) per exchange,
    ("compute", kind, mb, chunk) as each computation starts, ("wait", label) as each
    transfer is waited for; a label is ("send" | "recv", the message's tag)."""
    from megatron3d.mpu import comm

    with coalescing_batches() if nccl_like else contextlib.nullcontext():
        engine, _ = _linear_pipeline(chunks, directed_links=nccl_like)
        events: list[tuple] = []
        start, forward, backward = comm.start_exchange, engine._forward, engine._backward

        def logged_start(sends, recvs, axis):
            labels = [("send", tag) for *_, tag in sends] + [("recv", tag) for *_, tag in recvs]
            works = start(sends, recvs, axis)
            events.append(("post", labels, len({id(work) for work in works})))
            return [_LoggedWork(w, label, events) for w, label in zip(works, labels, strict=True)]

        def logged(kind, run_step):
            def wrapper(step, *args):
                events.append(("compute", kind, step.micro_batch, step.chunk))
                return run_step(step, *args)
            return wrapper

        engine._forward, engine._backward = logged("F", forward), logged("B", backward)
        comm.start_exchange = logged_start
        try:
            engine.forward_backward([_Batch(torch.randn(SHAPE)) for _ in range(4)], 1.0)
        finally:
            comm.start_exchange = start
    return events


@pytest.mark.parametrize("nccl_like", [False, True])
def test_transfers_are_waited_for_only_where_needed(nccl_like: bool):
    """A received tensor is waited for as the computation that reads it starts (not at its
    exchange), a send at the next exchange or the end of the batch; under interleaving a
    gradient thus arrives while a forward runs. Every exchange hands out one work per
    transfer, also where a batch of transfers gives one work for all of it (``nccl_like``:
    gloo posting as NCCL does), so each wait is for that transfer alone. Mutations: waiting
    at the exchange, as before, fails the first check; posting NCCL's transfers as one
    batch fails the count of works."""
    overlapped = 0
    for chunks in (1, 2):
        for events in run_distributed(_waits_and_computations, 2, chunks, nccl_like,
                                      timeout_s=60):
            posts = [e for e in events if e[0] == "post"]
            assert all(works == len(labels) for _, labels, works in posts), posts
            waited = [i for i, e in enumerate(events) if e[0] == "wait"]
            for i in waited:
                kind, label = events[i][1]
                if kind == "recv":  # label: (F | B, micro-batch[, chunk as received])
                    computes = [e for e in events[:i] if e[0] == "compute"]
                    assert computes and computes[-1][1:3] == label[:2], (events[i], events)
                    assert computes[-1][3] == (label[2] if len(label) > 2 else 0)
                    assert events[i - 1][0] == "compute", events[i - 1]
                else:  # a send: waited once the next exchange is posted, or at the end
                    posted = [j for j, e in enumerate(events) if e[0] == "post"
                              and ("send", label) in e[1]][0]
                    later = [j for j, e in enumerate(events) if e[0] == "post" and j > posted]
                    assert i > (later[0] if later else max(
                        j for j, e in enumerate(events) if e[0] == "compute")), events[i]
            labels = [label for e in posts for label in e[1]]
            assert sorted(labels) == sorted(events[i][1] for i in waited)  # each waited once
            if chunks == 2:
                overlapped += sum(_computations_while_in_flight(events))
    assert overlapped > 0


def _computations_while_in_flight(events: list[tuple]) -> list[int]:
    """For each received message: the computations run between its post and its wait."""
    counts = []
    for i, event in enumerate(events):
        if event[0] != "post":
            continue
        for label in (lb for lb in event[1] if lb[0] == "recv"):
            waited = events.index(("wait", label), i)
            counts.append(sum(e[0] == "compute" for e in events[i:waited]) - 1)
    return counts


class _ReceivedActivations:
    """A traffic observer: how many received activations (``recv`` of an "F" message) are
    alive at once, by weak reference, at the most."""

    def __init__(self) -> None:
        self.alive = self.peak = 0

    def __call__(self, kind: str, tensor: torch.Tensor, axis, peer, tag) -> None:
        if kind == "recv" and tag[0] == "F":
            self.alive += 1
            self.peak = max(self.peak, self.alive)
            weakref.finalize(tensor, self._freed)

    def _freed(self) -> None:
        self.alive -= 1


def _peak_received(chunks: int, micro_batches: int) -> dict[str, int]:
    """The most received activations alive at once on this rank in a training batch (1F1B,
    or interleaved) and in an evaluation batch, of ``micro_batches`` each."""
    from megatron3d.mpu import traffic

    engine, _ = _linear_pipeline(chunks)
    batches = [_Batch(torch.randn(SHAPE)) for _ in range(micro_batches)]
    peaks = {}
    for name, run in (("train", lambda: engine.forward_backward(batches, 1.0)),
                      ("eval", lambda: engine.forward_only(batches))):
        with traffic.observing(_ReceivedActivations()) as counter:
            run()
        peaks[name] = counter.peak
    return peaks


def test_evaluation_holds_no_more_received_activations_than_training():
    """Evaluation under PP=2 with 16 micro-batches: each stage holds at most as many
    received activations at once as training does, the last stage one (each is dropped once
    its forward has read it; training's 1F1B held 1 there, interleaved 3). Mutation: keeping
    them in ``run.inputs`` until the batch ends, as before, holds all 16 (32 interleaved: one
    per micro-batch and chunk) and fails."""
    for chunks in (1, 2):
        peaks = run_distributed(_peak_received, 2, chunks, 16, timeout_s=60)
        assert all(rank["eval"] <= rank["train"] for rank in peaks), (chunks, peaks)
        assert peaks[-1]["eval"] == 1, (chunks, peaks)
