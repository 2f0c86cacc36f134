"""Rewrite a megatron3d checkpoint for another parallel layout, offline in one CPU process.

    python tools/checkpoint/reshape.py --load ckpt --save ckpt_tp4 \
        --tensor-model-parallel-size 4 --pipeline-model-parallel-size 1
    torchrun --nproc-per-node 4 pretrain_gpt.py --load ckpt_tp4 --save ckpt_tp4 ...

The result holds the same run (weights, Adam moments and step, iteration, consumed samples,
loss scaler, series) as the newest checkpoint in --load, laid out as a run at the target
layout writes it: one rank file per target rank. The target is checked against the model
before anything is written, and --save must hold no checkpoint. Any layout also loads any
checkpoint directly; reshape when the files should match the layout they will be used at.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from megatron3d.cli.common import OneLineParser, add_int, run_tool
from megatron3d.config.ranges import AT_LEAST_ONE
from megatron3d.convert.contents import ZERO_STAGES
from megatron3d.convert.relayout import reshape
from megatron3d.convert.streaming import PeakMemory, peak_text, size_text
from megatron3d.log import get_logger, setup_logging

logger = get_logger("reshape")


def main(argv: Sequence[str] | None = None) -> int:
    return run_tool(_run, argv)


def _run(argv: Sequence[str] | None) -> int:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="checkpoint directory (a run's --save)")
    p.add_argument("--save", required=True, help="new checkpoint directory")
    add_int(p, "--tensor-model-parallel-size", AT_LEAST_ONE, "Target TP size.", required=True)
    add_int(p, "--pipeline-model-parallel-size", AT_LEAST_ONE, "Target PP size.",
            required=True)
    add_int(p, "--data-parallel-size", AT_LEAST_ONE, "Target DP size.", default=1)
    p.add_argument("--zero-stage", type=int, choices=ZERO_STAGES,
                   help="Target ZeRO stage. Default: the saved run's.")
    p.add_argument("--pp-partition-method", metavar="METHOD",
                   help="How the target pipeline stages are cut (uniform, parameters or "
                   "type:REGEX). Default: the saved run's.")
    args = p.parse(argv)
    setup_logging(0, 0)
    peak = PeakMemory()
    report = reshape(args.load, args.save, args.tensor_model_parallel_size,
                     args.pipeline_model_parallel_size, args.data_parallel_size,
                     args.zero_stage, args.pp_partition_method)
    layout = report.layout
    logger.info("wrote %s: %d logical tensors in %d rank files (TP %d, PP %d, DP %d, ZeRO-%d); "
                "%s", report.checkpoint, report.tensors, layout.world_size, layout.tp,
                layout.pp, layout.dp, layout.zero_stage,
                peak_text(peak.growth, "largest target pipeline stage with its optimizer "
                          f"state: {size_text(report.largest_stage_bytes)}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
