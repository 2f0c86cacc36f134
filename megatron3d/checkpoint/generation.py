"""Text generation from a loaded checkpoint: greedy or sampled, one sequence, one process.

``tools/generate.py`` is a thin command line over this. The whole sequence is run through
the model for every new token (no key/value cache): the models a checkpoint tool meets on a
CPU are small, and the same forward as training keeps generation trivially correct. The
context is the model's ``seq_length`` (the rotary tables and learned positions are built for
it): a prompt plus new tokens longer than that is refused, never silently cut.

The tokenizer recorded in a checkpoint holds the paths training was given, which may be
relative to where training ran; ``resolve_tokenizer`` takes flag overrides for them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron3d.checkpoint.standalone import LoadedModel
from megatron3d.data.tokenizer import Tokenizer, TokenizerSpec, build_tokenizer
from megatron3d.errors import ConfigError

TOKENIZER_FLAGS = ("--tokenizer-type", "--tokenizer-model", "--vocab-file", "--merge-file",
                   "--tokenizer-name-or-path")
DEFAULT_SEED = 1234


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked: the argmax when neither ``top_k`` nor ``temperature``
    is set; otherwise a draw from the ``top_k`` most likely tokens (all when None) at
    ``temperature`` (1 when None), from a generator seeded with ``seed``."""

    top_k: int | None = None
    temperature: float | None = None
    seed: int = DEFAULT_SEED

    @property
    def greedy(self) -> bool:
        return self.top_k is None and self.temperature is None


GREEDY = Sampling()


def generate(loaded: LoadedModel, prompt: Sequence[int], max_new_tokens: int | None = None,
             *, eod: int | None = None, sampling: Sampling = GREEDY) -> list[int]:
    """The token ids that follow ``prompt``: ``max_new_tokens`` of them (default: until the
    context is full), fewer when ``eod`` comes (it is not returned). ConfigError for ids
    outside the vocabulary or a request longer than the context."""
    vocab, context = loaded.config.model.vocab_size, loaded.config.model.seq_length
    _check_request(list(prompt), max_new_tokens, vocab, context)
    if sampling.top_k is not None and sampling.top_k > vocab:
        raise ConfigError(f"--top-k {sampling.top_k} exceeds the vocabulary ({vocab} tokens); "
                          f"give at most {vocab}")
    budget = context - len(prompt) if max_new_tokens is None else max_new_tokens
    generator = torch.Generator().manual_seed(sampling.seed)
    tokens = torch.tensor([list(prompt)], dtype=torch.long)  # [1, s]
    new: list[int] = []
    for _ in range(budget):
        last = loaded.logits(tokens)[0, -1]  # [V]
        token = _pick(last, sampling, generator)
        if token == eod:
            break
        new.append(token)
        tokens = torch.cat([tokens, torch.tensor([[token]])], dim=1)
    return new


def _check_request(prompt: list[int], max_new_tokens: int | None, vocab: int,
                   context: int) -> None:
    if not prompt:
        raise ConfigError("the prompt is empty (no tokens): give at least one token")
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise ConfigError(f"prompt token id {bad} is outside the model's vocabulary "
                          f"[0, {vocab}); give ids below {vocab}")
    wanted = len(prompt) + (max_new_tokens or 1)
    if wanted > context:
        room = context - len(prompt)
        fix = (f"give --max-new-tokens {room} or less" if room > 0
               else f"shorten the prompt to at most {context - 1} tokens")
        raise ConfigError(f"the prompt ({len(prompt)} tokens) plus the new tokens "
                          f"({max_new_tokens or 1}) exceed the model's context of {context} "
                          f"tokens (--seq-length at training): {fix}")


def _pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """One token id from the last position's logits [V]."""
    if sampling.greedy:
        return int(logits.argmax())
    scaled = logits / (sampling.temperature or 1.0)
    if sampling.top_k is not None:
        kept, ids = scaled.topk(sampling.top_k)
        return int(ids[torch.multinomial(kept.softmax(-1), 1, generator=generator)])
    return int(torch.multinomial(scaled.softmax(-1), 1, generator=generator))


def continuation_text(tokenizer: Tokenizer, prompt: Sequence[int], new: Sequence[int]) -> str:
    """The text ``new`` adds after ``prompt``, with the spacing it has in context (tokenizers
    such as SentencePiece drop a leading space when a piece is decoded alone)."""
    before = tokenizer.detokenize(prompt)
    full = tokenizer.detokenize([*prompt, *new])
    return full[len(before):] if full.startswith(before) else tokenizer.detokenize(new)


def resolve_tokenizer(loaded: LoadedModel, overrides: dict[str, str | None]) -> Tokenizer | None:
    """The run's tokenizer, with ``overrides`` (TokenizerSpec field -> value; None = not
    given) replacing what the checkpoint recorded; None when it has none and none is given.

    A ``tokenizer_type`` other than the recorded one starts from that type alone. A recorded
    tokenizer that cannot be loaded (a relative path from elsewhere, a moved file) is a
    one-line ConfigError naming the flags that override it.
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    recorded = loaded.tokenizer
    kind = given.get("tokenizer_type")
    if recorded is not None and kind in (None, recorded.tokenizer_type):
        spec = dataclasses.replace(recorded, **given)
    elif kind is not None:
        spec = TokenizerSpec(**given)
    elif given:
        raise ConfigError(f"the checkpoint records no tokenizer, so {_flag(next(iter(given)))} "
                          "needs --tokenizer-type too")
    else:
        return None
    if spec.tokenizer_type == "NullTokenizer" and spec.vocab_size is None:
        spec = dataclasses.replace(spec, vocab_size=loaded.config.model.vocab_size - 1)
    unused = spec.unused_flags()
    if unused:
        raise ConfigError(f"--tokenizer-type {spec.tokenizer_type} does not use {unused[0]}; "
                          "drop it")
    try:
        tokenizer = build_tokenizer(spec)
    except ConfigError as err:
        if given:
            raise
        raise ConfigError(f"the checkpoint's tokenizer cannot be loaded ({err}); its paths are "
                          "the ones training was given, maybe relative to where it ran: pass "
                          f"them again with {', '.join(TOKENIZER_FLAGS[1:])}") from None
    _check_vocabulary(tokenizer, loaded.config.model.vocab_size)
    return tokenizer


def _check_vocabulary(tokenizer: Tokenizer, vocab: int) -> None:
    """A tokenizer of another size is not the run's: its ids would mean other tokens."""
    if tokenizer.vocab_size != vocab:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model was "
                          f"trained with {vocab}: give the tokenizer the run was trained with")


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")
