"""How fast is the data pipeline? Tokenizing (1 vs N workers) and building sample indices.

1. ``tools/preprocess_data.py``'s engine on a fixed synthetic JSONL corpus (seeded Zipfian
   words, varied document lengths) with a SentencePiece tokenizer trained on it: tokens/s with
   1 worker and with N, and their ratio, measured in this invocation.
2. GPT sample-index building (per-epoch document shuffle, sample index, shuffle index) for
   10^7 documents: wall time and peak memory, in a fresh child process so its peak RSS is
   its own. Targets: under 10 s and under 2 GiB.

    python -m benchmarks.preprocess                      # 20 MB corpus, N = all cores
    python -m benchmarks.preprocess --corpus-mb 100 --workers 8 --documents 10000000
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import resource
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from megatron3d.data.indexed_dataset import IndexedDataset
from megatron3d.data.prep.preprocess import PreprocessJob, preprocess
from megatron3d.data.prep.tokenizer_training import train_sentencepiece
from megatron3d.data.sample_index import build_sample_index, num_epochs_for
from megatron3d.data.tokenizer import TokenizerSpec


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus-mb", type=float, default=20.0)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--repeats", type=int, default=2, help="runs of each, best time kept")
    p.add_argument("--documents", type=int, default=10_000_000)
    p.add_argument("--mean-doc-tokens", type=float, default=500.0)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=1)
    return p.parse_args()


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def machine() -> str:
    return (f"{platform.platform()}, {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores, Python {platform.python_version()}, numpy {np.__version__}")


def _cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (pool workers)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def synthetic_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """Seeded documents of Zipf-distributed pseudo-words; returns the number of documents."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    words = ["".join(rng.choice(letters, int(rng.integers(1, 10)))) for _ in range(20000)]
    rank_p = 1.0 / np.arange(1, len(words) + 1)
    rank_p /= rank_p.sum()
    target, written, docs = int(megabytes * 1e6), 0, 0
    with open(path, "w") as f:
        while written < target:
            n = int(rng.lognormal(5.0, 1.0)) + 1
            picks = rng.choice(len(words), n, p=rank_p)
            text = " ".join(words[i] for i in picks)
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line)
            docs += 1
    return docs


def bench_preprocess(args: argparse.Namespace, workdir: Path) -> None:
    corpus = workdir / "corpus.jsonl"
    docs = synthetic_corpus(corpus, args.corpus_mb)
    with open(corpus) as f:
        sample = [json.loads(line)["text"] for _, line in zip(range(3000), f, strict=False)]
    model = train_sentencepiece(sample, str(workdir / "tok"), args.vocab_size)
    spec = TokenizerSpec("SentencePieceTokenizer", tokenizer_model=model)
    _say(f"corpus: {docs:,} documents, {corpus.stat().st_size / 1e6:.1f} MB; "
         f"SentencePiece vocab {args.vocab_size}")
    best: dict[int, float] = {}
    cpu: dict[int, float] = {}
    for _ in range(args.repeats):  # alternate 1 and N so background load hits both alike
        for workers in sorted({1, args.workers}):
            job = PreprocessJob(input=str(corpus), output_prefix=str(workdir / f"w{workers}"),
                                tokenizer=spec, append_eod=True)
            cpu_start, start = _cpu_seconds(), time.perf_counter()
            preprocess(job, workers=workers)
            best[workers] = min(best.get(workers, float("inf")), time.perf_counter() - start)
            cpu[workers] = min(cpu.get(workers, float("inf")), _cpu_seconds() - cpu_start)
    tokens = IndexedDataset(str(workdir / "w1_text_document")).index.num_tokens
    for workers, seconds in best.items():
        _say(f"  {workers:2d} worker(s): {tokens:,} tokens in {seconds:.2f}s (best of "
             f"{args.repeats}) = {tokens / seconds:,.0f} tokens/s, "
             f"{corpus.stat().st_size / 1e6 / seconds:.1f} MB/s; CPU {cpu[workers]:.2f}s "
             "(this process and its workers)")
    _say(f"  load average while measuring: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    same = (workdir / "w1_text_document.bin").read_bytes() == \
        (workdir / f"w{args.workers}_text_document.bin").read_bytes()
    _say(f"  ratio {args.workers} workers / 1 worker: {best[1] / best[args.workers]:.2f}x "
         f"(outputs identical: {same})")


def _index_child(args: argparse.Namespace, replies) -> None:
    rng = np.random.default_rng(0)
    sizes = np.maximum(rng.lognormal(np.log(args.mean_doc_tokens) - 0.5, 1.0,
                                     args.documents), 1).astype(np.int32)
    tokens = int(sizes.sum(dtype=np.int64))
    samples = (tokens * args.epochs - 1) // args.seq_length
    epochs = num_epochs_for(tokens, args.seq_length, samples)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tracemalloc.start()
    start = time.perf_counter()
    index = build_sample_index(sizes, np.arange(len(sizes)), args.seq_length, epochs, seed=1)
    seconds = time.perf_counter() - start
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    replies.put({"tokens": tokens, "samples": len(index), "epochs": epochs,
                 "seconds": seconds, "traced_peak": traced_peak, "rss_before": rss_before,
                 "rss_peak": rss_peak,
                 "index_bytes": sum(a.nbytes for a in index.arrays().values())})


def bench_index(args: argparse.Namespace) -> None:
    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    child = ctx.Process(target=_index_child, args=(args, replies))
    child.start()
    r = replies.get()
    child.join()
    gib = 2**30
    _say(f"index: {args.documents:,} documents, {r['tokens']:,} tokens, seq {args.seq_length},"
         f" {r['epochs']} epoch(s) -> {r['samples']:,} samples")
    _say(f"  build time {r['seconds']:.2f}s (target < 10 s); peak memory while building "
         f"{r['traced_peak'] / gib:.2f} GiB allocated, process peak RSS "
         f"{r['rss_peak'] / gib:.2f} GiB (before building {r['rss_before'] / gib:.2f} GiB; "
         f"target < 2 GiB); index arrays {r['index_bytes'] / gib:.2f} GiB")


def main() -> None:
    args = _args()
    _say(f"machine: {machine()}")
    with tempfile.TemporaryDirectory(prefix="m3d_bench_") as tmp:
        bench_preprocess(args, Path(tmp))
    bench_index(args)


if __name__ == "__main__":
    main()
