"""Import a Megatron-Core GPT checkpoint (torch_dist, any TP/PP) as a megatron3d checkpoint.

Megatron-LM's torch_dist format in, a checkpoint to continue pre-training out:

    python tools/checkpoint/import_megatron.py --load mcore-ckpt --save ckpt \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    torchrun ... pretrain_gpt.py --load ckpt --save ckpt --use-checkpoint-args ...

The model comes from the arguments Megatron-LM stored in the checkpoint, or, when any of
pretrain_gpt.py's model flags (--num-layers, --hidden-size, ...) are given, from those flags
alone (the way in when the arguments cannot be read safely); every stored tensor's shape is
checked against it before anything is written. Model weights only: iteration 0, fp32, Adam
starts fresh. Megatron itself is not needed: torch.distributed.checkpoint reads the files.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from megatron3d.cli.arguments import build_parser
from megatron3d.cli.common import OneLineParser, add_int, run_tool
from megatron3d.config.ranges import AT_LEAST_ONE
from megatron3d.convert.megatron import from_mcore
from megatron3d.convert.streaming import PeakMemory, peak_text, size_text
from megatron3d.log import get_logger, setup_logging

logger = get_logger("import_megatron")


def main(argv: Sequence[str] | None = None) -> int:
    return run_tool(_run, argv)


def _run(argv: Sequence[str] | None) -> int:
    p = OneLineParser(description=__doc__.splitlines()[0],
                      epilog="Model flags: those of pretrain_gpt.py --help's model section.")
    p.add_argument("--load", required=True, help="Megatron-LM checkpoint directory (holding "
                   "latest_checkpointed_iteration.txt) or one iter_* directory")
    p.add_argument("--save", required=True, help="new checkpoint directory")
    add_int(p, "--tensor-model-parallel-size", AT_LEAST_ONE, "layout to check", default=1)
    add_int(p, "--pipeline-model-parallel-size", AT_LEAST_ONE, "layout to check", default=1)
    args, rest = p.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    flags = vars(build_parser().parse(rest))
    setup_logging(0, 0)
    peak = PeakMemory()
    directory = from_mcore.iteration_dir(Path(args.load))
    from_mcore.check_backend(directory)
    model = from_mcore.model_config(directory, flags)
    written, layer = from_mcore.import_megatron(model, directory, args.save,
                                                  args.tensor_model_parallel_size,
                                                  args.pipeline_model_parallel_size)
    logger.info("wrote %s: train it with pretrain_gpt.py --load %s --use-checkpoint-args; %s",
                written, args.save, peak_text(peak.growth, f"largest layer {size_text(layer)}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
