"""Run one global batch through this rank's pipeline stage by following a schedule.

The schedule (``schedule.py``, ``interleaved.py``) says what to do; this module only does it:
forward and backward on the local stage (or on one of its chunks under interleaving), and
the exchanges with the neighbouring ranks. Without pipelining (one stage) the 1F1B program is
simply forward, backward per micro-batch, so there is one code path for every layout.

Activations travel between stages with the same tensor-parallel rank: each TP rank sends its
own copy. That keeps one deterministic path with no extra collective; under sequence
parallelism the activations are already split across TP ranks, so nothing is sent twice.

A stage output that has been sent is only needed for its autograd graph: its data is freed
after the send (as Megatron does) and its backward runs from the graph alone, so a stage
holding many in-flight micro-batches keeps none of their outputs. Without gradients
(evaluation) nothing outlives its use: a received activation is dropped once its forward has
read it and an output once its send is done, so evaluation holds one received activation at
a time however many micro-batches it runs (training keeps each until its gradient is sent:
one per micro-batch in flight on the stage).

An ``Exchange`` posts its transfers in the schedule's order but does not wait for them there:
a received tensor is waited for just before the computation that reads it, and the sends are
waited for at the next exchange (which releases the sent output's memory) or at the end of
the batch. A rank therefore never idles for a message its next computation does not need (the
gradient that arrives while a forward runs, under interleaving), and only ever waits later
than the blocking order the schedules are checked with (``simulate.py``), so a program that
finishes there finishes here. On NCCL the waits order the compute stream, not the host:
communication overlaps the computation in between (Megatron's --overlap-p2p-communication).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from megatron3d.errors import ConfigError
from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup
from megatron3d.pipeline.instructions import Backward, Exchange, Forward, Instruction
from megatron3d.pipeline.interleaved import interleaved_1f1b, interleaved_forward_only
from megatron3d.pipeline.schedule import forward_only, schedule_for

_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


class Batch(Protocol):
    tokens: torch.Tensor  # [b, s] token ids: the first stage's input
    # token_info (optional): a cp.tokens.TokenInfo the engine hands to the stage's layers


LossFn = Callable[[torch.Tensor, Batch], torch.Tensor]
"""(last stage's output, micro-batch) -> that micro-batch's mean loss (fp32 scalar)."""


class ProgramObserver(Protocol):
    """Told what the engine runs, so it can prepare ahead of time (ZeRO-3 plans its parameter
    gathers from the program before the first layer runs)."""

    def begin(self, program: list[Instruction]) -> None: ...
    def after(self, instruction: Instruction) -> None: ...
    def end(self) -> None: ...


class PipelineEngine:
    """This rank's stage, its neighbours on the ``pp`` axis, and how to run a batch.

    ``stage`` runs the rank's layers; under interleaving (``chunks`` > 1) it is a
    ``spec.VirtualStages`` whose ``chunks[c]`` is virtual stage ``c * pp.size + pp.rank``."""

    def __init__(self, stage: nn.Module, pp: AxisGroup, loss_fn: LossFn,
                 activation_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, schedule: str = "1f1b", chunks: int = 1) -> None:
        self.stage = stage
        self.chunks: list[nn.Module] = list(stage.chunks) if chunks > 1 else [stage]
        self.pp = pp
        self.loss_fn = loss_fn
        self.shape, self.dtype, self.device = activation_shape, dtype, device
        self.schedule = schedule
        self.first = pp.rank == 0
        self.last = pp.rank == pp.size - 1
        self.observers: list[ProgramObserver] = []  # told each program as it runs
        if pp.size > 1:
            self._handshake()

    def forward_backward(self, batches: list[Batch], loss_scale: float,
                         before_last_backward: Callable[[int], None] | None = None,
                         ) -> torch.Tensor:
        """Accumulate gradients of ``loss_scale * mean(micro-batch losses)``; return the mean
        loss on the last stage (zero elsewhere), detached, on the device.
        ``before_last_backward(chunk)`` runs just before each model chunk's last backward,
        the one that makes its gradients final (data-parallel reduction of that chunk starts
        from there, overlapping the backward work still to run)."""
        p, r, m, v = self.pp.size, self.pp.rank, len(batches), len(self.chunks)
        program = (interleaved_1f1b(p, r, m, v) if v > 1
                   else schedule_for(self.schedule, p, r, m))
        if before_last_backward is not None:
            last = {step.chunk: i for i, step in enumerate(program) if isinstance(step, Backward)}
            for chunk, i in sorted(last.items(), key=lambda item: item[1], reverse=True):
                program.insert(i, _Call(functools.partial(before_last_backward, chunk)))
        return self._run(program, batches, loss_scale / len(batches))

    def forward_only(self, batches: list[Batch]) -> torch.Tensor:
        """Mean loss over ``batches`` without gradients (evaluation)."""
        p, r, m, v = self.pp.size, self.pp.rank, len(batches), len(self.chunks)
        program = (interleaved_forward_only(p, r, m, v) if v > 1 else forward_only(p, r, m))
        with torch.no_grad():
            return self._run(program, batches, 0.0)

    def _run(self, program: list[Instruction | _Call], batches: list[Batch],
             weight: float) -> torch.Tensor:
        run = _Run(total=torch.zeros((), dtype=torch.float32, device=self.device))
        observers = self.observers
        for observer in observers:
            observer.begin([s for s in program if not isinstance(s, _Call)])
        for step in program:
            if isinstance(step, Exchange):
                self._exchange(step, run)
            elif isinstance(step, Forward):
                self._forward(step, batches[step.micro_batch], run, weight)
            elif isinstance(step, Backward):
                self._backward(step, run)
            else:
                step.fn()
            for observer in observers:
                observer.after(step)
        run.settle_sends()
        assert not run.arriving, f"received but never used: {sorted(run.arriving)}"
        for observer in observers:
            observer.end()
        return run.total / len(batches)

    def _first_virtual(self, chunk: int) -> bool:
        return self.first and chunk == 0

    def _last_virtual(self, chunk: int) -> bool:
        return self.last and chunk == len(self.chunks) - 1

    def _forward(self, step: Forward, batch: Batch, run: _Run, weight: float) -> None:
        key = (step.micro_batch, step.chunk)
        x = batch.tokens if self._first_virtual(step.chunk) else run.arrived("F", key)
        # Where the micro-batch's tokens sit (context parallelism, packed documents); None
        # for a plain sequence, and on a middle stage that reads no data.
        info = getattr(batch, "token_info", None)
        chunk = self.chunks[step.chunk]
        y = chunk(x) if info is None else chunk(x, info)
        if not self._last_virtual(step.chunk):
            run.outputs[key] = y  # [s(/tp), b, h]
            return
        loss = self.loss_fn(y, batch)
        run.total += loss.detach()
        if torch.is_grad_enabled():
            run.outputs[key] = loss * weight

    def _backward(self, step: Backward, run: _Run) -> None:
        key = (step.micro_batch, step.chunk)
        out = run.outputs.pop(key)
        if self._last_virtual(step.chunk):
            out.backward()
        else:  # ``out`` lost its data after the send: only its graph is left
            _backward_from_graph(out, run.arrived("B", key))

    def _exchange(self, step: Exchange, run: _Run) -> None:
        p, v = self.pp.size, len(self.chunks)
        nxt, prev = (self.pp.rank + 1) % p, (self.pp.rank - 1) % p
        sends, recvs, received, sent = [], [], [], []
        for name, mb, chunk in step.transfers():  # field order: the order both sides post
            key = (mb, chunk)
            if name == "send_forward":  # training keeps the output's graph for its backward
                out = run.outputs[key] if torch.is_grad_enabled() else run.outputs.pop(key)
                sends.append((out.detach(), nxt, _tag("F", mb, chunk + (nxt == 0), v)))
                sent.append(out)
            elif name == "send_backward":
                grad = run.inputs.pop(key).grad
                sends.append((grad, prev, _tag("B", mb, chunk - (prev == p - 1), v)))
            else:  # tags name what a message is, for hang dumps
                peer, kind = (prev, "F") if name == "recv_forward" else (nxt, "B")
                buffer = self._buffer()
                received.append((kind, key, buffer))
                recvs.append((buffer, peer, _tag(kind, mb, chunk, v)))
        works = comm.start_exchange(sends, recvs, self.pp)
        run.settle_sends()  # the previous exchange's, once the peers can match this one's
        run.sending = works[:len(sends)]
        # Safe before the sends complete: each sends ``out.detach()``, a tensor of its own
        # that its work holds, so the storage lives until the work is waited for.
        for out in sent:
            _free_data(out)
        for (kind, key, buffer), work in zip(received, works[len(sends):], strict=True):
            if kind == "F" and torch.is_grad_enabled():  # kept for its gradient's send
                run.inputs[key] = buffer.requires_grad_()
            run.arriving[kind, key] = (work, buffer)

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def _handshake(self) -> None:
        """Agree once that neighbours send what this stage expects: a launch with mismatched
        model flags fails here, on both sides of the mismatch and with both shapes, instead
        of hanging or misreading bytes. Each stage sends its description both ways, so the
        neighbour that would only send learns of the mismatch too. Under interleaving the
        last and first ranks are neighbours too, so every link the schedules use (and, on
        NCCL, each direction's communicator) is met here once, before any batch."""
        mine = self._describe()
        p, r, ring = self.pp.size, self.pp.rank, len(self.chunks) > 1
        peers = sorted({q % p for q in (r - 1, r + 1) if ring or 0 <= q < p} - {r})
        theirs = {q: torch.empty_like(mine) for q in peers}
        tag = ("handshake",)
        comm.exchange([(mine, q, tag) for q in peers], [(theirs[q], q, tag) for q in peers],
                      self.pp)
        for q in peers:
            if not torch.equal(mine, theirs[q]):  # named alike on both: sender first
                fed_by = q == r - 1 or (r == 0 and q == p - 1 and p > 2)  # or the ring's wrap
                raise (_mismatch(q, theirs[q], r, mine) if fed_by
                       else _mismatch(r, mine, q, theirs[q]))

    def _describe(self) -> torch.Tensor:
        dims = list(self.shape) + [0] * (6 - len(self.shape))
        return torch.tensor([len(self.shape), _DTYPES.index(self.dtype), *dims],
                            dtype=torch.int64, device=self.device)


def _tag(kind: str, mb: int, chunk: int, chunks: int) -> tuple:
    """What a message is, named as its receiver names it; the chunk only with interleaving."""
    return (kind, mb) if chunks == 1 else (kind, mb, chunk)


def _free_data(out: torch.Tensor) -> None:
    """Drop a sent output's data; its graph (``grad_fn``) stays for the backward."""
    if out.requires_grad:
        out.data = torch.empty((1,), dtype=out.dtype, device=out.device)


def _backward_from_graph(out: torch.Tensor, grad: torch.Tensor) -> None:
    """``torch.autograd.backward(out, grad)`` for an output whose data was freed: autograd's
    engine runs from ``out.grad_fn`` directly, skipping the Python wrapper's check that
    ``grad`` has the output's shape (which the freed placeholder no longer has)."""
    torch.autograd.Variable._execution_engine.run_backward(  # as Megatron does
        (out,), (grad,), False, False, (), True, True)


class _Call:
    """A host-side callback spliced into a program (not part of any schedule)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn


class _Run:
    """Tensors alive during one batch, keyed by (micro-batch, chunk), and the transfers still
    in flight."""

    def __init__(self, total: torch.Tensor) -> None:
        self.total = total  # sum of micro-batch losses (last stage)
        # received activations whose gradient is still to be sent (training only)
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}  # outputs, or scaled losses
        # posted receives not yet waited for: ("F" activation | "B" gradient, key) -> (work,
        # buffer)
        self.arriving: dict[tuple[str, tuple[int, int]], tuple[comm.Work, torch.Tensor]] = {}
        self.sending: list[comm.Work] = []  # the last exchange's sends

    def arrived(self, kind: str, key: tuple[int, int]) -> torch.Tensor:
        """The received tensor, once its transfer is done."""
        work, buffer = self.arriving.pop((kind, key))
        work.wait()
        return buffer

    def settle_sends(self) -> None:
        for work in self.sending:
            work.wait()
        self.sending = []


def _mismatch(sender: int, sent: torch.Tensor, receiver: int,
              expected: torch.Tensor) -> ConfigError:
    """The same message on both stages of a mismatched pair."""
    return ConfigError(
        f"pipeline stage {sender} sends activations {_explain(sent)} but stage {receiver} "
        f"expects {_explain(expected)}: launch every rank with the same model, batch and "
        "parallel flags")


def _explain(desc: torch.Tensor) -> str:
    ndim, dtype = int(desc[0]), _DTYPES[int(desc[1])]
    return f"{list(desc[2:2 + ndim].tolist())} {str(dtype).removeprefix('torch.')}"
