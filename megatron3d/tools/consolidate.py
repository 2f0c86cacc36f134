"""Write a megatron3d checkpoint (any saved layout) as one fp32 safetensors file.

    python tools/checkpoint/consolidate.py --load ckpt --output model.safetensors

The file holds every weight under its logical name (e.g. ``layers.3.mlp.fc1.weight``), with
the vocabulary padding dropped and tied weights once; its metadata records the iteration and
the model configuration. It is written one tensor at a time, so memory stays near the
largest tensor whatever the model's size. Load it with ``safetensors.torch.load_file``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from megatron3d.cli.common import OneLineParser, check_output_path, run_tool
from megatron3d.convert.consolidate import consolidate
from megatron3d.convert.streaming import PeakMemory, peak_text, size_text
from megatron3d.log import get_logger, setup_logging

logger = get_logger("consolidate")


def main(argv: Sequence[str] | None = None) -> int:
    return run_tool(_run, argv)


def _run(argv: Sequence[str] | None) -> int:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="checkpoint directory (a run's --save)")
    p.add_argument("--output", required=True, help="new .safetensors file")
    args = p.parse(argv)
    setup_logging(0, 0)
    peak = PeakMemory()
    check_output_path(args.output, "--output")
    report = consolidate(args.load, args.output)
    logger.info("wrote %d tensors (%s) to %s; %s", report.tensors,
                size_text(report.total_bytes), report.output,
                peak_text(peak.growth, f"largest tensor {size_text(report.largest_bytes)}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
