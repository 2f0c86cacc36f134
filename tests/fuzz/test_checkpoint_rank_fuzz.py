"""Damaged rank files: resuming refuses them with one line and changes no file.

A rank file is truncated, overwritten with random bytes, has bytes flipped, is a pickle of
other objects or a ``torch.save`` of other values, or is the valid payload with a key
deleted or set to a value of another type or shape: at the top level, in one chunk, or in the
saved RNG states. Nothing but a one-line ``Megatron3dError`` may come out of the load (the
weights-only unpickler must also never run code). Most examples load in-process (see
``checkpoints.load``); a handful go through ``pretrain_gpt.main``.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import pretrain_gpt
from tests.fuzz.checkpoints import (
    ITER_DIR,
    RESUME_ITERS,
    copy_of,
    load,
    process_group,
    save_valid_checkpoint,
)
from tests.fuzz.common import Labelled, assert_main_refuses, fuzz, tree_digest
from tests.helpers.tiny import train_argv

RANK_FILE = f"{ITER_DIR}/rank_00000.pt"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_valid_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def payload(checkpoint: Path) -> dict[str, Any]:
    return torch.load(checkpoint / RANK_FILE, weights_only=True)


_SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=6)
            | st.floats() | st.sampled_from([0, -1, 1, 2, 10**6, 2**31, 2**63]))
_TENSORS = st.builds(
    lambda shape, dtype: torch.zeros(shape, dtype=dtype),
    st.lists(st.integers(0, 5), max_size=3).map(tuple) | st.sampled_from([(512,), (5056,)]),
    st.sampled_from([torch.float32, torch.float64, torch.float16, torch.int64, torch.uint8]))
VALUES = st.recursive(_SCALARS | _TENSORS, lambda inner: (
    st.lists(inner, max_size=3) | st.lists(inner, max_size=3).map(tuple)
    | st.dictionaries(st.text(max_size=6), inner, max_size=3)), max_leaves=5)
_CHUNK_KEYS = ["name", "kind", "tp_size", "tp_rank", "split_dim", "stride", "logical_rows",
               "local_shape", "start", "end", "data"]
_RNG_PATHS = [("python",), ("python", 0), ("python", 1), ("python", 2), ("numpy",),
              ("numpy", "kind"), ("numpy", "keys"), ("numpy", "pos"), ("numpy", "has_gauss"),
              ("numpy", "cached_gaussian"), ("torch",), ("torch", "cpu"),
              ("torch", "stream:model-parallel")]


def _replace(container: Any, key: Any, value: Any, delete: bool) -> Any:
    """``container`` with ``key`` set to ``value`` (or deleted); tuples are rebuilt."""
    if isinstance(container, tuple):
        items = list(container)
        if delete:
            del items[key]
        else:
            items[key] = value
        return tuple(items)
    if delete:
        container.pop(key, None)
    else:
        container[key] = value
    return container


def _edit(payload: dict, path: tuple, value: Any, delete: bool) -> dict:
    """A deep copy of ``payload`` with the value at ``path`` replaced or deleted."""
    changed = copy.deepcopy(payload)

    def walk(node: Any, rest: tuple) -> Any:
        if len(rest) == 1:
            return _replace(node, rest[0], value, delete)
        return _replace(node, rest[0], walk(node[rest[0]], rest[1:]), False)

    return walk(changed, path)


def _saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@st.composite
def rank_file_bytes(draw: st.DrawFn, valid: bytes, payload: dict) -> Labelled:
    """The bytes of one damaged rank file, labelled with the damage."""
    kind = draw(st.sampled_from(["truncate", "random", "flip", "pickle", "save", "payload",
                                 "payload", "chunk", "chunk", "chunk", "rng", "rng"]))
    if kind == "truncate":
        at = draw(st.integers(0, len(valid) - 1))
        return Labelled(f"truncated at {at}", valid[:at])
    if kind == "random":
        data = draw(st.binary(max_size=300) | st.just(b"PK\x03\x04" + bytes(40)))
        return Labelled(f"random {data!r}", data)
    if kind == "flip":
        data, flips = bytearray(valid), []
        for _ in range(draw(st.integers(1, 4))):
            flips.append((draw(st.integers(0, len(data) - 1)), draw(st.integers(1, 255))))
            data[flips[-1][0]] ^= flips[-1][1]
        return Labelled(f"flipped (offset, xor) {flips}", bytes(data))
    if kind in ("pickle", "save"):
        value = draw(VALUES)
        if kind == "save":
            return Labelled(f"torch.save of {value!r:.200}", _saved(value))
        protocol = draw(st.integers(2, 5))
        return Labelled(f"pickle {protocol} of {value!r:.200}",
                        pickle.dumps(value, protocol=protocol))
    delete = draw(st.booleans())
    value = None if delete else draw(VALUES)
    if kind == "payload":
        path: tuple = (draw(st.sampled_from(sorted(payload))),)
    elif kind == "chunk":
        path = ("chunks", draw(st.integers(0, len(payload["chunks"]) - 1)),
                draw(st.sampled_from(_CHUNK_KEYS)))
    else:
        path = ("rng", *draw(st.sampled_from(_RNG_PATHS)))
    if delete and path[:2] == ("rng", "python") and len(path) == 3:
        delete, value = False, draw(VALUES)  # a tuple of another length is the same damage
    label = f"payload with {path} " + ("deleted" if delete else f"= {value!r:.200}")
    return Labelled(label, _saved(_edit(payload, path, value, delete)))


def test_a_damaged_rank_file_is_refused_with_one_line(checkpoint: Path, payload: dict,
                                                       tmp_path: Path) -> None:
    valid = (checkpoint / RANK_FILE).read_bytes()
    with process_group() as state:

        @fuzz(max_examples=500)
        @given(content=rank_file_bytes(valid, payload))
        def check(content: Labelled) -> None:
            root = copy_of(checkpoint, tmp_path)
            (root / RANK_FILE).write_bytes(content.data)
            before = tree_digest(root)
            load(root, state)
            assert tree_digest(root) == before

        check()


_ENTRY_CASES: dict[str, Callable[[dict], bytes]] = {
    "pickle of a list": lambda payload: pickle.dumps([1, 2, 3]),
    "save of a string": lambda payload: _saved("not a checkpoint"),
    "chunks missing": lambda payload: _saved(_edit(payload, ("chunks",), None, delete=True)),
    "chunk tp rank out of range": lambda payload: _saved(
        _edit(payload, ("chunks", 0, "tp_rank"), 7, delete=False)),
    "rng of the wrong type": lambda payload: _saved(_edit(payload, ("rng",), 5, delete=False)),
}


@pytest.mark.parametrize("case", list(_ENTRY_CASES))
def test_pretrain_refuses_a_damaged_rank_file(checkpoint: Path, payload: dict, case: str,
                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # a stray hang dump would land here, not in the repository
    root = copy_of(checkpoint, tmp_path)
    (root / RANK_FILE).write_bytes(_ENTRY_CASES[case](payload))
    before = tree_digest(root)
    code = pretrain_gpt.main(train_argv("gpt2", RESUME_ITERS, "--load", str(root)))
    assert_main_refuses(code, capsys)
    assert tree_digest(root) == before
