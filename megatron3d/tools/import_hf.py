"""Import a Hugging Face transformers model as a megatron3d checkpoint to continue pre-training.

GPT-2, BLOOM, Llama 2/3.x (grouped-query attention, llama3 RoPE scaling), Mistral, Qwen2/2.5.

    python tools/checkpoint/import_hf.py --hf hf/my-model --save ckpt \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    torchrun ... pretrain_gpt.py --load ckpt --save ckpt --use-checkpoint-args ...

The checkpoint is iteration 0 (weights in fp32; Adam starts fresh) and loads at any layout;
the layout given here is checked against the model before anything is written.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from megatron3d.cli.common import OneLineParser, add_int, run_tool
from megatron3d.config.ranges import AT_LEAST_ONE, SIZE
from megatron3d.convert.hf.from_hf import import_hf
from megatron3d.convert.streaming import PeakMemory, peak_text, size_text
from megatron3d.log import get_logger, setup_logging

logger = get_logger("import_hf")


def main(argv: Sequence[str] | None = None) -> int:
    return run_tool(_run, argv)


def _run(argv: Sequence[str] | None) -> int:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf", required=True, help="Hugging Face model directory")
    p.add_argument("--save", required=True, help="new checkpoint directory")
    add_int(p, "--tensor-model-parallel-size", AT_LEAST_ONE, "layout to check", default=1)
    add_int(p, "--pipeline-model-parallel-size", AT_LEAST_ONE, "layout to check", default=1)
    add_int(p, "--seq-length", SIZE, "training sequence length; default the model's "
            "max_position_embeddings (2048 for BLOOM)")
    args = p.parse(argv)
    setup_logging(0, 0)
    peak = PeakMemory()
    written, layer = import_hf(args.hf, args.save, args.tensor_model_parallel_size,
                               args.pipeline_model_parallel_size, args.seq_length)
    logger.info("wrote %s: train it with pretrain_gpt.py --load %s --use-checkpoint-args; %s",
                written, args.save, peak_text(peak.growth, f"largest layer {size_text(layer)}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
