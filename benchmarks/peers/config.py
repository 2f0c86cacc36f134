"""The one model and optimizer every framework trains, and the layouts (rows) it runs at.

Everything a worker needs to build its side travels as one JSON file written from
``PeerConfig``, so no framework sees a setting the others do not.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class PeerConfig:
    """A GPT-2-flavour model (learned positions, LayerNorm, tanh GeLU, tied head), fp32,
    no dropout, trained with AdamW at a constant learning rate."""

    num_layers: int = 8
    hidden_size: int = 256
    num_heads: int = 8
    seq_length: int = 128
    vocab_size: int = 1024  # a multiple of 128 x TP: no padding rows on any side
    global_batch_size: int = 16
    micro_batch_size: int = 4  # 4 micro-batches per step at DP 1: pipelines have work
    steps: int = 10
    warmup_steps: int = 3  # step times before this are not in the median
    # the loss falls steadily; at 1e-3 Adam's normalised steps amplify the rounding of
    # reordered sums to a few 1e-5 by step 10, too close to the 1e-4 agreement check
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.01  # not on biases and norm weights, everywhere
    clip_grad: float = 1.0  # Megatron-Core's and DeepSpeed's default, set on every side
    init_std: float = 0.02
    layernorm_eps: float = 1e-5
    seed: int = 1234

    @property
    def ffn_size(self) -> int:
        return 4 * self.hidden_size

    def to_json(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def from_json(cls, path: Path) -> PeerConfig:
        return cls(**json.loads(path.read_text()))


def build_config(quick: bool) -> PeerConfig:
    """The comparison's configuration. ``--quick`` keeps the model (10 steps are what the
    loss check needs) and the full run takes more steps for steadier median times."""
    return PeerConfig(steps=10) if quick else PeerConfig(steps=30, warmup_steps=5)


@dataclass(frozen=True, kw_only=True)
class Row:
    """One framework at one layout: a torchrun of ``world_size`` processes running the
    framework's worker (``runner.WORKERS``) with ``options`` (framework-specific, e.g. the
    ZeRO stage)."""

    framework: str
    variant: str  # what the framework runs, e.g. "ZeRO-1", "FSDP2", "1F1B"
    tp: int = 1
    pp: int = 1
    dp: int = 1
    options: tuple[tuple[str, str], ...] = ()
    baseline: str = ""  # the megatron3d variant at this layout it is timed against

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def layout(self) -> str:
        return f"({self.tp},{self.pp},{self.dp})"

    @property
    def label(self) -> str:
        return f"{self.framework} {self.variant}"

    def option(self, name: str, default: str = "") -> str:
        return dict(self.options).get(name, default)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> Row:
        return cls(**{**raw, "options": tuple(tuple(o) for o in raw["options"])})


REFERENCE = Row(framework="megatron3d", variant="ZeRO-0", baseline="ZeRO-0")
"""The single-process run every loss is compared with, and every time is divided by."""


def megatron3d_rows() -> list[Row]:
    def m3d(variant: str, tp: int = 1, pp: int = 1, dp: int = 1, **options: str) -> Row:
        return Row(framework="megatron3d", variant=variant, tp=tp, pp=pp, dp=dp,
                   options=tuple(options.items()), baseline=variant)

    return [REFERENCE, m3d("ZeRO-0", tp=2), m3d("1F1B", pp=2),
            m3d("interleaved 1F1B", pp=2, virtual="2"),
            m3d("ZeRO-0", dp=2, zero="0"), m3d("ZeRO-1", dp=2, zero="1"),
            m3d("ZeRO-3", dp=2, zero="3"), m3d("ZeRO-1", tp=2, pp=2, dp=2, zero="1")]


def torch_rows() -> list[Row]:
    def pt(variant: str, baseline: str, tp: int = 1, pp: int = 1, dp: int = 1) -> Row:
        return Row(framework="pytorch", variant=variant, tp=tp, pp=pp, dp=dp,
                   baseline=baseline)

    return [pt("DTensor TP", "ZeRO-0", tp=2), pt("pipelining 1F1B", "1F1B", pp=2),
            pt("pipelining interleaved 1F1B", "interleaved 1F1B", pp=2),
            pt("DDP", "ZeRO-0", dp=2), pt("FSDP2", "ZeRO-3", dp=2)]


def mcore_rows() -> list[Row]:
    """Megatron-Core at megatron3d's layouts; its distributed optimizer is ZeRO-1."""
    def mc(variant: str, baseline: str, tp: int = 1, pp: int = 1, dp: int = 1,
           **options: str) -> Row:
        return Row(framework="megatron-core", variant=variant, tp=tp, pp=pp, dp=dp,
                   options=tuple(options.items()), baseline=baseline)

    return [mc("DDP", "ZeRO-0"), mc("DDP", "ZeRO-0", tp=2), mc("1F1B", "1F1B", pp=2),
            mc("interleaved 1F1B", "interleaved 1F1B", pp=2, virtual="2"),
            mc("DDP", "ZeRO-0", dp=2),
            mc("distributed optimizer", "ZeRO-1", dp=2, **{"distributed-optimizer": "1"}),
            mc("distributed optimizer", "ZeRO-1", tp=2, pp=2, dp=2,
               **{"distributed-optimizer": "1"})]


