"""The tools keep pretrain_gpt.py's promise: bad input exits 2 with one ``error:`` line.

Each tool's ``main(argv)`` runs in-process on bad input; stderr must be exactly one line
starting with ``error: `` (no usage block, no traceback) naming what is wrong.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from megatron3d.cli.common import OneLineParser, add_float, add_int, run_tool
from megatron3d.config.ranges import NON_NEGATIVE, SIZE
from megatron3d.data.prep.indexed_builder import IndexedDatasetBuilder
from megatron3d.errors import ConfigError, DataError, TrainingError
from megatron3d.resilience.hang_dump import DATA_MARKER
from tests.helpers.tools import load_tool

NAMES = ("preprocess_data", "train_tokenizer", "prepare_data_cache", "hang_report",
         "stdlib_corpus", "plan_topology")


def tool(name: str) -> ModuleType:
    return load_tool(f"{name}.py")


@pytest.fixture(autouse=True)
def workdir(tmp_path, monkeypatch):
    """Small inputs in a fresh working directory: a JSONL corpus, a file where a directory
    would go, a directory, a token dataset and a float one."""
    monkeypatch.chdir(tmp_path)
    root, before = logging.getLogger(), list(logging.getLogger().handlers)
    Path("c.jsonl").write_text('{"text": "1 2 3"}\n{"text": "4 x"}\n')
    Path("list.jsonl").write_text("[1, 2]\n")
    Path("empty.jsonl").write_text("")
    Path("f").write_text("a file")
    Path("bad.model").write_text("not a model")
    Path("d").mkdir()
    for prefix, dtype in (("tokens", np.uint16), ("floats", np.float64)):
        with IndexedDatasetBuilder(prefix, dtype) as builder:
            builder.add_document(np.arange(40) % 7)
            builder.finalize()
    yield
    for handler in [h for h in root.handlers if h not in before]:  # the tools' setup_logging
        root.removeHandler(handler)  # bound them to this test's captured streams


PRE = ["--output-prefix", "o", "--no-progress", "--input", "c.jsonl"]
NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "10"]
TOK = ["--input", "c.jsonl", "--model-prefix", "tok"]
CACHE = ["--data-path", "tokens", "--seq-length", "8", "--train-samples", "4",
         "--global-batch-size", "2"]

PLAN = ["--nodes", "1", "--gpus-per-node", "4", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "203",
        "--global-batch-size", "8"]

CASES = [
    ("preprocess_data", [*PRE, *NULL, "--workers", "0"], "--workers='0'): expected a whole "
     "number >= 1"),
    ("preprocess_data", [*PRE, *NULL, "--partitions", "0"], "--partitions='0'"),
    ("preprocess_data", [*PRE, *NULL, "--chunk-mb", "nan"], "--chunk-mb='nan'): expected a "
     "finite number > 0"),
    ("preprocess_data", [*PRE, *NULL, "--chunk-mb=inf"], "--chunk-mb='inf'"),
    ("preprocess_data", [*PRE, "--tokenizer-type", "NullTokenizer", "--vocab-size", "-3"],
     "--vocab-size='-3'): expected a whole number in [1, 2147483647]"),
    ("preprocess_data", [*PRE, *NULL, "--worker", "2"], "(--worker=2): did you mean --workers?"),
    ("preprocess_data", [*PRE, *NULL, "--workers"], "write it as '--workers INT'"),
    ("preprocess_data", [*PRE, *NULL, "--no-progress=yes"], "--no-progress is a switch"),
    ("preprocess_data", ["--output-prefix", "o", *NULL], "required: --input"),
    ("preprocess_data", [*PRE, "--tokenizer-type", "Null"], "invalid choice: 'Null'"),
    ("preprocess_data", [*PRE, "--tokenizer-type", "NullTokenizer"], "needs --vocab-size"),
    ("preprocess_data", [*PRE, *NULL, "--vocab-file", "v.json"], "does not use --vocab-file"),
    ("preprocess_data", [*PRE, "--tokenizer-type", "SentencePieceTokenizer",
                         "--tokenizer-model", "none.model"], "'none.model': file not found"),
    ("preprocess_data", [*PRE, "--tokenizer-type", "SentencePieceTokenizer",
                         "--tokenizer-model", "bad.model"], "is not a SentencePiece model"),
    ("preprocess_data", [*NULL, "--input", "none.jsonl", "--output-prefix", "o"],
     "none.jsonl: input file not found"),
    ("preprocess_data", [*NULL, "--input", "c.jsonl", "--output-prefix", "f/o"],
     "f is a file, not a directory"),
    ("preprocess_data", [*NULL, "--input", "c.jsonl", "--output-prefix", "d/"],
     "names a directory"),
    ("preprocess_data", [*PRE, *NULL, "--json-keys", "text", "text"], "'text' twice"),
    ("preprocess_data", [*PRE, *NULL, "--input-format", "xml"], "invalid choice: 'xml'"),
    ("preprocess_data", [*PRE, *NULL, "--input-format", "text", "--json-keys", "title"],
     "--json-keys title applies to JSONL input"),
    ("preprocess_data", [*PRE, "--tokenizer-type", "NullTokenizer", "--vocab-size", "70000",
                         "--dtype", "uint16"], "--dtype uint16 holds ids up to 65535"),
    ("preprocess_data", [*PRE, *NULL], "the line at byte 18: NullTokenizer: word 'x'"),
    ("train_tokenizer", [*TOK, "--vocab-size", "0"], "--vocab-size='0'"),
    ("train_tokenizer", [*TOK, "--character-coverage", "nan"], "in [0.98, 1.0]"),
    ("train_tokenizer", [*TOK, "--max-pieces", "-1"], "--max-pieces='-1'"),
    ("train_tokenizer", [*TOK, "--model-type", "bpe", "--vocab-size", "1e3"], "'1e3'"),
    ("train_tokenizer", ["--input", "none.txt", "--model-prefix", "tok"], "none.txt: input "
     "file not found"),
    ("train_tokenizer", ["--input", "c.jsonl", "--model-prefix", "f/tok"], "f is a file"),
    ("train_tokenizer", ["--input", "list.jsonl", "--model-prefix", "tok"], "list.jsonl:1: no "
     "string value for key 'text'"),
    ("train_tokenizer", ["--input", "empty.jsonl", "--model-prefix", "tok"], "no text to "
     "train on"),
    ("prepare_data_cache", [*CACHE, "--seq-length", "0"], "--seq-length='0'"),
    ("prepare_data_cache", [*CACHE, "--train-samples", "-5"], "--train-samples='-5'"),
    ("prepare_data_cache", [*CACHE, "--seed", "-1"], "--seed='-1'"),
    ("prepare_data_cache", [*CACHE, "--eval-iters", "nan"], "--eval-iters='nan'"),
    ("prepare_data_cache", [*CACHE, "--train-iters", "3"], "not allowed with argument"),
    ("prepare_data_cache", [*CACHE[:-2]], "required: --global-batch-size"),
    ("prepare_data_cache", [*CACHE, "--rampup-batch-size", "1", "3", "8"], "rampup"),
    ("prepare_data_cache", [*CACHE, "--data-cache-path", "f"], "--data-cache-path 'f' is a "
     "file"),
    ("prepare_data_cache", [*CACHE, "--split", "abc"], "invalid split"),
    ("prepare_data_cache", [*CACHE, "--data-path", "tokns.idx"], "no dataset at data prefix "
     "'tokns' (tokns.idx not found; nearest existing: tokens)"),
    ("prepare_data_cache", [*CACHE, "--data-path", "floats"], "floats.idx: dtype float64 is "
     "not a token dtype"),
    ("prepare_data_cache", CACHE[2:], "exactly one of"),
    ("hang_report", [], "required: dump_dir"),
    ("hang_report", ["f"], "f is not a directory"),
    ("hang_report", ["d"], "no readable rank-XXXXX.txt dump in d"),
    ("hang_report", ["d", "extra"], "unexpected value on the command line ('extra')"),
    ("stdlib_corpus", ["--output", "d"], "--output 'd' names a directory"),
    ("stdlib_corpus", ["--output", "f/c.jsonl"], "f is a file"),
    ("stdlib_corpus", ["--output", "c.jsonl", "--max-mb", "nan"], "--max-mb='nan'"),
    ("stdlib_corpus", ["--output", "c.jsonl", "--max-mb", "-1"], "--max-mb='-1'"),
    ("stdlib_corpus", ["--outptu", "c.jsonl"], "required: --output"),
    ("plan_topology", PLAN[2:], "required: --nodes"),
    ("plan_topology", [*PLAN, "--nodes", "0"], "--nodes='0'): expected a whole number in "
     "[1, 65536]"),
    ("plan_topology", [*PLAN, "--gpu-memory-gb", "nan"], "--gpu-memory-gb='nan'"),
    ("plan_topology", [*PLAN, "--inter-node-gbps=-1"], "--inter-node-gbps='-1'"),
    ("plan_topology", [*PLAN, "--tp"], "write it as '--tp INT'"),
    ("plan_topology", [*PLAN, "--top", "-1"], "--top='-1'"),
    ("plan_topology", [*PLAN, "--json=yes"], "--json is a switch"),
    ("plan_topology", [*PLAN, "--hidden-size", "x"], "(--hidden-size='x')"),
    ("plan_topology", [*PLAN, "--nodez", "2"], "(--nodez=2): not a megatron3d flag"),
    ("plan_topology", [*PLAN, "--tp", "2", "--tensor-model-parallel-size", "2"],
     "--tp and --tensor-model-parallel-size both fix one size"),
    ("plan_topology", [*PLAN, "--num-layers-per-virtual-pipeline-stage", "1"],
     "fix the chunks with --virtual-pipeline-model-parallel-size"),
    ("plan_topology", [*PLAN[:-6], "--data-path", "tokens", "--tokenizer-type",
                       "NullTokenizer"], "the plan needs the vocabulary size"),
    ("plan_topology", [*PLAN, "--gpu-memory-gb", "1e300"], "--gpu-memory-gb='1e300'): "
     "expected a finite number in (0, 1048576]"),
    ("plan_topology", [*PLAN, "--gpu-peak-tflops", "1e300"], "--gpu-peak-tflops='1e300'"),
    ("plan_topology", [*PLAN, "--nodes", str(10**12)], "--nodes='1000000000000'): expected "
     "a whole number in [1, 65536]"),
    ("plan_topology", [*PLAN, "--gpus-per-node", str(10**6)], "--gpus-per-node='1000000'"),
    ("plan_topology", PLAN[:4], "the plan needs the model: pass --num-layers, --hidden-size, "
     "--num-attention-heads and --seq-length (missing: --num-layers, --hidden-size, "
     "--num-attention-heads, --seq-length)"),
    ("plan_topology", [*PLAN[:4], "--num-layers", "2"], "(missing: --hidden-size"),
]


@pytest.mark.parametrize(("name", "argv", "expected"), CASES,
                         ids=[f"{c[0]}:{' '.join(c[1][-2:])}" for c in CASES])
def test_bad_input_exits_2_with_one_error_line(capsys, name, argv, expected):
    code = tool(name).main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("error: ") and expected in err, err


def test_nothing_is_written_for_refused_input(capsys):
    tool("preprocess_data").main([*PRE, *NULL])
    tool("stdlib_corpus").main(["--output", "out.jsonl", "--max-mb", "1e-9"])
    assert "error: --max-mb 1e-09 is below the first standard-library file" in \
        capsys.readouterr().err
    assert not list(Path().glob("o_*")) and not Path("out.jsonl").exists()


@pytest.mark.parametrize("name", NAMES)
def test_help_prints_and_exits_0(capsys, name):
    with pytest.raises(SystemExit) as info:
        tool(name).main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--help" in out


def test_good_input_still_works(capsys):
    Path("ids.jsonl").write_text("".join(json.dumps({"text": f"{i} {i + 1}"}) + "\n"
                                         for i in range(8)))
    assert tool("preprocess_data").main([*NULL, "--input", "ids.jsonl", "--output-prefix",
                                         "new/ids", "--workers", "1", "--chunk-mb", "1e-5",
                                         "--no-progress"]) == 0
    assert Path("new/ids_text_document.idx").is_file()
    out, err = capsys.readouterr()
    assert err == "" and out.splitlines()[-1].startswith(
        "wrote new/ids_text_document.bin/.idx from jsonl input in ")
    assert out.splitlines()[-1].endswith(": 8 documents, 16 tokens, dtype uint16")


@pytest.mark.parametrize(("error", "code"), [(DataError, 2), (TrainingError, 1)])
def test_run_tool_prints_one_line(capsys, error, code):
    def body(argv):
        raise error(f"went wrong\nfor {argv}")
    assert run_tool(body, ["x"]) == code
    assert capsys.readouterr().err == "error: went wrong for ['x']\n"


def test_number_flags_name_flag_value_and_range():
    parser = OneLineParser()
    add_int(parser, "--size", SIZE, "A size.", default=4)
    add_float(parser, "--rate", NON_NEGATIVE, "A rate.", default=0.0)
    args = parser.parse(["--size", "1_024", "--rate", "0"])
    assert (args.size, args.rate) == (1024, 0.0)
    for argv, message in [
        (["--size", "2.0"], "(--size='2.0'): expected a whole number in [1, 1048576]"),
        (["--size=1048577"], "(--size='1048577')"),
        (["--size", "9" * 400], "(--size='999"),
        (["--rate=-1e-3"], "(--rate='-1e-3'): expected a finite number >= 0"),
        (["--rate", "-1"], "(--rate='-1')"),
        (["--rate", "1e400"], "(--rate='1e400')"),
        (["--rate=-inf"], "(--rate='-inf')"),
    ]:
        with pytest.raises(ConfigError) as info:
            parser.parse(argv)
        assert str(info.value).startswith(f"invalid value on the command line {message}")
    with pytest.raises(ConfigError, match="starts with .-. to its flag: write --rate=-1e-3"):
        parser.parse(["--rate", "-1e-3"])
    assert "A size. Default: 4. Allowed: [1, 1048576]." in parser.format_help()


OP = {"seq": 0, "kind": "all_reduce", "group": "dp", "ranks": [0, 1], "group_seq": 0,
      "peer": None, "shape": [4], "dtype": "float32", "iteration": 3, "program": 0,
      "step": None, "instruction": "F0", "tag": None, "completed": False}
DUMP = {"rank": 0, "world_size": 2, "job": "j", "written": 1.0, "iteration": 3,
        "sizes": {"tp": 1, "pp": 1, "dp": 2}, "coords": {"tp": 0, "pp": 0, "dp": 0},
        "main_stack": ["loop.py:1 in run"], "phase": "train", "reason": "stall", "ops": [OP]}


def _op(**changes) -> dict:
    return {**DUMP, "ops": [{**OP, **changes}]}


@pytest.mark.parametrize(("data", "why"), [
    ({}, "field 'rank'"), ({"rank": 0, "job": "", "world_size": 1}, "field 'written'"),
    ([1, 2], "has dump format list"), ({**DUMP, "ops": [{"seq": "x"}]}, "ops[0] field 'seq'"),
    ({**DUMP, "world_size": 2**40, "sizes": {"tp": 1, "pp": 1, "dp": 2**40}},
     "world_size 1099511627776 is not in [1, 1048576]"),
    ({**DUMP, "rank": 5}, "rank 5 is outside world_size 2"),
    ({**DUMP, "sizes": {}}, "sizes {} are not tp, pp, dp"),
    ({**DUMP, "sizes": {"tp": 0, "pp": 1, "dp": 2}}, "are not tp, pp, dp multiplying"),
    (_op(ranks=["a", 1]), "ops[0] names a rank outside world_size 2"),
    (_op(ranks=[0, 7]), "ops[0] names a rank outside"), (_op(ranks=[{}]), "names a rank"),
    (_op(kind="send"), "(or no peer)"), (_op(kind="recv", peer=9), "names a rank outside"),
    (_op(shape=[[1]]), "ops[0] has a shape or tag"), (_op(tag=[{}, []]), "a shape or tag"),
    ({k: v for k, v in DUMP.items() if k != "phase"}, "field 'phase'"),
], ids=["empty", "no ops", "not an object", "damaged op", "2**40 ranks", "rank outside",
        "no sizes", "tp 0", "rank text", "rank outside", "rank object", "send without peer",
        "peer outside", "nested shape", "tag objects", "no phase"])
def test_a_damaged_hang_dump_is_skipped_with_its_reason(capsys, data, why):
    from megatron3d.resilience.hang_dump import FORMAT

    payload = {"format": FORMAT, **data} if isinstance(data, dict) else data
    Path("d/rank-00000.txt").write_text(f"{DATA_MARKER}\n{json.dumps(payload)}\n")
    assert tool("hang_report").main(["d"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no readable rank-XXXXX.txt dump in d (skipped rank-00000.txt")
    assert len(err.splitlines()) == 1 and "Traceback" not in err and why in err, err


def test_a_hang_dump_that_is_not_a_regular_file_is_skipped(capsys):
    os.mkfifo("d/rank-00001.txt")  # reading it would block forever
    Path("d/rank-00000.txt").write_text(f"{DATA_MARKER}\n{json.dumps({'format': 2, **DUMP})}\n")
    assert tool("hang_report").main(["d"]) == 0
    out = capsys.readouterr().out
    assert "skipped rank-00001.txt: not a regular file" in out and "1 of 2 ranks" in out


def test_plan_topology_ranks_layouts_and_writes_json(capsys):
    assert tool("plan_topology").main([*PLAN, "--micro-batch-size", "2", "--tp", "2",
                                       "--top", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("model: ") and "cluster: 1 nodes x 4 GPUs" in out[0]
    header = next(i for i, line in enumerate(out) if line.split()[:3] == ["#", "TP", "SP"])
    assert len(out) == header + 4  # --top 3 rows
    assert out[header + 1].split()[:2] == ["1", "2"] and out[header + 1].endswith("feasible")
    assert tool("plan_topology").main([*PLAN, "--micro-batch-size", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    keys = {"tp", "pp", "dp", "micro_batch_size", "zero_stage", "checkpoint_activations",
            "sequence_parallel", "feasible", "reason", "memory_gb", "peak_phase", "phases_gb",
            "parts_gb", "iteration_s", "tflops_per_gpu"}
    assert rows and all(keys <= set(row) for row in rows)
    assert {row["micro_batch_size"] for row in rows} == {2}
    assert rows[0]["feasible"] and rows[-1]["memory_gb"] is None  # refused: nothing judged
    assert {row["sequence_parallel"] for row in rows} == {False, True}  # enumerated with TP


def test_plan_topology_fixes_sequence_parallelism_and_keeps_the_headroom(capsys):
    assert tool("plan_topology").main([*PLAN, "--micro-batch-size", "2", "--tp", "2",
                                       "--sequence-parallel", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {row["sequence_parallel"] for row in rows} == {True}
    need = min(row["memory_gb"] for row in rows if row["memory_gb"] is not None)
    for headroom, feasible in (("0", True), ("0.5", False)):
        assert tool("plan_topology").main([
            *PLAN, "--micro-batch-size", "2", "--tp", "2", "--sequence-parallel", "--json",
            "--gpu-memory-gb", str(need * 1.001), "--memory-headroom", headroom]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert any(row["feasible"] for row in rows) == feasible
