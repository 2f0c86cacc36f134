"""The planner's activation part: per micro-batch, what each pipeline chunk keeps for
backward (embedding, norms, blocks, head and loss) against the saved bytes of a real CPU
forward within 10%, grouped-query attention included; and how many micro-batches a rank
holds, read from its real program, against the pipeline simulator and for long programs."""

from __future__ import annotations

import functools

import pytest
import torch

from megatron3d.accounting.activations import (
    layer_activation_bytes,
    measured_layer_bytes,
    saved_bytes,
)
from megatron3d.accounting.in_flight import Activations, in_flight_states, peak_in_flight
from megatron3d.config import ModelConfig
from megatron3d.model.context import LayerContext
from megatron3d.model.gpt import gpt_layer_specs, lm_loss, stage_bounds
from megatron3d.mpu.random import RNGStreams
from megatron3d.mpu.state import AxisGroup
from megatron3d.pipeline.instructions import Backward, Forward
from megatron3d.pipeline.interleaved import interleaved_1f1b
from megatron3d.pipeline.schedule import schedule_for
from megatron3d.pipeline.simulate import simulate
from tests.helpers.tiny import FLAVOURS

ACTIVATION_RTOL = 0.10  # the bound: the model within 10% of the measured bytes
BF16, CPU, MICRO_BATCH = torch.bfloat16, torch.device("cpu"), 2
# Attention dropout 0: the CPU runs SDPA's flash kernel only without it (as the GPU does
# with it), so no s x s tensor is kept; hidden dropout on, so its masks are.
SHAPE = {"num_layers": 3, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
         "vocab_size": 203, "hidden_dropout": 0.1, "attention_dropout": 0.0}


def _measured_chunks(cfg: ModelConfig, bounds: tuple[int, ...]) -> list[int]:
    """Saved bytes of each pipeline chunk's forward (the loss with the last), parameters,
    buffers and the shared ALiBi bias left out."""
    ctx = LayerContext(cfg, AxisGroup.single(), 1, BF16, CPU, RNGStreams.create(1, 0, 0, CPU))
    layers = [spec.build().train() for spec in gpt_layer_specs(ctx)]
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, cfg.seq_length), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, cfg.seq_length), generator=gen)
    mask = torch.ones(MICRO_BATCH, cfg.seq_length)
    sizes = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        chunk = layers[start:end]
        constants = [t for layer in chunk for t in (*layer.parameters(), *layer.buffers())]
        if cfg.position_embedding_type == "alibi":
            constants.append(ctx.alibi.get(cfg.seq_length, BF16, CPU))

        def run(chunk: list = chunk, x: torch.Tensor = x, last: bool = end == len(layers)):
            for layer in chunk:
                x = layer(x)
            return lm_loss(x, labels, mask, ctx) if last else x

        size, x = saved_bytes(run, constants)
        sizes.append(size)
    return sizes


GQA = {"group_query_attention": True, "num_query_groups": 2}  # 2 query heads per group
MODELS = {**FLAVOURS, "gpt2 gqa": {**FLAVOURS["gpt2"], **GQA},
          "llama gqa": {**FLAVOURS["llama"], **GQA}}


@pytest.mark.parametrize("recompute", [None, "selective", "full"])
@pytest.mark.parametrize("flavour", list(MODELS))
def test_chunk_activations_match_saved_bytes(flavour, recompute):
    cfg = ModelConfig(**{**SHAPE, **MODELS[flavour], "recompute_granularity": recompute})
    bounds = stage_bounds(cfg, 3, "uniform", 1)  # embedding+, blocks, +head and loss
    model = Activations(cfg, MICRO_BATCH, 1, False, BF16, device_type="cpu")
    names = [spec.type_name for spec in gpt_layer_specs(LayerContext(
        cfg, AxisGroup.single(), 1, device=torch.device("meta")))]
    measured = _measured_chunks(cfg, bounds)
    for (start, end), real in zip(zip(bounds, bounds[1:], strict=False), measured, strict=True):
        ours = model.chunk(names[start:end], cfg.padded_vocab_size(1))
        assert abs(ours - real) <= ACTIVATION_RTOL * real, (names[start:end], ours, real)


