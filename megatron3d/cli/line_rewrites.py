"""Rewrites of a Megatron command line that read several of its flags together (the per-flag
table is ``compat.py``): Megatron-LM's tokenizer names, and what BLOOM's DeepSpeed stage 0
meant."""

from __future__ import annotations

from collections.abc import Sequence

TOKENIZER_TYPES = {"HuggingFaceTokenizer": "PretrainedFromHF",
                   "Llama2Tokenizer": "SentencePieceTokenizer",
                   "GPTSentencePieceTokenizer": "SentencePieceTokenizer"}
"""Megatron-LM's tokenizer types -> megatron3d's; a HuggingFaceTokenizer's --tokenizer-model
(a directory or name) is megatron3d's --tokenizer-name-or-path."""


def tokenizer_spelling(args: list[str], notices: list[str]) -> list[str]:
    """Megatron-LM's --tokenizer-type (and, for Hugging Face, its --tokenizer-model) rewritten,
    with one notice saying how."""
    words = [w for a in args for w in (a.split("=", 1) if a.startswith("--tokenizer-") else [a])]
    if "--tokenizer-type" not in words[:-1]:
        return args
    at = words.index("--tokenizer-type")
    theirs = words[at + 1]
    if theirs not in TOKENIZER_TYPES:
        return args
    shown = ["--tokenizer-type", theirs]
    words[at + 1] = TOKENIZER_TYPES[theirs]
    becomes = ["--tokenizer-type", words[at + 1]]
    if theirs == "HuggingFaceTokenizer" and "--tokenizer-model" in words[:-1]:
        model = words.index("--tokenizer-model")
        shown += words[model:model + 2]
        words[model] = "--tokenizer-name-or-path"
        becomes += words[model:model + 2]
    notices.append(f"{' '.join(shown)}: read as {' '.join(becomes)} (Megatron-LM's name)")
    return words


_DEEPSPEED_FLAGS = {"--deepspeed", "--deepspeed_config", "--deepspeed-config",
                    "--deepspeed-activation-checkpointing", "--deepspeed_mpi"}


def deepspeed_stage_0(argv: Sequence[str]) -> list[str]:
    """BLOOM's ZERO_STAGE=0 with bf16 meant DeepSpeed's bf16 optimizer, which shards the
    optimizer states: here that is ZeRO-1, and stage 0 would hold them whole on every rank."""
    words = [w for a in argv for w in a.split("=", 1)]
    stage = words[words.index("--zero-stage") + 1:][:1] if "--zero-stage" in words else []
    if stage != ["0"] or "--bf16" not in words or not _DEEPSPEED_FLAGS & set(words):
        return []
    return ["--zero-stage 0 with --bf16 and DeepSpeed flags: DeepSpeed's bf16 optimizer "
            "sharded the optimizer states over data-parallel ranks, as ZeRO-1 does, where "
            "megatron3d's stage 0 keeps them whole on every rank (at 176B that runs out of "
            "memory): --zero-stage 1 is the equivalent"]
