"""Import from Hugging Face: HF -> megatron3d -> HF is bitwise identical (training from an
import: test_hf_continue.py). What cannot be imported (a config
missing a key or with a mistyped value, no weights, a missing package, a pickle that would
run code) is one line, and nothing is written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from megatron3d.checkpoint.reader import CheckpointReader
from tests.checkpoint.conftest import PEAK_LINE
from tests.checkpoint.test_bad_checkpoints import _tree
from tests.helpers.hf_models import saved_hf_model
from tests.helpers.tools import load_tool

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")
import_hf, export_hf = load_tool("checkpoint/import_hf.py"), load_tool("checkpoint/export_hf.py")

SEQ, VOCAB = 16, 203
# transformers' default std (0.02) makes near-uniform logits (loss ~ ln V) whatever the
# weights' order, so a misplaced tensor would not change the loss: 0.5 makes it ~9 vs 5.3.
INIT_RANGE = 0.5
CONFIGS = {
    "gpt2": {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": SEQ},
    "bloom": {"model_type": "bloom", "n_layer": 2, "hidden_size": 32, "n_head": 4},
    "llama": {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32,
              "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 64,
              "max_position_embeddings": SEQ, "rms_norm_eps": 1e-6},
}
_LLAMA_SHAPE = {k: v for k, v in CONFIGS["llama"].items() if k != "model_type"}
# Llama 3.x's RoPE scaling over an original context of 16: at head dim 4 (wavelengths 6.3
# and 628 against 4 and 16) one frequency is smoothed and the other divided by the factor.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
CONFIGS |= {
    "llama3": {"model_type": "llama", **_LLAMA_SHAPE, "rope_parameters": LLAMA3_ROPE},
    "mistral": {"model_type": "mistral", **_LLAMA_SHAPE, "sliding_window": SEQ},  # = full
    "qwen2": {"model_type": "qwen2", **_LLAMA_SHAPE, "tie_word_embeddings": True},
}
# The transformers class each family is exported to, and the export flags that pick it.
EXPORTED = {"gpt2": ("GPT2LMHeadModel", ()), "bloom": ("BloomForCausalLM", ()),
            "llama": ("LlamaForCausalLM", ()), "llama3": ("LlamaForCausalLM", ()),
            "mistral": ("MistralForCausalLM", ("--model-type", "mistral")),
            "qwen2": ("Qwen2ForCausalLM", ())}


def _hf_model(flavour: str, directory: Path):
    return saved_hf_model(CONFIGS[flavour], directory, VOCAB, INIT_RANGE)


@pytest.mark.parametrize("flavour", CONFIGS)
def test_round_trip_is_bitwise(tmp_path, flavour):
    """The tensors come back bit for bit, in the family's own class with its own RoPE
    parameters (the Llama 3.x scaling included)."""
    model = _hf_model(flavour, tmp_path / "hf")
    architecture, flags = EXPORTED[flavour]
    assert import_hf.main(["--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 0
    assert export_hf.main(["--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "back"),
                           "--no-verify", *flags]) == 0
    original = safetensors.load_file(tmp_path / "hf" / "model.safetensors")
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    back = {}
    for file in set(index["weight_map"].values()):
        back.update(safetensors.load_file(tmp_path / "back" / file))
    if model.config.tie_word_embeddings:
        original.pop("lm_head.weight", None)  # the embedding's: not stored in the export
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    config = transformers.AutoConfig.from_pretrained(tmp_path / "back")
    assert config.architectures == [architecture]
    if "rope_parameters" in CONFIGS[flavour] or flavour == "llama":
        assert config.rope_parameters == model.config.rope_parameters


@pytest.mark.parametrize(("change", "expected"), [
    ({"model_type": "t5"}, "unsupported Hugging Face model_type 't5'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "rope_type='yarn'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type='linear'"),
], ids=["architecture", "activation", "yarn", "dynamic", "linear"])
def test_unsupported_config_is_one_line_and_writes_nothing(tmp_path, capsys, change, expected):
    _hf_model("llama", tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = {**json.loads(path.read_text()), **change}
    config.pop("rope_parameters", None) if "rope_scaling" in change else None
    path.write_text(json.dumps(config))
    before = _tree(tmp_path)
    capsys.readouterr()  # transformers' own output while saving
    assert import_hf.main(["--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and expected in err, err
    assert _tree(tmp_path) == before and not (tmp_path / "ckpt").exists()


def test_a_layout_the_model_cannot_take_is_refused(tmp_path, capsys):
    _hf_model("llama", tmp_path / "hf")  # 2 key/value heads
    capsys.readouterr()
    assert import_hf.main(["--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt"),
                           "--tensor-model-parallel-size", "4"]) == 2
    assert "key/value groups (2) are not divisible" in capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists()


def test_weights_missing_a_tensor_are_one_line_and_leave_nothing(tmp_path, capsys):
    """Found only when the last layer is converted: what was written is removed."""
    _hf_model("llama", tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    tensors = safetensors.load_file(path)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    safetensors.save_file(tensors, path, metadata={"format": "pt"})
    capsys.readouterr()
    assert import_hf.main(["--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no tensor model.layers.1.mlp.down_proj.weight" in err
    assert not (tmp_path / "ckpt").exists()


def _import_refused(tmp_path: Path, capsys, expected: str, hf: Path | None = None) -> None:
    """Import of ``hf`` (default ``tmp_path/hf``) exits 2 with one line holding
    ``expected`` and writes nothing."""
    before = _tree(tmp_path)
    capsys.readouterr()  # transformers' own output while saving
    assert import_hf.main(["--hf", str(hf or tmp_path / "hf"), "--save",
                           str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and expected in err, err
    assert _tree(tmp_path) == before and not (tmp_path / "ckpt").exists()


DROP = object()  # a key removed from config.json


@pytest.mark.parametrize(("flavour", "change", "expected"), [
    ("gpt2", {"n_embd": DROP}, "config.json has no n_embd (a whole number >= 1): the file "
     "is incomplete"),
    ("gpt2", {"n_layer": "two"}, "config.json has n_layer='two', expected a whole number >= 1"),
    ("gpt2", {"n_head": 5}, "n_embd=32, which n_head=5 does not divide"),
    ("gpt2", {"tie_word_embeddings": False}, "tie_word_embeddings=False"),
    ("bloom", {"layer_norm_epsilon": "1e-5"}, "layer_norm_epsilon='1e-5', expected a finite"),
    ("llama", {"num_hidden_layers": 2.5}, "num_hidden_layers=2.5, expected a whole number"),
    ("llama", {"tie_word_embeddings": "no"}, "tie_word_embeddings='no', expected true or false"),
    ("llama", {"num_key_value_heads": 3}, "num_attention_heads=8, which "
     "num_key_value_heads=3 does not divide"),
    ("llama", {"rope_parameters": "default"}, "rope_parameters='default', expected an object"),
    ("llama3", {"rope_parameters": {**LLAMA3_ROPE, "factor": DROP}}, "has no factor"),
    ("llama3", {"rope_parameters": {**LLAMA3_ROPE, "high_freq_factor": 1.0}},
     "high_freq_factor=1.0, which must exceed low_freq_factor=1.0"),
    ("mistral", {"sliding_window": SEQ - 1}, f"sliding_window={SEQ - 1}, shorter than the "
     f"training sequence ({SEQ} tokens): pass --seq-length {SEQ - 1} or less"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8}, "sliding_window=8, shorter "
     f"than the training sequence ({SEQ} tokens)"),
    ("mistral", {"head_dim": 8}, "head_dim=8"),
], ids=["missing key", "mistyped int", "heads", "untied gpt2", "mistyped float", "float int",
        "mistyped bool", "groups", "rope not an object", "llama3 without factor",
        "llama3 frequency factors", "mistral window", "qwen2 window", "mistral head dim"])
def test_a_config_problem_is_one_line_naming_the_key(tmp_path, capsys, flavour, change,
                                                     expected):
    _hf_model(flavour, tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    for key, value in change.items():
        if value is DROP:
            del config[key]
        elif isinstance(value, dict):
            config[key] = {k: v for k, v in value.items() if v is not DROP}
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    _import_refused(tmp_path, capsys, expected)


def test_no_config_no_weights_or_no_safetensors_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "empty").mkdir()
    _import_refused(tmp_path, capsys, "has no config.json", tmp_path / "empty")
    _hf_model("gpt2", tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "safetensors", None)  # import raises ImportError
        _import_refused(tmp_path, capsys, "needs the safetensors package: pip install")
    weights.rename(tmp_path / "elsewhere.safetensors")
    _import_refused(tmp_path, capsys, "has no model.safetensors, sharded safetensors or "
                    "pytorch_model.bin")
    weights.write_bytes(b"not safetensors")
    _import_refused(tmp_path, capsys, "cannot be read as safetensors")


def test_pytorch_model_bin_imports_like_safetensors(tmp_path, capsys):
    model = _hf_model("llama", tmp_path / "hf")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_bytes((tmp_path / "hf" / "config.json").read_bytes())
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    for name in ("hf", "bin"):
        assert import_hf.main(["--hf", str(tmp_path / name), "--save",
                               str(tmp_path / f"ckpt-{name}")]) == 0
        assert PEAK_LINE.search(capsys.readouterr().out.splitlines()[-1])
    ours, theirs = (CheckpointReader.latest(tmp_path / f"ckpt-{n}") for n in ("hf", "bin"))
    assert ours.names() == theirs.names()
    for name in ours.names():
        assert torch.equal(ours.tensor(name), theirs.tensor(name)), name


class _RunsCode:
    """Unpickling this would create ``path``: what a malicious pickle does, harmlessly."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def test_a_pickle_that_would_run_code_is_refused_unrun(tmp_path, capsys):
    _hf_model("gpt2", tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    marker = tmp_path / "ran"
    torch.save({"transformer.wte.weight": _RunsCode(marker)},
               tmp_path / "hf" / "pytorch_model.bin")
    _import_refused(tmp_path, capsys, "cannot be read with torch's weights-only loader")
    assert not marker.exists()


def test_a_save_path_under_a_file_is_one_line(tmp_path, capsys):
    _hf_model("gpt2", tmp_path / "hf")
    (tmp_path / "file").write_text("keep me\n")
    before = _tree(tmp_path)
    capsys.readouterr()
    assert import_hf.main(["--hf", str(tmp_path / "hf"), "--save",
                           str(tmp_path / "file" / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --save must be a directory, but it is under the file ")
    assert err.count("\n") == 1 and _tree(tmp_path) == before