@pytest.mark.parametrize("recompute", [None, "selective"])
@pytest.mark.parametrize("groups", [1, 2, 8])
@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_grouped_query_attention_layers_are_counted_to_the_byte(flavour, groups, recompute):
    """8 query heads in 1, 2 or 8 groups (8: multi-head): the fused QKV output, the copy of q
    across several groups, rotated q and k, k and v expanded to every head."""
    gqa = {"group_query_attention": True, "num_query_groups": groups} if groups < 8 else {}
    cfg = ModelConfig(**{**SHAPE, "num_layers": 1, "num_attention_heads": 8, **gqa,
                         **FLAVOURS[flavour], "recompute_granularity": recompute})
    ours = sum(layer_activation_bytes(cfg, MICRO_BATCH, 1, False, BF16, "cpu").values())
    assert ours == measured_layer_bytes(cfg, MICRO_BATCH, AxisGroup.single(), False)[0]


def test_the_peak_in_flight_weighs_each_chunk_by_its_micro_batches():
    """Rank 0 of 1F1B over 4 stages holds 4 micro-batches of its one chunk; interleaved
    with 2 chunks it holds more of the first chunk than of the second at its peak."""
    assert peak_in_flight([7], in_flight_states("1f1b", 4, 0, 16, 1)) == 4 * 7
    states = in_flight_states("1f1b", 4, 0, 16, 2)
    assert peak_in_flight([1000, 1], states) == max(1000 * a + b for a, b in states)
    assert peak_in_flight([1000, 1], states) > peak_in_flight([1, 1000], states)


def _walk(schedule: str, p: int, r: int, m: int, v: int) -> set[tuple[int, ...]]:
    """In-flight counts per chunk along the whole program (no shortcut)."""
    program = interleaved_1f1b(p, r, m, v) if v > 1 else schedule_for(schedule, p, r, m)
    counts, seen = [0] * v, set()
    for step in program:
        if isinstance(step, Forward | Backward):
            counts[step.chunk] += 1 if isinstance(step, Forward) else -1
            seen.add(tuple(counts))
    return seen


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("p", "m"), [(1, 3), (2, 1), (2, 8), (4, 3), (4, 16), (6, 30)])
def test_in_flight_peak_is_the_simulators(schedule, p, m):
    report = simulate([schedule_for(schedule, p, r, m) for r in range(p)])
    for r in range(p):
        peak = max(counts[0] for counts in in_flight_states(schedule, p, r, m, 1))
        assert peak == report.stages[r].peak_activations


@pytest.mark.parametrize(("p", "v"), [(2, 1), (3, 1), (4, 1), (2, 2), (3, 2), (4, 3)])
def test_long_programs_repeat_their_first_counts(p, v):
    """The 1F1B shortcut (walk at most 2 x PP x chunks micro-batches) loses no state."""
    for m in (p * k for k in range(1, 4 * v + 3)):
        for r in range(p):
            assert in_flight_states("1f1b", p, r, m, v) == frozenset(_walk("1f1b", p, r, m, v))


def test_interleaved_first_rank_holds_the_most_micro_batch_chunks():
    """Interleaving trades a smaller bubble for more in flight on early ranks (Narayanan et
    al. 2021): rank 0 holds more (micro-batch, chunk) pairs than PP."""
    first = max(sum(c) for c in in_flight_states("1f1b", 4, 0, 16, 2))
    last = max(sum(c) for c in in_flight_states("1f1b", 4, 3, 16, 2))
    assert first > 4 and last < first
    assert functools.reduce(max, (sum(c) for c in in_flight_states("1f1b", 4, 0, 16, 1))) == 4


@pytest.mark.parametrize("recompute", [None, "selective"])
@pytest.mark.parametrize("flavour", ["gpt2", "bloom"])
def test_attention_dropout_on_the_cpu_keeps_the_scores(flavour, recompute):
    """The CPU runs SDPA's math kernel with attention dropout: it keeps the [b, n, s, s]
    probabilities and their dropout, which the start-up check once left out (a million-token
    sequence passed it and died in the allocator)."""
    cfg = ModelConfig(**{**SHAPE, "num_layers": 1, "attention_dropout": 0.1,
                         **FLAVOURS[flavour], "recompute_granularity": recompute})
    ours = sum(layer_activation_bytes(cfg, MICRO_BATCH, 1, False, BF16, "cpu").values())
    real = measured_layer_bytes(cfg, MICRO_BATCH, AxisGroup.single(), False)[0]
    assert abs(ours - real) <= ACTIVATION_RTOL * real, (ours, real)
