"""Generate text from a megatron3d checkpoint (any saved layout) in one CPU process.

    python tools/generate.py --load ckpt --prompt "def main(" --max-new-tokens 32
    python tools/generate.py --load ckpt --prompt-ids "5 17 3"   # token ids in and out
    python tools/generate.py --load ckpt --hf hf/my-model --prompt "def main("

Greedy (the argmax) by default; --top-k and/or --temperature sample instead, reproducibly
for one --seed. Prints only the new text (or ids) to stdout. Generation stops at the
end-of-document token or after --max-new-tokens (default: until the model's --seq-length is
full); a longer request is refused. The tokenizer is the one the run trained with; the
tokenizer flags override its recorded paths (needed when they were relative to elsewhere).
With --hf, transformers' ``generate`` runs the checkpoint's export (tools/checkpoint/
export_hf.py) instead of megatron3d's model, still with the run's tokenizer: the way to use
an export whose tokenizer transformers cannot read (SentencePiece).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from megatron3d.checkpoint.reader import CheckpointReader
from megatron3d.cli.common import OneLineParser, add_float, add_int, run_tool
from megatron3d.config import DataConfig
from megatron3d.config.ranges import AT_LEAST_ONE, SEED, SIZE, Range
from megatron3d.convert.standalone import checkpoint_config, load_model
from megatron3d.data.tokenizer import TOKENIZER_TYPES, Tokenizer
from megatron3d.errors import ConfigError
from megatron3d.inference.generation import (
    DEFAULT_SEED,
    Sampling,
    continuation_text,
    generate,
    generate_with_transformers,
    resolve_tokenizer,
)

TEMPERATURE = Range(1e-3)  # logits / T stays finite in fp32 (transformers divides in fp32)
_TOKENIZER_FIELDS = ("tokenizer_model", "vocab_file", "merge_file", "tokenizer_name_or_path")


def main(argv: Sequence[str] | None = None) -> int:
    return run_tool(_run, argv)


def _parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="checkpoint directory (a run's --save)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text to continue (needs the run's tokenizer)")
    prompt.add_argument("--prompt-ids", metavar="IDS",
                        help="whitespace-separated token ids to continue; prints ids")
    p.add_argument("--hf", metavar="HF_DIR",
                   help="generate with transformers from this export of --load (written by "
                   "tools/checkpoint/export_hf.py); the tokenizer is still the run's")
    add_int(p, "--max-new-tokens", SIZE, "Most tokens to generate (default: until the "
            "context is full).")
    add_int(p, "--top-k", AT_LEAST_ONE, "Sample from the K most likely tokens.")
    add_float(p, "--temperature", TEMPERATURE, "Sample with logits divided by T (1 if only "
              "--top-k is given); below 0.001 the draw is the argmax anyway (drop the flag "
              "for greedy), and fp32 logits divided by it would overflow.")
    add_int(p, "--seed", SEED, f"Seed of the sampling generator (default {DEFAULT_SEED}); "
            "sampling only.")
    tokenizer = p.add_argument_group("tokenizer overrides (default: what the run recorded)")
    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(DataConfig)}
    tokenizer.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES,
                           help=helps["tokenizer_type"])
    for field in _TOKENIZER_FIELDS:
        tokenizer.add_argument("--" + field.replace("_", "-"), metavar="PATH", help=helps[field])
    return p


def _run(argv: Sequence[str] | None) -> int:
    args = _parser().parse(argv)
    sampling = Sampling(args.top_k, args.temperature,
                        DEFAULT_SEED if args.seed is None else args.seed)
    if sampling.greedy and args.seed is not None:
        raise ConfigError("--seed applies only to sampling: add --top-k or --temperature, or "
                          "drop --seed for greedy generation")
    if args.hf is None:
        loaded = load_model(args.load)
        cfg = loaded.config
    else:  # the checkpoint gives the tokenizer and the context; transformers, the model
        cfg = checkpoint_config(CheckpointReader.latest(args.load))
    overrides = {f: getattr(args, f) for f in ("tokenizer_type", *_TOKENIZER_FIELDS)}
    tokenizer = resolve_tokenizer(cfg, overrides)
    prompt = _prompt(args, tokenizer)
    eod = None if tokenizer is None else tokenizer.eod
    if args.hf is None:
        new = generate(loaded, prompt, args.max_new_tokens, eod=eod, sampling=sampling)
    else:
        new = generate_with_transformers(args.hf, cfg.model, prompt, args.max_new_tokens,
                                         eod=eod, sampling=sampling)
    if args.prompt_ids is not None:
        sys.stdout.write(" ".join(map(str, new)) + "\n")
    else:
        sys.stdout.write(continuation_text(tokenizer, prompt, new) + "\n")
    return 0


def _prompt(args: argparse.Namespace, tokenizer: Tokenizer | None) -> list[int]:
    if args.prompt_ids is not None:
        return _ids(args.prompt_ids)
    if tokenizer is None:
        raise ConfigError("the checkpoint has no tokenizer (it trained on --mock-data), so "
                          "--prompt cannot be tokenized: give token ids with --prompt-ids "
                          "'1 2 3', or a tokenizer with --tokenizer-type and its files")
    return tokenizer.tokenize(args.prompt)


def _ids(text: str) -> list[int]:
    try:
        return [int(word) for word in text.split()]
    except ValueError:
        raise ConfigError(f"--prompt-ids {text[:40]!r}: expected whitespace-separated whole "
                          "numbers, e.g. --prompt-ids '1 2 3'") from None


if __name__ == "__main__":
    sys.exit(main())
