"""Write a JSONL corpus from the Python standard library's ``.py`` sources (no download).

    python tools/stdlib_corpus.py --output data/stdlib.jsonl --max-mb 8

One document per file, ``{"text": ..., "path": ...}``, in an order shuffled by --seed (so
every --split part samples the whole library): the same corpus for the same flags on every
machine with the same Python version. Used by the quickstart.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence

from megatron3d.cli.common import OneLineParser, add_float, add_int, check_output_path, run_tool
from megatron3d.config.ranges import POSITIVE, SEED
from megatron3d.data.prep.corpus import DEFAULT_SEED, stdlib_documents, write_jsonl
from megatron3d.errors import ConfigError
from megatron3d.log import get_logger, setup_logging

logger = get_logger("stdlib_corpus")


def main(argv: Sequence[str] | None = None) -> int:
    return run_tool(_run, argv)


def _run(argv: Sequence[str] | None) -> int:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, help="JSONL file to write")
    add_float(p, "--max-mb", POSITIVE, "Stop before the text exceeds this many MB "
              "(default: all files).")
    add_int(p, "--seed", SEED, "Seed of the document order.", default=DEFAULT_SEED)
    args = p.parse(argv)
    setup_logging(0, 0)
    check_output_path(args.output, "--output")
    documents = stdlib_documents(None if args.max_mb is None else int(args.max_mb * 1e6),
                                 args.seed)
    first = next(documents, None)
    if first is None:
        raise ConfigError(f"--max-mb {args.max_mb} is below the first standard-library file; "
                          "raise it (e.g. --max-mb 1)")
    docs, nbytes = write_jsonl(itertools.chain([first], documents), args.output)
    logger.info("wrote %s: %d documents, %.1f MB", args.output, docs, nbytes / 1e6)
    return 0


if __name__ == "__main__":
    sys.exit(main())
