"""Training on packed documents (--reset-position-ids, --reset-attention-mask,
--eod-mask-loss) trains the same model under TP x PP (sequence parallel, interleaved, full
and selective recompute), with middle pipeline stages (which then read the tokens: their
attention needs the documents) and under context parallelism (documents across the chunks,
each exchange) as in one process: losses, grad norms, parameters, validation
loss; for GPT-2 (learned positions), BLOOM (ALiBi) and Llama (RoPE, GQA)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron3d.data.prep.indexed_builder import IndexedDatasetBuilder
from tests.helpers.dist import run_distributed
from tests.helpers.runs import assert_each_variant, reference_run, train
from tests.helpers.tiny import FLAVOUR_FLAGS
from tests.helpers.tolerances import EQUIVALENCE_FLAGS, FP32

VOCAB = 100  # the null tokenizer's ids; its eod is 100
PACKED = ("--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss")
GQA = ("--group-query-attention", "--num-query-groups", "2")
VARIANTS = {  # label: (flavour, model flags, layout and features)
    "gpt2, TP2 x PP2 interleaved, sequence parallel, full recompute": (
        "gpt2", (), ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                     "2", "--num-layers-per-virtual-pipeline-stage", "1",
                     "--sequence-parallel", "--recompute-granularity", "full")),
    "bloom, TP2 x PP2, selective recompute": (
        "bloom", (), ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                      "2", "--recompute-granularity", "selective")),
    "llama GQA, PP4 (two middle stages)": (
        "llama", GQA, ("--pipeline-model-parallel-size", "4", "--pp-partition-method",
                       "type:transformer")),
    # documents crossing the context-parallel chunks: each exchange sees them
    "llama GQA, CP2 x PP2, p2p": (
        "llama", GQA, ("--context-parallel-size", "2", "--cp-comm-type", "p2p",
                       "--pipeline-model-parallel-size", "2")),
    "gpt2, CP4, a2a": ("gpt2", (), ("--context-parallel-size", "4", "--cp-comm-type", "a2a")),
    "bloom, CP2 x TP2, sequence parallel, all_gather": (
        "bloom", (), ("--context-parallel-size", "2", "--cp-comm-type", "all_gather",
                      "--tensor-model-parallel-size", "2", "--sequence-parallel")),
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[str, str]:
    """Short documents (3 to 12 tokens and the EOD): every 16-token sample holds several."""
    root = tmp_path_factory.mktemp("packed")
    prefix = str(root / "packed_text_document")
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for _ in range(200):
            start, length = rng.integers(0, 17), rng.integers(3, 13)
            builder.add_document(list((start + np.arange(length)) % 17) + [VOCAB])
        builder.finalize()
    return prefix, str(root / "cache")


def _argv(prefix: str, cache: str, flavour: str, *extra: str) -> list[str]:
    return ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", "4", "--lr", "3e-3", "--lr-warmup-iters", "1",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
            "--eval-interval", "1000", "--eval-iters", "1", "--data-path", prefix,
            "--split", "90,10,0", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            str(VOCAB), "--data-cache-path", cache, *EQUIVALENCE_FLAGS, *PACKED,
            *FLAVOUR_FLAGS[flavour], *extra]


def _variant_runs(prefix: str, cache: str) -> list:
    """One rank of four: every variant in the same processes."""
    return [train(_argv(prefix, cache, flavour, *model, *layout))
            for flavour, model, layout in VARIANTS.values()]


def test_packed_documents_train_alike_under_tp_pp_and_middle_stages(dataset):
    prefix, cache = dataset
    references = [reference_run(tuple(_argv(prefix, cache, flavour, *model)))
                  for flavour, model, _ in VARIANTS.values()]  # and the index caches, once
    per_rank = run_distributed(_variant_runs, 4, prefix, cache, timeout_s=300)
    for index, (label, reference) in enumerate(zip(VARIANTS, references, strict=True)):
        assert_each_variant([[runs[index]] for runs in per_rank], reference, [label], FP32)
