"""Import from Megatron-Core's ``torch_dist`` checkpoints.

With megatron-core installed (the peer set: ``benchmarks/peers/requirements.txt``),
Megatron-Core itself builds GPT-2- and Llama-style GPTModels on CPU/gloo at TP=2 x PP=2,
saves them as Megatron-LM does, and the imported checkpoint's first training loss in
megatron3d (TP=2 x PP=2) equals Megatron-Core's on the same batch. Always: a checkpoint
written here with torch.distributed.checkpoint under the names and layout Megatron-Core was
seen to write (layers stacked on a leading axis, or one key per layer; fused or separate
norm names) imports tensor for tensor, and every bad input is one line, exit 2, nothing
written.
"""

from __future__ import annotations

import argparse
import enum
import json
import math
import pickle
import re
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron3d.checkpoint.reader import CheckpointReader
from megatron3d.config import ModelConfig
from megatron3d.convert.megatron import args as mcore_args
from megatron3d.data.mock import MockGPTDataset
from megatron3d.errors import ConfigError
from tests.checkpoint.conftest import PEAK_LINE
from tests.checkpoint.test_bad_checkpoints import _tree
from tests.helpers.dist import run_distributed
from tests.helpers.runs import train
from tests.helpers.tiny import train_argv
from tests.helpers.tools import load_tool, tool_logging

import_megatron = load_tool("checkpoint/import_megatron.py")

SEQ, VOCAB, GBS, LAYERS, HIDDEN = 16, 128, 8, 4, 32
FUSED_NORMS = {"input_norm": "self_attention.linear_qkv.layer_norm_",
               "post_attention_norm": "mlp.linear_fc1.layer_norm_"}
SEPARATE_NORMS = {"input_norm": "input_layernorm.", "post_attention_norm": "pre_mlp_layernorm."}
LAYER_MODULES = {"attention.qkv": "self_attention.linear_qkv.",
                 "attention.dense": "self_attention.linear_proj.",
                 "mlp.fc1": "mlp.linear_fc1.", "mlp.fc2": "mlp.linear_fc2."}


def _first_losses(directories: dict[str, str]) -> dict[str, list[float]]:
    """Rank view of one step at TP=2 x PP=2 from each imported checkpoint."""
    out = {}
    for flavour, directory in directories.items():
        argv = train_argv("gpt2", 1, "--lr-warmup-iters", "0", "--seq-length", str(SEQ),
                          "--global-batch-size", str(GBS), "--tensor-model-parallel-size",
                          "2", "--pipeline-model-parallel-size", "2", "--load", directory,
                          "--use-checkpoint-args")
        out[flavour] = train(argv).losses
    return out


def test_a_megatron_core_checkpoint_starts_from_megatron_cores_loss(tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed: it is in "
                        "the peer set (benchmarks/peers/requirements.txt), not the project")
    from tests.helpers.mcore_gpt import FLAVOURS, save_and_loss

    batch = MockGPTDataset(VOCAB, SEQ, 1234).samples(0, GBS)  # what pretrain_gpt trains on
    expected, directories = {}, {}
    for flavour in FLAVOURS:
        source = tmp_path / f"mcore-{flavour}"
        per_rank = run_distributed(save_and_loss, 4, str(source), flavour, 2, 2, VOCAB, batch,
                                   timeout_s=300)
        expected[flavour] = per_rank[-1]
        directories[flavour] = str(tmp_path / f"ckpt-{flavour}")
        with tool_logging():
            assert import_megatron.main(["--load", str(source), "--save",
                                         directories[flavour],
                                         "--tensor-model-parallel-size", "2",
                                         "--pipeline-model-parallel-size", "2"]) == 0
    last_stage = run_distributed(_first_losses, 4, directories, timeout_s=300)[-1]
    for flavour, loss in expected.items():
        assert loss > math.log(VOCAB) + 2, (flavour, loss)  # far from a flat guess
        assert last_stage[flavour][0] == pytest.approx(loss, rel=1e-5), flavour


