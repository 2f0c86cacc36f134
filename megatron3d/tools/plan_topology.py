"""Rank the layouts of a model on a cluster before spending GPU hours on it.

Which TP, CP, PP, DP, micro-batch size, ZeRO stage, recompute, partition method, model
chunks per rank and sequence parallelism to use, for example:

    python tools/plan_topology.py --nodes 48 --gpus-per-node 8 --inter-node-gbps 400 \
        --num-layers 70 --hidden-size 14336 --num-attention-heads 112 --seq-length 2048 \
        --vocab-size 250680 --global-batch-size 2048 --rampup-batch-size 192 16 9765625 \
        --bf16 --position-embedding-type alibi --embed-layernorm

Takes pretrain_gpt.py's flags (the model, batch sizes and rampup, precision, ...) plus the
cluster's. Every layout is judged by pretrain_gpt.py's own validation, then by the memory
model of every pipeline rank (the start-up check's, ``megatron3d/accounting/fit.py``: a
layout whose peak leaves less than ``--memory-headroom`` of a GPU free is not feasible) and
the time model (``megatron3d/planner``); the table ranks feasible layouts by estimated
iteration time and gives each infeasible one its reason. A dimension given as a flag is
fixed instead of enumerated: ``--tp``/``--pp`` (or their long spellings),
``--micro-batch-size``, ``--zero-stage``, ``--recompute-granularity`` or
``--checkpoint-activations``, ``--pp-partition-method``,
``--virtual-pipeline-model-parallel-size``, ``--sequence-parallel``,
``--context-parallel-size`` (searched over 1, 2, 4, 8 from 8192-token sequences on; the
exchange is ``--cp-comm-type``'s, p2p by default), ``--zero3-shard-group`` or
``--zero3-secondary-shard`` (ZeRO-3 across nodes: flat, hybrid and secondary shard are
searched when the weights' replicas span nodes; ``--zero3-quantize-*`` apply as given). The
table's x-node column is ZeRO-3's GB a rank receives from other nodes per step. Flags that
change no layout may be left out:
without a data source the plan assumes ``--mock-data``, without ``--lr`` a learning rate of 1,
without a run length ``--train-iters 1`` (they only let validation run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from megatron3d.cli import compat
from megatron3d.cli.arguments import (
    build_parser,
    field_specs,
    parse_command_line,
    read_config_file,
)
from megatron3d.cli.common import OneLineParser, add_float, add_int, run_tool
from megatron3d.config import ParallelConfig, TrainConfig
from megatron3d.config.ranges import AT_LEAST_ONE, Range
from megatron3d.errors import ConfigError
from megatron3d.planner.hardware import A100_80GB, Cluster
from megatron3d.planner.report import summary, table, to_json
from megatron3d.planner.search import Fixed, Planner

# Far past any cluster or GPU, small enough that byte counts and rank enumeration stay
# exact and quick (1e300 GiB overflows the byte count; 10**12 nodes, the layout search).
COUNT, HARDWARE = Range(1, 2**16), Range(0, 2**20, low_open=True)
_MODEL = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
_ALIASES = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size"}
_SWITCHES = {"--json"}  # the planner's flags that take no value


def _planner_parser() -> OneLineParser:
    p = OneLineParser(prog="plan_topology.py", description=__doc__.splitlines()[0],
                      epilog="Every pretrain_gpt.py flag is accepted too "
                      "(python pretrain_gpt.py --help).")
    add_int(p, "--nodes", COUNT, "Nodes of the cluster.", required=True)
    add_int(p, "--gpus-per-node", COUNT, "GPUs per node.", required=True)
    add_float(p, "--gpu-memory-gb", HARDWARE, "GiB per GPU, as nvidia-smi lists it.",
              default=A100_80GB["gpu_memory_gb"])
    add_float(p, "--gpu-peak-tflops", HARDWARE, "Dense bf16/fp16 peak TFLOP/s per GPU.",
              default=A100_80GB["gpu_peak_tflops"])
    add_float(p, "--intra-node-gbps", HARDWARE, "One GPU's NVLink bandwidth to the others of "
              "its node, one direction, Gb/s.", default=A100_80GB["intra_node_gbps"])
    add_float(p, "--inter-node-gbps", HARDWARE, "One node's network bandwidth, all links "
              "together, one direction, Gb/s.", default=A100_80GB["inter_node_gbps"])
    add_int(p, "--tp", AT_LEAST_ONE, "Fix the tensor-parallel size.")
    add_int(p, "--pp", AT_LEAST_ONE, "Fix the pipeline-parallel size.")
    add_int(p, "--top", Range(0), "Table rows to print (0: all).", default=25)
    p.add_argument("--json", action="store_true", help="Write every layout as JSON instead.")
    return p


def _split(argv: list[str], mine: set[str]) -> tuple[list[str], list[str]]:
    """(the planner's flags with their values, the rest for pretrain_gpt.py's parser)."""
    own, rest, i = [], [], 0
    while i < len(argv):
        word = argv[i]
        name, eq, _ = word.partition("=")
        target = own if name in mine else rest
        target.append(word)
        i += 1
        takes_value = name in mine and name not in _SWITCHES and not eq
        if takes_value and i < len(argv) and not argv[i].startswith("--"):
            own.append(argv[i])
            i += 1
    return own, rest


def _given(rest: list[str]) -> set[str]:
    """Config fields the command line (or its --config file) sets."""
    parser = build_parser()
    values = vars(parser.parse(compat.translate(rest, parser.known_flags()).argv))
    from_file = read_config_file(values["config"]) if "config" in values else {}
    return set(values) | set(from_file)


def _fixed(args: argparse.Namespace, cfg: TrainConfig, given: set[str]) -> Fixed:
    """The dimensions the command line chose (``given``: the config fields it sets)."""
    for short, field in _ALIASES.items():
        if getattr(args, short) is not None and field in given:
            raise ConfigError(f"--{short} and --{field.replace('_', '-')} both fix one size: "
                              "give one of them")
    if "num_layers_per_virtual_pipeline_stage" in given:
        raise ConfigError("--num-layers-per-virtual-pipeline-stage depends on the PP the "
                          "planner chooses: fix the chunks with "
                          "--virtual-pipeline-model-parallel-size")
    parallel, model = cfg.parallel, cfg.model
    recompute = {"checkpoint_activations", "recompute_granularity"} & given
    return Fixed(
        tp=args.tp or (parallel.tensor_model_parallel_size if _ALIASES["tp"] in given else None),
        pp=args.pp or (parallel.pipeline_model_parallel_size if _ALIASES["pp"] in given
                       else None),
        micro_batch_size=cfg.training.micro_batch_size,
        zero_stage=parallel.zero_stage if "zero_stage" in given else None,
        recompute=(model.recompute or "none") if recompute else None,
        partition_method=parallel.pp_partition_method if "pp_partition_method" in given
        else None,
        virtual=parallel.virtual_size(model.num_layers)
        if "virtual_pipeline_model_parallel_size" in given else None,
        sequence_parallel=parallel.sequence_parallel if "sequence_parallel" in given else None,
        cp=parallel.context_parallel_size if "context_parallel_size" in given else None,
        cp_comm_type=parallel.cp_comm_type,
        zero3_mode=_zero3_mode(parallel) if {"zero3_shard_group", "zero3_secondary_shard"}
        & given else None)


def _zero3_mode(parallel: ParallelConfig) -> str:
    """The planner's name of the ZeRO-3 node mode the flags chose."""
    if parallel.zero3_shard_group == "node":
        return "hybrid"
    return "secondary" if parallel.zero3_secondary_shard == "node" else "flat"


