"""JSONL or plain text -> tokenized indexed datasets, in parallel, with output independent of
parallelism.

JSONL holds one JSON object per line (``json_keys`` pick the texts); plain text holds one
document per line. Beside each ``.bin/.idx`` goes a ``.meta.json`` (``dataset_meta``) with the
counts and the range of token ids, which training checks against its tokenizer at start.

The input is cut into ~1 MiB chunks at line starts. Workers read their chunk straight from
the file (text never passes through the parent), tokenize it and send back compact token
arrays; the parent receives results in input order and streams them into one
``IndexedDatasetBuilder`` per JSON key. Chunk bounds depend only on the file, so the output
is byte-identical for any number of workers.

``partitions > 1`` cuts the input into that many line-aligned slices, writes each slice to
its own intermediate dataset, and merges them at the end. A slice whose intermediate dataset
is complete (its ``.done`` marker matches the input, range and settings) is reused, so a
long run that dies resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import multiprocessing as mp
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from megatron3d.data.dataset_meta import (
    DatasetMeta,
    describe,
    meta_file_path,
    read_meta,
    write_meta,
)
from megatron3d.data.indexed_dataset import data_file_path, index_file_path
from megatron3d.data.prep.indexed_builder import IndexedDatasetBuilder, best_dtype, merge_datasets
from megatron3d.data.tokenizer import Tokenizer, TokenizerSpec, build_tokenizer
from megatron3d.errors import ConfigError, DataError
from megatron3d.log import get_logger

logger = get_logger(__name__)

Progress = Callable[[int, int], None]  # (documents, input bytes) done since the last call
_WINDOW_PER_WORKER = 4  # chunks in flight per worker
INPUT_FORMATS = ("jsonl", "text")
IdRange = tuple[int, int] | None  # smallest and largest token id; None: no tokens


@dataclass(frozen=True)
class PreprocessJob:
    """What to tokenize, how, and where to write it."""

    input: str
    output_prefix: str
    tokenizer: TokenizerSpec
    json_keys: tuple[str, ...] = ("text",)
    append_eod: bool = False
    dtype: str | None = None  # token dtype; default uint16 below 65500 tokens, else int32
    chunk_bytes: int = 1 << 20
    input_format: str = "jsonl"  # or "text": one document per line

    def key_prefix(self, key: str, part: str = "") -> str:
        """Megatron's output name: ``{output_prefix}_{key}_document``."""
        return f"{self.output_prefix}_{key}_document{part}"


@dataclass(frozen=True)
class _Chunk:
    job: PreprocessJob
    start: int
    end: int


@dataclass(frozen=True)
class _ChunkResult:
    tokens: dict[str, np.ndarray]  # all documents' tokens, concatenated
    lengths: dict[str, np.ndarray]  # int64 [documents] tokens per document
    id_ranges: dict[str, IdRange]
    documents: int
    nbytes: int


