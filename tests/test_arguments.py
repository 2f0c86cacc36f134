"""Flags and YAML -> TrainConfig: every field type, precedence, and one-line errors."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from megatron3d.cli.arguments import (
    config_from_dict,
    config_to_dict,
    field_specs,
    format_config,
    parse_args,
)
from megatron3d.config import ModelConfig, TrainConfig, TrainingConfig
from megatron3d.errors import ConfigError
from megatron3d.validation import validate


def _field(cfg: TrainConfig, name: str):
    return getattr(getattr(cfg, field_specs()[name].section), name)


def _raises(argv: list[str]) -> str:
    """The ConfigError message parse_args raises for argv; it must be one line."""
    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    message = str(info.value)
    assert "\n" not in message
    return message


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


# --------------------------------------------------------------------------- flags


def test_no_flags_gives_the_dataclass_defaults():
    assert parse_args([]) == TrainConfig(model=ModelConfig(), training=TrainingConfig())


def _sample(spec) -> tuple[list[str], object]:
    """A command-line spelling of a non-default value for spec, and the parsed value."""
    if spec.kind is bool:
        return [], True
    if spec.choices:
        return [spec.choices[-1]], spec.choices[-1]
    if spec.nargs == "+":
        return ["0.3", "a", "0.7", "b"], ("0.3", "a", "0.7", "b")
    if spec.nargs:
        return ["1", "2", "3"], (1, 2, 3)
    return {int: (["7"], 7), float: (["0.25"], 0.25), str: (["x/y"], "x/y")}[spec.kind]


@pytest.mark.parametrize("name", sorted(field_specs()))
def test_every_field_has_a_flag(name):
    spec = field_specs()[name]
    words, expected = _sample(spec)
    cfg = parse_args([spec.flag, *words])
    assert _field(cfg, name) == expected
    assert type(_field(cfg, name)) is type(expected)


def test_field_types_from_annotations():
    specs = field_specs()
    assert specs["num_layers"].kind is int
    assert specs["lr"].kind is float and specs["lr"].optional
    assert specs["ffn_hidden_size"].kind is int and specs["ffn_hidden_size"].optional
    assert specs["bf16"].kind is bool
    assert specs["position_embedding_type"].choices == ("learned_absolute", "rope", "alibi")
    assert specs["rampup_batch_size"].nargs == 3
    assert specs["pp_partition_method"].kind is str and not specs["seed"].optional


def test_underscores_in_numbers():
    cfg = parse_args(["--train-samples", "9_765_625", "--rampup-batch-size", "32", "32",
                      "2_000_000", "--initial-loss-scale", "65_536"])
    assert cfg.training.train_samples == 9_765_625
    assert cfg.training.rampup_batch_size == (32, 32, 2_000_000)
    assert cfg.precision.initial_loss_scale == 65536.0


def test_equals_syntax_and_negative_values():
    cfg = parse_args(["--lr=3e-4", "--min-lr", "-1", "--seed=-5"])
    assert cfg.optimizer.lr == 3e-4
    assert cfg.optimizer.min_lr == -1.0  # parsing keeps it; validation rejects it
    assert cfg.training.seed == -5


def test_later_flag_wins():
    assert parse_args(["--num-layers", "2", "--num-layers", "4"]).model.num_layers == 4


def test_help_exits_zero_and_lists_grouped_flags(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # undo line wrapping
    for text in ("--num-layers", "--rampup-batch-size INT INT INT", "{learned_absolute,rope,alibi}",
                 "--config FILE", "parallel:", "dropout. Default: 1234. Allowed: [0, 4294967296).",
                 "Tokens per training sample. Allowed: [1, 1048576].", "Allowed: > 0."):
        assert text in out


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--num-layer", "24"], ["--num-layer=24", "did you mean --num-layers?"]),
        (["--num_layers", "24"], ["--num_layers=24", "did you mean --num-layers?"]),
        (["--hiden-size=8"], ["--hiden-size=8", "did you mean --hidden-size?"]),
        (["--data-imp", "mmap"], ["--data-imp=mmap", "did you mean --data-impl?"]),
        (["--data-impl", "lazy"], ["--data-impl='lazy'", "mmap"]),
        (["--num-layers", "2", "3"], ["unexpected value", "'3'"]),
        (["--lr"], ["--lr", "expected one argument", "--lr FLOAT"]),
        (["--lr", "--bf16"], ["--lr", "expected one argument"]),
        (["--bf16=yes"], ["--bf16", "'yes'", "switch"]),
        (["--rampup-batch-size", "1", "2"], ["--rampup-batch-size", "INT INT INT"]),
        (["--num-layers", "two"], ["--num-layers='two'", "whole number"]),
        (["--num-layers", "2.0"], ["--num-layers='2.0'", "whole number"]),
        (["--seq-length", "1e3"], ["--seq-length='1e3'"]),
        (["--lr", "fast"], ["--lr='fast'", "a number"]),
        (["--rampup-batch-size", "1", "x", "3"], ["--rampup-batch-size=['1', 'x', '3']"]),
        (["--position-embedding-type", "ropee"], ["--position-embedding-type='ropee'",
                                                  "did you mean 'rope'?"]),
        (["--lr-decay-style", "step"], ["--lr-decay-style='step'", "constant, linear, cosine"]),
    ],
)
def test_bad_command_lines_raise_one_line_naming_the_flag(argv, expected):
    message = _raises(argv)
    for text in expected:
        assert text in message


# --------------------------------------------------------------------------- YAML


def test_yaml_config_and_command_line_precedence(tmp_path):
    path = _write(tmp_path, """
