"""Damaged ``latest`` and ``meta.json``: resuming refuses them with one line, loads them only
when they still describe a position a run could have saved, and changes no file.

``latest``: random bytes, non-digits, huge numbers, an empty file, a directory. ``meta.json``:
every field (and nested field) replaced by random JSON of any shape or type, deleted, the
document replaced, invalid UTF-8, truncated. Most examples load in-process (see
``checkpoints.load``); a handful go through ``pretrain_gpt.main`` for the exit code and stderr.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

import pretrain_gpt
from megatron3d.checkpoint.loading import with_checkpoint_args
from megatron3d.cli.arguments import parse_args
from megatron3d.errors import Megatron3dError
from megatron3d.validation import validate
from tests.fuzz.checkpoints import (
    ITER_DIR,
    RESUME_ITERS,
    copy_of,
    load,
    process_group,
    sane,
    save_valid_checkpoint,
)
from tests.fuzz.common import Labelled, assert_main_refuses, attempt, fuzz, tree_digest
from tests.helpers.tiny import train_argv


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_valid_checkpoint(tmp_path_factory)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=8)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([0, 1, -1, 2**31, 2**53, 2**62, 2**63, 2**64, 10**30, 1e400, -0.0, 0.5,
                      "3"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=6,
)
NUMBERS = (st.integers(-2**64, 2**64) | st.floats(allow_nan=True, allow_infinity=True)
           | st.sampled_from([0, -1, 1, 3, 2**62, 2**63 - 1, 2**63, -2**63, 1e308]))
_NUMBERS = ["iteration", "consumed_samples", "consumed_tokens", "adam_step", "world_size",
            "tp", "pp", "dp", "zero_stage"]
_DIGITS = st.integers(0, 10**40).map(str) | st.just("9" * 5000) | st.just("0" * 30 + "3")


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path in a JSON document (what the mutations can replace or delete)."""
    if not isinstance(value, dict):
        return []
    found = []
    for key, inner in value.items():
        found.append((*prefix, key))
        found += _paths(inner, (*prefix, key))
    return found


@st.composite
def _meta_mutation(draw: st.DrawFn, meta: dict) -> Labelled:
    """The bytes of a damaged meta.json, labelled with the damage."""
    kind = draw(st.sampled_from(["set", "set", "set", "number", "number", "delete",
                                 "document", "truncate", "bytes"]))
    text = json.dumps(meta, indent=1, sort_keys=True).encode()
    if kind == "number":  # the fields a resumed run computes with, at their edges
        changed = json.loads(text)
        key = draw(st.sampled_from(_NUMBERS))
        parent = changed["layout"] if key in changed["layout"] else changed
        parent[key] = draw(NUMBERS)
        return Labelled(f"set {key} = {parent[key]!r}", json.dumps(changed).encode())
    if kind == "document":
        value = draw(JSON)
        return Labelled(f"document {value!r}", json.dumps(value).encode())
    if kind == "truncate":
        at = draw(st.integers(0, len(text) - 1))
        return Labelled(f"truncated at {at}", text[:at])
    if kind == "bytes":
        raw = draw(st.binary(max_size=64) | st.just(b'{"iteration": "\xff\xfe"}'))
        return Labelled(f"bytes {raw!r}", raw)
    main = [(k,) for k in meta] + [("layout", k) for k in meta["layout"]]
    path = draw(st.sampled_from(main) | st.sampled_from(_paths(meta)))  # top level: often
    changed = json.loads(text)
    parent = changed
    for key in path[:-1]:
        parent = parent[key]
    if kind == "delete":
        del parent[path[-1]]
        return Labelled(f"delete {path}", json.dumps(changed).encode())
    parent[path[-1]] = draw(JSON)
    return Labelled(f"set {path} = {parent[path[-1]]!r}", json.dumps(changed).encode())


def _write_latest(root: Path, content: bytes | None) -> None:
    latest = root / "latest"
    latest.unlink()
    if content is None:  # a directory where the file should be
        latest.mkdir()
        (latest / "3").write_text("3\n")
    else:
        latest.write_bytes(content)


_LATEST = (st.binary(max_size=24) | st.text(max_size=12).map(str.encode)
           | _DIGITS.map(str.encode) | st.sampled_from([b"", b"\n", b"-3", b" 3 ", b"3.0",
                                                       b"0x3", b"\xd9\xa3", b"\xb2", b"3\x00"])
           | st.none())


