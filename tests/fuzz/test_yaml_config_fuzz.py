"""``--config FILE``: any YAML document is either accepted, within every field's declared
range, or refused with one ``ConfigError`` line; the file is never touched.

Documents: mappings with real flag names (either spelling) and random keys, holding values of
every YAML type (huge integers, NaN and infinities, dates, lists, nested mappings); the valid
tiny run's mapping with random overrides, so that validation is reached; documents that are
no mapping; random text; invalid UTF-8. ``parse_args`` and ``validate`` run in-process; a
handful of documents go through ``pretrain_gpt.main``.
"""

from __future__ import annotations

import datetime
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import event, given
from hypothesis import strategies as st

import pretrain_gpt
from megatron3d.cli.arguments import field_specs, parse_args
from megatron3d.errors import ConfigError
from megatron3d.validation import validate
from tests.fuzz.common import (
    assert_in_declared_ranges,
    assert_main_refuses,
    attempt,
    fuzz,
    tree_digest,
)

# The tiny valid run of tests/helpers/tiny.train_argv, as a YAML mapping.
VALID = {"num-layers": 2, "hidden-size": 32, "num-attention-heads": 4, "seq-length": 16,
         "micro-batch-size": 2, "global-batch-size": 8, "train-iters": 3, "lr": 3e-3,
         "min-lr": 3e-4, "lr-decay-style": "cosine", "mock-data": True, "vocab-size": 203,
         "make-vocab-size-divisible-by": 8, "hidden-dropout": 0, "attention-dropout": 0,
         "log-interval": 1, "eval-interval": 1000, "eval-iters": 1}

_NAMES = sorted(field_specs())
KEYS = (st.sampled_from(_NAMES) | st.sampled_from(_NAMES).map(lambda n: n.replace("_", "-"))
        | st.text(max_size=10) | st.integers(-3, 3) | st.none() | st.booleans())
SCALARS = (st.none() | st.booleans() | st.integers(-2**80, 2**80) | st.text(max_size=10)
           | st.floats(allow_nan=True, allow_infinity=True)
           | st.sampled_from([0, -1, 1, 2**63, 10**400, 1e-320, "1e400", "1e-3", " 7 ", "nan",
                              "0x10", "1_000", datetime.date(2001, 1, 1)]))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=5), inner, max_size=2), max_leaves=4)


def _plausible(name: str) -> st.SearchStrategy[Any]:
    """Values of the field's own type, edges included, so that validation is reached."""
    spec = field_specs()[name]
    if spec.choices:
        element: st.SearchStrategy[Any] = st.sampled_from(spec.choices) | st.text(max_size=4)
    elif spec.kind is bool:
        element = st.booleans()
    elif spec.kind is int:
        element = st.integers(-2**70, 2**70) | st.sampled_from([0, 1, 2, -1, 2**31, 2**63])
    elif spec.kind is float:
        element = (st.floats(allow_nan=True, allow_infinity=True) | st.integers(-2**40, 2**40)
                   | st.sampled_from([10**400, -(10**309), 2**1024]))
    else:
        element = st.text(max_size=8)
    return element if spec.nargs is None else st.lists(element, min_size=1, max_size=4)


def _dump(document: Any) -> bytes:
    return yaml.safe_dump(document, allow_unicode=True).encode()


_CHANGES = st.lists(st.sampled_from(_NAMES).flatmap(
    lambda name: st.tuples(st.just(name.replace("_", "-")), _plausible(name))),
    min_size=1, max_size=3).map(dict)  # dashes, as in VALID: a change replaces its value
_TUNED = _CHANGES.map(lambda changes: {**VALID, **changes})
DOCUMENTS = st.one_of(
    _TUNED.map(_dump),
    _TUNED.map(_dump),
    st.dictionaries(KEYS, VALUES, max_size=5).map(_dump),
    st.dictionaries(st.sampled_from(_NAMES), VALUES, min_size=1, max_size=3).map(
        lambda changes: {**VALID, **changes}).map(_dump),
    VALUES.map(_dump),
    st.text(alphabet=" \n\t:-[]{},#&*!|>'\"%@`?abc019.", max_size=40).map(str.encode),
    st.binary(max_size=40),
)


def _parse_and_validate(path: str) -> None:
    cfg = parse_args(["--config", path])
    validate(cfg, 1)
    assert_in_declared_ranges(cfg)


@fuzz(max_examples=600)
@given(document=DOCUMENTS)
def test_a_config_file_is_accepted_in_range_or_refused_in_one_line(document: bytes) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "run.yaml"
        path.write_bytes(document)
        before = tree_digest(Path(directory))
        _, err = attempt(lambda: _parse_and_validate(str(path)), ConfigError)
        event("accepted" if err is None else "refused: " + " ".join(str(err).split()[:3]))
        assert tree_digest(Path(directory)) == before


_ENTRY_CASES = {
    "a list": b"- num-layers\n- 2\n",
    "invalid utf-8": b"num-layers: \xff\xfe\n",
    "unknown key": _dump({**VALID, "num-layer": 2}),
    "nan learning rate": _dump({**VALID, "lr": float("nan")}),
    "huge integer": _dump({**VALID, "train-iters": 2**70}),
    "unclosed bracket": b"num-layers: [2\n",
}


@pytest.mark.parametrize("document", list(_ENTRY_CASES.values()), ids=list(_ENTRY_CASES))
def test_pretrain_refuses_a_bad_config_file(document: bytes, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "run.yaml"
    path.write_bytes(document)
    before = tree_digest(tmp_path)
    assert_main_refuses(pretrain_gpt.main(["--config", str(path)]), capsys)
    assert tree_digest(tmp_path) == before
