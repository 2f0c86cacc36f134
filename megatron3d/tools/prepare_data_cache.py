"""Build the dataset index caches offline, before a training job starts.

    python tools/prepare_data_cache.py \
        --data-path 0.3 data/a_text_document 0.7 data/b_text_document \
        --split 969,30,1 --seq-length 2048 --seed 1234 \
        --train-iters 500000 --global-batch-size 512 --eval-iters 10 \
        --data-cache-path /shared/index-cache

Give the training run's own flags: the sample counts come from them as pretrain_gpt.py
computes them (training samples from ``--train-iters`` or ``--train-samples`` with the batch
rampup; validation and test samples from ``--eval-iters`` x ``--global-batch-size``). Caches
are keyed by the data, split, sequence length, epochs and seed, so the job finds them; it
also prints the blend's per-source samples and epochs (what ``--dry-run-data`` shows).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from megatron3d.cli.common import OneLineParser, add_int, run_tool
from megatron3d.config import ModelConfig, TrainConfig, TrainingConfig
from megatron3d.config.ranges import BATCH, ITERATIONS, SAMPLES, SEED, SIZE, Range
from megatron3d.data.blended_dataset import format_report
from megatron3d.data.builder import DEFAULT_SPLIT, build_datasets, dry_run_report
from megatron3d.errors import ConfigError
from megatron3d.log import get_logger, setup_logging
from megatron3d.optim.batch_schedule import BatchSchedule
from megatron3d.training.build import run_length, valid_samples

logger = get_logger("prepare_data_cache")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The training run's data flags, with the bounds pretrain_gpt.py puts on them."""
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-path", nargs="+", help="PREFIX, or W1 PREFIX1 W2 PREFIX2 ...")
    p.add_argument("--data-path-file", help="a file holding the --data-path words")
    p.add_argument("--split", default=DEFAULT_SPLIT)
    add_int(p, "--seq-length", SIZE, "Tokens per training sample.", required=True)
    add_int(p, "--seed", SEED, "The training run's seed.", default=1234)
    length = p.add_mutually_exclusive_group(required=True)
    add_int(length, "--train-iters", ITERATIONS, "The run's optimizer steps.")
    add_int(length, "--train-samples", SAMPLES, "The run's training samples.")
    add_int(p, "--global-batch-size", BATCH, "The run's global batch size.", required=True)
    p.add_argument("--rampup-batch-size", nargs=3, type=int, metavar=("START", "INCR", "SAMPLES"),
                   help="the run's batch-size rampup, if any")
    add_int(p, "--eval-iters", Range(0, 2**20), "The run's global batches per evaluation.",
            default=TrainingConfig.__dataclass_fields__["eval_iters"].default)
    p.add_argument("--data-cache-path", help="default: index-cache beside the first dataset")
    p.add_argument("--dry-run-data", action="store_true",
                   help="only print the per-source report; build nothing")
    return p.parse(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return run_tool(_run, argv)


def _run(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    setup_logging(0, 0)
    if args.data_cache_path is not None and os.path.exists(args.data_cache_path) \
            and not os.path.isdir(args.data_cache_path):
        raise ConfigError(f"--data-cache-path {args.data_cache_path!r} is a file; give a "
                          "directory (it is created when missing)")
    train, valid = _run_samples(args)
    common = {"data_path": args.data_path, "data_path_file": args.data_path_file,
              "split": args.split, "seq_length": args.seq_length, "train_samples": train,
              "valid_samples": valid, "test_samples": valid}  # as data_setup asks for them
    start = time.perf_counter()
    for split, rows in dry_run_report(**common).items():
        logger.info(format_report(split, rows))
    if not args.dry_run_data:
        build_datasets(**common, seed=args.seed, data_cache_path=args.data_cache_path)
    logger.info("done in %.1fs", time.perf_counter() - start)
    return 0


def _run_samples(args: argparse.Namespace) -> tuple[int, int]:
    """(train, valid) samples by training's own functions; micro-batch and DP sizes do not
    change them, so 1 stands in for both."""
    training = TrainingConfig(micro_batch_size=1, global_batch_size=args.global_batch_size,
                              rampup_batch_size=args.rampup_batch_size,
                              train_iters=args.train_iters, train_samples=args.train_samples,
                              eval_iters=args.eval_iters)
    cfg = TrainConfig(model=ModelConfig(), training=training)
    schedule = BatchSchedule.from_config(training, dp_size=1)
    return run_length(cfg, schedule)[1], valid_samples(cfg, schedule)


if __name__ == "__main__":
    sys.exit(main())