num-layers: 12
hidden_size: 768
lr: 6e-4            # YAML 1.1 reads this as a string; it is still a float flag
train-samples: 1_000_000
bf16: true
rampup-batch-size: [16, 16, 5_000]
position_embedding_type: rope
ffn-hidden-size: null
tensorboard-dir: runs/tb
""")
    cfg = parse_args(["--config", path, "--num-layers", "24", "--seed", "7"])
    assert cfg.model.num_layers == 24  # the flag overrides YAML
    assert cfg.model.hidden_size == 768
    assert cfg.optimizer.lr == 6e-4
    assert cfg.training.train_samples == 1_000_000
    assert cfg.precision.bf16 is True
    assert cfg.training.rampup_batch_size == (16, 16, 5000)
    assert cfg.model.position_embedding_type == "rope"
    assert cfg.model.ffn_hidden_size is None
    assert cfg.logging.tensorboard_dir == "runs/tb"
    assert cfg.training.seed == 7


def test_config_flag_position_does_not_matter(tmp_path):
    path = _write(tmp_path, "num_layers: 12\n")
    assert parse_args(["--num-layers", "3", "--config", path]).model.num_layers == 3


def test_empty_yaml_is_all_defaults(tmp_path):
    assert parse_args(["--config", _write(tmp_path, "# nothing\n")]) == parse_args([])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("num-layer: 2\n", ["'num-layer'", "did you mean 'num-layers'?"]),
        ("--num-layers: 2\n", ["'--num-layers'", "without the '--'"]),
        ("config: other.yaml\n", ["'config'"]),
        ("num_layers: abc\n", ["--num-layers='abc'", "whole number"]),
        ("num_layers: 2.5\n", ["--num-layers=2.5"]),
        ("bf16: 1\n", ["--bf16=1", "true or false"]),
        ("hidden_dropout: true\n", ["--hidden-dropout=True"]),
        ("lr: [1, 2]\n", ["--lr=[1, 2]"]),
        ("seed: null\n", ["--seed=None"]),
        ("rampup_batch_size: [1, 2]\n", ["--rampup-batch-size=[1, 2]", "3 values"]),
        ("pp_partition_method: 3\n", ["--pp-partition-method=3", "a string"]),
        ("normalization: batchnorm\n", ["--normalization='batchnorm'", "layernorm, rmsnorm"]),
        ("num-layers: 2\nnum_layers: 3\n", ["twice", "'num_layers'"]),
        ("- num_layers\n- 2\n", ["not a mapping", "--config="]),
        ("just a string\n", ["not a mapping"]),
        ("num_layers: [1, 2\n", ["not valid YAML", "--config="]),
    ],
)
def test_bad_yaml_raises_one_line(tmp_path, text, expected):
    path = _write(tmp_path, text)
    message = _raises(["--config", path])
    assert path in message
    for part in expected:
        assert part in message


def test_missing_config_file(tmp_path):
    message = _raises(["--config", str(tmp_path / "nope.yaml")])
    assert "not found" in message and "nope.yaml" in message


def test_config_dict_yaml_round_trip():
    cfg = parse_args(["--num-layers", "4", "--lr", "1e-4", "--rampup-batch-size", "2", "2", "10",
                      "--swiglu", "--position-embedding-type", "rope", "--loss-scale", "128"])
    values = config_to_dict(cfg)
    assert values["rampup_batch_size"] == [2, 2, 10]
    assert config_from_dict(yaml.safe_load(yaml.safe_dump(values))) == cfg


def test_yaml_written_from_a_config_loads_back(tmp_path):
    cfg = parse_args(["--hidden-size", "64", "--fp16"])
    path = _write(tmp_path, yaml.safe_dump(config_to_dict(cfg)))
    assert parse_args(["--config", path]) == cfg


def test_format_config_is_sorted_megatron_lines():
    text = format_config(parse_args(["--num-layers", "24"]))
    lines = text.splitlines()[1:-1]
    names = [line.split()[0] for line in lines]
    assert names == sorted(field_specs())
    assert "  num_layers ...................................... 24" in lines
    assert all(line.split()[1].strip(".") == "" for line in lines)


def test_format_config_shows_the_values_a_run_resolves():
    cfg = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                      "--micro-batch-size", "2", "--tensor-model-parallel-size", "2",
                      "--seq-length", "32"])
    lines = format_config(cfg, world_size=8).splitlines()
    for name, value in [("ffn_hidden_size", 256), ("max_position_embeddings", 32),
                        ("num_query_groups", 4), ("kv_channels", 16), ("global_batch_size", 8),
                        ("data_parallel_size", 4)]:
        assert f"  {name} {'.' * (48 - len(name))} {value}" in lines, name


# --------------------------------------------------------------------------- real scripts

GPT2_345M = """
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16
    --seq-length 1024 --max-position-embeddings 1024
    --micro-batch-size 4 --global-batch-size 512 --rampup-batch-size 32 32 1_953_125
    --train-samples 146_484_375 --lr-decay-samples 126_953_125 --lr-warmup-samples 183_105
    --lr 1.5e-4 --min-lr 1.0e-5 --lr-decay-style cosine --weight-decay 1e-2 --clip-grad 1.0
    --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --init-method-std 0.02
    --fp16 --loss-scale-window 1000 --hysteresis 2 --min-loss-scale 1 --initial-loss-scale 4096
    --checkpoint-activations --log-interval 10 --eval-interval 1000 --eval-iters 10
    --mock-data --vocab-size 50257 --seed 42