def deepspeed_rows() -> list[Row]:
    def ds(variant: str, baseline: str, pp: int = 1, dp: int = 1, zero: str = "0") -> Row:
        return Row(framework="deepspeed", variant=variant, pp=pp, dp=dp,
                   options=(("zero", zero),), baseline=baseline)

    return [ds("PipelineModule", "1F1B", pp=2), ds("ZeRO-1", "ZeRO-1", dp=2, zero="1"),
            ds("ZeRO-3", "ZeRO-3", dp=2, zero="3")]


NODES = 2
"""The node rows' nodes: their 4 ranks as 2 nodes x 2 (``--gpus-per-node``, FSDP2's mesh)."""
FLAG_OPTIONS = {"zero3-shard-group": True, "zero3-secondary-shard": True, "gpus-per-node": True,
                "zero3-quantize-weights": False, "zero3-quantize-grads": False}
"""Row options that are pretrain_gpt.py flags of the same name: whether each takes the
option's value (else it is a switch)."""


def node_rows() -> list[Row]:
    """ZeRO-3 on 2 nodes x 2 ranks: flat, hybrid and with a secondary shard (int8 or not),
    every one timed against flat; FSDP2 flat and hybrid (HSDP) against flat too."""
    per_node = ("gpus-per-node", str(4 // NODES))

    def m3d(variant: str, *options: tuple[str, str]) -> Row:
        return Row(framework="megatron3d", variant=variant, dp=4,
                   options=(("zero", "3"), per_node, *options), baseline="ZeRO-3")

    hybrid, secondary = ("zero3-shard-group", "node"), ("zero3-secondary-shard", "node")
    weights, grads = ("zero3-quantize-weights", "1"), ("zero3-quantize-grads", "1")
    return [m3d("ZeRO-3"), m3d("ZeRO-3 hybrid", hybrid),
            m3d("ZeRO-3 hybrid int8 grads", hybrid, grads),
            m3d("ZeRO-3 secondary shard", secondary),
            m3d("ZeRO-3 secondary shard int8", secondary, weights, grads),
            Row(framework="pytorch", variant="FSDP2", dp=4, baseline="ZeRO-3"),
            Row(framework="pytorch", variant="FSDP2 hybrid", dp=4,
                options=(("nodes", str(NODES)),), baseline="ZeRO-3")]


def all_rows() -> list[Row]:
    return (megatron3d_rows() + torch_rows() + mcore_rows() + deepspeed_rows()
            + node_rows())


def run_order(rows: list[Row]) -> list[Row]:
    """The reference first (it writes the weights every row starts from), then layout by
    layout, in order of first appearance, megatron3d's rows before the peers': a round runs
    each comparison's rows within a minute of each other."""
    layouts = list(dict.fromkeys(r.layout for r in rows))
    rest = [r for r in rows if r != REFERENCE]
    return [REFERENCE] + sorted(rest, key=lambda r: (layouts.index(r.layout),
                                                     r.framework != "megatron3d"))
