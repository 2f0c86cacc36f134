"""The command-line tools on damaged or absurd input: a hang dump with any field replaced by
any JSON value, the chunk lists a DCP ``.metadata`` may claim, a Megatron-LM ``common.pt``'s
model arguments, and the numeric flags of the tools that do arithmetic with them
(plan_topology, generate). Each either works or refuses with one line (exit 2), never a
traceback, and never runs away with memory or time.

In-process calls of each tool's ``main`` (or the function it trusts), milliseconds per
example; the chunk checker is compared with an element-by-element count.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from megatron3d.config import ModelConfig, TrainConfig, TrainingConfig
from megatron3d.convert.contents import model_tensors
from megatron3d.convert.megatron import args as mcore_args
from megatron3d.convert.megatron.coverage import coverage_problem
from megatron3d.convert.offline import write_checkpoint
from megatron3d.errors import ConfigError
from megatron3d.resilience.hang_dump import DATA_MARKER, FORMAT
from tests.fuzz.common import assert_in_declared_ranges, assert_main_refuses, attempt, fuzz
from tests.helpers.tiny import model_config
from tests.helpers.tools import load_tool, tool_logging
from tests.test_tools import DUMP, OP, PLAN

hang_report = load_tool("hang_report.py")
plan_topology = load_tool("plan_topology.py")
generate = load_tool("generate.py")

ODD = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                st.sampled_from([2**40, 2**63, -1, 0, 1]),
                st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
                st.lists(st.one_of(st.integers(-3, 3), st.text(max_size=2),
                                   st.lists(st.integers(0, 2), max_size=2)), max_size=3),
                st.dictionaries(st.sampled_from(["tp", "pp", "dp", "x"]),
                                st.one_of(st.integers(-2, 4), st.text(max_size=2)),
                                max_size=3))
NUMBERS = st.one_of(st.sampled_from(["nan", "inf", "1e300", "1e-300", "-1", "0", str(2**70),
                                     "1e400", "x", ""]),
                    st.integers(-2**70, 2**70).map(str),
                    st.floats(allow_nan=False).map(repr))


def _main(tool, argv: list[str], capsys) -> tuple[int, str]:
    """The exit code and stdout; a refusal must be exit 2 with one ``error:`` line."""
    capsys.readouterr()
    with tool_logging():
        code = tool.main(argv)
    if code != 0:
        assert_main_refuses(code, capsys)
        return code, ""
    return code, capsys.readouterr().out


@fuzz(400)
@given(where=st.sampled_from(sorted(DUMP) + [f"op.{k}" for k in sorted(OP)]), value=ODD)
def test_a_hang_dump_with_any_field_replaced(tmp_path_factory, capsys, where, value):
    directory = tmp_path_factory.mktemp("hang")
    first = {**DUMP, "format": FORMAT}
    if where.startswith("op."):
        first["ops"] = [{**OP, where[3:]: value}]
    else:
        first[where] = value
    second = {**DUMP, "format": FORMAT, "rank": 1, "coords": {"tp": 0, "pp": 0, "dp": 1}}
    for rank, data in enumerate((first, second)):
        (directory / f"rank-{rank:05d}.txt").write_text(f"{DATA_MARKER}\n{json.dumps(data)}\n")
    code, out = _main(hang_report, [str(directory)], capsys)
    assert code == 0 and out.startswith("hang report: "), out  # the damaged one is skipped


def _covered_once(shape: tuple[int, ...], boxes: list[tuple[tuple, tuple]]) -> bool:
    """The oracle: every chunk inside, every element counted exactly once."""
    counts = torch.zeros(shape, dtype=torch.int64)
    for offsets, sizes in boxes:
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape,
                                                              strict=True)):
            return False
        counts[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))] += 1
    return bool((counts == 1).all())


@fuzz(200)
@given(shape=st.tuples(st.integers(0, 6), st.integers(1, 5)),
       cuts=st.lists(st.tuples(st.integers(-1, 6), st.integers(-1, 5), st.integers(-1, 6),
                               st.integers(-1, 5)), max_size=6),
       tile=st.booleans(), swap=st.tuples(st.integers(0, 5), st.integers(0, 5)))
def test_chunk_coverage_agrees_with_counting_elements(shape, cuts, tile, swap):
    """Random chunk lists, and exact tilings (row bands) with one band replaced by another
    or by a random chunk: the sizes may still add up."""
    boxes = [((a, b), (c, d)) for a, b, c, d in cuts]
    if tile and shape[0]:
        bands = [((r, 0), (1, shape[1])) for r in range(shape[0])]
        i, j = swap[0] % shape[0], swap[1] % shape[0]
        bands[i] = boxes[0] if boxes else bands[j]
        boxes = bands
    chunks = [SimpleNamespace(offsets=o, sizes=s) for o, s in boxes]
    problem = coverage_problem("t", shape, chunks)
    assert (problem is None) == _covered_once(shape, boxes), (problem, boxes)


MODEL_KEYS = ["num_layers", "hidden_size", "num_attention_heads", "seq_length",
              "padded_vocab_size", "ffn_hidden_size", "max_position_embeddings",
              "norm_epsilon", "rotary_base", "init_method_std", "num_query_groups",
              "kv_channels"]


@fuzz(150)
@given(key=st.sampled_from(MODEL_KEYS), value=ODD, gqa=st.booleans())
def test_megatron_arguments_with_any_model_value(key, value, gqa):
    """A stored argument of any value: ModelConfig fields inside their declared ranges, or
    one ConfigError line."""
    base = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
            "padded_vocab_size": 128, "openai_gelu": True, "num_query_groups": 2,
            "group_query_attention": gqa}
    fields, _ = attempt(lambda: mcore_args.model_fields(argparse.Namespace(
        **{**base, key: value})), ConfigError)
    if fields is not None:
        assert_in_declared_ranges(TrainConfig(model=ModelConfig(**fields),
                                              training=TrainingConfig()))


@fuzz(25)
@given(flag=st.sampled_from(["--nodes", "--gpus-per-node", "--gpu-memory-gb",
                             "--gpu-peak-tflops", "--intra-node-gbps", "--inter-node-gbps",
                             "--top", "--tp", "--pp"]), value=NUMBERS)
def test_plan_topology_numbers(capsys, flag, value):
    code, out = _main(plan_topology, [*PLAN, f"{flag}={value}"], capsys)
    assert code == 2 or out.startswith(("model: ", "notice: ")), out


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    model = model_config("gpt2")
    root = tmp_path_factory.mktemp("tools-fuzz") / "ckpt"
    pieces = [[(p.meta.name, torch.randn(p.shape)) for p in model_tensors(model)]]
    write_checkpoint(root, TrainConfig(model=model, training=TrainingConfig()), pieces)
    return root


@fuzz(25)
@given(flag=st.sampled_from(["--temperature", "--top-k", "--max-new-tokens", "--seed"]),
       value=NUMBERS)
def test_generate_numbers(tiny_checkpoint, capsys, flag, value):
    argv = ["--load", str(tiny_checkpoint), "--prompt-ids", "1 2", f"{flag}={value}"]
    if flag != "--max-new-tokens":
        argv += ["--max-new-tokens", "2"]
    if flag == "--seed":
        argv += ["--top-k", "3"]
    code, out = _main(generate, argv, capsys)
    assert code == 2 or all(0 <= int(t) < 203 for t in out.split()), out
