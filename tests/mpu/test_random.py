"""Layout-independent initialisation and the dropout RNG streams."""

from __future__ import annotations

import torch

from megatron3d.mpu.random import MODEL_PARALLEL, RNGStreams, seeded_normal, stable_seed

CPU = torch.device("cpu")


def test_stable_seed_is_fixed_across_runs() -> None:
    # Golden value: changing the derivation would silently change every initial weight.
    assert stable_seed(1234, "a") != stable_seed(1234, "b")
    assert stable_seed(1234, "a") != stable_seed(1235, "a")
    assert stable_seed(1, "x") == 2446244176347676501  # sha256(b"1:x")[:8], little-endian, 63 bits
    assert 0 <= stable_seed(1, "x") < 2**63


def test_seeded_normal_depends_only_on_seed_and_name() -> None:
    torch.manual_seed(0)
    a = seeded_normal((64, 32), 0.02, 7, "w")
    torch.manual_seed(99)  # the global generator plays no part
    torch.rand(10)
    b = seeded_normal((64, 32), 0.02, 7, "w")
    assert torch.equal(a, b)
    assert a.dtype == torch.float32 and a.device == CPU
    assert not torch.equal(a, seeded_normal((64, 32), 0.02, 7, "v"))
    assert abs(a.std().item() - 0.02) < 0.002


def test_default_stream_shared_model_parallel_stream_per_tp_rank() -> None:
    draws = []
    for tp_rank in (0, 1):
        streams = RNGStreams.create(seed=5, tp_rank=tp_rank, pp_rank=0, dev=CPU)
        default = torch.rand(4)
        with streams.fork():
            forked = torch.rand(4)
        draws.append((default, forked, torch.rand(4)))
    (d0, f0, after0), (d1, f1, after1) = draws
    assert torch.equal(d0, d1) and torch.equal(after0, after1)  # default: same on all TP ranks
    assert not torch.equal(f0, f1)  # model-parallel: distinct per TP rank

    streams = RNGStreams.create(seed=5, tp_rank=0, pp_rank=0, dev=CPU)
    expected_default = torch.cat([torch.rand(4), torch.rand(4)])
    streams = RNGStreams.create(seed=5, tp_rank=0, pp_rank=0, dev=CPU)
    first = torch.rand(4)
    with streams.fork(MODEL_PARALLEL):
        torch.rand(100)
    assert torch.equal(torch.cat([first, torch.rand(4)]), expected_default)  # untouched


def test_pipeline_stages_get_their_own_streams() -> None:
    """Megatron offsets both seeds by 100 per stage: stages must not drop out alike."""
    draws = []
    for pp_rank in (0, 1):
        streams = RNGStreams.create(seed=5, tp_rank=0, pp_rank=pp_rank, dev=CPU)
        with streams.fork():
            forked = torch.rand(4)
        draws.append((torch.rand(4), forked))
    (d0, f0), (d1, f1) = draws
    assert not torch.equal(d0, d1) and not torch.equal(f0, f1)
    torch.manual_seed(5 + 100)  # stage 1's default seed, as in Megatron
    assert torch.equal(torch.rand(4), d1)


def test_context_parallel_ranks_drop_out_their_own_tokens() -> None:
    """CP ranks hold other tokens of a sequence: both streams differ per CP rank, which no
    pipeline stage or TP rank shares; CP rank 0 keeps the seeds a run without CP has."""
    def draw(**ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
        streams = RNGStreams.create(seed=5, dev=CPU, **{"tp_rank": 0, "pp_rank": 0, **ranks})
        with streams.fork():
            forked = torch.rand(4)
        return torch.rand(4), forked

    base, cp1 = draw(), draw(cp_rank=1)
    assert all(torch.equal(a, b) for a, b in zip(draw(cp_rank=0), base, strict=True))
    others = [draw(pp_rank=p, tp_rank=t) for p in range(3) for t in range(3)] + [draw(cp_rank=2)]
    for default, forked in [base, *others]:
        assert not torch.equal(default, cp1[0]) and not torch.equal(forked, cp1[1])


def test_state_round_trip_replays_both_streams() -> None:
    streams = RNGStreams.create(seed=11, tp_rank=1, pp_rank=0, dev=CPU)
    torch.rand(3)
    with streams.fork():
        torch.rand(3)
    saved = streams.get_state()

    def draw() -> torch.Tensor:
        with streams.fork():
            forked = torch.rand(5)
        return torch.cat([torch.rand(5), forked])

    first = draw()
    streams.set_state(saved)
    assert torch.equal(draw(), first)

    fresh = RNGStreams(CPU)  # e.g. after loading a checkpoint into a new process
    fresh.set_state(saved)
    with fresh.fork():
        forked = torch.rand(5)
    assert torch.equal(torch.cat([torch.rand(5), forked]), first)
