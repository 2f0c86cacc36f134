"""The offline checkpoint tools on the session's checkpoints trained at (TP, PP, DP) =
(2, 2, 2) (``conftest.trained_222``): reshape carries the whole run to another layout
(training continues exactly as from the original), consolidate streams one safetensors file,
inspect_checkpoint reports the run; bad input is one line and writes nothing."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron3d.checkpoint import io
from megatron3d.checkpoint.chunks import KINDS
from megatron3d.checkpoint.reader import CheckpointReader
from megatron3d.config import TrainConfig, TrainingConfig
from megatron3d.convert.contents import Layout, model_tensors
from megatron3d.convert.offline import write_checkpoint
from tests.checkpoint.conftest import INIT, PEAK_LINE
from tests.checkpoint.test_bad_checkpoints import _tree
from tests.helpers.dist import run_distributed
from tests.helpers.runs import RunResult, merge_ranks, train
from tests.helpers.tiny import model_config, train_argv
from tests.helpers.tools import TOOLS, load_tool

reshape_tool = load_tool("checkpoint/reshape.py")
consolidate_tool = load_tool("checkpoint/consolidate.py")
inspect_tool = load_tool("checkpoint/inspect_checkpoint.py")

SAVED_AT = 3  # trained_222's last step
LAYOUT_122 = ("--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
              "--zero-stage", "1", "--pp-partition-method", "uniform")


@pytest.fixture
def trained(trained_222) -> Path:
    """GPT-2 at (2, 2, 2) with ZeRO-1, saved at step 3. Read it, never write."""
    return trained_222 / "gpt2"


def _reshape(load: Path, save: Path, tp: int, pp: int, *extra: str) -> None:
    assert reshape_tool.main(["--load", str(load), "--save", str(save),
                              "--tensor-model-parallel-size", str(tp),
                              "--pipeline-model-parallel-size", str(pp), *extra]) == 0


def _two_steps_after_load(directories: list[str]) -> list[RunResult]:
    return [train(train_argv("gpt2", SAVED_AT + 2, *LAYOUT_122, *INIT, "--load", d,
                             "--override-opt-param-scheduler"))
            for d in directories]


def test_reshape_twice_continues_exactly_like_loading_the_original(trained, tmp_path):
    once, twice = tmp_path / "tp4", tmp_path / "tp1-pp2-dp2"
    _reshape(trained, once, 4, 1)
    _reshape(once, twice, 1, 2, "--data-parallel-size", "2")
    per_rank = run_distributed(_two_steps_after_load, 4, [str(trained), str(twice)],
                               timeout_s=300)
    direct, reshaped = (merge_ranks([r[i] for r in per_rank]) for i in range(2))
    assert len(direct.losses) == 2
    # The same logical tensors and run state are loaded, so the arithmetic is the same.
    assert reshaped.losses == direct.losses and reshaped.grad_norms == direct.grad_norms
    for name, value in direct.params.items():
        assert torch.equal(reshaped.params[name], value), name


def test_reshape_carries_the_run_state_and_every_tensor(trained, tmp_path, capsys):
    out = tmp_path / "dp3"
    _reshape(trained, out, 1, 1, "--data-parallel-size", "3", "--zero-stage", "3")
    assert PEAK_LINE.search(capsys.readouterr().out.splitlines()[-1])
    source, result = CheckpointReader.latest(trained), CheckpointReader.latest(out)
    assert result.meta["layout"] == Layout(1, 1, 3, 3).as_meta()
    for key in set(source.meta) - {"layout", "config"}:  # iteration, Adam step, series, ...
        assert result.meta[key] == source.meta[key], key
    parallel = result.meta["config"]["parallel"]
    assert (parallel["tensor_model_parallel_size"], parallel["zero_stage"]) == (1, 3)
    assert sorted(result.names()) == sorted(source.names())
    for name in source.names():
        for kind in KINDS:
            assert torch.equal(result.tensor(name, kind), source.tensor(name, kind)), name
    held = [sum(c["end"] - c["start"] for c in f["chunks"]) for f in result.files]
    assert max(held) - min(held) <= 3 * len(source.names())  # ZeRO: spread evenly over DP
    assert all(f["rng"] is None for f in result.files)  # another layout: fresh streams


def _owners(reader: CheckpointReader) -> dict[tuple[int, int], set[tuple[str, int]]]:
    """(pp rank, tp rank) -> the (name, chunk's TP rank) its ranks hold (DP ranks merged)."""
    owners: dict[tuple[int, int], set[tuple[str, int]]] = {}
    layout = reader.meta["layout"]
    for rank, payload in enumerate(reader.files):
        where = (rank // (layout["tp"] * layout["dp"]), rank % layout["tp"])
        owners.setdefault(where, set()).update((c["name"], c["tp_rank"])
                                               for c in payload["chunks"])
    return owners


def test_reshape_into_the_saved_layout_places_chunks_as_training_does(trained, tmp_path):
    out = tmp_path / "same"
    _reshape(trained, out, 2, 2, "--data-parallel-size", "2")
    source, result = CheckpointReader.latest(trained), CheckpointReader.latest(out)
    assert result.meta["layout"] == source.meta["layout"]
    assert _owners(result) == _owners(source)
    for mine, saved in zip(result.files, source.files, strict=True):  # the same layout
        assert mine["rng"]["python"] == saved["rng"]["python"]
        for key, value in saved["rng"]["torch"].items():
            assert torch.equal(mine["rng"]["torch"][key], value), key


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def _without_chunks(trained: Path, into: Path, drop) -> Path:
    """A copy of ``trained`` whose rank files lost the chunks ``drop(rank, chunk)`` picks."""
    shutil.copytree(trained, into)
    for path in io.iteration_dir(into, SAVED_AT).glob("rank_*.pt"):
        payload = torch.load(path, weights_only=True)
        kept = [c for c in payload["chunks"] if not drop(payload["rank"], c)]
        torch.save({**payload, "chunks": kept}, path)
    return into


def _bad_checkpoints(trained: Path, tmp_path: Path) -> dict[str, Path]:
    """Error -> a checkpoint root the tools must refuse: none at all, a truncated rank file,
    a tensor lost from every rank file, a rank file that lost its chunks (both found from
    the chunk descriptions, before writing)."""
    empty, truncated = tmp_path / "empty", tmp_path / "truncated"
    empty.mkdir()
    shutil.copytree(trained, truncated)
    path = io.rank_file(io.iteration_dir(truncated, SAVED_AT), 5)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return {"no checkpoint in": empty, "cannot be read": truncated,
            "does not hold the model": _without_chunks(
                trained, tmp_path / "lost", lambda _, c: c["name"] == "final_norm.weight"),
            "is incomplete": _without_chunks(trained, tmp_path / "incomplete",
                                             lambda rank, _: rank == 5)}


@pytest.mark.parametrize(("sizes", "expected"), [
    (("3", "1"), "attention heads (4) are not divisible by --tensor-model-parallel-size 3"),
    (("1", "6"), "6 pipeline stages but only 5 layers"),
    (("1", "1", "--data-parallel-size", "0"), "--data-parallel-size='0'"),
    (("1", "1", "--zero-stage", "2"), "invalid choice: 2"),
    (("1", "1", "--pp-partition-method", "biggest"), "unknown pipeline partition method"),
], ids=["tp-heads", "pp-layers", "dp-zero", "zero-2", "partition-method"])
def test_reshape_refuses_a_target_the_model_cannot_take(trained, tmp_path, capsys, sizes,
                                                          expected):
    before = _tree(trained)
    argv = ["--load", str(trained), "--save", str(tmp_path / "new"),
            "--tensor-model-parallel-size", sizes[0], "--pipeline-model-parallel-size",
            *sizes[1:]]
    assert reshape_tool.main(argv) == 2
    assert expected in _one_error_line(capsys)
    assert not (tmp_path / "new").exists() and _tree(trained) == before


def test_reshape_splits_swiglu_and_grouped_query_attention_and_refuses_what_cannot_be(
        trained_222, tmp_path, capsys):
    """SwiGLU weights are split with stride 2 and key/value groups are split whole."""
    _reshape(trained_222 / "llama", tmp_path / "tp2", 2, 1, "--data-parallel-size", "2")
    source, result = (CheckpointReader.latest(d) for d in (trained_222 / "llama",
                                                           tmp_path / "tp2"))
    assert any(c["stride"] == 2 and c["tp_size"] == 2 for c in result.files[1]["chunks"])
    for name in source.names():
        for kind in KINDS:
            assert torch.equal(result.tensor(name, kind), source.tensor(name, kind)), name
    assert reshape_tool.main(["--load", str(trained_222 / "llama"), "--save",
                              str(tmp_path / "new"), "--tensor-model-parallel-size", "4",
                              "--pipeline-model-parallel-size", "1"]) == 2
    assert "key/value groups (2)" in _one_error_line(capsys)
    assert not (tmp_path / "new").exists()


def test_reshape_a_converted_checkpoint_without_adam_moments(tmp_path):
    _random_checkpoint(tmp_path / "converted", model_config("llama"))
    _reshape(tmp_path / "converted", tmp_path / "tp2", 2, 2)
    source, result = (CheckpointReader.latest(tmp_path / d) for d in ("converted", "tp2"))
    assert result.meta["adam_step"] == 0 and not result.has(source.names()[0], "exp_avg")
    for name in source.names():
        assert torch.equal(result.tensor(name), source.tensor(name)), name


def _reshape_argv(load: Path, save: Path) -> list[str]:
    return ["--load", str(load), "--save", str(save), "--tensor-model-parallel-size", "1",
            "--pipeline-model-parallel-size", "1"]


@pytest.mark.parametrize("tool", ["reshape", "consolidate", "inspect"])
def test_bad_input_is_one_line_and_writes_nothing(trained, tmp_path, capsys, tool):
    bad = _bad_checkpoints(trained, tmp_path)
    taken = tmp_path / "taken.safetensors"
    taken.write_bytes(b"keep me")
    new = tmp_path / "new"
    module, argv, refused = {
        "reshape": (reshape_tool, lambda load: _reshape_argv(load, new),
                    (_reshape_argv(trained, trained), "already holds checkpoints")),
        "consolidate": (consolidate_tool, lambda load: ["--load", str(load), "--output", str(new)],
                        (["--load", str(trained), "--output", str(taken)], "already exists")),
        "inspect": (inspect_tool, lambda load: ["--load", str(load), "--tensors"],
                    (["--load", str(tmp_path / "missing")], "no checkpoint in")),
    }[tool]
    cases = [(argv(load), why) for why, load in bad.items()] + [refused]
    before = {p: _tree(p) for p in (trained, *bad.values())}
    for args, why in cases:
        assert module.main(args) == 2, args
        assert why in _one_error_line(capsys), args
    assert {p: _tree(p) for p in before} == before
    assert taken.read_bytes() == b"keep me"
    left = sorted(p.name for p in tmp_path.iterdir())  # nothing new, no temporary files
    assert left == sorted([*(p.name for p in bad.values()), "taken.safetensors"])


def test_consolidate_writes_one_safetensors_file_of_the_logical_tensors(trained, tmp_path,
                                                                       capsys):
    safetensors = pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    assert consolidate_tool.main(["--load", str(trained), "--output", str(out)]) == 0
    assert PEAK_LINE.search(capsys.readouterr().out.splitlines()[-1])
    loaded, reader = load_file(out), CheckpointReader.latest(trained)
    assert set(loaded) == set(reader.names())
    for name in reader.names():
        assert torch.equal(loaded[name], reader.tensor(name)), name
    assert loaded["embedding.word_embeddings.weight"].shape[0] == 203  # padding dropped
    with safetensors.safe_open(out, framework="pt") as f:
        assert f.metadata()["iteration"] == str(SAVED_AT)


def test_inspect_reports_the_run_and_each_tensor(trained, capsys):
    assert inspect_tool.main(["--load", str(trained), "--tensors"]) == 0
    lines = capsys.readouterr().out.splitlines()
    reader = CheckpointReader.latest(trained)
    assert f"iteration: {SAVED_AT}" in lines and f"series: {reader.meta['series']}" in lines
    assert "layout: TP 2, PP 2, DP 2, ZeRO-1 (8 rank files)" in lines
    flags = next(line for line in lines if line.startswith("model flags: "))
    assert "--num-layers 2 " in flags and "--hidden-size 32 " in flags
    rows = {line.split("  ")[0]: line for line in lines if "  weight " in line}
    order = [list(rows).index(n) for n in ("layers.0.mlp.fc1.weight", "layers.1.mlp.fc1.weight",
                                           "final_norm.weight")]
    assert order == sorted(order)  # layer order
    assert sorted(rows) == sorted(reader.names())
    for name in reader.names():
        norm = float(torch.linalg.vector_norm(reader.tensor(name, "exp_avg"), dtype=torch.float64))
        assert f"exp_avg {norm:.6e}" in rows[name]
    assert PEAK_LINE.search(lines[-1]) and "largest tensor" in lines[-1]
    assert inspect_tool.main(["--load", str(trained)]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert PEAK_LINE.search(last) and "only their descriptions read" in last


def _random_checkpoint(root: Path, model) -> int:
    """A checkpoint of random weights for ``model`` written a layer per rank file; returns
    the bytes of its largest transformer layer."""
    groups: dict[str, list] = {}
    for p in model_tensors(model):
        groups.setdefault(".".join(p.meta.name.split(".")[:2]), []).append(p)
    pieces = [((p.meta.name, torch.randn(p.shape)) for p in group) for group in groups.values()]
    write_checkpoint(root, TrainConfig(model=model, training=TrainingConfig()), pieces)
    return max(sum(4 * math.prod(p.shape) for p in group)
               for key, group in groups.items() if key.startswith("layers."))


# The kernel's high-water mark of resident memory (VmHWM) is reset after the imports (Linux's
# clear_refs), so its growth is the consolidation's alone (ru_maxrss would not do: it keeps
# the peak of the forking test process). torch._dynamo (~75 MB of modules) is imported first:
# torch imports it lazily when the model's skeleton is first built on the meta device.
_MEASURE = """
import sys
import torch._dynamo
from tests.helpers.tools import load_tool
tool = load_tool("checkpoint/consolidate.py")
def peak():
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) * 1024 for l in status if l.startswith("VmHWM:"))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = peak()
assert tool.main(sys.argv[1:]) == 0
print(peak() - before)
"""


def test_consolidate_peaks_below_three_times_the_largest_layer(tmp_path):
    model = model_config("gpt2", num_layers=10, hidden_size=1024, num_attention_heads=8,
                         vocab_size=1024, seq_length=32)
    largest_layer = _random_checkpoint(tmp_path / "big", model)
    out = subprocess.run([sys.executable, "-c", _MEASURE, "--load", str(tmp_path / "big"),
                          "--output", str(tmp_path / "big.safetensors")], cwd=TOOLS.parent,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    peak = int(out[-1])
    assert PEAK_LINE.search(out[-2])  # the tool's own final line
    total = (tmp_path / "big.safetensors").stat().st_size
    assert total > 9 * largest_layer  # the model is far larger than what may be held
    assert peak < 3 * largest_layer, f"peak {peak / 2**20:.1f} MiB, layer " \
                                     f"{largest_layer / 2**20:.1f} MiB"