# --------------------------------------------------------------------------- synthetic


def _ours(untied: bool = False) -> dict[str, torch.Tensor]:
    """Our logical tensors of a GPT-2-style model (bias, LayerNorm), drawn from seed 0."""
    torch.manual_seed(0)
    shapes = {"embedding.word_embeddings.weight": (VOCAB, HIDDEN),
              "embedding.position_embeddings.weight": (SEQ, HIDDEN),
              "final_norm.weight": (HIDDEN,), "final_norm.bias": (HIDDEN,)}
    if untied:
        shapes["output_layer.weight"] = (VOCAB, HIDDEN)
    per_layer = {"input_norm": (HIDDEN,), "attention.qkv": (3 * HIDDEN, HIDDEN),
                 "attention.dense": (HIDDEN, HIDDEN), "post_attention_norm": (HIDDEN,),
                 "mlp.fc1": (4 * HIDDEN, HIDDEN), "mlp.fc2": (HIDDEN, 4 * HIDDEN)}
    for i in range(LAYERS):
        for module, shape in per_layer.items():
            shapes[f"layers.{i}.{module}.weight"] = shape
            shapes[f"layers.{i}.{module}.bias"] = shape[:1]
    return {name: torch.randn(shape) for name, shape in shapes.items()}


def _theirs(ours: dict[str, torch.Tensor], stacked: bool, norms: dict[str, str]
            ) -> dict[str, torch.Tensor]:
    """Megatron-Core's state dict of ``ours``: layers stacked on a leading axis (the default
    of homogeneous layers) or one key per layer; norms fused into the next linear's name or
    separate (what the local spec's modules are called)."""
    modules = {**norms, **LAYER_MODULES}
    out, layers = {}, {}
    for name, tensor in ours.items():
        if not name.startswith("layers."):
            out[name.replace("final_norm.", "decoder.final_layernorm.")] = tensor
            continue
        _, index, rest = name.split(".", 2)
        module, _, leaf = rest.rpartition(".")
        key = modules[module] + leaf
        if stacked:
            layers.setdefault(f"decoder.layers.{key}", []).append(tensor)
        else:
            out[f"decoder.layers.{index}.{key}"] = tensor
    return {**out, **{key: torch.stack(parts) for key, parts in layers.items()}}


def _args(**changes) -> argparse.Namespace:
    return argparse.Namespace(**{
        "num_layers": LAYERS, "hidden_size": HIDDEN, "num_attention_heads": 4,
        "seq_length": SEQ, "max_position_embeddings": SEQ, "padded_vocab_size": VOCAB,
        "position_embedding_type": "learned_absolute", "normalization": "LayerNorm",
        "openai_gelu": True, "add_bias_linear": True, "swiglu": False,
        "untie_embeddings_and_output_weights": False, "norm_epsilon": 1e-5, **changes})


