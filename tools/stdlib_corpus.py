"""Write a JSONL corpus from the Python standard library's ``.py`` sources (no download).

    python tools/stdlib_corpus.py --output data/stdlib.jsonl --max-mb 8

One document per file, ``{"text": ..., "path": ...}``, in sorted path order: the same corpus
on every machine with the same Python version. Used by the quickstart.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron3d.data.corpus import stdlib_documents, write_jsonl  # noqa: E402
from megatron3d.log import get_logger, setup_logging  # noqa: E402

logger = get_logger("stdlib_corpus")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, help="JSONL file to write")
    p.add_argument("--max-mb", type=float, default=None,
                   help="stop before the text exceeds this many MB (default: all files)")
    args = p.parse_args(argv)
    setup_logging(0, 0)
    limit = None if args.max_mb is None else int(args.max_mb * 1e6)
    docs, nbytes = write_jsonl(stdlib_documents(limit), args.output)
    logger.info("wrote %s: %d documents, %.1f MB", args.output, docs, nbytes / 1e6)
    return 0


if __name__ == "__main__":
    sys.exit(main())
