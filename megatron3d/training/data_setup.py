"""Training, validation and test data for a run: mock data, or Megatron datasets with their
tokenizer.

The tokenizer decides the model's vocabulary when real data is used, so this runs before the
model is built. Validation uses the same ``eval_iters`` global batches at every evaluation,
so the numbers are comparable across a run (Megatron instead moves on to fresh samples). The
test split is read once, at the end, for as many samples as one evaluation (Megatron's
``eval_iters`` test batches).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatron3d.config import TrainConfig
from megatron3d.data.blended_dataset import format_report
from megatron3d.data.builder import (
    SplitPaths,
    build_datasets,
    check_sources_exist,
    dry_run_report,
)
from megatron3d.data.documents import every_stage_reads_tokens
from megatron3d.data.mock import MockGPTDataset
from megatron3d.data.sampler import TokenDataset, UnreadDataset
from megatron3d.data.tokenizer import TokenizerSpec, build_tokenizer
from megatron3d.data.vocab_padding import check_vocab_padding
from megatron3d.errors import ConfigError
from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup

VALID_SAMPLE_OFFSET = 2**48
"""Validation samples of the mock dataset start here: same distribution, disjoint samples."""
TEST_SAMPLE_OFFSET = 2**49
"""And test samples here."""


@dataclass(frozen=True)
class Datasets:
    """The run's datasets (a middle pipeline stage gets placeholders it never reads)."""

    vocab_size: int
    train: TokenDataset
    valid: TokenDataset | None
    test: TokenDataset | None  # None when --split gives the test split no documents
    eod: int | None  # the tokenizer's end-of-document token (None for mock data)


class _Offset:
    """A view of a dataset starting ``offset`` samples in."""

    def __init__(self, dataset: TokenDataset, offset: int) -> None:
        self.dataset, self.offset = dataset, offset

    def samples(self, start: int, count: int) -> torch.Tensor:
        return self.dataset.samples(self.offset + start, count)


def build_run_data(cfg: TrainConfig, train_samples: int, valid_samples: int,
                   pp: AxisGroup | None = None, device: torch.device | None = None) -> Datasets:
    """``valid_samples``: what one evaluation reads, from the validation and the test split.

    Only the first and the last pipeline stage (``pp``) use tokens, labels and loss masks;
    a middle stage opens no dataset file and gets ``UnreadDataset``s (it learns from the
    others, in one collective, whether the test split has samples: every stage must run the
    same evaluations), unless its attention reads where packed documents lie
    (--reset-position-ids, --reset-attention-mask): then it reads the tokens too."""
    if pp is not None and 0 < pp.rank < pp.size - 1 and not every_stage_reads_tokens(cfg.data):
        data = _unread(cfg)
    else:
        data = _read(cfg, train_samples, valid_samples)
    if (pp is not None and pp.size > 2  # every stage takes part in the collective
            and comm.any_rank(data.test is not None, pp, device) and data.test is None):
        data = dataclasses.replace(data, test=UnreadDataset())
    return data


def _unread(cfg: TrainConfig) -> Datasets:
    vocab = (cfg.model.vocab_size if cfg.data.mock_data
             else build_tokenizer(_tokenizer_spec(cfg)).vocab_size)
    return Datasets(vocab, UnreadDataset(), UnreadDataset(), None, None)


def _read(cfg: TrainConfig, train_samples: int, valid_samples: int) -> Datasets:
    if cfg.data.mock_data:
        mock = MockGPTDataset(cfg.model.vocab_size, cfg.model.seq_length, cfg.training.seed)
        return Datasets(cfg.model.vocab_size, mock, _Offset(mock, VALID_SAMPLE_OFFSET),
                       _Offset(mock, TEST_SAMPLE_OFFSET), None)
    tokenizer = build_tokenizer(_tokenizer_spec(cfg))
    sets = build_datasets(**_sources(cfg), seq_length=cfg.model.seq_length,
                          seed=cfg.training.seed, train_samples=train_samples,
                          valid_samples=valid_samples, test_samples=valid_samples,
                          data_cache_path=cfg.data.data_cache_path,
                          vocab_size=tokenizer.vocab_size,
                          tokenizer_type=cfg.data.tokenizer_type)
    if sets.train is None:
        raise ConfigError(f"the training split is empty (--split={cfg.data.split!r}): give "
                          "training a share of the documents")
    if sets.valid is None and valid_samples > 0:
        if cfg.data.train_data_path:
            raise ConfigError("no validation data (--train-data-path without "
                              "--valid-data-path) but --eval-iters > 0: pass --valid-data-path "
                              "or --eval-iters 0")
        raise ConfigError(f"the validation split is empty (--split={cfg.data.split!r}) but "
                          "--eval-iters > 0: give validation a share or pass --eval-iters 0")
    return Datasets(tokenizer.vocab_size, sets.train, sets.valid, sets.test, tokenizer.eod)


def dry_run(cfg: TrainConfig, train_samples: int, valid_samples: int) -> str:
    """The --dry-run-data report: per split and source, weight, samples and epochs."""
    reports = dry_run_report(**_sources(cfg), seq_length=cfg.model.seq_length,
                             train_samples=train_samples, valid_samples=valid_samples,
                             test_samples=valid_samples)
    return "\n".join(format_report(split, rows) for split, rows in reports.items() if rows)


def _sources(cfg: TrainConfig) -> dict:
    d = cfg.data
    return {"data_path": d.data_path, "data_path_file": d.data_path_file, "split": d.split,
            "train_data_path": d.train_data_path, "valid_data_path": d.valid_data_path,
            "test_data_path": d.test_data_path}


def check_data_exists(cfg: TrainConfig) -> None:
    """Every dataset prefix the flags name has its .idx (``DataError`` naming the nearest)."""
    for sources in SplitPaths(**_sources(cfg)).sources():
        if sources is not None:
            check_sources_exist(sources)


def check_vocabulary_fits(cfg: TrainConfig) -> None:
    """--pad-vocab-size-to against the tokenizer's vocabulary, before any work (the
    tokenizer only reads its local files)."""
    if cfg.model.pad_vocab_size_to is not None and not cfg.data.mock_data:
        check_vocab_padding(cfg.model.pad_vocab_size_to,
                            cfg.parallel.tensor_model_parallel_size,
                            build_tokenizer(_tokenizer_spec(cfg)).vocab_size)


def _tokenizer_spec(cfg: TrainConfig) -> TokenizerSpec:
    d = cfg.data
    return TokenizerSpec(d.tokenizer_type, tokenizer_model=d.tokenizer_model,
                         vocab_file=d.vocab_file, merge_file=d.merge_file,
                         tokenizer_name_or_path=d.tokenizer_name_or_path,
                         vocab_size=cfg.model.vocab_size)
