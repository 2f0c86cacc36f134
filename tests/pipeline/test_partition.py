"""Stage boundaries for the real GPT layer lists, checked against known layouts and brute force."""

from __future__ import annotations

import itertools
import random
import re

import pytest

from megatron3d.accounting.placement import placement
from megatron3d.cli.arguments import parse_args
from megatron3d.errors import ConfigError
from megatron3d.pipeline.partition import (
    TiedCopy,
    format_partition_table,
    layer_weights,
    partition,
    partition_layers,
)
from tests.helpers.tiny import train_argv

BLOOM_METHOD = "type:transformer|embedding"


def gpt_names(num_layers: int, embed_norm: bool = True) -> list[str]:
    """The class names ``gpt_layer_specs`` produces, in order."""
    head = ["InputEmbedding"] + (["InputNorm"] if embed_norm else [])
    return head + ["TransformerLayer"] * num_layers + ["FinalNorm", "OutputEmbedding"]


def stage_names(bounds: list[int], names: list[str]) -> list[list[str]]:
    return [names[a:b] for a, b in itertools.pairwise(bounds)]


def test_names_match_the_real_layer_classes() -> None:
    from megatron3d.model.embedding import FinalNorm, InputEmbedding, InputNorm, OutputEmbedding
    from megatron3d.model.transformer import TransformerLayer

    real = [c.__name__ for c in (InputEmbedding, InputNorm, TransformerLayer, FinalNorm,
                                 OutputEmbedding)]
    assert real == gpt_names(1)


def test_layer_weights_per_method() -> None:
    names, counts = gpt_names(2), [50, 2, 10, 10, 2, 50]
    assert layer_weights(names, counts, "uniform") == [1] * 6
    assert layer_weights(names, counts, "parameters") == counts
    assert layer_weights(names, counts, BLOOM_METHOD) == [1, 0, 1, 1, 0, 1]
    assert layer_weights(names, counts, "type:^transformer") == [0, 0, 1, 1, 0, 0]
    assert layer_weights(names, counts, "type:NORM") == [0, 1, 0, 0, 1, 0]


def test_bloom_176b_shape_over_12_stages() -> None:
    names = gpt_names(70)
    bounds = partition_layers(names, [1] * len(names), 12, BLOOM_METHOD)
    weights = layer_weights(names, [1] * len(names), BLOOM_METHOD)
    assert [sum(weights[a:b]) for a, b in itertools.pairwise(bounds)] == [6] * 12
    stages = stage_names(bounds, names)
    assert stages[0] == ["InputEmbedding", "InputNorm"] + ["TransformerLayer"] * 5
    assert stages[-1] == ["TransformerLayer"] * 5 + ["FinalNorm", "OutputEmbedding"]
    assert all(stage == ["TransformerLayer"] * 6 for stage in stages[1:-1])


def test_three_stages_four_layers() -> None:
    names = gpt_names(4)
    bounds = partition_layers(names, [1] * len(names), 3, BLOOM_METHOD)
    assert stage_names(bounds, names) == [
        ["InputEmbedding", "InputNorm", "TransformerLayer"],
        ["TransformerLayer", "TransformerLayer"],
        ["TransformerLayer", "FinalNorm", "OutputEmbedding"],
    ]


@pytest.mark.parametrize("embed_norm", [True, False])
def test_four_stages_two_layers_puts_embeddings_alone(embed_norm: bool) -> None:
    names = gpt_names(2, embed_norm)
    stages = stage_names(partition_layers(names, [1] * len(names), 4, BLOOM_METHOD), names)
    assert stages[0] == ["InputEmbedding"] + (["InputNorm"] if embed_norm else [])
    assert stages[1] == ["TransformerLayer"]
    # A zero-weight layer joins the weighted layer before it: the final norm stays with the
    # last block, the head is alone.
    assert stages[2] == ["TransformerLayer", "FinalNorm"]
    assert stages[3] == ["OutputEmbedding"]


def test_uniform_two_and_four_stages() -> None:
    names = gpt_names(4, embed_norm=False)  # 7 layers, each weighing 1
    counts = [1] * len(names)
    assert partition_layers(names, counts, 2, "uniform") == [0, 3, 7]
    assert partition_layers(names, counts, 4, "uniform") == [0, 1, 3, 5, 7]


@pytest.mark.parametrize(("num_layers", "num_stages"),
                         [(n, s) for n in (1, 5, 12, 37, 200) for s in (1, 2, 3, 7, 100) if s <= n])
def test_unit_weights_are_spread_evenly_larger_stages_last(num_layers: int,
                                                          num_stages: int) -> None:
    sizes = [b - a for a, b in itertools.pairwise(partition([1] * num_layers, num_stages))]
    assert len(sizes) == num_stages and sum(sizes) == num_layers
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes)


def test_parameters_method_isolates_huge_embeddings() -> None:
    names = gpt_names(4, embed_norm=False)
    counts = [1000, 10, 10, 10, 10, 1, 1000]
    assert partition_layers(names, counts, 3, "parameters") == [0, 1, 6, 7]
    # Two stages: the blocks split 2 + 2 (loads 1020, 1021), better than 1000 | 1041.
    assert partition_layers(names, counts, 2, "parameters") == [0, 3, 7]