def _write(root: Path, state: dict[str, torch.Tensor], common: object = None) -> Path:
    """``state`` saved as Megatron-LM saves iteration 5 in the torch_dist format."""
    iteration = root / "iter_0000005"
    iteration.mkdir(parents=True)
    with warnings.catch_warnings():  # DCP's note that it saves without a process group
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(iteration)), no_dist=True)
    (iteration / "metadata.json").write_text(json.dumps(
        {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
         "common_backend": "torch", "common_backend_version": 1}))
    torch.save({"args": _args(), "iteration": 5} if common is None else common,
               iteration / "common.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("5")
    return root


def _import(tmp_path: Path, capsys, *extra: str) -> tuple[int, str, str]:
    capsys.readouterr()
    with tool_logging():
        code = import_megatron.main(["--load", str(tmp_path / "mcore"), "--save",
                                     str(tmp_path / "ckpt"), *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(("stacked", "norms", "untied"), [
    (True, FUSED_NORMS, False), (False, FUSED_NORMS, True), (True, SEPARATE_NORMS, False)],
    ids=["stacked layers", "a key per layer, untied head", "separate norms"])
def test_every_tensor_arrives_under_its_name(tmp_path, capsys, stacked, norms, untied):
    ours = _ours(untied)
    _write(tmp_path / "mcore", _theirs(ours, stacked, norms), {
        "args": _args(untie_embeddings_and_output_weights=untied)})
    code, out, err = _import(tmp_path, capsys, "--tensor-model-parallel-size", "2")
    assert code == 0, err
    assert PEAK_LINE.search(out.splitlines()[-1]), out
    reader = CheckpointReader.latest(tmp_path / "ckpt")
    assert sorted(reader.names()) == sorted(ours)
    for name, tensor in ours.items():
        assert torch.equal(reader.tensor(name), tensor), name
    assert reader.meta["config"]["model"]["vocab_size"] == VOCAB


def test_model_flags_replace_the_stored_arguments(tmp_path, capsys):
    ours = _ours()
    _write(tmp_path / "mcore", _theirs(ours, True, FUSED_NORMS), {"iteration": 5})
    code, _, err = _import(tmp_path, capsys, "--num-layers", str(LAYERS), "--hidden-size",
                           str(HIDDEN), "--num-attention-heads", "4", "--seq-length", str(SEQ))
    assert code == 0, err
    reader = CheckpointReader.latest(tmp_path / "ckpt")
    assert all(torch.equal(reader.tensor(n), t) for n, t in ours.items())


def _llama3_qkv_bias() -> dict[str, torch.Tensor]:
    """Our logical tensors of a Llama-style model (RMSNorm, SwiGLU, 2 query groups, no
    biases but on QKV, as Qwen2), drawn from seed 0."""
    torch.manual_seed(0)
    head = HIDDEN // 4
    shapes = {"embedding.word_embeddings.weight": (VOCAB, HIDDEN), "final_norm.weight": (HIDDEN,)}
    per_layer = {"input_norm.weight": (HIDDEN,), "attention.qkv.weight": (8 * head, HIDDEN),
                 "attention.qkv.bias": (8 * head,), "attention.dense.weight": (HIDDEN, HIDDEN),
                 "post_attention_norm.weight": (HIDDEN,), "mlp.fc1.weight": (128, HIDDEN),
                 "mlp.fc2.weight": (HIDDEN, 64)}
    shapes |= {f"layers.{i}.{k}": v for i in range(LAYERS) for k, v in per_layer.items()}
    return {name: torch.randn(shape) for name, shape in shapes.items()}


def test_rope_scaling_and_a_qkv_bias_import_as_megatron_computed_them(tmp_path, capsys):
    """Megatron-LM's --use-rope-scaling (Llama 3.x: factor given, the others fixed at 1, 4
    and 8192, our defaults) and --add-qkv-bias without other biases (Qwen2) were refused."""
    ours = _llama3_qkv_bias()
    args = _args(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                 openai_gelu=False, add_bias_linear=False, add_qkv_bias=True,
                 group_query_attention=True, num_query_groups=2, ffn_hidden_size=64,
                 use_rope_scaling=True, rope_scaling_factor=32.0)
    _write(tmp_path / "mcore", _theirs(ours, True, FUSED_NORMS), {"args": args})
    code, _, err = _import(tmp_path, capsys)
    assert code == 0, err
    reader = CheckpointReader.latest(tmp_path / "ckpt")
    assert sorted(reader.names()) == sorted(ours)
    assert all(torch.equal(reader.tensor(n), t) for n, t in ours.items())
    model = ModelConfig(**reader.meta["config"]["model"])
    assert (model.use_rope_scaling, model.rope_scaling_factor, model.add_qkv_bias,
            model.disable_bias_linear) == (True, 32.0, True, True)
    assert (model.rope_scaling_low_freq_factor, model.rope_scaling_high_freq_factor,
            model.rope_scaling_original_max_position_embeddings) == (1.0, 4.0, 8192)


class _RunsCode:
    """Unpickling this would create ``path``: what a malicious pickle does, harmlessly."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def _refused(tmp_path: Path, capsys, expected: str, *extra: str) -> None:
    before = _tree(tmp_path)
    code, _, err = _import(tmp_path, capsys, *extra)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert expected in err, err
    assert _tree(tmp_path) == before and not (tmp_path / "ckpt").exists()


MODEL_FLAGS = ("--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN),
               "--num-attention-heads", "4", "--seq-length", str(SEQ))


def test_bad_directories_are_one_line(tmp_path, capsys):
    (tmp_path / "mcore").write_text("a file\n")
    _refused(tmp_path, capsys, "is not a directory")
    (tmp_path / "mcore").unlink()
    (tmp_path / "mcore").mkdir()
    _refused(tmp_path, capsys, "has no readable latest_checkpointed_iteration.txt")
    (tmp_path / "mcore" / "latest_checkpointed_iteration.txt").write_text("9")
    _refused(tmp_path, capsys, "names '9', which is not a checkpoint")


def test_a_checkpoint_of_another_backend_is_one_line(tmp_path, capsys):
    _write(tmp_path / "mcore", _theirs(_ours(), True, FUSED_NORMS))
    (tmp_path / "mcore" / "iter_0000005" / "metadata.json").write_text(
        json.dumps({"sharded_backend": "zarr"}))
    _refused(tmp_path, capsys, "is a 'zarr' checkpoint: only torch_dist is read")


@pytest.mark.parametrize(("drop", "flags", "expected"), [
    ("decoder.layers.mlp.linear_fc2.bias", (), "has no tensor decoder.layers.mlp.linear_fc2."
     "bias (for layers.0.mlp.fc2.bias)"),
    (None, (*MODEL_FLAGS[:-4], "--num-attention-heads", "4", "--seq-length", "8"),
     "stores embedding.position_embeddings.weight as [16, 32], but the model needs [8, 32]"),
    (None, (*MODEL_FLAGS, "--disable-bias-linear"), "holds 4 model tensors that this model "
     "does not have"),
    (None, ("--hidden-size", "32"), "the model flags given lack --num-layers"),
], ids=["missing tensor", "wrong shape", "extra tensors", "too few flags"])
def test_a_checkpoint_unlike_its_model_is_one_line(tmp_path, capsys, drop, flags, expected):
    state = _theirs(_ours(), True, FUSED_NORMS)
    state.pop(drop, None)
    _write(tmp_path / "mcore", state)
    _refused(tmp_path, capsys, expected, *flags)


def test_unsupported_megatron_options_are_one_line(tmp_path, capsys):
    _write(tmp_path / "mcore", _theirs(_ours(), True, FUSED_NORMS),
           {"args": _args(openai_gelu=False, bias_gelu_fusion=False)})
    _refused(tmp_path, capsys, "openai_gelu=False, which megatron3d does not implement")


def test_a_common_pt_that_would_run_code_is_refused_unrun(tmp_path, capsys):
    marker = tmp_path / "ran"
    _write(tmp_path / "mcore", _theirs(_ours(), True, FUSED_NORMS),
           {"args": _RunsCode(marker)})
    _refused(tmp_path, capsys, "cannot be read with torch's weights-only loader")
    assert not marker.exists()
    code, _, err = _import(tmp_path, capsys, *MODEL_FLAGS)  # the way round it
    assert code == 0 and not marker.exists(), err


def test_a_dcp_metadata_that_would_run_code_is_refused_unrun(tmp_path, capsys):
    marker = tmp_path / "ran"
    _write(tmp_path / "mcore", _theirs(_ours(), True, FUSED_NORMS))
    (tmp_path / "mcore" / "iter_0000005" / ".metadata").write_bytes(
        pickle.dumps(_RunsCode(marker)))
    _refused(tmp_path, capsys, "cannot be read safely (it names io.open")
    assert not marker.exists()


def test_lost_chunks_or_files_are_one_line_and_leave_nothing(tmp_path, capsys):
    """A chunk missing from .metadata is found before writing; a lost .distcp file only
    when its tensor is read, and what was written is then removed."""
    _write(tmp_path / "mcore", _theirs(_ours(), True, FUSED_NORMS))
    iteration = tmp_path / "mcore" / "iter_0000005"
    original = (iteration / ".metadata").read_bytes()
    md = pickle.loads(original)  # written by this test: trusted
    md.state_dict_metadata["decoder.final_layernorm.bias"].chunks.clear()
    (iteration / ".metadata").write_bytes(pickle.dumps(md))
    _refused(tmp_path, capsys, "holds only part of decoder.final_layernorm.bias")
    (iteration / ".metadata").write_bytes(original)
    for file in iteration.glob("*.distcp"):
        file.unlink()
    _refused(tmp_path, capsys, "cannot give embedding.")


# Stands for Megatron's AttnBackend: an enum pickled under Megatron's module name.
_BACKEND = enum.Enum("AttnBackend", {"local": 4}, module="megatron.core.transformer.enums",
                     qualname="AttnBackend")


def test_stored_arguments_with_megatron_enums_read_without_megatron(tmp_path, monkeypatch):
    """Megatron-LM's args hold enum members of Megatron's classes: they read back as inert
    text, and a Llama-style model's options map onto ours."""
    names = ("megatron", "megatron.core", "megatron.core.transformer",
             "megatron.core.transformer.enums")
    with monkeypatch.context() as patch:  # only while pickling: importable by that name
        for name in names:
            patch.setitem(sys.modules, name, types.ModuleType(name))
        patch.setattr(sys.modules[names[-1]], "AttnBackend", _BACKEND, raising=False)
        llama = {"position_embedding_type": "rope", "normalization": "RMSNorm",
                 "swiglu": True, "openai_gelu": False, "add_bias_linear": False,
                 "untie_embeddings_and_output_weights": True, "group_query_attention": True,
                 "num_query_groups": 2, "num_attention_heads": 8, "ffn_hidden_size": 64,
                 "attention_backend": _BACKEND.local, "rotary_base": 500000}
        torch.save({"args": _args(**llama)}, tmp_path / "common.pt")
    args = mcore_args.read_args(tmp_path / "common.pt")
    inert = args.attention_backend == "megatron.core.transformer.enums.AttnBackend(4,)"
    # megatron.core, once imported in this process (the test above), allowlists its enums
    assert inert or "megatron.core" in sys.modules and args.attention_backend.value == 4
    model = ModelConfig(**mcore_args.model_fields(args))
    assert (model.position_embedding_type, model.normalization, model.swiglu, model.add_bias,
            model.tie_embeddings, model.query_groups, model.ffn_size, model.rotary_base) == (
        "rope", "rmsnorm", True, False, False, 2, 64, 500000.0)


@pytest.mark.parametrize(("change", "expected"), [
    ({"rotary_seq_len_interpolation_factor": 4}, "rotary_seq_len_interpolation_factor=4"),
    ({"qk_l2_norm": True}, "qk_l2_norm=True"),
    ({"window_size": (128, 0)}, "window_size=(128, 0)"),
    ({"mtp_num_layers": 1}, "mtp_num_layers=1"),
    ({"no_rope_freq": 4}, "no_rope_freq=4"),
    ({"attention_output_gate": True}, "attention_output_gate=True"),
], ids=["interpolation", "qk l2 norm", "sliding window", "multi-token prediction", "nope",
        "output gate"])
def test_megatron_core_options_it_does_not_compute_are_one_line(change, expected):
    with pytest.raises(ConfigError, match=re.escape(expected) + ", which megatron3d does not "
                       "implement") as refused:
        mcore_args.model_fields(_args(**change))
    assert "\n" not in str(refused.value)
    interpolation = mcore_args.model_fields(_args(rotary_seq_len_interpolation_factor=1))
    assert interpolation == mcore_args.model_fields(_args())  # a factor of 1 changes nothing


def test_megatron_dropout_is_carried():
    fields = mcore_args.model_fields(_args(hidden_dropout=0.0, attention_dropout=0.05))
    assert (fields["hidden_dropout"], fields["attention_dropout"]) == (0.0, 0.05)