def _complete(cfg: TrainConfig) -> TrainConfig:
    """Placeholders for what changes no layout but validation requires."""
    data, training, optimizer = cfg.data, cfg.training, cfg.optimizer
    if not (data.mock_data or data.data_path or data.data_path_file):
        data = dataclasses.replace(data, mock_data=True)
    elif cfg.model.vocab_size is None:
        raise ConfigError("the plan needs the vocabulary size, which a tokenizer would only "
                          "tell at run time: pass --vocab-size V instead of the data and "
                          "tokenizer flags")
    missing = [name for name in _MODEL if getattr(cfg.model, name) is None]
    if missing:
        raise ConfigError("the plan needs the model: pass --num-layers, --hidden-size, "
                          "--num-attention-heads and --seq-length (missing: "
                          f"{', '.join(field_specs()[name].flag for name in missing)})")
    if training.train_iters is None and training.train_samples is None:
        training = dataclasses.replace(training, train_iters=1)
    if optimizer.lr is None:
        optimizer = dataclasses.replace(optimizer, lr=1.0)
    return dataclasses.replace(cfg, data=data, training=training, optimizer=optimizer)


def main(argv: Sequence[str] | None = None) -> int:
    return run_tool(_run, argv)


def _run(argv: Sequence[str] | None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    planner_parser = _planner_parser()
    if {"-h", "--help"} & set(words):
        planner_parser.parse(["--help"])
    own, rest = _split(words, planner_parser.known_flags())
    args = planner_parser.parse(own)
    cfg, notices = parse_command_line(rest)
    fixed = _fixed(args, cfg, _given(rest))
    cluster = Cluster(args.nodes, args.gpus_per_node, args.gpu_memory_gb, args.gpu_peak_tflops,
                      args.intra_node_gbps, args.inter_node_gbps)
    cfg = _complete(cfg)
    plans = Planner(cfg, cluster).plan(fixed)
    if args.json:
        sys.stdout.write(json.dumps([to_json(plan) for plan in plans], indent=1) + "\n")
        return 0
    lines = [f"notice: {notice}" for notice in notices]
    lines += [summary(plans, cluster, cfg.model, cfg.parallel.memory_headroom),
              table(plans, args.top)]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