def _brute_force_bottleneck(weights: list[int], num_stages: int) -> int:
    best = None
    for cuts in itertools.combinations(range(1, len(weights)), num_stages - 1):
        bounds = [0, *cuts, len(weights)]
        loads = [sum(weights[a:b]) for a, b in itertools.pairwise(bounds)]
        if min(loads) > 0 and (best is None or max(loads) < best):
            best = max(loads)
    assert best is not None
    return best


def test_bottleneck_is_exact_against_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(300):
        weights = [rng.choice([0, 0, 1, 2, 3, 5, 8, 13]) for _ in range(rng.randint(1, 9))]
        weighted = sum(1 for w in weights if w)
        if weighted == 0:
            continue
        num_stages = rng.randint(1, weighted)
        bounds = partition(weights, num_stages)
        loads = [sum(weights[a:b]) for a, b in itertools.pairwise(bounds)]
        assert bounds[0] == 0 and bounds[-1] == len(weights) and len(bounds) == num_stages + 1
        assert min(loads) > 0
        assert max(loads) == _brute_force_bottleneck(weights, num_stages)
        # Every stage but the first starts at a weighted layer: zero weights join the left.
        assert all(weights[b] > 0 for b in bounds[1:-1])
        assert bounds == partition(weights, num_stages)  # deterministic


def test_large_partition_is_fast() -> None:
    weights = [10**9] + [1] * 198 + [10**9]
    bounds = partition(weights, 100)
    assert bounds[:2] == [0, 1] and bounds[-2:] == [199, 200]


def test_more_stages_than_weighted_layers() -> None:
    names = gpt_names(1)  # 3 layers match
    with pytest.raises(ConfigError, match=r"4 pipeline stages but only 3 of 5 layers match "
                                          r"type:transformer\|embedding.*lower "
                                          r"--pipeline-model-parallel-size"):
        partition_layers(names, [1] * 5, 4, BLOOM_METHOD)
    with pytest.raises(ConfigError, match="only 0 layers"):
        partition([0, 0], 1)
    with pytest.raises(ConfigError, match="at least one stage"):
        partition([1, 1], 0)


@pytest.mark.parametrize(("method", "message"), [
    ("type:(", "invalid regex"),
    ("type:", "empty regex"),
    ("blocks", "unknown pipeline partition method"),
    ("Uniform", "unknown pipeline partition method"),
])
def test_bad_methods(method: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"{message}.*--pp-partition-method={re.escape(method)}"):
        layer_weights(gpt_names(2), [1] * 6, method)


LABELS = (["embedding", "embedding norm"] + [f"transformer layer {i}" for i in range(1, 71)]
          + ["final norm", "output layer"])


def test_partition_table_names_layers_as_users_count_them() -> None:
    counts = [100, 2] + [10] * 70 + [2, 100]
    bounds = partition_layers(gpt_names(70), counts, 12, BLOOM_METHOD)
    lines = format_partition_table(bounds, LABELS, counts).splitlines()
    assert len(lines) == 14
    assert lines[1] == "    0              152  embedding, embedding norm, transformer layers 1-5"
    assert lines[-2].endswith("transformer layers 66-70, final norm, output layer")
    assert lines[-1].split() == ["total", "904", "unique", "parameters"]
    single = format_partition_table([0, 1], ["transformer layer 3"], [1234567]).splitlines()[1]
    assert single.split() == ["0", "1,234,567", "transformer", "layer", "3"]


def test_partition_table_counts_a_tied_weight_once() -> None:
    counts = [100, 2] + [10] * 70 + [2, 100]
    tied = [TiedCopy(layer=73, owner=0, numel=100)]
    one = format_partition_table([0, 74], LABELS, counts, tied).splitlines()
    assert one[1].split()[:2] == ["0", "804"]
    assert one[-1].split()[:2] == ["total", "804"]
    two = format_partition_table([0, 37, 74], LABELS, counts, tied).splitlines()
    assert two[1].split()[:2] == ["0", "452"]
    assert two[2].split()[:2] == ["1", "352"]
    assert two[2].endswith("output layer (+ 100 tied copy of embedding)")
    assert two[-1].split()[:2] == ["total", "804"]


@pytest.mark.parametrize("method", ["uniform", "parameters", BLOOM_METHOD, "type:transformer"])
@pytest.mark.parametrize("flavour", ["gpt2", "bloom", "llama"])
def test_layers_per_virtual_stage_give_megatrons_layout(flavour: str, method: str) -> None:
    """--num-layers-per-virtual-pipeline-stage N: every virtual stage holds N blocks, the
    embedding (and its norm) rides with the first ones, the final norm and the head with the
    last ones, whatever --pp-partition-method says (a real vocabulary: the embedding outweighs
    two blocks)."""
    cfg = parse_args(train_argv(flavour, 10, "--num-layers", "8", "--vocab-size", "8000",
                                "--pp-partition-method", method,
                                "--pipeline-model-parallel-size", "2",
                                "--num-layers-per-virtual-pipeline-stage", "2"))
    blocks = ("TransformerLayer",) * 2
    first = ("InputEmbedding",) + (("InputNorm",) if flavour == "bloom" else ()) + blocks
    assert placement(cfg).virtual_stages == [first, blocks, blocks,
                                             blocks + ("FinalNorm", "OutputEmbedding")]