def line_aligned_bounds(path: str, start: int, end: int, step: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut into pieces of about ``step`` bytes, each starting at a line start."""
    bounds, pos = [], start
    with open(path, "rb") as f:
        while pos < end:
            target = pos + max(step, 1)
            if target >= end:
                bounds.append((pos, end))
                break
            f.seek(target - 1)
            f.readline()  # to the end of the line holding byte target - 1
            nxt = min(f.tell(), end)
            bounds.append((pos, nxt))
            pos = nxt
    return bounds


@functools.cache
def _tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """One tokenizer per process (workers rebuild it from the picklable spec)."""
    return build_tokenizer(spec)


def _tokenize_chunk(chunk: _Chunk) -> _ChunkResult:
    job = chunk.job
    tok = _tokenizer(job.tokenizer)
    dtype = np.dtype(job.dtype)
    ids: dict[str, list[int]] = {k: [] for k in job.json_keys}
    lengths: dict[str, list[int]] = {k: [] for k in job.json_keys}
    with open(job.input, "rb") as f:
        f.seek(chunk.start)
        data = f.read(chunk.end - chunk.start)
    starts, offset = [], chunk.start  # starts: byte offset of each document's line
    for line in data.splitlines(keepends=True):
        if line.strip():
            record = _parse(line, job, offset)
            for key in job.json_keys:
                tokens = _tokenize(tok, _text(record, key, job, offset), job, offset)
                if job.append_eod:
                    tokens.append(tok.eod)
                ids[key].extend(tokens)
                lengths[key].append(len(tokens))
            starts.append(offset)
        offset += len(line)
    sizes = {k: np.asarray(v, dtype=np.int64) for k, v in lengths.items()}
    tokens = {k: _as_tokens(v, sizes[k], starts, tok.vocab_size, dtype, job)
              for k, v in ids.items()}
    return _ChunkResult(tokens=tokens, lengths=sizes, documents=len(starts),
                        nbytes=chunk.end - chunk.start,
                        id_ranges={k: (int(v.min()), int(v.max())) if v.size else None
                                   for k, v in tokens.items()})


def _tokenize(tok: Tokenizer, text: str, job: PreprocessJob, offset: int) -> list[int]:
    """``tok.tokenize``, with the input line named when the tokenizer refuses the text."""
    try:
        return tok.tokenize(text)
    except DataError as exc:
        raise DataError(f"{job.input}: the line at byte {offset}: {exc}") from None


def _parse(line: bytes, job: PreprocessJob, offset: int) -> dict:
    if job.input_format == "text":
        try:
            return {"text": line.rstrip(b"\r\n").decode("utf-8")}
        except UnicodeDecodeError as exc:
            raise DataError(f"{job.input}: the line at byte {offset} is not UTF-8 ({exc}); "
                            "convert the file to UTF-8") from None
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{job.input}: invalid JSON in the line at byte {offset} ({exc}); "
                        "fix or remove that line (the input must be one JSON object per "
                        "line)") from None
    if not isinstance(record, dict):
        raise DataError(f"{job.input}: the line at byte {offset} is not a JSON object; write "
                        "one object per line, e.g. {\"text\": \"...\"}")
    return record


def _text(record: dict, key: str, job: PreprocessJob, offset: int) -> str:
    text = record.get(key)
    if not isinstance(text, str):
        what = "has no key" if key not in record else "has a non-string value for"
        raise DataError(f"{job.input}: the object at byte {offset} {what} {key!r}; pass the "
                        f"right --json-keys (it has {sorted(record)[:5]})")
    return text


def _as_tokens(ids: list[int], lengths: np.ndarray, starts: list[int], vocab_size: int,
               dtype: np.dtype, job: PreprocessJob) -> np.ndarray:
    """A chunk's ids as ``dtype``, each checked to lie in ``[0, vocab_size)`` (one vectorised
    min/max; ``preprocess`` made sure the vocabulary fits ``dtype``): an id outside it would be
    written wrapped, or crash the embedding much later."""
    values = np.asarray(ids, dtype=np.int64)
    if values.size and (values.min() < 0 or values.max() >= vocab_size):
        first = int(np.flatnonzero((values < 0) | (values >= vocab_size))[0])
        doc = int(np.searchsorted(np.cumsum(lengths), first, side="right"))
        raise DataError(f"{job.input}: the line at byte {starts[doc]} gives token id "
                        f"{int(values[first])}, outside the tokenizer's vocabulary "
                        f"[0, {vocab_size}); its files disagree (e.g. a vocab.json id beyond "
                        "its size): fix or replace the tokenizer")
    return values.astype(dtype)


def preprocess(job: PreprocessJob, workers: int = 1, partitions: int = 1,
               progress: Progress | None = None) -> list[str]:
    """Tokenize ``job.input``; return the output prefix of each JSON key.

    Bad input (a missing input, a tokenizer that cannot load, a ``dtype`` too narrow for the
    vocabulary) is refused before any work; a bad line, with its byte offset, when met.
    """
    _check_input(job)
    job = dataclasses.replace(job, dtype=_token_dtype(job, _tokenizer(job.tokenizer)).name)
    slices = line_aligned_bounds(job.input, 0, os.path.getsize(job.input),
                                 -(-os.path.getsize(job.input) // max(partitions, 1)))
    pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) \
        if workers > 1 else None
    try:
        if partitions <= 1:
            _write(job, _results(job, slices, pool, workers),
                   [job.key_prefix(k) for k in job.json_keys], progress)
        else:
            _write_partitions(job, slices, pool, workers, progress)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return [job.key_prefix(k) for k in job.json_keys]


def detect_format(path: str) -> str:
    """``jsonl`` for a ``.jsonl``/``.json`` file or one whose first line is a JSON object,
    ``text`` otherwise (``--input-format`` overrides)."""
    if path.endswith((".jsonl", ".json")):
        return "jsonl"
    with contextlib.suppress(OSError), open(path, "rb") as f:
        first = next((line for line in f if line.strip()), b"")
        with contextlib.suppress(ValueError):
            return "jsonl" if isinstance(json.loads(first), dict) else "text"
    return "text"


def _merge_ranges(a: IdRange, b: IdRange) -> IdRange:
    if a is None or b is None:
        return a or b
    return min(a[0], b[0]), max(a[1], b[1])


def _write_meta(job: PreprocessJob, prefix: str, ids: IdRange) -> None:
    tok = _tokenizer(job.tokenizer)
    write_meta(prefix, describe(prefix, min_token_id=None if ids is None else ids[0],
                                max_token_id=None if ids is None else ids[1],
                                vocab_size=tok.vocab_size,
                                tokenizer_type=job.tokenizer.tokenizer_type))


def _check_input(job: PreprocessJob) -> None:
    if not os.path.isfile(job.input):
        raise DataError(f"{job.input}: input file not found; pass an existing JSONL or text file "
                        "as --input")
    try:
        with open(job.input, "rb"):
            pass
    except OSError as exc:
        raise DataError(f"{job.input}: cannot read the input ({exc.strerror}); pass a "
                        "readable JSONL or text file as --input") from None
    if job.input_format not in INPUT_FORMATS:
        raise ConfigError(f"--input-format {job.input_format!r} is unknown; give one of "
                          f"{', '.join(INPUT_FORMATS)}")
    if job.input_format == "text" and job.json_keys != ("text",):
        raise ConfigError(f"--json-keys {' '.join(job.json_keys)} applies to JSONL input, but "
                          f"{job.input} is read as plain text (one document per line); drop "
                          "--json-keys or pass --input-format jsonl")
    repeated = sorted({k for k in job.json_keys if job.json_keys.count(k) > 1})
    if repeated:
        raise ConfigError(f"--json-keys names {repeated[0]!r} twice; each key writes one "
                          "dataset, so list it once")


def _token_dtype(job: PreprocessJob, tok: Tokenizer) -> np.dtype:
    """``job.dtype`` (default: the narrowest for the vocabulary); it must hold every id."""
    dtype = np.dtype(job.dtype or best_dtype(tok.vocab_size))
    if tok.vocab_size - 1 > np.iinfo(dtype).max:
        raise ConfigError(f"--dtype {dtype} holds ids up to {np.iinfo(dtype).max}, but the "
                          f"tokenizer has {tok.vocab_size} ids; pass --dtype int32 or leave "
                          "--dtype out")
    if job.append_eod and not 0 <= tok.eod < tok.vocab_size:
        raise ConfigError(f"the tokenizer's end-of-document id {tok.eod} is outside its "
                          f"vocabulary [0, {tok.vocab_size}); fix the tokenizer files or drop "
                          "--append-eod")
    return dtype


def _results(job: PreprocessJob, slices: list[tuple[int, int]],
             pool: ProcessPoolExecutor | None, workers: int) -> Iterator[_ChunkResult]:
    """Chunk results in input order.

    At most ``_WINDOW_PER_WORKER`` chunks per worker are in flight, so memory stays bounded
    when one chunk is slow; a worker that dies raises ``BrokenProcessPool`` instead of hanging.
    """
    chunks = (_Chunk(job, a, b) for start, end in slices
              for a, b in line_aligned_bounds(job.input, start, end, job.chunk_bytes))
    if pool is None:
        yield from map(_tokenize_chunk, chunks)
        return
    window = _WINDOW_PER_WORKER * workers
    pending: deque[Future] = deque()
    for chunk in chunks:
        pending.append(pool.submit(_tokenize_chunk, chunk))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _write(job: PreprocessJob, results: Iterator[_ChunkResult], prefixes: list[str],
           progress: Progress | None) -> None:
    with contextlib.ExitStack() as stack:
        builders = [stack.enter_context(IndexedDatasetBuilder(p, np.dtype(job.dtype)))
                    for p in prefixes]
        ranges: dict[str, IdRange] = dict.fromkeys(job.json_keys)
        for result in results:
            for key, builder in zip(job.json_keys, builders, strict=True):
                builder.add_documents(result.tokens[key], result.lengths[key])
                ranges[key] = _merge_ranges(ranges[key], result.id_ranges[key])
            if progress is not None:
                progress(result.documents, result.nbytes)
        for builder in builders:
            builder.finalize()
    for key, prefix in zip(job.json_keys, prefixes, strict=True):
        _write_meta(job, prefix, ranges[key])


def _write_partitions(job: PreprocessJob, slices: list[tuple[int, int]],
                      pool: ProcessPoolExecutor | None, workers: int,
                      progress: Progress | None) -> None:
    parts: list[list[str]] = []
    for p, bounds in enumerate(slices):
        suffix = f"_part{p}of{len(slices)}"
        prefixes = [job.key_prefix(k, suffix) for k in job.json_keys]
        marker = f"{job.output_prefix}{suffix}.done"
        stamp = _stamp(job, bounds)
        if _marker_matches(marker, stamp, prefixes):
            logger.info("reusing finished partition %d of %d", p + 1, len(slices))
            if progress is not None:
                progress(0, bounds[1] - bounds[0])
        else:
            _write(job, _results(job, [bounds], pool, workers), prefixes, progress)
            with open(marker, "w") as f:
                json.dump(stamp, f, sort_keys=True)
        parts.append(prefixes)
    for k, key in enumerate(job.json_keys):
        merge_datasets([prefixes[k] for prefixes in parts], job.key_prefix(key))
        ranges = [_id_range(read_meta(prefixes[k])) for prefixes in parts]
        _write_meta(job, job.key_prefix(key), functools.reduce(_merge_ranges, ranges))
    for p, prefixes in enumerate(parts):
        for prefix in prefixes:
            os.remove(data_file_path(prefix))
            os.remove(index_file_path(prefix))
            os.remove(meta_file_path(prefix))
        os.remove(f"{job.output_prefix}_part{p}of{len(slices)}.done")


def _stamp(job: PreprocessJob, bounds: tuple[int, int]) -> dict:
    stat = os.stat(job.input)
    return {"input": os.path.abspath(job.input), "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns, "range": list(bounds),
            "job": {k: v for k, v in dataclasses.asdict(job).items() if k != "chunk_bytes"}}


def _id_range(meta: DatasetMeta | None) -> IdRange:
    assert meta is not None  # _marker_matches or _write made it
    return None if meta.min_token_id is None else (meta.min_token_id, meta.max_token_id)


def _marker_matches(marker: str, stamp: dict, prefixes: list[str]) -> bool:
    if not all(os.path.isfile(index_file_path(p)) and read_meta(p) for p in prefixes):
        return False
    try:
        with open(marker) as f:
            return json.load(f) == json.loads(json.dumps(stamp, sort_keys=True))
    except (OSError, ValueError):
        return False
