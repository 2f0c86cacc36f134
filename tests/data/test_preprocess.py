"""preprocess_data: JSONL in, Megatron datasets out, the same bytes for any parallelism."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pretrain_gpt
from megatron3d.data import gpt_dataset
from megatron3d.data.indexed_dataset import IndexedDataset
from megatron3d.data.prep import preprocess as preprocess_module
from megatron3d.data.prep.corpus import stdlib_documents
from megatron3d.data.prep.preprocess import PreprocessJob, line_aligned_bounds, preprocess
from megatron3d.data.prep.tokenizer_training import train_sentencepiece
from megatron3d.data.tokenizer import TokenizerSpec, build_tokenizer
from megatron3d.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """~100 documents of stdlib code (varied lengths, unicode) and a tokenizer trained on them."""
    directory = tmp_path_factory.mktemp("corpus")
    docs = [d["text"][:3000] for d in stdlib_documents(max_bytes=2_000_000)][:300]
    docs[5] = ""  # an empty document
    path = directory / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t, "title": t[:20]}) + "\n" for t in docs))
    model = train_sentencepiece(docs, str(directory / "tok"), vocab_size=500)
    return path, docs, TokenizerSpec("SentencePieceTokenizer", tokenizer_model=model)


def job(corpus, prefix, **kw) -> PreprocessJob:
    path, _, spec = corpus
    return PreprocessJob(input=str(path), output_prefix=str(prefix), tokenizer=spec,
                         append_eod=True, chunk_bytes=20_000, **kw)


def files(prefix: str) -> tuple[bytes, bytes]:
    return Path(prefix + ".bin").read_bytes(), Path(prefix + ".idx").read_bytes()


def test_output_is_the_tokenized_documents(corpus, tmp_path):
    _, docs, spec = corpus
    (out,) = preprocess(job(corpus, tmp_path / "one"))
    assert out == str(tmp_path / "one") + "_text_document"
    ds, tok = IndexedDataset(out), build_tokenizer(spec)
    assert ds.dtype == np.uint16 and ds.num_documents == len(docs) and len(ds) == len(docs)
    for i in (0, 5, 17, len(docs) - 1):
        assert ds[i].tolist() == tok.tokenize(docs[i]) + [tok.eod]


def test_one_and_four_workers_and_partitions_give_identical_files(corpus, tmp_path):
    one = preprocess(job(corpus, tmp_path / "w1"))[0]
    four = preprocess(job(corpus, tmp_path / "w4"), workers=4)[0]
    parts = preprocess(job(corpus, tmp_path / "p3"), workers=2, partitions=3)[0]
    assert files(one) == files(four) == files(parts)
    assert sorted(p.name for p in tmp_path.iterdir() if "p3" in p.name) == [
        "p3_text_document.bin", "p3_text_document.idx", "p3_text_document.meta.json"]
    # intermediates are gone


def test_a_finished_partition_is_reused_after_a_crash(corpus, tmp_path, monkeypatch):
    real_write, calls = preprocess_module._write, []
    def crash_on_second(*args):
        calls.append(args[2])
        if len(calls) == 2:
            raise RuntimeError("killed")
        real_write(*args)
    monkeypatch.setattr(preprocess_module, "_write", crash_on_second)
    with pytest.raises(RuntimeError):
        preprocess(job(corpus, tmp_path / "r"), partitions=2)
    calls.clear()
    monkeypatch.setattr(preprocess_module, "_write", lambda *a: (calls.append(a[2]),
                                                                  real_write(*a)))
    out = preprocess(job(corpus, tmp_path / "r"), partitions=2)[0]
    assert len(calls) == 1 and "part1of2" in calls[0][0]  # only the unfinished slice
    assert files(out) == files(preprocess(job(corpus, tmp_path / "ref"))[0])


def test_several_keys_and_progress(corpus, tmp_path):
    seen = []
    outs = preprocess(job(corpus, tmp_path / "k", json_keys=("text", "title")), workers=2,
                      progress=lambda docs, nbytes: seen.append((docs, nbytes)))
    assert [Path(o).name for o in outs] == ["k_text_document", "k_title_document"]
    assert sum(d for d, _ in seen) == len(corpus[1])
    assert sum(b for _, b in seen) == corpus[0].stat().st_size


def test_bad_input_lines(corpus, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "1 2"}\n{"text": 3 4}\n')
    null = TokenizerSpec("NullTokenizer", vocab_size=10)
    base = PreprocessJob(input=str(bad), output_prefix=str(tmp_path / "o"), tokenizer=null)
    with pytest.raises(DataError, match=r"bad.jsonl: invalid JSON in the line at byte 16"):
        preprocess(base)
    bad.write_text('{"body": "1 2"}\n')
    with pytest.raises(DataError, match="has no key 'text'; pass the right --json-keys"):
        preprocess(base)
    with pytest.raises(DataError, match="input file not found"):
        preprocess(PreprocessJob(input=str(tmp_path / "none"), output_prefix="o",
                                 tokenizer=null))
    assert not list(tmp_path.glob("o*"))


@pytest.mark.parametrize(("text", "message"), [
    ("4 x", r"byte 16: NullTokenizer: word 'x' is not a token id"),
    ("4 -1", r"byte 16: NullTokenizer: token id -1 is outside \[0, 10\)"),
    ("4 10", r"byte 16: NullTokenizer: token id 10 is outside \[0, 10\)"),  # 10 is eod
    ("4 99999999999999999999", r"byte 16: NullTokenizer: token id 99999999999999999999"),
])
def test_null_tokenizer_words_must_be_ids_in_the_vocabulary(tmp_path, text, message):
    path = tmp_path / "ids.jsonl"
    path.write_text('{"text": "1 2"}\n' + json.dumps({"text": text}) + "\n")
    with pytest.raises(DataError, match=rf"ids.jsonl: the line at {message}"):
        preprocess(PreprocessJob(input=str(path), output_prefix=str(tmp_path / "o"),
                                 tokenizer=TokenizerSpec("NullTokenizer", vocab_size=10)))
    assert not list(tmp_path.glob("o*"))


class _Unchecked:
    """A tokenizer whose ids are its text, unchecked: stands for inconsistent tokenizer files."""

    vocab_size, eod = 10, 9

    def tokenize(self, text: str) -> list[int]:
        return [int(word) for word in text.split()]


@pytest.mark.parametrize("bad", [10, -1, 70_000])
def test_every_written_id_lies_in_the_vocabulary(tmp_path, monkeypatch, bad):
    """The chunk check, for any tokenizer: an id outside [0, vocab) names the id and the byte
    offset of its line, even where the dtype would silently wrap it."""
    monkeypatch.setattr(preprocess_module, "_tokenizer", lambda spec: _Unchecked())
    path = tmp_path / "ids.jsonl"
    lines = ['{"text": "1 2"}\n', '{"text": ""}\n', json.dumps({"text": f"3 {bad} 4"}) + "\n"]
    path.write_text("".join(lines))
    job = PreprocessJob(input=str(path), output_prefix=str(tmp_path / "o"), append_eod=True,
                        tokenizer=TokenizerSpec("NullTokenizer", vocab_size=1))
    with pytest.raises(DataError, match=rf"the line at byte {len(lines[0]) + len(lines[1])} "
                                        rf"gives token id {bad}, outside the tokenizer's "
                                        r"vocabulary \[0, 10\)"):
        preprocess(job)
    assert not list(tmp_path.glob("o*"))
    path.write_text('{"text": "0 8"}\n')
    assert IndexedDataset(preprocess(job)[0])[0].tolist() == [0, 8, 9]


def test_a_dtype_too_narrow_for_the_vocabulary_is_refused_before_work(tmp_path):
    path = tmp_path / "ids.jsonl"
    path.write_text('{"text": "1 2"}\n')
    job = PreprocessJob(input=str(path), output_prefix=str(tmp_path / "o"), dtype="uint16",
                        tokenizer=TokenizerSpec("NullTokenizer", vocab_size=70_000))
    with pytest.raises(ConfigError, match="--dtype uint16 holds ids up to 65535, but the "
                                          "tokenizer has 70001 ids; pass --dtype int32"):
        preprocess(job)
    assert not list(tmp_path.glob("o*"))


def test_line_aligned_bounds(tmp_path):
    path = tmp_path / "lines"
    path.write_bytes(b"aaaa\nbb\ncccccc\nd\n")
    bounds = line_aligned_bounds(str(path), 0, 17, 3)
    assert bounds == [(0, 5), (5, 8), (8, 15), (15, 17)]
    assert line_aligned_bounds(str(path), 0, 17, 100) == [(0, 17)]


def test_quickstart_tools_end_to_end(tmp_path, monkeypatch):
    """stdlib corpus -> tokenizer -> preprocess -> index caches, through the command-line
    tools; training with the same flags then finds every cache entry the tool built."""
    def tool(name, *args):
        subprocess.run([sys.executable, str(ROOT / "tools" / name), *map(str, args)],
                       check=True, capture_output=True, cwd=tmp_path)
    tool("stdlib_corpus.py", "--output", "c.jsonl", "--max-mb", "0.4")
    tool("train_tokenizer.py", "--input", "c.jsonl", "--model-prefix", "tok", "--vocab-size",
         "400")
    tool("preprocess_data.py", "--input", "c.jsonl", "--output-prefix", "c", "--append-eod",
         "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "tok.model",
         "--workers", "2", "--no-progress")
    run = ["--data-path", "c_text_document.bin", "--split", "90,10,0", "--seq-length", "32",
           "--train-iters", "6", "--global-batch-size", "4", "--eval-iters", "12"]
    tool("prepare_data_cache.py", *run)
    built = sorted((tmp_path / "index-cache").iterdir())  # valid: 48 samples, 2 epochs
    assert len(built) == 2 and not list((tmp_path / "index-cache").glob("*.lock"))

    def rebuild(*args, **kwargs):
        raise AssertionError("training rebuilt an index the tool prepared")
    monkeypatch.setattr(gpt_dataset, "build_sample_index", rebuild)
    monkeypatch.chdir(tmp_path)
    assert pretrain_gpt.main([
        *run, "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--micro-batch-size", "2", "--lr", "1e-3", "--eval-interval", "6",
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "tok.model"]) == 0
    assert sorted((tmp_path / "index-cache").iterdir()) == built
