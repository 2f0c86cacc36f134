"""Megatron-DeepSpeed command-line flags and YAML config files -> ``TrainConfig``.

The only module that knows the training flags or YAML (``cli.OneLineParser``, the argparse
front end shared with tools/, reports the mistakes). The parser is generated from the fields
of ``config.SECTIONS`` (flag ``--foo-bar`` for field ``foo_bar``), so a new field is a new
flag without touching this file. Precedence: dataclass defaults < ``--config`` YAML < flags.

Every mistake raises ``ConfigError`` with one line naming the flag, the value and the fix;
argparse never prints usage and exits by itself (``--help`` still prints and exits 0).
This module only builds the config: cross-field checks are ``validation.validate``'s job,
because they need the world size, which is unknown while parsing.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import math
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from megatron3d.cli import compat
from megatron3d.cli.common import COMMAND_LINE, OneLineParser
from megatron3d.config import SECTIONS, Range, TrainConfig, flat_fields
from megatron3d.errors import ConfigError

CONFIG_FLAG = "--config"
_METAVARS = {int: "INT", float: "FLOAT", str: "STR"}
_EXPECTED = {
    int: "a whole number such as 24 (underscores allowed: 9_765_625)",
    float: "a number such as 3e-4",
    str: "a string",
    bool: "true or false",
}


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """What one config field accepts, read once from its dataclass annotation."""

    section: str
    name: str
    kind: type  # int, float, str or bool; the element type for tuples
    optional: bool  # None is a valid value (meaning "unset, use the documented default")
    choices: tuple[str, ...] | None
    nargs: int | str | None  # a count, "+" for one or more, None for a single value
    default: Any
    help: str
    bounds: Range | None  # the values validation accepts, shown in --help
    aliases: tuple[str, ...] = ()  # other names of the field (Megatron-LM's spelling)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def flags(self) -> list[str]:
        return [self.flag] + ["--" + a.replace("_", "-") for a in self.aliases]

    @property
    def metavar(self) -> str:
        if self.choices:
            return "{" + ",".join(self.choices) + "}"
        return _METAVARS[self.kind]

    @property
    def expected(self) -> str:
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.nargs == "+":
            return f"one or more values, each {_EXPECTED[self.kind]}"
        if self.nargs:
            return f"{self.nargs} values, each {_EXPECTED[self.kind]}"
        return _EXPECTED[self.kind]


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (annotation, False)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        assert len(args) == 1, f"unsupported union annotation {annotation}"
        return args[0], True
    return annotation, False


def _field_spec(section: str, field: dataclasses.Field, annotation: Any) -> FieldSpec:
    inner, optional = _unwrap_optional(annotation)
    kind, choices, nargs = inner, None, None
    if typing.get_origin(inner) is Literal:
        choices = typing.get_args(inner)
        kind = type(choices[0])
    elif typing.get_origin(inner) is tuple and typing.get_args(inner)[-1] is Ellipsis:
        kind, nargs = typing.get_args(inner)[0], "+"
    elif typing.get_origin(inner) is tuple:
        elements = typing.get_args(inner)
        kind, nargs = elements[0], field.metadata.get("nargs", len(elements))
        assert nargs == len(elements) and len(set(elements)) == 1, f"bad tuple field {field.name}"
    assert kind in _EXPECTED, f"field {field.name}: no flag type for {annotation}"
    assert kind is not bool or field.default is False, f"bool field {field.name} must default False"
    return FieldSpec(
        section=section,
        name=field.name,
        kind=kind,
        optional=optional or field.default is None,
        choices=choices,
        nargs=nargs,
        default=field.default,
        help=field.metadata["help"],
        bounds=field.metadata["range"],
        aliases=field.metadata.get("aliases", ()),
    )


@functools.cache
def field_specs() -> Mapping[str, FieldSpec]:
    """Field name -> spec for every field of every section, in ``--help`` order (read-only)."""
    specs: dict[str, FieldSpec] = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            assert field.name not in specs, f"field {field.name} appears in two sections"
            specs[field.name] = _field_spec(section, field, hints[field.name])
    return types.MappingProxyType(specs)


# --------------------------------------------------------------------------- values


def _convert(kind: type, value: Any) -> Any:
    """``value`` as ``kind``; ValueError if it is not one. Strings come from the command line
    or from YAML (which reads ``1e-4`` as a string); ``int()`` accepts ``9_765_625``."""
    if isinstance(value, bool) != (kind is bool):  # bool is an int subclass: never mix them
        raise ValueError(value)
    if isinstance(value, kind):
        return value
    if kind is float and isinstance(value, int):
        return float(value) if abs(value) < 2**1024 else math.inf  # range checks refuse it
    if kind in (int, float) and isinstance(value, str):
        return kind(value.strip())
    raise ValueError(value)


def coerce(spec: FieldSpec, value: Any, source: str) -> Any:
    """Check and convert one raw value (a string, or a YAML scalar or list) for ``spec``.

    ``source`` says where the value came from, worded to follow "invalid value", e.g.
    "on the command line" or "in config file run.yaml".
    """
    if value is None and spec.optional:
        return None
    try:
        if spec.nargs == "+" and isinstance(value, str):  # YAML: "0.3 a 0.7 b"
            value = value.split()
        if spec.nargs is None:
            result = _convert(spec.kind, value)
        elif isinstance(value, list | tuple) and value and (
                spec.nargs == "+" or len(value) == spec.nargs):
            result = tuple(_convert(spec.kind, item) for item in value)
        else:
            raise ValueError(value)
    except ValueError:
        raise ConfigError(
            f"invalid value {source} ({spec.flag}={value!r}): expected {spec.expected}"
        ) from None
    if spec.choices and result not in spec.choices:
        close = difflib.get_close_matches(result, spec.choices, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"invalid choice {source} ({spec.flag}={value!r}): expected {spec.expected}{hint}"
        )
    return result


def _coerce_all(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    specs = field_specs()
    return {name: coerce(specs[name], value, source) for name, value in raw.items()}


def _field_name(key: Any, source: str) -> str:
    """A YAML key (flag name with dashes or underscores, no ``--``) -> field name."""
    name = key.replace("-", "_") if isinstance(key, str) else ""
    if name in field_specs():
        return name
    alias_of = {a: spec.name for spec in field_specs().values() for a in spec.aliases}
    if name in alias_of:
        return alias_of[name]
    close = difflib.get_close_matches(name.lstrip("_"), list(field_specs()), n=1)
    hint = f"did you mean {close[0].replace('_', '-')!r}?" if close else "see --help for the flags"
    raise ConfigError(
        f"unknown key {source} ({key!r}): {hint} (keys are flag names without the '--')"
    )


def _normalise_keys(raw: Mapping[Any, Any], source: str) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = _field_name(key, source)
        if name in values:
            raise ConfigError(
                f"key given twice {source} ({key!r}): keep one spelling of {name!r}"
            )
        values[name] = value
    return values


def _assemble(values: Mapping[str, Any]) -> TrainConfig:
    """Checked field values -> TrainConfig; fields not given keep their dataclass default."""
    specs = field_specs()
    by_section: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for name, value in values.items():
        by_section[specs[name].section][name] = value
    return TrainConfig(**{s: cls(**by_section[s]) for s, cls in SECTIONS.items()})


def config_from_dict(raw: Mapping[Any, Any], source: str = "in the mapping") -> TrainConfig:
    """A flat ``{flag name: value}`` mapping (the YAML form) -> TrainConfig."""
    return _assemble(_coerce_all(_normalise_keys(raw, source), source))


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """Flat ``{field name: value}`` of every field, in section order.

    Keys use the underscore spelling of the flag names (``num_layers`` for ``--num-layers``),
    which the YAML ``--config`` file accepts, so ``config_from_dict(config_to_dict(cfg))``
    round-trips; tuples become lists so ``yaml.safe_dump`` can write them.
    """
    return {name: list(value) if isinstance(value, tuple) else value
            for name, value in flat_fields(cfg).items()}


def format_config(cfg: TrainConfig, world_size: int | None = None) -> str:
    """The Megatron-style block of sorted ``name ..... value`` lines logged once at start.

    With ``world_size``, fields left unset for a derived default show the value the run uses
    (``ffn_hidden_size`` 4h, ``global_batch_size`` micro-batch x DP, ...), and
    ``data_parallel_size`` is added, as Megatron prints its resolved arguments."""
    values = config_to_dict(cfg)
    if world_size is not None:
        values.update(_resolved(cfg, world_size))
    lines = ["------------------------ arguments ------------------------"]
    for name, value in sorted(values.items()):
        lines.append(f"  {name} {'.' * max(3, 48 - len(name))} {value}")
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)


def _resolved(cfg: TrainConfig, world_size: int) -> dict[str, Any]:
    model, dp = cfg.model, cfg.parallel.data_parallel_size(world_size)
    if model.hidden_size is None or model.num_attention_heads is None:
        return {"data_parallel_size": dp}
    return {"ffn_hidden_size": model.ffn_size, "max_position_embeddings": model.max_positions,
            "num_query_groups": model.query_groups, "kv_channels": model.head_dim,
            "global_batch_size": cfg.training.global_batch_size
            or cfg.training.micro_batch_size * dp, "data_parallel_size": dp}


# --------------------------------------------------------------------------- YAML


def read_config_file(path: str) -> dict[str, Any]:
    """The ``--config`` YAML file as ``{field name: raw value}``; ConfigError if unusable."""
    where = f"({CONFIG_FLAG}={path})"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found {where}: check the path") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file {where}: {err}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        detail = " ".join(str(err).split())
        raise ConfigError(f"config file is not valid YAML {where}: fix {detail}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config file is a {type(raw).__name__}, not a mapping {where}: "
            "write one 'flag-name: value' per line"
        )
    return _normalise_keys(raw, f"in config file {path}")


# --------------------------------------------------------------------------- argparse


def _help_text(spec: FieldSpec) -> str:
    text = spec.help
    if spec.default is not None and spec.default is not False:
        text += f" Default: {spec.default}."
    if spec.bounds is not None:
        text += f" Allowed: {spec.bounds}."
    return text.replace("%", "%%")  # argparse %-formats help strings


def build_parser(prog: str | None = None) -> OneLineParser:
    """One flag per config field, grouped by section. Values stay strings: ``coerce`` converts
    them, so the command line and YAML share one set of checks and error messages. Flags not
    given are absent from the namespace, which is how YAML values survive unless overridden."""
    parser = OneLineParser(
        prog=prog,
        description="Train a GPT model with tensor, pipeline and data parallelism.",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument(
        CONFIG_FLAG, metavar="FILE", default=argparse.SUPPRESS,
        help="YAML mapping of flag names (without '--') to values; flags given on the "
        "command line override it.",
    )
    groups = {
        section: parser.add_argument_group(section, (cls.__doc__ or "").strip())
        for section, cls in SECTIONS.items()
    }
    for spec in field_specs().values():
        kwargs: dict[str, Any] = {"action": "store_true"} if spec.kind is bool else {
            "metavar": spec.metavar, "nargs": spec.nargs,
        }
        groups[spec.section].add_argument(
            *spec.flags, dest=spec.name, default=argparse.SUPPRESS, help=_help_text(spec), **kwargs
        )
    return parser


def _parse_command_line(argv: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """Flags actually given -> raw values (strings, string lists, True for switches), after
    the Megatron flags table (``compat``) rewrote them; and its notices."""
    parser = build_parser()
    translation = compat.translate(argv, parser.known_flags())
    problems = translation.problems
    if len(problems) == 1:
        shown, why = problems[0]
        raise ConfigError(f"cannot use a flag {COMMAND_LINE} ({shown}): {why}")
    if problems:
        by_reason: dict[str, list[str]] = {}  # flags refused for one reason are listed once
        for shown, why in problems:
            by_reason.setdefault(why, []).append(shown)
        listed = "; ".join(f"({', '.join(flags)}) {why}" for why, flags in by_reason.items())
        raise ConfigError(f"{len(problems)} flags {COMMAND_LINE} cannot be used: {listed}")
    return vars(parser.parse(translation.argv)), translation.notices


def parse_command_line(argv: list[str] | None = None) -> tuple[TrainConfig, list[str]]:
    """Command line (``sys.argv[1:]`` by default) plus optional ``--config`` YAML -> config,
    and one notice line per Megatron flag that was aliased or ignored (log them at start).

    Raises ConfigError for unknown or refused flags (all of them in one line), unknown keys
    and badly typed values; ``--help`` prints the flags and exits 0. The result is not yet
    validated: call ``validation.validate``.
    """
    cfg, notices, _ = parse_given(argv)
    return cfg, notices


def parse_given(argv: list[str] | None = None) -> tuple[TrainConfig, list[str], frozenset[str]]:
    """``parse_command_line``, and the fields the command line or YAML set (what
    ``--use-checkpoint-args`` must not replace)."""
    given, notices = _parse_command_line(sys.argv[1:] if argv is None else argv)
    config_path = given.pop("config", None)
    values: dict[str, Any] = {}
    if config_path is not None:
        source = f"in config file {config_path}"
        values.update(_coerce_all(read_config_file(config_path), source))
    values.update(_coerce_all(given, COMMAND_LINE))
    return _assemble(values), notices, frozenset(values)


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """``parse_command_line`` without the notices (tests, tools)."""
    return parse_command_line(argv)[0]
