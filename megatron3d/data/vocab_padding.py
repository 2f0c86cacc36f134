"""The rule of ``--pad-vocab-size-to`` (BLOOM's exact padded vocabulary), kept with the data
because it needs the tokenizer's vocabulary: validation asks it before any process starts,
and the run again once the tokenizer is read."""

from __future__ import annotations

from megatron3d.errors import ConfigError


def check_vocab_padding(pad_to: int | None, tp: int, vocab: int | None) -> None:
    """``pad_to`` rows must split evenly over ``tp`` ranks and hold ``vocab`` tokens (the
    tokenizer's vocabulary; ``None`` while it is not read yet)."""
    if pad_to is None:
        return
    if pad_to % tp:
        raise ConfigError(f"--pad-vocab-size-to {pad_to} is not divisible by the tensor-parallel "
                          f"size (--pad-vocab-size-to={pad_to}, --tensor-model-parallel-size="
                          f"{tp}): give a multiple of {tp}, e.g. {-(-pad_to // tp) * tp}")
    if vocab is not None and pad_to < vocab:
        raise ConfigError(f"--pad-vocab-size-to {pad_to} is below the vocabulary of {vocab} "
                          f"tokens (--pad-vocab-size-to={pad_to}): give at least {vocab}, or "
                          "drop it to pad to a multiple of --make-vocab-size-divisible-by x TP")
