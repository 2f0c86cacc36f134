"""Tokenize a JSONL or plain-text corpus into Megatron indexed datasets (``.bin``/``.idx``).

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model \
        --output-prefix data/corpus --append-eod --workers 4

writes ``data/corpus_text_document.bin/.idx`` (``{prefix}_{key}_document``) and a
``.meta.json`` beside them (counts and token-id range, checked by training at start). A plain
text input (one document per line; ``--input-format text``, the default unless the file is
``.jsonl``/``.json`` or starts with a JSON object) writes ``{prefix}_text_document``. The
output is identical for any ``--workers``; ``--partitions N`` writes N intermediate datasets
and merges them, reusing finished ones when rerun after a crash. The last line states the
documents, tokens and dtype written.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence

from megatron3d.cli.common import OneLineParser, add_float, add_int, check_output_path, run_tool
from megatron3d.config.ranges import AT_LEAST_ONE, POSITIVE, VOCABULARY
from megatron3d.data.dataset_meta import read_meta
from megatron3d.data.prep.preprocess import INPUT_FORMATS, PreprocessJob, detect_format, preprocess
from megatron3d.data.tokenizer import TOKENIZER_TYPES, TokenizerSpec
from megatron3d.errors import ConfigError
from megatron3d.log import get_logger, setup_logging

logger = get_logger("preprocess_data")


def add_tokenizer_args(parser: argparse.ArgumentParser) -> None:
    """The tokenizer flags, named as in Megatron-DeepSpeed."""
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", help="SentencePiece model file")
    group.add_argument("--vocab-file", help="GPT-2 vocab.json")
    group.add_argument("--merge-file", help="GPT-2 merges.txt")
    group.add_argument("--tokenizer-name-or-path", help="local Hugging Face tokenizer dir/file")
    add_int(group, "--vocab-size", VOCABULARY, "NullTokenizer vocabulary size.")


def tokenizer_spec(args: argparse.Namespace) -> TokenizerSpec:
    """The tokenizer the flags name; ConfigError for a flag this tokenizer type ignores."""
    spec = TokenizerSpec(tokenizer_type=args.tokenizer_type,
                         tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file,
                         merge_file=args.merge_file,
                         tokenizer_name_or_path=args.tokenizer_name_or_path,
                         vocab_size=args.vocab_size)
    unused = spec.unused_flags()
    if unused:
        raise ConfigError(f"--tokenizer-type {spec.tokenizer_type} does not use {unused[0]}; "
                          f"drop {unused[0]} or pick the tokenizer type it belongs to")
    return spec


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True,
                   help="JSONL or plain-text file, one document per line")
    p.add_argument("--input-format", choices=INPUT_FORMATS,
                   help="default: jsonl for .jsonl/.json files or a first line holding a "
                   "JSON object, else text")
    p.add_argument("--json-keys", nargs="+",
                   help="JSONL keys to tokenize, one output dataset per key (default: text)")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--append-eod", action="store_true",
                   help="append the end-of-document token to every document")
    p.add_argument("--dtype", choices=["uint16", "int32", "int64"],
                   help="token dtype; default uint16 below 65500 tokens, else int32")
    add_int(p, "--workers", AT_LEAST_ONE, "Tokenizer processes.", default=1)
    add_int(p, "--partitions", AT_LEAST_ONE, "Cut the input into this many slices written "
            "separately, then merged.", default=1)
    add_float(p, "--chunk-mb", POSITIVE, "Input MB per worker task.", default=1.0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--dataset-impl", default="mmap",
                   help="Megatron's dataset format flag: mmap, the only format written")
    add_tokenizer_args(p)
    args = p.parse(argv)
    if args.dataset_impl != "mmap":
        raise ConfigError(f"--dataset-impl {args.dataset_impl!r} is not supported: mmap is the "
                          "only format written (Megatron's .bin/.idx, which every Megatron "
                          "reads); pass --dataset-impl mmap or drop the flag")
    return args


def _progress_bar(total: int, enabled: bool):
    """A tqdm bar over input bytes (MB/s) with documents/s alongside."""
    if not enabled:
        return None, lambda docs, nbytes: None
    from tqdm import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc="tokenizing")
    state = {"docs": 0, "start": time.perf_counter()}

    def update(docs: int, nbytes: int) -> None:
        state["docs"] += docs
        elapsed = max(time.perf_counter() - state["start"], 1e-9)
        bar.set_postfix_str(f"{state['docs']:,} docs, {state['docs'] / elapsed:,.0f} docs/s",
                            refresh=False)
        bar.update(nbytes)
    return bar, update


def main(argv: Sequence[str] | None = None) -> int:
    return run_tool(_run, argv)


def _run(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    setup_logging(0, 0)
    check_output_path(args.output_prefix, "--output-prefix", prefix=True)
    job = PreprocessJob(input=args.input, output_prefix=args.output_prefix,
                        tokenizer=tokenizer_spec(args),
                        json_keys=tuple(args.json_keys or ["text"]),
                        append_eod=args.append_eod, dtype=args.dtype,
                        chunk_bytes=math.ceil(args.chunk_mb * 1e6),
                        input_format=args.input_format or detect_format(args.input))
    start = time.perf_counter()
    exists = os.path.isfile(args.input)  # else preprocess says so, with no empty bar
    total = os.path.getsize(args.input) if exists else 0
    bar, update = _progress_bar(total, exists and not args.no_progress)
    try:
        outputs = preprocess(job, workers=args.workers, partitions=args.partitions,
                             progress=update)
    finally:
        if bar is not None:
            bar.close()
    for prefix in outputs:
        meta = read_meta(prefix)
        logger.info("wrote %s.bin/.idx from %s input in %.1fs: %s documents, %s tokens, "
                    "dtype %s", prefix, job.input_format, time.perf_counter() - start,
                    f"{meta.documents:,}", f"{meta.tokens:,}", meta.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
