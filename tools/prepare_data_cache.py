"""Build the dataset index caches offline, before a training job starts.

    python tools/prepare_data_cache.py \
        --data-path 0.3 data/a_text_document 0.7 data/b_text_document \
        --split 969,30,1 --seq-length 2048 --seed 1234 \
        --train-samples 1000000 --valid-samples 20000 --test-samples 2000 \
        --data-cache-path /shared/index-cache

Use the training run's values (pretrain_gpt.py logs the sample counts it asks for). Caches
are keyed by the data, split, sequence length, epochs and seed, so the job finds them; it
also prints the blend's per-source samples and epochs (what ``--dry-run-data`` shows).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron3d.data.blended_dataset import format_report  # noqa: E402
from megatron3d.data.builder import DEFAULT_SPLIT, build_datasets, dry_run_report  # noqa: E402
from megatron3d.errors import Megatron3dError  # noqa: E402
from megatron3d.log import get_logger, setup_logging  # noqa: E402

logger = get_logger("prepare_data_cache")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-path", nargs="+", help="PREFIX, or W1 PREFIX1 W2 PREFIX2 ...")
    p.add_argument("--data-path-file", help="a file holding the --data-path words")
    p.add_argument("--split", default=DEFAULT_SPLIT)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--train-samples", type=int, required=True)
    p.add_argument("--valid-samples", type=int, default=0)
    p.add_argument("--test-samples", type=int, default=0)
    p.add_argument("--data-cache-path", help="default: index-cache beside the first dataset")
    p.add_argument("--dry-run-data", action="store_true",
                   help="only print the per-source report; build nothing")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(0, 0)
    common = {"data_path": args.data_path, "data_path_file": args.data_path_file,
              "split": args.split, "seq_length": args.seq_length,
              "train_samples": args.train_samples, "valid_samples": args.valid_samples,
              "test_samples": args.test_samples}
    start = time.perf_counter()
    try:
        for split, rows in dry_run_report(**common).items():
            logger.info(format_report(split, rows))
        if not args.dry_run_data:
            build_datasets(**common, seed=args.seed, data_cache_path=args.data_cache_path)
    except Megatron3dError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    logger.info("done in %.1fs", time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
