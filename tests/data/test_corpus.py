"""The quickstart corpus: documents in a seeded shuffle, so that the consecutive train,
valid and test parts of ``--split`` each sample the whole standard library."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from megatron3d.data.prep.corpus import stdlib_documents
from tests.helpers.tools import load_tool, tool_logging

LIMIT = 2_000_000


def _directory(doc: dict[str, str]) -> str:
    return doc["path"].rpartition("/")[0] or "."


def test_documents_are_shuffled_with_a_fixed_seed_within_max_bytes():
    docs = list(stdlib_documents(LIMIT))
    tenth = len(docs) // 10
    assert tenth >= 5
    for part in (docs[:tenth], docs[-tenth:]):  # the ends are where --split cuts
        _, most = Counter(map(_directory, part)).most_common(1)[0]
        assert most <= len(part) / 2, [d["path"] for d in part]
    assert sum(len(d["text"].encode("utf-8")) for d in docs) <= LIMIT
    paths = [d["path"] for d in docs]
    assert [d["path"] for d in stdlib_documents(LIMIT)] == paths
    assert [d["path"] for d in stdlib_documents(LIMIT, seed=7)] != paths


def test_the_tool_writes_the_same_file_for_the_same_flags(tmp_path: Path, capsys):
    tool = load_tool("stdlib_corpus.py")
    outputs = [tmp_path / name for name in ("a.jsonl", "b.jsonl", "c.jsonl")]
    with tool_logging():
        for out, seed in zip(outputs, ("1", "1", "2"), strict=True):
            assert tool.main(["--output", str(out), "--max-mb", "0.3", "--seed", seed]) == 0
    capsys.readouterr()
    a, b, c = (out.read_bytes() for out in outputs)
    assert a == b != c
