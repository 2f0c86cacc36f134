"""Every numeric flag, given any value, is either accepted (finite, inside the range its
field declares) or refused with one ``ConfigError`` line, never another exception.

The fields come from ``arguments.field_specs()`` (int and float kinds, the three-value
``--rampup-batch-size`` included), so a new numeric field is fuzzed without touching this
file. Each is set on the command line of the valid tiny run, written ``--flag=VALUE`` so that
negative values stay values, then ``parse_args`` and ``validate`` run in-process. Edge values
(nan, infinities, 1e400, 2**70, -1, 0, words) are tried for every field; hypothesis adds
random integers, floats and strings on top. A handful of values go through
``pretrain_gpt.main`` for the exit code and stderr.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

import pretrain_gpt
from megatron3d.cli.arguments import FieldSpec, field_specs, parse_args
from megatron3d.errors import ConfigError
from megatron3d.validation import validate
from tests.fuzz.common import assert_in_declared_ranges, assert_main_refuses, attempt, fuzz
from tests.helpers.tiny import train_argv

NUMERIC = [name for name, spec in field_specs().items()
           if spec.kind in (int, float) and not spec.choices]
EDGES = ["nan", "NaN", "inf", "-inf", "infinity", "1e400", "-1e400", "1e-400", str(2**70),
         str(-2**70), str(2**63), str(2**31 - 1), str(2**31), "-1", "0", "-0", "0.0", "1",
         "0.5", "1.0", "2", "1e3", "0x10", "1_000", " 7 ", "", "abc", "None", "true",
         "9" * 5000, "1" + "0" * 400 + ".0"]


def _argv(spec: FieldSpec, values: list[str]) -> list[str]:
    """The valid tiny run with ``spec`` set to ``values`` (one, or nargs of them)."""
    if spec.nargs is None:
        return [*train_argv("gpt2", 10), f"{spec.flag}={values[0]}"]
    return [*train_argv("gpt2", 10), spec.flag, *values]


def _check(spec: FieldSpec, values: list[str]) -> bool:
    """Whether the run accepted ``values`` (a refusal must be one ConfigError line)."""
    def run() -> None:
        cfg = parse_args(_argv(spec, values))
        validate(cfg, 1)
        assert_in_declared_ranges(cfg)

    return attempt(run, ConfigError)[1] is None


@pytest.mark.parametrize("name", NUMERIC)
def test_every_edge_value_of_every_numeric_flag(name: str) -> None:
    spec = field_specs()[name]
    for value in EDGES:
        width = 1 if spec.nargs is None else spec.nargs
        _check(spec, [value] * width)


_WORD = (st.integers(-2**80, 2**80).map(str) | st.floats().map(repr)
         | st.text(alphabet="0123456789.eE+-_ xa", max_size=12) | st.sampled_from(EDGES))


@fuzz(max_examples=1000)
@given(name=st.sampled_from(NUMERIC), words=st.lists(_WORD, min_size=3, max_size=3))
def test_random_values_of_numeric_flags(name: str, words: list[str]) -> None:
    spec = field_specs()[name]
    accepted = _check(spec, words[:1] if spec.nargs is None else words[:spec.nargs])
    event("accepted" if accepted else "refused")


_ENTRY_CASES = {
    "lr nan": "--lr=nan",
    "lr 1e400": "--lr=1e400",
    "seed negative": "--seed=-1",
    "layers 2**70": f"--num-layers={2**70}",
    "hidden words": "--hidden-size=abc",
    "dropout one": "--hidden-dropout=1",
    "vocabulary multiple 2**70": f"--make-vocab-size-divisible-by={2**70}",
    "timeout 2**70": f"--distributed-timeout-minutes={2**70}",
    "lr 1e30": "--lr=1e30",
    "init std 1e30": "--init-method-std=1e30",
    "loss scale 1e30": "--loss-scale=1e30",
    "skip window negative": "--max-skipped-iters-in-a-row=-1",
    **{f"{name} 0": f"--hang-{name}-timeout=0" for name in
       ("startup", "index", "load", "first-step", "save", "eval")},
}


@pytest.mark.parametrize("flag", list(_ENTRY_CASES.values()), ids=list(_ENTRY_CASES))
def test_pretrain_refuses_a_bad_numeric_flag(flag: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert_main_refuses(pretrain_gpt.main([*train_argv("gpt2", 10), flag]), capsys)
    assert list(tmp_path.iterdir()) == []  # nothing written
