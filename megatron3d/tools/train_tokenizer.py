"""Train a SentencePiece tokenizer on JSONL or plain text.

    python tools/train_tokenizer.py --input corpus.jsonl --model-prefix data/tok --vocab-size 4096

writes ``data/tok.model`` (use it with ``--tokenizer-type SentencePieceTokenizer
--tokenizer-model data/tok.model``) and ``data/tok.vocab``. Text keeps its exact spelling
(newlines, indentation), so the model suits code as well as prose.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from megatron3d.cli.common import OneLineParser, add_float, add_int, check_output_path, run_tool
from megatron3d.config.ranges import AT_LEAST_ONE, VOCABULARY, Range
from megatron3d.data.prep.tokenizer_training import read_texts, train_sentencepiece
from megatron3d.data.tokenizer import SentencePieceTokenizer
from megatron3d.log import get_logger, setup_logging

logger = get_logger("train_tokenizer")

# SentencePiece's own limit: it refuses a coverage outside [0.98, 1].
_COVERAGE = Range(0.98, 1.0)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", nargs="+", required=True, help="JSONL or text files")
    p.add_argument("--input-format", choices=["auto", "jsonl", "text"], default="auto",
                   help="auto: .jsonl/.json files are JSONL, others plain text")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    add_int(p, "--vocab-size", VOCABULARY, "Pieces in the vocabulary.", default=8192)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    add_int(p, "--max-pieces", AT_LEAST_ONE, "Train on at most this many ~2000-character "
            "pieces of the input.", default=2_000_000)
    add_float(p, "--character-coverage", _COVERAGE, "Share of characters the vocabulary "
              "covers.", default=0.9995)
    return p.parse(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return run_tool(_run, argv)


def _run(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    setup_logging(0, 0)
    texts = read_texts(args.input, args.json_keys, args.input_format)
    check_output_path(args.model_prefix, "--model-prefix", prefix=True)
    start = time.perf_counter()
    model = train_sentencepiece(texts, args.model_prefix, args.vocab_size, args.model_type,
                                args.max_pieces, args.character_coverage)
    tokenizer = SentencePieceTokenizer(model)
    logger.info("wrote %s: vocab %d, eod %d, in %.1fs", model, tokenizer.vocab_size,
                tokenizer.eod, time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
