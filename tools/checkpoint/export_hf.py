"""Export a megatron3d checkpoint (any saved TP/PP/DP/ZeRO layout) to Hugging Face transformers.

    python tools/checkpoint/export_hf.py --load ckpt --output hf/my-model

writes config.json and safetensors shards (one per layer, fp32, vocabulary padding dropped)
for GPT2LMHeadModel, BloomForCausalLM or LlamaForCausalLM, whichever holds the model; then
loads the result with transformers and compares its logits with megatron3d's own forward
(``--no-verify`` skips that). Needs ``pip install -e '.[hf]'``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron3d.checkpoint.hf_export import export, verify  # noqa: E402
from megatron3d.cli import OneLineParser, run_tool  # noqa: E402
from megatron3d.errors import TrainingError  # noqa: E402
from megatron3d.log import get_logger, setup_logging  # noqa: E402

logger = get_logger("export_hf")
_TOLERANCE = 1e-4  # of the largest |logit|: fp32 sums in another order differ by ~1e-6


def main(argv: Sequence[str] | None = None) -> int:
    return run_tool(_run, argv)


def _run(argv: Sequence[str] | None) -> int:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="checkpoint directory (a run's --save)")
    p.add_argument("--output", required=True, help="new directory for the transformers model")
    p.add_argument("--no-verify", action="store_true",
                   help="skip loading the export with transformers and comparing logits")
    args = p.parse(argv)
    setup_logging(0, 0)
    report = export(args.load, args.output)
    gib = 2.0**30
    logger.info("wrote %d tensors to %s; peak tensor memory %.3f GiB (largest tensor %.3f GiB)",
                report.tensors, report.output, report.peak_bytes / gib, report.largest_bytes / gib)
    if args.no_verify:
        return 0
    agreement = verify(args.load, report.output)
    logger.info("transformers vs megatron3d logits: max abs difference %.3g (largest |logit| "
                "%.3g), top-1 agreement %.1f%%", agreement.max_abs_diff,
                agreement.max_abs_logit, 100 * agreement.top1_agreement)
    if agreement.max_abs_diff > _TOLERANCE * max(1.0, agreement.max_abs_logit):
        raise TrainingError(f"the export in {report.output} does not reproduce the "
                            f"checkpoint's logits (max abs difference "
                            f"{agreement.max_abs_diff:.3g}): please report this")
    return 0


if __name__ == "__main__":
    sys.exit(main())
