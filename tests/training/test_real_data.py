"""Training on Megatron .bin/.idx data: through pretrain_gpt, with --eod-mask-loss, and the
same model under data parallelism as in one process; data that does not fit the tokenizer
stops every rank at start with one line."""

from __future__ import annotations

import numpy as np
import pytest

import pretrain_gpt
from megatron3d.data.dataset_meta import describe, write_meta
from megatron3d.data.prep.indexed_builder import IndexedDatasetBuilder
from tests.helpers.dist import run_distributed
from tests.helpers.launch import launch
from tests.helpers.runs import assert_same_run, merge_ranks, train, train_single
from tests.helpers.tolerances import EQUIVALENCE_FLAGS, FP32
from tests.helpers.tools import load_tool, tool_logging

VOCAB = 100  # the null tokenizer's ids; its eod is 100 and its vocabulary 101


def _make_dataset(prefix: str) -> None:
    """300 documents of a learnable pattern (a counter modulo 17 from a random start)."""
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix, np.uint16)
    for _ in range(300):
        start, length = rng.integers(0, 17), rng.integers(5, 60)
        builder.add_document(list((start + np.arange(length)) % 17) + [VOCAB])
    builder.finalize()


def _argv(prefix: str, cache: str, iters: int, *extra: str) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", str(iters), "--lr", "3e-3", "--lr-warmup-iters", "2",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
            "--eval-interval", "5", "--eval-iters", "1", "--data-path", prefix,
            "--split", "90,10,0", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            str(VOCAB), "--data-cache-path", cache, *extra]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("data")
    _make_dataset(str(root / "corpus_text_document"))
    return str(root / "corpus_text_document"), str(root / "cache")


def test_pretrain_on_indexed_data_with_eod_mask(dataset, capsys):
    prefix, cache = dataset
    assert pretrain_gpt.main(_argv(prefix, cache, 10, "--eod-mask-loss")) == 0
    out = capsys.readouterr().out
    losses = [float(line.split("lm loss: ")[1].split()[0]) for line in out.splitlines()
              if line.startswith(" iteration")]
    assert len(losses) == 10 and losses[-1] < losses[0]
    assert "validation loss at iteration 10" in out


