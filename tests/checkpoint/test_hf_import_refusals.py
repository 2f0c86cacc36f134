"""What import_hf must refuse rather than convert wrongly or write from bad input: options
it does not compute, weights unlike their config, non-finite weights, a shard index naming
files outside the model, a sequence longer than the model's positions, sizes training would
refuse. Each is exit 2, one line, nothing written."""

from __future__ import annotations

import json

import pytest
import torch

from tests.checkpoint.test_hf_import import _hf_model, _import_refused, import_hf

safetensors = pytest.importorskip("safetensors.torch")


def _edit_config(tmp_path, **change) -> None:
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))


@pytest.mark.parametrize(("change", "expected"), [
    ({"scale_attn_weights": False}, "scale_attn_weights=False"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
    ({"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn=True"),
    ({"resid_pdrop": 1.5}, "resid_pdrop=1.5, expected a number in [0, 1)"),
    ({"n_layer": 2**17}, "config.json gives num_layers=131072, beyond what pretrain_gpt.py "
     "accepts (--num-layers in [1, 65536])"),
    ({"n_positions": 2**21}, "=2097152, beyond what pretrain_gpt.py accepts"),
], ids=["unscaled attention", "inverse layer scaling", "upcast attention", "dropout",
        "layers", "positions"])
def test_gpt2_options_and_sizes_it_cannot_train_are_refused(tmp_path, capsys, change,
                                                            expected):
    _hf_model("gpt2", tmp_path / "hf")
    _edit_config(tmp_path, **change)
    _import_refused(tmp_path, capsys, expected)


def _tensors(tmp_path) -> dict[str, torch.Tensor]:
    return safetensors.load_file(tmp_path / "hf" / "model.safetensors")


def _save(tmp_path, tensors: dict[str, torch.Tensor]) -> None:
    safetensors.save_file(tensors, tmp_path / "hf" / "model.safetensors",
                          metadata={"format": "pt"})


def test_a_tensor_shaped_unlike_the_config_is_refused(tmp_path, capsys):
    _hf_model("llama", tmp_path / "hf")
    tensors = _tensors(tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = tensors[name].t().contiguous()  # [8, 32] stored as [32, 8]
    _save(tmp_path, tensors)
    _import_refused(tmp_path, capsys, f"{name} is [32, 8] in the weights but config.json "
                    "makes it [8, 32]")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_weights_are_refused(tmp_path, capsys, bad):
    _hf_model("llama", tmp_path / "hf")
    tensors = _tensors(tmp_path)
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = bad  # the last layer converted
    _save(tmp_path, tensors)
    _import_refused(tmp_path, capsys, "model.layers.1.mlp.up_proj.weight holds NaN or inf")


@pytest.mark.parametrize("file", ["../outside.safetensors", "/tmp/outside.safetensors"],
                         ids=["parent", "absolute"])
def test_a_shard_index_pointing_outside_the_model_is_refused(tmp_path, capsys, file):
    _hf_model("gpt2", tmp_path / "hf")
    names = list(_tensors(tmp_path))
    weight_map = {name: "model.safetensors" for name in names} | {names[0]: file}
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    _import_refused(tmp_path, capsys, f"names {file!r} for {names[0]}, outside the model "
                    "directory")


@pytest.mark.parametrize(("flavour", "key"), [("gpt2", "n_positions"),
                                              ("llama", "max_position_embeddings")])
def test_a_sequence_longer_than_the_models_positions_is_refused(tmp_path, capsys, flavour,
                                                                key):
    _hf_model(flavour, tmp_path / "hf")  # 16 positions
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()
    assert import_hf.main(["--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt"),
                           "--seq-length", "32"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--seq-length 32 is above the model's {key}=16" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
