"""Show what a megatron3d checkpoint holds: run state, layout, model flags, tensors.

    python tools/checkpoint/inspect_checkpoint.py --load ckpt [--tensors]

Prints the newest checkpoint's iteration, consumed samples and tokens, series, layout, Adam
step, loss scaler and the model flags that rebuild it; with --tensors also every logical
tensor's shape and the L2 norms of its weight and Adam moments, read one tensor at a time.
(Not named inspect.py: a script of that name shadows the standard library's ``inspect``
module for everything it imports.)
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

from megatron3d.checkpoint.reader import CheckpointReader
from megatron3d.cli.common import OneLineParser, run_tool
from megatron3d.convert.inspection import checked_tensors, summary, tensor_lines
from megatron3d.convert.streaming import PeakMemory, peak_text, size_text
from megatron3d.log import get_logger, setup_logging

logger = get_logger("inspect_checkpoint")


def main(argv: Sequence[str] | None = None) -> int:
    return run_tool(_run, argv)


def _run(argv: Sequence[str] | None) -> int:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="checkpoint directory (a run's --save)")
    p.add_argument("--tensors", action="store_true",
                   help="also list every logical tensor's shape and L2 norms")
    args = p.parse(argv)
    setup_logging(0, 0)
    peak = PeakMemory()
    reader = CheckpointReader.latest(args.load)
    for line in summary(reader):
        logger.info(line)
    if args.tensors:
        wanted = checked_tensors(reader)
        for line in tensor_lines(reader, wanted):
            logger.info(line)
    else:
        wanted = [(name, "weight") for name in reader.names()]
    largest = max((4 * math.prod(reader.shape(name, kind)) for name, kind in wanted), default=0)
    logger.info("%d logical tensors%s; %s", len({name for name, _ in wanted}),
                "" if args.tensors else " (only their descriptions read: --tensors reads them)",
                peak_text(peak.growth, f"largest tensor {size_text(largest)}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