@pytest.mark.parametrize("foreign", [VOCAB + 400, -3])
@pytest.mark.parametrize("sidecar", [False, True], ids=["sampled at start", "at first batch"])
def test_token_outside_the_vocabulary_exits_2_with_one_line(tmp_path, capsys, foreign,
                                                            sidecar):
    """Data made with another tokenizer stops at start (a sample of documents) or, when a
    sidecar vouches for ids it does not hold, at its first batch; never in the embedding."""
    prefix = str(tmp_path / "foreign_text_document")
    with IndexedDatasetBuilder(prefix, np.int32) as builder:
        for _ in range(40):
            builder.add_document([1, 2, 3, foreign, 5, 6, 7, VOCAB])
        builder.finalize()
    if sidecar:
        write_meta(prefix, describe(prefix, min_token_id=0, max_token_id=VOCAB,
                                    vocab_size=VOCAB + 1, tokenizer_type="NullTokenizer"))
    assert pretrain_gpt.main(_argv(prefix, str(tmp_path / "cache"), 3)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert f"token id {foreign} is outside the vocabulary of {VOCAB + 1} in {prefix}" in err
    assert ("at start" in err) != sidecar
    assert (tmp_path / "cache").exists() == sidecar  # at start: before any index is built


def test_a_larger_vocabulary_than_the_tokenizer_stops_every_rank_at_start(tmp_path):
    """Text tokenized with 1000 ids, trained with 100, at DP=2: the sidecar that
    preprocess_data wrote stops both ranks before any index is built, one line each."""
    (tmp_path / "corpus.txt").write_text("".join(
        " ".join(str((7 * i + j) % 1000) for j in range(30)) + "\n" for i in range(200)))
    with tool_logging():
        assert load_tool("preprocess_data.py").main([
            "--input", str(tmp_path / "corpus.txt"), "--output-prefix", str(tmp_path / "big"),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--no-progress"]) == 0
    prefix = str(tmp_path / "big_text_document")
    job = launch("pretrain_gpt.py", _argv(prefix + ".bin", str(tmp_path / "cache"), 3), 2,
                 tmp_path)
    try:
        assert job.wait(timeout_s=120) == 2
    finally:
        job.kill()
    for rank in range(2):
        text = job.output(rank)
        errors = [line for line in text.splitlines() if line.startswith("error: ")]
        assert job.exit_codes[rank] == 2 and "Traceback" not in text, text[-2000:]
        assert len(errors) == 1, text[-2000:]
        assert (f"token id 999 is outside the vocabulary of {VOCAB + 1} in {prefix} "
                f"({prefix}.meta.json records ids written by NullTokenizer with 1001 ids; "
                "this run uses NullTokenizer)") in errors[0]
    assert not (tmp_path / "cache").exists()


def test_a_mistyped_prefix_names_the_nearest_before_any_work(dataset, capsys):
    prefix, cache = dataset
    assert pretrain_gpt.main(_argv(prefix.replace("text", "txt") + ".idx", cache, 3)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"not found; nearest existing: {prefix})" in err, err
    assert capsys.readouterr().out == ""  # refused in validation: no log, no process group


def test_dry_run_reports_the_sources(dataset, capsys):
    prefix, cache = dataset
    assert pretrain_gpt.main(_argv(prefix, cache, 10, "--dry-run-data")) == 0
    out = capsys.readouterr().out
    assert "train" in out and prefix in out and "iteration" not in out


def _dp_run(prefix: str, cache: str) -> object:
    return train(_argv(prefix, cache, 6, *EQUIVALENCE_FLAGS, "--zero-stage", "1"))


def test_data_parallel_on_indexed_data_matches_one_process(dataset):
    prefix, cache = dataset
    train_single(_argv(prefix, cache, 6))  # build the index caches once, in this process
    merged = merge_ranks(run_distributed(_dp_run, 2, prefix, cache))
    assert_same_run(merged, train_single(_argv(prefix, cache, 6, *EQUIVALENCE_FLAGS)), FP32)


def test_a_run_far_longer_than_the_data_is_refused_before_the_index(dataset, capsys):
    """10**12 samples of 300 short documents: the index would take terabytes."""
    prefix, cache = dataset
    argv = _argv(prefix, cache, 1)
    at = argv.index("--train-iters")
    argv[at:at + 2] = ["--train-samples", str(10**12)]
    warmup = argv.index("--lr-warmup-iters")
    del argv[warmup:warmup + 2]
    assert pretrain_gpt.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "the train split needs 1,000,000,000,000 samples" in err and "GiB" in err


def _pp4_run(prefix: str, cache: str) -> tuple[int, object]:
    """Train at PP=4 (4 blocks, one per stage), counting the datasets this rank opens."""
    from megatron3d.data import indexed_dataset

    opened: list[str] = []
    real = indexed_dataset.IndexedDataset.__init__

    def counting(self, path_prefix: str, *args, **kwargs) -> None:
        opened.append(path_prefix)
        real(self, path_prefix, *args, **kwargs)

    indexed_dataset.IndexedDataset.__init__ = counting
    try:
        result = train(_argv(prefix, cache, 4, *EQUIVALENCE_FLAGS, "--num-layers", "4",
                             "--pipeline-model-parallel-size", "4", "--pp-partition-method",
                             "type:transformer", "--split", "80,10,10"))
    finally:
        indexed_dataset.IndexedDataset.__init__ = real
    return len(opened), result


def test_middle_pipeline_stages_open_no_dataset(dataset):
    """Only the first stage (tokens) and the last (labels and loss masks) read data; the
    run is the same model as one process, test-split evaluation included."""
    prefix, cache = dataset
    extra = (*EQUIVALENCE_FLAGS, "--num-layers", "4", "--split", "80,10,10")
    reference = train_single(_argv(prefix, cache, 4, *extra))
    per_rank = run_distributed(_pp4_run, 4, prefix, cache, timeout_s=180)
    assert [opened for opened, _ in per_rank][1:3] == [0, 0]
    assert all(opened > 0 for opened, _ in (per_rank[0], per_rank[3]))
    assert_same_run(merge_ranks([result for _, result in per_rank]), reference, FP32)