"""

BLOOM_STYLE = """
    --tensor-model-parallel-size 4 --pipeline-model-parallel-size 12
    --num-layers 70 --hidden-size 14336 --num-attention-heads 112 --seq-length 2048
    --micro-batch-size 2 --global-batch-size 2048 --rampup-batch-size 192 16 9_765_625
    --train-samples 220_000_000 --lr 6e-5 --min-lr 6e-6 --lr-decay-style cosine
    --lr-decay-samples 200_000_000 --lr-warmup-samples 216_320 --clip-grad 1.0
    --weight-decay 1e-1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8
    --init-method-std 0.0048 --embed-layernorm --position-embedding-type alibi
    --bf16 --zero-stage 1 --pp-partition-method 'type:transformer|embedding'
    --hidden-dropout 0.0 --attention-dropout 0.0 --seed 42
    --log-interval 1 --eval-interval 1000 --eval-iters 1 --tensorboard-dir tb/bloom
"""

LLAMA_STYLE = """
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008
    --seq-length 4096 --max-position-embeddings 4096 --position-embedding-type rope
    --rotary-base 10000 --normalization rmsnorm --layernorm-epsilon 1e-6 --swiglu
    --disable-bias-linear --untie-embeddings-and-output-weights
    --hidden-dropout 0 --attention-dropout 0
    --micro-batch-size 1 --global-batch-size 1024 --train-iters 250_000
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01
    --weight-decay 0.1 --adam-beta2 0.95 --adam-eps 1e-5 --bf16
