"""Data checks before work: the sidecar preprocess writes, the start-up vocabulary check that
reads it (or a bounded sample), and ``--data-path`` prefixes given with a suffix or mistyped."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megatron3d.data import dataset_meta
from megatron3d.data.builder import check_sources_exist, parse_data_path
from megatron3d.data.dataset_meta import (
    check_vocabulary,
    describe,
    meta_file_path,
    read_meta,
    write_meta,
)
from megatron3d.data.indexed_dataset import IndexedDataset
from megatron3d.data.prep.indexed_builder import IndexedDatasetBuilder
from megatron3d.data.prep.preprocess import PreprocessJob, detect_format, preprocess
from megatron3d.data.tokenizer import TokenizerSpec
from megatron3d.errors import ConfigError, DataError

NULL = TokenizerSpec("NullTokenizer", vocab_size=1000)


def _dataset(prefix: str, documents: list[list[int]]) -> IndexedDataset:
    with IndexedDatasetBuilder(prefix, np.int32) as builder:
        for doc in documents:
            builder.add_document(doc)
        builder.finalize()
    return IndexedDataset(prefix)


def _text(tmp_path: Path, lines: list[str]) -> str:
    path = tmp_path / "corpus.txt"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_preprocess_records_counts_and_the_id_range_for_any_partitioning(tmp_path):
    lines = [" ".join(str(i + j) for j in range(i % 9)) for i in range(300)]  # ids grow
    path = _text(tmp_path, lines)
    metas = []
    for name, partitions in (("one", 1), ("three", 3)):
        job = PreprocessJob(input=path, output_prefix=str(tmp_path / name), tokenizer=NULL,
                            input_format="text", chunk_bytes=500)
        (out,) = preprocess(job, partitions=partitions)
        metas.append(read_meta(out))
        assert not list(tmp_path.glob(f"{name}*part*"))  # partition sidecars cleaned up
    one, three = metas
    tokens = [int(w) for line in lines if line for w in line.split()]
    documents = sum(1 for line in lines if line)
    assert (one.documents, one.tokens, one.dtype) == (documents, len(tokens), "uint16")
    assert (one.min_token_id, one.max_token_id) == (1, 303) == (min(tokens), max(tokens))
    assert (one.vocab_size, one.tokenizer_type) == (1001, "NullTokenizer")
    assert three == one


def test_a_sidecar_for_other_files_is_not_trusted(tmp_path):
    prefix = str(tmp_path / "d")
    _dataset(prefix, [[1, 2, 3]])
    write_meta(prefix, describe(prefix, min_token_id=1, max_token_id=3, vocab_size=10,
                                tokenizer_type="NullTokenizer"))
    assert read_meta(prefix).max_token_id == 3
    _dataset(prefix, [[1, 2, 3, 4]])  # rewritten by another tool: the sizes differ
    assert read_meta(prefix) is None
    Path(meta_file_path(prefix)).write_text("{not json")
    assert read_meta(prefix) is None


def test_the_sidecar_catches_ids_the_sample_cannot_see(tmp_path, monkeypatch):
    """One foreign id in 1 of 400 documents: a 4-document sample misses it; the sidecar,
    written from every id, does not."""
    monkeypatch.setattr(dataset_meta, "SAMPLE_DOCUMENTS", 4)
    prefix = str(tmp_path / "d")
    ds = _dataset(prefix, [[1, 2, 500 if i == 201 else 3] for i in range(400)])
    check_vocabulary(ds, 100, "NullTokenizer")  # sampled: documents 0, 133, 266, 399
    write_meta(prefix, describe(prefix, min_token_id=1, max_token_id=500, vocab_size=1000,
                                tokenizer_type="GPT2BPETokenizer"))
    with pytest.raises(DataError, match=r"token id 500 is outside the vocabulary of 100 .*"
                       r"records ids written by GPT2BPETokenizer with 1000 ids"):
        check_vocabulary(ds, 100, "NullTokenizer")


def test_the_sample_is_bounded_and_finds_foreign_ids(tmp_path, monkeypatch):
    monkeypatch.setattr(dataset_meta, "SAMPLE_DOCUMENTS", 8)
    monkeypatch.setattr(dataset_meta, "SAMPLE_TOKENS", 5)
    ds = _dataset(str(tmp_path / "d"), [[7] * 50 + [-4] for _ in range(100)] + [[900]])
    reads = []
    real_get = IndexedDataset.get
    monkeypatch.setattr(IndexedDataset, "get", lambda self, i, offset=0, length=None: (
        reads.append(length) or real_get(self, i, offset, length)))
    with pytest.raises(DataError, match="token id 900 .* in a sample of 8 documents at start"):
        check_vocabulary(ds, 100, "NullTokenizer")  # the last document is always read
    assert len(reads) == 8 and max(reads) == 5  # -4 sits past the 5 tokens read: unseen


def test_data_path_suffixes_are_stripped_everywhere(tmp_path):
    listing = tmp_path / "list.txt"
    listing.write_text("0.5 a.bin  # first\n0.5 dir/b.idx\n")
    assert parse_data_path(["data/c.idx"]).prefixes == ("data/c",)
    assert parse_data_path(["0.3", "a.bin", "0.7", "b"]).prefixes == ("a", "b")
    assert parse_data_path(None, str(listing)).prefixes == ("a", "dir/b")
    assert parse_data_path(["data/c.binary"]).prefixes == ("data/c.binary",)


def test_a_missing_prefix_names_the_nearest_existing_ones(tmp_path):
    for name in ("corpus_text_document", "corpus_title_document", "other"):
        _dataset(str(tmp_path / name), [[1]])
    with pytest.raises(DataError, match=r"corpus_txt_document.idx not found; nearest existing: "
                       rf"{tmp_path}/corpus_text_document, {tmp_path}/corpus_title_document\)"):
        check_sources_exist(parse_data_path([str(tmp_path / "corpus_txt_document")]))
    with pytest.raises(DataError, match=f"{tmp_path / 'empty'} holds no .idx file"):
        (tmp_path / "empty").mkdir()
        check_sources_exist(parse_data_path([str(tmp_path / "empty" / "x")]))
    check_sources_exist(parse_data_path([str(tmp_path / "other.bin")]))


def test_plain_text_gives_the_same_dataset_as_jsonl(tmp_path):
    lines = ["1 2 3", "", "4 5", "6"]
    text = _text(tmp_path, lines)
    jsonl = tmp_path / "corpus.data"
    jsonl.write_text("".join(f'{{"text": "{line}"}}\n' for line in lines if line))
    assert (detect_format(text), detect_format(str(jsonl))) == ("text", "jsonl")
    outs = [preprocess(PreprocessJob(input=path, output_prefix=str(tmp_path / name),
                                     tokenizer=NULL, input_format=fmt, append_eod=True))[0]
            for path, name, fmt in ((text, "t", "text"), (str(jsonl), "j", "jsonl"))]
    for suffix in (".bin", ".idx"):
        assert Path(outs[0] + suffix).read_bytes() == Path(outs[1] + suffix).read_bytes()
    with pytest.raises(ConfigError, match="--json-keys title applies to JSONL input"):
        preprocess(PreprocessJob(input=text, output_prefix=str(tmp_path / "k"),
                                 tokenizer=NULL, input_format="text", json_keys=("title",)))
