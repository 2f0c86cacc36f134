"""Mock data: deterministic, layout-independent global batches with learnable structure."""

from __future__ import annotations

import torch

from megatron3d.data.mock import MockGPTDataset
from megatron3d.data.sampler import micro_batches
from tests.helpers.batches import assert_same_global_batch

CPU = torch.device("cpu")


def test_samples_are_a_pure_function_of_seed_and_index():
    a = MockGPTDataset(100, 16, seed=3)
    b = MockGPTDataset(100, 16, seed=3)
    assert torch.equal(a.samples(10, 5), b.samples(0, 20)[10:15])
    assert not torch.equal(a.samples(0, 5), MockGPTDataset(100, 16, seed=4).samples(0, 5))
    s = a.samples(0, 64)
    assert s.shape == (64, 17) and s.dtype == torch.int64
    assert s.min() >= 0 and s.max() < 100


def test_tokens_follow_the_chain_mostly():
    """Most next tokens are one of the few successors: a model can learn it."""
    ds = MockGPTDataset(500, 64, seed=1, branching=4, noise=0.05)
    s = ds.samples(0, 200)
    follows = torch.zeros_like(s[:, 1:], dtype=torch.bool)
    successors = torch.from_numpy(ds._successors)
    for k in range(ds.branching):
        follows |= successors[s[:, :-1], k] == s[:, 1:]
    assert 0.9 < follows.float().mean().item() < 1.0


def test_global_batch_is_the_same_whatever_the_data_parallel_size():
    assert_same_global_batch(MockGPTDataset(100, 8, seed=0), (2, 4, 8))


def test_labels_are_inputs_shifted_by_one():
    ds = MockGPTDataset(100, 8, seed=0)
    (mb,) = micro_batches(ds, 0, 2, 2, 0, 1, CPU)
    full = ds.samples(0, 2)
    assert torch.equal(mb.tokens, full[:, :-1]) and torch.equal(mb.labels, full[:, 1:])
    assert torch.equal(mb.loss_mask, torch.ones(2, 8))