"""


def test_gpt2_megatron_deepspeed_command_line():
    cfg = parse_args(shlex.split(GPT2_345M))
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads) == (
        24, 1024, 16)
    assert cfg.model.position_embedding_type == "learned_absolute"
    assert cfg.model.checkpoint_activations and cfg.model.ffn_size == 4096
    assert cfg.training.rampup_batch_size == (32, 32, 1_953_125)
    assert cfg.training.train_samples == 146_484_375 and cfg.training.train_iters is None
    assert cfg.lr_schedule.lr_decay_style == "cosine"
    assert cfg.lr_schedule.lr_warmup_samples == 183_105
    assert cfg.precision.fp16 and cfg.precision.initial_loss_scale == 4096.0
    assert cfg.data.mock_data and cfg.model.vocab_size == 50257
    validate(cfg, world_size=1)  # every ramp size 32k divides micro x DP = 4 x 1


def test_bloom_style_command_line():
    cfg = parse_args(shlex.split(BLOOM_STYLE))
    assert cfg.parallel.tensor_model_parallel_size == 4
    assert cfg.parallel.pipeline_model_parallel_size == 12
    assert cfg.parallel.zero_stage == 1
    assert cfg.parallel.pp_partition_method == "type:transformer|embedding"
    assert cfg.model.position_embedding_type == "alibi" and cfg.model.embed_layernorm
    assert cfg.model.hidden_dropout == 0.0 and cfg.precision.params_dtype_name == "bfloat16"
    assert cfg.training.rampup_batch_size == (192, 16, 9_765_625)
    assert cfg.optimizer.weight_decay == pytest.approx(0.1)
    assert cfg.logging.tensorboard_dir == "tb/bloom"


def test_llama_style_command_line():
    cfg = parse_args(shlex.split(LLAMA_STYLE))
    model = cfg.model
    assert model.position_embedding_type == "rope" and model.normalization == "rmsnorm"
    assert model.swiglu and not model.add_bias and not model.tie_embeddings
    assert model.ffn_size == 11008 and model.layernorm_epsilon == 1e-6
    assert cfg.training.train_iters == 250_000
    assert cfg.lr_schedule.lr_warmup_fraction == 0.01
    assert cfg.optimizer.adam_beta2 == 0.95 and cfg.optimizer.adam_beta1 == 0.9


LLAMA3_70B = """
    --num-layers 80 --hidden-size 8192 --num-attention-heads 64 --group-query-attention
    --num-query-groups 8 --ffn-hidden-size 28672 --seq-length 8192
    --position-embedding-type rope --rotary-base 500000 --normalization rmsnorm
    --norm-epsilon 1e-5 --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
    --micro-batch-size 1 --train-iters 10 --lr 1e-4
"""


def test_llama3_70b_shape_maps_one_to_one():
    """Megatron-LM's flags for a Llama-3-70B: grouped-query attention, --norm-epsilon."""
    model = parse_args(shlex.split(LLAMA3_70B)).model
    assert (model.num_attention_heads, model.query_groups, model.head_dim) == (64, 8, 128)
    assert model.layernorm_epsilon == 1e-5 and model.rotary_base == 500_000


def test_an_alias_names_one_field_in_yaml_too(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("norm-epsilon: 1e-6\n")
    assert parse_args(["--config", str(path)]).model.layernorm_epsilon == 1e-6
    path.write_text("norm-epsilon: 1e-6\nlayernorm-epsilon: 1e-5\n")
    with pytest.raises(ConfigError, match="key given twice"):
        parse_args(["--config", str(path)])


def test_a_yaml_integer_past_float_range_is_one_line(tmp_path):
    """YAML reads a 401-digit number as an int; as a float field it is out of range."""
    path = tmp_path / "run.yaml"
    path.write_text(f"lr: {10**400}\n")
    argv = [*shlex.split(LLAMA3_70B)[:-2], "--mock-data", "--vocab-size", "100"]  # no --lr
    cfg = parse_args(["--config", str(path), *argv])
    with pytest.raises(ConfigError, match="--lr must be a finite number"):
        validate(cfg, 1)
