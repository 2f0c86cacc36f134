"""GPT samples: the stream they cut, epochs, determinism, splits and layout independence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron3d.data.builder import build_datasets, dry_run_report, parse_split, split_ranges
from megatron3d.data.gpt_dataset import GPTDataset
from megatron3d.data.index_cache import IndexCache
from megatron3d.data.indexed_dataset import IndexedDataset
from megatron3d.data.prep.indexed_builder import IndexedDatasetBuilder
from megatron3d.data.sample_index import build_sample_index, num_epochs_for, samples_in_epochs
from megatron3d.errors import ConfigError, DataError
from tests.helpers.batches import assert_same_global_batch

CPU = torch.device("cpu")
SEQ = 8


def make_data(path, sizes) -> IndexedDataset:
    """Documents whose tokens are unique: token = 1000 * document + position."""
    with IndexedDatasetBuilder(str(path), np.int32) as builder:
        for d, size in enumerate(sizes):
            builder.add_document(1000 * d + np.arange(size))
        builder.finalize()
    return IndexedDataset(str(path))


@pytest.fixture
def data(tmp_path):
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 40, size=60)
    sizes[[3, 17]] = 0  # empty documents are skipped, not crashed on
    sizes[-1] += (-sizes.sum()) % SEQ  # tokens per epoch divisible by SEQ
    return make_data(tmp_path / "corpus", sizes)


def dataset(data, num_samples, seed=1, documents=None, cache=None, name="train"):
    return GPTDataset(data, documents or range(len(data)), name=name, seq_length=SEQ,
                      num_samples=num_samples, seed=seed, cache=cache or IndexCache(None))


def stream(data, ds) -> np.ndarray:
    """The epochs' documents in visiting order, concatenated."""
    return np.concatenate([data[int(d)] for d in ds.index.doc_idx])


def test_samples_cut_the_shuffled_document_stream(data):
    ds = dataset(data, 100)
    tokens = stream(data, ds)
    inverse = np.argsort(ds.index.shuffle_idx)  # dataset sample of each stream sample
    got = ds.samples_at(inverse)  # stream samples 0, 1, 2, ...
    for k in range(len(ds)):
        np.testing.assert_array_equal(got[k], tokens[k * SEQ:(k + 1) * SEQ + 1])
    assert (got[1:, 0] == got[:-1, -1]).all()  # k+1 starts on the token k ended with


