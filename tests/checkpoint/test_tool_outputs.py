"""The checkpoint tools touch only what they create, bound their work by what the input can
hold, and turn a failed write or a refused file into one line. On a tiny checkpoint of random
weights written in-process (no training run): a user's ``OUTPUT.tmp`` beside the output
survives export_hf and consolidate; a full disk during export is one line and leaves
nothing; reshape refuses a data-parallel size no run of the checkpoint could use before
writing a rank file; generate refuses a temperature that would overflow the logits and a
transformers export whose weights torch refuses to unpickle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron3d.config import TrainConfig, TrainingConfig
from megatron3d.convert.contents import model_tensors
from megatron3d.convert.offline import write_checkpoint
from tests.checkpoint.test_bad_checkpoints import _tree
from tests.helpers.tiny import model_config
from tests.helpers.tools import load_tool, tool_logging

export_hf = load_tool("checkpoint/export_hf.py")
consolidate = load_tool("checkpoint/consolidate.py")
reshape = load_tool("checkpoint/reshape.py")
generate = load_tool("generate.py")
USER_FILES = {"notes.txt": b"the user's own work"}


def _checkpoint(root: Path, training: TrainingConfig) -> Path:
    """Random weights of the tiny GPT-2 (one rank file) under ``root``, iteration 0."""
    model = model_config("gpt2")
    torch.manual_seed(0)
    pieces = [[(p.meta.name, torch.randn(p.shape)) for p in model_tensors(model)]]
    write_checkpoint(root, TrainConfig(model=model, training=training), pieces)
    return root


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A run's checkpoint: micro-batches of 2, global batch 8. Read it, never write."""
    return _checkpoint(tmp_path_factory.mktemp("outputs") / "ckpt",
                       TrainingConfig(micro_batch_size=2, global_batch_size=8))


def _run(tool, argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    with tool_logging():
        code = tool.main(argv)
    return code, capsys.readouterr().err


def _one_line(code: int, err: str) -> str:
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err, err
    return err


def _users_directory(path: Path) -> None:
    path.mkdir()
    for name, data in USER_FILES.items():
        (path / name).write_bytes(data)


def test_export_keeps_a_users_directory_named_like_its_staging(ckpt, tmp_path, capsys):
    pytest.importorskip("safetensors")
    _users_directory(tmp_path / "model.tmp")
    code, err = _run(export_hf, ["--load", str(ckpt), "--output", str(tmp_path / "model"),
                                 "--no-verify"], capsys)
    assert code == 0, err
    assert {p.name for p in (tmp_path / "model.tmp").iterdir()} == set(USER_FILES)
    assert (tmp_path / "model.tmp" / "notes.txt").read_bytes() == USER_FILES["notes.txt"]
    assert (tmp_path / "model" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "model.tmp"]


def test_consolidate_keeps_a_users_file_named_like_its_staging(ckpt, tmp_path, capsys):
    users = tmp_path / "m.safetensors.tmp"
    users.write_bytes(b"keep me")
    code, err = _run(consolidate, ["--load", str(ckpt), "--output",
                                   str(tmp_path / "m.safetensors")], capsys)
    assert code == 0, err
    assert users.read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "m.safetensors.tmp"]


def test_a_full_disk_during_export_is_one_line_and_leaves_nothing(ckpt, tmp_path, capsys,
                                                                  monkeypatch):
    safetensors = pytest.importorskip("safetensors")
    writer = pytest.importorskip("safetensors.torch")

    def full(*args, **kwargs):  # what safetensors raises when a write fails
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space "
                                          "left on device (os error 28)")
    monkeypatch.setattr(writer, "save_file", full)
    (tmp_path / "out").mkdir()  # an empty directory, which the export may fill
    before = _tree(tmp_path)
    code, err = _run(export_hf, ["--load", str(ckpt), "--output", str(tmp_path / "out" / "a"
                                                                     / "hf"), "--no-verify"],
                     capsys)
    assert "No space left on device" in _one_line(code, err)
    assert _tree(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize(("training", "dp", "expected"), [
    (TrainingConfig(micro_batch_size=2, global_batch_size=8), "100000",
     "--data-parallel-size 100000 exceeds the saved run's global batch of 8 samples"),
    (TrainingConfig(micro_batch_size=2), "3", "exceeds the saved run's global batch of 2 "),
    (TrainingConfig(), str(2**24 + 1), f"--data-parallel-size {2**24 + 1} exceeds the "
     "largest global batch a run takes"),
], ids=["a run's batch", "a default batch (micro-batch x the saved DP)", "converted"])
def test_reshape_bounds_the_rank_files_by_the_saved_batch(tmp_path, capsys, training, dp,
                                                          expected):
    source = _checkpoint(tmp_path / "src", training)
    before = _tree(tmp_path)
    code, err = _run(reshape, ["--load", str(source), "--save", str(tmp_path / "new"),
                               "--tensor-model-parallel-size", "1",
                               "--pipeline-model-parallel-size", "1",
                               "--data-parallel-size", dp], capsys)
    assert expected in _one_line(code, err)
    assert _tree(tmp_path) == before and not (tmp_path / "new").exists()


def test_generate_refuses_a_temperature_that_overflows_the_logits(ckpt, capsys):
    code, err = _run(generate, ["--load", str(ckpt), "--prompt-ids", "1 2",
                                "--max-new-tokens", "2", "--temperature", "1e-300"], capsys)
    assert "--temperature='1e-300'): expected a finite number >= 0.001" in _one_line(code, err)
    code, err = _run(generate, ["--load", str(ckpt), "--prompt-ids", "1 2",
                                "--max-new-tokens", "2", "--temperature", "0.001"], capsys)
    assert code == 0, err


class _RunsCode:
    """Unpickling this would create ``path``: a malicious pickle, harmlessly."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def test_generate_hf_on_weights_torch_refuses_is_one_line(ckpt, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    transformers.GPT2Config(vocab_size=203, n_positions=16, n_embd=32, n_layer=2,
                            n_head=4).save_pretrained(hf)
    marker = tmp_path / "ran"
    torch.save({"transformer.wte.weight": _RunsCode(marker)}, hf / "pytorch_model.bin")
    code, err = _run(generate, ["--load", str(ckpt), "--prompt-ids", "1 2", "--hf", str(hf)],
                     capsys)
    assert f"--hf {hf} cannot be loaded by transformers" in _one_line(code, err)
    assert not marker.exists()
    assert json.loads((hf / "config.json").read_text())["n_layer"] == 2  # untouched
