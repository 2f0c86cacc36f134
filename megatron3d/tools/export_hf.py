"""Export a megatron3d checkpoint (any saved TP/PP/DP/ZeRO layout) to Hugging Face transformers.

    python tools/checkpoint/export_hf.py --load ckpt --output hf/my-model

writes config.json and safetensors shards (one per layer, fp32, vocabulary padding dropped)
for GPT2LMHeadModel, BloomForCausalLM, LlamaForCausalLM (``--model-type mistral``:
MistralForCausalLM) or Qwen2ForCausalLM, whichever holds the model; then
loads the result with transformers and compares its logits with megatron3d's own forward
(``--no-verify`` skips that). Everything is checked before anything is written, and a
failure part-way (the verification included) leaves nothing behind. Needs
``pip install -e '.[hf]'``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from megatron3d.cli.common import OneLineParser, check_output_path, run_tool
from megatron3d.convert.hf.mapping import ARCHITECTURES
from megatron3d.convert.hf.to_hf import export, plan_export
from megatron3d.convert.streaming import peak_text, size_text
from megatron3d.log import get_logger, setup_logging

logger = get_logger("export_hf")


def main(argv: Sequence[str] | None = None) -> int:
    return run_tool(_run, argv)


def _run(argv: Sequence[str] | None) -> int:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="checkpoint directory (a run's --save)")
    p.add_argument("--output", required=True, help="new directory for the transformers model")
    p.add_argument("--no-verify", action="store_true",
                   help="skip loading the export with transformers and comparing logits")
    p.add_argument("--model-type", choices=sorted(ARCHITECTURES),
                   help="the transformers family to write (default: the one the model is, "
                   "llama for the Llama flavour); mistral holds a Llama-flavour model too")
    args = p.parse(argv)
    setup_logging(0, 0)
    plan = plan_export(args.load, args.output, verify=not args.no_verify,
                       family=args.model_type)
    check_output_path(str(plan.output), "--output", prefix=True)  # a directory is fine here
    if plan.transformers is not None:  # its loading bar would sit between our lines
        plan.transformers.utils.logging.disable_progress_bar()
    report = export(plan)
    held = (f"largest layer {size_text(report.largest_layer_bytes)}, largest tensor "
            f"{size_text(report.largest_bytes)}")
    verified = ("" if report.agreement is None else
                f"; {size_text(report.peak_bytes)} with the verification, which holds the "
                "whole model twice (transformers' and megatron3d's)")
    logger.info("wrote %d tensors to %s; %s while writing%s", report.tensors, report.output,
                peak_text(report.written_peak_bytes, held), verified)
    return 0


if __name__ == "__main__":
    sys.exit(main())
