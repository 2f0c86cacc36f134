"""Blending: proportions at every prefix, sources drawn in order, flags, and the dry run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron3d.data.blended_dataset import blending_index, format_report
from megatron3d.data.builder import build_datasets, dry_run_report, parse_data_path
from megatron3d.data.prep.indexed_builder import IndexedDatasetBuilder
from megatron3d.errors import ConfigError
from tests.helpers.batches import assert_same_global_batch

CPU = torch.device("cpu")


def test_proportions_within_one_percent_at_every_prefix():
    weights = [0.2, 0.5, 0.3]
    blend = blending_index(weights, 100_000)
    source = blend["dataset_index"]
    n = np.arange(1, len(source) + 1)
    for d, w in enumerate(weights):
        drawn = np.cumsum(source == d)
        assert abs(drawn[-1] / len(source) - w) < 0.01
        assert np.abs(drawn - w * n).max() < 2  # never more than two samples off
        # each source's draws are its samples 0, 1, 2, ... in order
        np.testing.assert_array_equal(blend["dataset_sample"][source == d],
                                      np.arange(drawn[-1]))


def test_weights_are_normalised_and_validated():
    a = blending_index([3, 7], 1000)["dataset_index"]
    b = blending_index([0.3, 0.7], 1000)["dataset_index"]
    np.testing.assert_array_equal(a, b)
    for bad in ([0.5, 0], [1, -1], [float("nan"), 1]):
        with pytest.raises(ConfigError, match="positive"):
            blending_index(bad, 10)


def test_parse_data_path(tmp_path):
    assert parse_data_path(["data/a"]).prefixes == ("data/a",)
    two = parse_data_path(["1", "data/a", "3", "data/b"])
    assert two.prefixes == ("data/a", "data/b") and two.weights == (0.25, 0.75)
    assert parse_data_path("0.5 x 0.5 y").prefixes == ("x", "y")
    listing = tmp_path / "list.txt"
    listing.write_text("# weight prefix\n0.3 data/a  # first\n0.7\tdata/b\n")
    assert parse_data_path(None, str(listing)).weights == (0.3, 0.7)
    for bad in (["data/a", "data/b"], ["0.5", "a", "b"], ["x", "a", "0.3", "b"]):
        with pytest.raises(ConfigError, match="weight-prefix pairs"):
            parse_data_path(bad)
    with pytest.raises(ConfigError, match="exactly one of"):
        parse_data_path(["a"], str(listing))
    with pytest.raises(ConfigError, match="cannot read --data-path-file"):
        parse_data_path(None, str(tmp_path / "missing.txt"))


def make_source(path, first_token, docs=40, size=25):
    with IndexedDatasetBuilder(str(path), np.int32) as builder:
        for d in range(docs):
            builder.add_document(first_token + d * size + np.arange(size))
        builder.finalize()
    return str(path)


@pytest.fixture
def sources(tmp_path):
    return [make_source(tmp_path / "a", 0), make_source(tmp_path / "b", 100_000, docs=10)]


def test_blended_samples_come_from_their_sources(sources, tmp_path):
    sets = build_datasets(data_path=["0.25", sources[0], "0.75", sources[1]], seq_length=16,
                          seed=5, train_samples=400, valid_samples=40, split="90,10,0",
                          data_cache_path=str(tmp_path / "cache"))
    train = sets.train
    tokens = train.samples(0, 400)
    from_b = (tokens >= 100_000).all(dim=1)
    from_a = (tokens < 100_000).all(dim=1)
    assert bool((from_a | from_b).all())  # a sample never mixes sources
    np.testing.assert_array_equal(from_b.numpy(), train.dataset_index[:400] == 1)
    assert abs(from_b.float().mean().item() - 0.75) < 0.01
    # B has 225 train tokens per epoch: 300 samples of 16 tokens take it through 22 epochs
    assert train.datasets[1].num_epochs == 22
    again = build_datasets(data_path=["0.25", sources[0], "0.75", sources[1]], seq_length=16,
                           seed=5, train_samples=400, split="90,10,0",
                           data_cache_path=str(tmp_path / "cache"))
    assert torch.equal(again.train.samples(0, 400), tokens)
    assert_same_global_batch(train, (2, 4))


def test_dry_run_report(sources):
    report = dry_run_report(data_path=["1", sources[0], "3", sources[1]], seq_length=16,
                            train_samples=4000, valid_samples=100, split="90,10,0")
    train = report["train"]
    assert [r.weight for r in train] == [0.25, 0.75]
    assert sum(r.samples for r in train) == 4000
    assert abs(train[0].samples - 1000) <= 1 and train[0].documents == 36
    assert train[0].tokens == 36 * 25 and train[0].epochs == pytest.approx(
        train[0].samples * 16 / 900)
    assert report["test"][0].samples == 0 and report["test"][0].epochs == 0.0
    text = format_report("train", train)
    assert sources[1] in text and "epochs" in text and "4,000" in text