def test_every_token_of_an_epoch_appears_once(data):
    ds = dataset(data, 3 * data.sizes.sum() // SEQ)
    assert ds.num_epochs == 4  # the last sample of epoch 3 needs one token of epoch 4
    per_epoch = ds.tokens_per_epoch // SEQ
    for epoch in range(3):
        inputs = ds.samples(epoch * per_epoch, per_epoch)[:, :-1].numpy().ravel()
        everything = np.concatenate([data[i] for i in range(len(data))])
        np.testing.assert_array_equal(np.sort(inputs), np.sort(everything))
    orders = ds.index.doc_idx.reshape(ds.num_epochs, len(data))
    assert all(sorted(o) == list(range(len(data))) for o in orders)
    assert not (orders[0] == orders[1]).all()  # each epoch is shuffled anew


def test_epoch_count_and_sample_count():
    assert samples_in_epochs(100, 10, 1) == 9 and samples_in_epochs(101, 10, 1) == 10
    assert num_epochs_for(100, 10, 9) == 1 and num_epochs_for(100, 10, 10) == 2
    assert num_epochs_for(100, 10, 0) == 1 and num_epochs_for(7, 10, 5) == 8


def test_deterministic_in_the_seed_and_cache_equals_memory(data, tmp_path):
    a, b = dataset(data, 50, seed=3), dataset(data, 50, seed=3)
    assert torch.equal(a.samples(0, 50), b.samples(0, 50))
    assert not torch.equal(a.samples(0, 50), dataset(data, 50, seed=4).samples(0, 50))
    cached = dataset(data, 50, seed=3, cache=IndexCache(str(tmp_path / "cache")))
    again = dataset(data, 50, seed=3, cache=IndexCache(str(tmp_path / "cache")))
    assert torch.equal(cached.samples(0, 50), a.samples(0, 50))
    assert torch.equal(again.samples(0, 50), a.samples(0, 50))
    assert isinstance(again.index.doc_idx, np.memmap)  # loaded from disk, memory-mapped


def test_pure_numpy_index_is_repeatable():
    sizes = np.array([5, 0, 7, 3, 9], dtype=np.int32)
    one = build_sample_index(sizes, np.arange(1, 5), 4, 3, seed=9)
    two = build_sample_index(sizes, np.arange(1, 5), 4, 3, seed=9)
    for name, array in one.arrays().items():
        np.testing.assert_array_equal(array, two.arrays()[name])
    assert set(one.doc_idx.tolist()) == {1, 2, 3, 4}  # only the split's documents


def test_global_batch_is_the_same_for_every_data_parallel_size(data):
    assert_same_global_batch(dataset(data, 200), (2, 4))


def test_out_of_range_and_foreign_tokens_are_errors(data):
    ds = dataset(data, 10)
    with pytest.raises(DataError, match="was built for"):
        ds.samples(len(ds) - 1, 2)
    strict = GPTDataset(data, range(len(data)), name="train", seq_length=SEQ, num_samples=10,
                        seed=1, cache=IndexCache(None), vocab_size=100)
    with pytest.raises(DataError, match="outside the vocabulary of 100"):
        strict.samples(0, 10)


def test_negative_tokens_are_errors(tmp_path):
    data = make_data(tmp_path / "neg", [SEQ + 1] * 4)  # ids 0..3008, all below the vocabulary
    strict = GPTDataset(data, range(len(data)), name="train", seq_length=SEQ, num_samples=4,
                        seed=1, cache=IndexCache(None), vocab_size=10_000)
    strict.samples(0, 4)
    with IndexedDatasetBuilder(str(tmp_path / "neg"), np.int32) as builder:
        for _ in range(4):
            builder.add_document(np.arange(SEQ + 1) - 3)
        builder.finalize()
    data = IndexedDataset(str(tmp_path / "neg"))
    strict = GPTDataset(data, range(len(data)), name="train", seq_length=SEQ, num_samples=4,
                        seed=1, cache=IndexCache(None), vocab_size=10_000)
    with pytest.raises(DataError, match="token id -3 is outside the vocabulary of 10000"):
        strict.samples(0, 4)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_float_dataset_is_not_read_as_tokens(tmp_path, dtype):
    """Floats would be truncated to ids silently: refused wherever GPT samples are built."""
    with IndexedDatasetBuilder(str(tmp_path / "f"), dtype) as builder:
        builder.add_document(np.linspace(0.5, 30.5, 4 * SEQ))
        builder.finalize()
    data = IndexedDataset(str(tmp_path / "f"))
    assert data.dtype == dtype and data[0][0] == 0.5  # the container still reads floats
    match = rf"f.idx: dtype {np.dtype(dtype).name} is not a token dtype.*tools/preprocess_data"
    with pytest.raises(DataError, match=match):
        dataset(data, 4)
    flags = {"data_path": str(tmp_path / "f"), "seq_length": SEQ, "train_samples": 4}
    with pytest.raises(DataError, match=match):
        build_datasets(**flags, seed=1, data_cache_path=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=match):
        dry_run_report(**flags)
    assert not (tmp_path / "cache").exists()  # refused before any index was built


def test_split_parsing_and_sizes():
    assert split_ranges(1000, parse_split("949,50,1")) == [range(0, 949), range(949, 999),
                                                            range(999, 1000)]
    assert [len(r) for r in split_ranges(1000, parse_split("969, 30, 1"))] == [969, 30, 1]
    assert parse_split("'99,1,0'") == parse_split('"99,1,0"') == parse_split("99,1,0")
    assert [len(r) for r in split_ranges(10, parse_split("8/2"))] == [8, 2, 0]
    assert [len(r) for r in split_ranges(7, parse_split("1,1,1"))] == [2, 3, 2]
    for bad in ("", "a,b", "1,2,3,4", "-1,2", "0,0", "nan,1,1", "inf,1,1", "1,-inf", "1e400",
                "1e308,1e308"):
        with pytest.raises(ConfigError, match="--split"):
            parse_split(bad)


def test_splits_are_disjoint_and_empty_splits_are_none(data, tmp_path):
    sets = build_datasets(data_path=data.prefix, seq_length=SEQ, seed=1, train_samples=30,
                          valid_samples=5, test_samples=5, split="80,20,0",
                          data_cache_path=str(tmp_path / "c"))
    assert sets.test is None and len(sets.train) >= 30 and len(sets.valid) >= 5
    train_docs = set(sets.train.index.doc_idx.tolist())
    valid_docs = set(sets.valid.index.doc_idx.tolist())
    assert train_docs == set(range(48)) and valid_docs == set(range(48, 60))
    with pytest.raises(ConfigError, match="gives the train split none of the 60 documents"):
        build_datasets(data_path=data.prefix, seq_length=SEQ, seed=1, train_samples=30,
                       split="1,1000,0", data_cache_path=str(tmp_path / "c"))
    empty = make_data(tmp_path / "empty", [0, 0, 5])
    with pytest.raises(DataError, match="the train split .* holds no tokens"):
        build_datasets(data_path=empty.prefix, seq_length=SEQ, seed=1, train_samples=30,
                       split="2,1,0", data_cache_path=str(tmp_path / "c"))