def _names_the_saved_iteration(content: bytes | None) -> bool:
    """The format: ASCII digits (surrounding whitespace allowed) naming iteration 3."""
    try:
        text = content.decode("ascii").strip() if content is not None else ""
    except UnicodeDecodeError:
        return False
    return text.isdigit() and text.lstrip("0") == "3"


def test_a_damaged_latest_is_refused_with_one_line(checkpoint: Path, tmp_path: Path) -> None:
    with process_group() as state:

        @fuzz(max_examples=80)
        @given(content=_LATEST)
        def check(content: bytes | None) -> None:
            root = copy_of(checkpoint, tmp_path)
            _write_latest(root, content)
            before = tree_digest(root)
            loaded, err = load(root, state)
            event("loaded" if loaded else "refused")
            assert loaded == _names_the_saved_iteration(content), f"latest={content!r}: {err}"
            assert tree_digest(root) == before

        check()


def test_a_damaged_meta_json_is_refused_with_one_line(checkpoint: Path, tmp_path: Path) -> None:
    meta = json.loads((checkpoint / ITER_DIR / "meta.json").read_text())
    with process_group() as state:

        @fuzz(max_examples=300)
        @given(mutation=_meta_mutation(meta))
        def check(mutation: Labelled) -> None:
            text = mutation.data
            root = copy_of(checkpoint, tmp_path)
            (root / ITER_DIR / "meta.json").write_bytes(text)
            before = tree_digest(root)
            loaded, err = load(root, state)
            event("loaded" if loaded else f"refused: {str(err).split(' (')[0][-40:]}")
            if loaded:
                assert sane(json.loads(text)), f"loaded an impossible position: {text[:300]!r}"
            assert tree_digest(root) == before

        check()


def _meta_field(key: str, value: Any) -> Callable[[Path], None]:
    """A damage that sets one field of the valid meta.json."""
    def damage(root: Path) -> None:
        path = root / ITER_DIR / "meta.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))
    return damage


def _file(name: str, content: bytes) -> Callable[[Path], None]:
    """A damage that overwrites ``latest`` or the checkpoint's ``name``."""
    def damage(root: Path) -> None:
        (root / name if name == "latest" else root / ITER_DIR / name).write_bytes(content)
    return damage


_ENTRY_CASES: dict[str, Callable[[Path], None]] = {
    "latest of 5000 digits": _file("latest", b"9" * 5000),
    "latest random bytes": _file("latest", b"\x80\x00PK\x03"),
    "meta truncated": _file("meta.json", b'{"format_version": 1, "iter'),
    "meta negative samples": _meta_field("consumed_samples", -8),
    "meta nan adam step": _meta_field("adam_step", float("nan")),
    "latest past its bound": _file("latest", b"3" + b" " * 5000),
}


@pytest.mark.parametrize("case", list(_ENTRY_CASES))
def test_pretrain_refuses_damaged_metadata(checkpoint: Path, case: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # a stray hang dump would land here, not in the repository
    root = copy_of(checkpoint, tmp_path)
    _ENTRY_CASES[case](root)
    before = tree_digest(root)
    code = pretrain_gpt.main(train_argv("gpt2", RESUME_ITERS, "--load", str(root)))
    assert_main_refuses(code, capsys)
    assert tree_digest(root) == before


def test_use_checkpoint_args_refuses_mistyped_model_values(checkpoint: Path,
                                                           tmp_path: Path) -> None:
    """Any JSON as a saved model value: --use-checkpoint-args takes it as that flag would
    take it, or refuses it with one line (validation included), and changes no file."""
    meta = json.loads((checkpoint / ITER_DIR / "meta.json").read_text())

    @fuzz(max_examples=150)
    @given(key=st.sampled_from(sorted(meta["config"]["model"])), value=JSON)
    def check(key: str, value: Any) -> None:
        root = copy_of(checkpoint, tmp_path)
        path = root / ITER_DIR / "meta.json"
        changed = json.loads(path.read_text())
        changed["config"]["model"][key] = value
        path.write_text(json.dumps(changed))
        before = tree_digest(root)
        cfg = parse_args(train_argv("gpt2", RESUME_ITERS, "--load", str(root),
                                    "--use-checkpoint-args"))
        _, err = attempt(lambda: validate(with_checkpoint_args(cfg)[0], 1), Megatron3dError)
        event("refused" if err else "taken")
        assert tree_digest(root) == before

    check()
