"""Export to Hugging Face: a checkpoint trained at (TP, PP, DP) = (2, 2, 2) loads with
transformers' AutoModelForCausalLM and gives megatron3d's logits and greedy generations;
whatever is refused (a damaged checkpoint, a missing package, an architecture transformers
has no class for, a failed verification) exits with one line and leaves nothing behind."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from megatron3d.config import TrainConfig, TrainingConfig
from megatron3d.convert.contents import model_tensors
from megatron3d.convert.hf import to_hf
from megatron3d.convert.hf.mapping import ARCHITECTURES
from megatron3d.convert.offline import write_checkpoint
from megatron3d.convert.standalone import load_model
from tests.checkpoint.conftest import FLAVOURS, PEAK_LINE
from tests.checkpoint.test_bad_checkpoints import _tree
from tests.checkpoint.test_checkpoint_tools import _bad_checkpoints
from tests.helpers.tiny import model_config
from tests.helpers.tools import load_tool

export_hf = load_tool("checkpoint/export_hf.py")

transformers = pytest.importorskip("transformers")
PROMPT = [5, 17, 3, 99, 42]


@pytest.fixture
def checkpoints(trained_222) -> Path:
    return trained_222


# (checkpoint, export flags, the transformers class): each family in its own class; a Llama
# model is a Mistral one without a sliding window, exported as one on request.
EXPORTS = {**{f: (f, (), ARCHITECTURES.get(f, "LlamaForCausalLM")) for f in FLAVOURS},
           "mistral": ("llama", ("--model-type", "mistral"), "MistralForCausalLM")}


@pytest.mark.parametrize("export", EXPORTS)
def test_export_matches_transformers_logits_and_greedy_generation(checkpoints, tmp_path,
                                                                   export, capsys):
    flavour, flags, architecture = EXPORTS[export]
    out = tmp_path / "hf"
    assert export_hf.main(["--load", str(checkpoints / flavour), "--output", str(out),
                           *flags]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "top-1 agreement 100.0%" in lines[-2]
    assert PEAK_LINE.search(lines[-1]) and "with the verification" in lines[-1], lines[-1]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [architecture]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    ours = load_model(checkpoints / flavour)
    prompt = torch.tensor([PROMPT])
    with torch.no_grad():
        expected = theirs(prompt).logits
        generated = theirs.generate(prompt, max_new_tokens=8, do_sample=False,
                                    pad_token_id=0)[0, 5:].tolist()
    assert expected.abs().max() > 5  # logits that vary (conftest.INIT), not a flat guess
    torch.testing.assert_close(ours.logits(prompt), expected, rtol=1e-4, atol=1e-4)
    tokens = prompt
    for _ in range(8):  # greedy, by hand, through load_model
        tokens = torch.cat([tokens, ours.logits(tokens)[:, -1].argmax(-1, keepdim=True)], 1)
    assert tokens[0, 5:].tolist() == generated
    assert len(set(generated)) > 2, generated  # not one token over and over


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_unsupported_model_or_output_is_one_line_and_writes_nothing(checkpoints, tmp_path,
                                                                     capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("keep me\n")
    before = _tree(taken)
    assert export_hf.main(["--load", str(checkpoints / "gpt2"), "--output", str(taken)]) == 2
    assert "already exists and is not an empty directory" in _one_error_line(capsys)
    assert export_hf.main(["--load", str(tmp_path / "nothing"), "--output",
                           str(tmp_path / "new")]) == 2
    assert "no checkpoint in" in _one_error_line(capsys)
    assert export_hf.main(["--load", str(checkpoints / "gpt2"), "--output",
                           str(taken / "notes.txt" / "hf")]) == 2
    assert "is a file" in _one_error_line(capsys)
    assert _tree(taken) == before and not (tmp_path / "new").exists()


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_a_damaged_checkpoint_is_refused_before_anything_is_written(checkpoints, tmp_path,
                                                                     capsys, verify):
    bad = _bad_checkpoints(checkpoints / "gpt2", tmp_path)
    before = {p: _tree(p) for p in bad.values()}
    for why, load in bad.items():
        argv = ["--load", str(load), "--output", str(tmp_path / "out" / "hf")]
        assert export_hf.main(argv + ([] if verify else ["--no-verify"])) == 2, why
        assert why in _one_error_line(capsys)
    assert {p: _tree(p) for p in before} == before
    assert sorted(tmp_path.iterdir()) == sorted(bad.values())  # no output, no .tmp


@pytest.mark.parametrize(("package", "flags", "expected"), [
    ("transformers", [], "verifying the export needs the transformers package: pip install"),
    ("safetensors.torch", ["--no-verify"], "needs the safetensors package: pip install"),
])
def test_a_missing_package_is_refused_before_anything_is_written(checkpoints, tmp_path,
                                                                  capsys, monkeypatch,
                                                                  package, flags, expected):
    monkeypatch.setitem(sys.modules, package, None)  # import raises ImportError
    out = tmp_path / "hf"
    assert export_hf.main(["--load", str(checkpoints / "gpt2"), "--output", str(out),
                           *flags]) == 2
    assert expected in _one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_without_transformers_no_verify_still_exports(checkpoints, tmp_path, monkeypatch,
                                                      capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert export_hf.main(["--load", str(checkpoints / "gpt2"), "--output",
                           str(tmp_path / "hf"), "--no-verify"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert PEAK_LINE.search(last) and "largest layer" in last and "verification" not in last
    assert (tmp_path / "hf" / "config.json").is_file()


def test_an_architecture_transformers_has_no_class_for_is_refused(tmp_path, capsys):
    model = model_config("gpt2", position_embedding_type="rope")  # RoPE with LayerNorm
    pieces = [[(p.meta.name, torch.randn(p.shape)) for p in model_tensors(model)]]
    write_checkpoint(tmp_path / "rope", TrainConfig(model=model, training=TrainingConfig()),
                     pieces)
    before = _tree(tmp_path)
    assert export_hf.main(["--load", str(tmp_path / "rope"), "--output",
                           str(tmp_path / "hf")]) == 2
    err = _one_error_line(capsys)
    assert "no Hugging Face architecture matches this model (positions rope, layernorm" in err
    assert _tree(tmp_path) == before


@pytest.mark.parametrize(("flavour", "family", "expected"), [
    ("llama", "qwen2", "--model-type qwen2 cannot hold this model: Qwen2 has a bias on q, k "
     "and v"),
    ("qwen2", "mistral", "--model-type mistral cannot hold this model"),
    ("gpt2", "llama", "--model-type llama cannot hold this model"),
])
def test_a_family_that_cannot_hold_the_model_is_one_line(checkpoints, tmp_path, capsys,
                                                         flavour, family, expected):
    assert export_hf.main(["--load", str(checkpoints / flavour), "--output",
                           str(tmp_path / "hf"), "--model-type", family]) == 2
    assert expected in _one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_verification_leaves_nothing(checkpoints, tmp_path, capsys, monkeypatch):
    """Logits that disagree (simulated: no difference is tolerated) fail the export with
    exit code 1 after it was written and loaded: the output, its .tmp and the directories
    made for it are removed."""
    monkeypatch.setattr(to_hf, "TOLERANCE", -1.0)
    assert export_hf.main(["--load", str(checkpoints / "gpt2"), "--output",
                           str(tmp_path / "new" / "dir" / "hf")]) == 1
    assert "does not reproduce the checkpoint's logits" in _one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []
